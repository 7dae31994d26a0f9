import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision

from conftest import measured_step
from division.methods import build, load_config
from division.models import create_model

ALL = ["fp", "division", "actnn", "blpa", "checkpoint", "swap"]
COMPRESSING = ["division", "actnn", "blpa"]


def _step(model, x, y):
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _cos(a, b):
    return F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


@pytest.mark.parametrize("kind", ALL)
def test_state_dict_unchanged_and_eval_plain(kind):
    torch.manual_seed(0)
    model = create_model("resnet20")
    before = copy.deepcopy(model.state_dict())
    build({"name": kind}).prepare(model)
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    model.eval()
    plain = create_model("resnet20")
    plain.load_state_dict(before)
    plain.eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(model(x), plain(x))


def test_eight_bits_block_one_matches_full_precision():
    torch.manual_seed(0)
    ref = create_model("resnet20")
    model = copy.deepcopy(ref)
    build({"name": "division", "hfc_bits": 8, "block_size": 1, "lfc_dtype": "fp32"}).prepare(model)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    g_ref, g = _step(ref, x, y), _step(model, x, y)
    assert g.keys() == g_ref.keys()
    for name in g_ref:
        assert _cos(g[name], g_ref[name]) > 0.9999, name


@pytest.mark.parametrize("kind", COMPRESSING)
def test_gradients_close_at_eight_bits(kind):
    torch.manual_seed(0)
    ref = create_model("resnet20")
    model = copy.deepcopy(ref)
    opts = {"division": {"hfc_bits": 8}, "actnn": {"bits": 8}, "blpa": {"bits": 8}}[kind]
    build({"name": kind, **opts}).prepare(model)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    g_ref, g = _step(ref, x, y), _step(model, x, y)
    for name in g_ref:
        assert _cos(g[name], g_ref[name]) > 0.99, name


def test_relu_mask_exact():
    torch.manual_seed(0)
    x = torch.randn(2, 4, 8, 8, requires_grad=True)
    relu = nn.Sequential(nn.ReLU())
    build({"name": "division"}).prepare(relu)
    relu.train()
    g = torch.randn(2, 4, 8, 8)
    (relu(x) * g).sum().backward()
    assert torch.equal(x.grad, g * (x > 0))


