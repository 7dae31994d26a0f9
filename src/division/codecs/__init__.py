"""Codecs: pure tensor functions (no autograd, no modules) that turn an activation into a smaller
object holding exactly the bytes kept for backward, and back.

Every packed object exposes ``nbytes()`` (bytes actually held, de-duplicated by storage through
``tensors()``) and ``decode()``.
"""
from division.codecs.packing import pack_bits, unpack_bits, packed_nbytes
from division.codecs.quant import (
    QuantizedTensor,
    quantize_per_row,
    BitMask,
    Bf16Copy,
    FullCopy,
    VALID_BITS,
)
from division.codecs.division import DivisionCodec, DivisionPacked, lfc_blocks, block_average, upsample_blocks
from division.codecs.groupwise import GroupwiseCodec, PerChannelCodec, BlpaCodec

__all__ = [
    "pack_bits", "unpack_bits", "packed_nbytes",
    "QuantizedTensor", "quantize_per_row", "BitMask", "Bf16Copy", "FullCopy", "VALID_BITS",
    "DivisionCodec", "DivisionPacked", "lfc_blocks", "block_average", "upsample_blocks",
    "GroupwiseCodec", "PerChannelCodec", "BlpaCodec",
]
