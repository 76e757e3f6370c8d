"""Timelines in the Chrome / Perfetto trace format (open in ui.perfetto.dev or chrome://tracing).

One track (``pid``) per rank or simulated device stage, one complete event (``ph: "X"``) per
actor firing. The real run (``sbpc run --trace``) and the compiler's simulation (``sbpc
compile --trace``) write the same format, so the two can be laid side by side.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from sbpc.runtime.files import write_atomic


@dataclass(frozen=True)
class Span:
    track: int  # rank, or device stage in a simulation
    name: str  # the firing, e.g. "F1.3" (forward of chunk 1, micro-batch 3)
    start: float  # seconds (simulations: units of the cost model)
    end: float
    step: int = 0


def chrome_trace(spans: list[Span], track_names: dict[int, str], *, scale: float = 1e6) -> dict:
    """``scale`` turns span units into the format's microseconds."""
    events = [{"ph": "M", "pid": t, "name": "process_name", "args": {"name": name}} for t, name in sorted(track_names.items())]
    events += [{"ph": "M", "pid": t, "name": "process_sort_index", "args": {"sort_index": t}} for t in sorted(track_names)]
    for s in spans:
        events.append({"ph": "X", "pid": s.track, "tid": 0, "name": s.name, "cat": _category(s.name),
                       "ts": round(s.start * scale, 3), "dur": round(max(s.end - s.start, 0.0) * scale, 3),
                       "args": {"step": s.step}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(path: str, spans: list[Span], track_names: dict[int, str], *, scale: float = 1e6) -> None:
    """Write atomically: a crash never leaves half a trace behind."""
    write_atomic(path, json.dumps(chrome_trace(spans, track_names, scale=scale)))


def _category(name: str) -> str:
    return {"P": "pre", "F": "forward", "B": "backward", "U": "update"}.get(name[:1], "step")
