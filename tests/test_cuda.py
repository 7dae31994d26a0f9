"""CUDA checks, skipped without a GPU (``scripts/gpu_check.sh`` runs them on one)."""
import pytest
import torch
import torch.nn.functional as F

from division import engine
from division.codecs import BitMask, BlpaCodec, DivisionCodec, GroupwiseCodec, PerChannelCodec
from division.methods import build, load_config, method_names
from division.models import create_model

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CODECS = [lambda b: DivisionCodec(backend=b), lambda b: PerChannelCodec(backend=b),
          lambda b: GroupwiseCodec(backend=b), lambda b: BlpaCodec(backend=b)]


@pytest.mark.parametrize("make", CODECS)
def test_cuda_codec_equals_cpu_reference_in_statistics(make):
    torch.manual_seed(0)
    x = torch.randn(4, 8, 28, 28)
    ref = make("reference").encode(x)
    gpu = make("auto").encode(x.cuda())
    assert gpu.backend == "triton"
    errs = [((p.decode().cpu() - x).pow(2).mean().item()) for p in (ref, gpu)]
    assert abs(errs[1] - errs[0]) < 0.1 * errs[0], errs
    assert torch.equal(BitMask.positive(x.cuda()).packed.cpu(), BitMask.encode(x > 0).packed)


@pytest.mark.parametrize("name", method_names())
def test_cuda_training_step_every_method(name):
    torch.manual_seed(0)
    model = create_model("resnet20").cuda()
    method = build(load_config(name))
    method.prepare(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 3, 32, 32, device="cuda"), torch.randint(0, 10, (8,), device="cuda")
    state = engine.StepState(torch.device("cuda"))
    out = engine.train_step(model, method, x, y, opt, None, state, account=True)
    assert torch.isfinite(out.loss).item() and out.report.held_bytes > 0


