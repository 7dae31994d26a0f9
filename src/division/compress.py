"""The saving policy: custom autograd functions that keep compressed copies of what backward needs.

``install(model, policy)`` points the forward of every covered module (Conv2d, BatchNorm2d, SyncBatchNorm,
Linear, ReLU, MaxPool2d, Dropout, average pools, LayerNorm, GELU) at a function that, in training steps
only, runs the exact forward and hands the tensor backward needs to ``policy.save``. Parameters, buffers and the state_dict are untouched;
eval mode and ``torch.no_grad()`` run the module's own forward. Modules whose class overrides ``forward``
(timm's fused or "same"-padding variants, for example) keep their own autograd and are reported uncovered.

One ``SavePolicy`` decides, per tensor, which codec keeps it, and keeps a tensor saved by two layers once.
"""
import types
import weakref
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef

from division.codecs.packing import pack_bits, unpack_bits
from division.codecs.quant import BitMask, FullCopy, Packed, check_backend, storage_key, unique_nbytes

LAYER_KINDS = ("conv", "bn", "linear", "relu", "maxpool", "dropout", "avgpool", "ln", "gelu", "attn")


def check_layer_kinds(kinds) -> tuple:
    kinds = tuple(kinds)
    bad = [k for k in kinds if k not in LAYER_KINDS]
    if bad:
        raise ValueError(f"unknown layer kind(s) {bad}; valid choices: {list(LAYER_KINDS)}")
    return kinds


@dataclass
class SaveRecord:
    """What one layer holds for backward in the last training forward."""

    layer: str
    kind: str
    codec: str
    shape: tuple
    fp_bytes: int
    held: List[tuple] = field(default_factory=list)  # (storage key, nbytes) of tensors held
    fp_key: Optional[tuple] = None  # storage of the full-precision tensor plain autograd would hold
    shared: bool = False  # served from a tensor another layer already saved
    backend: str = ""  # the codec implementation that encoded it ("" when nothing was encoded)


class TensorIds:
    """Identity of a storage during one forward: its address plus a generation that changes when the storage
    first seen there has been freed, so a freed address reused by a new tensor is not taken for the old one.
    Holds only weak references: measuring identity keeps no memory alive."""

    def __init__(self):
        self._table: Dict[tuple, tuple] = {}
        self._next = 0

    def __call__(self, t: torch.Tensor) -> tuple:
        key = storage_key(t)
        entry = self._table.get(key)
        if entry is not None and not entry[0].expired():
            return key + (entry[1],)
        self._next += 1
        self._table[key] = (StorageWeakRef(t.untyped_storage()), self._next)
        return key + (self._next,)


