"""compact_relu: a ReLU output's codes kept only where the ReLU's exact mask is set."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from division.codecs import BitMask, DivisionCodec, GroupwiseCodec, PerChannelCodec, packed_nbytes
from division.codecs.compact import ReluCompacted, compact_relu
from division.compress.pointwise import _ReLUFn
from division.kernels import triton_codecs
from division.methods import build
from division.models import create_model

BACKENDS = ["reference", "compiled"] + (["triton"] if triton_codecs.available(torch.device("cpu")) else [])
CODECS = {
    "division": lambda b: DivisionCodec(stochastic=False, backend=b),
    "division_plus_like": lambda b: DivisionCodec(block_size=16, stochastic=False, backend=b, stat_dtype="bf16"),
    "per_channel": lambda b: PerChannelCodec(stochastic=False, backend=b),
    "groupwise": lambda b: GroupwiseCodec(group_size=64, stochastic=False, backend=b),
}


def _relu_output(shape, seed=0):
    torch.manual_seed(seed)
    y = torch.relu(torch.randn(shape) + 0.3)
    return y, BitMask.encode(y > 0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(CODECS))
@pytest.mark.parametrize("shape", [(2, 3, 16, 16), (2, 4, 13, 17), (1, 2, 8, 32)])
def test_compacted_decodes_as_the_codec_with_the_mask_applied(name, backend, shape):
    """Same decode as the codec's own (split by the mask) output with the mask applied, bit for bit; codes
    for the positive elements only, and only the positive side's statistics."""
    if name == "groupwise" and (shape[1] * shape[2] * shape[3]) % 64:
        pytest.skip("padded groups: left as they are (tested below)")
    y, mask = _relu_output(shape)
    full = CODECS[name](backend).encode(y, mask)
    packed = compact_relu(full, mask)
    assert isinstance(packed, ReluCompacted) and packed.backend == full.backend
    assert torch.equal(packed.decode(), mask.apply(full.decode()))
    positives = int((y > 0).sum())
    q = full.hfc if hasattr(full, "hfc") else full.q
    assert packed.count == positives and packed.codes.numel() == packed_nbytes(positives, 2)
    split_stats = q.minimum.numel() == 2 * q.rows
    negative_side = q.rows * 2 * q.minimum.element_size() if split_stats else 0
    saved = packed_nbytes(y.numel(), 2) - packed_nbytes(positives, 2) + negative_side
    assert packed.nbytes() == full.nbytes() - saved


def test_layouts_that_do_not_follow_the_elements_stay_as_they_are():
    y, mask = _relu_output((2, 3, 10, 10))
    padded = GroupwiseCodec(group_size=64).encode(y, mask)  # 300 elements per sample: padded groups
    assert compact_relu(padded, mask) is padded
    tiny = DivisionCodec().encode(torch.relu(torch.randn(2, 3, 1, 1)))  # 1x1 maps: bf16 copies
    assert compact_relu(tiny, BitMask.encode(torch.ones(2, 3, 1, 1, dtype=torch.bool))) is tiny


@pytest.mark.parametrize("method", ["division", "actnn"])
def test_policy_compacts_relu_outputs_only_while_unchanged(method):
    """A ReLU output is compacted (and decodes to exactly 0 where it was 0); the same output changed in place
    after the ReLU is not (its zeros are gone, and the mask no longer describes it)."""
    torch.manual_seed(0)
    policy = build({"name": method, "compact_relu": True}).policy
    policy.begin_forward()
    x = torch.randn(2, 4, 16, 16, requires_grad=True)
    y = _ReLUFn.apply(x * 1.0, False, policy, "relu")
    zeros = y.detach() == 0
    saved = policy.save(y, "conv", "conv1")
    assert isinstance(saved.packed, ReluCompacted) and "relu-compact" in policy.records[-1].codec
    assert torch.equal(saved.decode()[zeros], torch.zeros(int(zeros.sum())))
    z = _ReLUFn.apply(x * 1.0, True, policy, "relu_inplace")
    assert isinstance(policy.save(z, "conv", "conv2").packed, ReluCompacted)  # in place: version bump matched
    w = _ReLUFn.apply(x * 1.0, False, policy, "relu2")
    w.add_(0.5)
    changed = policy.save(w, "conv", "conv3")
    assert not isinstance(changed.packed, ReluCompacted)
    assert changed.decode()[zeros].min() > 0.1  # 0.5 up to the 2-bit error; masked it would be 0
    policy.end_forward()


