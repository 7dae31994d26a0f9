"""The fused CPU DIVISION kernel (division/kernels/division_cpu.c) as PyTorch custom operators, so that a
compiled graph calls it as one opaque kernel instead of the compiler's own loops for pooling, statistics,
dither and packing (compress/graph_hooks.py chooses it for CPU maps where the kernel library builds).

``division::encode_maps(x, bits, bh, bw, stochastic)`` -> (LFC bf16 (N, C, ceil(H/bh), ceil(W/bw)), packed
HFC codes uint8 (ceil(N*C*H*W*bits/8),), per-map minimum and scale float32 (N*C,)); ``division::decode_maps``
rebuilds (N, C, H, W) in float32 or the ``dtype`` given; ``division::relu_signs`` and
``division::decode_relu_maps`` add a ReLU output's exact mask (one bit per element, made and applied by the
kernel library). On CUDA the same four operators run the Triton kernels (the section at the end). The fake
implementations give the compiler these shapes without running anything. Stochastic rounding draws its seed
from torch's CPU generator when the operator runs (each step afresh; rank-mixed under DDP, as the eager
codec). A map holding NaN or Inf is encoded with those elements as zero and gets a NaN minimum, so it
decodes to NaN throughout: the backward's gradients show it instead of a finite value that was never there.
"""
import math
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from division.codecs.packing import packed_nbytes