class SavePolicy:
    """Holds a codec choice per tensor and the per-forward bookkeeping (dedup cache and records).

    ``choose(kind, x) -> Packed`` is the method's decision; ``reuse_relu_mask`` multiplies a rebuilt ReLU
    output by the ReLU's exact mask.
    """

    def __init__(self, choose: Callable[[str, torch.Tensor], Packed], kinds=LAYER_KINDS,
                 reuse_relu_mask: bool = False, backend: str = "auto"):
        self.choose = choose
        self.backend = check_backend(backend)
        self.kinds = frozenset(check_layer_kinds(kinds))
        self.reuse_relu_mask = reuse_relu_mask
        self._cache: Dict[tuple, tuple] = {}
        self._masks: Dict[tuple, tuple] = {}
        self.records: List[SaveRecord] = []
        self.ids = TensorIds()
        self.enabled = True

    def begin_forward(self):
        self._cache = {}
        self._masks = {}
        self.records = []
        self.ids = TensorIds()

    def end_forward(self):
        self._cache = {}
        self._masks = {}

    @staticmethod
    def _key(x: torch.Tensor) -> tuple:
        return (storage_key(x), x.storage_offset(), tuple(x.shape), tuple(x.stride()), x._version)

    def _relu_mask(self, x: torch.Tensor):
        entry = self._masks.get(self._key(x)[:4])
        return entry[1] if entry is not None and entry[0]() is x else None

    def _lookup(self, x: torch.Tensor):
        hit = self._cache.get(self._key(x))
        if hit is None or hit[0]() is None:
            return None
        return hit

    def save(self, x: torch.Tensor, kind: str, layer: str) -> "Saved":
        """Compress ``x`` for a layer of ``kind``, or reuse what was saved for the very same tensor."""
        hit = self._lookup(x)
        packed = hit[1] if hit is not None else None
        mask = hit[2] if hit is not None else None
        if mask is None:
            mask = self._relu_mask(x)
        record = SaveRecord(layer, kind, "", tuple(x.shape), x.numel() * x.element_size(),
                            fp_key=self.ids(x))
        if packed is not None:
            record.codec, record.shared = packed.kind, True
        else:
            packed = self.choose(kind, x)
            record.codec = packed.kind
            record.backend = "" if packed.backend == "none" else packed.backend
            record.held = [(storage_key(t), t.untyped_storage().nbytes()) for t in packed.tensors() if t is not None]
            self._cache[self._key(x)] = (weakref.ref(x), packed, mask)
        self.records.append(record)
        use_mask = mask if (self.reuse_relu_mask and packed.kind != "full") else None
        return Saved(packed, use_mask, tuple(x.shape))

    def save_mask(self, y: torch.Tensor, mask: BitMask, kind: str, layer: str, fp_bytes: int, fp_key=None):
        """Record an exact mask (ReLU, dropout) and remember it for a later compression of ``y``."""
        self.records.append(SaveRecord(layer, kind, mask.kind, tuple(y.shape), fp_bytes,
                                       [(storage_key(mask.packed), mask.packed.untyped_storage().nbytes())],
                                       fp_key=fp_key, backend=mask.backend))
        if kind == "relu":
            # an in-place ReLU's output gets its version bumped after forward: match it by identity
            self._masks[self._key(y)[:4]] = (weakref.ref(y), mask)

    def save_extra(self, t: torch.Tensor, kind: str, layer: str, codec: str, fp_bytes: int, fp_key=None):
        self.records.append(SaveRecord(layer, kind, codec, tuple(t.shape), fp_bytes,
                                       [(storage_key(t), t.untyped_storage().nbytes())], fp_key=fp_key))

    def save_nothing(self, kind: str, layer: str, shape, fp_bytes: int, fp_key=None):
        self.records.append(SaveRecord(layer, kind, "none", tuple(shape), fp_bytes, [], fp_key=fp_key))


class Saved:
    """A packed activation and, with ``reuse_relu_mask``, the exact mask of the ReLU that produced it."""

    __slots__ = ("packed", "mask", "packed_shape")

    def __init__(self, packed: Packed, mask: Optional[BitMask], shape=None):
        self.packed, self.mask, self.packed_shape = packed, mask, shape

    def decode(self) -> torch.Tensor:
        x = self.packed.decode()
        return x if self.mask is None else self.mask.apply(x)


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
    gw = grad.new_zeros(cout, x.shape[1])
    for i in range(n):
        gw.addmm_(grad[i].reshape(cout, -1), xs[i].reshape(x.shape[1], -1).t())
    return gw.view(cout, x.shape[1], 1, 1)


def _pointwise_input_grad(shape, w, grad, stride):
    """dX of a 1x1 convolution: W^T (Cin x Cout) @ grad_n, scattered to the strided positions."""
    n, cin, h, wd = shape
    cout = w.shape[0]
    gy = torch.matmul(w.view(cout, cin).t(), grad.reshape(n, cout, -1))
    if tuple(stride) == (1, 1):
        return gy.view(shape)
    gx = grad.new_zeros(shape)
    gx[:, :, ::stride[0], ::stride[1]] = gy.view(n, cin, *grad.shape[2:])
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


class _BatchNorm2dFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps, policy, layer):
        out, save_mean, save_invstd = torch.ops.aten.native_batch_norm(
            x, weight, bias, running_mean, running_var, True, momentum, eps)
        ctx.saved = policy.save(x, "bn", layer)
        ctx.eps = eps
        ctx.x_dtype = x.dtype
        ctx.save_for_backward(weight, bias, save_mean, save_invstd)
        return out

    @staticmethod
    def backward(ctx, grad):
        weight, bias, save_mean, save_invstd = ctx.saved_tensors
        x = ctx.saved.decode().to(ctx.x_dtype)
        ctx.saved = None
        mask = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[1],
                bias is not None and ctx.needs_input_grad[2]]
        gx, gw, gb = torch.ops.aten.native_batch_norm_backward(
            grad.contiguous().to(ctx.x_dtype), x, weight, None, None, save_mean, save_invstd, True, ctx.eps, mask)
        return gx, gw, gb, None, None, None, None, None, None


