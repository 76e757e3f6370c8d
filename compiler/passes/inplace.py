"""inplace: the optimizer update overwrites what it no longer needs, across parameters at once.

The traced update is functional: ``p1 = mul(p, c)`` allocates a new parameter while the old
one is still held, and each of the ~10 tensor ops of AdamW does so per parameter. Where the
old value has no later reader, the op becomes its in-place variant (``mul_``), so the update
no longer holds old and new parameters and states at once. Then the same op of every
parameter (same scalars, same shared 0-d tensors) becomes one ``aten._foreach_*`` call:
one dispatch for many parameters instead of one each.

Same arithmetic: an in-place variant runs the kernel of its functional op with the output
written over the input, and torch's CPU ``_foreach_*`` kernels loop over the tensors calling
those same single-tensor kernels, so the plan's numbers do not change in a bit. (On CUDA the
foreach kernels are fused multi-tensor kernels; a CUDA backend re-checks them.)

The backward's gradient accumulations (``add`` of two contributions to one gradient, a
residual's two paths) are overwritten the same way, as autograd's input buffer sums in place:
into the first operand, or the second with the two swapped where only that one dies there
(``a + b == b + a`` bit for bit). In a pipelined plan the overwritten storage must also be made
in the accumulation's own task (every value sharing it): then it is that firing's, one
micro-batch's, and every other reader runs in that task or in a task that reads from it, i.e.
later in the same micro-batch (and at a later last firing: the position rule below sees it);
a parameter, a once-a-step value or one received from another task is never overwritten, since
another micro-batch's firing reads it again.

When an op may overwrite its first input ``x``:
- it is an optimizer op with an in-place variant, or such an accumulation (no ``alpha``), of
  the same shape and dtype as ``x``;
- ``x`` is a storage the step owns: a PARAM or STATE input (the runtime replaces those by the
  update) or the fresh result of a non-view aten op, never a view, a batch, a buffer or the
  result of an ``sbpc.*`` op (a collective on a one-device axis returns its input);
- nothing that shares ``x``'s storage runs later on the op's device stage or is a graph output;
- nothing that shares it is sent (``sbpc.transfer``): a send keeps its buffer until the step
  ends, and gloo's ``isend`` reads it while it flies.
"Later" is the execution order of the op's device stage. A one-program plan runs in graph
order. A pipeline stage runs its tasks in ``schedule.order[stage]`` and each task's
instructions in graph order, so an instruction's position is (its task's place in that order,
for a per-micro-batch task its last firing; its index in the graph). A program input read on
another device stage is that stage's own copy (every stage loads the parameters it reads; a
tied weight's other copies receive the new value), so only this stage's readers count; any
other value reaches another stage only through a transfer.

Grouping works on runs of consecutive optimizer aten ops of one task (in a pipeline: one
chunk's once-a-step part; the parts are re-derived after the rewrite and must not move), cut
into pieces: a foreach call makes its results for all its members at once, so a whole run
grouped would hold every parameter's temporaries (its sqrt, its step) together. A piece ends
where the traced per-parameter order holds no temporary and keeps its temporaries within the
largest parameter's own, or ``foreach_floor`` bytes where that is more. Inside a piece the ops
are ordered by their depth in its dependence graph (data, plus "every reader of a storage
before the op that overwrites it"), and the ops of one depth with the same operator and shared
arguments become one foreach call, unless one feeds a transfer and the other does not (the
runtime keeps what feeds a send, and what it reads, in its early part); the order is a topological order of that graph, so every
value is computed before it is read and overwritten after.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, ClassVar

import networkx as nx

from sbpc.compiler.ir.aten import ACCUMULATE, overwritten, returns_alias
from sbpc.compiler.ir.types import Graph, InputKind, Node, Ref, Role, TensorType
from sbpc.compiler.pass_manager import Fact
from sbpc.compiler.passes.schedule import execution_positions, node_tasks, task_graph
from sbpc.errors import CompileError
from sbpc.runtime.backend import OVERWRITTEN_LISTS, torch_op
from sbpc.runtime.pipeline_tasks import TRANSFER

_VIEWS_TOO = frozenset({"aten._unsafe_view.default"})  # views aot emits without an alias annotation
_OWNED_INPUTS = (InputKind.PARAM, InputKind.STATE)
# ops torch has as _foreach_*: unary, binary with alpha, and the Scalar-weighted ternary ones
_UNARY = frozenset({"sqrt", "neg", "reciprocal", "exp", "abs"})
_BINARY = frozenset({"add", "sub", "mul", "div"})
_COMMUTATIVE = frozenset({"add", "mul"})  # a * b == b * a bit for bit (IEEE)
_TERNARY = frozenset({"addcmul", "addcdiv", "lerp"})


@dataclass
class InPlace:
    name: str = "inplace"
    needs: ClassVar[tuple[Fact, ...]] = (Fact.SBP,)
    provides: ClassVar[tuple[Fact, ...]] = ()
    foreach: bool = True  # group per-parameter ops into _foreach_* calls
    # bytes per device a foreach call may make at once even where one parameter's update needs
    # less: below it, one dispatch for many small parameters is worth more than the memory
    foreach_floor: int = 256 << 20

    def apply(self, graph: Graph, ctx) -> Graph:
        where = _Where.of(graph)
        graph = replace(graph, nodes=_overwrite_dead(graph, where))
        if self.foreach:
            graph = replace(graph, nodes=_group(graph, where, self.foreach_floor))
            if graph.schedule is not None:
                _check_tasks(graph, where)
        return graph


@dataclass(frozen=True)
class _Where:
    """Where each node runs: its device stage, its position there, and its task."""
    stage: list[int]
    position: list[tuple[int, int]]  # compare within a stage (schedule.execution_positions)
    task: list[tuple[int, str, int] | None]  # (chunk, phase, part); None in a one-program plan
    names: dict[str, tuple[int, str, int] | None]  # the task of each value made by a node
    # the nodes a transfer's value is computed from in the once-a-step phase, which stay in
    # their part with everything they read (runtime/pipeline_tasks.py): a foreach call of such
    # a node and another would pin the other's inputs to an earlier part too
    feeds_send: list[bool]

    @staticmethod
    def of(graph: Graph) -> "_Where":
        pipelined = graph.schedule is not None
        task = node_tasks(graph) if pipelined else [None] * len(graph.nodes)
        at = execution_positions(graph, task)
        feeds = task_graph(graph).feeds_send if pipelined else [False] * len(graph.nodes)
        return _Where([s for s, _ in at], [p for _, p in at], task, _made_in(graph, task), feeds)


def _made_in(graph: Graph, task: list) -> dict[str, tuple[int, str, int]]:
    return {o: key for key, n in zip(task, graph.nodes) for o in n.outputs}


class _Storages:
    """Which values share a storage (union-find over views, sbpc ops and in-place results)."""

    def __init__(self, graph: Graph):
        self.parent: dict[str, str] = {}
        self.owned: set[str] = {i.value for i in graph.inputs if i.kind in _OWNED_INPUTS}  # x may be one of these
        self.foreign = {i.value for i in graph.inputs if i.kind not in _OWNED_INPUTS}  # batches, buffers
        for n in graph.nodes:
            self.add(n)

    def add(self, n: Node) -> None:
        uses = list(n.uses())
        if n.op in OVERWRITTEN_LISTS:  # fused AdamW: each result is the storage it overwrote
            for o, u in zip(n.outputs, overwritten(n)):
                self.parent.setdefault(o, o)
                self.union(o, u)
                if u in self.owned:
                    self.owned.add(o)
            return
        if n.op.startswith("sbpc."):
            aliased = uses  # collectives, shard ops and hints may hand back an input
        elif _inplace_base(n.op):  # the overwritten storage, owned if it was
            aliased = uses[:1]
            if uses and uses[0] in self.owned:
                self.owned.update(n.outputs)
        elif returns_alias(n.op) or n.op in _VIEWS_TOO:
            aliased = uses[:1]
        else:  # a fresh result
            aliased = []
            self.owned.update(n.outputs)
        for o in n.outputs:
            self.parent.setdefault(o, o)
            for u in aliased:
                self.union(o, u)

    def find(self, v: str) -> str:
        self.parent.setdefault(v, v)
        while self.parent[v] != v:
            self.parent[v] = self.parent[self.parent[v]]
            v = self.parent[v]
        return v

    def union(self, a: str, b: str) -> None:
        self.parent[self.find(a)] = self.find(b)


@dataclass
class _Reads:
    """Who reads one storage: the last reader on each device stage, and whether a transfer sends it."""
    last: dict[int, tuple[int, int]] = field(default_factory=dict)
    sent: bool = False

    def merge(self, other: "_Reads") -> "_Reads":
        last = dict(self.last)
        for st, p in other.last.items():
            last[st] = max(last.get(st, p), p)
        return _Reads(last, self.sent or other.sent)


def _overwrite_dead(graph: Graph, where: _Where) -> list[Node]:
    store = _Storages(graph)
    types = {i.value: i.type for i in graph.inputs} | {o: t for n in graph.nodes for o, t in zip(n.outputs, n.types)}
    outputs = {o.value for o in graph.outputs}
    reads: dict[str, _Reads] = {}  # storage -> its readers
    for idx, n in enumerate(graph.nodes):
        st = where.stage[idx]
        for u in n.uses():
            r = reads.setdefault(store.find(u), _Reads())
            if n.op == TRANSFER:
                r.sent = True
            else:
                r.last[st] = max(r.last.get(st, where.position[idx]), where.position[idx])
    shared = store.foreign | outputs  # what no update may overwrite: once, not per candidate op
    # per storage, what its members (the values in it) say, kept as storages merge: whether one
    # is shared, and their tasks. A residual stream's gradient accumulates into one storage layer
    # by layer: walking its members at every add was quadratic in the depth
    pinned: dict[str, bool] = {}
    homes: dict[str, set] = {}
    for v in types:
        s = store.find(v)
        pinned[s] = pinned.get(s, False) or v in shared
        homes.setdefault(s, set()).add(where.names.get(v))
    nodes = []
    for idx, n in enumerate(graph.nodes):
        st, at = where.stage[idx], where.position[idx]

        def free(x: str) -> bool:
            """``x``'s storage may take ``n``'s result: owned, same type, read last here, not sent,
            not a graph output (nor anything sharing it), not another operand of ``n``."""
            s = store.find(x)
            return (types[x] == n.types[0] and x in store.owned and not pinned[s]
                    and not reads[s].sent and reads[s].last.get(st) == at
                    and sum(store.find(u) == s for u in n.uses()) == 1
                    and (n.role != Role.BACKWARD or homes[s] == {where.task[idx]}))

        if not _may_overwrite(n) or len(n.outputs) != 1 or not n.args or not isinstance(n.args[0], Ref):
            nodes.append(n)
            continue
        if n.role == Role.BACKWARD and not free(n.args[0].name) and free(n.args[1].name):
            n = n.replace(args=(n.args[1], n.args[0]))  # an accumulation: a + b == b + a bit for bit
        x, op = n.args[0].name, _inplace_variant(n.op)
        if op and free(x):
            s = store.find(x)
            n = n.replace(op=op)
            out = store.find(n.outputs[0])
            store.add(n)  # from here on the result is x's storage
            merged = store.find(x)
            reads[merged] = reads.pop(s).merge(reads.pop(out, _Reads()))
            was, came = pinned.pop(s), pinned.pop(out, False)
            pinned[merged] = was or came
            homes[merged] = homes.pop(s) | homes.pop(out, set())
        nodes.append(n)
    return nodes


def _may_overwrite(n: Node) -> bool:
    """Optimizer ops, and the backward's gradient accumulations (``add`` of two contributions to
    one gradient, which autograd's input buffer sums in place)."""
    return n.role == Role.OPTIMIZER or (n.role == Role.BACKWARD and n.op == ACCUMULATE and not n.kwargs
                                        and len(n.args) == 2 and all(isinstance(a, Ref) for a in n.args))


