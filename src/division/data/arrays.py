"""Small image datasets held as uint8 arrays in memory, batched and augmented as whole tensors.

Sources, tried in order: a class-folder tree (``train/`` and ``test/``, one folder per class), a ``.tar.gz``
of such a tree, torchvision's pickled CIFAR batches, and (if allowed) torchvision's download. Decoded arrays
are cached as .npy files so the second load takes seconds.
"""
import hashlib
import io
import os
import tarfile
from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np
import torch

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm")


class DataNotFoundError(FileNotFoundError):
    """Raised with a message that names every path searched and how to get the data."""


def _decode(data: bytes) -> np.ndarray:
    from PIL import Image
    with Image.open(io.BytesIO(data)) as img:
        return np.asarray(img.convert("RGB"), dtype=np.uint8)


def _stack(images: List[np.ndarray], where: str) -> np.ndarray:
    shapes = {im.shape for im in images}
    if len(shapes) != 1:
        raise ValueError(f"images under {where} have different sizes {sorted(shapes)[:4]}; "
                         "resize them to one size first")
    return np.stack(images)


def read_folder_tree(root: Path, split: str) -> Tuple[np.ndarray, np.ndarray, List[str]]:
    """Read ``root/split/<class>/<image>``; classes are the sorted folder names."""
    base = root / split
    classes = sorted(p.name for p in base.iterdir() if p.is_dir())
    images, labels = [], []
    for label, cls in enumerate(classes):
        for f in sorted((base / cls).iterdir()):
            if f.suffix.lower() in IMAGE_SUFFIXES:
                images.append(_decode(f.read_bytes()))
                labels.append(label)
    if not images:
        raise DataNotFoundError(f"no images under {base}")
    return _stack(images, str(base)), np.asarray(labels, dtype=np.int64), classes


def read_tar_tree(archive: Path, split: str) -> Tuple[np.ndarray, np.ndarray, List[str]]:
    """Read ``.../<split>/<class>/<image>`` members of a .tar.gz, at any depth inside it."""
    found = []
    with tarfile.open(archive, "r:*") as tar:
        for member in tar:
            if not member.isfile():
                continue
            parts = Path(member.name).parts
            if len(parts) < 3 or parts[-3] != split or Path(parts[-1]).suffix.lower() not in IMAGE_SUFFIXES:
                continue
            found.append((parts[-2], parts[-1], tar.extractfile(member).read()))
    if not found:
        raise DataNotFoundError(f"no {split}/<class>/<image> members in {archive}")
    classes = sorted({cls for cls, _, _ in found})
    index = {c: i for i, c in enumerate(classes)}
    found.sort(key=lambda t: (index[t[0]], t[1]))
    images = [_decode(data) for _, _, data in found]
    labels = np.asarray([index[cls] for cls, _, _ in found], dtype=np.int64)
    return _stack(images, str(archive)), labels, classes


