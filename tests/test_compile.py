"""torch.compile with a compressing method: the model compiled whole, the compiled graph's saved maps encoded
through saved-tensor hooks (division/compress/saved_hooks.py). A small conv net keeps compilation to seconds."""
import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from division import api, engine
from division.methods import build


def small_net():
    def block(c):
        return nn.Sequential(nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(),
                             nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), block(8), block(8),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))


def _step(model, method, x, y):
    """One accounted training step through the engine (the runner's own step): loss, report."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the gradients stay to compare
    out = engine.train_step(model, method, x, y, opt, None, engine.StepState(torch.device("cpu")), account=True)
    return out.loss.item(), out.report


def _relative(a, b):
    ga = torch.cat([p.grad.flatten() for p in a.parameters()])
    gb = torch.cat([p.grad.flatten() for p in b.parameters()])
    return ((ga - gb).norm() / gb.norm()).item()


def _eager_and_compiled(spec, x, y):
    """One accounted step of ``small_net`` under method ``spec``, eager and compiled: (model, loss, report) of
    each, and the compiled run's method."""
    runs, method = [], None
    for compiled in (False, True):
        model, method = small_net(), build(spec)
        method.prepare(model)
        if compiled:
            api.compile_model(model, method)
        runs.append((model, *_step(model, method, x, y)))
    return runs[0], runs[1], method


@pytest.mark.parametrize("fuse_bn_relu", [False, True])
def test_compiled_division_step_matches_eager_without_graph_breaks(fuse_bn_relu):
    """8-bit codes, nearest rounding: the same loss (compression touches only backward; the compiled forward
    sums in its own order, hence float tolerance), gradients near fp's, held bytes within 5 % of eager
    DIVISION's (the issue's bound), no graph break. The codec runs inside the compiled graphs
    (compress/graph_hooks.py). The gradient bound: each rebuilt map is within half a step (range/510) of the
    original, which measured 0.003 of the gradient's norm compiled and 0.006 eager.

    Without fuse_bn_relu ReLU outputs are saved (SaveReluOutputs) with their sign bits, so no map is left in
    bf16 for a mask the backward would recompute from it: with that fallback the compiled graph held 8 % more
    than eager here, 58 % more on ResNet-50. With fuse_bn_relu (ExactReluMasks) a ReLU output after a batch
    norm is not held: its exact mask is ("relu mask", bits), the output rebuilt from the batch norm's encoded
    input, as eager fuse_bn_relu does; before, the compiled graph ignored the option and held 34 % more than
    eager on resnet20."""
    spec = {"name": "division", "hfc_bits": 8, "stochastic": False, "fuse_bn_relu": fuse_bn_relu}
    x, y = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(1)), torch.arange(8) % 10
    ref = small_net()
    F.cross_entropy(ref(x), y).backward()
    (eager, loss_e, report_e), (compiled, loss_c, report_c), m_compiled = _eager_and_compiled(spec, x, y)
    assert api.graph_breaks() == 0
    torch.testing.assert_close(loss_c, loss_e)
    assert _relative(compiled, ref) < 0.01 and _relative(eager, ref) < 0.01
    codecs = {r["codec"] for r in report_c.layers}
    assert ("compiled relu mask" in codecs and "compiled encode + sign bits" not in codecs) if fuse_bn_relu else \
        ("compiled encode + sign bits" in codecs)
    assert "compiled bf16" not in codecs
    assert 0.95 < report_c.held_bytes / report_e.held_bytes < 1.05, (report_c.held_bytes, report_e.held_bytes)
    assert report_c.held_bytes < report_c.fp_bytes / 3


def test_exact_relu_masks_leave_an_uncompressed_step_as_it_was():
    """The pass rewrites each relu(z) as where(z <= 0, 0, z) and the backward's uses of its output as the
    same expression of z and the saved mask: without compression, resnet20 (BN -> ReLU chains and ReLUs after
    residual additions) compiled with it gives compiled fp's loss and gradients bit for bit (the backward
    recomputes the batch norm's output from the convolution's, as the unmodified graph does)."""
    from division.compress.graph_hooks import ExactReluMasks
    from division.models import create_model
    x, y = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(2)), torch.arange(4) % 10
    grads, losses = [], []
    for passes in ({}, {"joint_custom_pre_pass": ExactReluMasks()}):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = create_model("resnet20")
        with torch._inductor.config.patch(**passes):
            loss = F.cross_entropy(torch.compile(model)(x), y)
            loss.backward()
        losses.append(loss.detach())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.equal(losses[1], losses[0]) and torch.equal(grads[1], grads[0])


def test_saved_hooks_keep_signs_exactly():
    """Whether each element is > 0 comes back exactly (1 bit each): a compiled ReLU's backward takes its mask
    from the saved output, and a decoded zero that turned positive would let gradient through."""
    from division.compress.saved_hooks import SavedTensorCodec
    method = build({"name": "division"})
    route = SavedTensorCodec(lambda x: method.choose("conv", x))
    t = torch.relu(torch.randn(4, 8, 16, 16, generator=torch.Generator().manual_seed(0)))
    t[0, 0] = -torch.rand(16, 16)  # a map with both signs
    with route.context():
        saved = route.pack(t)
    back = route.unpack(saved)
    assert torch.equal(back > 0, t > 0)
    assert route.records and route.records[0].fp_bytes == t.numel() * 4


