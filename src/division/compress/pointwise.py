"""Pointwise layers: ReLU and dropout keep exact 1-bit masks, GELU a compressed input (or its derivative in
a few bits)."""
import torch
import torch.nn.functional as F

from division.codecs.quant import BitMask


class _ReLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, inplace, policy, layer):
        fp_bytes, fp_key = x.numel() * x.element_size(), policy.ids(x)
        bn, residual = policy.bn_output(x), policy.residual_of(x)
        y, mask = BitMask.relu(x, inplace, policy.backend)
        if inplace:
            ctx.mark_dirty(x)
        ctx.mask = mask
        policy.note_relu(x, bn, y, mask, inplace, residual)  # first: it encodes the batch norm's waiting input
        policy.save_mask(y, mask, "relu", layer, fp_bytes, fp_key if inplace else policy.ids(y), inplace)
        return y

    @staticmethod
    def backward(ctx, grad):
        grad = ctx.mask.apply(grad)
        ctx.mask = None
        return grad, None, None, None


class _DropoutFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, p, policy, layer):
        keep = torch.rand_like(x, dtype=torch.float32) >= p
        ctx.mask = BitMask.encode(keep)
        ctx.scale = 1.0 / (1.0 - p)
        policy.save_mask(x, ctx.mask, "dropout", layer, x.numel())  # plain dropout keeps a bool per element
        return x * keep * ctx.scale

    @staticmethod
    def backward(ctx, grad):
        keep = ctx.mask.decode().view(grad.shape)
        ctx.mask = None
        return grad * keep * ctx.scale, None, None, None


class _GeluFn(torch.autograd.Function):
    """GELU keeping its input through the method's codec, or (``gelu_bits``) its derivative in a few bits."""

    @staticmethod
    def forward(ctx, x, approximate, policy, layer):
        if policy.gelu is not None:
            ctx.saved, ctx.slope = None, policy.save_gelu(x, layer, approximate)
        else:
            ctx.saved, ctx.slope = policy.save(x, "gelu", layer), None
        ctx.approximate = approximate
        return F.gelu(x, approximate=approximate)

    @staticmethod
    def backward(ctx, grad):
        saved, slope, ctx.saved, ctx.slope = ctx.saved, ctx.slope, None, None
        if slope is not None:
            return grad * slope.decode(grad.dtype), None, None, None
        x = saved.decode()
        return torch.ops.aten.gelu_backward(grad, x.to(grad.dtype), approximate=ctx.approximate), None, None, None
