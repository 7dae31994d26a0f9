import math

import pytest
import torch

from division.codecs import (BitMask, BlpaCodec, DivisionCodec, GroupwiseCodec, PerChannelCodec, pack_bits,
                             packed_nbytes, unpack_bits)
from division.codecs.division import block_average, upsample_blocks
from division.codecs.quant import expected_quantized_nbytes, quantize_per_row


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("numel", [1, 7, 64, 1001])
def test_pack_roundtrip_and_size(bits, numel):
    codes = torch.randint(0, 1 << bits, (numel,), dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.numel() == packed_nbytes(numel, bits) == math.ceil(numel * bits / 8)
    assert torch.equal(unpack_bits(packed, bits, numel), codes)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_quantized_size_is_analytic_and_error_within_one_step(bits):
    x = torch.randn(12, 300)
    q = quantize_per_row(x, bits)
    assert q.nbytes() == expected_quantized_nbytes(12, 300, bits)
    step = (x.amax(1) - x.amin(1)) / ((1 << bits) - 1)
    err = (q.decode() - x).abs()
    assert (err <= step.unsqueeze(1) * (1 + 1e-5) + 1e-6).all()


def test_division_packed_size_is_analytic():
    x = torch.randn(3, 5, 32, 32)
    p = DivisionCodec(block_size=8, hfc_bits=2).encode(x)
    lfc = 3 * 5 * 4 * 4 * 2  # bf16 block averages
    hfc = 3 * 5 * 32 * 32 * 2 // 8  # 4 codes per byte
    stats = 3 * 5 * 8  # fp32 minimum and scale per (sample, channel)
    assert p.nbytes() == lfc + hfc + stats
    assert p.nbytes() < x.numel() * x.element_size() / 10


def test_division_unbiased():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 16, 16)
    codec = DivisionCodec(block_size=4, hfc_bits=2)
    draws = 400
    mean = sum(codec.encode(x).decode() for _ in range(draws)) / draws
    single = (codec.encode(x).decode() - x).pow(2).mean().sqrt()
    bias = (mean - x).pow(2).mean().sqrt()
    # the error of a mean of n unbiased draws shrinks like 1/sqrt(n); a biased codec's would not
    assert bias < 3 * single / math.sqrt(draws)


@pytest.mark.parametrize("codec", [DivisionCodec(hfc_bits=4), GroupwiseCodec(bits=4), PerChannelCodec(bits=4),
                                   BlpaCodec(bits=8)])
def test_roundtrip_error_is_bounded_and_small(codec):
    """No element is off by more than the tensor's range, and the 4-bit error is well below the signal
    (a decoder returning zeros, or noise, has relative error >= 1)."""
    torch.manual_seed(1)
    x = torch.randn(2, 4, 20, 20)
    y = codec.encode(x).decode()
    assert y.shape == x.shape and y.dtype == x.dtype
    assert (y - x).abs().max().item() <= (x.amax() - x.amin()).item()
    rel = ((y - x).norm() / x.norm()).item()
    assert rel < 0.3, rel


@pytest.mark.parametrize("shape", [(2, 3, 13, 17), (2, 3, 5, 3), (1, 4, 1, 1), (2, 2, 7, 1030), (1, 1, 9, 9),
                                   (1, 2, 8, 24)])
def test_division_shapes(shape):
    x = torch.randn(shape)
    p = DivisionCodec(block_size=8, hfc_bits=8).encode(x)
    y = p.decode()
    assert y.shape == x.shape
    assert (y - x).abs().max() < 0.05 * x.abs().max() + 1e-3


def test_partial_blocks_average_what_they_cover():
    x = torch.arange(2 * 10 * 11, dtype=torch.float32).view(1, 2, 10, 11)
    lfc = block_average(x, (8, 8))
    assert lfc.shape == (1, 2, 2, 2)
    assert torch.allclose(lfc[0, 0, 1, 1], x[0, 0, 8:, 8:].mean())
    assert torch.allclose(lfc[0, 1, 0, 1], x[0, 1, :8, 8:].mean())
    up = upsample_blocks(lfc, (8, 8), 10, 11)
    assert up.shape == x.shape and torch.equal(up[0, 0, 9, 10], lfc[0, 0, 1, 1])


