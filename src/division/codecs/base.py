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


def ieee_div(t: torch.Tensor, divisor) -> torch.Tensor:
    """``t / divisor`` correctly rounded on every device. PyTorch's CUDA division by a Python scalar multiplies
    by its reciprocal (one unit off for 1/3); a 0-dim tensor on t's own device takes the IEEE division the
    CPU, the C kernel and Triton's ``div_rn`` compute, so all backends agree bit for bit."""
    return t / t.new_full((), divisor)


def bf16_outward(mn: torch.Tensor, mx: torch.Tensor, levels: int):
    """bf16 minimum rounded down and scale rounded up (float32 tensors holding bf16 values), so that the
    stored range still covers [mn, mx] and stochastic rounding with them stays unbiased; the decode uses
    exactly the values the encode used. Same bit arithmetic as the CPU kernel."""
    def truncate(t, away):
        u = t.float().contiguous().view(torch.int32)
        kept = u & -65536  # 0xFFFF0000: sign, exponent and the top 7 mantissa bits
        return (kept + torch.where(away & (kept != u), 65536, 0).to(torch.int32)).view(torch.float32)

    low = truncate(mn, mn < 0)  # truncation is toward zero: a negative minimum takes one more unit
    scale = ieee_div(mx - low, levels)
    return low, truncate(scale, torch.ones_like(scale, dtype=torch.bool))


def process_rank() -> int:
    """This process's rank in the default process group (0 when not distributed)."""
    import torch.distributed as torch_dist
    return torch_dist.get_rank() if torch_dist.is_available() and torch_dist.is_initialized() else 0


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


def rounding_seed(generator=None, bits: int = 62) -> int:
    """The seed of one stochastic-rounding kernel call, in [2, 2^bits): drawn from ``generator`` (the CPU
    default when None, so no device synchronisation) and, on distributed rank r > 0, mixed with r. Every
    rank seeds its generators alike (identical model initialisation); without the mix every rank would draw
    the same dither, and rounding errors would be correlated instead of averaging out in the all-reduce.
    Rank 0 (and a single process) keeps the plain draw. (2 and up: Triton specialises an argument equal to 1.)"""
    draw = int(torch.randint(0, 2 ** bits, (1,), generator=generator).item())
    rank = process_rank()
    if rank:
        draw = _splitmix64(draw ^ _splitmix64(rank)) >> (64 - bits)
    return max(draw, 2)


def rounding_generator(generator, device):
    """The generator for the reference quantizer's uniform noise: ``generator`` when given; else the device's
    default on rank 0, and on other ranks a fresh one seeded by :func:`rounding_seed` (see there why)."""
    if generator is not None or process_rank() == 0:
        return generator
    return torch.Generator(device).manual_seed(rounding_seed(None))


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