@pytest.mark.parametrize("bad", [0, -3])
def test_saved_hooks_reject_bad_sizes(bad):
    from division.compress.saved_hooks import SavedTensorCodec
    with pytest.raises(ValueError, match="min_map_elems"):
        SavedTensorCodec(lambda x: None, min_map_elems=bad)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_traced_code_packing_round_trips(bits):
    from division.compress.graph_hooks import pack_codes, unpack_codes
    codes = torch.randint(0, 1 << bits, (3, 37), generator=torch.Generator().manual_seed(bits), dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape == (3, -(-37 * bits // 8)) and torch.equal(unpack_codes(packed, bits, 37), codes)


def test_traced_stochastic_rounding_is_unbiased_and_nearest_within_half_a_step():
    """Values 1/3 of a step above a code: stochastic codes average back to them (2e6 draws: the mean's
    standard error is 0.47 / sqrt(2e6) = 3e-4 of a step, the bound 10x that); nearest rounding is within
    half a step everywhere."""
    from division.compress.graph_hooks import dequantize_rows, quantize_rows
    rows = torch.full((2, 1_000_000), 1 / 3)
    rows[:, 0], rows[:, 1] = 0.0, 3.0  # range 3 at 2 bits: a step of 1
    mean = dequantize_rows(*quantize_rows(rows, 2, True), 2, rows.shape[1])[:, 2:].mean().item()
    assert abs(mean - 1 / 3) < 3e-3
    x = torch.randn(4, 999, generator=torch.Generator().manual_seed(0))
    back = dequantize_rows(*quantize_rows(x, 8, False), 8, 999)
    step = (x.amax(1, keepdim=True) - x.amin(1, keepdim=True)) / 255
    assert bool(((back - x).abs() <= step / 2 * (1 + 1e-5) + 1e-6).all())


def test_traced_codec_rejects_bad_settings():
    from division.compress.graph_hooks import TracedCodec
    with pytest.raises(ValueError, match="bits"):
        TracedCodec(bits=3)
    with pytest.raises(ValueError, match="kind"):
        TracedCodec(kind="blpa")


def test_compiled_division_survives_a_change_of_batch_size():
    """An epoch's last, smaller batch recompiles the model. Dynamo would otherwise mark the batch dimension
    dynamic on the second shape, and the traced codec's shapes (taken while tracing the forward) would be
    symbols foreign to the backward's trace; the graph route compiles with static shapes."""
    model, method = small_net(), build({"name": "division"})
    method.prepare(model)
    api.compile_model(model, method)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    state = engine.StepState(torch.device("cpu"))
    for n in (8, 6, 8):
        x = torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(n))
        out = engine.train_step(model, method, x, torch.arange(n) % 10, opt, None, state, account=True)
        assert torch.isfinite(out.loss) and out.report.held_bytes < out.report.fp_bytes / 3
    assert api.graph_breaks() == 0


def test_kernel_operators_decode_as_the_eager_kernel_does():
    """The custom operators run the same C kernel as the eager codec: with nearest rounding (deterministic)
    the rebuilt maps are identical, bit for bit; the fake implementations give the real outputs' shapes and
    dtypes (torch.library.opcheck)."""
    from division.codecs.division import DivisionCodec
    from division.compress import ops  # noqa: F401  (registers the operators)
    if not __import__("division.kernels", fromlist=["available"]).available():
        pytest.skip("no C compiler: the kernel operators are not used")
    x = torch.randn(2, 3, 20, 13, generator=torch.Generator().manual_seed(0))  # partial 8x8 blocks on both sides
    parts = torch.ops.division.encode_maps(x, 2, 8, 8, False)
    back = torch.ops.division.decode_maps(*parts, 2, 20, 13, 8, 8)
    eager = DivisionCodec(hfc_bits=2, stochastic=False, backend="compiled").encode(x).decode()
    assert torch.equal(back, eager)
    torch.library.opcheck(torch.ops.division.encode_maps.default, (x, 2, 8, 8, False))
    torch.library.opcheck(torch.ops.division.decode_maps.default, (*parts, 2, 20, 13, 8, 8))
    torch.library.opcheck(torch.ops.division.decode_maps.default, (*parts, 2, 20, 13, 8, 8, torch.bfloat16))
    assert torch.equal(torch.ops.division.decode_maps(*parts, 2, 20, 13, 8, 8, torch.bfloat16), eager.bfloat16())


def test_kernel_operators_turn_a_map_with_nan_into_nan_only_there():
    """A NaN in one map: that map decodes to NaN throughout (its gradient shows it), the others as if it
    were not there."""
    from division.compress import ops  # noqa: F401
    if not __import__("division.kernels", fromlist=["available"]).available():
        pytest.skip("no C compiler: the kernel operators are not used")
    x = torch.randn(2, 2, 16, 16, generator=torch.Generator().manual_seed(0))
    bad = x.clone()
    bad[1, 0, 3, 5] = float("nan")
    clean = torch.ops.division.decode_maps(*torch.ops.division.encode_maps(x, 4, 8, 8, False), 4, 16, 16, 8, 8)
    back = torch.ops.division.decode_maps(*torch.ops.division.encode_maps(bad, 4, 8, 8, False), 4, 16, 16, 8, 8)
    assert torch.isnan(back[1, 0]).all()
    keep = torch.ones(2, 2, dtype=torch.bool)
    keep[1, 0] = False
    assert torch.equal(back[keep], clean[keep])


def test_compiled_division_uses_the_kernel_operators_on_the_cpu():
    model, method = small_net(), build({"name": "division"})
    method.prepare(model)
    api.compile_model(model, method)
    x = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    _step(model, method, x, torch.arange(8) % 10)
    plans = [p for p in method.saved_tensor_route.plans.values() if p.action == "encode"]
    kernels_built = __import__("division.kernels", fromlist=["available"]).available()
    assert plans and all(p.kernel == kernels_built for p in plans)
    # the route makes the model channels-last on a CPU: every map the graph computes (8 channels: whole bytes
    # per sample) goes through the channels-last operators, none is copied to NCHW for them; the batch itself
    # (a graph input, NCHW) through the NCHW ones
    inner = [p for p in plans if p.producer.startswith("aten.")]
    assert len(inner) == 9 and all(p.channels_last == kernels_built for p in inner)  # 5 conv, 4 ReLU outputs
    assert not any(p.channels_last for p in plans if p not in inner)
    assert next(model.parameters()).is_contiguous(memory_format=torch.channels_last)


def _kernels_or_skip():
    from division.compress import ops  # noqa: F401  (registers the operators)
    if not __import__("division.kernels", fromlist=["available"]).available():
        pytest.skip("no C compiler: the kernel operators are not used")


@pytest.mark.parametrize("shape,block", [((2, 16, 14, 14), 8), ((3, 8, 7, 7), 8), ((2, 24, 31, 31), 16),
                                         ((1, 8, 20, 13), 8)])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_channels_last_operators_encode_as_the_nchw_ones(shape, block, bits):
    """Values that are multiples of 1/8 below 8 in size: every block sum is exact in float32 whatever the
    order of the additions, so the channels-last kernel (channels in the vector lanes) and the NCHW one
    (maps in the lanes) must agree bit for bit: LFC, statistics, rebuilt maps (nearest rounding). The codes
    follow each layout's memory order; the fake implementations give the real outputs' shapes, dtypes and
    strides (opcheck)."""
    _kernels_or_skip()
    n, c, h, w = shape
    x = torch.randint(-64, 64, shape, generator=torch.Generator().manual_seed(0)).float() / 8
    x_cl = x.contiguous(memory_format=torch.channels_last)
    ops = torch.ops.division
    nchw, cl = ops.encode_maps(x, bits, block, block, False), ops.encode_maps_cl(x_cl, bits, block, block, False)
    for a, b in zip([nchw[0], nchw[2], nchw[3]], [cl[0], cl[2], cl[3]]):
        assert torch.equal(a, b)
    back = ops.decode_maps_cl(*cl, bits, h, w, block, block)
    assert back.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(back, ops.decode_maps(*nchw, bits, h, w, block, block))
    torch.library.opcheck(ops.encode_maps_cl.default, (x_cl, bits, block, block, False))
    torch.library.opcheck(ops.decode_maps_cl.default, (*cl, bits, h, w, block, block))


@pytest.mark.parametrize("shape,block", [((2, 64, 20, 20), 8), ((3, 16, 13, 9), 8), ((2, 8, 31, 31), 16)])
def test_channels_last_hfc_range_is_exactly_that_of_x_minus_its_lfc(shape, block):
    """The kernel takes the HFC's range from each block's minimum and maximum of x (one pass): since rounding
    is monotonic, min(x - l) == min(x) - l for the block's one LFC value l. On random floats (no exact
    sums), the stored minimum and scale must still be exactly those of x - upsample(LFC) computed in torch."""
    _kernels_or_skip()
    from division.codecs.division import upsample_blocks
    n, c, h, w = shape
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(7)) * 3 + 1).contiguous(
        memory_format=torch.channels_last)
    lfc, _, minimum, scale = torch.ops.division.encode_maps_cl(x, 2, block, block, False)
    hfc = (x - upsample_blocks(lfc.float(), (block, block), h, w)).reshape(n * c, -1)
    lo, hi = hfc.amin(1), hfc.amax(1)
    assert torch.equal(minimum, lo) and torch.equal(scale, (hi - lo) / 3)