def test_channels_last_and_noncontiguous():
    x = torch.randn(2, 3, 16, 16)
    for variant in (x.to(memory_format=torch.channels_last), x.transpose(2, 3), x[:, :, ::2, ::2]):
        y = DivisionCodec(hfc_bits=8).encode(variant).decode()
        assert torch.allclose(y, variant, atol=0.05)


def test_constant_channels_exact_and_nonfinite_kept():
    x = torch.full((2, 3, 8, 8), 3.25)
    for codec in (DivisionCodec(), GroupwiseCodec(), PerChannelCodec(), BlpaCodec()):
        assert torch.equal(codec.encode(x).decode(), x)
    x = torch.randn(2, 3, 16, 16)
    x[0, 0, 0, 0] = float("nan")
    x[1, 2, 5, 5] = float("inf")
    x[1, 1, 3, 3] = float("-inf")
    for codec in (DivisionCodec(), GroupwiseCodec(), PerChannelCodec(), BlpaCodec()):
        y = codec.encode(x).decode()
        assert torch.isnan(y).sum() == 1 and torch.isnan(y[0, 0, 0, 0])
        assert y[1, 2, 5, 5] == float("inf") and y[1, 1, 3, 3] == float("-inf")
        finite = torch.isfinite(x)
        assert torch.isfinite(y[finite]).all()


@pytest.mark.parametrize("kwargs", [{"hfc_bits": 3}, {"hfc_bits": 0}, {"hfc_bits": 16}, {"block_size": 0},
                                    {"lfc_dtype": "int8"}])
def test_bad_division_config(kwargs):
    with pytest.raises(ValueError, match="valid|must be"):
        DivisionCodec(**kwargs)


def test_bitmask_exact():
    m = torch.rand(3, 5, 7) > 0.5
    bm = BitMask.encode(m)
    assert bm.nbytes() == math.ceil(m.numel() / 8)
    assert torch.equal(bm.decode(), m)


@pytest.mark.parametrize("codec", [GroupwiseCodec(bits=8), PerChannelCodec(bits=8), BlpaCodec(bits=8),
                                   DivisionCodec(hfc_bits=8)])
@pytest.mark.parametrize("shape", [(3, 4, 20, 20), (5, 37), (1, 2, 7, 9)])
def test_eight_bit_roundtrip_is_close_for_every_layout(codec, shape):
    torch.manual_seed(0)
    x = torch.randn(shape)
    if x.dim() != 4 and not isinstance(codec, (GroupwiseCodec, BlpaCodec)):
        pytest.skip("per-channel codecs take 4-D maps")
    y = codec.encode(x).decode()
    assert y.shape == x.shape
    assert (y - x).abs().max() <= (x.max() - x.min()) / 255 * 1.01


def _compiled_or_skip():
    from division import kernels
    if not kernels.available():
        pytest.skip("no C compiler: the compiled kernels are optional")


@pytest.mark.parametrize("shape", [(2, 3, 32, 32), (2, 3, 7, 7), (1, 2, 13, 17), (3, 1, 56, 56), (1, 1, 5, 1030),
                                   (2, 3, 14, 14), (2, 5, 11, 9), (1, 2, 20, 3), (1, 2, 28, 28)])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_compiled_kernel_matches_reference(shape, bits):
    """The fused CPU kernel keeps the reference layout: its packed object decodes identically through the
    reference path, its LFC equals the reference LFC, and its error stays within one step."""
    _compiled_or_skip()
    from division.codecs.division import DivisionPacked
    torch.manual_seed(0)
    x = torch.randn(shape)
    ref = DivisionCodec(hfc_bits=bits, backend="reference").encode(x)
    fast = DivisionCodec(hfc_bits=bits, backend="compiled").encode(x)
    assert isinstance(fast, DivisionPacked) and fast.compiled
    assert fast.nbytes() == ref.nbytes()
    assert torch.allclose(fast.lfc.float(), ref.lfc.float(), atol=1e-2, rtol=1e-2)
    y = fast.decode()
    assert torch.allclose(DivisionPacked.decode(dataclass_replace(fast, compiled=False)), y, atol=1e-6)
    step = fast.hfc.scale.view(shape[0], shape[1], 1, 1)
    assert ((y - x).abs() <= step * 1.001 + 1e-5).all()


def dataclass_replace(obj, **kw):
    import dataclasses
    return dataclasses.replace(obj, **kw)


