"""What every codec shares: the choices (bits, backends, statistics dtype) with their checks, byte accounting
by storage, and the ``Packed`` interface of a compressed activation."""
from abc import ABC, abstractmethod

import torch

VALID_BITS = (1, 2, 4, 8)
BACKENDS = ("auto", "reference", "compiled", "triton")
STAT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def check_stat_dtype(stat_dtype) -> str:
    """The dtype of the per-row minimum and scale. fp16 is not offered: its range (+-65504, scales below
    6e-8 flush to zero) cannot hold every activation's statistics; bf16 keeps fp32's exponent range."""
    if stat_dtype not in STAT_DTYPES:
        raise ValueError(f"stat_dtype={stat_dtype!r} is invalid; valid choices: {list(STAT_DTYPES)}")
    return stat_dtype


def bf16_outward(mn: torch.Tensor, mx: torch.Tensor, levels: int):
    """bf16 minimum rounded down and scale rounded up (float32 tensors holding bf16 values), so that the
    stored range still covers [mn, mx] and stochastic rounding with them stays unbiased; the decode uses
    exactly the values the encode used. Same bit arithmetic as the CPU kernel."""
    def truncate(t, away):
        u = t.float().contiguous().view(torch.int32)
        kept = u & -65536  # 0xFFFF0000: sign, exponent and the top 7 mantissa bits
        return (kept + torch.where(away & (kept != u), 65536, 0).to(torch.int32)).view(torch.float32)

    low = truncate(mn, mn < 0)  # truncation is toward zero: a negative minimum takes one more unit
    scale = (mx - low) / levels
    return low, truncate(scale, torch.ones_like(scale, dtype=torch.bool))


def check_backend(backend) -> str:
    """``auto``: Triton kernels for CUDA tensors, the compiled C kernel for CPU tensors, else PyTorch;
    ``reference``: pure PyTorch; ``compiled``: the CPU kernel, an error if it cannot be built; ``triton``: the
    Triton kernels (CUDA, or any device under TRITON_INTERPRET=1). Tensors a kernel cannot take use PyTorch."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is invalid; valid choices: {list(BACKENDS)}")
    return backend


def use_triton(t: torch.Tensor, backend: str) -> bool:
    """Whether the Triton kernels serve ``t`` under ``backend``."""
    if backend not in ("auto", "triton") or (backend == "auto" and t.device.type != "cuda"):
        return False
    from division.kernels import triton_codecs
    if triton_codecs.available(t.device):
        return True
    if backend == "triton":
        raise RuntimeError(f"backend='triton' but Triton cannot run on {t.device} (it needs CUDA, or "
                           "TRITON_INTERPRET=1 for the interpreter); use backend=auto")
    return False


def kernel_library(backend: str):
    """The compiled library if ``backend`` allows it and it is available, else None."""
    if backend in ("reference", "triton"):
        return None
    from division import kernels
    lib = kernels.library()
    if lib is None and backend == "compiled":
        raise RuntimeError("backend='compiled' but the compiled kernels could not be built (no C compiler?); "
                           "use backend=auto or backend=reference")
    return lib


def check_bits(bits, what: str = "bits") -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in VALID_BITS:
        raise ValueError(f"{what}={bits!r} is not supported; valid choices: {list(VALID_BITS)}")
    return bits


def storage_key(t: torch.Tensor):
    return (t.device.type, t.device.index, t.untyped_storage().data_ptr())


def tensor_storages(values) -> set:
    """Storage keys of the tensors among ``values`` (a call's arguments, say)."""
    return {storage_key(v) for v in values if isinstance(v, torch.Tensor)}


def unique_nbytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a view counts its whole storage, once)."""
    seen = {}
    for t in tensors:
        if t is None:
            continue
        seen.setdefault(storage_key(t), t.untyped_storage().nbytes())
    return sum(seen.values())


class Packed(ABC):
    """A compressed activation: what it holds, how many bytes, how to get the tensor back."""

    kind = "packed"
    backend = "reference"  # which implementation encoded it: "reference" (PyTorch) or "compiled"

    @abstractmethod
    def tensors(self):
        """Every tensor held (None entries allowed), for byte accounting."""

    @abstractmethod
    def decode(self) -> torch.Tensor:
        """The rebuilt activation, in its original dtype and shape."""

    def nbytes(self) -> int:
        return unique_nbytes(self.tensors())


class Rearranged(Packed):
    """A quantized tensor ``q`` whose rows came from another arrangement of the activation (reshaped, padded,
    channels moved first): ``q`` holds the bytes and names the backend; subclasses undo the arrangement."""

    kind = "quantized"
    q: Packed

    @property
    def backend(self) -> str:
        return self.q.backend

    def tensors(self):
        return self.q.tensors()


def _float_kernel(t: torch.Tensor, backend: str):
    """The compiled library for a CPU float32 tensor, else None (other tensors take the PyTorch path)."""
    if t.device.type != "cpu" or t.dtype != torch.float32:
        return None
    return kernel_library(backend)