@pytest.mark.parametrize("z_channels_last", [False, True])
@pytest.mark.parametrize("flag", [False, True])
def test_relu_with_mask_keeps_the_layout_and_its_bits_invert_with_the_same_flag(z_channels_last, flag):
    """The ReLU output comes back in z's own layout, and the bits, packed in the order ``flag`` names,
    unpack (as uint8 0 / 1, laid out so) to exactly z > 0, also where Inductor laid z out otherwise than
    traced (flag and layout disagree: the operator's copy path). Exact: a comparison and a maximum."""
    _kernels_or_skip()
    z = torch.randn(2, 16, 6, 10, generator=torch.Generator().manual_seed(8))
    z[0, 0, 0, :3] = 0.0
    z_in = z.contiguous(memory_format=torch.channels_last) if z_channels_last else z
    out, bits = torch.ops.division.relu_with_mask(z_in, flag)
    assert torch.equal(out, torch.relu(z)) and ops_is_channels_last(out) == z_channels_last
    mask = torch.ops.division.unpack_mask_bytes(bits, list(z.shape), flag)
    assert mask.dtype == torch.uint8 and ops_is_channels_last(mask) == flag
    assert torch.equal(mask.bool(), z > 0)
    torch.library.opcheck(torch.ops.division.relu_with_mask.default, (z_in, flag))
    torch.library.opcheck(torch.ops.division.unpack_mask_bytes.default, (bits, list(z.shape), flag))


