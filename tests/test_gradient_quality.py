"""Gradient quality on a real CIFAR-10 batch through the CIFAR ResNet-18 (skipped without DATA_DIR)."""
import pytest
import torch

from conftest import compose
from division import data as data_lib
from division.analysis import gradient_error, lfc_energy_share, mean_over_layers, weight_grads
from division.methods import build
from division.models import create_model


@pytest.fixture(scope="module")
def batch_and_model():
    import os
    from pathlib import Path
    data_dir = os.environ.get("DATA_DIR")
    if not data_dir or not (Path(data_dir) / "cifar10_jpeg.tar.gz").exists():
        pytest.skip("DATA_DIR is unset or holds no cifar10_jpeg.tar.gz: set DATA_DIR=../shared/datasets")
    cfg = compose([f"data.root={data_dir}", "data.subset=10", "data.batch_size=32"]).data
    train, _, _ = data_lib.build(cfg)
    x, y = next(iter(train))
    torch.manual_seed(0)
    model = create_model("resnet18")
    return model, x, y, weight_grads(model.train(), x, y)


def _err(batch_and_model, **opts):
    model, x, y, ref = batch_and_model
    torch.manual_seed(1)
    return gradient_error(model, build({"name": "division", **opts}), x, y, draws=2, reference=ref)


def test_error_falls_as_bits_rise(batch_and_model):
    errs = {b: _err(batch_and_model, hfc_bits=b) for b in (2, 4, 8)}
    rel = [mean_over_layers(errs[b], "rel_error") for b in (2, 4, 8)]
    cos = [mean_over_layers(errs[b], "cosine") for b in (2, 4, 8)]
    print("bits 2/4/8 rel error", rel, "cosine", cos)
    assert rel[0] > rel[1] > rel[2]
    assert cos[0] < cos[1] < cos[2] and cos[2] > 0.99


def test_block_size_effect_is_measured(batch_and_model):
    """Smaller blocks do not lower the gradient error here (measured 2 bits, blocks 16/8/4/2: 0.525, 0.581,
    0.610, 0.582): reported, not asserted. What must hold at every block size: 4 bits beat 2 bits."""
    rel = {(b, bits): mean_over_layers(_err(batch_and_model, block_size=b, hfc_bits=bits), "rel_error")
           for b in (8, 2) for bits in (2, 4)}
    print("block/bits -> rel error", rel)
    for b in (8, 2):
        assert rel[(b, 4)] < rel[(b, 2)] / 3


def test_lfc_and_plain_quantizer_errors_are_real_measurements(batch_and_model):
    """Which of the two is better is an open question (reported in results/analysis, not asserted); what
    holds for both: a 2-bit error well below the gradient itself, and 4 bits at least 3x better than 2."""
    for lfc in (True, False):
        two = mean_over_layers(_err(batch_and_model, lfc=lfc), "rel_error")
        four = mean_over_layers(_err(batch_and_model, lfc=lfc, hfc_bits=4), "rel_error")
        print(f"lfc={lfc}: weight-gradient relative error 2-bit {two:.4f}, 4-bit {four:.4f}")
        assert 0.0 < two < 0.9 and four < two / 3


def test_energy_share_extremes():
    const = torch.full((1, 2, 16, 16), 3.0)
    assert abs(lfc_energy_share(const, 8) - 1.0) < 1e-6
    checker = (torch.arange(16).view(16, 1) + torch.arange(16).view(1, 16)) % 2 * 2.0 - 1.0
    assert abs(lfc_energy_share(checker.expand(1, 2, 16, 16), 8)) < 1e-6


def test_exact_codec_gives_zero_gradient_error():
    from division.analysis import CodecMethod
    from division.codecs import FullCopy
    torch.manual_seed(0)
    model = create_model("resnet20")
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    errs = gradient_error(model, CodecMethod(lambda t: FullCopy(t)), x, y, draws=1)
    assert max(e["rel_error"] for e in errs.values()) < 1e-5


def test_relu_mask_applies_to_lfc_only_approximation():
    """lfc_only+relu_mask must differ from lfc_only: the mask zeroes the LFC where the ReLU output was 0."""
    import torch.nn as nn
    from division.analysis import CodecMethod, lfc_only
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                          nn.Conv2d(8, 4, 3, padding=1), nn.Flatten(), nn.Linear(4 * 16 * 16, 10))
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
    plain, masked = (gradient_error(model, CodecMethod(lfc_only(8), reuse_relu_mask=r), x, y, draws=1)["3.weight"]
                     for r in (False, True))
    assert masked["rel_error"] < plain["rel_error"]


def test_vit_linear_layers_are_analysed_on_the_patch_grid():
    """In a ViT the analysis follows every linear layer fed tokens (the grid maps DIVISION's codec sees, class
    token left out) besides the patch convolution; an exact codec gives fp's gradients through the token path,
    a 2-bit DIVISION codec does not."""
    from division.analysis import CodecMethod, layer_inputs
    from division.codecs import DivisionCodec, FullCopy
    torch.manual_seed(0)
    model = create_model("vit_cifar")
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    acts = layer_inputs(model, x)
    assert acts["blocks.0.attn.qkv"].shape == (4, 192, 8, 8) and acts["blocks.5.mlp.fc2"].shape == (4, 768, 8, 8)
    assert "patch_embed.proj" in acts and "head" not in acts and len(acts) == 1 + 6 * 4
    exact = gradient_error(model, CodecMethod(lambda t: FullCopy(t)), x, y, draws=1)
    assert set(exact) == {f"{n}.weight" for n in acts}
    assert max(e["rel_error"] for e in exact.values()) < 1e-5
    lossy = gradient_error(model, CodecMethod(DivisionCodec(8, 2).encode), x, y, draws=1)
    assert min(lossy[f"blocks.{i}.mlp.fc1.weight"]["rel_error"] for i in range(5)) > 1e-3
    # the head reads the class token alone, so the last block's per-token layers get gradient from that
    # (exactly held) token only: their error is 0 even through a lossy codec
    assert lossy["blocks.5.mlp.fc1.weight"]["rel_error"] < 1e-5 < lossy["blocks.5.attn.qkv.weight"]["rel_error"]
