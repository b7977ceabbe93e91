"""tinyconv.heap: glibc keeps freed memory when asked, and the switch turns it off."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


def run(env_value: str | None) -> str:
    """keep_freed_memory() in a fresh interpreter (its settings last for the whole process)."""
    env = {} if env_value is None else {"TINYCONV_KEEP_FREED_MEMORY": env_value}
    code = "from tinyconv.heap import keep_freed_memory; print(keep_freed_memory())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60, check=True)
    return out.stdout.strip()


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_glibc_takes_the_settings():
    assert run(None) == "True"


def test_the_switch_turns_it_off():
    assert run("0") == "False"