def test_compiled_kernel_unbiased_and_falls_back_on_nonfinite():
    _compiled_or_skip()
    torch.manual_seed(0)
    x = torch.randn(2, 3, 16, 16)
    codec = DivisionCodec(block_size=4, hfc_bits=2, backend="compiled")
    draws = 400
    mean = sum(codec.encode(x).decode() for _ in range(draws)) / draws
    single = (codec.encode(x).decode() - x).pow(2).mean().sqrt()
    assert (mean - x).pow(2).mean().sqrt() < 3 * single / math.sqrt(draws)
    x[0, 0, 0, 0] = float("nan")
    p = codec.encode(x)
    assert not getattr(p, "compiled", False)
    for shape in ((1, 2, 14, 14), (1, 2, 7, 7), (1, 2, 40, 40)):  # narrow, one-block and wide maps
        z = torch.randn(shape)
        z[0, 1, 3, 2] = float("inf")
        kept = DivisionCodec(hfc_bits=2, backend="compiled").encode(z)
        assert not getattr(kept, "compiled", False) and torch.isinf(kept.decode()[0, 1, 3, 2])
    assert torch.isnan(p.decode()).sum() == 1


@pytest.mark.parametrize("n", [1, 7, 8, 29, 4096 + 3])
def test_compiled_relu_mask_matches_reference(n):
    _compiled_or_skip()
    torch.manual_seed(0)
    y = torch.randn(n)
    y[0] = float("nan")
    if n > 2:
        y[1], y[2] = -0.0, 0.0
    fast = BitMask.positive(y)
    ref = BitMask.encode(y > 0)
    assert torch.equal(fast.packed, ref.packed) and fast.nbytes() == ref.nbytes() == -(-n // 8)
    g = torch.randn(n)
    g[-1] = float("nan")
    expected = torch.where(y > 0, g, torch.zeros(()))
    assert torch.equal(fast.apply(g).isnan(), expected.isnan())
    assert torch.equal(fast.apply(g).nan_to_num(), expected.nan_to_num())
    assert torch.equal(ref.apply(g.double()).float().nan_to_num(), (g * (y > 0)).nan_to_num())


ROW_CODECS = [lambda b: DivisionCodec(hfc_bits=2, backend=b), lambda b: PerChannelCodec(bits=2, backend=b),
              lambda b: GroupwiseCodec(bits=2, backend=b), lambda b: BlpaCodec(bits=4, backend=b)]


@pytest.mark.parametrize("make", ROW_CODECS)
def test_reference_backend_never_calls_the_kernel(make, monkeypatch):
    """backend='reference' is pure PyTorch end to end, ReLU masks included."""
    from division import kernels
    from division.codecs.quant import BitMask

    def forbidden():
        raise AssertionError("the compiled kernel was called under backend='reference'")
    monkeypatch.setattr(kernels, "library", forbidden)
    x = torch.randn(2, 3, 16, 16)
    p = make("reference").encode(x)
    assert p.backend == "reference"
    assert p.decode().shape == x.shape
    m = BitMask.positive(x, "reference")
    assert m.backend == "reference" and torch.equal(m.apply(x), x.clamp_min(0))


@pytest.mark.parametrize("make", ROW_CODECS)
@pytest.mark.parametrize("shape", [(2, 3, 16, 16), (1, 3, 7, 7), (3, 5, 9, 13)])
def test_kernel_matches_reference_statistics(make, shape):
    """The compiled kernel against the pure-PyTorch reference: same layout and size, unbiased over many
    draws where the codec rounds stochastically, and an error within a few percent of the reference's."""
    _compiled_or_skip()
    torch.manual_seed(0)
    x = torch.randn(shape)
    ref_codec, fast_codec = make("reference"), make("compiled")
    ref, fast = ref_codec.encode(x), fast_codec.encode(x)
    assert fast.backend == "compiled" and ref.backend == "reference"
    assert fast.nbytes() == ref.nbytes()
    draws = 300
    errs = {}
    for name, codec in (("ref", ref_codec), ("fast", fast_codec)):
        decoded = [codec.encode(x).decode() for _ in range(draws)]
        errs[name] = sum((d - x).pow(2).mean() for d in decoded).item() / draws
        if getattr(codec, "stochastic", getattr(codec, "hfc_bits", None)) is not False:
            mean = sum(decoded) / draws
            assert (mean - x).pow(2).mean().sqrt() < 4 * math.sqrt(errs[name] / draws)
    assert abs(errs["fast"] - errs["ref"]) / errs["ref"] < 0.05, errs


def test_no_compiler_falls_back_to_pytorch(tmp_path):
    """Without a C compiler (CC points nowhere, empty kernel cache) training still runs, on the PyTorch
    path, with one warning, and the result records the backend that ran."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, CC=str(tmp_path / "no-such-cc"), DIVISION_KERNEL_CACHE=str(tmp_path / "cache"))
    cmd = [sys.executable, "train.py", "data=synthetic", "data.train_size=8", "data.test_size=8", "data.batch_size=4",
           "trainer.max_steps=1", "trainer.device=cpu", "trainer.progress=false", f"paths.root_dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "compiled DIVISION kernels unavailable" in proc.stderr
    result = json.loads(next(Path(tmp_path, "outputs", "runs").rglob("result.json")).read_text())
    assert set(result["codec_backends"]) == {"reference"}


def test_extra_kernel_flags_reach_the_compiler(tmp_path):
    """DIVISION_KERNEL_FLAGS (make test-portable) is passed to the compiler: a flag it rejects gives the reference
    path with a warning that says why, not a silently different build."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, DIVISION_KERNEL_FLAGS="-mno-such-flag", DIVISION_KERNEL_CACHE=str(tmp_path / "cache"))
    code = ("import warnings; warnings.simplefilter('always'); from division import kernels; "
            "print('available', kernels.available())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "available False" in proc.stdout and "-mno-such-flag" in proc.stderr


@pytest.mark.parametrize("backend", ["reference", "compiled"])
@pytest.mark.parametrize("make", [lambda b: DivisionCodec(hfc_bits=2, backend=b, stat_dtype="bf16"),
                                  lambda b: PerChannelCodec(bits=2, backend=b, stat_dtype="bf16")])
def test_bf16_statistics_unbiased_and_smaller(make, backend):
    """16-bit per-map statistics: 4 bytes less per map, the stored range covers the map (minimum rounded
    down, scale up), decode uses exactly the stored values, and stochastic rounding stays unbiased."""
    if backend == "compiled":
        _compiled_or_skip()
    torch.manual_seed(0)
    x = torch.randn(2, 3, 7, 7) * 3 + 1
    codec = make(backend)
    p = codec.encode(x)
    q = p.hfc if hasattr(p, "hfc") else p.q
    assert p.backend == backend and q.minimum.dtype == q.scale.dtype == torch.bfloat16
    wide = DivisionCodec(hfc_bits=2, backend=backend) if isinstance(codec, DivisionCodec) else PerChannelCodec(
        bits=2, backend=backend)
    assert wide.encode(x).nbytes() - p.nbytes() == 2 * 3 * 4
    y = p.decode()
    step = q.scale.float().view(2, 3, 1, 1)
    assert ((y - x).abs() <= step * 1.001 + 1e-5).all()
    draws = 300
    mean = sum(codec.encode(x).decode() for _ in range(draws)) / draws
    single = (p.decode() - x).pow(2).mean().sqrt()
    assert (mean - x).pow(2).mean().sqrt() < 4 * single / math.sqrt(draws)


def test_bad_stat_dtype():
    with pytest.raises(ValueError, match="stat_dtype='fp16' is invalid; valid choices"):
        DivisionCodec(stat_dtype="fp16")


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("n", [5, 16, 37, 4096 + 9])
def test_compiled_relu_with_mask_matches_clamp(n, inplace):
    """One pass makes ReLU's output and its mask: values as ``clamp_min(0)`` (NaN kept), mask as ``y > 0``,
    and an in-place call counts as an in-place change (version bumped)."""
    _compiled_or_skip()
    torch.manual_seed(0)
    x = torch.randn(n)
    x[0], x[1], x[2] = float("nan"), -0.0, float("-inf")
    expected = x.clamp_min(0)
    version = x._version
    y, mask = BitMask.relu(x, inplace, "compiled")
    assert mask.backend == "compiled" and (y is x) == inplace and (x._version > version) == inplace
    assert torch.equal(y.isnan(), expected.isnan()) and torch.equal(y.nan_to_num(), expected.nan_to_num())
    assert torch.equal(mask.packed, BitMask.encode(expected > 0).packed)
