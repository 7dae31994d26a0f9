"""Pooling: max-pool keeps the winner's position in its window, average pools keep nothing."""
import torch
import torch.nn.functional as F

from division.codecs.base import _float_kernel
from division.codecs.packing import pack_bits, packed_nbytes, unpack_bits


def _pooled_size(size: int, k: int, s: int, p: int, ceil_mode: bool) -> int:
    """PyTorch's output length of a pooling window (dilation 1)."""
    out = (size + 2 * p - k + (s - 1 if ceil_mode else 0)) // s + 1
    if ceil_mode and (out - 1) * s >= size + p:
        out -= 1
    return out


def _maxpool_compiled(lib, x, ctx, ceil_mode):
    """Max-pool through the CPU kernel: the output and each winner's packed window position, one pass."""
    (n, c, h, w), (kh, kw), stride, padding, bits = ctx.conf
    oh, ow = (_pooled_size(h, kh, stride[0], padding[0], ceil_mode),
              _pooled_size(w, kw, stride[1], padding[1], ceil_mode))
    out = torch.empty(n, c, oh, ow, dtype=x.dtype)
    codes = torch.empty(out.numel(), dtype=torch.uint8)
    threads = torch.get_num_threads()
    lib.maxpool_codes(x.data_ptr(), n * c, h, w, kh, kw, *stride, *padding, oh, ow, out.data_ptr(), codes.data_ptr(),
                      threads)
    ctx.offsets = torch.empty(packed_nbytes(out.numel(), bits), dtype=torch.uint8)
    lib.pack_codes(codes.data_ptr(), out.numel(), bits, ctx.offsets.data_ptr(), threads)
    ctx.out_shape = out.shape
    return out


def _sample_chunks(n: int, per_sample: int, target: int = 1 << 21):
    """Slices of the batch holding about ``target`` elements each: index arithmetic on int64 would otherwise
    make several full-size temporaries (8 bytes per element) at the largest maps of the network."""
    step = max(1, target // max(per_sample, 1))
    return [slice(a, min(a + step, n)) for a in range(0, n, step)]


class _MaxPool2dFn(torch.autograd.Function):
    """Keeps, for each output, the position of the maximum inside its window: log2(kh*kw) bits, not int64.
    On CPU float32 one kernel pass makes output and positions; otherwise forward and backward work through
    the batch in chunks so that no int64 index tensor of the whole batch exists."""

    @staticmethod
    def _window_origin(oh, ow, stride, padding, device):
        h0 = (torch.arange(oh, device=device) * stride[0] - padding[0]).view(oh, 1)
        w0 = (torch.arange(ow, device=device) * stride[1] - padding[1]).view(1, ow)
        return h0, w0

    @staticmethod
    def forward(ctx, x, kernel, stride, padding, ceil_mode, policy, layer):
        kh, kw = kernel
        bits = 1
        while (1 << bits) < kh * kw:
            bits *= 2
        ctx.conf = (x.shape, kernel, stride, padding, bits)
        ctx.lib = _float_kernel(x, policy.backend)
        if ctx.lib is not None:
            out = _maxpool_compiled(ctx.lib, x.contiguous(), ctx, ceil_mode)
        else:
            out = _MaxPool2dFn._forward_torch(ctx, x, kernel, stride, padding, ceil_mode, bits)
        policy.save_extra(ctx.offsets, "maxpool", layer, f"{bits}-bit index", out.numel() * 8)
        policy.save_nothing("maxpool", layer + ".input", x.shape, x.numel() * x.element_size(), policy.ids(x))
        return out

    @staticmethod
    def _forward_torch(ctx, x, kernel, stride, padding, ceil_mode, bits):
        n, c, h, w = x.shape
        kh, kw = kernel
        outs, offsets = [], []
        for part in _sample_chunks(n, c * h * w):
            out, idx = F.max_pool2d(x[part], kernel, stride, padding, 1, ceil_mode, return_indices=True)
            h0, w0 = _MaxPool2dFn._window_origin(*out.shape[-2:], stride, padding, x.device)
            offsets.append(((idx // w - h0) * kw + (idx % w - w0)).to(torch.uint8))
            del idx
            outs.append(out)
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        ctx.offsets = pack_bits(offsets[0] if len(offsets) == 1 else torch.cat(offsets), bits)
        ctx.out_shape = out.shape
        return out

    @staticmethod
    def backward(ctx, grad):
        (n, c, h, w), (kh, kw), stride, padding, bits = ctx.conf
        oshape = ctx.out_shape
        oh, ow = oshape[-2:]
        if ctx.lib is not None:  # the forward ran the kernel: a float32 CPU output, so a float32 CPU gradient
            gx = torch.zeros(n, c, h, w, dtype=grad.dtype)
            ctx.lib.maxpool_codes_backward(grad.contiguous().data_ptr(), ctx.offsets.data_ptr(), bits, n * c, h, w,
                                           kw, *stride, *padding, oh, ow, gx.data_ptr(), torch.get_num_threads())
            ctx.offsets = None
            return gx, None, None, None, None, None, None
        h0, w0 = _MaxPool2dFn._window_origin(oh, ow, stride, padding, grad.device)
        codes = unpack_bits(ctx.offsets, bits, grad.numel()).view(oshape)
        ctx.offsets = None
        gx = torch.zeros(n, c, h * w, dtype=grad.dtype, device=grad.device)
        for part in _sample_chunks(n, c * h * w):
            offset = codes[part].long()
            idx = (h0 + offset // kw) * w + (w0 + offset % kw)
            del offset
            gx[part].scatter_add_(2, idx.view(idx.shape[0], c, -1), grad[part].reshape(idx.shape[0], c, -1))
        return gx.view(n, c, h, w), None, None, None, None, None, None


class _LinearOpFn(torch.autograd.Function):
    """An average pool keeps nothing: it is linear, so its backward needs only the input's shape."""

    @staticmethod
    def forward(ctx, x, op, policy, layer):
        ctx.op, ctx.shape, ctx.dtype = op, x.shape, x.dtype
        policy.save_nothing("avgpool", layer, x.shape, x.numel() * x.element_size(), policy.ids(x))
        return op(x)

    @staticmethod
    def backward(ctx, grad):
        with torch.enable_grad():
            z = torch.zeros(ctx.shape, dtype=ctx.dtype, device=grad.device, requires_grad=True)
            (gx,) = torch.autograd.grad(ctx.op(z), z, grad)
        return gx, None, None, None
