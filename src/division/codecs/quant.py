"""Row-wise stochastic b-bit quantization: the packed container and its encoders (Triton, the CPU kernel, the
PyTorch reference).

A row is the unit that shares one minimum and one scale: a (sample, channel) map for DIVISION's HFC, a
group of 256 contiguous elements for ActNN-style quantization, a whole layer for BLPA.
"""
from dataclasses import dataclass
from typing import Optional

import torch

from division.codecs.base import (BACKENDS, STAT_DTYPES, VALID_BITS, Packed, _float_kernel, bf16_outward, ieee_div,
                                  check_backend, check_bits, check_stat_dtype, kernel_library, rounding_generator,
                                  rounding_seed, storage_key, unique_nbytes, use_triton)
from division.codecs.exact import Bf16Copy, BitMask, FullCopy
from division.codecs.packing import pack_bits, packed_nbytes, unpack_bits

__all__ = ["QuantizedTensor", "quantize_per_row", "quantize_rows_reference", "quantize_rows_triton",
           "encode_maps_compiled", "decode_rows_compiled", "expected_quantized_nbytes",
           # the shared pieces, importable from here as before the split into base/exact
           "BACKENDS", "STAT_DTYPES", "VALID_BITS", "Packed", "bf16_outward", "check_backend", "check_bits",
           "check_stat_dtype", "kernel_library", "storage_key", "unique_nbytes", "use_triton", "_float_kernel",
           "Bf16Copy", "BitMask", "FullCopy"]


@dataclass(eq=False)
class QuantizedTensor(Packed):
    """Codes of shape (rows, row_len) packed to ``bits`` bits, with a float32 minimum and scale per row.

    Non-finite inputs (rare) are kept exactly as (flat index, value) pairs so that the codec never turns a
    finite value into NaN and never loses an Inf or NaN that was there.
    """

    packed: torch.Tensor
    minimum: torch.Tensor
    scale: torch.Tensor
    bits: int
    rows: int
    row_len: int
    dtype: torch.dtype
    bad_index: Optional[torch.Tensor] = None
    bad_value: Optional[torch.Tensor] = None
    backend: str = "reference"
    bad_rows: Optional[torch.Tensor] = None  # Triton: int8 per row, set where the row held NaN or Inf
    split: Optional["BitMask"] = None  # two ranges per row, chosen per element by this exact mask
    zero_unset: bool = False  # with a split: exactly 0 where it is unset (a ReLU's zeros, codes not held)
    kind = "quantized"

    def tensors(self):
        # a split mask is a ReLU's own mask: listed so the accounting sees it, counted once by storage
        return [self.packed, self.minimum, self.scale, self.bad_index, self.bad_value, self.bad_rows,
                None if self.split is None else self.split.packed]

    def decode(self, dtype: Optional[torch.dtype] = None, lfc=None, map_hw=None, block_hw=None) -> torch.Tensor:
        if self.backend == "triton":
            from division.kernels import triton_codecs
            return triton_codecs.decode_rows(self.packed, self.minimum, self.scale, self.bad_rows, self.rows,
                                             self.row_len, self.bits, lfc, map_hw, block_hw,
                                             None if self.split is None else self.split.packed,
                                             dtype=dtype or self.dtype, zero_unset=self.zero_unset)
        if self.backend == "compiled" and self.bad_index is None:
            return decode_rows_compiled(self).to(dtype or self.dtype)
        codes = unpack_bits(self.packed, self.bits, self.rows * self.row_len).view(self.rows, self.row_len)
        if self.split is not None:
            side = self.split.decode().view(self.rows, self.row_len).long()
            mn, sc = self.minimum.float().view(self.rows, 2), self.scale.float().view(self.rows, 2)
            x = codes.float() * sc.gather(1, side) + mn.gather(1, side)
            if self.zero_unset:  # (an LFC added later by DivisionPacked is masked there)
                x.masked_fill_(side.logical_not(), 0.0)
            return x.to(dtype or self.dtype)
        x = codes.float().mul_(self.scale.unsqueeze(1)).add_(self.minimum.unsqueeze(1))
        if self.bad_index is not None:
            x.view(-1)[self.bad_index] = self.bad_value.float()
        return x.to(dtype or self.dtype)