def ops_is_channels_last(x):
    from division.compress.ops import is_channels_last
    return is_channels_last(x)


def test_channels_last_stochastic_rounding_is_unbiased():
    """2-bit codes, 400 encodes: the mean rebuilt map is within 6 standard errors of the map (each draw errs by
    at most one step, so its standard deviation is at most half a step; the mean's, that over 20)."""
    _kernels_or_skip()
    x = torch.randn(2, 8, 16, 16, generator=torch.Generator().manual_seed(4)).contiguous(
        memory_format=torch.channels_last)
    ops = torch.ops.division
    total = torch.zeros_like(x)
    for _ in range(400):
        parts = ops.encode_maps_cl(x, 2, 8, 8, True)
        total += ops.decode_maps_cl(*parts, 2, 16, 16, 8, 8)
    step = parts[3].view(2, 8, 1, 1)
    assert bool(((total / 400 - x).abs() <= 6 * step / 2 / 20).all())


def test_channels_last_operators_keep_nan_to_its_map():
    _kernels_or_skip()
    ops = torch.ops.division
    x = torch.randn(2, 8, 16, 16, generator=torch.Generator().manual_seed(5)).contiguous(
        memory_format=torch.channels_last)
    bad = x.clone()
    bad[1, 3, 3, 5] = float("nan")
    clean = ops.decode_maps_cl(*ops.encode_maps_cl(x, 4, 8, 8, False), 4, 16, 16, 8, 8)
    back = ops.decode_maps_cl(*ops.encode_maps_cl(bad, 4, 8, 8, False), 4, 16, 16, 8, 8)
    keep = torch.ones(2, 8, dtype=torch.bool)
    keep[1, 3] = False
    assert torch.isnan(back[1, 3]).all() and torch.equal(back[keep], clean[keep])


@pytest.mark.parametrize("channels", [8, 4])  # whole bytes of sign bits per pixel, and not
def test_channels_last_relu_decode_applies_floor_and_mask_as_the_nchw_one(channels):
    """The kernel applies a ReLU output's floor and exact mask as it decodes: positive (at least eps) exactly
    where the output was, exactly 0 elsewhere, and (exact sums, nearest rounding) bit for bit what the NCHW
    operator rebuilds."""
    _kernels_or_skip()
    ops = torch.ops.division
    r = torch.relu(torch.randint(-64, 64, (2, channels, 16, 12), generator=torch.Generator().manual_seed(6)) / 8)
    r_cl = r.contiguous(memory_format=torch.channels_last)
    eps = torch.finfo(torch.float32).eps
    out = ops.decode_relu_maps_cl(*ops.encode_maps_cl(r_cl, 2, 8, 8, False), ops.relu_signs_cl(r_cl), 2, 16, 12,
                                  8, 8, eps)
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(out > 0, r > 0) and bool((out[r > 0] >= eps).all()) and bool((out[r <= 0] == 0).all())
    nchw = ops.decode_relu_maps(*ops.encode_maps(r, 2, 8, 8, False), ops.relu_signs(r), 2, 16, 12, 8, 8, eps)
    assert torch.equal(out, nchw)


def test_relu_maps_come_back_with_their_exact_mask_and_no_denormals():
    """A ReLU output through the kernel operators at 2 bits: positive exactly where it was (at least the
    dtype's epsilon: the smallest normal, used before, made the backward's convolutions multiply denormals,
    5x slower on a CPU), exactly 0 elsewhere; the traced path's with_signs the same."""
    from division.compress import graph_hooks, ops  # noqa: F401
    if not __import__("division.kernels", fromlist=["available"]).available():
        pytest.skip("no C compiler: the kernel operators are not used")
    x = torch.relu(torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(3)))
    parts = torch.ops.division.encode_maps(x, 2, 8, 8, True)
    eps = torch.finfo(torch.float32).eps
    back = torch.ops.division.decode_relu_maps(*parts, torch.ops.division.relu_signs(x), 2, 16, 16, 8, 8, eps)
    assert torch.equal(back > 0, x > 0) and bool((back[x > 0] >= eps).all()) and bool((back[x <= 0] == 0).all())
    decoded = torch.ops.division.decode_maps(*parts, 2, 16, 16, 8, 8)
    traced = graph_hooks.with_signs(decoded, x > 0, torch.float32, relu=True)
    assert torch.equal(traced, back)
    general = graph_hooks.with_signs(decoded, x > 0, torch.float32, relu=False)
    assert torch.equal(general > 0, x > 0) and bool((general[x <= 0] <= 0).all())


