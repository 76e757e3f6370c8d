"""runtime/host_memory.py: with the cpu backend made, memory a step frees stays in the process,
so the next step's same allocations take no page faults. Each case runs in a fresh interpreter:
glibc's thresholds depend on the process's allocation history."""
import subprocess
import sys

import pytest

from sbpc.runtime.host_memory import keep_freed_memory

# four 24 MiB blocks written and freed, five times; prints the faults of the last time. The
# blocks come straight from malloc (torch's tensors come from it too), so that no small
# allocation of the interpreter lands between them. Without the setting glibc maps the first
# round's blocks on their own, then serves them from the heap and trims the 96 MiB freed at its
# top back to the kernel every round (more than its highest trim threshold, 64 MiB). "tensors":
# the same with four torch tensors of that size.
SCRIPT = """
import ctypes, resource, sys
import torch
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes, libc.memset.argtypes = [ctypes.c_void_p], [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
mode, size = sys.argv[1], 24 << 20
if mode != "plain":
    from sbpc.runtime.backend import make_backend
    assert make_backend("cpu").keeps_freed_memory

def blocks():
    held = [libc.malloc(size) for _ in range(4)]
    for p in held:
        libc.memset(p, 1, size)
    for p in held:
        libc.free(p)

def tensors():
    held = [torch.ones(size // 4) for _ in range(4)]
    del held

faults = []
for _ in range(5):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    tensors() if mode == "tensors" else blocks()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(faults[-1])
"""
PAGES = 4 * (24 << 20) // 4096  # the faults of touching the four tensors' memory afresh


def _last_round_faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not keep_freed_memory(), reason="not glibc: mallopt is absent or refused")
def test_cpu_backend_keeps_freed_memory_for_the_next_step():
    assert _last_round_faults("plain") > PAGES // 2  # glibc's default gives it back each round
    assert _last_round_faults("backend") < PAGES // 50
    assert _last_round_faults("tensors") < PAGES // 50
