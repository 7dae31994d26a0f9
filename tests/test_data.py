import pickle
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import compose
from division import data as data_lib
from division.data.arrays import DataNotFoundError, recompress_jpeg, stratified_subset

CLASSES = ["cat", "dog", "emu"]


def _make_tree(root, per_class=4, size=8, fmt="png"):
    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        for cls in CLASSES:
            folder = root / split / cls
            folder.mkdir(parents=True)
            for i in range(per_class):
                Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(folder / f"{i:04d}.{fmt}")


def _cfg(root, tmp_path, **extra):
    overrides = [f"data.root={root}", "data.num_classes=3", "data.batch_size=4", "data.download=false", "data.image_size=8",
                 f"paths.root_dir={tmp_path}"] + [f"data.{k}={v}" for k, v in extra.items()]
    return compose(overrides).data


def test_class_folder_tree(tmp_path):
    _make_tree(tmp_path / "cifar10")
    train, test, info = data_lib.build(_cfg(tmp_path, tmp_path))
    assert (info.train_size, info.test_size, info.num_classes) == (12, 12, 3)
    x, y = next(iter(train))
    assert x.shape == (4, 3, 8, 8) and x.dtype == torch.float32 and set(y.tolist()) <= {0, 1, 2}
    assert sum(len(yb) for _, yb in test) == 12


def test_other_image_size_resizes_each_batch(tmp_path):
    """data.image_size different from the stored images: batches are resized on the fly (the ImageNet ViT on
    CIFAR-10 at 224), and the info reports the size the model sees."""
    _make_tree(tmp_path / "cifar10")
    train, test, info = data_lib.build(_cfg(tmp_path, tmp_path, image_size=24))
    assert info.image_size == 24
    for loader in (train, test):
        x, _ = next(iter(loader))
        assert x.shape[-2:] == (24, 24) and torch.isfinite(x).all()
    with pytest.raises(ValueError, match="data.image_size=0"):
        data_lib.build(_cfg(tmp_path, tmp_path, image_size=0))


def test_tar_gz_and_cache(tmp_path):
    src = tmp_path / "src"
    _make_tree(src / "CIFAR-10-images", fmt="jpg")
    archive = tmp_path / "cifar10_jpeg.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(src / "CIFAR-10-images", arcname="CIFAR-10-images")
    cfg = _cfg(tmp_path, tmp_path, subset=2)
    train, _, info = data_lib.build(cfg)
    assert info.train_size == 6  # 2 per class, stratified
    assert list((tmp_path / "data" / "cache").glob("*.x.npy"))
    train2, _, _ = data_lib.build(cfg)  # second load: from the cache
    assert torch.equal(train.images, train2.images)