def _triton_or_skip():
    from division.kernels import triton_codecs
    if not triton_codecs.available(torch.device("cuda" if torch.cuda.is_available() else "cpu")):
        pytest.skip("Triton is not installed")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tile", [None, 16])
def test_cuda_operators_encode_and_decode_as_the_eager_triton_codec(dtype, tile, monkeypatch):
    """The CUDA implementations of division::encode_maps/decode_maps (the Triton kernels; run here on CPU
    tensors under Triton's interpreter, called directly, since the operators dispatch CPU tensors to the C
    kernel) compute what the eager Triton codec computes: with nearest rounding (deterministic) the same LFC,
    codes and statistics and the same rebuilt map, bit for bit, decoded straight into the map's dtype; also
    with rows cut into tiles of 16 (the two-pass path of long rows)."""
    from division.codecs.division import DivisionCodec
    from division.compress import ops
    from division.kernels import triton_codecs
    _triton_or_skip()
    if tile:
        monkeypatch.setattr(triton_codecs, "DEFAULT_TILE", tile)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(2, 3, 20, 13, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    lfc, packed, minimum, scale = ops._encode_maps_triton(x, 2, 8, 8, False)
    eager = DivisionCodec(hfc_bits=2, stochastic=False, backend="triton").encode(x)
    assert torch.equal(lfc, eager.lfc) and torch.equal(packed, eager.hfc.packed)
    assert torch.equal(minimum, eager.hfc.minimum) and torch.equal(scale, eager.hfc.scale)
    back = ops._decode_maps_triton(lfc, packed, minimum, scale, 2, 20, 13, 8, 8, dtype)
    assert back.dtype == dtype and torch.equal(back, eager.decode())
    assert ops._decode_maps_triton(lfc, packed, minimum, scale, 2, 20, 13, 8, 8).dtype == torch.float32


def test_cuda_operators_turn_a_map_with_nan_into_nan_only_there():
    """As the C kernel's operators: a map that held a NaN gets a NaN minimum and decodes to NaN throughout
    (its gradient shows it); the other maps decode as if it were not there."""
    from division.compress import ops
    _triton_or_skip()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(2, 2, 16, 16, generator=torch.Generator().manual_seed(0)).to(device)
    bad = x.clone()
    bad[1, 0, 3, 5] = float("nan")
    clean = ops._decode_maps_triton(*ops._encode_maps_triton(x, 4, 8, 8, False), 4, 16, 16, 8, 8)
    parts = ops._encode_maps_triton(bad, 4, 8, 8, False)
    assert torch.isnan(parts[2]).tolist() == [False, False, True, False]
    back = ops._decode_maps_triton(*parts, 4, 16, 16, 8, 8)
    keep = torch.ones(2, 2, dtype=torch.bool, device=device)
    keep[1, 0] = False
    assert torch.isnan(back[1, 0]).all() and torch.equal(back[keep], clean[keep])


def test_cuda_relu_operators_keep_the_exact_mask_and_the_floor():
    """division::relu_signs on CUDA packs the same bits as the C kernel's (x > 0, the first element in the low
    bit); decode_relu_maps gives the decoded map floored at the dtype's epsilon where the ReLU's output was
    positive and exactly 0 elsewhere, in the map's dtype."""
    from division.codecs.exact import BitMask
    from division.compress import ops
    _triton_or_skip()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.relu(torch.randn(2, 4, 16, 12, generator=torch.Generator().manual_seed(3))).half().to(device)
    signs = ops._relu_signs_triton(x)
    assert torch.equal(signs.cpu(), BitMask.encode(x.cpu() > 0).packed)
    parts = ops._encode_maps_triton(x, 2, 8, 8, True)
    eps = torch.finfo(torch.float16).eps
    back = ops._decode_relu_maps_triton(*parts, signs, 2, 16, 12, 8, 8, eps, torch.float16)
    decoded = ops._decode_maps_triton(*parts, 2, 16, 12, 8, 8, torch.float16)
    assert back.dtype == torch.float16
    assert torch.equal(back, torch.where(x > 0, decoded.clamp_min(eps), torch.zeros((), dtype=x.dtype,
                                                                                    device=device)))


@pytest.mark.parametrize("backend,kernels", [("auto", True), ("reference", False)])
def test_backend_reference_leaves_the_compiled_codec_traced(backend, kernels):
    """method.backend=reference: the compiled graphs hold the traced codec (Inductor's own kernels), every
    map planned without the kernel operators and the model left NCHW; otherwise the kernel operators where
    the kernel library builds (the choice measured against each other on a GPU by compile_check)."""
    built = __import__("division.kernels", fromlist=["available"]).available()
    model, method = small_net(), build({"name": "division", "backend": backend})
    method.prepare(model)
    api.compile_model(model, method)
    assert method.saved_tensor_route.codec.kernels is kernels
    x = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    _step(model, method, x, torch.arange(8) % 10)
    plans = [p for p in method.saved_tensor_route.plans.values() if p.action == "encode"]
    assert plans and all(p.kernel is (kernels and built) for p in plans)
    assert next(model.parameters()).is_contiguous(memory_format=torch.channels_last) is (kernels and built)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_division_on_cuda_uses_the_triton_operators_and_matches_eager():
    """On a GPU the compiled graphs encode DIVISION's maps through the Triton operators (NCHW, no C kernel's
    channels-last ones): 8-bit nearest codes give the eager step's loss and gradients to float tolerance
    (compiled kernels sum in their own order) and held bytes within 5 %."""
    spec = {"name": "division", "hfc_bits": 8, "stochastic": False}
    x, y = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(1)).cuda(), torch.arange(8).cuda() % 10
    runs = []
    for compiled in (False, True):
        model, method = small_net().cuda(), build(spec)
        method.prepare(model)
        if compiled:
            api.compile_model(model, method)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        out = engine.train_step(model, method, x, y, opt, None, engine.StepState(torch.device("cuda")), account=True)
        runs.append((model, method, out.loss.item(), out.report))
    (eager, _, loss_e, report_e), (compiled, m_c, loss_c, report_c) = runs
    plans = [p for p in m_c.saved_tensor_route.plans.values() if p.action == "encode"]
    assert plans and all(p.kernel and not p.channels_last for p in plans)
    assert api.graph_breaks() == 0
    torch.testing.assert_close(loss_c, loss_e)
    assert _relative(compiled, eager) < 0.01
    assert 0.95 < report_c.held_bytes / report_e.held_bytes < 1.05, (report_c.held_bytes, report_e.held_bytes)