def _step(model, x, y):
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("method", [{"name": "division", "hfc_bits": 8}, {"name": "actnn", "bits": 8}])
def test_training_with_compaction_holds_less_and_gives_the_same_gradients(method):
    """torchvision's resnet18 (in-place ReLUs, residual blocks): the blocks' inputs are compacted, the model
    holds less, and at 8 bits the gradients stay those of plain autograd."""
    torch.manual_seed(0)
    ref = create_model("resnet18", num_classes=10)
    x, t = torch.randn(2, 3, 64, 64), torch.randint(0, 10, (2,))
    g_ref = _step(ref, x, t)
    held = {}
    for compact in (False, True):
        model = copy.deepcopy(ref)
        m = build({**method, "compact_relu": compact})
        m.prepare(model)
        with m.accounting(model) as acc:
            loss = F.cross_entropy(model(x), t)
        loss.backward()
        g = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        report = acc.report
        held[compact] = report.held_bytes
        codecs = {r["codec"] for r in report.layers}
        assert any("relu-compact" in c for c in codecs) == compact
        for name in g_ref:
            cos = F.cosine_similarity(g[name].flatten().double(), g_ref[name].flatten().double(), dim=0).item()
            assert cos > 0.99, name
    assert held[True] < 0.97 * held[False]


def test_bad_compact_relu_value():
    with pytest.raises(ValueError, match=r"compact_relu='yes' is invalid; valid choices: \[True, False\]"):
        build({"name": "division", "compact_relu": "yes"})


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("numel", [1, 8, 13, 1000, 4099, 8 * (1 << 14) * 3 + 77])
def test_kernel_moves_codes_as_pytorch_does(bits, numel):
    """The CPU kernel's kept codes and their restoration agree byte for byte with the PyTorch path (odd
    sizes, empty and full masks included, and a parallel chunk with nothing kept between two that keep some)."""
    from division.codecs.compact import keep_codes, restore_codes
    from division.codecs.packing import pack_bits
    if kernel_library_missing():
        pytest.skip("no C compiler: the PyTorch path is the only one")
    torch.manual_seed(numel + bits)
    codes = pack_bits(torch.randint(0, 1 << bits, (numel,), dtype=torch.uint8), bits)
    gap = torch.rand(numel) < 0.3
    gap[numel // 3: 2 * numel // 3] = False
    for set_bits in (torch.zeros(numel, dtype=torch.bool), torch.rand(numel) < 0.3, gap,
                     torch.ones(numel, dtype=torch.bool)):
        mask = BitMask.encode(set_bits)
        ref, ref_count = keep_codes(codes, mask, numel, bits, "reference")
        fast, count = keep_codes(codes, mask, numel, bits, "compiled")
        assert count == ref_count and torch.equal(fast, ref)
        back = restore_codes(fast, count, mask, numel, bits, "compiled")
        assert torch.equal(back, restore_codes(ref, count, mask, numel, bits, "reference"))


def kernel_library_missing():
    from division import kernels
    return kernels.library() is None


def test_division_plus_compact_is_division_plus_with_compaction():
    from division.methods import load_config
    plus, compact = load_config("division_plus"), load_config("division_plus_compact")
    assert compact.pop("compact_relu") is True and plus.pop("compact_relu") is False
    assert compact.pop("name") == "division_plus_compact" and plus.pop("name") == "division_plus"
    assert compact == plus
    assert build(load_config("division_plus_compact")).policy.compact_relu