class _SyncBatchNorm2dFn(torch.autograd.Function):
    """Batch norm over the union of all ranks' batches, keeping a compressed input.

    Forward gathers each rank's (count, mean, M2) in one collective and merges them with Chan's formula
    (exact, no sum-of-squares cancellation); backward all-reduces the two per-channel sums the input
    gradient needs. Weight and bias gradients stay local: DDP averages them, as it does for
    ``nn.SyncBatchNorm``. Works on any backend (gloo on CPU included), unlike PyTorch's own.
    """
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps, group, policy, layer):
        dims = (0, 2, 3)
        xf = x.float()
        count = x.numel() // x.shape[1]
        local_mean = xf.mean(dims)
        local_m2 = ((xf - local_mean[None, :, None, None]) ** 2).sum(dims)
        mine = torch.cat([local_mean.new_tensor([count]), local_mean, local_m2])
        world = torch.distributed.get_world_size(group)
        gathered = [torch.empty_like(mine) for _ in range(world)]
        torch.distributed.all_gather(gathered, mine, group=group)
        stats = torch.stack(gathered)
        counts, means, m2s = stats[:, :1], stats[:, 1:1 + x.shape[1]], stats[:, 1 + x.shape[1]:]
        total = counts.sum()
        mean = (counts * means).sum(0) / total
        m2 = (m2s + counts * (means - mean) ** 2).sum(0)
        var = m2 / total
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None:
            with torch.no_grad():
                running_mean.lerp_(mean.to(running_mean.dtype), momentum)
                running_var.lerp_((m2 / (total - 1).clamp(min=1)).to(running_var.dtype), momentum)
        scale = invstd if weight is None else invstd * weight.float()
        shift = -mean * scale if bias is None else bias.float() - mean * scale
        out = (xf * scale[None, :, None, None] + shift[None, :, None, None]).to(x.dtype)
        ctx.saved = policy.save(x, "bn", layer)
        param_dtype = next((p.dtype for p in (weight, bias) if p is not None), x.dtype)
        ctx.conf = (x.dtype, param_dtype, group, float(total), weight is not None, bias is not None)
        ctx.save_for_backward(weight, mean, invstd)
        return out

    @staticmethod
    def backward(ctx, grad):
        weight, mean, invstd = ctx.saved_tensors
        dtype, param_dtype, group, total, has_weight, has_bias = ctx.conf
        x = ctx.saved.decode().float()
        ctx.saved = None
        g = grad.float()
        xhat = (x - mean[None, :, None, None]) * invstd[None, :, None, None]
        del x
        local = torch.cat([g.sum((0, 2, 3)), (g * xhat).sum((0, 2, 3))])
        gw = local[mean.numel():].to(param_dtype) if has_weight and ctx.needs_input_grad[1] else None
        gb = local[:mean.numel()].to(param_dtype) if has_bias and ctx.needs_input_grad[2] else None
        gx = None
        if ctx.needs_input_grad[0]:
            both = local.clone()  # gw and gb are views of ``local`` and must stay this rank's own
            torch.distributed.all_reduce(both, group=group)
            mean_g, mean_gxhat = (both / total).split(mean.numel())
            scale = invstd if weight is None else invstd * weight.float()
            gx = ((g - mean_g[None, :, None, None] - xhat * mean_gxhat[None, :, None, None])
                  * scale[None, :, None, None]).to(dtype)
        return gx, gw, gb, None, None, None, None, None, None, None


class _ReLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, inplace, policy, layer):
        fp_bytes, fp_key = x.numel() * x.element_size(), policy.ids(x)
        if inplace:
            y = x.clamp_min_(0)
            ctx.mark_dirty(x)
        else:
            y = x.clamp_min(0)
        mask = BitMask.positive(y, policy.backend)
        ctx.mask = mask
        policy.save_mask(y, mask, "relu", layer, fp_bytes, fp_key if inplace else policy.ids(y))
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