def read_cifar_pickles(folder: Path, split: str):
    """torchvision's CIFAR-10 (data_batch_*, test_batch) or CIFAR-100 (train, test) python batches."""
    import pickle
    if (folder / "test_batch").is_file():
        files = [f"data_batch_{i}" for i in range(1, 6)] if split == "train" else ["test_batch"]
        label_key, meta, names_key = "labels", "batches.meta", "label_names"
    else:
        files = ["train"] if split == "train" else ["test"]
        label_key, meta, names_key = "fine_labels", "meta", "fine_label_names"
    images, labels = [], []
    for name in files:
        with open(folder / name, "rb") as fh:
            entry = pickle.load(fh, encoding="latin1")
        images.append(np.asarray(entry["data"], dtype=np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
        labels.extend(entry[label_key])
    classes = [str(i) for i in range(int(max(labels)) + 1)]
    if (folder / meta).exists():
        with open(folder / meta, "rb") as fh:
            classes = pickle.load(fh, encoding="latin1")[names_key]
    return np.concatenate(images), np.asarray(labels, dtype=np.int64), classes


def _cached(cache_dir: Optional[Path], source: Path, split: str, reader):
    """Decode once; later loads read .npy files keyed by the source's path, size and modification time."""
    if cache_dir is None:
        return reader()
    stat = source.stat()
    tag = hashlib.sha1(f"{source.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{split}".encode()).hexdigest()[:16]
    x_path, y_path, c_path = (cache_dir / f"{tag}.{part}.npy" for part in ("x", "y", "classes"))
    if x_path.exists() and y_path.exists() and c_path.exists():
        return np.load(x_path), np.load(y_path), list(np.load(c_path))
    x, y, classes = reader()
    cache_dir.mkdir(parents=True, exist_ok=True)
    for path, arr in ((x_path, x), (y_path, y), (c_path, np.asarray(classes))):
        tmp = path.with_name(path.name + f".tmp{os.getpid()}.npy")
        np.save(tmp, arr)
        os.replace(tmp, path)
    return x, y, classes


def load_split(root: Path, split: str, candidates: List[str], download: bool,
               cache_dir: Optional[Path], torchvision_name: str):
    """Find the data under ``root`` (see module docstring) and return (images NHWC uint8, labels, classes)."""
    searched = []
    for name in candidates:
        path = root / name
        searched.append(str(path))
        if name.endswith((".tar.gz", ".tgz", ".tar")) and path.is_file():
            return _cached(cache_dir, path, split, lambda: read_tar_tree(path, split))
        if (path / "train").is_dir() and (path / "test").is_dir():
            return _cached(cache_dir, path / split, split, lambda: read_folder_tree(path, split))
        if (path / "test_batch").is_file() or (path / "test").is_file():
            return read_cifar_pickles(path, split)
    if download:
        import torchvision
        cls = getattr(torchvision.datasets, torchvision_name)
        try:
            ds = cls(str(root), train=(split == "train"), download=True)
            return np.asarray(ds.data), np.asarray(ds.targets, dtype=np.int64), list(ds.classes)
        except Exception as err:  # network failures come in many types
            searched.append(f"download into {root} failed: {type(err).__name__}: {err}")
    raise DataNotFoundError(
        f"{torchvision_name} data not found. Searched:\n  " + "\n  ".join(searched) +
        f"\nGet it by one of: set data.root (or the DATA_DIR environment variable) to a folder holding one of "
        f"{candidates}; or allow data.download=true with network access.")


def recompress_jpeg(images: np.ndarray, quality: int) -> np.ndarray:
    """``images`` (N, H, W, 3 uint8) encoded once more as JPEG at ``quality`` (Pillow, 4:2:0 chroma) and decoded:
    a controlled extra dose of JPEG loss, for measuring how much a recipe's accuracy depends on it (the
    shipped CIFAR-10 copy is itself JPEG at quality 75)."""
    from PIL import Image
    if not (isinstance(quality, (int, np.integer)) and 1 <= int(quality) <= 95):
        raise ValueError(f"data.jpeg_quality={quality!r} is invalid; valid choices: null (images as stored) or "
                         "an integer from 1 to 95")
    out = np.empty_like(images)
    for i, image in enumerate(images):
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="JPEG", quality=int(quality), subsampling=2)
        out[i] = _decode(buffer.getvalue())
    return out


def stratified_subset(labels: np.ndarray, per_class: int, seed: int) -> np.ndarray:
    """Indices of ``per_class`` images of each class, chosen by a seeded permutation (0 = all)."""
    if per_class <= 0:
        return np.arange(len(labels))
    rng = np.random.default_rng(seed)
    keep = []
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        keep.append(rng.permutation(idx)[:per_class])
    return np.sort(np.concatenate(keep))


class TensorLoader:
    """Batches from in-memory uint8 images with vectorized augmentation (padded random crop, horizontal flip)
    and normalization. ``rank``/``world_size`` shard the order like DistributedSampler; ``set_epoch`` reshuffles.
    ``device``: the whole dataset is held there as one uint8 tensor and batches are cut and augmented there (no
    worker processes, no copies per batch); the random draws stay on the CPU generator, so a run's batches are
    the same on every device. ``pad_mode``: ``constant`` (zeros) or ``reflect`` padding for the crop."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, batch_size: int, mean, std, train: bool,
                 pad: int = 4, flip: bool = True, seed: int = 0, rank: int = 0, world_size: int = 1,
                 drop_last: Optional[bool] = None, size: Optional[int] = None, device=None,
                 pad_mode: str = "constant"):
        if pad_mode not in ("constant", "reflect"):
            raise ValueError(f"data.pad_mode={pad_mode!r} is invalid; valid choices: ['constant', 'reflect']")
        self.device = torch.device(device or "cpu")
        self.pad_mode = pad_mode
        self.images = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).contiguous().to(self.device)
        self.labels = torch.from_numpy(labels).to(self.device)
        self.batch_size, self.train, self.pad, self.flip = batch_size, train, pad if train else 0, flip and train
        self.mean = torch.tensor(mean, dtype=torch.float32, device=self.device).view(1, -1, 1, 1) * 255
        self.std = torch.tensor(std, dtype=torch.float32, device=self.device).view(1, -1, 1, 1) * 255
        self.seed, self.rank, self.world_size, self.epoch = seed, rank, world_size, 0
        self._skip = 0
        self.drop_last = train if drop_last is None else drop_last
        self.num_samples = -(-len(self.labels) // world_size)
        native = self.images.shape[-1]
        self.size = None if size in (None, native) else int(size)  # resized per batch (bilinear), not stored

    def set_epoch(self, epoch: int):
        self.epoch = epoch

    def sample_images(self, n: int) -> torch.Tensor:
        """``n`` training images drawn at random (seeded by the loader's seed), normalized, without augmentation,
        for data-dependent initialisation (a whitening layer's filters). Not the first ``n`` in stored order:
        folder trees are stored class by class, and CIFAR-10's first 5,000 are then all airplanes, whose patch
        covariance whitens the other classes poorly."""
        n = min(int(n), len(self.labels))
        idx = torch.randperm(len(self.labels), generator=torch.Generator().manual_seed(self.seed))[:n]
        return (self.images[idx.to(self.device)].float() - self.mean) / self.std

    def skip_batches(self, n: int):
        """The next pass starts at batch ``n`` of this epoch, with the same images and augmentation the full
        pass gives from there (a run resumed mid-epoch continues exactly)."""
        self._skip = int(n)

    def _order(self) -> torch.Tensor:
        n = len(self.labels)
        if self.train:
            g = torch.Generator().manual_seed(self.seed * 100003 + self.epoch)
            order = torch.randperm(n, generator=g)
        else:
            order = torch.arange(n)
        total = self.num_samples * self.world_size
        if total > n:
            order = torch.cat([order, order[: total - n]])
        return order[self.rank:total:self.world_size]

    def __len__(self):
        if self.drop_last:
            return max(1, self.num_samples // self.batch_size)
        return -(-self.num_samples // self.batch_size)

    def __iter__(self):
        order = self._order()
        g = torch.Generator().manual_seed(self.seed * 7919 + self.epoch + 1)
        start, self._skip = self._skip, 0
        for b in range(len(self)):
            idx = order[b * self.batch_size:(b + 1) * self.batch_size].to(self.device)
            if b < start:  # draw what the skipped batch would have drawn, and nothing else
                for _ in range(2 if self.pad else 0):  # dy, dx: the very calls below
                    torch.randint(0, 2 * self.pad + 1, (len(idx),), generator=g)
                if self.flip:
                    torch.rand(len(idx), generator=g)
                continue
            x = self.images[idx].float()
            if self.pad:
                n, c, h, w = x.shape
                x = torch.nn.functional.pad(x, (self.pad,) * 4, mode=self.pad_mode)
                dy = torch.randint(0, 2 * self.pad + 1, (n,), generator=g).to(self.device)
                dx = torch.randint(0, 2 * self.pad + 1, (n,), generator=g).to(self.device)
                padded_w = x.shape[3]
                at = torch.arange(max(h, w), device=self.device)
                rows = (dy.view(n, 1, 1, 1) + at[:h].view(1, 1, h, 1)).expand(n, c, h, padded_w)
                x = x.gather(2, rows)
                cols = (dx.view(n, 1, 1, 1) + at[:w].view(1, 1, 1, w)).expand(n, c, h, w)
                x = x.gather(3, cols)
            if self.flip:
                flip = (torch.rand(x.shape[0], generator=g) < 0.5).to(self.device)
                x = torch.where(flip.view(-1, 1, 1, 1), x.flip(3), x)
            if self.size is not None:
                x = torch.nn.functional.interpolate(x, size=(self.size, self.size), mode="bilinear",
                                                    align_corners=False, antialias=self.size < x.shape[-1])
            yield (x - self.mean) / self.std, self.labels[idx]
