"""BatchNorm -> ReLU -> convolution without a copy of the convolution's input.

The input of a convolution that follows a batch norm and a ReLU is ``relu(bn(y))``: fully determined by the
batch norm's input ``y`` (which the batch norm keeps compressed for its own backward anyway), its batch
statistics and the ReLU's exact 1-bit mask. With ``fuse_bn_relu`` the convolution holds nothing of its own
and rebuilds its input in backward. Chains are found from the model's own forward by tensor identity (no
per-architecture code): the batch norm notes its output, the ReLU links its output to that note when the
tensor is unchanged since, and a convolution whose input is such a ReLU output, unchanged since, takes the
fused path; anything else saves as usual.
"""
from typing import Optional

import torch

from division.codecs.base import _float_kernel
from division.codecs.quant import BitMask


class BnOutput:
    """What a training batch norm leaves for a following ReLU: its saved (compressed) input and the affine
    map it applied, out = y * alpha + beta per channel, in float32."""

    __slots__ = ("saved", "alpha", "beta", "dtype", "layer")

    def __init__(self, saved, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], mean: torch.Tensor,
                 invstd: torch.Tensor, dtype: torch.dtype, layer: Optional[str] = None):
        alpha = invstd.float() if weight is None else invstd.float() * weight.detach().float()
        beta = -mean.float() * alpha if bias is None else bias.detach().float() - mean.float() * alpha
        self.saved, self.alpha, self.beta, self.dtype, self.layer = saved, alpha, beta, dtype, layer

    def affine(self, y: torch.Tensor) -> torch.Tensor:
        """The batch norm's output rebuilt from (a decode of) its input ``y``, in float32."""
        return torch.addcmul(self.beta[None, :, None, None], y.float(), self.alpha[None, :, None, None])


class BnReluInput:
    """A convolution's input rebuilt in backward as mask * (y * alpha + beta) from the batch norm's saved
    ``y``: the same interface as a saved tensor (``decode``, ``packed_shape``), no bytes of its own beyond
    two per-channel vectors."""

    __slots__ = ("bn", "mask", "packed_shape")

    def __init__(self, bn: BnOutput, mask: BitMask, shape):
        self.bn, self.mask, self.packed_shape = bn, mask, tuple(shape)

    def decode(self, keep: bool = True) -> torch.Tensor:
        """The batch norm's backward comes right after (through the ReLU's): it gets this decode of ``y``
        once, instead of decoding it again (``Saved.keep_decoded``); ``keep=False`` where it does not (a
        residual rebuild reading this as its shortcut)."""
        y = self.bn.saved.decode()
        if keep:
            self.bn.saved.keep_decoded(y)
        lib = _float_kernel(y, self.mask.backend) if self.mask.backend == "compiled" else None
        if lib is not None and y.dim() >= 2 and y.is_contiguous():
            a = torch.empty_like(y)
            lib.bn_relu_rebuild(y.data_ptr(), self.bn.alpha.data_ptr(), self.bn.beta.data_ptr(),
                                self.mask.packed.data_ptr(), y.shape[0] * y.shape[1], y.shape[1],
                                y[0, 0].numel(), a.data_ptr(), torch.get_num_threads())
            return a.to(self.bn.dtype)
        return self.mask.apply(self.bn.affine(y)).to(self.bn.dtype)

    def nbytes(self) -> int:
        return self.bn.alpha.untyped_storage().nbytes() + self.bn.beta.untyped_storage().nbytes()


class ResidualSum:
    """What ``bn_output + shortcut`` leaves for a following ReLU (``fuse_residual``): the batch norm's output,
    and a shortcut the policy can rebuild (another batch norm's output, a rebuilt ReLU output, or codes it
    holds anyway)."""

    __slots__ = ("bn", "other")

    def __init__(self, bn: BnOutput, other):
        self.bn, self.other = bn, other


class ResidualReluInput:
    """A convolution's input rebuilt in backward as mask * (y * alpha + beta + shortcut) (``fuse_residual``):
    a residual block's output, which the next block's first convolution reads, is fully determined by the
    block's last batch norm's saved input, the shortcut and the ReLU's exact mask, so that convolution holds
    nothing of its own. The shortcut is rebuilt in turn where it is itself a rebuilt ReLU output (a chain
    through a stage): each link's rounding error adds, which the budget's probe measures."""

    __slots__ = ("sum", "mask", "packed_shape", "dtype")

    def __init__(self, residual: ResidualSum, mask: BitMask, shape, dtype):
        self.sum, self.mask, self.packed_shape, self.dtype = residual, mask, tuple(shape), dtype

    def decode(self, keep: bool = True) -> torch.Tensor:
        """``keep``: hand the batch norm's decode of ``y`` to its backward, which comes after this block's
        ReLU's (as BnReluInput does); a rebuild reading this as its shortcut passes False."""
        bn = self.sum.bn
        y = bn.saved.decode()
        if keep:
            bn.saved.keep_decoded(y)
        a = bn.affine(y)
        a += rebuild(self.sum.other).float()
        return self.mask.apply(a).to(self.dtype)

    def nbytes(self) -> int:
        return self.sum.bn.alpha.untyped_storage().nbytes() + self.sum.bn.beta.untyped_storage().nbytes()


def rebuild(source) -> torch.Tensor:
    """A shortcut's value in backward: a batch norm's output (its affine map of the saved input), a rebuilt
    ReLU output (without handing decodes on), or held codes."""
    if isinstance(source, BnOutput):
        return source.affine(source.saved.decode())
    if isinstance(source, (BnReluInput, ResidualReluInput)):
        return source.decode(keep=False)
    return source.decode()


_ADDS = frozenset({torch.add, torch.Tensor.add, torch.Tensor.add_, torch.Tensor.__add__, torch.Tensor.__radd__,
                   torch.Tensor.__iadd__})


class ResidualMode(torch.overrides.TorchFunctionMode):
    """Active only during a prepared model's training forward with ``fuse_residual``: notes each addition of a
    batch norm's untouched output and a shortcut the policy can rebuild, so that a ReLU on the sum can link
    its output to a :class:`ResidualReluInput` (found from the model's own forward, no per-architecture code;
    ``out += identity`` and ``out + identity`` alike)."""

    def __init__(self, policy):
        super().__init__()
        self.policy = policy

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _ADDS or len(args) != 2 or kwargs or not all(isinstance(a, torch.Tensor) for a in args):
            return func(*args, **kwargs)
        residual = self.policy.residual_sum(*args)  # before the addition: an in-place one changes args[0]
        out = func(*args)
        if residual is not None:
            self.policy.note_residual(out, residual)
        return out