def _sample_chunks(n: int, per_sample: int, target: int = 1 << 21):
    """Slices of the batch holding about ``target`` elements each: index arithmetic on int64 would otherwise
    make several full-size temporaries (8 bytes per element) at the largest maps of the network."""
    step = max(1, target // max(per_sample, 1))
    return [slice(a, min(a + step, n)) for a in range(0, n, step)]


class _MaxPool2dFn(torch.autograd.Function):
    """Keeps, for each output, the position of the maximum inside its window: log2(kh*kw) bits, not int64.
    Forward and backward work through the batch in chunks so that no int64 index tensor of the whole batch
    exists."""

    @staticmethod
    def _window_origin(oh, ow, stride, padding, device):
        h0 = (torch.arange(oh, device=device) * stride[0] - padding[0]).view(oh, 1)
        w0 = (torch.arange(ow, device=device) * stride[1] - padding[1]).view(1, ow)
        return h0, w0

    @staticmethod
    def forward(ctx, x, kernel, stride, padding, ceil_mode, policy, layer):
        n, c, h, w = x.shape
        kh, kw = kernel
        bits = 1
        while (1 << bits) < kh * kw:
            bits *= 2
        outs, offsets = [], []
        for part in _sample_chunks(n, c * h * w):
            out, idx = F.max_pool2d(x[part], kernel, stride, padding, 1, ceil_mode, return_indices=True)
            h0, w0 = _MaxPool2dFn._window_origin(*out.shape[-2:], stride, padding, x.device)
            offsets.append(((idx // w - h0) * kw + (idx % w - w0)).to(torch.uint8))
            del idx
            outs.append(out)
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        ctx.offsets = pack_bits(offsets[0] if len(offsets) == 1 else torch.cat(offsets), bits)
        del offsets
        ctx.conf = (x.shape, out.shape, kernel, stride, padding, bits)
        policy.save_extra(ctx.offsets, "maxpool", layer, f"{bits}-bit index", out.numel() * 8)
        policy.save_nothing("maxpool", layer + ".input", x.shape, x.numel() * x.element_size(), policy.ids(x))
        return out

    @staticmethod
    def backward(ctx, grad):
        (n, c, h, w), oshape, (kh, kw), stride, padding, bits = ctx.conf
        oh, ow = oshape[-2:]
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


class _LayerNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shape, weight, bias, eps, policy, layer):
        if torch.is_autocast_enabled(x.device.type):
            x = x.float()  # autocast runs layer norm in fp32
        out, mean, rstd = torch.native_layer_norm(x, shape, weight, bias, eps)
        ctx.saved = policy.save(x, "ln", layer)
        ctx.shape = shape
        ctx.save_for_backward(weight, bias, mean, rstd)
        return out

    @staticmethod
    def backward(ctx, grad):
        weight, bias, mean, rstd = ctx.saved_tensors
        x = ctx.saved.decode()
        ctx.saved = None
        mask = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[2],
                bias is not None and ctx.needs_input_grad[3]]
        gx, gw, gb = torch.ops.aten.native_layer_norm_backward(grad.to(x.dtype), x, ctx.shape, mean, rstd,
                                                               weight, bias, mask)
        return gx, None, gw, gb, None, None, None


class _GeluFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, approximate, policy, layer):
        ctx.saved = policy.save(x, "gelu", layer)
        ctx.approximate = approximate
        return F.gelu(x, approximate=approximate)

    @staticmethod
    def backward(ctx, grad):
        x = ctx.saved.decode()
        ctx.saved = None
        return torch.ops.aten.gelu_backward(grad, x.to(grad.dtype), approximate=ctx.approximate), None, None, None


class _AttentionFn(torch.autograd.Function):
    """Scaled-dot-product attention that keeps compressed q, k, v (as (batch*heads, tokens, head_dim)
    token tensors) and recomputes the attention from them in backward; nothing of size tokens^2 is held."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal, scale, policy, layer):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)
        ctx.saved = [policy.save(t.reshape(-1, *t.shape[-2:]), "attn", f"{layer}.{n}") for n, t in zip("qkv", (q, k, v))]
        ctx.shapes = [t.shape for t in (q, k, v)]
        ctx.conf = (is_causal, scale, [t.dtype for t in (q, k, v)])
        return out

    @staticmethod
    def backward(ctx, grad):
        is_causal, scale, dtypes = ctx.conf
        with torch.enable_grad():
            qkv = [s.decode().view(shape).to(dt).requires_grad_() for s, shape, dt in zip(ctx.saved, ctx.shapes, dtypes)]
            out = F.scaled_dot_product_attention(*qkv, is_causal=is_causal, scale=scale)
            grads = torch.autograd.grad(out, qkv, grad)
        ctx.saved = None
        return (*grads, None, None, None, None)


class AttentionMode(torch.overrides.TorchFunctionMode):
    """Active only during a prepared model's training forward: routes F.scaled_dot_product_attention
    (without mask or dropout) through :class:`_AttentionFn`. Scoped to the model, no global patching."""

    def __init__(self, policy: "SavePolicy"):
        super().__init__()
        self.policy = policy
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and self.policy.enabled and torch.is_grad_enabled():
            q, k, v = args[:3]
            extra = dict(zip(("attn_mask", "dropout_p", "is_causal", "scale"), args[3:]), **kwargs)
            if (extra.get("attn_mask") is None and not extra.get("dropout_p") and not extra.get("enable_gqa")
                    and q.requires_grad | k.requires_grad | v.requires_grad):
                self.calls += 1
                return _AttentionFn.apply(q, k, v, bool(extra.get("is_causal", False)), extra.get("scale"),
                                          self.policy, f"attention{self.calls}")
        return func(*args, **kwargs)


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


def _pair(v):
    return tuple(v) if isinstance(v, (tuple, list)) else (v, v)


def _routed(route):
    """A forward for module ``m`` that, in training steps, calls ``route(m, x, policy, name, plain)``; a
    ``None`` from the route (a case it does not cover) falls back to the module's own forward."""
    def make(m, policy, name):
        plain = type(m).forward

        def forward(self, x):
            out = route(self, x, policy, name, plain) if _training_step(self, x, policy) else None
            return plain(self, x) if out is None else out
        return forward
    return make


def _conv(m, x, policy, name, plain):
    if x.dim() == 4:
        return _Conv2dFn.apply(x, m.weight, m.bias, m.stride, m.padding, m.dilation, m.groups, policy, name)


def _linear(m, x, policy, name, plain):
    return _LinearFn.apply(x, m.weight, m.bias, policy, name)


def _bn_momentum(m):
    """Count this training step and return the running-statistics momentum; None if the layer keeps none."""
    if not (m.track_running_stats and m.running_mean is not None):
        return None
    m.num_batches_tracked.add_(1)
    return 1.0 / float(m.num_batches_tracked) if m.momentum is None else m.momentum


def _bn(m, x, policy, name, plain):
    momentum = _bn_momentum(m)
    if momentum is None:
        return None
    return _BatchNorm2dFn.apply(x, m.weight, m.bias, m.running_mean, m.running_var, momentum, m.eps, policy, name)


def _sync_bn(m, x, policy, name, plain):
    """SyncBatchNorm on a 4-D input; one rank (or no process group) is plain batch norm."""
    if x.dim() != 4:
        return None
    group = m.process_group or (torch.distributed.group.WORLD if torch.distributed.is_initialized() else None)
    if group is None or torch.distributed.get_world_size(group) == 1:
        return _bn(m, x, policy, name, plain)
    momentum = _bn_momentum(m)
    running = (m.running_mean, m.running_var) if momentum is not None else (None, None)
    return _SyncBatchNorm2dFn.apply(x, m.weight, m.bias, *running, momentum or 0.0, m.eps, group, policy, name)


def _relu(m, x, policy, name, plain):
    return _ReLUFn.apply(x, m.inplace and not x.is_leaf, policy, name)


def _dropout(m, x, policy, name, plain):
    if 0 < m.p < 1:
        return _DropoutFn.apply(x, m.p, policy, name)


def _maxpool(m, x, policy, name, plain):
    kernel = _pair(m.kernel_size)
    if x.dim() != 4 or m.return_indices or _pair(m.dilation) != (1, 1) or kernel[0] * kernel[1] > 256:
        return None
    stride = _pair(m.stride if m.stride is not None else m.kernel_size)
    return _MaxPool2dFn.apply(x, kernel, stride, _pair(m.padding), m.ceil_mode, policy, name)


def _avgpool(m, x, policy, name, plain):
    return _LinearOpFn.apply(x, types.MethodType(plain, m), policy, name)


def _layer_norm(m, x, policy, name, plain):
    return _LayerNormFn.apply(x, list(m.normalized_shape), m.weight, m.bias, m.eps, policy, name)


def _gelu(m, x, policy, name, plain):
    return _GeluFn.apply(x, m.approximate, policy, name)


def _training_step(module, x, policy) -> bool:
    return (policy.enabled and module.training and torch.is_grad_enabled() and isinstance(x, torch.Tensor)
            and x.is_floating_point())


_COVERED = (
    (nn.Conv2d, "conv", _routed(_conv)),
    (nn.Linear, "linear", _routed(_linear)),
    (nn.BatchNorm2d, "bn", _routed(_bn)),
    (nn.SyncBatchNorm, "bn", _routed(_sync_bn)),
    (nn.ReLU, "relu", _routed(_relu)),
    (nn.Dropout, "dropout", _routed(_dropout)),
    (nn.MaxPool2d, "maxpool", _routed(_maxpool)),
    (nn.AvgPool2d, "avgpool", _routed(_avgpool)),
    (nn.AdaptiveAvgPool2d, "avgpool", _routed(_avgpool)),
    (nn.LayerNorm, "ln", _routed(_layer_norm)),
    (nn.GELU, "gelu", _routed(_gelu)),
)


def _same_math(m: nn.Module, cls) -> bool:
    """The module computes exactly what ``cls`` does: its own class, or a subclass known to (timm's
    LayerNorm without its fast-norm option)."""
    if type(m).forward is cls.forward:
        return True
    qualname = f"{type(m).__module__}.{type(m).__qualname__}"
    return qualname == "timm.layers.norm.LayerNorm" and not getattr(m, "_fast_norm", True)


def _covered_kind(m: nn.Module):
    for cls, kind, make in _COVERED:
        if isinstance(m, cls) and _same_math(m, cls):
            if kind == "conv" and (m.padding_mode != "zeros" or isinstance(m.padding, str)):
                return None
            return kind, make
    return None


def install(model: nn.Module, policy: SavePolicy) -> List[str]:
    """Route the covered modules of ``model`` through ``policy``; returns the names of covered modules.

    A forward pre-hook and hook on the root open and close one forward's bookkeeping.
    """
    if getattr(model, "_division_policy", None) is not None:
        raise RuntimeError("model is already prepared by a method; call remove(model) first")
    covered = []
    for name, m in model.named_modules():
        found = _covered_kind(m)
        if found is None or found[0] not in policy.kinds:
            continue
        kind, make = found
        m.forward = types.MethodType(make(m, policy, name or kind), m)
        covered.append(name)
    modes = []
    # the function mode costs a Python call per op: enter it only in models that have attention
    has_attention = any(isinstance(m, nn.MultiheadAttention) or type(m).__name__.endswith("Attention")
                        for m in model.modules())

    def begin(mod, args):
        policy.begin_forward()
        if has_attention and "attn" in policy.kinds and mod.training and torch.is_grad_enabled() and policy.enabled:
            mode = AttentionMode(policy)
            mode.__enter__()
            modes.append(mode)

    def end(mod, args, out):
        while modes:
            modes.pop().__exit__(None, None, None)
        policy.end_forward()

    handles = [model.register_forward_pre_hook(begin), model.register_forward_hook(end)]
    object.__setattr__(model, "_division_policy", policy)
    object.__setattr__(model, "_division_handles", handles)
    return covered


def remove(model: nn.Module) -> None:
    """Undo :func:`install`: every module gets its class's forward back."""
    for m in model.modules():
        if "forward" in m.__dict__:
            del m.__dict__["forward"]
    for h in getattr(model, "_division_handles", []):
        h.remove()
    object.__setattr__(model, "_division_policy", None)
    object.__setattr__(model, "_division_handles", [])


def full_copy(kind: str, x: torch.Tensor) -> Packed:
    return FullCopy(x)


__all__ = ["SavePolicy", "SaveRecord", "TensorIds", "install", "remove", "LAYER_KINDS", "check_layer_kinds",
           "full_copy", "storage_key", "unique_nbytes"]
