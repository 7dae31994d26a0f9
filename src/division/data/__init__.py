"""``build(cfg, seed, rank, world_size) -> (train_loader, test_loader, info)`` for every data config."""
import os
from dataclasses import dataclass
from pathlib import Path
from typing import List

import numpy as np
import torch

from division.data.arrays import (DataNotFoundError, TensorLoader, load_split, recompress_jpeg,
                                  stratified_subset)

DATASETS = ("cifar10", "cifar100", "imagenet", "synthetic")


@dataclass
class DataInfo:
    name: str
    num_classes: int
    image_size: int
    train_size: int
    test_size: int
    source: str


class ResumableSampler(torch.utils.data.distributed.DistributedSampler):
    """DistributedSampler (one replica too: an order fixed by seed and epoch, not by the global random state)
    that can start a pass part-way, for a run resumed mid-epoch; the skipped images are never loaded."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._skip = 0

    def skip_samples(self, n: int):
        self._skip = int(n)

    def __iter__(self):
        start, self._skip = self._skip, 0
        return iter(list(super().__iter__())[start:])


def skip_batches(loader, n: int) -> bool:
    """Make the next pass of a training loader start at batch ``n``; False when the loader cannot."""
    if hasattr(loader, "skip_batches"):
        loader.skip_batches(n)
        return True
    sampler = getattr(loader, "sampler", None)
    if isinstance(sampler, ResumableSampler):
        sampler.skip_samples(n * loader.batch_size)
        return True
    return False


def resolve_root(root) -> Path:
    """data.root, else $DATA_DIR, else ./data."""
    if root in (None, ""):
        root = os.environ.get("DATA_DIR") or "./data"
    return Path(os.path.expanduser(str(root)))


def build(cfg, seed: int = 0, rank: int = 0, world_size: int = 1, device=None):
    """(train loader, test loader, DataInfo). ``device``: where ``data.on_device=true`` keeps the in-memory
    datasets (CIFAR) and augments them."""
    kind = cfg.get("kind", cfg.name)
    if kind not in DATASETS:
        raise ValueError(f"unknown dataset kind {kind!r}; valid choices: {list(DATASETS)}")
    batch = int(cfg.batch_size)
    if batch < 1:
        raise ValueError(f"data.batch_size={batch} is invalid; it must be >= 1")
    for key in ("subset", "test_subset"):
        if int(cfg.get(key) or 0) < 0:
            raise ValueError(f"data.{key}={cfg.get(key)} is invalid; it must be >= 0 (images per class; 0 = all)")
    eval_batch = int(cfg.get("eval_batch_size") or batch)
    if kind == "synthetic":
        return _synthetic(cfg, batch, eval_batch, seed, rank, world_size)
    if kind == "imagenet":
        return _imagenet(cfg, batch, eval_batch, seed, rank, world_size)
    root = resolve_root(cfg.root)
    cache = Path(os.path.expanduser(cfg.cache_dir)) if cfg.get("cache_dir") else None
    candidates: List[str] = list(cfg.candidates)
    loaded = {}
    for split in ("train", "test"):
        loaded[split] = load_split(root, split, candidates, bool(cfg.download), cache,
                                   cfg.torchvision_name)
    (xtr, ytr, classes), (xte, yte, _) = loaded["train"], loaded["test"]
    if len(classes) != int(cfg.num_classes):
        raise ValueError(f"found {len(classes)} classes under {root}, but data.num_classes={cfg.num_classes}")
    keep = stratified_subset(ytr, int(cfg.subset), seed)
    xtr, ytr = xtr[keep], ytr[keep]
    test_subset = int(cfg.get("test_subset", 0) or 0)
    if test_subset:
        keep = stratified_subset(yte, test_subset, seed)
        xte, yte = xte[keep], yte[keep]
    quality = cfg.get("jpeg_quality")
    if quality is not None:  # train and test alike: the same images, one more JPEG pass
        xtr, xte = recompress_jpeg(xtr, quality), recompress_jpeg(xte, quality)
    size = int(xtr.shape[1] if cfg.get("image_size") is None else cfg.image_size)
    if size < 1:
        raise ValueError(f"data.image_size={size} is invalid; it must be >= 1 (the images are {xtr.shape[1]}x{xtr.shape[1]})")
    where = device if cfg.get("on_device", False) else None
    train = TensorLoader(xtr, ytr, batch, cfg.mean, cfg.std, True, int(cfg.crop_padding), True, seed, rank, world_size,
                         size=size, device=where, pad_mode=str(cfg.get("pad_mode", "constant")))
    test = TensorLoader(xte, yte, eval_batch, cfg.mean, cfg.std, False, rank=rank, world_size=world_size, size=size,
                        device=where)
    info = DataInfo(cfg.name, int(cfg.num_classes), size, len(ytr), len(yte), str(cfg.root or root))
    return train, test, info


def _synthetic(cfg, batch, eval_batch, seed, rank, world_size):
    """Random images (a fixed seed) with random labels: for benchmarks and tests, never for accuracy."""
    g = np.random.default_rng(1234 + seed)
    size, classes = int(cfg.image_size), int(cfg.num_classes)
    n_train, n_test = int(cfg.train_size), int(cfg.test_size)
    xtr = g.integers(0, 256, (n_train, size, size, 3), dtype=np.uint8)
    xte = g.integers(0, 256, (n_test, size, size, 3), dtype=np.uint8)
    ytr = g.integers(0, classes, n_train).astype(np.int64)
    yte = g.integers(0, classes, n_test).astype(np.int64)
    mean, std = [0.5] * 3, [0.29] * 3
    train = TensorLoader(xtr, ytr, batch, mean, std, True, 0, False, seed, rank, world_size)
    test = TensorLoader(xte, yte, eval_batch, mean, std, False, rank=rank, world_size=world_size)
    return train, test, DataInfo("synthetic", classes, size, n_train, n_test, "synthetic")


def _imagenet(cfg, batch, eval_batch, seed, rank, world_size):
    """ImageFolder train/ and val/ with torchvision's reference transforms (random-resized crop + flip;
    resize 256 + center crop 224)."""
    import torchvision.transforms as T
    from torchvision.datasets import ImageFolder
    root = resolve_root(cfg.root)
    base = root / cfg.get("folder", "imagenet")
    searched = [base, root]
    where = next((p for p in searched if (p / "train").is_dir() and (p / "val").is_dir()), None)
    if where is None:
        raise DataNotFoundError("ImageNet not found. Searched:\n  " + "\n  ".join(str(p) for p in searched) +
                                "\nImageNet cannot be downloaded automatically: put ILSVRC2012 as ImageFolder "
                                "train/ and val/ (one folder per class) under data.root or $DATA_DIR/imagenet.")
    norm = T.Normalize(cfg.mean, cfg.std)
    size = int(cfg.image_size)
    train_ds = ImageFolder(str(where / "train"), T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(),
                                                             T.ToTensor(), norm]))
    val_ds = ImageFolder(str(where / "val"), T.Compose([T.Resize(int(size * 256 / 224)), T.CenterCrop(size),
                                                         T.ToTensor(), norm]))
    if int(cfg.subset):
        keep = stratified_subset(np.asarray(train_ds.targets), int(cfg.subset), seed)
        train_ds = torch.utils.data.Subset(train_ds, keep.tolist())
    if int(cfg.get("test_subset", 0) or 0):
        keep = stratified_subset(np.asarray(val_ds.targets), int(cfg.test_subset), seed)
        val_ds = torch.utils.data.Subset(val_ds, keep.tolist())
    sampler = ResumableSampler(train_ds, world_size, rank, seed=seed)
    workers = int(cfg.get("workers", 8))
    train = torch.utils.data.DataLoader(train_ds, batch, sampler=sampler,
                                        num_workers=workers, pin_memory=torch.cuda.is_available(), drop_last=True,
                                        persistent_workers=workers > 0)
    val_sampler = (torch.utils.data.distributed.DistributedSampler(val_ds, world_size, rank, shuffle=False)
                   if world_size > 1 else None)
    test = torch.utils.data.DataLoader(val_ds, eval_batch, sampler=val_sampler, num_workers=workers,
                                       pin_memory=torch.cuda.is_available())
    info = DataInfo("imagenet", int(cfg.num_classes), size, len(train_ds), len(val_ds), str(cfg.root or root))
    return train, test, info


__all__ = ["build", "DataInfo", "DataNotFoundError", "ResumableSampler", "resolve_root", "skip_batches", "DATASETS"]
