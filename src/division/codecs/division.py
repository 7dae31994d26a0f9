"""DIVISION's dual-precision codec (Wang et al., 2022).

x (N, C, H, W) -> LFC = average over B x B blocks (kept in bf16 by default) and
HFC = x - upsample_nearest(LFC as stored), quantized to ``hfc_bits`` per (sample, channel) with
stochastic rounding. A last partial block averages what it covers; a side shorter than B shrinks the block.
"""
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from division.codecs.quant import (STAT_DTYPES, Bf16Copy, Packed, QuantizedTensor, check_backend, check_bits,
                                   check_stat_dtype, decode_rows_compiled, encode_maps_compiled, kernel_library,
                                   quantize_per_row, quantize_rows_triton, use_triton)

LFC_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _encode_compiled(lib, x: torch.Tensor, block_hw, bits: int, stochastic: bool,
                     stat_bf16: bool = False, split=None) -> Optional["DivisionPacked"]:
    """The fused CPU kernel (division/kernels); None when a map holds NaN or Inf."""
    n, c, h, w = x.shape
    encoded = encode_maps_compiled(x, n * c, h, w, block_hw, bits, stochastic, lib=lib, stat_bf16=stat_bf16,
                                   split=split)
    if encoded is None:
        return None
    lfc, q = encoded
    bh, bw = block_hw
    return DivisionPacked(lfc.view(n, c, -(-h // bh), -(-w // bw)), q, block_hw, x.shape, x.dtype, compiled=True)


def _decode_compiled(p: "DivisionPacked") -> torch.Tensor:
    n, c, h, w = p.shape
    return decode_rows_compiled(p.hfc, p.lfc, (h, w), p.block_hw).view(n, c, h, w)


def lfc_blocks(height: int, width: int, block: int):
    """Block height and width for a map: B, shrunk to the side where the side is shorter."""
    return min(block, height), min(block, width)


def map_nbytes(height: int, width: int, block: int, bits: int, lfc_itemsize: int, stat_itemsize: int) -> float:
    """Bytes one (sample, channel) map takes under DIVISION: LFC, packed HFC, minimum and scale."""
    bh, bw = lfc_blocks(height, width, block)
    lfc = -(-height // bh) * -(-width // bw) * lfc_itemsize
    return lfc + height * width * bits / 8 + 2 * stat_itemsize


def block_average(x: torch.Tensor, block_hw) -> torch.Tensor:
    """Average over non-overlapping blocks; a partial last block averages only what it covers."""
    bh, bw = block_hw
    if bh == 1 and bw == 1:
        return x
    return F.avg_pool2d(x, (bh, bw), stride=(bh, bw), ceil_mode=True, count_include_pad=False)


def upsample_blocks(lfc: torch.Tensor, block_hw, height: int, width: int) -> torch.Tensor:
    """Nearest upsampling of block averages back to (height, width), cropping the partial last block."""
    bh, bw = block_hw
    if bh == 1 and bw == 1:
        return lfc
    n, c, hb, wb = lfc.shape
    up = lfc[:, :, :, None, :, None].expand(n, c, hb, bh, wb, bw).reshape(n, c, hb * bh, wb * bw)
    return up[:, :, :height, :width]


def add_blocks_(x: torch.Tensor, lfc: torch.Tensor, block_hw, sign: float = 1.0) -> torch.Tensor:
    """In place: x += sign * upsample(lfc), by broadcasting over block views (no upsampled copy) where the
    map divides into whole blocks."""
    n, c, h, w = x.shape
    bh, bw = block_hw
    if h % bh == 0 and w % bw == 0 and x.is_contiguous():
        view = x.view(n, c, h // bh, bh, w // bw, bw)
        view.add_(lfc.float()[:, :, :, None, :, None], alpha=sign)
    else:
        x.add_(upsample_blocks(lfc.float(), block_hw, h, w), alpha=sign)
    return x


@dataclass(eq=False)
class DivisionPacked(Packed):
    lfc: torch.Tensor
    hfc: QuantizedTensor
    block_hw: tuple
    shape: torch.Size
    dtype: torch.dtype
    bad_index: Optional[torch.Tensor] = None
    bad_value: Optional[torch.Tensor] = None
    compiled: bool = False
    kind = "division"

    @property
    def backend(self) -> str:
        return "compiled" if self.compiled else self.hfc.backend

    def tensors(self):
        return [self.lfc, *self.hfc.tensors(), self.bad_index, self.bad_value]

    def decode(self) -> torch.Tensor:
        n, c, h, w = self.shape
        if self.compiled:
            return _decode_compiled(self).to(self.dtype)
        if self.hfc.backend == "triton":
            return self.hfc.decode(self.dtype, self.lfc, (h, w), self.block_hw).view(n, c, h, w)
        x = self.hfc.decode(torch.float32).view(n, c, h, w)
        add_blocks_(x, self.lfc, self.block_hw)
        if self.hfc.zero_unset:
            x = self.hfc.split.apply(x, inplace=True)
        if self.bad_index is not None:
            x.view(-1)[self.bad_index] = self.bad_value.float()
        return x.to(self.dtype)


class DivisionCodec:
    """Encoder for 4-D maps. Maps with a 1x1 spatial size, fewer than ``min_numel`` elements, or so small
    that LFC plus HFC plus statistics would take as many bytes as bf16, are held in bf16."""

    def __init__(self, block_size: int = 8, hfc_bits: int = 2, lfc_dtype: str = "bf16", min_numel: int = 0,
                 stochastic: bool = True, backend: str = "auto", stat_dtype: str = "fp32"):
        self.backend = check_backend(backend)
        self.stat_dtype = check_stat_dtype(stat_dtype)
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size={block_size!r} is invalid; it must be an integer >= 1 (paper: 8)")
        if lfc_dtype not in LFC_DTYPES:
            raise ValueError(f"lfc_dtype={lfc_dtype!r} is invalid; valid choices: {list(LFC_DTYPES)}")
        if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 0:
            raise ValueError(f"min_numel={min_numel!r} is invalid; it must be an integer >= 0")
        self.block_size = block_size
        self.hfc_bits = check_bits(hfc_bits, "hfc_bits")
        self.lfc_dtype = LFC_DTYPES[lfc_dtype]
        self.min_numel = min_numel
        self.stochastic = stochastic

    def encode(self, x: torch.Tensor, split=None) -> Packed:
        """``split``: an exact mask the decoder holds too (BitMask over ``x``, a following ReLU's): the HFC of
        each map then gets one range per side of the mask (every backend)."""
        if x.dim() != 4:
            raise ValueError(f"DivisionCodec expects (N, C, H, W); got shape {tuple(x.shape)}")
        n, c, h, w = x.shape
        block_hw = lfc_blocks(h, w, self.block_size)
        if h * w == 1 or x.numel() < self.min_numel or self.map_nbytes(h, w) >= 2 * h * w:
            return Bf16Copy.encode(x)
        if use_triton(x, self.backend):
            lfc = self._lfc(x, block_hw)  # in x's dtype (no fp32 copy); a NaN or Inf flags its map on the device
            q = quantize_rows_triton(x.reshape(n * c, h * w), self.hfc_bits, self.stochastic, lfc=lfc,
                                     map_hw=(h, w), block_hw=block_hw, split=split,
                                     stat_bf16=self.stat_dtype == "bf16")
            return DivisionPacked(lfc, q, block_hw, x.shape, x.dtype)
        lib = self._compiled_library(x)
        if lib is not None:
            packed = _encode_compiled(lib, x, block_hw, self.hfc_bits, self.stochastic, self.stat_dtype == "bf16",
                                      split)
            if packed is not None:
                return packed
        xf = x.float()
        lfc = self._lfc(xf, block_hw)
        bad_index = bad_value = None
        if not bool(torch.isfinite(lfc).all()):
            # A NaN or Inf would spread over its whole block through the LFC: keep such elements exactly
            # and compress the rest as if they were zero.
            finite = torch.isfinite(xf)
            bad_index = (~finite).reshape(-1).nonzero().squeeze(1)
            bad_value = xf.reshape(-1)[bad_index].to(x.dtype)
            xf = torch.where(finite, xf, torch.zeros((), device=xf.device))
            lfc = self._lfc(xf, block_hw)
        hfc = xf.clone() if xf is x else xf.contiguous()
        add_blocks_(hfc, lfc, block_hw, sign=-1.0)
        q = quantize_per_row(hfc.reshape(n * c, h * w), self.hfc_bits, self.stochastic, backend=self.backend,
                             stat_dtype=self.stat_dtype, split=split)
        return DivisionPacked(lfc, q, block_hw, x.shape, x.dtype, bad_index, bad_value)

    def _compiled_library(self, x: torch.Tensor):
        """The CPU kernel library where it applies to ``x`` and the backend allows it, else None."""
        ok = x.device.type == "cpu" and self.lfc_dtype == torch.bfloat16 and x.dtype in (torch.float32, torch.bfloat16)
        return kernel_library(self.backend) if ok else None

    def map_nbytes(self, height: int, width: int) -> float:
        """Bytes DIVISION holds per (sample, channel) map: LFC, packed HFC, minimum and scale."""
        return map_nbytes(height, width, self.block_size, self.hfc_bits, self.lfc_dtype.itemsize,
                          STAT_DTYPES[self.stat_dtype].itemsize)

    def _lfc(self, xf: torch.Tensor, block_hw) -> torch.Tensor:
        lfc = block_average(xf, block_hw)
        if self.lfc_dtype == torch.float16:
            lfc = lfc.clamp(-65504.0, 65504.0)
        return lfc.to(self.lfc_dtype).contiguous()
