"""Convolution and linear layers: keep the compressed input, rebuild it for the weight gradient only."""
import torch
import torch.nn.functional as F

def _cast(t, dtype):
    return t if t is None or t.dtype == dtype else t.to(dtype)


class _Conv2dFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, groups, policy, layer):
        out = F.conv2d(x, weight, bias, stride, padding, dilation, groups)
        ctx.saved = policy.save(x, "conv", layer)
        ctx.conf = (stride, padding, dilation, groups, x.dtype, out.dtype, bias is not None)
        ctx.save_for_backward(weight)
        return out

    @staticmethod
    def backward(ctx, grad):
        """Weight gradient first, from the decoded input, which is then freed before the input gradient is
        made (that needs only the input's shape): the decoded copy and the input gradient, each as large as
        the activation, never coexist. 1x1 convolutions go through matrix products, which need no workspace
        (the library's convolution backward reorders input and gradient into temporary copies)."""
        (weight,) = ctx.saved_tensors
        stride, padding, dilation, groups, in_dtype, dtype, has_bias = ctx.conf
        grad, w = grad.to(dtype), weight.to(dtype)
        shape = ctx.saved.packed_shape
        pointwise = weight.shape[2:] == (1, 1) and tuple(padding) == (0, 0) and groups == 1
        need_w, need_b = ctx.needs_input_grad[1], has_bias and ctx.needs_input_grad[2]
        gw = gb = gx = None
        if need_w or need_b:
            x = ctx.saved.decode().to(dtype)
            if pointwise:
                gw = _pointwise_weight_grad(x, grad, stride) if need_w else None
                gb = grad.sum((0, 2, 3)) if need_b else None
            else:
                _, gw, gb = torch.ops.aten.convolution_backward(
                    grad, x, w, [weight.shape[0]] if has_bias else None, stride, padding, dilation, False, [0, 0],
                    groups, (False, need_w, need_b))
            del x
        ctx.saved = None
        if ctx.needs_input_grad[0]:
            if pointwise:
                gx = _pointwise_input_grad(shape, w, grad, stride)
            else:
                stub = grad.new_empty(1).expand(shape)
                gx = torch.ops.aten.convolution_backward(grad, stub, w, None, stride, padding, dilation, False,
                                                         [0, 0], groups, (True, False, False))[0]
        return (_cast(gx, in_dtype), _cast(gw, weight.dtype), _cast(gb, weight.dtype),
                None, None, None, None, None, None)


def _pointwise_weight_grad(x, grad, stride):
    """dW of a 1x1 convolution: sum over samples of grad_n (Cout x P) @ x_n^T (P x Cin), P = output pixels."""
    n, cout = grad.shape[:2]
    xs = x[:, :, ::stride[0], ::stride[1]] if tuple(stride) != (1, 1) else x
    gw = torch.mm(grad[0].reshape(cout, -1), xs[0].reshape(x.shape[1], -1).t())
    for i in range(1, n):
        gw.addmm_(grad[i].reshape(cout, -1), xs[i].reshape(x.shape[1], -1).t())
    return gw.view(cout, x.shape[1], 1, 1)


def _pointwise_input_grad(shape, w, grad, stride):
    """dX of a 1x1 convolution: W^T (Cin x Cout) @ grad_n, scattered to the strided positions."""
    n, cin, h, wd = shape
    cout = w.shape[0]
    wt = w.view(cout, cin).t()
    gy = grad.new_empty((n, cin) + tuple(grad.shape[2:]))
    for i in range(n):  # one product per sample into its slice: a batched matmul would transpose-copy the batch
        torch.mm(wt, grad[i].reshape(cout, -1), out=gy[i].view(cin, -1))
    if tuple(stride) == (1, 1):
        return gy
    gx = grad.new_zeros(shape)
    gx[:, :, ::stride[0], ::stride[1]] = gy
    return gx


class _LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, policy, layer):
        out = F.linear(x, weight, bias)
        ctx.saved = policy.save(x, "linear", layer)
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