def test_cifar_pickles(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        entry = {"data": rng.integers(0, 255, (6, 3072), dtype=np.uint8), "labels": [0, 1, 2, 0, 1, 2]}
        with open(folder / name, "wb") as fh:
            pickle.dump(entry, fh)
    with open(folder / "batches.meta", "wb") as fh:
        pickle.dump({"label_names": CLASSES}, fh)
    train, test, info = data_lib.build(_cfg(tmp_path, tmp_path, image_size=32))
    assert info.train_size == 30 and info.test_size == 6 and info.image_size == 32


def test_missing_data_error_names_paths(tmp_path):
    with pytest.raises(DataNotFoundError) as err:
        data_lib.build(_cfg(tmp_path / "empty", tmp_path))
    msg = str(err.value)
    assert "Searched" in msg and "cifar10_jpeg.tar.gz" in msg and "DATA_DIR" in msg


def test_stratified_subset():
    labels = np.repeat(np.arange(5), 10)
    idx = stratified_subset(labels, 3, seed=0)
    assert np.bincount(labels[idx]).tolist() == [3] * 5


def test_sharded_loader_disjoint(tmp_path):
    _make_tree(tmp_path / "cifar10", per_class=8)
    cfg = _cfg(tmp_path, tmp_path)
    a, _, _ = data_lib.build(cfg, rank=0, world_size=2)
    b, _, _ = data_lib.build(cfg, rank=1, world_size=2)
    ia, ib = set(a._order().tolist()), set(b._order().tolist())
    assert not ia & ib and len(ia | ib) == 24


def test_real_cifar10_subset(real_data_dir, tmp_path):
    cfg = compose([f"data.root={real_data_dir}", "data.subset=20", "data.batch_size=50",
                   "data.test_subset=10"]).data
    train, test, info = data_lib.build(cfg)
    assert info.train_size == 200 and info.test_size == 100 and info.num_classes == 10
    x, y = next(iter(train))
    assert x.shape == (50, 3, 32, 32)
    assert abs(x.mean().item()) < 0.5 and 0.5 < x.std().item() < 1.5


def test_imagenet_folder_subsets(tmp_path):
    """ImageNet as ImageFolder train/ and val/: subset and test_subset both keep per-class counts."""
    _make_tree(tmp_path / "imagenet", per_class=4, size=40, fmt="jpg")
    (tmp_path / "imagenet" / "test").rename(tmp_path / "imagenet" / "val")
    cfg = compose([f"data.root={tmp_path}", "data=imagenet", "data.num_classes=3", "data.image_size=32",
                   "data.batch_size=2", "data.eval_batch_size=5", "data.workers=0", "data.subset=2",
                   "data.test_subset=1", f"paths.root_dir={tmp_path}"]).data
    train, test, info = data_lib.build(cfg)
    assert (info.train_size, info.test_size) == (6, 3)
    x, y = next(iter(train))
    assert x.shape == (2, 3, 32, 32)
    labels = torch.cat([yb for _, yb in test])
    assert sorted(labels.tolist()) == [0, 1, 2]


def test_loader_resumed_part_way_gives_the_rest_of_the_epoch_exactly(tmp_path):
    """A run resumed mid-epoch must see the very batches (images, crops, flips) the full pass gives there."""
    _make_tree(tmp_path / "cifar10", per_class=8)
    train, _, _ = data_lib.build(_cfg(tmp_path, tmp_path), seed=3)
    assert train.pad and train.flip
    train.set_epoch(2)
    full = list(train)
    train.set_epoch(2)
    assert data_lib.skip_batches(train, 2)
    rest = list(train)
    assert len(rest) == len(full) - 2 > 0
    for (x, y), (x_ref, y_ref) in zip(rest, full[2:]):
        assert torch.equal(x, x_ref) and torch.equal(y, y_ref)
    assert len(list(train)) == len(full)  # the skip holds for one pass only


def test_imagenet_sampler_resumes_part_way(tmp_path):
    _make_tree(tmp_path / "imagenet", per_class=4, size=40, fmt="jpg")
    (tmp_path / "imagenet" / "test").rename(tmp_path / "imagenet" / "val")
    cfg = compose([f"data.root={tmp_path}", "data=imagenet", "data.num_classes=3", "data.image_size=32",
                   "data.batch_size=2", "data.workers=0", f"paths.root_dir={tmp_path}"]).data
    train, _, _ = data_lib.build(cfg, seed=1)
    train.sampler.set_epoch(1)
    full = [y.tolist() for _, y in train]
    assert data_lib.skip_batches(train, 2)
    assert [y.tolist() for _, y in train] == full[2:]
    assert not data_lib.skip_batches([(torch.zeros(1), torch.zeros(1))], 1)


def test_jpeg_quality_recompresses_train_and_test(tmp_path):
    """data.jpeg_quality: both splits hold exactly the stored images after one more JPEG pass at that quality
    (Pillow's codec is deterministic), and not the stored images themselves."""
    _make_tree(tmp_path / "cifar10", size=16)
    plain_train, plain_test, _ = data_lib.build(_cfg(tmp_path, tmp_path, image_size=16))
    train, test, _ = data_lib.build(_cfg(tmp_path, tmp_path, image_size=16, jpeg_quality=50))
    for plain, dosed in ((plain_train, train), (plain_test, test)):
        stored = plain.images.permute(0, 2, 3, 1).numpy()
        expected = torch.from_numpy(recompress_jpeg(stored, 50)).permute(0, 3, 1, 2)
        assert torch.equal(dosed.images, expected)
        assert not torch.equal(dosed.images, plain.images)
        assert torch.equal(dosed.labels, plain.labels)


def test_jpeg_quality_is_a_dose():
    """Lower quality loses more: the mean absolute change grows as the quality falls."""
    rng = np.random.default_rng(1)
    smooth = np.cumsum(rng.integers(-8, 9, (20, 32, 32, 3)), axis=2).clip(0, 255).astype(np.uint8)
    error = [np.abs(recompress_jpeg(smooth, q).astype(int) - smooth).mean() for q in (95, 75, 50, 20)]
    assert error == sorted(error) and error[0] < error[-1]


@pytest.mark.parametrize("quality", [0, 96, 7.5, "high"])
def test_jpeg_quality_rejects_bad_values(quality):
    with pytest.raises(ValueError, match="jpeg_quality.*valid choices"):
        recompress_jpeg(np.zeros((1, 8, 8, 3), np.uint8), quality)
