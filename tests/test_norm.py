"""The compressed batch norm's kernels: PyTorch's own backend choice (cuDNN on a GPU) where a module has an
affine weight and running statistics, the native kernels otherwise; either way what nn.BatchNorm2d computes."""
import pytest
import torch
import torch.nn.functional as F

from division.compress.norm import _BatchNorm2dFn


class _Exact:
    """A policy that keeps the batch norm's input as it is (the kernels alone are under test)."""

    def save_bn_input(self, x, layer):
        return type("Kept", (), {"decode": lambda _self: x})()

    def note_bn_output(self, *args):
        pass


def _run(x, g, affine: bool, running: bool, ours: bool):
    c = x.shape[1]
    torch.manual_seed(3)
    w = torch.randn(c, requires_grad=True) if affine else None
    b = torch.randn(c, requires_grad=True) if affine else None
    rm, rv = (torch.zeros(c), torch.ones(c)) if running else (None, None)
    x = x.detach().requires_grad_(True)
    with torch.profiler.profile() as prof:
        if ours:
            out = _BatchNorm2dFn.apply(x, w, b, rm, rv, 0.1, 1e-5, _Exact(), "bn")
        else:
            out = F.batch_norm(x, rm, rv, w, b, training=True, momentum=0.1, eps=1e-5)
        out.backward(g)
    grads = [x.grad] + ([w.grad, b.grad] if affine else [])
    return [out, *grads, *([rm, rv] if running else [])], {e.name for e in prof.events()}


@pytest.mark.parametrize("affine,running", [(True, True), (False, True), (True, False)])
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
def test_batch_norm_kernels_follow_pytorchs_choice(affine, running, layout):
    """With weight and running statistics the forward and backward go through ``_batch_norm_with_update`` and
    ``batch_norm_backward`` (cuDNN on a GPU: the native CUDA kernels ran 5-15x below bandwidth); without, the
    native kernels. Outputs, gradients and running statistics equal nn.BatchNorm2d's bit for bit on a CPU (the
    same native kernels underneath), in either memory layout."""
    torch.manual_seed(0)
    x = (torch.randn(4, 6, 5, 7) * 2 + 1).contiguous(memory_format=layout)
    g = torch.randn(4, 6, 5, 7).contiguous(memory_format=layout)
    got, ops = _run(x, g, affine, running, ours=True)
    want, _ = _run(x, g, affine, running, ours=False)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    chosen = affine and running
    assert ("aten::_batch_norm_with_update" in ops) is chosen and ("aten::batch_norm_backward" in ops) is chosen
    if not chosen:
        assert "aten::native_batch_norm" in ops and "aten::native_batch_norm_backward" in ops