@pytest.mark.parametrize("h,w,bits,pays", [(7, 7, 2, True), (3, 3, 2, True), (2, 2, 2, False), (2, 4, 2, False),
                                           (3, 3, 8, False), (56, 56, 8, True)])
def test_traced_codec_encodes_a_map_only_where_it_takes_fewer_bytes_than_bf16(h, w, bits, pays):
    """ResNet-50's 7x7 maps are encoded (LFC 2 + codes 13 + statistics 8 bytes against bf16's 98): left in
    float32 by the former 64-element floor they were 27.6 MB of a batch-8 step's 84.6 MB held."""
    from division.compress.graph_hooks import TracedCodec
    assert TracedCodec(bits=bits).pays_off(h, w) is pays


def test_cpu_graph_route_keeps_its_layouts_while_compiling():
    """On a CPU the route makes the model channels-last itself and compiles with Inductor's layout
    optimisation off, so that the layouts the hooks planned for are the ones the graph runs, and only there."""
    import torch._inductor.config as inductor_config
    model, method = small_net(), build({"name": "division"})
    method.prepare(model)
    api.compile_model(model, method)
    route = method.saved_tensor_route
    assert route.keep_layouts
    before = inductor_config.layout_optimization
    with route.context():
        assert inductor_config.layout_optimization is False
    assert inductor_config.layout_optimization == before


@pytest.mark.parametrize("name,channels_last", [("division", True), ("actnn", False)])
def test_cpu_route_turns_the_model_channels_last_only_for_the_kernel_codec(name, channels_last):
    """DIVISION's maps go through the channels-last kernel operators; ActNN's groups run along NCHW order
    (its traced codec would copy every channels-last map: 0.41 of compiled fp's speed on resnet20 became 0.32)."""
    kernels_built = __import__("division.kernels", fromlist=["available"]).available()
    model, method = small_net(), build({"name": name})
    method.prepare(model)
    api.compile_model(model, method)
    weight = model[0].weight
    assert weight.is_contiguous(memory_format=torch.channels_last) == (channels_last and kernels_built)
    assert weight.is_contiguous() == (not (channels_last and kernels_built))


def test_compiled_actnn_runs_the_group_kernel_and_matches_eager():
    """ActNN's groups through the C kernel's group operators on a CPU (the traced groups ran at 0.41 of compiled
    fp's speed on resnet20): 8-bit nearest codes give eager ActNN's gradients to float tolerance (the same
    codes of the same maps; the compiled graph sums in its own order) and its held bytes within 1 %."""
    kernels_built = __import__("division.kernels", fromlist=["available"]).available()
    spec = {"name": "actnn", "bits": 8, "stochastic": False}
    x, y = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(1)), torch.arange(8) % 10
    (eager, loss_e, report_e), (compiled, loss_c, report_c), m_compiled = _eager_and_compiled(spec, x, y)
    assert api.graph_breaks() == 0
    torch.testing.assert_close(loss_c, loss_e)
    assert _relative(compiled, eager) < 1e-3
    assert 0.99 < report_c.held_bytes / report_e.held_bytes < 1.01
    plans = [p for p in m_compiled.saved_tensor_route.plans.values() if p.action == "encode"]
    assert len(plans) == 10 and all(p.groups and p.kernel == kernels_built for p in plans)


@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (2, 8, 6, 6), (1, 1, 1, 9)])
@pytest.mark.parametrize("channels_last", [False, True])
def test_mask_operators_pack_in_memory_order_and_unpack_exactly(shape, channels_last):
    """The kernel's mask operators (used for every bool mask a compiled CPU graph saves): bits laid out as
    the traced packing lays out the mask's memory order (so both read each other's bytes), and the mask comes
    back exactly, in its own layout. Odd sizes leave a partial last byte."""
    from division import kernels
    from division.compress import graph_hooks, ops
    if not kernels.available():
        pytest.skip("no C compiler: the traced packing is used")
    mask = torch.rand(shape, generator=torch.Generator().manual_seed(3)) > 0.5
    if channels_last:
        mask = mask.to(memory_format=torch.channels_last)
    packed = torch.ops.division.pack_mask(mask)
    in_memory_order = mask.permute(0, 2, 3, 1) if ops.is_channels_last(mask) else mask
    assert torch.equal(packed, graph_hooks.pack_bools(in_memory_order.contiguous()).reshape(-1))
    back = torch.ops.division.unpack_mask(packed, list(shape), ops.is_channels_last(mask))
    assert back.dtype == torch.bool and torch.equal(back, mask)
    assert ops.is_channels_last(back) == ops.is_channels_last(mask)