def test_maxpool_and_dropout_exact():
    torch.manual_seed(0)
    pool = nn.Sequential(nn.MaxPool2d(3, 2, 1))
    ref = nn.MaxPool2d(3, 2, 1)
    build({"name": "division"}).prepare(pool)
    x = torch.randn(2, 3, 15, 15, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    g = torch.randn(2, 3, 8, 8)
    (pool(x) * g).sum().backward()
    (ref(x2) * g).sum().backward()
    assert torch.equal(x.grad, x2.grad)
    drop = nn.Sequential(nn.Dropout(0.3))
    build({"name": "division"}).prepare(drop)
    x = torch.randn(4, 100, requires_grad=True)
    out = drop(x)
    out.sum().backward()
    keep = out != 0
    assert torch.allclose(x.grad, keep.float() / 0.7)


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("kernel, stride, padding, ceil_mode, size",
                         [(3, 2, 1, False, 15), (2, 2, 0, False, 8), (3, 2, 0, True, 10), (3, 1, 1, False, 7),
                          (2, 3, 1, True, 11)])
def test_maxpool_matches_pytorch_on_ties_and_nan(backend, kernel, stride, padding, ceil_mode, size):
    """The max-pool that keeps packed window positions (CPU kernel under auto, PyTorch under reference)
    gives PyTorch's output and input gradient exactly, with ties (integer inputs), NaN and -inf present."""
    torch.manual_seed(0)
    x = torch.randint(-3, 4, (2, 3, size, size)).float()
    x[0, 0, 1, 1], x[1, 2, 0, 0], x[1, 1, 2, 3] = float("nan"), float("-inf"), float("nan")
    pool, ref = nn.MaxPool2d(kernel, stride, padding, ceil_mode=ceil_mode), nn.MaxPool2d(kernel, stride, padding,
                                                                                         ceil_mode=ceil_mode)
    build({"name": "division", "backend": backend}).prepare(pool)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, expected = pool(x1), ref(x2)
    assert out.shape == expected.shape
    assert torch.equal(out.isnan(), expected.isnan()) and torch.equal(out.nan_to_num(), expected.nan_to_num())
    g = torch.randn(expected.shape)
    (out * g).sum().backward()
    (expected * g).sum().backward()
    assert torch.equal(x1.grad, x2.grad)


def test_shared_input_held_once():
    """A block input read by conv1 and by the downsample conv is compressed once."""
    model = torchvision.models.resnet18(num_classes=10)
    method = build({"name": "division"})
    method.prepare(model)
    x = torch.randn(2, 3, 64, 64)
    with method.accounting() as acc:
        out = model(x)
    shared = [r for r in acc.report.layers if "(shared)" in r["codec"]]
    names = {r["layer"] for r in shared}
    assert "layer2.0.downsample.0" in names or "layer2.0.conv1" in names
    assert all(r["held_bytes"] == 0 for r in shared)
    out.sum().backward()


@pytest.mark.parametrize("kind", ALL)
def test_every_method_trains_torchvision_and_timm(kind):
    for name, size in (("resnet50", 64), ("vit_cifar", 32)):
        torch.manual_seed(0)
        model = create_model(name, num_classes=10)
        if kind == "checkpoint" and name == "vit_cifar":
            continue  # timm ViT blocks are an nn.Sequential: covered below
        method = build({"name": kind})
        method.prepare(model)
        x, y = torch.randn(2, 3, size, size), torch.randint(0, 10, (2,))
        with method.accounting() as acc:
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        assert torch.isfinite(loss)
        assert acc.report.held_bytes > 0
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("kind", COMPRESSING + ["checkpoint"])
def test_resnet50_holds_less(kind):
    torch.manual_seed(0)
    model = torchvision.models.resnet50()
    method = build({"name": kind})
    method.prepare(model)
    x, y = torch.randn(2, 3, 224, 224), torch.randint(0, 1000, (2,))
    fp, report = measured_step(method, model, x, y)
    ratio = fp / report.held_bytes
    assert ratio > {"division": 10.4, "actnn": 10.0, "blpa": 6.0, "checkpoint": 2.0}[kind], ratio


@pytest.mark.parametrize("kind", ["fp", "division"])
def test_accounting_matches_profiler(kind):
    """The accounted bytes agree with an independent measure: the allocator's net growth over the forward
    pass seen by torch.profiler, less the output; held storages that existed before the forward (the input,
    where plain autograd keeps it) are not growth."""
    from torch.profiler import ProfilerActivity, profile
    from division.compress import storage_key
    torch.manual_seed(0)
    model = torchvision.models.resnet50()
    method = build({"name": kind})
    method.prepare(model)
    x, y = torch.randn(2, 3, 224, 224), torch.randint(0, 1000, (2,))
    F.cross_entropy(model(x), y).backward()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with method.accounting(model) as acc:
            out = model(x)
    net = sum(e.self_cpu_memory_usage for e in prof.key_averages()) - out.numel() * out.element_size()
    held_before = {k[:3] for k in acc.recorder.tensors}
    held = acc.report.held_bytes - (x.untyped_storage().nbytes() if storage_key(x) in held_before else 0)
    assert abs(net - held) / held < 0.03, (net, held)


def test_parameter_views_are_not_activations():
    """A Linear saves ``weight.t()``, a view of the parameter: it is not an activation."""
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 8))
    method = build({"name": "fp"})
    method.prepare(model)
    x = torch.randn(4, 64)
    fp = method.fp_reference_bytes(model, lambda: model(x).sum())
    with method.accounting(model) as acc:
        model(x).sum().backward()
    # x, the first Linear's output (kept by GELU), GELU's output: 4*(64 + 256 + 256) floats, no weight
    assert fp == acc.report.held_bytes == 4 * (64 + 256 + 256) * 4


def test_autocast_weight_copies_reported_apart():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 14 * 14, 10))
    method = build({"name": "fp"})
    method.prepare(model)
    x = torch.randn(2, 3, 16, 16)

    def forward():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x).float().sum()
    ref = method.fp_reference(model, forward)
    weights = sum(p.numel() for n, p in model.named_parameters() if n.endswith("weight")) * 2
    assert ref.amp_weight_cast_bytes >= weights
    with method.accounting(model) as acc:
        forward().backward()
    assert acc.report.amp_weight_cast_bytes == ref.amp_weight_cast_bytes
    assert acc.report.held_bytes == ref.act_bytes
    assert "autocast weight copies" in acc.report.table()