def test_cuda_step_makes_no_host_sync():
    torch.manual_seed(0)
    model = create_model("resnet20").cuda()
    method = build({"name": "division"})
    method.prepare(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(8, 3, 32, 32, device="cuda"), torch.randint(0, 10, (8,), device="cuda")
    state = engine.StepState(torch.device("cuda"))
    engine.train_step(model, method, x, y, opt, None, state)  # warm-up: kernels compiled, state created
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("name", ["fp", "division", "division_plus", "actnn"])
def test_cuda_train_step_makes_no_host_sync(name):
    """The runner's whole step (forward with the method's codecs, backward, update, timing) never waits for
    the device: the caller's one read of the loss is the step's only synchronisation."""
    torch.manual_seed(0)
    model = create_model("resnet20").cuda()
    method = build(load_config(name))
    method.prepare(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(8, 3, 32, 32, device="cuda"), torch.randint(0, 10, (8,), device="cuda")
    state = engine.StepState(torch.device("cuda"))
    engine.train_step(model, method, x, y, opt, None, state).loss.item()  # warm-up: kernels compiled
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = engine.train_step(model, method, x, y, opt, None, state)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(out.loss).item() and out.seconds > 0


@pytest.mark.parametrize("name", ["fp", "division", "actnn"])
def test_cuda_accounting_matches_allocator(name):
    """Held bytes against the growth of torch.cuda.memory_allocated over the forward (output and loss
    excluded; the input, where held, existed before), within 3 %."""
    torch.manual_seed(0)
    model = create_model("resnet50", num_classes=10).cuda()
    method = build({"name": name})
    method.prepare(model)
    x, y = torch.randn(8, 3, 224, 224, device="cuda"), torch.randint(0, 10, (8,), device="cuda")
    F.cross_entropy(model(x), y).backward()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with method.accounting(model) as acc:
        out = model(x)
    torch.cuda.synchronize()
    growth = torch.cuda.memory_allocated() - before - out.untyped_storage().nbytes()
    from division.compress import storage_key
    held = acc.report.held_bytes - (x.untyped_storage().nbytes() if storage_key(x) in
                                    {k[:3] for k in acc.recorder.tensors} else 0)
    assert abs(growth - held) / held < 0.03, (growth, held)


def test_cuda_compact_relu_leaves_cuda_codes_as_they_are():
    """compact_relu is skipped on CUDA (its output size needs a host read, a sync per ReLU): the codec's own
    output comes back, the same object (the ReLU's backward applies the mask, as for any masked codec)."""
    from division.codecs.compact import compact_relu
    torch.manual_seed(0)
    y = torch.relu(torch.randn(4, 8, 28, 28, device="cuda"))
    mask = BitMask.positive(y)
    full = DivisionCodec(backend="auto", stochastic=False).encode(y, mask)
    assert compact_relu(full, mask) is full


def test_cuda_result_device_names_the_fp32_precision():
    from division.results import device_description
    from division.train import set_tf32
    before = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    try:
        set_tf32(torch.device("cuda"), False)
        assert device_description(torch.device("cuda")).endswith("(convolutions fp32, matmuls fp32)")
        set_tf32(torch.device("cuda"), None)
        assert device_description(torch.device("cuda")).endswith("(convolutions TF32, matmuls fp32)")
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before


def test_cuda_offsets_past_2_31_elements():
    """Tensors of more than 2^31 elements address correctly (64-bit offsets): the last map of a 2.2e9-element
    tensor, whose offsets exceed 2^31, encodes and decodes as it does alone, and the ReLU mask's last bits are
    right."""
    from division.kernels import triton_codecs
    maps, side = 33, 8192  # 33 * 8192^2 = 2.21e9 elements > 2^31
    x = torch.randn(maps, 1, side, side, device="cuda", dtype=torch.float16)
    codec = DivisionCodec(backend="triton", stochastic=False)
    whole, alone = codec.encode(x), codec.encode(x[-1:].clone())
    per_map = whole.hfc.packed.numel() // maps
    assert torch.equal(whole.hfc.packed[-per_map:], alone.hfc.packed)
    assert torch.equal(whole.decode()[-1], alone.decode()[0])
    mask = triton_codecs.mask_positive(x)
    tail = x.reshape(-1)[-64:]
    assert torch.equal(mask[-8:], BitMask.encode(tail > 0).packed)


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
def test_cuda_compressed_batch_norm_runs_cudnn(layout):
    """The compressed batch norm runs cuDNN's kernels on a GPU, as nn.BatchNorm2d does (the native CUDA kernels
    were 18 % of a DIVISION step at batch 256 on an H200), and agrees with nn.BatchNorm2d under fp16 autocast
    to within fp16's rounding (the inputs are the same; the reduction order of the kernels may differ)."""
    from division.compress.norm import _BatchNorm2dFn
    torch.manual_seed(0)
    x = (torch.randn(16, 32, 14, 14, device="cuda") * 2 + 1).half().contiguous(memory_format=layout)
    g = torch.randn_like(x)
    keep = type("Exact", (), {"save_bn_input": lambda self, t, layer: type("K", (), {"decode": lambda s: t})(),
                              "note_bn_output": lambda self, *a: None})()
    outs = []
    for ours in (True, False):
        bn = torch.nn.BatchNorm2d(32).cuda()
        xi = x.detach().requires_grad_(True)
        with torch.profiler.profile() as prof:
            out = (_BatchNorm2dFn.apply(xi, bn.weight, bn.bias, bn.running_mean, bn.running_var, 0.1, 1e-5, keep, "bn")
                   if ours else bn(xi))
            out.backward(g)
        ops = {e.name for e in prof.events()}
        outs.append((out.float(), xi.grad.float(), bn.weight.grad, bn.running_var, ops))
    assert "aten::cudnn_batch_norm" in outs[0][4] and "aten::cudnn_batch_norm_backward" in outs[0][4]
    for a, b in zip(outs[0][:4], outs[1][:4]):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3)


def test_cuda_kernel_operators_dispatch_to_triton_and_pass_opcheck():
    """The compiled route's custom operators on CUDA tensors run the Triton kernels (compress/ops.py): the
    same outputs as the Triton implementations called directly, fake implementations that match them, in
    the dtype asked for (torch.library.opcheck)."""
    from division.compress import ops
    x = torch.randn(4, 8, 20, 13, device="cuda", dtype=torch.float16)
    parts = torch.ops.division.encode_maps(x, 2, 8, 8, False)
    for a, b in zip(parts, ops._encode_maps_triton(x, 2, 8, 8, False)):
        assert torch.equal(a, b)
    signs = torch.ops.division.relu_signs(x)
    eps = torch.finfo(torch.float16).eps
    torch.library.opcheck(torch.ops.division.encode_maps.default, (x, 2, 8, 8, False))
    torch.library.opcheck(torch.ops.division.decode_maps.default, (*parts, 2, 20, 13, 8, 8, torch.float16))
    torch.library.opcheck(torch.ops.division.relu_signs.default, (x,))
    torch.library.opcheck(torch.ops.division.decode_relu_maps.default,
                          (*parts, signs, 2, 20, 13, 8, 8, eps, torch.float16))
    assert torch.ops.division.decode_maps(*parts, 2, 20, 13, 8, 8, torch.float16).dtype == torch.float16
