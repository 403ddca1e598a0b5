"""`mtplxd train` keeps the memory it frees (engine/training/freed_memory.py): a block
freed and allocated again is served from memory already mapped, so touching it again
costs no page faults. Each side runs in a process of its own (the setting is for good);
the control, the same loop without it, must fault on every page every time."""

from __future__ import annotations

import subprocess
import sys

import pytest

BLOCK = 64 << 20  # a heads step's logits of one head
ROUNDS = 5
PAGES = ROUNDS * BLOCK // 4096

LOOP = f"""
import ctypes, resource, sys
from engine.training.freed_memory import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
block = libc.malloc({BLOCK}); libc.memset(block, 1, {BLOCK}); libc.free(block)  # the first one faults either way
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range({ROUNDS}):
    block = libc.malloc({BLOCK}); libc.memset(block, 1, {BLOCK}); libc.free(block)
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(side: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", LOOP, side], capture_output=True, text=True, check=True).stdout
    kept, count = out.split()
    return kept, int(count)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux only (macOS has no mallopt)")
def test_freed_blocks_are_reused_without_page_faults():
    kept, kept_faults = faults("keep")
    assert kept == "True"
    assert kept_faults < PAGES // 20, f"{kept_faults} page faults over {ROUNDS} reused 64 MiB blocks"
    _, default_faults = faults("default")
    assert default_faults > PAGES // 2, f"the control: {default_faults} faults, expected about {PAGES}"