def quantize_per_row(x2d: torch.Tensor, bits: int, stochastic: bool = True,
                     minimum: Optional[torch.Tensor] = None, maximum: Optional[torch.Tensor] = None,
                     generator: Optional[torch.Generator] = None, backend: str = "auto",
                     stat_dtype: str = "fp32", split: Optional["BitMask"] = None) -> QuantizedTensor:
    """Quantize each row of a 2-D tensor to ``bits`` bits between its minimum and maximum.

    Stochastic rounding (floor(v + u), u ~ U[0,1)) makes the decoded value unbiased. A constant row has
    scale 0 and decodes exactly. ``minimum``/``maximum`` (one per row, or one for all rows) override the row
    statistics; values outside them are clamped (BLPA's per-layer range uses this). ``stat_dtype='bf16'``
    holds each row's minimum and scale in 16 bits (rounded outward, used as stored by encode and decode).
    ``split``, an exact mask over the flattened ``x2d`` that the decoder also holds (a ReLU's), gives each row
    two ranges, one per side of the mask. Every backend implements both.
    """
    rows, row_len = x2d.shape
    stat_bf16 = check_stat_dtype(stat_dtype) == "bf16"
    if split is not None and (minimum is not None or split.packed.device != x2d.device):
        split = None
    if use_triton(x2d, check_backend(backend)):
        if minimum is None and maximum is None:
            return quantize_rows_triton(x2d, bits, stochastic, generator, split=split, stat_bf16=stat_bf16)
        if minimum.numel() == 1 and maximum.numel() == 1:
            return quantize_rows_triton(x2d, bits, stochastic, generator, fixed_range=(minimum, maximum))
    if x2d.device.type == "cpu" and x2d.dtype in (torch.float32, torch.bfloat16):
        lib = kernel_library(check_backend(backend))
        if lib is not None:
            fast = _quantize_rows_compiled(lib, x2d, bits, stochastic, generator, minimum, maximum, stat_bf16,
                                           split)
            if fast is not None:
                return fast
    return quantize_rows_reference(x2d, bits, stochastic, minimum, maximum, generator, stat_bf16, split)


def quantize_rows_triton(x2d, bits, stochastic=True, generator=None, lfc=None, map_hw=None, block_hw=None,
                         fixed_range=None, split=None, stat_bf16=False):
    """The Triton kernel (division/kernels/triton_codecs.py): no host synchronisation."""
    from division.kernels import triton_codecs
    rows, row_len = x2d.shape
    split = split if split is not None and fixed_range is None else None
    packed, mn, scale, bad = triton_codecs.encode_rows(x2d, rows, row_len, bits, stochastic, lfc, map_hw, block_hw,
                                                       generator, fixed_range, None if split is None else split.packed,
                                                       stat_bf16)
    return QuantizedTensor(packed, mn, scale, bits, rows, row_len, x2d.dtype, backend="triton", bad_rows=bad,
                           split=split)


