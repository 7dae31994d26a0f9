"""Plain quantizers without an LFC: ActNN-style groups, per-(sample, channel) rows, BLPA's per-layer range."""
from dataclasses import dataclass

import torch

from division.codecs.base import Rearranged
from division.codecs.quant import (STAT_DTYPES, Bf16Copy, Packed, QuantizedTensor, check_backend, check_bits,
                                   check_stat_dtype, quantize_per_row)


@dataclass(eq=False)
class ReshapedQuantized(Rearranged):
    """A quantized tensor whose rows came from a reshaped (and possibly padded) view of the activation."""

    q: QuantizedTensor
    shape: torch.Size
    samples: int = 1  # the padding (if any) sits at the end of each sample's flattened row

    def decode(self) -> torch.Tensor:
        per_sample = self.shape.numel() // self.samples if self.samples else 0
        return self.q.decode().reshape(self.samples, -1)[:, :per_sample].reshape(self.shape)


class GroupwiseCodec:
    """ActNN's L2 level (Chen et al., 2021): each sample's activation, flattened, is cut into groups of
    ``group_size`` contiguous elements; every group gets its own minimum and range; stochastic rounding."""

    def __init__(self, bits: int = 2, group_size: int = 256, stochastic: bool = True, backend: str = "auto",
                 stat_dtype: str = "fp32"):
        self.backend = check_backend(backend)
        self.stat_dtype = check_stat_dtype(stat_dtype)
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size={group_size!r} is invalid; it must be an integer >= 1 (ActNN: 256)")
        self.bits = check_bits(bits)
        self.group_size = group_size
        self.stochastic = stochastic

    def encode(self, x: torch.Tensor, split=None) -> Packed:
        """``split`` (an exact mask over ``x`` the decoder holds): two ranges per group; unused with padding."""
        n = x.shape[0] if x.dim() > 1 else 1
        flat = x.reshape(n, -1)
        pad = (-flat.shape[1]) % self.group_size
        if pad:  # repeat the last element, so padding never widens a group's range
            flat = torch.cat([flat, flat[:, -1:].expand(n, pad)], dim=1)
        q = quantize_per_row(flat.reshape(-1, self.group_size), self.bits, self.stochastic, backend=self.backend,
                             stat_dtype=self.stat_dtype, split=None if pad else split)
        return ReshapedQuantized(q, x.shape, n)


class PerChannelCodec:
    """A plain per-(sample, channel) quantizer: DIVISION without its LFC, at the same bits (an ablation)."""

    def __init__(self, bits: int = 2, stochastic: bool = True, min_numel: int = 0, backend: str = "auto",
                 stat_dtype: str = "fp32"):
        self.backend = check_backend(backend)
        self.stat_dtype = check_stat_dtype(stat_dtype)
        self.bits = check_bits(bits)
        self.stochastic = stochastic
        self.min_numel = min_numel

    def encode(self, x: torch.Tensor, split=None) -> Packed:
        if x.dim() != 4:
            raise ValueError(f"PerChannelCodec expects (N, C, H, W); got shape {tuple(x.shape)}")
        n, c, h, w = x.shape
        stat_bytes = 2 * STAT_DTYPES[self.stat_dtype].itemsize
        if h * w == 1 or x.numel() < self.min_numel or h * w * self.bits / 8 + stat_bytes >= 2 * h * w:
            return Bf16Copy.encode(x)
        q = quantize_per_row(x.reshape(n * c, h * w), self.bits, self.stochastic, backend=self.backend,
                             stat_dtype=self.stat_dtype, split=split)
        return ReshapedQuantized(q, x.shape)


class BlpaCodec:
    """BLPA (Chakrabarti & Moseley, 2019): the forward pass is exact and the copy kept for backward is a
    K-bit fixed-point approximation with one scale per layer.

    Choices made here where the paper leaves room: the layer's range is the current batch's minimum and
    maximum of the tensor (one scale per layer and step, so nothing is clipped); rounding is to the nearest
    level (deterministic), as in fixed-point approximation; the same codec serves every covered layer kind
    (the paper approximates the batch-norm/ReLU outputs that feed convolutions).
    """

    def __init__(self, bits: int = 4, stochastic: bool = False, backend: str = "auto"):
        self.bits = check_bits(bits)
        self.stochastic = stochastic
        self.backend = check_backend(backend)

    def encode(self, x: torch.Tensor) -> Packed:
        """One range for the layer, held once; the codes are cut into equal rows so that the compiled kernel
        spreads them over every thread."""
        flat = x.reshape(-1)
        mn, mx = torch.aminmax(flat.float())
        rows = parallel_rows(flat.numel())
        q = quantize_per_row(flat.view(rows, -1), self.bits, self.stochastic, minimum=mn.reshape(1),
                             maximum=mx.reshape(1), backend=self.backend)
        return ReshapedQuantized(q, x.shape)


def parallel_rows(numel: int, min_row: int = 4096) -> int:
    """The most rows (up to 256, a power of two) that divide ``numel`` into rows of at least ``min_row``."""
    rows = 256
    while rows > 1 and (numel % rows or numel // rows < min_row):
        rows //= 2
    return rows
