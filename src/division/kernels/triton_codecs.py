"""Triton kernels for the CUDA path: DIVISION encode/decode (the per-row quantizers are the same kernels
without an LFC), ReLU mask pack/apply, and WRPN's k-bit ReLU with its mask.

Layout is the reference's (``division.codecs``): rows of ``row_len`` elements (a (sample, channel) map, or
an ActNN group), one minimum and scale per row in fp32 or bf16 (two per row with a split mask), codes packed little end first over the flattened
tensor, 8/bits codes per byte. One program per row; a row is loaded as a (BLOCK/PER, PER) tile so that the
PER codes of one byte are reduced into it in registers.

No host synchronisation: the random seed comes from the CPU generator, and a row holding NaN or Inf is not
inspected on the host. The kernel flags it on the device (``bad`` per row) and decodes it as NaN: the step's
gradients become non-finite as they would have anyway, and fp16's GradScaler skips the step. (The CPU paths
keep non-finite elements exactly.)

With ``TRITON_INTERPRET=1`` the same kernels run on CPU tensors; the tests use that to check them against
the reference on machines without a GPU.
"""
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # triton ships with CUDA builds of torch; CPU-only installs may lack it
    triton = tl = None


def available(device: torch.device) -> bool:
    """Triton can serve tensors on ``device``: CUDA, or any device under the interpreter."""
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:
    @triton.jit
    def _bf16_down(v):
        """bf16 value at or below ``v`` (as float32): truncate, one more unit of magnitude if negative."""
        u = v.to(tl.uint32, bitcast=True)
        t = u & 0xFFFF0000
        t = tl.where((t != u) & ((u >> 31) != 0), t + 0x10000, t)
        return t.to(tl.float32, bitcast=True)

    @triton.jit
    def _bf16_up(v):
        """bf16 value at or above ``v`` >= 0 (as float32)."""
        u = v.to(tl.uint32, bitcast=True)
        t = u & 0xFFFF0000
        t = tl.where(t != u, t + 0x10000, t)
        return t.to(tl.float32, bitcast=True)

    @triton.jit
    def _range(x, chosen, levels, STAT_BF16: tl.constexpr):
        """Minimum and scale of the chosen elements (0, 0 when none), bf16-rounded outward if asked."""
        mn = tl.min(tl.min(tl.where(chosen, x, float("inf")), axis=1), axis=0)
        mx = tl.max(tl.max(tl.where(chosen, x, -float("inf")), axis=1), axis=0)
        empty = mn > mx
        mn = tl.where(empty, 0.0, mn)
        mx = tl.where(empty, 0.0, mx)
        if STAT_BF16:
            mn = _bf16_down(mn)
            scale = _bf16_up((mx - mn) / levels)
        else:
            scale = (mx - mn) / levels
        return mn, scale

    @triton.jit
    def _encode_rows(x_ptr, lfc_ptr, packed_ptr, codes_ptr, min_ptr, scale_ptr, bad_ptr, split_ptr, seed,
                     row_len, w, wb, bh, bw, lfc_row,
                     BITS: tl.constexpr, PER: tl.constexpr, BLOCK: tl.constexpr, HAS_LFC: tl.constexpr,
                     STOCHASTIC: tl.constexpr, ALIGNED: tl.constexpr, FIXED: tl.constexpr,
                     SPLIT: tl.constexpr, STAT_BF16: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK // PER)[:, None] * PER + tl.arange(0, PER)[None, :]
        inside = offs < row_len
        x = tl.load(x_ptr + row * row_len + offs, mask=inside, other=0.0).to(tl.float32)
        if HAS_LFC:
            block = (offs // w // bh) * wb + (offs % w) // bw
            low = tl.load(lfc_ptr + row * lfc_row + block, mask=inside, other=0.0).to(tl.float32)
            x = x - low
        finite = (x == x) & (tl.abs(x) < float("inf"))
        bad = tl.max(tl.max(tl.where(inside & ~finite, 1, 0), axis=1), axis=0)
        x = tl.where(finite, x, 0.0)
        levels = (1 << BITS) - 1
        if SPLIT:  # two ranges, one per side of an exact mask the decoder holds too
            flat = row * row_len + offs
            side = ((tl.load(split_ptr + flat // 8, mask=inside, other=0).to(tl.int32) >> (flat % 8)) & 1) != 0
            mn0, scale0 = _range(x, inside & ~side, levels, STAT_BF16)
            mn1, scale1 = _range(x, inside & side, levels, STAT_BF16)
            tl.store(min_ptr + 2 * row, mn0)
            tl.store(min_ptr + 2 * row + 1, mn1)
            tl.store(scale_ptr + 2 * row, scale0)
            tl.store(scale_ptr + 2 * row + 1, scale1)
            mn = tl.where(side, mn1, mn0)
            scale = tl.where(side, scale1, scale0)
        elif FIXED:  # one range for every row (BLPA), given in element 0
            mn = tl.load(min_ptr)
            scale = tl.load(scale_ptr)
        else:
            mn, scale = _range(x, inside, levels, STAT_BF16)
        inv = tl.where(scale > 0, 1.0 / scale, 0.0)
        v = (x - mn) * inv
        if STOCHASTIC:
            v = v + tl.rand(seed, row * row_len + offs)
        else:
            v = v + 0.5
        q = tl.minimum(tl.maximum(tl.floor(v), 0.0), levels).to(tl.int32)
        if not FIXED and not SPLIT:
            tl.store(min_ptr + row, mn)
            tl.store(scale_ptr + row, scale)
        tl.store(bad_ptr + row, bad.to(tl.int8))
        if ALIGNED:
            shifts = (tl.arange(0, PER) * BITS)[None, :]
            byte = tl.sum(q << shifts, axis=1)
            bytes_at = tl.arange(0, BLOCK // PER)
            tl.store(packed_ptr + row * (row_len // PER) + bytes_at, byte.to(tl.uint8),
                     mask=bytes_at * PER < row_len)
        else:
            tl.store(codes_ptr + row * row_len + offs, q.to(tl.uint8), mask=inside)

    @triton.jit
    def _decode_rows(packed_ptr, lfc_ptr, min_ptr, scale_ptr, bad_ptr, out_ptr, split_ptr,
                     row_len, w, wb, bh, bw, lfc_row,
                     BITS: tl.constexpr, PER: tl.constexpr, BLOCK: tl.constexpr, HAS_LFC: tl.constexpr,
                     SHARED: tl.constexpr, SPLIT: tl.constexpr):
        row = tl.program_id(0)
        stat = 0 if SHARED else row
        offs = tl.arange(0, BLOCK)
        inside = offs < row_len
        flat = row * row_len + offs
        byte = tl.load(packed_ptr + flat // PER, mask=inside, other=0).to(tl.int32)
        q = (byte >> ((flat % PER) * BITS)) & ((1 << BITS) - 1)
        if SPLIT:
            side = (tl.load(split_ptr + flat // 8, mask=inside, other=0).to(tl.int32) >> (flat % 8)) & 1
            x = tl.load(min_ptr + 2 * row + side) + q.to(tl.float32) * tl.load(scale_ptr + 2 * row + side)
        else:
            x = tl.load(min_ptr + stat) + q.to(tl.float32) * tl.load(scale_ptr + stat)
        if HAS_LFC:
            block = (offs // w // bh) * wb + (offs % w) // bw
            x = x + tl.load(lfc_ptr + row * lfc_row + block, mask=inside, other=0.0).to(tl.float32)
        bad = tl.load(bad_ptr + row)
        x = tl.where(bad != 0, float("nan"), x)
        tl.store(out_ptr + flat, x, mask=inside)

    @triton.jit
    def _mask_tile(start, BLOCK: tl.constexpr):
        """A block's element offsets as a (BLOCK/8, 8) tile: one row per mask byte."""
        return start + tl.arange(0, BLOCK // 8)[:, None] * 8 + tl.arange(0, 8)[None, :]

    @triton.jit
    def _store_mask_bytes(out_ptr, keep, start, n, BLOCK: tl.constexpr):
        """Packs a (BLOCK/8, 8) boolean tile into its bytes, little end first."""
        bits = tl.where(keep, 1, 0) << tl.arange(0, 8)[None, :]
        byte_at = start // 8 + tl.arange(0, BLOCK // 8)
        tl.store(out_ptr + byte_at, tl.sum(bits, axis=1).to(tl.uint8), mask=byte_at * 8 < n)

    @triton.jit
    def _mask_positive(y_ptr, out_ptr, n, BLOCK: tl.constexpr):
        start = tl.program_id(0) * BLOCK
        offs = _mask_tile(start, BLOCK)
        y = tl.load(y_ptr + offs, mask=offs < n, other=0.0)
        _store_mask_bytes(out_ptr, y > 0, start, n, BLOCK)

    @triton.jit
    def _quant_relu_mask(x_ptr, y_ptr, out_ptr, n, levels, BLOCK: tl.constexpr):
        """y = round_half_even(clamp(x, 0, 1) * levels) / levels (NaN kept), and the mask 0 < x < 1 packed as
        _mask_positive packs it."""
        start = tl.program_id(0) * BLOCK
        offs = _mask_tile(start, BLOCK)
        inside = offs < n
        x = tl.load(x_ptr + offs, mask=inside, other=0.0)
        v = tl.minimum(tl.maximum(x, 0.0), 1.0) * levels
        low = tl.floor(v)
        odd = low - 2.0 * tl.floor(low * 0.5)
        up = v - low
        rounded = tl.where(up > 0.5, low + 1.0, tl.where(up < 0.5, low, low + odd))
        tl.store(y_ptr + offs, tl.where(x != x, x, tl.div_rn(rounded, levels)), mask=inside)
        _store_mask_bytes(out_ptr, (x > 0) & (x < 1), start, n, BLOCK)

    @triton.jit
    def _mask_apply(g_ptr, mask_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < n
        g = tl.load(g_ptr + offs, mask=inside, other=0.0)
        keep = (tl.load(mask_ptr + offs // 8, mask=inside, other=0).to(tl.int32) >> (offs % 8)) & 1
        tl.store(out_ptr + offs, tl.where(keep != 0, g, 0.0), mask=inside)


def _block(row_len: int, per: int) -> int:
    return max(triton.next_power_of_2(row_len), per, 16)


def encode_rows(x: torch.Tensor, rows: int, row_len: int, bits: int, stochastic: bool, lfc=None, map_hw=None,
                block_hw=None, generator=None, fixed_range=None, split=None, stat_bf16: bool = False):
    """Quantize ``x`` viewed as (rows, row_len), after subtracting the upsampled ``lfc`` (rows of hb*wb block
    means of (h, w) maps) if given; ``fixed_range`` = (minimum, maximum) device scalars shared by every row;
    ``split`` (packed mask bits over the flattened x): two ranges per row, laid out [row, side];
    ``stat_bf16``: statistics rounded outward to bf16 (returned as bf16).
    Returns (packed, minimum, scale, bad) on x's device (minimum and scale of one element when shared)."""
    from division.codecs.packing import pack_bits, packed_nbytes
    xc = x.contiguous()
    per = 8 // bits
    aligned = row_len % per == 0
    dev = x.device
    packed = torch.empty(packed_nbytes(rows * row_len, bits), dtype=torch.uint8, device=dev)
    codes = torch.empty(0 if aligned else rows * row_len, dtype=torch.uint8, device=dev)
    if fixed_range is not None:
        minimum = fixed_range[0].float().reshape(1).contiguous()
        scale = ((fixed_range[1].float() - fixed_range[0].float()) / ((1 << bits) - 1)).reshape(1).contiguous()
    else:
        minimum = torch.empty(rows * (2 if split is not None else 1), dtype=torch.float32, device=dev)
        scale = torch.empty_like(minimum)
    bad = torch.empty(rows, dtype=torch.int8, device=dev)
    seed = int(torch.randint(0, 2 ** 31 - 1, (1,), generator=generator).item()) if stochastic else 0
    h, w = map_hw if map_hw else (1, row_len)
    bh, bw = block_hw if block_hw else (1, 1)
    wb = -(-w // bw)
    lfc_row = (-(-h // bh)) * wb
    _encode_rows[(rows,)](xc, lfc if lfc is not None else xc, packed, codes, minimum, scale, bad,
                          split if split is not None else packed, seed, row_len, w, wb, bh, bw, lfc_row, BITS=bits,
                          PER=per, BLOCK=_block(row_len, per), HAS_LFC=lfc is not None,
                          STOCHASTIC=bool(stochastic), ALIGNED=aligned, FIXED=fixed_range is not None,
                          SPLIT=split is not None, STAT_BF16=bool(stat_bf16) and fixed_range is None)
    if not aligned:
        packed = pack_bits(codes, bits)
    if stat_bf16 and fixed_range is None:
        minimum, scale = minimum.to(torch.bfloat16), scale.to(torch.bfloat16)  # exact: bf16 values
    return packed, minimum, scale, bad


def decode_rows(packed, minimum, scale, bad, rows: int, row_len: int, bits: int, lfc=None, map_hw=None,
                block_hw=None, split=None) -> torch.Tensor:
    """Inverse of :func:`encode_rows`: a float32 (rows, row_len) tensor; flagged rows come back as NaN."""
    out = torch.empty(rows, row_len, dtype=torch.float32, device=packed.device)
    h, w = map_hw if map_hw else (1, row_len)
    bh, bw = block_hw if block_hw else (1, 1)
    wb = -(-w // bw)
    minimum, scale = minimum.float(), scale.float()
    _decode_rows[(rows,)](packed, lfc if lfc is not None else minimum, minimum, scale, bad, out,
                          split if split is not None else packed, row_len, w, wb, bh, bw, (-(-h // bh)) * wb,
                          BITS=bits, PER=8 // bits, BLOCK=max(triton.next_power_of_2(row_len), 16),
                          HAS_LFC=lfc is not None, SHARED=minimum.numel() == 1 and rows > 1,
                          SPLIT=split is not None)
    return out


MASK_BLOCK = 1024


def mask_positive(y: torch.Tensor) -> torch.Tensor:
    """Bit i of byte k is y[8k + i] > 0, packed on the device."""
    from division.codecs.packing import packed_nbytes
    yc = y.contiguous()
    out = torch.empty(packed_nbytes(y.numel(), 1), dtype=torch.uint8, device=y.device)
    _mask_positive[(triton.cdiv(y.numel(), MASK_BLOCK),)](yc, out, y.numel(), BLOCK=MASK_BLOCK)
    return out


def mask_apply(g: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    gc = g.contiguous()
    out = torch.empty_like(gc)
    _mask_apply[(triton.cdiv(g.numel(), MASK_BLOCK),)](gc, packed, out, g.numel(), BLOCK=MASK_BLOCK)
    return out


def quant_relu_mask(x: torch.Tensor, levels: int):
    """WRPN's k-bit ReLU of a float32 ``x`` and its gradient mask (0 < x < 1), in one pass on the device."""
    from division.codecs.packing import packed_nbytes
    xc = x.contiguous()
    y = torch.empty_like(xc)
    out = torch.empty(packed_nbytes(x.numel(), 1), dtype=torch.uint8, device=x.device)
    _quant_relu_mask[(triton.cdiv(x.numel(), MASK_BLOCK),)](xc, y, out, x.numel(), float(levels), BLOCK=MASK_BLOCK)
    return y, out