def quantize_rows_reference(x2d, bits, stochastic=True, minimum=None, maximum=None, generator=None,
                            stat_bf16=False, split=None):
    """The readable pure-PyTorch quantizer that every accelerated path is tested against."""
    rows, row_len = x2d.shape
    levels = (1 << bits) - 1
    xf = x2d.float()
    bad_index = bad_value = None
    if minimum is None or maximum is None:
        mn, mx = torch.aminmax(xf, dim=1)
    else:
        mn, mx = minimum.float().expand(rows).clone(), maximum.float().expand(rows).clone()
    if not bool(torch.isfinite(mn).all() and torch.isfinite(mx).all()):
        finite = torch.isfinite(xf)
        bad_index = (~finite).view(-1).nonzero().squeeze(1)
        bad_value = xf.view(-1)[bad_index].to(x2d.dtype)
        inf = torch.tensor(float("inf"), device=xf.device)
        mn = torch.where(finite, xf, inf).amin(dim=1)
        mx = torch.where(finite, xf, -inf).amax(dim=1)
        no_finite = ~torch.isfinite(mn)
        mn = torch.where(no_finite, torch.zeros_like(mn), mn)
        mx = torch.where(no_finite, torch.zeros_like(mx), mx)
        xf = torch.where(finite, xf, mn.unsqueeze(1))
    if split is not None and bad_index is None:
        return _quantize_split_reference(xf, split, bits, stochastic, generator, stat_bf16, x2d.dtype)
    if stat_bf16 and minimum is None:
        mn, scale = bf16_outward(mn, mx, levels)
    else:
        scale = ieee_div(mx - mn, levels)
    inv_scale = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    v = (xf - mn.unsqueeze(1)).mul_(inv_scale.unsqueeze(1))
    if stochastic:
        v.add_(torch.rand(v.shape, device=v.device, generator=rounding_generator(generator, v.device))).floor_()
    else:
        v.round_()
    codes = v.clamp_(0, levels).to(torch.uint8)
    if minimum is not None and minimum.numel() == 1 and bad_index is None:
        mn, scale = mn[:1], scale[:1]  # one shared range (BLPA) is held once
    if stat_bf16 and minimum is None:
        mn, scale = mn.to(torch.bfloat16), scale.to(torch.bfloat16)  # exact: they hold bf16 values
    return QuantizedTensor(pack_bits(codes, bits), mn.contiguous(), scale.contiguous(), bits, rows, row_len,
                           x2d.dtype, bad_index, bad_value)


def _quantize_split_reference(xf, split, bits, stochastic, generator, stat_bf16, dtype):
    """Two ranges per row, one for the elements where ``split`` is set and one for the rest; minimum and
    scale laid out as [row, side] (as the CPU kernel does)."""
    rows, row_len = xf.shape
    levels = (1 << bits) - 1
    side = split.decode().view(rows, row_len)
    inf = torch.tensor(float("inf"), device=xf.device)
    mins, scales = [], []
    for chosen in (side.logical_not(), side):
        lo = torch.where(chosen, xf, inf).amin(dim=1)
        hi = torch.where(chosen, xf, -inf).amax(dim=1)
        empty = ~(lo <= hi)
        lo, hi = lo.masked_fill(empty, 0.0), hi.masked_fill(empty, 0.0)
        lo, sc = bf16_outward(lo, hi, levels) if stat_bf16 else (lo, ieee_div(hi - lo, levels))
        mins.append(lo)
        scales.append(sc)
    mn, scale = torch.stack(mins, 1), torch.stack(scales, 1)
    pick = side.long()
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    v = (xf - mn.gather(1, pick)).mul_(inv.gather(1, pick))
    if stochastic:
        v.add_(torch.rand(v.shape, device=v.device, generator=rounding_generator(generator, v.device))).floor_()
    else:
        v.round_()
    codes = v.clamp_(0, levels).to(torch.uint8)
    stat = torch.bfloat16 if stat_bf16 else torch.float32
    return QuantizedTensor(pack_bits(codes, bits), mn.reshape(-1).to(stat), scale.reshape(-1).to(stat), bits, rows,
                           row_len, dtype, split=split)


def _quantize_rows_compiled(lib, x2d, bits, stochastic, generator, minimum=None, maximum=None, stat_bf16=False,
                            split=None):
    """The fused CPU kernel without an LFC (rows as 1 x n maps); None if a row (or the given range) is not
    finite. A given range is shared by all rows and is held once."""
    rows, row_len = x2d.shape
    fixed = None
    if minimum is not None and maximum is not None:
        if minimum.numel() != 1 or maximum.numel() != 1:
            return None
        levels = (1 << bits) - 1
        mn, mx = minimum.float().reshape(1).cpu(), maximum.float().reshape(1).cpu()
        if not bool(torch.isfinite(mn).all() and torch.isfinite(mx).all()):
            return None
        fixed = (mn, ieee_div(mx - mn, levels))
    encoded = encode_maps_compiled(x2d, rows, 1, row_len, None, bits, stochastic, generator, lib=lib,
                                   fixed_range=fixed, stat_bf16=stat_bf16 and fixed is None, split=split)
    return None if encoded is None else encoded[1]


