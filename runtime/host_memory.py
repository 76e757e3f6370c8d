"""Keep freed host memory in the process, so a step does not pay page faults for it again.

torch's CPU tensors come from the C library's ``malloc``. glibc's adapts two thresholds as a
program runs: blocks above ``M_MMAP_THRESHOLD`` get their own ``mmap`` (unmapped again at
``free``), and when more than ``M_TRIM_THRESHOLD`` lies free at the top of the heap, ``free``
hands it back to the kernel. A training step frees most of what it allocated (activations,
gradients) and allocates the same sizes again the next step, so memory that went back is
faulted in again, one minor page fault (about 1 us, zeroing included) per 4 KiB touched.
Whether that happens depends on the heap's history: on the mid config of
``bench/run_vs_eager.py`` (3.3 M parameters, batch 8 x 128) a step took between 0 and 5,700
faults, 4-6 ms of a 145 ms step.

``keep_freed_memory`` fixes both thresholds (which also stops glibc adapting them): nothing is
trimmed, and only blocks over 32 MiB (glibc's ceiling for the threshold) are mapped on their
own. After the first step, the heap holds the step's peak and every later step reuses it,
which is what torch's CUDA caching allocator does for device memory. The cost: the process
keeps its peak host memory instead of returning it between steps.

It applies to the whole process (``mallopt`` has no narrower scope), so eager PyTorch run in
the same process (``sbpc check``, ``bench/run_vs_eager.py``) gets it too. With another C
library (macOS, musl) or a preloaded allocator (jemalloc, tcmalloc) the call does nothing or
is refused: it reports False and the run goes on as before.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys

# glibc <malloc.h>
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
NO_TRIM = -1  # "setting M_TRIM_THRESHOLD to -1 disables trimming completely" (mallopt(3))
MMAP_THRESHOLD = 32 << 20  # the largest glibc accepts on 64-bit (HEAP_MAX_SIZE / 2)


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") else None


def keep_freed_memory() -> bool:
    """Stop ``malloc`` returning freed memory to the kernel (see the module doc). Idempotent;
    True where glibc accepted both settings."""
    libc = _libc()
    if libc is None:
        return False
    libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(M_TRIM_THRESHOLD, NO_TRIM))