def test_unpack_mask_kernel_spreads_every_byte_value():
    """Each of the 256 byte values unpacks to its eight bits (the branch-free spread), and a tail shorter
    than a byte takes only its own bits."""
    from division import kernels
    from division.codecs.packing import unpack_bits
    lib = kernels.library()
    if lib is None:
        pytest.skip("no C compiler")
    packed = torch.arange(256, dtype=torch.uint8)
    for n in (2048, 2045):
        out = torch.empty(n, dtype=torch.uint8)
        lib.unpack_mask(packed.data_ptr(), n, out.data_ptr(), 2)
        assert torch.equal(out, unpack_bits(packed, 1, n))


def test_compiled_graph_masks_go_through_the_kernel_operators():
    """A ReLU before a max-pool: the compiled graph saves the ReLU's mask as a bool tensor; on a CPU it is
    packed by the kernel's operators (the traced bit arithmetic, fused into the max-pool's backward, made that
    loop scalar), a bit per element, and the step's gradients equal those of the traced packing exactly (both
    hold the same bits; 8-bit nearest codes elsewhere)."""
    from division import kernels
    if not kernels.available():
        pytest.skip("no C compiler")

    def net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                             nn.MaxPool2d(3, 2, 1), nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8),
                             nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))

    x, y = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(5)), torch.arange(4) % 10
    grads, masks = [], []
    for traced in (False, True):
        torch._dynamo.reset()
        model, method = net(), build({"name": "division", "hfc_bits": 8, "stochastic": False})
        method.prepare(model)
        api.compile_model(model, method)
        if traced:
            from division.compress import ops
            original = ops.masks_available
            ops.masks_available = lambda mask: False
        try:
            _step(model, method, x, y)
        finally:
            if traced:
                ops.masks_available = original
        masks.append([p for p in method.saved_tensor_route.plans.values() if p.action == "bits"])
        grads.append([p.grad.clone() for p in model.parameters()])
    assert masks[0] and all(p.kernel and p.held_bytes == -(-math.prod(p.shape) // 8) for p in masks[0])
    assert not any(p.kernel for p in masks[1])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_compile_check_reads_method_specs_with_options_and_refuses_bad_ones(capsys):
    """compile_check's --methods: a spec's options after its ':' stay with it (the GPU step compares
    division with division:backend=reference); a bad name or option is an error before any model is built."""
    import importlib
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    check = importlib.import_module("compile_check")
    assert check.method_specs("division,division:backend=reference,actnn:bits=4,group_size=64") == [
        "division", "division:backend=reference", "actnn:bits=4,group_size=64"]
    with pytest.raises(ValueError, match="before any method name"):
        check.method_specs("bits=4,division")
    assert check.parse(["--methods", "division,division:backend=reference"]).methods
    for bad, named in (("divison", "valid choices"), ("division:backend=cuda", "backend")):
        with pytest.raises(SystemExit):
            check.parse(["--methods", bad])
        assert named in capsys.readouterr().err


@pytest.mark.parametrize("name,codec", [("blpa", "ReshapedQuantized"), ("mesa", "ChannelQuantized")])
def test_compiled_methods_without_a_traced_codec_account_through_their_hooks(name, codec):
    """BLPA and Mesa have no traced codec: compiled, their own codec runs in saved-tensor hooks after the
    compiled forward (compress/saved_hooks.py), and the accounted step reports what those hooks keep (the
    accounting took that route for the in-graph one and failed: 'list' object is not callable)."""
    model, method = small_net(), build({"name": name})
    method.prepare(model)
    api.compile_model(model, method)
    loss, report = _step(model, method, torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(4)),
                         torch.arange(8) % 10)
    assert math.isfinite(loss) and 0 < report.held_bytes < report.fp_bytes / 3
    inside = [r for r in report.layers if r["layer"] == "(compiled graph)"]  # the rest: the loss's, eager
    assert inside and all(r["codec"] == codec for r in inside if r["kind"] == "saved map" and r["shape"][2] > 1)


@pytest.mark.parametrize("model_name", ["small_net", "resnet20"])
def test_compile_model_captures_the_forward_of_torch_containers_and_of_our_models(model_name):
    """trainer.compile=true compiles in place and Dynamo captures a graph both for a model whose forward is
    PyTorch's own (an nn.Sequential: under torch 2.11, the GPU image's, Module.compile() ran it all eagerly
    without a word; scripts/device/rehearse.sh runs this file on torch 2.11) and for one of ours."""
    import torch._dynamo.utils
    from division.models import create_model
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model, method = (small_net() if model_name == "small_net" else create_model(model_name)), build({"name": "fp"})
    method.prepare(model)
    api.compile_model(model, method)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1


@pytest.mark.parametrize("spec", ["fp", "compile_budget:budget=0.1"])
def test_accounting_a_compiled_model_traces_nothing_of_its_own(spec):
    """The accounting notes the storages of the model's input (reported on their own). Noted in a forward
    pre-hook, that note was compiled with the model's call: 4 graph breaks under torch 2.14, and under 2.11
    (the GPU image's) the whole model ran eagerly, so compile_budget held as much as plain autograd. For a
    compiled model it is noted around the compiled call: no break, and the input still noted. (The compiled
    graph saves its own channels-last copy of the input on a CPU, so the report's input share is 0 here.)"""
    import torch._dynamo.utils
    from division.codecs.base import storage_key
    from division.memory import model_inputs
    from division.methods import load_config
    model, method = small_net(), build(load_config(spec))
    method.prepare(model)
    api.compile_model(model, method)
    torch._dynamo.utils.counters.clear()
    x, y = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(5)), torch.arange(4)
    fp = method.fp_reference_bytes(model, lambda: F.cross_entropy(model(x), y))
    with method.accounting(model) as acc:
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    with model_inputs(model) as noted:
        model(x)
    assert api.graph_breaks() == 0 and torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    assert storage_key(x) in noted
    if spec != "fp":
        assert acc.report.held_bytes < fp / 3, (acc.report.held_bytes, fp)


