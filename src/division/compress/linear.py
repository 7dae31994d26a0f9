"""Convolution and linear layers: keep the compressed input, rebuild it for the weight gradient only."""
import torch
import torch.nn.functional as F

from division.compress.policy import Saved

def _cast(t, dtype):
    return t if t is None or t.dtype == dtype else t.to(dtype)


def _save_input(policy, x, weight, kind, layer):
    """The input, kept for the weight gradient only: a frozen weight's layer keeps nothing of it (the input
    gradient needs the weight and the input's shape alone), where plain autograd holds the whole input."""
    if weight.requires_grad:
        return policy.save(x, kind, layer)
    policy.save_nothing(kind, layer, x.shape, x.numel() * x.element_size(), fp_key=policy.ids(x))
    return Saved(None, None, tuple(x.shape))


class _Conv2dFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, groups, policy, layer):
        out = F.conv2d(x, weight, bias, stride, padding, dilation, groups)
        ctx.saved = _save_input(policy, x, weight, "conv", layer)
        ctx.conf = (stride, padding, dilation, groups, x.dtype, out.dtype, bias is not None)
        ctx.save_for_backward(weight)
        return out

    @staticmethod
    def backward(ctx, grad):
        """Weight gradient first, from the decoded input, which is then freed before the input gradient is
        made (that needs only the input's shape): the decoded copy and the input gradient, each as large as
        the activation, never coexist. 1x1 convolutions on large maps go through one matrix product per sample,
        which needs no workspace (the library's convolution backward reorders input and gradient into temporary
        copies as large as the map); on small maps those products are too thin to be fast, and the library's
        kernels, with small copies, run them faster (see _PER_SAMPLE_MIN_PIXELS)."""
        (weight,) = ctx.saved_tensors
        stride, padding, dilation, groups, in_dtype, dtype, has_bias = ctx.conf
        grad, w = grad.to(dtype), weight.to(dtype)
        shape = ctx.saved.packed_shape
        pointwise = weight.shape[2:] == (1, 1) and tuple(padding) == (0, 0) and groups == 1
        per_sample = _runs_per_sample(grad, pointwise)
        need_w, need_b = ctx.needs_input_grad[1], has_bias and ctx.needs_input_grad[2]
        gw = gb = gx = None
        if need_b and not need_w:  # a frozen weight's layer kept no input: the bias gradient needs none
            gb = grad.sum((0, 2, 3))
        elif need_w:
            x = ctx.saved.decode().to(dtype)
            if per_sample:
                gw = _pointwise_weight_grad(x, grad, stride)
                gb = grad.sum((0, 2, 3)) if need_b else None
            else:
                _, gw, gb = torch.ops.aten.convolution_backward(
                    grad, x, w, [weight.shape[0]] if has_bias else None, stride, padding, dilation, False, [0, 0],
                    groups, (False, need_w, need_b))
            del x
        ctx.saved = None
        if ctx.needs_input_grad[0]:
            if pointwise:
                gx = _pointwise_input_grad(shape, w, grad, stride, per_sample)
            else:
                stub = grad.new_empty(1).expand(shape)
                gx = torch.ops.aten.convolution_backward(grad, stub, w, None, stride, padding, dilation, False,
                                                         [0, 0], groups, (True, False, False))[0]
        return (_cast(gx, in_dtype), _cast(gw, weight.dtype), _cast(gb, weight.dtype),
                None, None, None, None, None, None)


# Output pixels per sample from which a 1x1 convolution's backward runs as per-sample matrix products. Below
# it (28x28 and smaller) the library's weight-gradient kernel and one 1x1 convolution for the input gradient
# were faster on every resnet50 1x1 shape at batch 8, and their copies are at most a quarter of layer1's, where
# the step's memory peak lies (an AMD EPYC, 2 threads: 36 against 61 ms summed over those shapes for the weight
# gradients, 44 against 77 ms for the input gradients).
_PER_SAMPLE_MIN_PIXELS = 29 * 29


def _runs_per_sample(grad, pointwise: bool) -> bool:
    """Whether a 1x1 convolution's backward runs as per-sample matrix products: on the CPU (where it was
    tuned) and large maps only. On a GPU it would be 2N tiny kernel launches per layer, where the library's
    kernels run the whole batch at once."""
    return pointwise and grad.device.type == "cpu" and grad.shape[2] * grad.shape[3] >= _PER_SAMPLE_MIN_PIXELS


def _pointwise_weight_grad(x, grad, stride):
    """dW of a 1x1 convolution: sum over samples of grad_n (Cout x P) @ x_n^T (P x Cin), P = output pixels,
    accumulated in float32 whatever the inputs' precision (a sum over N samples in fp16 or bf16 would round
    at every addition), returned in float32."""
    n, cout = grad.shape[:2]
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xs = x[:, :, ::stride[0], ::stride[1]] if tuple(stride) != (1, 1) else x
    gw = torch.zeros(cout, x.shape[1], dtype=acc, device=x.device)
    for i in range(n):
        gw.addmm_(grad[i].reshape(cout, -1).to(acc), xs[i].reshape(x.shape[1], -1).t().to(acc))
    return gw.view(cout, x.shape[1], 1, 1)


def _pointwise_input_grad(shape, w, grad, stride, per_sample):
    """dX of a 1x1 convolution: W^T (Cin x Cout) @ grad_n, scattered to the strided positions; per sample, or
    as one 1x1 convolution of the gradient with W^T (the library's convolution backward with a stand-in input
    ran 2.5-8x slower than either on two of resnet50's three strided 1x1 layers)."""
    n, cin, h, wd = shape
    cout = w.shape[0]
    wt = w.view(cout, cin).t()
    if per_sample:
        gy = grad.new_empty((n, cin) + tuple(grad.shape[2:]))
        for i in range(n):  # one product per sample into its slice: a batched matmul would transpose-copy the batch
            torch.mm(wt, grad[i].reshape(cout, -1), out=gy[i].view(cin, -1))
    else:
        gy = F.conv2d(grad, wt.contiguous().view(cin, cout, 1, 1))
    if tuple(stride) == (1, 1):
        return gy
    gx = grad.new_zeros(shape)
    gx[:, :, ::stride[0], ::stride[1]] = gy
    return gx


class _LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, policy, layer):
        out = F.linear(x, weight, bias)
        ctx.saved = _save_input(policy, x, weight, "linear", layer)
        ctx.conf = (x.dtype, out.dtype, bias is not None)
        ctx.save_for_backward(weight)
        return out

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        in_dtype, dtype, has_bias = ctx.conf
        grad = grad.to(dtype)
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = (grad @ weight.to(dtype)).to(in_dtype)
        if ctx.needs_input_grad[1]:
            x = ctx.saved.decode().to(dtype)
            gw = (grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])).to(weight.dtype)
        if has_bias and ctx.needs_input_grad[2]:
            gb = grad.reshape(-1, grad.shape[-1]).sum(0).to(weight.dtype)
        ctx.saved = None
        return gx, gw, gb, None, None
