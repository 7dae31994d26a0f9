"""Exact containers: bit masks (ReLU, dropout), bf16 copies of tensors too small to compress, full copies."""
from dataclasses import dataclass

import torch

from division.codecs.base import Packed, _float_kernel, use_triton
from division.codecs.packing import pack_bits, packed_nbytes, unpack_bits


@dataclass(eq=False)
class BitMask(Packed):
    """An exact boolean mask, one bit per element (ReLU's x > 0, dropout's keep mask)."""

    packed: torch.Tensor
    shape: torch.Size
    backend: str = "reference"
    kind = "mask"

    @classmethod
    def encode(cls, mask: torch.Tensor) -> "BitMask":
        return cls(pack_bits(mask.reshape(-1).to(torch.uint8), 1), mask.shape)

    @classmethod
    def positive(cls, y: torch.Tensor, backend: str = "auto") -> "BitMask":
        """The mask ``y > 0`` (ReLU's), packed in one pass by a kernel where one applies."""
        if y.is_floating_point() and use_triton(y, backend):
            from division.kernels import triton_codecs
            return cls(triton_codecs.mask_positive(y), y.shape, "triton")
        lib = _float_kernel(y, backend)
        if lib is None:
            return cls.encode(y > 0)
        yc = y.contiguous()
        packed = cls.empty_packed(y.numel())
        lib.mask_positive(yc.data_ptr(), y.numel(), packed.data_ptr(), torch.get_num_threads())
        return cls(packed, y.shape, "compiled")

    @staticmethod
    def one_pass_kernel(x: torch.Tensor, backend: str):
        """The CPU kernel library when an activation and its mask can be made in one pass over ``x`` (a
        contiguous float32 CPU tensor, Triton not chosen), else None: the caller takes its PyTorch path."""
        if use_triton(x, backend) or not x.is_contiguous():
            return None
        return _float_kernel(x, backend)

    @staticmethod
    def empty_packed(numel: int) -> torch.Tensor:
        return torch.empty(packed_nbytes(numel, 1), dtype=torch.uint8)

    @classmethod
    def relu(cls, x: torch.Tensor, inplace: bool, backend: str = "auto"):
        """``(relu(x), its mask)``; on the CPU kernel one pass makes both (in place when asked)."""
        lib = cls.one_pass_kernel(x, backend)
        if lib is None:
            y = x.clamp_min_(0) if inplace else x.clamp_min(0)
            return y, cls.positive(y, backend)
        y = x if inplace else torch.empty_like(x)
        packed = cls.empty_packed(x.numel())
        lib.relu_mask(x.data_ptr(), x.numel(), y.data_ptr(), packed.data_ptr(), torch.get_num_threads())
        if inplace:  # written through a pointer: count the change as an in-place op would
            torch.autograd.graph.increment_version(x)
        return y, cls(packed, y.shape, "compiled")

    def apply(self, t: torch.Tensor, inplace: bool = False) -> torch.Tensor:
        """``t`` where the mask is set, 0 elsewhere (with the backend that made the mask); ``inplace``: into
        ``t`` itself where the path allows it (a fresh tensor saves the new allocation's page faults)."""
        if self.backend == "triton":
            from division.kernels import triton_codecs
            return triton_codecs.mask_apply(t, self.packed)
        lib = _float_kernel(t, self.backend) if self.backend == "compiled" else None
        if lib is None:
            if inplace:
                return t.masked_fill_(self.decode().view(t.shape).logical_not(), 0)
            return torch.where(self.decode().view(t.shape), t, torch.zeros((), dtype=t.dtype, device=t.device))
        tc = t.contiguous()
        out = tc if inplace and tc is t else torch.empty(t.shape, dtype=t.dtype)
        lib.mask_apply(tc.data_ptr(), self.packed.data_ptr(), t.numel(), out.data_ptr(), torch.get_num_threads())
        return out

    def tensors(self):
        return [self.packed]

    def decode(self) -> torch.Tensor:
        n = 1
        for s in self.shape:
            n *= s
        lib = _mask_kernel(self.packed, self.backend)
        if lib is None:
            return unpack_bits(self.packed, 1, n).view(self.shape).bool()
        out = torch.empty(self.shape, dtype=torch.bool)
        lib.unpack_mask(self.packed.data_ptr(), n, out.data_ptr(), torch.get_num_threads())
        return out


def _mask_kernel(packed: torch.Tensor, backend: str):
    """The CPU kernel library for unpacking a mask the kernels made (backend "compiled"), else None."""
    if backend != "compiled" or packed.device.type != "cpu":
        return None
    from division import kernels
    return kernels.library()


@dataclass(eq=False)
class Bf16Copy(Packed):
    """A tensor too small to be worth compressing, held in bfloat16."""

    data: torch.Tensor
    dtype: torch.dtype
    kind = "bf16"
    backend = "none"  # a plain cast: no codec implementation to choose

    @classmethod
    def encode(cls, x: torch.Tensor) -> "Bf16Copy":
        return cls(x.to(torch.bfloat16).contiguous() if x.dtype != torch.bfloat16 else x, x.dtype)

    def tensors(self):
        return [self.data]

    def decode(self) -> torch.Tensor:
        return self.data.to(self.dtype)


@dataclass(eq=False)
class FullCopy(Packed):
    """The activation itself, uncompressed (full precision): a reference, not a copy."""

    data: torch.Tensor
    kind = "full"
    backend = "none"

    def tensors(self):
        return [self.data]

    def decode(self) -> torch.Tensor:
        return self.data


@dataclass(eq=False)
class ExactReference(FullCopy):
    """An activation held exactly, by reference, as plain autograd holds it (a byte budget's "exact" choice):
    its storage stays alive, and counts, until backward. Plain autograd's version check, kept: an in-place
    change after the forward is an error, not a silently wrong gradient."""

    version: int = 0
    kind = "exact"
    what = "an activation held exactly"
    hint = ""

    @classmethod
    def encode(cls, x: torch.Tensor, split=None) -> "ExactReference":
        return cls(x, x._version)

    def decode(self) -> torch.Tensor:
        if self.data._version != self.version:
            raise RuntimeError(f"{self.what} was modified in place after the forward that saved it (version "
                               f"{self.version} -> {self.data._version}){self.hint}")
        return self.data


@dataclass(eq=False)
class InputReference(ExactReference):
    """The model's input, held by reference: the caller keeps its batch through backward anyway, so holding it
    exactly costs no memory, where codes for it would add some (the version check as ExactReference's)."""

    kind = "input"
    what = "the model's input"
    hint = "; keep_input holds it by reference"
