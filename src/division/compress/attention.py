"""Scaled-dot-product attention keeping compressed q, k, v, and the function mode that routes to it."""
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from division.compress.policy import SavePolicy

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
