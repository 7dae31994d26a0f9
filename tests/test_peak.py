"""The CPU peak's allocator setting applies only where glibc's malloc serves the process."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from division.peak import glibc_allocates, release_freed_memory, reuse_freed_memory

JEMALLOC = Path("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")


def test_glibc_serves_this_process_and_takes_the_setting():
    assert glibc_allocates()
    assert release_freed_memory() and reuse_freed_memory()


@pytest.mark.skipif(not JEMALLOC.exists(), reason="needs jemalloc (Debian: libjemalloc2)")
def test_a_preloaded_allocator_is_seen_and_not_claimed():
    """Under LD_PRELOAD=libjemalloc the glibc setting changes nothing, so it is not applied (and the result
    files' peak_mem_how does not claim it)."""
    code = ("from division.peak import glibc_allocates, release_freed_memory; "
            "print(glibc_allocates(), release_freed_memory())")
    env = {**os.environ, "LD_PRELOAD": str(JEMALLOC), "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "False"]
