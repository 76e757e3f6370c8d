"""overlap: issue collectives early and wait for them late, so communication runs under compute.

Every collective the runtime can start asynchronously (``runtime.collectives.ISSUABLE``: the
all-reduces, all-gathers and reduce-scatters, single or bucketed) becomes two instructions:

    %w = sbpc.issue(x, kind="all_reduce_coalesced", axis="dp", ...) : work[]
    %a, %b = sbpc.wait(%w) : (f32[...], f32[...])

The issue goes right after the last instruction its inputs need (a gradient bucket: after the
backward op that makes its last gradient, so the rest of the backward runs while it is reduced,
as DDP and Megatron's --overlap-grad-reduce do), never before an earlier collective's issue, so
the ranks of a group issue in the one order the plan had. A gather of a program input (a ZeRO-3
parameter shard) goes no earlier than the start of the layer before its reader's: it is
prefetched one layer ahead. A collective of values computed from the batch alone (the token
count of a global-mean loss: the target mask's all-gather) is issued at the start of its task,
its few small producers moved up with it, so the forward runs while it flies instead of every
rank stopping for its peer mid-forward. The wait goes right before the first
instruction that reads a result. Both stay inside the collective's task (its stage and role) in
a pipelined plan, whose tasks are cut by role; a one-task plan lets a gradient bucket issued in
the backward be waited for by the optimizer. The decision is made here, at compile time, and is
in the plan and the text IR: the run is as deterministic as before, and
``runtime.overlap.check_issue_order`` proves every issue is waited exactly once, after it,
within its task, in the compiler (after this pass) and in the runtime (before any rank runs).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from sbpc.compiler.ir.aten import is_mutating, is_random, overwritten, shares_storage
from sbpc.compiler.ir.mesh import MICROBATCH
from sbpc.compiler.ir.types import Graph, InputKind, Node, Ref, TensorType
from sbpc.compiler.pass_manager import Fact
from sbpc.compiler.pipelining.stage_policy import layer_key
from sbpc.errors import CompileError
from sbpc.runtime.collectives import ISSUABLE
from sbpc.runtime.kinds import ISSUE, WAIT, Collective
from sbpc.runtime.overlap import OrderError, check_issue_order
from sbpc.runtime.pipeline_tasks import TRANSFER
from sbpc.runtime.sbp import Broadcast

WORK = TensorType((), "work")
# a batch-only cone moved to its task's start stays alive from there to its collective: small only
HOIST_BYTES = 1 << 20


@dataclass
class Overlap:
    name: str = "overlap"
    needs: ClassVar[tuple[Fact, ...]] = (Fact.BOXED,)
    provides: ClassVar[tuple[Fact, ...]] = ()

    def apply(self, graph: Graph, ctx) -> Graph:
        one_task = graph.schedule is None
        nodes = list(graph.nodes)
        if not any(_issuable(n) for n in nodes):
            return graph
        nodes = _sink_views(nodes, one_task)
        nodes = _hoist_batch_cones(nodes, {i.value for i in graph.inputs if i.kind == InputKind.BATCH}, one_task)
        split = [i for i, n in enumerate(nodes) if _issuable(n)]
        producer = {o: i for i, n in enumerate(nodes) for o in n.outputs}
        readers: dict[str, list[int]] = {}
        for i, n in enumerate(nodes):
            for u in n.uses():
                readers.setdefault(u, []).append(i)
        task = [(n.stage, n.role) for n in nodes]
        root, writers = _storages(nodes)
        layer_start = _previous_layer_starts(nodes)
        # where each issue and wait goes: before the node at that index (ties keep program order)
        issue_at: dict[int, float] = {}
        wait_at: dict[int, float] = {}
        floor = -1.0
        for i in split:
            n = nodes[i]
            lo = i
            while lo > 0 and (one_task or task[lo - 1] == task[i]) and lo - 1 > floor:
                lo -= 1
            # after what makes its inputs: an instruction, or the wait of an earlier collective
            deps = [wait_at[d] + 1e-4 if d in wait_at else d + 1 for d in (producer[u] for u in n.uses() if u in producer)]
            if len(deps) < len(set(n.uses())):
                # it reads a program input (a ZeRO-3 parameter shard): prefetch it one layer
                # ahead, not all at the start, or every layer's full weights would be alive at once
                lo = max(lo, layer_start[i])
            at = max([lo, *deps])
            floor = issue_at[i] = max(at, floor + 1e-3)  # issues keep their order
            end = len(nodes) if one_task else _task_end(task, i)
            # before its first reader, and before anything overwrites what it sends in place
            first = min([r for o in n.outputs for r in readers.get(o, [])]
                        + [j for r in {root[u] for u in n.uses()} for j in writers.get(r, []) if j > i], default=end)
            wait_at[i] = min(first, end) - 1e-3
        out: list[tuple[float, int, Node]] = []
        for i, n in enumerate(nodes):
            if i not in issue_at:
                out.append((float(i), 0, n))
                continue
            w = f"{n.outputs[0]}_work"
            nd_b = [tuple(Broadcast() for _ in (n.sbp[0] if n.sbp else ()))]
            kind = Collective.of(n.op)
            out.append((issue_at[i] - 1e-6, 1, n.replace(outputs=[w], op=ISSUE, kwargs={"kind": kind.value, **n.kwargs},
                                                       types=[WORK], sbp=nd_b if n.sbp else None,
                                                       why=f"{kind.value} issued here, waited for at its first reader")))
            out.append((wait_at[i], 2, n.replace(op=WAIT, args=(Ref(w),), kwargs={},
                                               sbp_in=nd_b if n.sbp_in else None)))
        out.sort(key=lambda t: (t[0], t[1]))
        nodes = _work_under_issues([n for _, _, n in out], one_task)
        try:
            check_issue_order([(n.op, n.outputs, list(n.uses()), (n.stage, n.role), overwritten(n)) for n in nodes],
                              one_task=one_task)
        except OrderError as err:  # a bug of this pass, not of the user's program
            raise CompileError(f"overlap: {err}") from err
        if one_task:
            nodes = _overwrite_dead_inputs(nodes, {o.value for o in graph.outputs}, graph.mesh.size)
        return replace(graph, nodes=nodes)


# layout-only ops (no compute): one that reads a collective's result (the transpose of a
# reduced weight gradient) moves down to its own first reader, so it does not pull the wait up
_VIEWS = frozenset({"aten.t.default", "aten.transpose.int", "aten.view.default", "aten.reshape.default",
                    "aten._unsafe_view.default", "aten.permute.default", "aten.squeeze.dim", "aten.unsqueeze.default"})


def _sink_views(nodes: list[Node], one_task: bool) -> list[Node]:
    readers: dict[str, list[int]] = {}
    for i, n in enumerate(nodes):
        for u in n.uses():
            readers.setdefault(u, []).append(i)
    carried = {o for n in nodes if _issuable(n) for o in n.outputs}  # results, and views of them
    for n in nodes:
        if n.op in _VIEWS and any(u in carried for u in n.uses()):
            carried.update(n.outputs)
    task = [(n.stage, n.role) for n in nodes]
    pos = [float(i) for i in range(len(nodes))]
    for i in reversed(range(len(nodes))):
        n = nodes[i]
        if n.op not in _VIEWS or not any(u in carried for u in n.uses()):
            continue
        first = min([pos[r] for o in n.outputs for r in readers.get(o, [])], default=float(len(nodes)))
        end = float(len(nodes) if one_task else _task_end(task, i))
        pos[i] = max(pos[i], min(first, end) - 1e-3 * (1 + 1e-3 * i))  # never up; before its reader
    return [nodes[i] for i in sorted(range(len(nodes)), key=lambda i: (pos[i], i))]


def _work_under_issues(nodes: list[Node], one_task: bool) -> list[Node]:
    """Move the work an issued all-reduce does not need from before its issue to right after it.

    A tensor-parallel layer's backward makes the input gradient, all-reduces it, and meanwhile
    has only that layer's own weight gradient to compute; the ops before it (the next layer's
    weight gradient and bias sum, the head's) wait for nothing either, so they go under the
    collective too. Taken, in order, from the stretch after the previous issue or wait (same
    task): pure aten ops (no random draw, no in-place write) that the issued value is not
    computed from, read by nothing that stays before the issue, reading no storage that
    something staying before it overwrites. Gradient buckets (coalesced) are left where they
    are: their issue already trails the backward op that makes their last gradient."""
    root, _ = _storages(nodes)
    pos = [float(i) for i in range(len(nodes))]
    for k, n in enumerate(nodes):
        if n.op != ISSUE or n.kwargs.get("kind") != Collective.ALL_REDUCE.value:
            continue
        task = (n.stage, n.role)
        start = k
        while start > 0 and nodes[start - 1].op not in (ISSUE, WAIT) and (nodes[start - 1].stage, nodes[start - 1].role) == task:
            start -= 1
        read_later: set[str] = set(n.uses())  # values read by what stays, from j + 1 to the issue
        written_later: set[str] = set()  # storages overwritten by what stays there
        for j in range(k - 1, start - 1, -1):
            m = nodes[j]
            if (m.op.startswith("aten.") and not is_random(m.op) and not is_mutating(m.op)
                    and not set(m.outputs) & read_later and not {root[u] for u in m.uses()} & written_later):
                pos[j] = k + 0.5 * (j - start + 1) / (k - start + 1)  # after the issue, in order, before k + 1
                continue
            read_later.update(m.uses())
            written_later.update(root[v] for v in overwritten(m))
    return [nodes[i] for i in sorted(range(len(nodes)), key=lambda i: pos[i])]


def _hoist_batch_cones(nodes: list[Node], batch: set[str], one_task: bool) -> list[Node]:
    """Move the producers of a collective whose inputs come from the batch alone (pure aten ops
    reading only batch inputs and each other, HOIST_BYTES at most) to the start of its task, in
    their order: the issue then goes right after them, and the whole forward runs under it."""
    producer = {o: i for i, n in enumerate(nodes) for o in n.outputs}
    task = [(n.stage, n.role) for n in nodes]
    pos = [float(i) for i in range(len(nodes))]
    for i, n in enumerate(nodes):
        if not _issuable(n):
            continue
        cone = _batch_cone(n, nodes, producer, batch)
        if not cone or not all(one_task or task[c] == task[i] for c in cone):
            continue
        start = 0 if one_task else next(j for j in range(i, -1, -1) if j == 0 or task[j - 1] != task[i])
        for c in cone:
            pos[c] = min(pos[c], start - 0.5 + 1e-6 * c)  # before the task's first node, in order
    return [nodes[i] for i in sorted(range(len(nodes)), key=lambda i: (pos[i], i))]


def _batch_cone(n: Node, nodes: list[Node], producer: dict[str, int], batch: set[str]) -> list[int] | None:
    """The instructions ``n``'s inputs are computed by, if they read nothing but the batch, draw
    nothing, write nothing and make HOIST_BYTES at most; else None."""
    cone: set[int] = set()
    todo = list(n.uses())
    while todo:
        u = todo.pop()
        if u in batch:
            continue
        j = producer.get(u)
        if j is None:  # a parameter, buffer or state
            return None
        if j in cone:
            continue
        p = nodes[j]
        if not p.op.startswith("aten.") or is_random(p.op) or is_mutating(p.op):
            return None
        cone.add(j)
        todo.extend(p.uses())
    if sum(t.nbytes for j in cone for t in nodes[j].types) > HOIST_BYTES:
        return None
    return sorted(cone)


def _storages(nodes: list[Node]) -> tuple[dict[str, str], dict[str, list[int]]]:
    """Each value's storage (views and in-place results share their input's) and, per storage,
    the nodes that overwrite it in place (the inplace pass's optimizer ops), in order."""
    root: dict[str, str] = {}
    writers: dict[str, list[int]] = {}
    for i, n in enumerate(nodes):
        over = overwritten(n)
        for v in over:
            writers.setdefault(root.setdefault(v, v), []).append(i)
        first = next(iter(n.uses()), None)
        for k, o in enumerate(n.outputs):
            if over and len(over) == len(n.outputs):
                root[o] = root[over[k]]
            elif first is not None and shares_storage(n.op):
                root[o] = root.setdefault(first, first)
            else:
                root[o] = o
    for n in nodes:
        for u in n.uses():
            root.setdefault(u, u)  # program inputs
    return root, writers


def _overwrite_dead_inputs(nodes: list[Node], outputs: set[str], axis_size) -> list[Node]:
    """Mark ``overwrite=True`` on an issued all-reduce whose input dies at the issue and owns
    its storage, so the runtime reduces into it instead of into a copy (a tensor-parallel
    layer's partial sums: one copy and one allocation less per collective). One-task plans,
    which run in graph order. The input's storage must be the fresh result of an aten op (not a
    view, not a program input, not an ``sbpc.*`` result, which may hand back an input), and
    nothing that may share it is read after the issue, sent (a send holds its buffer until the
    step ends) or a graph output."""
    shares: dict[str, set[str]] = {}  # value -> the fresh storages (by their maker's output) it may be a view of
    fresh: set[str] = set()
    for n in nodes:
        over = overwritten(n)
        ins = [shares.get(u, {u}) for u in n.uses()]
        for k, o in enumerate(n.outputs):
            if over and len(over) == len(n.outputs):
                shares[o] = shares.get(over[k], {over[k]})
            elif ins and shares_storage(n.op):
                shares[o] = ins[0]
            elif n.op.startswith("aten.") or (n.op == ISSUE and axis_size(n.kwargs["axis"]) > 1):
                shares[o] = {o}  # an issued collective's result is its own buffer, or its dead input
                fresh.add(o)
            else:  # sbpc ops (a collective on a one-device axis, keep_first on index 0) may return an input
                shares[o] = {o}.union(*ins)
    last: dict[str, int] = {}  # storage -> index of its last reader
    held = {s for o in outputs for s in shares.get(o, {o})}
    for i, n in enumerate(nodes):
        for u in n.uses():
            for s in shares.get(u, {u}):
                last[s] = i
                if n.op == TRANSFER:
                    held.add(s)
    out = []
    for i, n in enumerate(nodes):
        if n.op == ISSUE and n.kwargs["kind"] == Collective.ALL_REDUCE.value:
            s = shares.get(n.args[0].name, set())
            if len(s) == 1 and (r := next(iter(s))) in fresh and r not in held and last[r] == i:
                n = replace(n, kwargs={**n.kwargs, "overwrite": True})
        out.append(n)
    return out


def _issuable(n: Node) -> bool:
    kind = Collective.of(n.op)
    return kind in ISSUABLE and n.kwargs.get("axis") != MICROBATCH


def _previous_layer_starts(nodes: list[Node]) -> list[int]:
    """Per node: the index where the layer before its own (``layer_key`` of its module, in
    program order) begins; 0 in the first two layers."""
    out, starts, key = [], [0], None
    for i, n in enumerate(nodes):
        k = layer_key(n.loc.module) if n.loc is not None else key
        if k != key and i:
            starts.append(i)
        key = k
        out.append(starts[-2] if len(starts) >= 2 else 0)
    return out


def _task_end(task: list, i: int) -> int:
    j = i
    while j < len(task) and task[j] == task[i]:
        j += 1
    return j
