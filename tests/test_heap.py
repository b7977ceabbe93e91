"""tinyconv.distributed.heap: glibc keeps freed memory when asked, and the switch turns it off."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


def run(env_value: str | None) -> str:
    """keep_freed_memory() in a fresh interpreter (its settings last for the whole process)."""
    env = {} if env_value is None else {"TINYCONV_KEEP_FREED_MEMORY": env_value}
    code = "from tinyconv.distributed.heap import keep_freed_memory; print(keep_freed_memory())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60, check=True)
    return out.stdout.strip()


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_glibc_takes_the_settings():
    assert run(None) == "True"


def test_the_switch_turns_it_off():
    assert run("0") == "False"


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_a_freed_block_over_2_gib_stays_in_the_heap():
    """INT_MAX as the trim threshold gave back any top over 2 GiB (conv2's columns of 300:1000 at
    batch 256), to be faulted in again at the next step. The block is never written: the heap's
    end (sbrk(0)) moves without touching a page."""
    code = (
        "import ctypes, numpy as np\n"
        "from tinyconv.distributed.heap import keep_freed_memory\n"
        "assert keep_freed_memory()\n"
        "libc = ctypes.CDLL(None); libc.sbrk.restype = ctypes.c_void_p; libc.sbrk.argtypes = (ctypes.c_ssize_t,)\n"
        "a = np.empty(2_300_000_000, np.uint8); end = libc.sbrk(0); del a\n"
        "print(libc.sbrk(0) - end)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert int(out.stdout) == 0, f"the heap shrank by {out.stdout.strip()} bytes when a 2.3 GB block was freed"


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's")
def test_release_gives_back_a_freed_block_below_the_top():
    """A written 400 MB block freed below a live one stays resident (kept for reuse) until
    release_freed_memory() hands its pages back; the live block keeps the heap's top in use."""
    code = (
        "import numpy as np\n"
        "from tinyconv.distributed.heap import keep_freed_memory, release_freed_memory\n"
        "assert keep_freed_memory()\n"
        "rss = lambda: int(open('/proc/self/statm').read().split()[1]) * 4096\n"
        "a = np.ones(400_000_000, np.uint8); b = np.ones(1_000_000, np.uint8)\n"
        "del a; kept = rss()\n"
        "print(release_freed_memory(), kept - rss())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    released, freed = out.stdout.split()
    assert released == "True" and int(freed) > 350_000_000, f"released {freed} bytes, expected about 400 MB"