@lru_cache(maxsize=None)
def _inplace_variant(op: str) -> str | None:
    """``aten.mul.Tensor`` -> ``aten.mul_.Tensor``: the overload with the same arguments whose
    result is its first argument, overwritten."""
    parts = op.split(".")
    if len(parts) != 3 or parts[0] != "aten" or parts[1].endswith("_") or parts[1].startswith("_"):
        return None
    ns, packet, overload = parts
    functional, inplace = torch_op(op), torch_op(f"{ns}.{packet}_.{overload}")
    if functional is None or inplace is None:
        return None
    names = lambda schema: [(a.name, str(a.type)) for a in schema.arguments]
    return f"{ns}.{packet}_.{overload}" if names(functional._schema) == names(inplace._schema) else None


def _inplace_base(op: str) -> bool:
    ns, _, rest = op.partition(".")
    return ns == "aten" and rest.split(".")[0].endswith("_") and not rest.startswith("_")


# -- grouping into _foreach_* -------------------------------------------------------------------

@dataclass(frozen=True)
class _Plan:
    """How one op becomes a member of a foreach call: the foreach op, which of its arguments
    are per member (positions into the member's args, in the foreach's order) and the shared rest."""
    op: str
    per_member: tuple[int, ...]
    shared: tuple[Any, ...]  # args after the lists, identical for every member
    kwargs: tuple[tuple[str, Any], ...]