def _lfc_shape(x: Tensor, bh: int, bw: int):
    n, c, h, w = x.shape
    return n, c, -(-h // bh), -(-w // bw)


@torch.library.custom_op("division::relu_signs", mutates_args=(), device_types="cpu")
def relu_signs(x: Tensor) -> Tensor:
    """One bit per element, set where ``x`` > 0 (a ReLU's output keeps its mask exactly), packed 8 to a byte."""
    from division.codecs.exact import BitMask
    return BitMask.positive(x.float(), backend="compiled").packed


@relu_signs.register_fake
def _signs_fake(x):
    return x.new_empty((packed_nbytes(x.numel(), 1),), dtype=torch.uint8)


@torch.library.custom_op("division::decode_relu_maps", mutates_args=(), device_types="cpu")
def decode_relu_maps(lfc: Tensor, packed: Tensor, minimum: Tensor, scale: Tensor, signs: Tensor, bits: int,
                     h: int, w: int, bh: int, bw: int, floor: float, dtype: Optional[torch.dtype] = None) -> Tensor:
    """:func:`decode_maps` for a ReLU's output: > 0 (at least ``floor``) where its sign bit is set, exactly 0
    elsewhere, so that the mask the backward recomputes from it is the forward's."""
    from division.codecs.exact import BitMask
    x = decode_maps(lfc, packed, minimum, scale, bits, h, w, bh, bw).clamp_min_(floor)
    return BitMask(signs, x.shape, "compiled").apply(x, inplace=True).to(dtype or torch.float32)


def _decoded_fake(lfc, h, w, dtype):
    return lfc.new_empty((lfc.shape[0], lfc.shape[1], h, w), dtype=dtype or torch.float32)


@decode_relu_maps.register_fake
def _(lfc, packed, minimum, scale, signs, bits, h, w, bh, bw, floor, dtype=None):
    return _decoded_fake(lfc, h, w, dtype)


@torch.library.custom_op("division::encode_maps", mutates_args=(), device_types="cpu")
def encode_maps(x: Tensor, bits: int, bh: int, bw: int, stochastic: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    from division.codecs.quant import encode_maps_compiled
    n, c, h, w = x.shape
    encoded = encode_maps_compiled(x, n * c, h, w, (bh, bw), bits, stochastic)
    bad_maps = None
    if encoded is None:  # NaN or Inf somewhere: encode the finite part, mark the maps that held them
        finite = torch.isfinite(x)
        bad_maps = ~finite.reshape(n * c, -1).all(1)
        encoded = encode_maps_compiled(torch.where(finite, x, torch.zeros((), dtype=x.dtype)), n * c, h, w,
                                       (bh, bw), bits, stochastic)
    lfc, q = encoded
    minimum = q.minimum
    if bad_maps is not None:
        minimum = minimum.masked_fill(bad_maps, float("nan"))
    return lfc.view(_lfc_shape(x, bh, bw)), q.packed, minimum, q.scale


@encode_maps.register_fake
def _encode_fake(x, bits, bh, bw, stochastic):
    n, c, h, w = x.shape
    lfc = x.new_empty(_lfc_shape(x, bh, bw), dtype=torch.bfloat16)
    packed = x.new_empty((packed_nbytes(n * c * h * w, bits),), dtype=torch.uint8)
    return lfc, packed, x.new_empty((n * c,), dtype=torch.float32), x.new_empty((n * c,), dtype=torch.float32)


@torch.library.custom_op("division::decode_maps", mutates_args=(), device_types="cpu")
def decode_maps(lfc: Tensor, packed: Tensor, minimum: Tensor, scale: Tensor, bits: int, h: int, w: int,
                bh: int, bw: int, dtype: Optional[torch.dtype] = None) -> Tensor:
    from division.codecs.quant import QuantizedTensor, decode_rows_compiled
    n, c = lfc.shape[:2]
    q = QuantizedTensor(packed, minimum, scale, bits, n * c, h * w, torch.float32, backend="compiled")
    return decode_rows_compiled(q, lfc, (h, w), (bh, bw)).view(n, c, h, w).to(dtype or torch.float32)


@decode_maps.register_fake
def _(lfc, packed, minimum, scale, bits, h, w, bh, bw, dtype=None):
    return _decoded_fake(lfc, h, w, dtype)


def available(x: Tensor, codec) -> bool:
    """Whether the kernel operators can keep ``x`` under ``codec``: DIVISION with a bf16 LFC, and on a CPU
    fp32 or bf16 maps with the kernel library built, on CUDA fp32, fp16 or bf16 maps with Triton installed."""
    if codec.kind != "division" or codec.lfc_dtype != torch.bfloat16:
        return False
    if x.device.type == "cuda":
        from division.kernels import triton_codecs
        return x.dtype in (torch.float32, torch.float16, torch.bfloat16) and triton_codecs.available(x.device)
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    from division import kernels
    return kernels.library() is not None


# --- channels-last maps (memory order N, H, W, C) -------------------------------------------------------------
# A compiled graph on a CPU runs its convolutions channels-last; the operators below keep such maps in that
# order (kernels/nhwc_cpu.c), where the ones above would need every saved map copied to (N, C, H, W) and every
# decoded one copied back. Their codes follow the memory order; the LFC is (N, C, H/bh, W/bw) as above.

def is_channels_last(x: Tensor) -> bool:
    """A 4-D tensor laid out channels-last and not also contiguous (a 1x1 map or one channel is both)."""
    return x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)


def nhwc_supported(x: Tensor) -> bool:
    """Whether :func:`encode_maps_cl` takes ``x``: channels-last, one sample's codes in whole bytes."""
    n, c, h, w = x.shape
    return is_channels_last(x) and (h * w * c) % 8 == 0


def _nhwc_encode(lib, x: Tensor, bits: int, bh: int, bw: int, stochastic: bool):
    from division.codecs.base import rounding_seed
    n, c, h, w = x.shape
    lfc = torch.empty(_lfc_shape(x, bh, bw), dtype=torch.bfloat16)
    packed = torch.empty((packed_nbytes(x.numel(), bits),), dtype=torch.uint8)
    minimum, scale = torch.empty(n * c, dtype=torch.float32), torch.empty(n * c, dtype=torch.float32)
    seed = rounding_seed() if stochastic else 0
    bad = lib.division_encode_nhwc(x.data_ptr(), n, h, w, c, bh, bw, bits, seed, int(stochastic), lfc.data_ptr(),
                                   minimum.data_ptr(), scale.data_ptr(), packed.data_ptr(), torch.get_num_threads())
    if bad < 0:
        raise MemoryError(f"division::encode_maps_cl could not encode a {tuple(x.shape)} map (out of memory)")
    return bad, (lfc, packed, minimum, scale)


@torch.library.custom_op("division::encode_maps_cl", mutates_args=(), device_types="cpu")
def encode_maps_cl(x: Tensor, bits: int, bh: int, bw: int, stochastic: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`encode_maps` for a channels-last ``x`` (see :func:`nhwc_supported`), codes in its memory order;
    maps holding NaN or Inf decode to NaN throughout, as there."""
    from division import kernels
    lib = kernels.library()
    xc = x.float().contiguous(memory_format=torch.channels_last)
    bad, parts = _nhwc_encode(lib, xc, bits, bh, bw, stochastic)
    if bad:
        finite = torch.isfinite(xc)
        bad_maps = ~finite.all(3).all(2).reshape(-1)
        xc = torch.where(finite, xc, torch.zeros((), dtype=xc.dtype)).contiguous(memory_format=torch.channels_last)
        parts = _nhwc_encode(lib, xc, bits, bh, bw, stochastic)[1]
        parts = (*parts[:2], parts[2].masked_fill(bad_maps, float("nan")), parts[3])
    return parts


encode_maps_cl.register_fake(_encode_fake)


def _channels_last_empty(lfc: Tensor, h: int, w: int) -> Tensor:
    return torch.empty((lfc.shape[0], lfc.shape[1], h, w), dtype=torch.float32, device=lfc.device,
                       memory_format=torch.channels_last)


def _nhwc_decode(lfc, packed, minimum, scale, bits, h, w, bh, bw, signs=None, floor=0.0) -> Tensor:
    from division import kernels
    out = _channels_last_empty(lfc, h, w)
    n, c = lfc.shape[:2]
    failed = kernels.library().division_decode_nhwc(
        packed.data_ptr(), lfc.data_ptr(), minimum.data_ptr(), scale.data_ptr(), n, h, w, c, bh, bw, bits,
        out.data_ptr(), torch.get_num_threads(), None if signs is None else signs.data_ptr(), floor)
    if failed:
        raise MemoryError(f"division::decode_maps_cl could not decode a {tuple(out.shape)} map (out of memory)")
    return out


@torch.library.custom_op("division::decode_maps_cl", mutates_args=(), device_types="cpu")
def decode_maps_cl(lfc: Tensor, packed: Tensor, minimum: Tensor, scale: Tensor, bits: int, h: int, w: int,
                   bh: int, bw: int) -> Tensor:
    """Inverse of :func:`encode_maps_cl`: float32 (N, C, H, W), channels-last."""
    return _nhwc_decode(lfc, packed, minimum, scale, bits, h, w, bh, bw)


@decode_maps_cl.register_fake
def _(lfc, packed, minimum, scale, bits, h, w, bh, bw):
    return _channels_last_empty(lfc, h, w)


@torch.library.custom_op("division::relu_signs_cl", mutates_args=(), device_types="cpu")
def relu_signs_cl(x: Tensor) -> Tensor:
    """:func:`relu_signs` of a channels-last ``x``, bits in its memory order."""
    from division.codecs.exact import BitMask
    return BitMask.positive(x.float().permute(0, 2, 3, 1), backend="compiled").packed


relu_signs_cl.register_fake(_signs_fake)


@torch.library.custom_op("division::decode_relu_maps_cl", mutates_args=(), device_types="cpu")
def decode_relu_maps_cl(lfc: Tensor, packed: Tensor, minimum: Tensor, scale: Tensor, signs: Tensor, bits: int,
                        h: int, w: int, bh: int, bw: int, floor: float) -> Tensor:
    """:func:`decode_relu_maps` for channels-last maps (signs from :func:`relu_signs_cl`), the floor and the
    mask applied by the kernel as it decodes."""
    return _nhwc_decode(lfc, packed, minimum, scale, bits, h, w, bh, bw, signs, floor)


@decode_relu_maps_cl.register_fake
def _(lfc, packed, minimum, scale, signs, bits, h, w, bh, bw, floor):
    return _channels_last_empty(lfc, h, w)


# --- boolean masks the compiled graph saves (a ReLU's mask beside a max-pool, a ReLU's at the network's end) --
# Packed eight to a byte by the kernel library, in the mask's memory order. The traced packing
# (graph_hooks.pack_bools) fused its bit arithmetic into the kernels that consume the mask, which turned them
# scalar: ResNet-50's stem backward (max-pool, ReLU and batch norm in one loop) took 3x compiled fp's time.

def masks_available(mask: Tensor) -> bool:
    """Whether :func:`pack_mask` runs the kernel for ``mask`` (a CPU bool tensor, the library built)."""
    if mask.device.type != "cpu" or mask.dtype != torch.bool:
        return False
    from division import kernels
    return kernels.library() is not None


def _memory_order(x: Tensor) -> Tensor:
    """``x``'s elements as a contiguous tensor in the order memory holds them (no copy for channels-last)."""
    return x.permute(0, 2, 3, 1) if is_channels_last(x) else x.contiguous()


@torch.library.custom_op("division::pack_mask", mutates_args=(), device_types="cpu")
def pack_mask(mask: Tensor) -> Tensor:
    """A bool ``mask``, one bit per element in its memory order (the first element in the low bit)."""
    from division import kernels
    flat = _memory_order(mask).reshape(-1).view(torch.uint8)
    out = torch.empty((packed_nbytes(flat.numel(), 1),), dtype=torch.uint8)
    kernels.library().pack_codes(flat.data_ptr(), flat.numel(), 1, out.data_ptr(), torch.get_num_threads())
    return out


@pack_mask.register_fake
def _(mask):
    return mask.new_empty((packed_nbytes(mask.numel(), 1),), dtype=torch.uint8)


@torch.library.custom_op("division::unpack_mask", mutates_args=(), device_types="cpu")
def unpack_mask(packed: Tensor, shape: List[int], channels_last: bool) -> Tensor:
    """Inverse of :func:`pack_mask`: the bool mask of ``shape``, laid out channels-last if it was."""
    return _decode_mask(packed, shape, channels_last, "compiled")


def _decode_mask(packed: Tensor, shape: List[int], channels_last: bool, backend: str) -> Tensor:
    from division.codecs.exact import BitMask
    if not channels_last:
        return BitMask(packed, torch.Size(shape), backend).decode()
    n, c, h, w = shape
    return BitMask(packed, torch.Size((n, h, w, c)), backend).decode().permute(0, 3, 1, 2)


def _empty_mask(packed: Tensor, shape: List[int], channels_last: bool, dtype: torch.dtype) -> Tensor:
    layout = torch.channels_last if channels_last else torch.contiguous_format
    return torch.empty(shape, dtype=dtype, device=packed.device, memory_format=layout)


@unpack_mask.register_fake
def _(packed, shape, channels_last):
    return _empty_mask(packed, shape, channels_last, torch.bool)


@torch.library.custom_op("division::relu_with_mask", mutates_args=(), device_types=("cpu", "cuda"))
def relu_with_mask(z: Tensor, channels_last: bool) -> Tuple[Tensor, Tensor]:
    """``relu(z)`` in ``z``'s layout and its mask ``z > 0``, one bit per element in the order of the layout
    ``channels_last`` names (as :func:`pack_mask` packs it, so that :func:`unpack_mask` with the same flag
    inverts it): one pass on the CPU kernel where ``z`` is laid out so. The flag is fixed when the graph is
    traced; Inductor may lay ``z`` out otherwise later (its layout optimisation), which costs a copy here but
    never a wrong mask. An operator of its own so that the compiled graph makes the mask in the forward (an
    Inductor CPU kernel storing a bool map ran 15x slower than the ReLU itself) and cannot recompute it in
    the backward from a decoded map."""
    from division.codecs.exact import BitMask
    if is_channels_last(z) == channels_last or z.dim() != 4:
        y, mask = BitMask.relu(_memory_order(z), inplace=False, backend="auto")
        return (y.permute(0, 3, 1, 2) if is_channels_last(z) else y), mask.packed
    y = torch.relu(z)
    order = y.permute(0, 2, 3, 1).contiguous() if channels_last else y.contiguous()
    return y, BitMask.positive(order, backend="auto").packed


@relu_with_mask.register_fake
def _(z, channels_last):
    return torch.empty_like(z), z.new_empty((packed_nbytes(z.numel(), 1),), dtype=torch.uint8)


@torch.library.custom_op("division::unpack_mask_bytes", mutates_args=(), device_types="cpu")
def unpack_mask_bytes(packed: Tensor, shape: List[int], channels_last: bool) -> Tensor:
    """:func:`unpack_mask`'s mask as uint8 0 / 1 (the same bytes): a compiled CPU graph multiplies by it,
    where a bool map in an Inductor kernel (loaded or stored) ran 4-5x slower than a ReLU of the map."""
    return unpack_mask(packed, shape, channels_last).view(torch.uint8)


@unpack_mask_bytes.register_fake
def _(packed, shape, channels_last):
    return _empty_mask(packed, shape, channels_last, torch.uint8)


def _unpack_mask_bytes_cuda(packed: Tensor, shape: List[int], channels_last: bool) -> Tensor:
    return _decode_mask(packed, shape, channels_last, "reference").view(torch.uint8)


unpack_mask_bytes.register_kernel("cuda", _unpack_mask_bytes_cuda)


# --- ActNN-style groups ----------------------------------------------------------------------------------------
# Each sample's activation, flattened in NCHW order, cut into groups of ``group`` elements (the last padded
# with its sample's last element), a minimum and scale per group: GroupwiseCodec's encoding through the same
# C kernel (rows without an LFC), where the traced version left the compiler's own loops for the per-group
# reductions and packing.

def _group_rows(x: Tensor, group: int) -> int:
    per_sample = x[0].numel()
    return x.shape[0] * -(-per_sample // group)


def groups_available(x: Tensor) -> bool:
    """Whether :func:`encode_groups` runs the kernel for ``x`` (CPU, fp32 or bf16, the library built)."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16) or x.dim() < 2:
        return False
    from division import kernels
    return kernels.library() is not None


@torch.library.custom_op("division::encode_groups", mutates_args=(), device_types="cpu")
def encode_groups(x: Tensor, bits: int, group: int, stochastic: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """(packed codes, minimum and scale float32 per group) of ``x`` (N, ...) in groups of ``group``."""
    from division.codecs.groupwise import GroupwiseCodec
    q = GroupwiseCodec(bits, group, stochastic, backend="compiled").encode(x.float()).q
    return q.packed, q.minimum.float().reshape(-1), q.scale.float().reshape(-1)


@encode_groups.register_fake
def _(x, bits, group, stochastic):
    rows = _group_rows(x, group)
    stat = x.new_empty((rows,), dtype=torch.float32)
    return x.new_empty((packed_nbytes(rows * group, bits),), dtype=torch.uint8), stat, torch.empty_like(stat)


@torch.library.custom_op("division::decode_groups", mutates_args=(), device_types="cpu")
def decode_groups(packed: Tensor, minimum: Tensor, scale: Tensor, bits: int, group: int, shape: List[int]) -> Tensor:
    """Inverse of :func:`encode_groups`: float32 of ``shape``, contiguous."""
    from division.codecs.quant import QuantizedTensor, decode_rows_compiled
    n, rows = shape[0], minimum.numel()
    q = QuantizedTensor(packed, minimum, scale, bits, rows, group, torch.float32, backend="compiled")
    per_sample = math.prod(shape[1:])
    return decode_rows_compiled(q).view(n, -1)[:, :per_sample].reshape(shape).contiguous()


@decode_groups.register_fake
def _(packed, minimum, scale, bits, group, shape):
    return minimum.new_empty(shape, dtype=torch.float32)


# --- CUDA: the operators above through the Triton kernels (division/kernels/triton_codecs.py) ---------------
# The same outputs as the C kernel's (LFC bf16 (N, C, hb, wb), codes, minimum and scale float32 per map; a map
# that held NaN or Inf gets a NaN minimum and decodes to NaN), computed as the eager Triton codec computes
# them: the LFC by PyTorch's average pool in the map's dtype, the HFC's statistics and codes by one Triton
# launch (no host synchronisation). Maps are read in NCHW order: a channels-last map is copied first.
# method.backend=reference leaves the traced operations to Inductor instead, which may fuse the encode with
# the kernel that made the map; which is faster is measured on the device (scripts/compile_check.py).

def _encode_maps_triton(x: Tensor, bits: int, bh: int, bw: int, stochastic: bool):
    from division.codecs.division import block_average
    from division.kernels import triton_codecs
    n, c, h, w = x.shape
    lfc = block_average(x, (bh, bw)).to(torch.bfloat16).contiguous()
    packed, minimum, scale, bad = triton_codecs.encode_rows(x, n * c, h * w, bits, stochastic, lfc, (h, w),
                                                            (bh, bw))
    return lfc, packed, minimum.masked_fill(bad.bool(), float("nan")), scale


def _decode_maps_triton(lfc, packed, minimum, scale, bits, h, w, bh, bw, dtype=None) -> Tensor:
    from division.kernels import triton_codecs
    n, c = lfc.shape[:2]
    bad = torch.isnan(minimum).to(torch.int8)
    out = triton_codecs.decode_rows(packed, minimum, scale, bad, n * c, h * w, bits, lfc, (h, w), (bh, bw),
                                    dtype=dtype or torch.float32)
    return out.view(n, c, h, w)


def _relu_signs_triton(x: Tensor) -> Tensor:
    from division.kernels import triton_codecs
    return triton_codecs.mask_positive(x)


def _decode_relu_maps_triton(lfc, packed, minimum, scale, signs, bits, h, w, bh, bw, floor, dtype=None) -> Tensor:
    from division.kernels import triton_codecs
    x = _decode_maps_triton(lfc, packed, minimum, scale, bits, h, w, bh, bw, dtype).clamp_min_(floor)
    return triton_codecs.mask_apply(x, signs)


encode_maps.register_kernel("cuda", _encode_maps_triton)
decode_maps.register_kernel("cuda", _decode_maps_triton)
relu_signs.register_kernel("cuda", _relu_signs_triton)
decode_relu_maps.register_kernel("cuda", _decode_relu_maps_triton)
