"""Routing: ``install(model, policy)`` points the forward of every covered module at the compressed autograd
function of its family, in training steps only; ``remove(model)`` undoes exactly that."""
import types
from typing import List

import torch
import torch.nn as nn

from division.compress.attention import AttentionMode
from division.compress.fused import ResidualMode
from division.compress.linear import _Conv2dFn, _LinearFn
from division.compress.norm import _BatchNorm2dFn, _LayerNormFn, _SyncBatchNorm2dFn
from division.compress.pointwise import _DropoutFn, _GeluFn, _ReLUFn
from division.compress.policy import SavePolicy
from division.compress.pooling import _LinearOpFn, _MaxPool2dFn

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


def numeric_padding(m: nn.Conv2d):
    """The convolution's padding as numbers: 'valid' is 0; 'same' is (dilation * (kernel - 1)) / 2 per side
    where that is whole (odd effective kernels, the common case); None where 'same' pads unevenly."""
    if not isinstance(m.padding, str):
        return tuple(m.padding)
    if m.padding == "valid":
        return (0, 0)
    total = [d * (k - 1) for d, k in zip(m.dilation, m.kernel_size)]
    return None if any(t % 2 for t in total) else tuple(t // 2 for t in total)


def _conv(m, x, policy, name, plain):
    if x.dim() == 4:
        return _Conv2dFn.apply(x, m.weight, m.bias, m.stride, numeric_padding(m), m.dilation, m.groups, policy,
                               name)


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
    """A training forward whose backward needs this layer: its input or one of its own parameters requires a
    gradient. A layer outside the graph (a frozen stem fed the batch, whatever follows it while nothing
    requires a gradient) runs its own forward and keeps nothing, as plain autograd does, instead of encoding
    codes that no backward reads."""
    return (policy.enabled and module.training and torch.is_grad_enabled() and isinstance(x, torch.Tensor)
            and x.is_floating_point()
            and (x.requires_grad or any(p.requires_grad for p in module.parameters(recurse=False))))


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
            if kind == "conv" and (m.padding_mode != "zeros" or numeric_padding(m) is None):
                return None
            return kind, make
    return None


def install(model: nn.Module, policy: SavePolicy, routes=None) -> List[str]:
    """Route the covered modules of ``model`` through ``policy``; returns the names of covered modules.

    ``routes`` (kind -> make(module, policy, name) -> forward) replaces the forward of a layer kind.
    A module whose instance already carries its own ``forward`` (patched by someone else) is left alone. A
    forward pre-hook and a hook on the root open and close one forward's bookkeeping; the closing hook runs
    even when the forward raises, so the attention function mode never outlives its forward.
    """
    if getattr(model, "_division_policy", None) is not None:
        raise RuntimeError("model is already prepared by a method; call remove(model) first")
    covered, patched = [], []
    for name, m in model.named_modules():
        found = _covered_kind(m)
        if found is None or found[0] not in policy.kinds or "forward" in m.__dict__:
            continue
        kind, make = found
        make = (routes or {}).get(kind, make)  # a method's own forward for a layer kind (WRPN quantizes)
        m.forward = types.MethodType(make(m, policy, name or kind), m)
        covered.append(name)
        patched.append(m)
    modes = []
    # the function mode costs a Python call per op: enter it only in models that have attention
    has_attention = any(isinstance(m, nn.MultiheadAttention) or type(m).__name__.endswith("Attention")
                        for m in model.modules())

    def begin(mod, args, kwargs):
        policy.begin_forward((*args, *kwargs.values()),
                             training=mod.training and torch.is_grad_enabled() and policy.enabled)
        active = mod.training and torch.is_grad_enabled() and policy.enabled
        new = []
        if has_attention and "attn" in policy.kinds and active:
            new.append(AttentionMode(policy))
        if policy.fuse_residual and active:  # notes additions (compress/fused.py): a Python call per op
            new.append(ResidualMode(policy))
        for mode in new:  # only this forward's: modes a forward still running entered stay entered once
            mode.__enter__()
            modes.append(mode)

    def end(mod, args, out):
        while modes:
            modes.pop().__exit__(None, None, None)
        policy.end_forward()

    handles = [model.register_forward_pre_hook(begin, with_kwargs=True),
               model.register_forward_hook(end, always_call=True)]
    object.__setattr__(model, "_division_policy", policy)
    object.__setattr__(model, "_division_handles", handles)
    object.__setattr__(model, "_division_patched", patched)
    return covered


def remove(model: nn.Module) -> None:
    """Undo :func:`install`, and only that: the modules it patched get their class's forward back, its two
    hooks go; forwards that others set on instances stay."""
    for m in getattr(model, "_division_patched", []):
        m.__dict__.pop("forward", None)
    for h in getattr(model, "_division_handles", []):
        h.remove()
    object.__setattr__(model, "_division_policy", None)
    object.__setattr__(model, "_division_handles", [])
    object.__setattr__(model, "_division_patched", [])