def _foreach_plan(n: Node, types: dict[str, TensorType]) -> _Plan | None:
    if n.role != Role.OPTIMIZER or not n.op.startswith("aten.") or len(n.outputs) != 1:
        return None
    _, packet, overload = n.op.split(".")
    inplace = packet.endswith("_")
    base = packet.rstrip("_")
    suffix = "_" if inplace else ""
    per = lambda a: isinstance(a, Ref) and types[a.name].shape == n.types[0].shape and types[a.name].shape != ()
    scalar_ref = lambda a: isinstance(a, Ref) and types[a.name].shape == ()
    number = lambda a: isinstance(a, (int, float)) and not isinstance(a, bool)
    args, kw = n.args, dict(n.kwargs)
    plan = None
    if base in _UNARY and overload == "default" and len(args) == 1 and not kw and per(args[0]):
        plan = _Plan(f"aten._foreach_{base}{suffix}.default", (0,), (), ())
    elif base in _BINARY and overload == "Tensor" and len(args) == 2 and set(kw) <= {"alpha"}:
        alpha = tuple(kw.items())
        x, y = args
        if per(x) and per(y):
            plan = _Plan(f"aten._foreach_{base}{suffix}.List", (0, 1), (), alpha)
        elif per(x) and scalar_ref(y):
            plan = _Plan(f"aten._foreach_{base}{suffix}.Tensor", (0,), (y,), alpha)
        elif per(x) and number(y) and not alpha:
            plan = _Plan(f"aten._foreach_{base}{suffix}.Scalar", (0,), (y,), ())
        elif not inplace and base in _COMMUTATIVE and scalar_ref(x) and per(y) and not alpha:
            plan = _Plan(f"aten._foreach_{base}.Tensor", (1,), (x,), ())
    elif base in ("addcmul", "addcdiv") and overload == "default" and len(args) == 3 and set(kw) <= {"value"} \
            and all(per(a) for a in args) and all(number(v) for v in kw.values()):
        plan = _Plan(f"aten._foreach_{base}{suffix}.Scalar", (0, 1, 2), tuple(kw.values()), ())
    elif base == "lerp" and overload == "Scalar" and len(args) == 3 and not kw and per(args[0]) and per(args[1]) \
            and number(args[2]):
        plan = _Plan(f"aten._foreach_lerp{suffix}.Scalar", (0, 1), (args[2],), ())
    if plan is None or torch_op(plan.op) is None:
        return None
    if any(types[args[i].name].dtype != n.types[0].dtype for i in plan.per_member):
        return None  # a foreach call keeps each tensor's dtype; type promotion stays single
    return plan


