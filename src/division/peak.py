"""The process's peak memory during a training step: the CUDA allocator's peak, or on CPU the peak resident set,
with glibc told to give large freed blocks back while a measurement runs (so the resident set follows the
tensors alive, not the heap's high-water mark)."""
import ctypes
import ctypes.util
import functools
import resource
from typing import Optional

import torch

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
LARGE_BLOCK = 64 * 1024
FAST_MMAP_THRESHOLD = 32 * 2**20  # glibc's own ceiling for its dynamic threshold


@functools.lru_cache(maxsize=1)
def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def glibc_allocates() -> bool:
    """Whether the process's malloc is glibc's: a preloaded allocator (``LD_PRELOAD=libjemalloc.so.2``, which
    speeds up long CPU runs) serves the tensors instead, and glibc's settings below then change nothing."""
    try:
        process, libc = ctypes.CDLL(None), _libc()
        address = lambda f: ctypes.cast(f, ctypes.c_void_p).value  # noqa: E731
        return address(process.malloc) == address(libc.malloc)
    except (OSError, AttributeError):
        return False


def _mallopt(mmap_threshold: int, trim_threshold: int) -> bool:
    if not glibc_allocates():
        return False
    try:
        libc = _libc()
        return libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold) == 1 and \
            libc.mallopt(M_TRIM_THRESHOLD, trim_threshold) == 1
    except (OSError, AttributeError):
        return False


def release_freed_memory() -> bool:
    """Tell glibc to serve blocks of 64 KiB and more with mmap and to give them back at free (CPU runs).

    By default glibc raises its mmap threshold after the first large free and keeps later frees in its heap,
    so the resident set stays at the heap's high-water mark: a peak that says more about the allocator than
    about the tensors alive. With this, the resident set follows live memory (same effect as
    ``MALLOC_MMAP_THRESHOLD_=65536``, set at run time). The price is a page fault per fresh page: training
    steps run markedly slower, so the runner and the benchmark use it only while they measure memory and
    then call :func:`reuse_freed_memory`. Returns False where unsupported (not glibc's malloc: the peak is
    then the resident set under the other allocator, and the results do not claim this setting).
    """
    if not _mallopt(LARGE_BLOCK, LARGE_BLOCK):
        return False
    try:  # and give back what the heap holds free now, so the measurement starts from live memory
        _libc().malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return True


def reuse_freed_memory() -> bool:
    """The fast setting after a memory measurement: blocks under 32 MiB are reused from the heap (glibc's
    default behaviour at its largest), larger ones still go back at free."""
    return _mallopt(FAST_MMAP_THRESHOLD, 2 * FAST_MMAP_THRESHOLD)


def _status_kib(field_name: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def resident_bytes() -> int:
    kib = _status_kib("VmRSS")
    return kib * 1024 if kib is not None else 0


class PeakMeter:
    """Peak memory since ``reset()``: the CUDA allocator's max allocated, or on CPU the process's peak
    resident set (VmHWM, reset through /proc/self/clear_refs; where that is unavailable, the lifetime peak,
    and ``resettable`` says so)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.resettable = device.type == "cuda" or _status_kib("VmHWM") is not None
        self.base = 0

    def current(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.memory_allocated(self.device))
        return resident_bytes()

    def reset(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.resettable:
            try:
                with open("/proc/self/clear_refs", "w") as fh:
                    fh.write("5")
            except OSError:
                self.resettable = False
        self.base = self.current()

    def peak(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return int(torch.cuda.max_memory_allocated(self.device))
        kib = _status_kib("VmHWM") if self.resettable else None
        if kib is not None:
            return kib * 1024
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024

    def growth(self) -> int:
        """Peak minus what was in use at ``reset()``."""
        return max(0, self.peak() - self.base)

    def describe(self) -> str:
        if self.device.type == "cuda":
            return "torch.cuda.max_memory_allocated since the step began"
        how = "VmHWM reset by /proc/self/clear_refs" if self.resettable else "lifetime ru_maxrss (not resettable)"
        return f"process peak resident set ({how})"
