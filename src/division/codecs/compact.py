"""Codes only where a ReLU's output is positive (beyond the paper).

A ReLU output is exactly zero wherever the ReLU's exact 1-bit mask, held for the ReLU's own backward, is
unset. A later layer's compressed copy of that output therefore needs codes (and one range per map) only for
the positive elements: the rest decode to zero through the mask. This is Gist's "sparse storage" of ReLU
outputs (Jain et al., ISCA 2018) applied to quantized codes; the bytes saved depend on the data (the fraction
of zeros), so memory reports measure them rather than assume them.

The codec encodes as usual with the mask as its ``split`` (one range per side: the positive side gets its own
range), then keeps the codes of the positive elements, in order, and the positive side's minimum and scale.
"""
import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch

from division.codecs.base import Packed, kernel_library
from division.codecs.division import DivisionPacked
from division.codecs.exact import BitMask
from division.codecs.groupwise import ReshapedQuantized
from division.codecs.packing import pack_bits, packed_nbytes, unpack_bits
from division.codecs.quant import QuantizedTensor


def _quantized_part(packed: Packed) -> Optional[str]:
    """The attribute of ``packed`` holding a QuantizedTensor whose codes follow the activation's own element
    order, else None (token layouts, channel-first rearrangements, padded groups, full copies)."""
    if isinstance(packed, DivisionPacked) and packed.bad_index is None:
        return "hfc"
    if isinstance(packed, ReshapedQuantized) and isinstance(packed.q, QuantizedTensor):
        return "q"
    return None


@dataclass(eq=False)
class ReluCompacted(Packed):
    """A codec's output over a ReLU output, its codes kept only where ``mask`` is set."""

    inner: Packed  # the codec's output with its quantized part's codes (and split statistics) removed
    part: str  # the attribute of ``inner`` that holds the quantized part
    codes: torch.Tensor  # packed codes of the positive elements, in element order
    count: int  # how many positive elements
    mask: BitMask  # the ReLU's own mask (held by the ReLU anyway: counted once, by storage)
    minimum: Optional[torch.Tensor] = None  # with a split: the positive side's minimum per row
    scale: Optional[torch.Tensor] = None
    compact_backend: str = "auto"  # "reference": PyTorch moves the codes, else the CPU kernel where it applies

    @property
    def kind(self) -> str:
        return f"{self.inner.kind}, relu-compact"

    @property
    def backend(self) -> str:
        return self.inner.backend

    def tensors(self):
        return [*self.inner.tensors(), self.codes, self.minimum, self.scale, self.mask.packed]

    def decode(self) -> torch.Tensor:
        q: QuantizedTensor = getattr(self.inner, self.part)
        rebuilt = {"packed": restore_codes(self.codes, self.count, self.mask, q.rows * q.row_len, q.bits,
                                           self.compact_backend), "zero_unset": q.split is not None}
        if self.minimum is not None:  # the negative side's range is never used: any value serves
            rebuilt["minimum"] = torch.stack([self.minimum, self.minimum], 1).reshape(-1)
            rebuilt["scale"] = torch.stack([self.scale, self.scale], 1).reshape(-1)
        inner = dataclasses.replace(self.inner, **{self.part: dataclasses.replace(q, **rebuilt)})
        x = inner.decode()  # with a split, its decode gives the zeros itself
        return x if q.split is not None else self.mask.apply(x, inplace=True)  # a fresh tensor


def _kernel(t: torch.Tensor, backend: str):
    return kernel_library(backend) if t.device.type == "cpu" else None


def keep_codes(codes: torch.Tensor, mask: BitMask, numel: int, bits: int, backend: str = "auto"):
    """(the packed ``bits``-bit codes of the elements where ``mask`` is set, in order; how many)."""
    lib = _kernel(codes, backend)
    if lib is None:
        kept = unpack_bits(codes, bits, numel)[mask.decode().reshape(-1)]
        return pack_bits(kept, bits), kept.numel()
    count = lib.count_set(mask.packed.data_ptr(), numel)
    out = torch.zeros(packed_nbytes(count, bits), dtype=torch.uint8)  # chunks OR their shared bytes in
    if lib.compact_codes(codes.contiguous().data_ptr(), mask.packed.data_ptr(), numel, bits, out.data_ptr(),
                         torch.get_num_threads()):
        raise MemoryError("compact_codes could not allocate its chunk table")
    return out, count


def restore_codes(kept: torch.Tensor, count: int, mask: BitMask, numel: int, bits: int, backend: str = "auto"):
    """The inverse of :func:`keep_codes`: packed codes of all ``numel`` elements, code 0 where unset."""
    lib = _kernel(kept, backend)
    if lib is None:
        full = torch.zeros(numel, dtype=torch.uint8, device=kept.device)
        full[mask.decode().reshape(-1)] = unpack_bits(kept, bits, count)
        return pack_bits(full, bits)
    out = torch.empty(packed_nbytes(numel, bits), dtype=torch.uint8)
    if lib.expand_codes(kept.data_ptr(), count, mask.packed.data_ptr(), numel, bits, out.data_ptr(),
                        torch.get_num_threads()):
        raise MemoryError("expand_codes could not allocate its chunk table")
    return out


def _compacts_here(packed: Packed) -> bool:
    """Compaction sizes its output by the count of positive elements, which the host must read: on the CPU
    that is free; on a GPU it would be a synchronisation per layer (stalling the launch queue), so codes stay
    in full layout there."""
    return all(t.device.type == "cpu" for t in packed.tensors() if t is not None)


def compact_relu(packed: Packed, mask: BitMask, backend: str = "auto") -> Packed:
    """``packed`` (a codec's output for a ReLU output whose exact ``mask`` is held) with codes only where the
    mask is set; ``packed`` unchanged where its layout does not allow it. ``backend`` as the codecs'."""
    part = _quantized_part(packed)
    if part is None or not _compacts_here(packed):
        return packed
    q: QuantizedTensor = getattr(packed, part)
    numel = q.rows * q.row_len
    if numel != math.prod(mask.shape):
        return packed
    kept, count = keep_codes(q.packed, mask, numel, q.bits, backend)
    minimum = scale = None
    emptied = {"packed": None}
    if q.split is not None and q.minimum.numel() == 2 * q.rows:
        minimum = q.minimum.view(q.rows, 2)[:, 1].contiguous()
        scale = q.scale.view(q.rows, 2)[:, 1].contiguous()
        emptied.update(minimum=None, scale=None)
    inner = dataclasses.replace(packed, **{part: dataclasses.replace(q, **emptied)})
    return ReluCompacted(inner, part, kept, count, mask, minimum, scale, backend)