def _group(graph: Graph, where: _Where, floor: int) -> list[Node]:
    nodes, store = graph.nodes, _Storages(graph)
    types = {i.value: i.type for i in graph.inputs} | {o: t for n in nodes for o, t in zip(n.outputs, n.types)}
    sizes = tuple(graph.mesh.size(a) for a in graph.mesh.sbp_axes)
    readers: dict[str, int] = {}
    for n in nodes:
        for u in set(n.uses()):
            readers[u] = readers.get(u, 0) + 1
    outputs = {o.value for o in graph.outputs}
    sending = {n.outputs[0] for n, f in zip(nodes, where.feeds_send) if f and n.outputs}
    out: list[Node] = []
    run: list[Node] = []

    def flush() -> None:
        if not run:  # most ops are not optimizer ops: the run is empty (and the union below is large)
            return
        inside: dict[str, int] = {}
        for n in run:
            for u in set(n.uses()):
                inside[u] = inside.get(u, 0) + 1
        # what is read after the run, or leaves the step, is held however the run is grouped (of
        # the run's own results, the only ones _slices asks about: not a copy of every graph
        # output per run, ~4.6k runs x the 1T's outputs)
        outlive = {o for n in run for o in n.outputs if o in outputs or inside.get(o, 0) < readers.get(o, 0)}
        for piece in _slices(run, sizes, floor, outlive):
            out.extend(_group_run(piece, types, store, sending))

    task = None
    for idx, n in enumerate(nodes):
        if n.role == Role.OPTIMIZER and n.op.startswith("aten.") and (not run or where.task[idx] == task):
            run.append(n)
            task = where.task[idx]
            continue
        flush()
        run = []
        if n.role == Role.OPTIMIZER and n.op.startswith("aten."):  # a run of another task starts
            run, task = [n], where.task[idx]
        else:
            out.append(n)
    flush()
    return out