def test_fp_reference_keeps_nothing_and_restores_rng():
    """The reference forward frees each activation as it goes, moves no batch-norm statistic and leaves
    the random state as it found it (dropout draws)."""
    import weakref
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.5), nn.Conv2d(8, 4, 3))
    method = build({"name": "fp"})
    method.prepare(model)
    refs = []
    hooks = [m.register_forward_hook(lambda mod, a, o: refs.append(weakref.ref(o))) for m in model]
    x = torch.randn(2, 3, 16, 16)
    stats = model[1].running_mean.clone()
    rng = torch.get_rng_state()
    ref = method.fp_reference(model, lambda: model(x).sum())
    assert ref.act_bytes > 0
    assert all(r() is None for r in refs), "an activation of the reference forward is still alive"
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(model[1].running_mean, stats)
    refs.clear()
    kept = model(x).sum()  # a real forward keeps its saved activations alive until backward
    assert any(r() is not None for r in refs[:-1])
    del kept
    for h in hooks:
        h.remove()


def test_swap_on_cpu_accounts_like_fp_and_obeys_bypass():
    torch.manual_seed(0)
    model = create_model("resnet20")
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    held = {}
    for kind in ("fp", "swap"):
        method = build({"name": kind})
        method.prepare(model)
        ref = method.fp_reference(model, lambda: F.cross_entropy(model(x), y))
        with method.accounting(model) as acc:
            F.cross_entropy(model(x), y).backward()
        held[kind] = (ref.act_bytes, acc.report.held_bytes, acc.report.host_bytes)
        method.remove(model)
        assert not model._forward_pre_hooks and not model._forward_hooks
    assert held["swap"] == held["fp"] and held["fp"][0] == held["fp"][1] > 0 and held["swap"][2] == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_swap_on_cuda_moves_and_accounts():
    torch.manual_seed(0)
    model = create_model("resnet20").cuda()
    method = build({"name": "swap"})
    method.prepare(model)
    x, y = torch.randn(4, 3, 32, 32, device="cuda"), torch.randint(0, 10, (4,), device="cuda")
    ref = method.fp_reference(model, lambda: F.cross_entropy(model(x), y))
    with method.accounting(model) as acc:
        F.cross_entropy(model(x), y).backward()
    assert acc.report.host_bytes >= 0.9 * ref.act_bytes
    assert acc.report.held_bytes < 0.1 * ref.act_bytes
    assert acc.report.fp_bytes == ref.act_bytes


def test_bf16_autocast_cpu():
    torch.manual_seed(0)
    model = create_model("resnet20")
    method = build({"name": "division"})
    method.prepare(model)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all()
               for p in model.parameters())


def test_reuse_relu_mask_applies_to_inplace_relu_outputs():
    grads = {}
    for reuse in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(8, 4, 3, padding=1))
        build({"name": "division", "reuse_relu_mask": reuse, "layers": ["conv", "relu"]}).prepare(model)
        torch.manual_seed(1)
        x = torch.randn(2, 3, 16, 16)
        model(x).square().sum().backward()
        grads[reuse] = model[2].weight.grad.clone()
    assert not torch.equal(grads[False], grads[True])


@pytest.mark.parametrize("reuse", [True, False])
def test_reuse_relu_mask_zeros_exact(reuse):
    """With reuse_relu_mask, a rebuilt ReLU output is exactly 0 wherever the ReLU output was 0 (without it,
    the quantization error leaves non-zeros there: the test can tell the two apart)."""
    from division.compress.pointwise import _ReLUFn
    torch.manual_seed(0)
    method = build({"name": "division", "reuse_relu_mask": reuse})
    policy = method.policy
    policy.begin_forward()
    x = torch.randn(2, 4, 16, 16, requires_grad=True)
    y = _ReLUFn.apply(x * 1.0, False, policy, "relu")
    rebuilt = policy.save(y, "conv", "conv").decode()
    zeros = y.detach() == 0
    assert zeros.any()
    if reuse:
        assert torch.equal(rebuilt[zeros], torch.zeros_like(rebuilt[zeros]))
    else:
        assert (rebuilt[zeros] != 0).any()


@pytest.mark.parametrize("bad", [{"name": "division", "hfc_bits": 3}, {"name": "division", "hfc_bits": 0},
                                 {"name": "division", "hfc_bits": 16}, {"name": "division", "block_size": 0},
                                 {"name": "division", "layers": ["conv", "lstm"]}, {"name": "actnn", "bits": 3},
                                 {"name": "checkpoint", "granularity": "layer"}, {"name": "nosuch"},
                                 {"name": "blpa", "colour": 1}])
def test_bad_method_config(bad):
    with pytest.raises(ValueError, match="valid|bad options"):
        build(bad)


