"""Python's cyclic garbage collector paused while the compiler builds its graphs.

Capture (building, tracing and importing a model) and the passes (every pass remakes a graph
of ~35k nodes at 1T) allocate millions of small objects and keep most of them; each burst of
allocations triggers collections that walk every live object again. At 1T that was a quarter
of capture's time and ~10 of the passes' ~22 CPU seconds. Reference counting still frees
nearly everything; the few cycles wait for the next collection after the compile (peak RSS
grows ~0.1 GB at 1T)."""
from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def no_cycle_collection(collect_after: bool = True):
    """The collector off inside, its previous state restored after: a nested use (the
    --device-memory advice's probe compiles, capture inside a compile) leaves it as it found it.

    Everything allocated inside is still in the collector's youngest generation, so the first
    allocation after it is back on walks all of it (a 1T compile: ~1.1 M live objects, ~1 s).
    ``collect_after=False`` (the process exits after the compile: ``CompileContext.process_exits``)
    moves them into the oldest generation instead, in O(1) (``gc.freeze``, then ``gc.unfreeze``),
    where only a full collection looks at them: their cycles are not collected before then, which
    a process that compiles again would pay in memory (~30 MB per 1.3b compile)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            if not collect_after and gc.get_freeze_count() == 0:  # someone else's frozen objects stay frozen
                gc.freeze()
                gc.unfreeze()
            gc.enable()