def _slices(run: list[Node], sizes: tuple[int, ...], floor: int, outlive: set[str]) -> list[list[Node]]:
    """``run`` cut into consecutive pieces whose temporaries (new tensors nothing after the run
    reads) fit in what the largest single parameter's update holds at once (its denominator and
    its step), or in ``floor`` bytes where that is more. A foreach call makes its results for
    all members at once, so a whole run grouped would hold every parameter's temporaries
    together. Cuts fall where the traced per-parameter order holds no temporary (a 0-d value, a
    step size every parameter reads, does not count)."""
    last: dict[str, int] = {}
    for k, n in enumerate(run):
        for u in n.uses():
            last[u] = k
    segments: list[tuple[list[Node], int]] = []
    piece: list[Node] = []
    held = until = 0
    for k, n in enumerate(run):
        piece.append(n)
        if not (overwritten(n) or returns_alias(n.op) or n.op in _VIEWS_TOO):
            for o, t, nd in zip(n.outputs, n.types, n.sbp or [None] * len(n.types)):
                if o not in outlive and t.shape != ():
                    held += t.local_nbytes(nd, sizes)
                    until = max(until, last.get(o, k))
        if until <= k:  # nothing of this piece is read further on
            segments.append((piece, held))
            piece, held = [], 0
    if piece:
        segments.append((piece, held))
    cap = max([floor] + [b for _, b in segments])
    pieces: list[list[Node]] = []
    total = cap + 1
    for seg, b in segments:
        if total + b > cap:
            pieces.append([])
            total = 0
        pieces[-1].extend(seg)
        total += b
    return pieces


def _check_tasks(graph: Graph, before: _Where) -> None:
    """Every value is made in the task it was made in before grouping: a foreach call of one
    task's ops, and the once-a-step parts re-derived from the new graph, leave the schedule's
    order valid. A failure is a bug of this pass."""
    for value, key in _made_in(graph, node_tasks(graph)).items():
        if before.names.get(value, key) != key:
            raise CompileError(f"inplace: %{value} moved from task {before.names[value]} to {key}",
                               hint="report this plan; compile with the inplace pass removed meanwhile")


def _group_run(run: list[Node], types: dict[str, TensorType], store: _Storages, sending: set[str]) -> list[Node]:
    if len(run) < 2:
        return run
    graph = nx.DiGraph()
    graph.add_nodes_from(range(len(run)))
    made = {o: k for k, n in enumerate(run) for o in n.outputs}
    readers: dict[str, list[int]] = {}  # storage -> ops of the run that read it, in order
    for k, n in enumerate(run):
        for u in n.uses():
            if u in made:
                graph.add_edge(made[u], k)
            readers.setdefault(store.find(u), []).append(k)
        if _inplace_base(n.op):  # every earlier reader of what it overwrites goes first
            for r in readers.get(store.find(n.args[0].name), []):
                if r != k:
                    graph.add_edge(r, k)
    depth: dict[int, int] = {}
    for k in nx.topological_sort(graph):
        depth[k] = max((depth[p] + 1 for p in graph.predecessors(k)), default=0)
    groups: dict[tuple, list[int]] = {}
    for k in sorted(range(len(run)), key=lambda k: (depth[k], k)):
        plan = _foreach_plan(run[k], types)
        key = ((depth[k], plan, run[k].types[0].dtype, run[k].memory, run[k].outputs[0] in sending)
               if plan is not None else ("single", k))
        groups.setdefault(key, []).append(k)
    out = []
    for key, ks in groups.items():
        plan = key[1] if key[0] != "single" else None
        out.append(run[ks[0]] if plan is None or len(ks) == 1 else _foreach_node(plan, [run[k] for k in ks]))
    return out


def _foreach_node(plan: _Plan, members: list[Node]) -> Node:
    lists = [[m.args[i] for m in members] for i in plan.per_member]
    sbp_of = lambda m: dict(zip(m.uses(), m.sbp_in)) if m.sbp_in is not None else None
    node = Node(outputs=[m.outputs[0] for m in members], op=plan.op, args=(*lists, *plan.shared),
                kwargs=dict(plan.kwargs), types=[m.types[0] for m in members], role=Role.OPTIMIZER,
                loc=members[0].loc, stage=members[0].stage, memory=members[0].memory,  # all optimizer ops: one memory
                sbp=[m.sbp[0] for m in members] if all(m.sbp for m in members) else None)
    if all(m.sbp_in is not None for m in members):
        known = {}
        for m in members:
            known.update(sbp_of(m))
        node = node.replace(sbp_in=[known[u] for u in node.uses()])
    return node