def encode_maps_compiled(x: torch.Tensor, maps: int, h: int, w: int, block_hw, bits: int, stochastic: bool,
                         generator=None, lib=None, fixed_range=None, stat_bf16=False, split=None):
    """``x`` as ``maps`` maps of h x w through the fused CPU kernel: (bf16 LFC of ``block_hw`` blocks, or None
    without blocks; the b-bit HFC). None when a map holds NaN or Inf, which the reference path keeps exactly.
    ``fixed_range`` = (minimum, scale), one element each: every map uses it (values outside are clamped).
    ``stat_bf16``: per-map minimum and scale held in bf16 (rounded outward by the kernel). ``split``: a BitMask
    over the flattened ``x``; two ranges per map, one per side of the mask."""
    if lib is None:
        lib = kernel_library("compiled")
    xc = x.float().contiguous()
    numel = maps * h * w
    bh, bw = block_hw if block_hw else (1, w)
    lfc = torch.empty(maps * -(-h // bh) * -(-w // bw), dtype=torch.bfloat16) if block_hw else None
    if fixed_range is not None:
        minimum = fixed_range[0].expand(maps).contiguous()
        scale = fixed_range[1].expand(maps).contiguous()
    else:
        minimum = torch.empty(maps * (2 if split is not None else 1), dtype=torch.float32)
        scale = torch.empty_like(minimum)
    aligned = (h * w * bits) % 8 == 0
    codes = torch.empty(0 if aligned else numel, dtype=torch.uint8)
    packed = torch.empty(packed_nbytes(numel, bits), dtype=torch.uint8)
    seed = rounding_seed(generator) if stochastic else 0
    threads = torch.get_num_threads()
    bad = lib.division_encode(xc.data_ptr(), maps, h, w, bh, bw, bits, seed, int(stochastic),
                              None if lfc is None else lfc.data_ptr(), minimum.data_ptr(), scale.data_ptr(),
                              codes.data_ptr(), packed.data_ptr(), threads, int(fixed_range is not None),
                              int(stat_bf16), None if split is None else split.packed.data_ptr())
    if bad:
        return None
    if not aligned:
        lib.pack_codes(codes.data_ptr(), numel, bits, packed.data_ptr(), threads)
    if fixed_range is not None:
        minimum, scale = fixed_range[0].clone(), fixed_range[1].clone()
    elif stat_bf16:
        minimum, scale = minimum.to(torch.bfloat16), scale.to(torch.bfloat16)  # exact: the kernel rounded them
    return lfc, QuantizedTensor(packed, minimum, scale, bits, maps, h * w, x.dtype, backend="compiled",
                                split=split)


def decode_rows_compiled(q: "QuantizedTensor", lfc=None, map_hw=None, block_hw=None) -> torch.Tensor:
    """The CPU kernel's decode: rows (or h x w maps plus their bf16 LFC), float32 of shape (rows, row_len)."""
    from division import kernels
    h, w = map_hw or (1, q.row_len)
    bh, bw = block_hw or (1, w)
    per_row = 2 if q.split is not None else 1
    minimum, scale = (t.float().expand(q.rows * per_row).contiguous() for t in (q.minimum, q.scale))  # shared: once
    out = torch.empty((q.rows, q.row_len), dtype=torch.float32)
    failed = kernels.library().division_decode(
        q.packed.data_ptr(), None if lfc is None else lfc.data_ptr(), minimum.data_ptr(), scale.data_ptr(), q.rows,
        h, w, bh, bw, q.bits, out.data_ptr(), torch.get_num_threads(),
        None if q.split is None else q.split.packed.data_ptr(), int(q.split is not None and q.zero_unset))
    if failed:
        raise MemoryError(f"decode kernel could not allocate its row buffers ({failed} rows left)")
    return out


def expected_quantized_nbytes(rows: int, row_len: int, bits: int) -> int:
    """Analytic size of a :class:`QuantizedTensor` with finite input: packed codes plus fp32 min and scale."""
    return packed_nbytes(rows * row_len, bits) + 8 * rows
