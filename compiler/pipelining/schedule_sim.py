"""Simulate the actor system of a pipelined plan and derive each device's firing order.

Every device stage runs its chunks' actors. An actor fires when what it reads is ready and,
for a forward, when an activation regst is free: the forward of micro-batch j keeps what its
backward needs in a regst until that backward has run. The regst count of a device is not
configured; it follows from the schedule and the device's stage index s of p:

==============  ============================================  =========================
schedule        regsts of a device (micro-batches in flight)  when several actors can fire
==============  ============================================  =========================
``gpipe``       m * v                                         forward first
``1f1b``        min(p - s, m)                                 backward first
``interleaved`` min(2 (p - s - 1) + (v - 1) p + 1, m * v)     Megatron's order: forwards in
                                                              groups of p micro-batches per
                                                              chunk, then 1F1B in turn
==============  ============================================  =========================

Durations come from a ``TaskCost`` (a policy; unit cost by default: forward 1, backward 2,
everything else 0, each divided by v for chunks of a virtual pipeline). The result is one
order per device, which the runtime follows, plus the timeline for traces and the bubble.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Callable

from sbpc.errors import CompileError
from sbpc.runtime.pipeline_tasks import Task, TaskGraph, fmt
from sbpc.runtime.kinds import ScheduleName

TaskCost = Callable[[Task], float]


def unit_cost(virtual_stages: int) -> TaskCost:
    per = {"fwd": 1.0, "bwd": 2.0}
    return lambda t: per.get(t.phase, 0.0) / virtual_stages


@dataclass
class Slice:
    task: Task
    device: int
    start: float
    end: float


@dataclass
class Simulation:
    order: list[list[Task]]
    in_flight: list[int]  # regsts per device
    peak_in_flight: list[int]  # the most micro-batches any device actually held
    timeline: list[Slice] = field(default_factory=list)

    @property
    def makespan(self) -> float:
        return max((s.end for s in self.timeline), default=0.0)

    def bubble(self) -> float:
        """Idle fraction of the step, averaged over devices."""
        span = self.makespan
        if span <= 0:
            return 0.0
        busy = [0.0] * len(self.order)
        for s in self.timeline:
            busy[s.device] += s.end - s.start
        return sum(1 - b / span for b in busy) / len(busy)


def regsts(schedule: ScheduleName, stage: int, stages: int, microbatches: int, virtual: int) -> int:
    p, m, v, s = stages, microbatches, virtual, stage
    if schedule == ScheduleName.GPIPE:
        return m * v
    if schedule == ScheduleName.ONE_F_ONE_B:
        return min(p - s, m)
    return min(2 * (p - s - 1) + (v - 1) * p + 1, m * v)


def simulate(graph: TaskGraph, schedule: ScheduleName | str, stages: int, virtual: int,
             cost: TaskCost | None = None) -> Simulation:
    try:
        schedule = ScheduleName(schedule)
    except ValueError:
        raise CompileError(f"unknown pipeline schedule {schedule!r}", hint="choose one of " + ScheduleName.names()) from None
    cost = cost or unit_cost(virtual)
    p, m = stages, graph.m
    limits = [regsts(schedule, s, p, m, virtual) for s in range(p)]
    deps = {t: graph.deps(t) for t in graph.tasks()}
    if schedule == ScheduleName.INTERLEAVED:
        return _timed(_interleaved_order(deps, p, m, virtual, limits), deps, cost, limits)
    priority = _priority(schedule, p, virtual)
    has_bwd = {t.chunk for t in deps if t.phase == "bwd"}
    queues = [_DeviceQueue(priority, has_bwd) for _ in range(p)]
    waiting: list[set[Task]] = [set() for _ in range(p)]  # not started yet, per device
    unmet: dict[Task, int] = {}  # dependencies that have not started yet
    readers: dict[Task, list[Task]] = {}
    rank = {t: k for k, t in enumerate(deps)}  # the order of ``deps`` breaks ties of priority
    for t, ds in deps.items():
        waiting[t.chunk % p].add(t)
        unmet[t] = len(ds)
        for x in ds:
            readers.setdefault(x, []).append(t)
        if not ds:
            queues[t.chunk % p].arrive(t, -math.inf, rank[t])
    finish: dict[Task, float] = {}
    held = [0] * p  # forwards whose backward has not run, per device
    peak = [0] * p
    busy_until = [0.0] * p
    running: list[tuple[float, int, Task]] = []
    order: list[list[Task]] = [[] for _ in range(p)]
    timeline: list[Slice] = []
    now, seq, left = 0.0, 0, len(deps)
    while left:
        _release(running, now, held, has_bwd, p)
        started = False
        for d in range(p):
            if busy_until[d] > now:
                continue
            t = queues[d].pop_first(now, allow_fwd=held[d] < limits[d])
            if t is None:
                continue
            waiting[d].remove(t)
            left -= 1
            end = now + cost(t)
            finish[t] = end
            busy_until[d] = end
            order[d].append(t)
            timeline.append(Slice(t, d, now, end))
            if t.phase == "fwd" and t.chunk in has_bwd:
                held[d] += 1
                peak[d] = max(peak[d], held[d])
            heapq.heappush(running, (end, seq, t))
            seq += 1
            started = True
            # a reader whose dependencies have all started is ready when the last of them ends
            # (a finish time never changes once set)
            for r in readers.get(t, ()):
                unmet[r] -= 1
                if unmet[r] == 0:
                    queues[r.chunk % p].arrive(r, max(finish[x] for x in deps[r]), rank[r])
        if started:
            continue  # zero-cost tasks finish at ``now``: let what they unblock start at ``now`` too
        if not running:  # what is still running ends after ``now`` (_release took the rest)
            stuck = [f"stage {d}: next {fmt(min(w, key=priority))}" for d, w in enumerate(waiting) if w]
            raise CompileError("the pipeline's actors cannot all fire: " + "; ".join(stuck),
                               hint="a dependency cycle between stages; check the stage assignment")
        now = running[0][0]
    return Simulation(order, limits, peak, timeline)


class _DeviceQueue:
    """One device's tasks whose dependencies have all started, by when they can run. Among
    those ready at ``now`` the device fires the first by the schedule's priority (ties: the
    earlier in ``rank``); a forward that keeps activations for its backward waits while the
    device's regsts are all held. Heaps, not a scan of every waiting task per event: a 1T
    pipeline has 64 stages x 64 micro-batches of tasks."""

    def __init__(self, priority, has_bwd: set[int]):
        self.priority, self.has_bwd = priority, has_bwd
        self.later: list[tuple[float, int, Task]] = []  # (ready at, rank, task)
        self.ready: list[tuple[tuple, int, Task]] = []  # (priority, rank, task): ready, needs no regst
        self.ready_fwd: list[tuple[tuple, int, Task]] = []  # ready forwards that take a regst

    def arrive(self, t: Task, at: float, rank: int) -> None:
        heapq.heappush(self.later, (at, rank, t))

    def pop_first(self, now: float, allow_fwd: bool) -> Task | None:
        while self.later and self.later[0][0] <= now:
            _, rank, t = heapq.heappop(self.later)
            heap = self.ready_fwd if t.phase == "fwd" and t.chunk in self.has_bwd else self.ready
            heapq.heappush(heap, (self.priority(t), rank, t))
        best = self.ready or None
        if allow_fwd and self.ready_fwd and (best is None or self.ready_fwd[0][:2] < best[0][:2]):
            best = self.ready_fwd
        return heapq.heappop(best)[2] if best is not None else None


def _interleaved_order(deps, p: int, m: int, v: int, limits: list[int]) -> list[list[Task]]:
    """Megatron's interleaved 1F1B: forwards in groups of p micro-batches, chunk by chunk;
    backwards the same with the chunks reversed; a warmup of (regsts - 1) forwards, then one
    forward and one backward in turn, then the remaining backwards."""
    order = []
    for d in range(p):
        tasks = [t for t in deps if t.chunk % p == d]
        groups = range(0, m, p)
        fwd = [Task(k * p + d, "fwd", j) for g in groups for k in range(v) for j in range(g, min(g + p, m))]
        bwd = [Task(k * p + d, "bwd", j) for g in groups for k in reversed(range(v)) for j in range(g, min(g + p, m))]
        fwd, bwd = [t for t in fwd if t in deps], [t for t in bwd if t in deps]
        warm = min(limits[d] - 1, len(fwd))
        seq = fwd[:warm]
        for i in range(len(fwd) - warm):
            seq += [fwd[warm + i], bwd[i]]
        seq += bwd[len(fwd) - warm:]
        pre = sorted((t for t in tasks if t.phase == "pre"), key=lambda t: (t.mb, t.chunk))
        opt = sorted((t for t in tasks if t.phase == "opt"), key=lambda t: (t.part, t.chunk))
        order.append(pre + seq + opt)
    return order


def timed(graph: TaskGraph, order: list[list[Task]], cost: TaskCost, limits: list[int]) -> Simulation:
    """The timeline of the per-device orders ``order`` (a plan's ``pipeline.order``) with task
    durations from ``cost``: what `sbpc simulate` runs over a cluster's cost model."""
    return _timed(order, {t: graph.deps(t) for t in graph.tasks()}, cost, limits)


def _timed(order: list[list[Task]], deps, cost: TaskCost, limits: list[int]) -> Simulation:
    """The timeline of a fixed per-device order: each task starts when its device is free and
    what it reads is done."""
    finish: dict[Task, float] = {}
    free = [0.0] * len(order)
    pos = [0] * len(order)
    timeline: list[Slice] = []
    while any(pos[d] < len(o) for d, o in enumerate(order)):
        moved = False
        for d, o in enumerate(order):
            while pos[d] < len(o) and all(x in finish for x in deps[o[pos[d]]]):
                t = o[pos[d]]
                start = max([free[d]] + [finish[x] for x in deps[t]])
                finish[t] = free[d] = start + cost(t)
                timeline.append(Slice(t, d, start, finish[t]))
                pos[d] += 1
                moved = True
        if not moved:
            stuck = [f"stage {d}: next {fmt(o[pos[d]])}" for d, o in enumerate(order) if pos[d] < len(o)]
            raise CompileError("the pipeline's actors cannot all fire: " + "; ".join(stuck),
                               hint="a dependency cycle between stages; check the stage assignment")
    peak = []
    for o in order:
        held = top = 0
        for t in o:
            held += (t.phase == "fwd") - (t.phase == "bwd")
            top = max(top, held)
        peak.append(top)
    return Simulation(order, limits, peak, timeline)


def _release(running, now, held, has_bwd, p) -> None:
    while running and running[0][0] <= now:
        _, _, t = heapq.heappop(running)
        if t.phase == "bwd" and t.chunk in has_bwd:
            held[t.chunk % p] -= 1


def _priority(schedule: ScheduleName, p: int, v: int):
    phase_rank = {"pre": 0, "opt": 9}

    def key(t: Task):
        j = t.mb if t.mb is not None else 0
        if t.phase in phase_rank:
            return (phase_rank[t.phase], t.part, j, t.chunk)
        first = 1 if (t.phase == "fwd") == (schedule == ScheduleName.GPIPE) else 2
        return (first, j, -t.chunk if t.phase == "bwd" else t.chunk)

    return key
