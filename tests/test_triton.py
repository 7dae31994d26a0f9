"""The Triton kernels (the CUDA path) against the pure-PyTorch reference. Without a GPU they run under
Triton's interpreter on CPU tensors (tests/conftest.py sets TRITON_INTERPRET=1), on small shapes."""
import math

import pytest
import torch
import torch.nn.functional as F

from division.codecs import BitMask, BlpaCodec, DivisionCodec, GroupwiseCodec, PerChannelCodec
from division.codecs.quant import quantize_rows_triton
from division.codecs.tokens import ChannelCodec
from division.kernels import triton_codecs

pytestmark = pytest.mark.skipif(not triton_codecs.available(torch.device("cuda" if torch.cuda.is_available()
                                                                          else "cpu")),
                                reason="Triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

CODECS = {
    "division": lambda b, bits=2: DivisionCodec(hfc_bits=bits, backend=b),
    "division_b4": lambda b, bits=2: DivisionCodec(block_size=4, hfc_bits=bits, backend=b),
    "per_channel": lambda b, bits=2: PerChannelCodec(bits=bits, backend=b),
    "groupwise": lambda b, bits=2: GroupwiseCodec(bits=bits, group_size=64, backend=b),
    "blpa": lambda b, bits=4: BlpaCodec(bits=bits, backend=b),
    "mesa": lambda b, bits=8: ChannelCodec(bits=bits, backend=b),
}


@pytest.fixture(params=["one tile", "tiles of 16"])
def tile(request, monkeypatch):
    """Rows in one program each, or cut into tiles of 16 elements: the multi-tile path (statistics pass,
    then codes) that long rows take at GPU sizes, exercised on small tensors."""
    if request.param == "tiles of 16":
        monkeypatch.setattr(triton_codecs, "DEFAULT_TILE", 16)
    return request.param


def _packed_parts(p):
    """The tensors a codec's output holds, in order, without the Triton-only NaN/Inf flags."""
    return [t for t in p.tensors() if t is not None and t.dtype != torch.int8]


@pytest.mark.parametrize("name", sorted(CODECS))
@pytest.mark.parametrize("shape", [(2, 3, 16, 16), (1, 5, 7, 7), (2, 3, 13, 17)])
def test_triton_equals_reference_when_deterministic(name, shape, tile):
    """With nearest rounding the Triton kernels compute what the reference computes, bit for bit: the same
    LFC, statistics (IEEE division), codes (ties to even) and decoded values, on one tile or many."""
    torch.manual_seed(0)
    x = torch.randn(shape, device=DEVICE)
    ref_codec, tri_codec = CODECS[name]("reference"), CODECS[name]("triton")
    ref_codec.stochastic = tri_codec.stochastic = False
    ref, tri = ref_codec.encode(x), tri_codec.encode(x)
    if ref.kind == "bf16":
        pytest.skip("held in bf16: no codec runs")
    assert tri.backend == "triton" and ref.backend == "reference"
    flags = sum(t.numel() for t in tri.tensors() if t is not None and t.dtype == torch.int8)
    assert tri.nbytes() == ref.nbytes() + flags
    for a, b in zip(_packed_parts(tri), _packed_parts(ref), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert torch.equal(tri.decode(), ref.decode())


@pytest.mark.parametrize("name", ["division", "division_b4", "per_channel", "groupwise"])
@pytest.mark.parametrize("shape", [(1, 5, 7, 7), (2, 3, 13, 17)])
def test_triton_stochastic_rounding_is_unbiased(name, shape):
    """Stochastic rounding draws its own numbers, so codes differ from the reference's; the statistics do not,
    each code is the floor or the ceiling of the exact level, and the mean of many decodes converges to x."""
    torch.manual_seed(0)
    x = torch.randn(shape, device=DEVICE)
    ref_codec, tri_codec = CODECS[name]("reference"), CODECS[name]("triton")
    ref, tri = ref_codec.encode(x), tri_codec.encode(x)
    stats = [(a, b) for a, b in zip(_packed_parts(tri), _packed_parts(ref), strict=True) if a.dtype != torch.uint8]
    assert stats and all(torch.equal(a, b) for a, b in stats)  # all but the codes
    ref_codec.stochastic = False
    nearest = ref_codec.encode(x).decode()
    y = tri.decode()
    step = (y - nearest).abs().max().item()
    scale_max = (tri.hfc.scale if hasattr(tri, "hfc") else tri.q.scale).max().item()
    assert step <= scale_max * (1 + 1e-6), (step, scale_max)
    draws = 30  # the interpreter runs a program per tile in Python: few draws, but of whole tensors (the
    # multi-tile path shares this rounding code; its statistics are checked exactly in the test above)
    decoded = [tri_codec.encode(x).decode() for _ in range(draws)]
    err = sum((d - x).pow(2).mean() for d in decoded).item() / draws
    mean = sum(decoded) / draws
    assert (mean - x).pow(2).mean().sqrt() < 4 * math.sqrt(err / draws)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_half_precision_inputs(dtype):
    torch.manual_seed(0)
    x = torch.randn(2, 4, 12, 12, device=DEVICE).to(dtype)
    p = DivisionCodec(hfc_bits=4, backend="triton").encode(x)
    y = p.decode()
    assert y.dtype == dtype and y.shape == x.shape
    step = p.hfc.scale.view(2, 4, 1, 1)
    assert ((y.float() - x.float()).abs() <= step * 1.01 + 0.02 * x.float().abs() + 1e-2).all()


def test_triton_flags_nonfinite_maps_without_a_host_sync(tile):
    """A map holding NaN or Inf is flagged on the device and decodes as NaN; every other map is untouched
    (on one tile, and when the flag comes from one of a row's several tiles)."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8, device=DEVICE)
    x[0, 1, 2, 2] = float("nan")
    x[1, 2, 5, 5] = float("inf")
    for codec in (DivisionCodec(backend="triton"), PerChannelCodec(backend="triton")):
        y = codec.encode(x).decode()
        bad = torch.zeros(2, 3, dtype=torch.bool)
        bad[0, 1] = bad[1, 2] = True
        per_map = torch.isnan(y).flatten(2).all(2).cpu()
        assert torch.equal(per_map, bad)
        assert torch.isfinite(y[~bad.to(y.device)]).all()


@pytest.mark.parametrize("n", [1, 7, 8, 29, 1024 + 3])
def test_triton_relu_mask_exact(n):
    torch.manual_seed(0)
    y = torch.randn(n, device=DEVICE)
    y[0] = float("nan")
    if n > 2:
        y[1], y[2] = -0.0, 0.0
    tri, ref = BitMask.positive(y, "triton"), BitMask.encode(y > 0)
    assert tri.backend == "triton" and torch.equal(tri.packed, ref.packed)
    g = torch.randn(n, device=DEVICE)
    assert torch.equal(tri.apply(g), torch.where(y > 0, g, torch.zeros((), device=DEVICE)))


def test_training_step_on_the_triton_path():
    """Every compressing method trains a step with backend=triton; the report says which backend ran."""
    import torch.nn as nn
    from division.methods import build, load_config
    for name in ("division", "actnn", "blpa", "division_plus", "wrpn"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
                              nn.Conv2d(4, 6, 3), nn.BatchNorm2d(6), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                              nn.Flatten(), nn.Linear(6, 10)).to(DEVICE)
        method = build({**load_config(name), "backend": "triton"})
        method.prepare(model)
        x, y = torch.randn(2, 3, 16, 16, device=DEVICE), torch.randint(0, 10, (2,), device=DEVICE)
        with method.accounting(model) as acc:
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        assert torch.isfinite(loss)
        assert set(acc.report.backends) == {"triton"}, acc.report.backends
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_triton_backend_without_triton_device_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(triton_codecs, "available", lambda device: False)
    with pytest.raises(RuntimeError, match="backend='triton'"):
        DivisionCodec(backend="triton").encode(torch.randn(1, 2, 8, 8))


def _split_codecs(x, stochastic):
    split = BitMask.encode(x * 2 + 0.3 > 0)
    codecs = [DivisionCodec(block_size=4, backend=b, stat_dtype="bf16", stochastic=stochastic)
              for b in ("triton", "reference")]
    return split, codecs


@pytest.mark.parametrize("shape", [(1, 5, 7, 7), (2, 3, 13, 17)])
def test_triton_split_ranges_and_bf16_statistics_exact(shape, tile):
    """division_plus's codec on the Triton path: two ranges per map chosen by an exact mask, bf16 statistics
    rounded outward: with nearest rounding the reference's statistics, codes and decode exactly."""
    torch.manual_seed(0)
    x = torch.randn(shape, device=DEVICE)
    split, (tri_codec, ref_codec) = _split_codecs(x, stochastic=False)
    tri, ref = tri_codec.encode(x, split), ref_codec.encode(x, split)
    assert tri.backend == "triton" and tri.hfc.split is split
    assert tri.hfc.minimum.dtype == torch.bfloat16 and tri.hfc.minimum.numel() == 2 * shape[0] * shape[1]
    for a, b in zip(_packed_parts(tri), _packed_parts(ref), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(tri.decode(), ref.decode())


def test_triton_split_ranges_stochastic():
    """With stochastic rounding the statistics are still the reference's; decodes stay within one step of x
    and are unbiased."""
    shape = (2, 3, 13, 17)
    torch.manual_seed(0)
    x = torch.randn(shape, device=DEVICE)
    split, (tri_codec, ref_codec) = _split_codecs(x, stochastic=True)
    tri, ref = tri_codec.encode(x, split), ref_codec.encode(x, split)
    assert torch.equal(tri.hfc.minimum, ref.hfc.minimum) and torch.equal(tri.hfc.scale, ref.hfc.scale)
    y = tri.decode()
    side = split.decode().view(shape[0] * shape[1], -1).long()
    step = tri.hfc.scale.float().view(-1, 2).gather(1, side).view(shape)
    assert ((y - x).abs() <= step * 1.001 + 1e-5).all()
    draws = 40  # the interpreter is slow
    mean = sum(tri_codec.encode(x, split).decode() for _ in range(draws)) / draws
    single = (y - x).pow(2).mean().sqrt()
    assert (mean - x).pow(2).mean().sqrt() < 4 * single / math.sqrt(draws)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_decodes_into_the_dtype_backward_needs(dtype, tile, monkeypatch):
    """Decode writes the activation's dtype directly, zeros of a split included: one tensor of that dtype is
    allocated (no float32 intermediate, no second tensor for the zeros), equal to the reference's float32
    decode cast to that dtype."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 13, 17, device=DEVICE)
    split = BitMask.encode(x > 0)
    codec = DivisionCodec(block_size=4, backend="triton", stochastic=False)
    packed = codec.encode(x, split)
    packed.hfc.zero_unset = True
    packed.dtype = packed.hfc.dtype = dtype
    expected = DivisionCodec(block_size=4, backend="reference", stochastic=False).encode(x, split)
    expected.hfc.zero_unset = True
    allocated = []
    real_empty = torch.empty

    def recording_empty(*args, **kwargs):
        out = real_empty(*args, **kwargs)
        allocated.append(out.dtype)
        return out
    monkeypatch.setattr(torch, "empty", recording_empty)
    y = packed.decode()
    monkeypatch.undo()
    assert y.dtype == dtype and allocated == [dtype], allocated
    want = expected.decode().to(dtype)
    if dtype == torch.bfloat16 and y.device.type == "cpu":
        # Triton's interpreter converts float32 to bf16 by truncation (the GPU rounds to nearest even, as
        # torch does): there the two may differ by one bf16 unit, never more.
        unit = torch.finfo(torch.bfloat16).eps * want.float().abs()
        assert ((y.float() - want.float()).abs() <= unit).all()
    else:
        assert torch.equal(y, want)
    assert (y.float()[x <= 0] == 0).all()


def test_triton_tiles_cover_long_rows(monkeypatch):
    """A row longer than a tile is split over programs: with a 16-element tile, a 1 x 1000 map takes 63
    programs per pass and gives the one-tile result exactly."""
    x = torch.randn(3, 1000, device=DEVICE)
    one = quantize_rows_triton(x, 2, stochastic=False)
    monkeypatch.setattr(triton_codecs, "DEFAULT_TILE", 16)
    assert triton_codecs.tile_size(1000, 4) == 16
    many = quantize_rows_triton(x, 2, stochastic=False)
    for a, b in zip(_packed_parts(one), _packed_parts(many), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(one.bad_rows, many.bad_rows) and not many.bad_rows.any()


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_triton_stochastic_draws_depend_on_position_alone_and_are_independent(bits, monkeypatch):
    """One Philox call serves four positions: the draws must not depend on the tiling (one tile and tiles of
    16 give the same codes for the same seed), and the four positions of a call must round independently.
    Every element sits half way between two levels, so each code is an independent coin: a group of four
    consecutive codes is all equal with probability 1/8 (1 if a call's four outputs were one number)."""
    levels = (1 << bits) - 1
    x = torch.full((2, 4096), 0.5, device=DEVICE)
    x[:, 0], x[:, 1] = 0.0, float(levels)  # range [0, levels]: scale 1, every other element at v = 0.5
    seed = torch.Generator().manual_seed(7)
    one = quantize_rows_triton(x, bits, stochastic=True, generator=seed).decode()
    monkeypatch.setattr(triton_codecs, "DEFAULT_TILE", 16)
    many = quantize_rows_triton(x, bits, stochastic=True, generator=torch.Generator().manual_seed(7)).decode()
    assert torch.equal(one, many)
    codes = one[:, 4:].reshape(-1, 4)
    assert set(codes.unique().tolist()) == {0.0, 1.0}
    all_equal = (codes == codes[:, :1]).all(1).float().mean().item()
    assert 0.06 < all_equal < 0.2, all_equal  # 2046 groups: mean 0.125, standard deviation 0.007


def test_triton_tile_is_capped():
    """Rows of any length run: a program never holds more than DEFAULT_TILE elements (Triton caps a block at
    2^20, and long tiles spill registers)."""
    assert triton_codecs.tile_size(224 * 224 * 512) == triton_codecs.DEFAULT_TILE <= 2 ** 14
    assert triton_codecs.tile_size(49, 4) == 64 and triton_codecs.tile_size(3, 8) == 16


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("n", [5, 37, 1024 + 9])
def test_triton_quantized_relu_matches_reference(n, bits):
    """WRPN's k-bit ReLU on Triton: the reference's values bit for bit (ties to even, NaN kept, infinities
    clamped) and the mask 0 < x < 1."""
    from division.methods.wrpn import quantize_activation, quantized_relu
    torch.manual_seed(0)
    levels = (1 << bits) - 1
    x = torch.rand(n) * 1.6 - 0.3
    ties = (torch.arange(n) % levels + 0.5) / levels
    x[::3] = ties[::3]
    x[0], x[1], x[2], x[3], x[4] = float("nan"), -0.0, 1.0, float("inf"), float("-inf")
    x = x.to(DEVICE)
    y, mask = quantized_relu(x, bits, "triton")
    expected = quantize_activation(x, bits)
    assert mask.backend == "triton"
    assert torch.equal(y.isnan(), expected.isnan()) and torch.equal(y.nan_to_num(), expected.nan_to_num())
    assert torch.equal(mask.packed, BitMask.encode((x > 0) & (x < 1)).packed)


@pytest.mark.parametrize("stochastic", [False, True])
def test_triton_rows_sharing_a_program_change_nothing(stochastic, monkeypatch):
    """Short rows share a program (up to DEFAULT_TILE elements): statistics, codes, flags and decodes are
    those of one row per program, bit for bit, with stochastic rounding too (each row draws from its own
    seed and positions). 37 maps of 7x7 per sample: the rows do not fill the last program, and 49-element
    rows are not whole bytes at 2 bits; one map holds a NaN."""
    torch.manual_seed(0)
    x = torch.randn(3, 37, 7, 7, device=DEVICE)
    x[1, 5, 3, 3] = float("nan")
    split = BitMask.encode(x * 2 + 0.3 > 0)
    assert triton_codecs.rows_per_program(3 * 37, 49, triton_codecs.tile_size(49, 4)) == 64

    def run():
        out = []
        for codec, s in ((DivisionCodec(block_size=4, backend="triton", stochastic=stochastic), None),
                         (DivisionCodec(block_size=4, backend="triton", stat_dtype="bf16",
                                        stochastic=stochastic), split),
                         (PerChannelCodec(bits=4, backend="triton"), None)):
            codec.stochastic = stochastic
            torch.manual_seed(1)
            packed = codec.encode(x, s) if s is not None else codec.encode(x)
            out.append([t.clone() for t in packed.tensors() if t is not None] + [packed.decode()])
        return out

    shared = run()
    monkeypatch.setattr(triton_codecs, "MAX_ROWS", 1)
    alone = run()
    for a_parts, b_parts in zip(shared, alone, strict=True):
        for a, b in zip(a_parts, b_parts, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(shared[0][-1][1, 5]).all() and not torch.isnan(shared[0][-1][0]).any()
