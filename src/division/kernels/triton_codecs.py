"""Triton kernels for the CUDA path: DIVISION encode/decode (the per-row quantizers are the same kernels
without an LFC), ReLU mask pack/apply, and WRPN's k-bit ReLU with its mask.

Layout is the reference's (``division.codecs``): rows of ``row_len`` elements (a (sample, channel) map, or
an ActNN group), one minimum and scale per row in fp32 or bf16 (two per row with a split mask), codes packed
little end first over the flattened tensor, 8/bits codes per byte.

Tiling: a row is cut into tiles of at most ``DEFAULT_TILE`` elements, one program per (row, tile), so that
rows of any length run (Triton caps a block at 2^20 elements, and tiles past about 16K elements spill
registers). Rows that fit one tile are encoded by fused programs (statistics and codes in registers), several
short rows to a program (up to a tile's elements: a 7x7 map alone would leave most of a program idle); a
longer row takes two passes: per-tile minima and maxima, reduced per row on the device, then the codes.
Offsets into tensors are 64-bit, so tensors past 2^31 elements address correctly.

Arithmetic matches the PyTorch reference where it is deterministic: the same statistics (IEEE division,
``tl.div_rn``), round half to even for nearest rounding; stochastic rounding draws its own uniform numbers
(Philox keyed by seed + row, counter = position in the row // 4, four numbers a call).

No host synchronisation: the random seed comes from the CPU generator (``rounding_seed``: distinct per
distributed rank), and a row holding NaN or Inf is not inspected on the host. The kernel flags it on the
device (``bad`` per row) and decodes it as NaN: the step's gradients become non-finite as they would have
anyway, and fp16's GradScaler skips the step. (The CPU paths keep non-finite elements exactly.)

With ``TRITON_INTERPRET=1`` the same kernels run on CPU tensors; the tests use that to check them against
the reference on machines without a GPU (with a small ``DEFAULT_TILE`` to exercise multi-tile rows).
"""
import os
from dataclasses import dataclass
from typing import Optional

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # triton ships with CUDA builds of torch; CPU-only installs may lack it
    triton = tl = None

# Elements per program along a row; tests lower it (monkeypatch) to run multi-tile rows on small tensors.
DEFAULT_TILE = 4096
# Short rows share a program, up to DEFAULT_TILE elements (and MAX_ROWS rows) in all: one program per 7x7 or
# 14x14 map meant hundreds of thousands of tiny programs per ResNet-50 layer at batch 256 (the H200 profile:
# 0.54 ms per encode, 28 % of the step). Tests set MAX_ROWS = 1 to compare against one row per program.
MAX_ROWS = 64
MASK_BLOCK = 1024