@pytest.mark.parametrize("spec,options", [("fp", {}), ("compile_budget", {"budget": 0.1}),
                                          ("division", {}), ("division", {"backend": "reference"})])
def test_a_handle_compiles_its_model_and_keeps_compressing_and_accounting(spec, options):
    """One's own loop: ``division.prepare`` then ``handle.compile()``. The method's hooks run around each
    compiled call and the first training forward is accounted outside the compiled code. Before, the handle's
    accounting hooks were compiled with the model (compile_budget through ``prepare``: 14 graph breaks and as
    much held as plain autograd under torch 2.14), and a compiled compressing model got none of the method's
    hooks in one's own loop (DIVISION held more than plain autograd). fp's reference runs the same compiled
    graph as its accounted forward, so the two are equal to the byte."""
    import division
    import torch._dynamo.utils
    model = small_net()
    handle = division.prepare(model, spec, **options)
    assert handle.compile() is model
    torch._dynamo.utils.counters.clear()
    x, y = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(6)), torch.arange(8) % 10
    for _ in range(2):
        F.cross_entropy(model(x), y).backward()
    report = handle.memory_report()
    assert api.graph_breaks() == 0 and torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    assert report is not None
    if spec == "fp":
        assert report.held_bytes == report.fp_bytes
    else:
        assert report.held_bytes < report.fp_bytes / 8, (report.held_bytes, report.fp_bytes)
    handle.compile()  # again: one accounting per forward still (twice, the second would record nothing)
    handle.measure_next()
    F.cross_entropy(model(x), y).backward()
    again = handle.memory_report()
    assert again is not report and again.held_bytes == report.held_bytes
    report, inner = again, handle._inner_call
    handle.remove()  # the model keeps the compiled call it had (compile_budget's own removal drops it)
    assert model._compiled_call_impl is (None if spec == "compile_budget" else inner)
    F.cross_entropy(model(x), y).backward()
    assert handle.memory_report() is report


def test_a_handle_refuses_dynamic_shapes_where_the_codec_plans_by_shape():
    import division
    handle = division.prepare(small_net(), "division")
    with pytest.raises(ValueError, match=r"dynamic=True does not work with method 'division'.*valid: dynamic=False"):
        handle.compile(dynamic=True)


def test_profile_step_profiles_a_compiled_step(tmp_path):
    """scripts/profile_step.py --compile (the GPU recipe's 'compile profile' step): the compiled model's graphs
    are what the profile shows, and the provenance beside it says it was compiled."""
    import json
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import profile_step
    out = tmp_path / "prof"
    profile_step.main(["--model", "resnet20", "--method", "division", "--batch", "2", "--image-size", "32",
                       "--amp", "none", "--device", "cpu", "--steps", "1", "--rows", "200", "--compile",
                       "--out", str(out)])
    record = json.loads(out.with_suffix(".json").read_text())
    assert record["compiled"] is True and len(record["step_seconds"]) == 1
    table = out.with_suffix(".txt").read_text()
    assert "CompiledFxGraph" in table, table


def test_every_model_compiled_in_a_process_gets_its_own_graphs():
    """Dynamo keeps compiled graphs per code object, at most recompile_limit (8): with the compiling frame's
    code shared by every model, the ninth model of another architecture ran eagerly with only a logged warning
    (it happened in this file: a profile's step showed no compiled graph). Dynamo's eager backend: the cache is
    Dynamo's, whatever compiles the graphs."""
    import torch._dynamo.utils
    counters = torch._dynamo.utils.counters["stats"]
    for depth in range(1, 11):
        model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(depth)])
        api.compile_in_place(model, backend="eager")
        before = counters["unique_graphs"]
        model(torch.randn(2, 4)).sum().backward()
        assert counters["unique_graphs"] == before + 1, f"model {depth} was not compiled"
