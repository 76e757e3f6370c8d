"""The actors of a pipelined plan: tasks, their data dependencies, and order replay.

A pipelined program is cut into tasks: the instructions of one chunk (virtual stage) with one
phase. ``pre``, ``fwd`` and ``bwd`` tasks fire once per micro-batch, ``opt`` once a step.
Two instructions are not kernels:

- ``sbpc.transfer(x, src=a, dst=b)`` on chunk b: ``x`` was made on chunk a; the task that made
  it sends it when it finishes, this task receives it before it starts. Between chunks on
  different device stages that is a send/recv between matching ranks; on one device a handoff.
- ``sbpc.mb_accumulate(x)``: the sum over the step's micro-batches of ``x``. The task that
  makes ``x`` adds each micro-batch's value into an accumulator; readers get the total, so
  they depend on every micro-batch's firing of the producer.

The once-a-step phase is cut into parts by transfers: an ``opt`` instruction that reads a value
received from another chunk's ``opt`` phase runs in a later part than what sent it. Two stages
may then both send and receive updates (a tied weight, a shared step counter) without their
update actors waiting on each other. What is not sent runs in the part that reads it, so no
part holds values made for a later one.

The compiler (schedule pass) and the runtime build the same ``TaskGraph`` from the program, so
the order the compiler proved deadlock-free is the order the runtime executes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from sbpc.errors import PlanError
from sbpc.runtime.kinds import ScheduleName

PHASES = ("pre", "fwd", "bwd", "opt")
PER_MICROBATCH = frozenset({"pre", "fwd", "bwd"})
TRANSFER = "sbpc.transfer"
ACCUMULATE = "sbpc.mb_accumulate"


@dataclass(frozen=True)
class Item:
    """One instruction as the task graph sees it."""
    index: int  # position in the chunk's program
    op: str
    outs: tuple[str, ...]
    uses: tuple[str, ...]
    phase: str
    chunk: int
    src: int | None = None  # a transfer's source chunk

    @property
    def index_key(self) -> tuple[int, int]:
        return (self.chunk, self.index)


@dataclass
class Body:
    """The instructions of one task and what crosses its boundary."""
    chunk: int
    phase: str
    part: int = 0  # of the once-a-step phase
    kernels: list[Item] = field(default_factory=list)  # run in order
    recvs: list[Item] = field(default_factory=list)  # transfers into this task
    reads: list[Item] = field(default_factory=list)  # mb_accumulate results it reads
    inputs: list[str] = field(default_factory=list)  # read here, made elsewhere (not recv/accumulated)
    outputs: list[str] = field(default_factory=list)  # made here, read elsewhere


@dataclass(frozen=True)
class Send:
    value: str  # the value on the source chunk
    dst_chunk: int
    dst_phase: str
    out: str  # the transfer's result on the destination chunk
    tag: int  # one tag per transfer, the same on both ends


@dataclass(frozen=True)
class Task:
    chunk: int
    phase: str
    mb: int | None
    part: int = 0

    @property
    def key(self) -> tuple[int, str, int]:
        return (self.chunk, self.phase, self.part)


class TaskGraph:
    def __init__(self, items: Iterable[Item], step_outputs: Iterable[str], microbatches: int):
        self.m = microbatches
        self._source_cache: dict[tuple[int, str, int], list] = {}
        self.bodies: dict[tuple[int, str, int], Body] = {}
        self.producer: dict[str, tuple[int, str, int]] = {}
        items = list(items)
        readers = _readers(items)  # once for both walks (a 1T program has ~35k items)
        self.feeds_send = _feeds_send(items, readers)  # per item (position): see _feeds_send
        parts = _opt_parts(items, self.feeds_send, readers)
        for it, part in zip(items, parts):
            key = (it.chunk, it.phase, part)
            body = self.bodies.setdefault(key, Body(*key))
            if it.op == TRANSFER:
                body.recvs.append(it)
            elif it.op == ACCUMULATE:
                body.reads.append(it)
            else:
                body.kernels.append(it)
            for o in it.outs:
                self.producer[o] = key
        self.accumulated = {it.uses[0] for it in items if it.op == ACCUMULATE}
        self.owned = _owned_results(items, self.accumulated, set(step_outputs))
        self.sends: dict[tuple[int, str, int], list[Send]] = {}
        for tag, it in enumerate(i for i in items if i.op == TRANSFER):
            src = self.producer.get(it.uses[0])
            if src is None or src[0] != it.src:
                raise PlanError(f"transfer %{it.outs[0]} reads %{it.uses[0]}, which chunk {it.src} does not make",
                                hint="the plan is corrupt; recompile it")
            self.sends.setdefault(src, []).append(Send(it.uses[0], it.chunk, it.phase, it.outs[0], tag))
        self._boundaries(set(step_outputs))

    def _boundaries(self, step_outputs: set[str]) -> None:
        read_elsewhere: dict[str, set] = {}
        for key, body in self.bodies.items():
            for it in body.kernels:
                for u in it.uses:
                    read_elsewhere.setdefault(u, set()).add(key)
        for key, body in self.bodies.items():
            local = {o for it in body.kernels for o in it.outs} | {it.outs[0] for it in body.recvs + body.reads}
            body.inputs = list(dict.fromkeys(u for it in body.kernels for u in it.uses if u not in local))
            sent = {s.value for s in self.sends.get(key, [])}
            body.outputs = [o for it in body.kernels for o in it.outs
                            if o in step_outputs or o in sent or o in self.accumulated
                            or read_elsewhere.get(o, set()) - {key}]

    # ----- dependencies of one firing
    def deps(self, task: Task) -> list[Task]:
        out: list[Task] = []
        for src, every in self._sources(task.key):
            if every:  # an accumulated value: every micro-batch's firing of its producer
                out += [Task(src[0], src[1], j, src[2]) for j in range(self.m)] if src[1] in PER_MICROBATCH \
                    else [Task(src[0], src[1], None, src[2])]
            else:
                out.append(self._firing(src, task))
        return list(dict.fromkeys(out))

    def _sources(self, key: tuple[int, str, int]) -> list[tuple[tuple[int, str, int], bool]]:
        """The distinct producer tasks a firing of ``key`` reads from, in first-read order (recvs,
        accumulated reads, inputs), each with whether it reads all of the producer's firings.
        The same for every micro-batch, so computed once per task key (a body reads hundreds of
        values from a few producers)."""
        if key not in self._source_cache:
            body = self.bodies.get(key)
            found: list[tuple[tuple[int, str, int], bool]] = []
            if body is not None:
                found += [(self.producer[it.uses[0]], False) for it in body.recvs]
                found += [(self.producer[it.uses[0]], True) for it in body.reads if it.uses[0] in self.producer]
                found += [(self.producer[v], False) for v in body.inputs
                          if v in self.producer and self.producer[v] != key]
            self._source_cache[key] = list(dict.fromkeys(found))
        return self._source_cache[key]

    def _firing(self, src: tuple[int, str, int], reader: Task) -> Task:
        if src[1] in PER_MICROBATCH:
            if reader.mb is None and self.m == 1:  # one micro-batch: its values are the step's
                return Task(src[0], src[1], 0, src[2])
            if reader.mb is None:
                raise PlanError(f"the once-a-step task {reader.phase} of chunk {reader.chunk} reads a per-micro-batch "
                                f"value of chunk {src[0]} ({src[1]}) without accumulating it",
                                hint="the plan is corrupt; recompile it")
            return Task(src[0], src[1], reader.mb, src[2])
        return Task(src[0], src[1], None, src[2])

    def tasks(self) -> list[Task]:
        """Every firing of a step, in no particular order."""
        out = []
        for (chunk, phase, part) in self.bodies:
            out += [Task(chunk, phase, j) for j in range(self.m)] if phase in PER_MICROBATCH \
                else [Task(chunk, phase, None, part)]
        return out


def _owned_results(items: list[Item], accumulated: set[str], step_outputs: set[str]) -> set[str]:
    """The accumulated values whose first micro-batch's result the sum may take over and add
    the later ones into in place (as torch's AccumulateGrad steals a gradient): made by an
    out-of-place ATen kernel whose schema says its result is new storage (no view, no in-place
    op), and read by nothing but their accumulation (not sent, no view of them, no step output)."""
    from sbpc.runtime.backend import torch_op

    made = {o: it.op for it in items for o in it.outs}
    others = {u for it in items if it.op != ACCUMULATE for u in it.uses}
    out = set()
    for v in accumulated - others - step_outputs:
        overload = torch_op(made.get(v, ""))
        if (overload is not None and not overload._schema.is_mutable and made[v] not in _UNMARKED_VIEWS
                and all(r.alias_info is None for r in overload._schema.returns)):
            out.add(v)
    return out


_UNMARKED_VIEWS = frozenset({"aten._unsafe_view.default"})  # a view although its schema says nothing


def replay(graph: TaskGraph, order: list[list[Task]], device_of) -> None:
    """Run the per-device orders with the runtime's semantics (a task starts when everything it
    reads is done; sends are buffered, receives wait) and raise if the ranks would wait on
    each other forever, naming the stages, tasks and values of the cycle."""
    every = set(graph.tasks())
    listed = [t for dev in order for t in dev]
    if len(listed) != len(set(listed)) or set(listed) != every:
        missing = sorted(map(str, every - set(listed)))[:3]
        raise PlanError(f"the pipeline order does not list every task exactly once (missing: {', '.join(missing) or '-'})",
                        hint="the plan is corrupt; recompile it")
    for d, dev in enumerate(order):
        for t in dev:
            if device_of(t.chunk) != d:
                raise PlanError(f"task {fmt(t)} is ordered on stage {d} but its chunk runs on stage {device_of(t.chunk)}",
                                hint="the plan is corrupt; recompile it")
    done: set[Task] = set()
    pos = [0] * len(order)
    deps = {t: graph.deps(t) for t in every}
    progress = True
    while progress:
        progress = False
        for d, dev in enumerate(order):
            while pos[d] < len(dev) and all(x in done for x in deps[dev[pos[d]]]):
                done.add(dev[pos[d]])
                pos[d] += 1
                progress = True
    if len(done) < len(every):
        raise PlanError(_cycle_message(graph, order, pos, done, deps, device_of),
                        hint=f"this order would hang; use a schedule sbpc derives ({ScheduleName.names()})")


def _cycle_message(graph, order, pos, done, deps, device_of) -> str:
    import networkx as nx  # only when an order hangs

    waits = {}
    for d, dev in enumerate(order):
        if pos[d] < len(dev):
            t = dev[pos[d]]
            blocker = next(x for x in deps[t] if x not in done)
            waits[d] = (t, blocker, device_of(blocker.chunk))
    # the wait-for graph of the stuck stages: the deadlock is its cycle reached from the first
    # (no cycle: a task no stage runs; then the chain of waits that ends there)
    wait_for = nx.DiGraph((d, w[2]) for d, w in waits.items())
    first = next(iter(waits))
    try:
        cycle = [d for d, _ in nx.find_cycle(wait_for, source=first)]
    except nx.NetworkXNoCycle:
        cycle = [d for d in nx.dfs_preorder_nodes(wait_for, first) if d in waits]
    parts = [f"stage {s} waits in {fmt(waits[s][0])} for {fmt(waits[s][1])} on stage {waits[s][2]}" for s in cycle]
    return "pipeline deadlock: " + "; ".join(parts)


def fmt(t: Task) -> str:
    names = {"pre": "P", "fwd": "F", "bwd": "B", "opt": "U"}
    return f"{names[t.phase]}{t.chunk}" + ("" if t.mb is None else f".{t.mb}") + (f"/{t.part}" if t.part else "")


def _readers(items: list[Item]) -> dict[str, list[int]]:
    """Value -> the positions of the items that read it, in order (once per read)."""
    readers: dict[str, list[int]] = {}
    for k, it in enumerate(items):
        for u in it.uses:
            readers.setdefault(u, []).append(k)
    return readers


def _feeds_send(items: list[Item], readers: dict[str, list[int]]) -> list[bool]:
    """Per item: an ``opt`` instruction that a transfer's value is computed from, on its chunk
    (such an instruction is never moved to a later part: ``_opt_parts``). ``readers``: ``_readers(items)``."""
    feeds = [False] * len(items)
    for k in reversed(range(len(items))):  # readers first: the items are in program order, a topological one
        it = items[k]
        if it.phase != "opt" or it.op == TRANSFER:
            continue
        feeds[k] = any(items[r].phase == "opt" and (items[r].op == TRANSFER or feeds[r])
                       for o in it.outs for r in readers.get(o, []))
    return feeds


def _opt_parts(items: list[Item], feeds_send: list[bool], readers: dict[str, list[int]]) -> list[int]:
    """The part of every ``opt`` instruction (0 for the others), per item. As early as it can
    run: one more than the part of what a transfer into it carries, else the largest part among
    the same chunk's ``opt`` values it reads. Then what is sent, what a sent value is computed
    from, and what leaves the step unread stays there, and every other instruction moves as
    late as its readers allow (the smallest part among them): a value made for a later part
    (an update's denominator, waiting for a received step count) is made in that part, not held
    across the parts. What other chunks wait for is never moved late: a sum over every stage's
    gradients (fp16's non-finite count, a global norm) passes from chunk to chunk, and had each
    chunk's own terms (a pass over all its gradients) moved into the part that receives the
    running sum, the stages would do that work one after another. Items are referred to by
    their position in ``items`` (a plan's 1T program has ~35k of them)."""
    at = {o: k for k, it in enumerate(items) for o in it.outs}
    # each opt instruction's opt-phase producers, found once for all rounds
    opt = [(k, it.op == TRANSFER, [at[u] for u in it.uses if u in at and items[at[u]].phase == "opt"])
           for k, it in enumerate(items) if it.phase == "opt"]
    part = [0] * len(items)
    changed = True
    while changed:  # a fixed point; rounds = the longest chain of opt-phase transfers + 1
        changed = False
        for k, transfer, srcs in opt:
            want = max(map(part.__getitem__, srcs), default=0) + (1 if transfer and srcs else 0)
            if part[k] != want:
                part[k] = want
                changed = True
    for k in reversed(range(len(items))):  # readers first: the items are in program order, a topological one
        it = items[k]
        if it.phase != "opt" or it.op == TRANSFER or feeds_send[k]:
            continue
        rs = [r for o in it.outs for r in readers.get(o, [])]
        if rs and all(items[r].phase == "opt" and items[r].chunk == it.chunk and items[r].op != TRANSFER for r in rs):
            part[k] = min(part[r] for r in rs)
    return part