@dataclass(frozen=True)
class Launch:
    """How the codec kernels are cut into programs: elements per program (``tile``, default DEFAULT_TILE),
    rows per program at most (``max_rows``, default MAX_ROWS) and warps per program. The codecs use the
    defaults; ``scripts/bench_codec.py --triton-sweep`` times others on a GPU to choose them by measurement."""
    tile: Optional[int] = None
    max_rows: Optional[int] = None
    num_warps: int = 4

    def cap(self) -> int:
        return self.tile or DEFAULT_TILE

    def rows_cap(self) -> int:
        return self.max_rows or MAX_ROWS


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
    def _min_max(x, chosen):
        """Per row of a (ROWS, ., .) tile: minimum and maximum of the chosen elements (+inf, -inf when none)."""
        mn = tl.min(tl.min(tl.where(chosen, x, float("inf")), axis=2), axis=1)
        mx = tl.max(tl.max(tl.where(chosen, x, -float("inf")), axis=2), axis=1)
        return mn, mx

    @triton.jit
    def _range(x, chosen, levels, STAT_BF16: tl.constexpr):
        """Per row: minimum and scale of the chosen elements (0, 0 when none), bf16-rounded outward if asked:
        the reference's arithmetic (``bf16_outward``, IEEE division)."""
        mn, mx = _min_max(x, chosen)
        levels = tl.full((), levels, tl.float32)
        empty = mn > mx
        mn = tl.where(empty, 0.0, mn)
        mx = tl.where(empty, 0.0, mx)
        if STAT_BF16:
            mn = _bf16_down(mn)
            scale = _bf16_up(tl.div_rn(mx - mn, levels))
        else:
            scale = tl.div_rn(mx - mn, levels)
        return mn, scale

    @triton.jit
    def _row_ids(n_rows, ROWS: tl.constexpr):
        """This program's rows (int64, shape (ROWS,)) and which of them exist."""
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        return rows, rows < n_rows

    @triton.jit
    def _load_tile(x_ptr, lfc_ptr, rows, row_ok, start, row_len, W: tl.constexpr, WB: tl.constexpr,
                   BH: tl.constexpr, BW: tl.constexpr, lfc_row,
                   PER: tl.constexpr, TILE: tl.constexpr, HAS_LFC: tl.constexpr):
        """The same tile of each of ``rows`` as a (ROWS, TILE/PER, PER) fp32 block (the PER codes of a byte in
        one line), the LFC subtracted, non-finite elements zeroed; with the in-row offsets, bounds mask and a
        NaN/Inf flag per row."""
        offs = start + tl.arange(0, TILE // PER)[None, :, None] * PER + tl.arange(0, PER)[None, None, :]
        r3 = rows[:, None, None]
        inside = (offs < row_len) & row_ok[:, None, None]
        x = tl.load(x_ptr + r3 * row_len + offs, mask=inside, other=0.0).to(tl.float32)
        if HAS_LFC:
            block = (offs // W // BH) * WB + (offs % W) // BW
            low = tl.load(lfc_ptr + r3 * lfc_row + block, mask=inside, other=0.0).to(tl.float32)
            x = x - low
        finite = (x == x) & (tl.abs(x) < float("inf"))
        bad = tl.max(tl.max(tl.where(inside & ~finite, 1, 0), axis=2), axis=1)
        return tl.where(finite, x, 0.0), offs, inside, bad

    @triton.jit
    def _split_side(split_ptr, rows3, row_len, offs, inside):
        """The split mask's bit for each element (1 = set), as int32."""
        flat = rows3 * row_len + offs
        return (tl.load(split_ptr + flat // 8, mask=inside, other=0).to(tl.int32) >> (flat % 8).to(tl.int32)) & 1

    @triton.jit
    def _uniform_tile(seeds, start, PER: tl.constexpr, TILE: tl.constexpr, ROWS: tl.constexpr):
        """Uniform numbers in [0, 1) for in-row positions start .. start + TILE - 1 of each row (its own seed),
        as a (ROWS, TILE/PER, PER) block: one Philox call gives four, so position p takes one of the four
        outputs at counter p // 4 (a quarter of the random-number arithmetic of one call per element; the
        numbers depend on the seed and position alone, so any tiling and any rows per program draw the same)."""
        r0, r1, r2, r3 = tl.randint4x(seeds[:, None], start // 4 + tl.arange(0, TILE // 4)[None, :])
        u = tl.reshape(tl.join(tl.join(r0, r1), tl.join(r2, r3)), (ROWS, TILE // PER, PER))
        return tl.random.uint_to_uniform_float(u)

    @triton.jit
    def _round_half_even(v):
        """torch.round's rounding (ties to even) for v >= 0 below 2^23."""
        low = tl.floor(v)
        odd = low - 2.0 * tl.floor(low * 0.5)
        frac = v - low
        return tl.where(frac > 0.5, low + 1.0, tl.where(frac < 0.5, low, low + odd))

    @triton.jit
    def _tile_stats(x_ptr, lfc_ptr, split_ptr, pmin_ptr, pmax_ptr, pbad_ptr, n_rows, row_len,
                    W: tl.constexpr, WB: tl.constexpr, BH: tl.constexpr, BW: tl.constexpr, lfc_row,
                    tiles, PER: tl.constexpr, TILE: tl.constexpr, HAS_LFC: tl.constexpr, SPLIT: tl.constexpr):
        """Pass 1 of a multi-tile row (one row per program): this tile's minimum and maximum (per side with a
        split), and its flag."""
        rows, row_ok = _row_ids(n_rows, 1)
        tile = tl.program_id(1)
        x, offs, inside, bad = _load_tile(x_ptr, lfc_ptr, rows, row_ok, tile * TILE, row_len, W, WB, BH, BW,
                                          lfc_row, PER, TILE, HAS_LFC)
        at = rows * tiles + tile
        tl.store(pbad_ptr + at, bad.to(tl.int8))
        if SPLIT:
            side = _split_side(split_ptr, rows[:, None, None], row_len, offs, inside) != 0
            mn0, mx0 = _min_max(x, inside & ~side)
            mn1, mx1 = _min_max(x, inside & side)
            tl.store(pmin_ptr + 2 * at, mn0)
            tl.store(pmax_ptr + 2 * at, mx0)
            tl.store(pmin_ptr + 2 * at + 1, mn1)
            tl.store(pmax_ptr + 2 * at + 1, mx1)
        else:
            mn, mx = _min_max(x, inside)
            tl.store(pmin_ptr + at, mn)
            tl.store(pmax_ptr + at, mx)

    @triton.jit
    def _encode_tiles(x_ptr, lfc_ptr, packed_ptr, codes_ptr, min_ptr, scale_ptr, bad_ptr, split_ptr, seed,
                      n_rows, row_len, W: tl.constexpr, WB: tl.constexpr, BH: tl.constexpr, BW: tl.constexpr,
                      lfc_row, tiles,
                      BITS: tl.constexpr, PER: tl.constexpr, TILE: tl.constexpr, ROWS: tl.constexpr,
                      HAS_LFC: tl.constexpr, STOCHASTIC: tl.constexpr, ALIGNED: tl.constexpr,
                      STATS: tl.constexpr, SPLIT: tl.constexpr, STAT_BF16: tl.constexpr):
        """Codes of one tile of ROWS rows (ROWS > 1 only for rows of one tile: many short rows per program
        instead of one program each). STATS: 0 = each row is this one tile: compute its statistics (and flag)
        here; 1 = read the row's statistics (pass 1 made them, and the flags); 2 = one range for every row, in
        element 0. The flag goes to bad[row, tile] (one writer each), reduced over tiles by the caller."""
        rows, row_ok = _row_ids(n_rows, ROWS)
        start = tl.program_id(1) * TILE
        x, offs, inside, bad = _load_tile(x_ptr, lfc_ptr, rows, row_ok, start, row_len, W, WB, BH, BW, lfc_row,
                                          PER, TILE, HAS_LFC)
        levels = (1 << BITS) - 1
        r3 = rows[:, None, None]
        if SPLIT:  # two ranges, one per side of an exact mask the decoder holds too
            side = _split_side(split_ptr, r3, row_len, offs, inside) != 0
            if STATS == 0:
                mn0, scale0 = _range(x, inside & ~side, levels, STAT_BF16)
                mn1, scale1 = _range(x, inside & side, levels, STAT_BF16)
                tl.store(min_ptr + 2 * rows, mn0, mask=row_ok)
                tl.store(min_ptr + 2 * rows + 1, mn1, mask=row_ok)
                tl.store(scale_ptr + 2 * rows, scale0, mask=row_ok)
                tl.store(scale_ptr + 2 * rows + 1, scale1, mask=row_ok)
            else:
                mn0 = tl.load(min_ptr + 2 * rows, mask=row_ok, other=0.0)
                mn1 = tl.load(min_ptr + 2 * rows + 1, mask=row_ok, other=0.0)
                scale0 = tl.load(scale_ptr + 2 * rows, mask=row_ok, other=0.0)
                scale1 = tl.load(scale_ptr + 2 * rows + 1, mask=row_ok, other=0.0)
            mn = tl.where(side, mn1[:, None, None], mn0[:, None, None])
            scale = tl.where(side, scale1[:, None, None], scale0[:, None, None])
        elif STATS == 2:
            mn = tl.load(min_ptr)
            scale = tl.load(scale_ptr)
        elif STATS == 1:
            mn = tl.load(min_ptr + r3, mask=row_ok[:, None, None], other=0.0)
            scale = tl.load(scale_ptr + r3, mask=row_ok[:, None, None], other=0.0)
        else:
            row_mn, row_scale = _range(x, inside, levels, STAT_BF16)
            tl.store(min_ptr + rows, row_mn, mask=row_ok)
            tl.store(scale_ptr + rows, row_scale, mask=row_ok)
            mn, scale = row_mn[:, None, None], row_scale[:, None, None]
        if STATS != 1:
            tl.store(bad_ptr + rows * tiles + tl.program_id(1), bad.to(tl.int8), mask=row_ok)
        inv = tl.where(scale > 0, tl.div_rn(tl.full((), 1.0, tl.float32), tl.where(scale > 0, scale, 1.0)), 0.0)
        v = (x - mn) * inv
        if STOCHASTIC:
            q = tl.floor(v + _uniform_tile(seed + rows, start, PER, TILE, ROWS))
        else:
            q = _round_half_even(v)
        q = tl.minimum(tl.maximum(q, 0.0), levels).to(tl.int32)
        if ALIGNED:
            shifts = (tl.arange(0, PER) * BITS)[None, None, :]
            byte = tl.sum(q << shifts, axis=2)
            bytes_at = start // PER + tl.arange(0, TILE // PER)[None, :]
            tl.store(packed_ptr + rows[:, None] * (row_len // PER) + bytes_at, byte.to(tl.uint8),
                     mask=(bytes_at * PER < row_len) & row_ok[:, None])
        else:
            tl.store(codes_ptr + r3 * row_len + offs, q.to(tl.uint8), mask=inside)

    @triton.jit
    def _decode_tiles(packed_ptr, lfc_ptr, min_ptr, scale_ptr, bad_ptr, out_ptr, split_ptr, n_rows,
                      row_len, W: tl.constexpr, WB: tl.constexpr, BH: tl.constexpr, BW: tl.constexpr, lfc_row,
                      BITS: tl.constexpr, PER: tl.constexpr, TILE: tl.constexpr, ROWS: tl.constexpr,
                      HAS_LFC: tl.constexpr, SHARED: tl.constexpr, SPLIT: tl.constexpr,
                      ZERO_UNSET: tl.constexpr):
        """One tile of ROWS rows, written in the output's dtype (no float32 intermediate)."""
        rows, row_ok = _row_ids(n_rows, ROWS)
        r2, ok2 = rows[:, None], row_ok[:, None]
        offs = tl.program_id(1) * TILE + tl.arange(0, TILE)[None, :]
        inside = (offs < row_len) & ok2
        flat = r2 * row_len + offs
        byte = tl.load(packed_ptr + flat // PER, mask=inside, other=0).to(tl.int32)
        q = (byte >> ((flat % PER).to(tl.int32) * BITS)) & ((1 << BITS) - 1)
        if SPLIT:
            side = (tl.load(split_ptr + flat // 8, mask=inside, other=0).to(tl.int32) >> (flat % 8).to(tl.int32)) & 1
            x = (tl.load(min_ptr + 2 * r2 + side, mask=inside, other=0.0)
                 + q.to(tl.float32) * tl.load(scale_ptr + 2 * r2 + side, mask=inside, other=0.0))
        elif SHARED:
            x = tl.load(min_ptr) + q.to(tl.float32) * tl.load(scale_ptr)
        else:
            x = (tl.load(min_ptr + r2, mask=ok2, other=0.0)
                 + q.to(tl.float32) * tl.load(scale_ptr + r2, mask=ok2, other=0.0))
        if HAS_LFC:
            block = (offs // W // BH) * WB + (offs % W) // BW
            x = x + tl.load(lfc_ptr + r2 * lfc_row + block, mask=inside, other=0.0).to(tl.float32)
        x = tl.where(tl.load(bad_ptr + r2, mask=ok2, other=0) != 0, float("nan"), x)
        if ZERO_UNSET:  # a ReLU's zeros: exactly 0 where the split mask is unset
            x = tl.where(side != 0, x, 0.0)
        tl.store(out_ptr + flat, x.to(out_ptr.dtype.element_ty), mask=inside)

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
    def _block_start(BLOCK: tl.constexpr):
        return tl.program_id(0).to(tl.int64) * BLOCK

    @triton.jit
    def _mask_positive(y_ptr, out_ptr, n, BLOCK: tl.constexpr):
        start = _block_start(BLOCK)
        offs = _mask_tile(start, BLOCK)
        y = tl.load(y_ptr + offs, mask=offs < n, other=0.0)
        _store_mask_bytes(out_ptr, y > 0, start, n, BLOCK)

    @triton.jit
    def _quant_relu_mask(x_ptr, y_ptr, out_ptr, n, levels, BLOCK: tl.constexpr):
        """y = round_half_even(clamp(x, 0, 1) * levels) / levels (NaN kept), and the mask 0 < x < 1 packed as
        _mask_positive packs it."""
        start = _block_start(BLOCK)
        offs = _mask_tile(start, BLOCK)
        inside = offs < n
        x = tl.load(x_ptr + offs, mask=inside, other=0.0)
        rounded = _round_half_even(tl.minimum(tl.maximum(x, 0.0), 1.0) * levels)
        tl.store(y_ptr + offs, tl.where(x != x, x, tl.div_rn(rounded, levels)), mask=inside)
        _store_mask_bytes(out_ptr, (x > 0) & (x < 1), start, n, BLOCK)

    @triton.jit
    def _mask_apply(g_ptr, mask_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = _block_start(BLOCK) + tl.arange(0, BLOCK)
        inside = offs < n
        g = tl.load(g_ptr + offs, mask=inside, other=0.0)
        keep = (tl.load(mask_ptr + offs // 8, mask=inside, other=0).to(tl.int32) >> (offs % 8).to(tl.int32)) & 1
        tl.store(out_ptr + offs, tl.where(keep != 0, g, 0.0), mask=inside)


def tile_size(row_len: int, per: int = 1, launch: Launch = Launch()) -> int:
    """Elements per program along a row: the row rounded up to a power of two, at most the launch's tile
    (DEFAULT_TILE), at least 16 and one byte's codes."""
    return max(min(triton.next_power_of_2(row_len), launch.cap()), per, 16)


def rows_per_program(rows: int, row_len: int, tile: int, launch: Launch = Launch()) -> int:
    """Rows one program takes: a power of two with at most the launch's tile (DEFAULT_TILE) elements in
    all (1 for rows longer than a tile), at most its max_rows (MAX_ROWS) and no more than the rows there are."""
    if row_len > tile:
        return 1
    return max(1, min(launch.cap() // tile, launch.rows_cap(), triton.next_power_of_2(rows)))


def _check_row_len(row_len: int):
    if row_len >= 2 ** 31:
        raise ValueError(f"row_len={row_len} is too long for the Triton codecs (offsets within a row are 32-bit); "
                         "rows must have fewer than 2^31 elements")


def _geometry(row_len, map_hw, block_hw):
    """(w, blocks per map row, bh, bw, LFC elements per row) for the kernels' LFC indexing. The first four are
    compile-time constants of the kernels (one compilation per map width and block), so that the per-element
    block index is computed with multiplies and shifts instead of integer divisions; without an LFC they are
    unused and fixed at 1 (one compilation for every row length)."""
    if not map_hw:
        return 1, 1, 1, 1, 0
    h, w = map_hw
    bh, bw = block_hw if block_hw else (1, 1)
    wb = -(-w // bw)
    return w, wb, bh, bw, (-(-h // bh)) * wb


def _row_statistics(xc, lfc, split, rows, row_len, bits, tile, geometry, stat_bf16, num_warps):
    """Pass 1 for rows longer than one tile: per-row (minimum, scale) laid out [row, side] and the NaN/Inf
    flag per row, reduced on the device with the reference's arithmetic (no host synchronisation)."""
    from division.codecs.base import bf16_outward, ieee_div
    tiles = triton.cdiv(row_len, tile)
    sides = 2 if split is not None else 1
    pmin = torch.empty(rows * tiles * sides, dtype=torch.float32, device=xc.device)
    pmax = torch.empty_like(pmin)
    pbad = torch.empty(rows * tiles, dtype=torch.int8, device=xc.device)
    _tile_stats[(rows, tiles)](xc, lfc if lfc is not None else xc, split if split is not None else pbad,
                               pmin, pmax, pbad, rows, row_len, *geometry, tiles, PER=8 // bits, TILE=tile,
                               HAS_LFC=lfc is not None, SPLIT=split is not None, enable_fp_fusion=False,
                               num_warps=num_warps)
    mn = pmin.view(rows, tiles, sides).amin(1).reshape(-1)
    mx = pmax.view(rows, tiles, sides).amax(1).reshape(-1)
    empty = mn > mx
    mn, mx = mn.masked_fill(empty, 0.0), mx.masked_fill(empty, 0.0)
    levels = (1 << bits) - 1
    mn, scale = bf16_outward(mn, mx, levels) if stat_bf16 else (mn, ieee_div(mx - mn, levels))
    return mn.contiguous(), scale.contiguous(), pbad.view(rows, tiles).amax(1)


def encode_rows(x: torch.Tensor, rows: int, row_len: int, bits: int, stochastic: bool, lfc=None, map_hw=None,
                block_hw=None, generator=None, fixed_range=None, split=None, stat_bf16: bool = False,
                launch: Launch = Launch()):
    """Quantize ``x`` viewed as (rows, row_len), after subtracting the upsampled ``lfc`` (rows of hb*wb block
    means of (h, w) maps) if given; ``fixed_range`` = (minimum, maximum) device scalars shared by every row;
    ``split`` (packed mask bits over the flattened x): two ranges per row, laid out [row, side];
    ``stat_bf16``: statistics rounded outward to bf16 (returned as bf16); ``launch``: how programs are cut.
    Returns (packed, minimum, scale, bad) on x's device (minimum and scale of one element when shared)."""
    from division.codecs.base import ieee_div, rounding_seed
    from division.codecs.packing import pack_bits, packed_nbytes
    _check_row_len(row_len)
    xc = x.contiguous()
    per = 8 // bits
    aligned = row_len % per == 0
    dev = x.device
    tile = tile_size(row_len, per, launch)
    tiles = triton.cdiv(row_len, tile)
    geometry = _geometry(row_len, map_hw, block_hw)
    stat_bf16 = bool(stat_bf16) and fixed_range is None
    packed = torch.empty(packed_nbytes(rows * row_len, bits), dtype=torch.uint8, device=dev)
    codes = torch.empty(0 if aligned else rows * row_len, dtype=torch.uint8, device=dev)
    if fixed_range is not None:
        stats = 2
        minimum = fixed_range[0].float().reshape(1).contiguous()
        scale = ieee_div(fixed_range[1].float() - fixed_range[0].float(), (1 << bits) - 1).reshape(1).contiguous()
        bad = torch.empty(rows * tiles, dtype=torch.int8, device=dev)
    elif tiles > 1:
        stats = 1
        minimum, scale, bad = _row_statistics(xc, lfc, split, rows, row_len, bits, tile, geometry, stat_bf16,
                                               launch.num_warps)
    else:
        stats = 0
        minimum = torch.empty(rows * (2 if split is not None else 1), dtype=torch.float32, device=dev)
        scale = torch.empty_like(minimum)
        bad = torch.empty(rows, dtype=torch.int8, device=dev)
    seed = rounding_seed(generator, bits=31) if stochastic else 0
    block = rows_per_program(rows, row_len, tile, launch)
    _encode_tiles[(triton.cdiv(rows, block), tiles)](
        xc, lfc if lfc is not None else xc, packed, codes, minimum, scale, bad,
        split if split is not None else packed, seed, rows, row_len, *geometry, tiles, BITS=bits,
        PER=per, TILE=tile, ROWS=block, HAS_LFC=lfc is not None, STOCHASTIC=bool(stochastic),
        ALIGNED=aligned, STATS=stats, SPLIT=split is not None, STAT_BF16=stat_bf16, enable_fp_fusion=False,
        num_warps=launch.num_warps)
    if stats == 2 and tiles > 1:
        bad = bad.view(rows, tiles).amax(1)
    if not aligned:
        packed = pack_bits(codes, bits)
    if stat_bf16:
        minimum, scale = minimum.to(torch.bfloat16), scale.to(torch.bfloat16)  # exact: bf16 values
    return packed, minimum, scale, bad


def decode_rows(packed, minimum, scale, bad, rows: int, row_len: int, bits: int, lfc=None, map_hw=None,
                block_hw=None, split=None, dtype: torch.dtype = torch.float32,
                zero_unset: bool = False, launch: Launch = Launch()) -> torch.Tensor:
    """Inverse of :func:`encode_rows`: a (rows, row_len) tensor of ``dtype`` (the dtype backward needs,
    written directly); flagged rows come back as NaN; ``zero_unset``: exactly 0 where ``split`` is unset."""
    _check_row_len(row_len)
    out = torch.empty(rows, row_len, dtype=dtype, device=packed.device)
    minimum, scale = minimum.float(), scale.float()
    tile = tile_size(row_len, launch=launch)
    block = rows_per_program(rows, row_len, tile, launch)
    _decode_tiles[(triton.cdiv(rows, block), triton.cdiv(row_len, tile))](
        packed, lfc if lfc is not None else minimum, minimum, scale, bad, out,
        split if split is not None else packed, rows, row_len, *_geometry(row_len, map_hw, block_hw),
        BITS=bits, PER=8 // bits, TILE=tile, ROWS=block, HAS_LFC=lfc is not None,
        SHARED=minimum.numel() == 1 and rows > 1 and split is None, SPLIT=split is not None,
        ZERO_UNSET=bool(zero_unset) and split is not None, enable_fp_fusion=False, num_warps=launch.num_warps)
    return out


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
    _quant_relu_mask[(triton.cdiv(x.numel(), MASK_BLOCK),)](xc, y, out, x.numel(), float(levels), BLOCK=MASK_BLOCK,
                                                      enable_fp_fusion=False)
    return y, out
