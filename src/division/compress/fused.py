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


class BnReluInput:
    """A convolution's input rebuilt in backward as mask * (y * alpha + beta) from the batch norm's saved
    ``y``: the same interface as a saved tensor (``decode``, ``packed_shape``), no bytes of its own beyond
    two per-channel vectors."""

    __slots__ = ("bn", "mask", "packed_shape")

    def __init__(self, bn: BnOutput, mask: BitMask, shape):
        self.bn, self.mask, self.packed_shape = bn, mask, tuple(shape)

    def decode(self) -> torch.Tensor:
        """The batch norm's backward comes right after (through the ReLU's): it gets this decode of ``y``
        once, instead of decoding it again (``Saved.keep_decoded``)."""
        y = self.bn.saved.decode()
        self.bn.saved.keep_decoded(y)
        lib = _float_kernel(y, self.mask.backend) if self.mask.backend == "compiled" else None
        if lib is not None and y.dim() >= 2 and y.is_contiguous():
            a = torch.empty_like(y)
            lib.bn_relu_rebuild(y.data_ptr(), self.bn.alpha.data_ptr(), self.bn.beta.data_ptr(),
                                self.mask.packed.data_ptr(), y.shape[0] * y.shape[1], y.shape[1],
                                y[0, 0].numel(), a.data_ptr(), torch.get_num_threads())
            return a.to(self.bn.dtype)
        a = torch.addcmul(self.bn.beta[None, :, None, None], y.float(), self.bn.alpha[None, :, None, None])
        return self.mask.apply(a).to(self.bn.dtype)

    def nbytes(self) -> int:
        return self.bn.alpha.untyped_storage().nbytes() + self.bn.beta.untyped_storage().nbytes()
