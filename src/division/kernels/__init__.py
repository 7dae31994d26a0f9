"""Optional compiled CPU kernels, built on first use with the system C compiler into a per-user cache
(keyed by the source's hash and the flags) and loaded with ctypes. If no compiler is available the reference
implementation is used; ``available()`` says which. ``DIVISION_KERNEL_FLAGS`` adds compiler flags, e.g.
``-mno-avx512f -mno-bmi2`` to build and test here the paths that CPUs without those extensions take."""
import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

_SOURCES = [Path(__file__).with_name(n) for n in ("division_cpu.c", "nhwc_cpu.c", "masks_cpu.c", "pool_cpu.c",
                                                             "compact_cpu.c")]
_HEADERS = sorted(Path(__file__).parent.glob("*.h"))
_FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno")  # part of the cache key
_LOCK = threading.Lock()
_LIB = {}


def _cache_dir() -> Path:
    root = os.environ.get("DIVISION_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "division", "kernels")
    return Path(root)


def _machine() -> str:
    """Built with -march=native, so the cache key names the CPU."""
    import platform
    model = ""
    try:
        with open("/proc/cpuinfo") as fh:
            model = next((line for line in fh if line.startswith("flags")), "")
    except OSError:
        pass
    return platform.machine() + model


def _flags():
    return _FLAGS + tuple(os.environ.get("DIVISION_KERNEL_FLAGS", "").split())


def _build() -> ctypes.CDLL:
    src = b"".join(p.read_bytes() for p in _SOURCES + _HEADERS)
    flags = _flags()
    tag = hashlib.sha1(src + _machine().encode() + " ".join(flags).encode()).hexdigest()[:16]
    lib_path = _cache_dir() / f"division_cpu_{tag}.so"
    if not lib_path.exists():
        chosen = os.environ.get("CC")  # CC names the compiler; only without it are cc and gcc tried
        compiler = shutil.which(chosen) if chosen else (shutil.which("cc") or shutil.which("gcc"))
        if compiler is None:
            raise OSError(f"no C compiler found ({'CC=' + chosen if chosen else 'cc, gcc'})")
        lib_path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=lib_path.parent) as tmp:
            out = Path(tmp) / lib_path.name
            subprocess.run([compiler, *flags, *map(str, _SOURCES), "-o", str(out), "-lm"], check=True, capture_output=True, timeout=120)
            os.replace(out, lib_path)
    lib = ctypes.CDLL(str(lib_path))
    p, i64, i32, u64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_uint64
    lib.division_encode.argtypes = [p, i64, i64, i64, i64, i64, i32, u64, i32, p, p, p, p, p, i32, i32, i32, p]
    lib.division_encode.restype = i32
    lib.pack_codes.argtypes = [p, i64, i32, p, i32]
    lib.pack_codes.restype = None
    lib.division_decode.argtypes = [p, p, p, p, i64, i64, i64, i64, i64, i32, p, i32, p, i32]
    lib.division_decode.restype = i32
    lib.division_encode_nhwc.argtypes = [p, i64, i64, i64, i64, i64, i64, i32, u64, i32, p, p, p, p, i32]
    lib.division_encode_nhwc.restype = i32
    lib.division_decode_nhwc.argtypes = [p, p, p, p, i64, i64, i64, i64, i64, i64, i32, p, i32, p, ctypes.c_float]
    lib.division_decode_nhwc.restype = i32
    lib.mask_positive.argtypes = [p, i64, p, i32]
    lib.mask_positive.restype = None
    lib.mask_apply.argtypes = [p, p, i64, p, i32]
    lib.mask_apply.restype = None
    lib.unpack_mask.argtypes = [p, i64, p, i32]
    lib.unpack_mask.restype = None
    lib.maxpool_codes.argtypes = [p, i64, i64, i64, i32, i32, i32, i32, i32, i32, i64, i64, p, p, i32]
    lib.maxpool_codes.restype = None
    lib.maxpool_codes_backward.argtypes = [p, p, i32, i64, i64, i64, i32, i32, i32, i32, i32, i64, i64, p, i32]
    lib.maxpool_codes_backward.restype = None
    lib.relu_mask.argtypes = [p, i64, p, p, i32]
    lib.relu_mask.restype = None
    lib.quant_relu_mask.argtypes = [p, i64, i32, p, p, i32]
    lib.quant_relu_mask.restype = None
    lib.bn_relu_rebuild.argtypes = [p, p, p, p, i64, i64, i64, p, i32]
    lib.bn_relu_rebuild.restype = None
    lib.count_set.argtypes = [p, i64]
    lib.count_set.restype = i64
    lib.compact_codes.argtypes = [p, p, i64, i32, p, i32]
    lib.compact_codes.restype = i32
    lib.expand_codes.argtypes = [p, i64, p, i64, i32, p, i32]
    lib.expand_codes.restype = i32
    return lib


def library():
    """The loaded kernel library, or None (with one warning) when it cannot be built."""
    with _LOCK:
        if "lib" not in _LIB:
            try:
                _LIB["lib"] = _build()
            except (OSError, subprocess.SubprocessError) as err:
                warnings.warn(f"compiled DIVISION kernels unavailable, using the reference path: {err}")
                _LIB["lib"] = None
        return _LIB["lib"]


def available() -> bool:
    return library() is not None
