"""Timelines in the Chrome / Perfetto trace format (open in ui.perfetto.dev or chrome://tracing).

One track (``pid``) per rank or simulated device stage, one complete event (``ph: "X"``) per
actor firing. Within a rank, one row (``tid``) for compute and one per communication stream
(``comm dp``: the collectives issued on mesh axis dp, each from its issue to the return of its
wait), so a gradient bucket reduced under the backward shows beside it. The real run (``sbpc run --trace``) and the compiler's simulation (``sbpc
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
    stream: str = "compute"  # or "comm <axis>"


def chrome_trace(spans: list[Span], track_names: dict[int, str], *, scale: float = 1e6) -> dict:
    """``scale`` turns span units into the format's microseconds."""
    events = [{"ph": "M", "pid": t, "name": "process_name", "args": {"name": name}} for t, name in sorted(track_names.items())]
    events += [{"ph": "M", "pid": t, "name": "process_sort_index", "args": {"sort_index": t}} for t in sorted(track_names)]
    streams = sorted({(s.track, s.stream) for s in spans}, key=lambda ts: (ts[0], ts[1] != "compute", ts[1]))
    tid = {ts: sum(1 for o in streams[:k] if o[0] == ts[0]) for k, ts in enumerate(streams)}
    events += [{"ph": "M", "pid": t, "tid": tid[(t, name)], "name": "thread_name", "args": {"name": name}} for t, name in streams]
    for s in spans:
        events.append({"ph": "X", "pid": s.track, "tid": tid[(s.track, s.stream)], "name": s.name,
                       "cat": "communication" if s.stream != "compute" else _category(s.name),
                       "ts": round(s.start * scale, 3), "dur": round(max(s.end - s.start, 0.0) * scale, 3),
                       "args": {"step": s.step}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(path: str, spans: list[Span], track_names: dict[int, str], *, scale: float = 1e6) -> None:
    """Write atomically: a crash never leaves half a trace behind."""
    write_atomic(path, json.dumps(chrome_trace(spans, track_names, scale=scale)))


def _category(name: str) -> str:
    return {"P": "pre", "F": "forward", "B": "backward", "U": "update"}.get(name[:1], "step")