def test_nonfinite_activation_gives_what_plain_autograd_gives():
    """An Inf in an activation survives compression: forward output and gradients carry Inf/NaN exactly
    where plain autograd's do, and the finite values agree."""
    import copy
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 3, padding=1))
    model = copy.deepcopy(plain)
    build({"name": "division", "hfc_bits": 8}).prepare(model)
    x = torch.randn(2, 3, 16, 16)
    x[0, 0, 5, 5] = float("inf")
    outs, grads = [], []
    for m in (plain, model):
        out = m(x)
        out.sum().backward()
        outs.append(out.detach())
        grads.append(m[2].weight.grad)
    for a, b in (outs, grads):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.isinf(), b.isinf())
        assert (~torch.isfinite(a)).any()
        fin = torch.isfinite(a)
        if fin.any():
            assert torch.allclose(a[fin], b[fin], rtol=0.05, atol=0.05 * a[fin].abs().max().item())


def test_single_block_maps_without_lfc_decode_alike_for_16_bits_less_per_map():
    """single_block_lfc=False: a map one LFC block covers is held without its LFC (the map mean, which the
    per-map minimum absorbs): 2 bytes (bf16) fewer per map, the same decode up to float rounding; larger maps
    keep DIVISION's codec."""
    torch.manual_seed(0)
    small, large = torch.randn(4, 8, 8, 8) * 3 + 1, torch.randn(4, 8, 16, 16)
    packs = {}
    for single in (True, False):
        method = build({"name": "division", "stochastic": False, "single_block_lfc": single})
        packs[single] = [method.choose("conv", t) for t in (small, large)]
    with_lfc, without = packs[True][0], packs[False][0]
    assert with_lfc.kind == "division" and without.kind != "division"
    assert with_lfc.nbytes() - without.nbytes() == 4 * 8 * 2
    scale = (small.amax((2, 3)) - small.amin((2, 3))).max()
    assert (with_lfc.decode() - without.decode()).abs().max() <= 1e-4 * scale
    assert torch.equal(packs[True][1].decode(), packs[False][1].decode())  # 16x16 at B=8: four blocks, LFC kept
    with pytest.raises(ValueError, match=r"single_block_lfc='no' is invalid; valid choices: \[True, False\]"):
        build({"name": "division", "single_block_lfc": "no"})


@pytest.mark.parametrize("size, stride, bias", [(8, 1, False), (8, 2, True), (58, 1, True), (58, 2, False)])
def test_pointwise_conv_backward_both_paths_exact(size, stride, bias):
    """1x1 convolutions take per-sample products on large maps (>= 29x29 output pixels) and the library's
    kernels on small ones; with a lossless codec both give plain autograd's gradients."""
    from division import compress
    from division.compress.linear import _PER_SAMPLE_MIN_PIXELS
    assert ((size // stride) ** 2 >= _PER_SAMPLE_MIN_PIXELS) == (size == 58)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Conv2d(6, 5, 1, stride=stride, bias=bias), nn.Flatten(), nn.LazyLinear(3))
    x = torch.randn(3, 6, size, size)
    ref(x)
    model = copy.deepcopy(ref)
    compress.install(model, compress.SavePolicy(compress.full_copy))
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    for net, inp in ((ref, xs[0]), (model, xs[1])):
        net(inp).square().sum().backward()
    torch.testing.assert_close(xs[1].grad, xs[0].grad, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-4, msg=name)


def test_same_padding_convolutions_are_compressed():
    """padding='same' (and 'valid') convolutions are covered: their input is held compressed, and the
    gradients match plain autograd's with a lossless codec. An even kernel, whose 'same' pads unevenly, stays
    with plain autograd."""
    import torch.nn as nn
    from division.compress.routing import numeric_padding
    assert numeric_padding(nn.Conv2d(2, 2, 3, padding="same")) == (1, 1)
    assert numeric_padding(nn.Conv2d(2, 2, 3, padding="same", dilation=2)) == (2, 2)
    assert numeric_padding(nn.Conv2d(2, 2, 2, padding="valid")) == (0, 0)
    assert numeric_padding(nn.Conv2d(2, 2, 2, padding="same")) is None
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(3, 4, 3, padding="same"), nn.Conv2d(4, 4, 2, padding="same"),
                          nn.Conv2d(4, 2, 5, padding="same", dilation=2))
    model = copy.deepcopy(plain)
    method = build({**load_config("division"), "hfc_bits": 8, "stochastic": False})
    method.prepare(model)
    assert set(method.covered) == {"0", "2"}
    x = torch.randn(2, 3, 12, 12, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    plain(x).square().sum().backward()
    model(x2).square().sum().backward()
    assert torch.allclose(x.grad, x2.grad, atol=1e-5)  # the input gradient never uses the held copy: exact up to summation order
    for a, b in zip(plain.parameters(), model.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=0.05, atol=0.05)  # 8-bit codes of the inputs: close, not equal
