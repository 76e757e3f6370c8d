"""inplace: the optimizer update overwrites what it no longer needs, across parameters at once.

The traced update is functional: ``p1 = mul(p, c)`` allocates a new parameter while the old
one is still held, and each of the ~10 tensor ops of AdamW does so per parameter. Where the
old value has no later reader, the op becomes its in-place variant (``mul_``), so the update
no longer holds old and new parameters and states at once. Then the same op of every
parameter (same scalars, same shared 0-d tensors) becomes one ``aten._foreach_*`` call:
one dispatch for all parameters instead of one each.

Same arithmetic: an in-place variant runs the kernel of its functional op with the output
written over the input, and torch's CPU ``_foreach_*`` kernels loop over the tensors calling
those same single-tensor kernels, so the plan's numbers do not change in a bit. (On CUDA the
foreach kernels are fused multi-tensor kernels; a CUDA backend re-checks them.)

When an op may overwrite its first input ``x``:
- it is an optimizer op with an in-place variant, of the same shape and dtype as ``x``;
- ``x`` is a storage the step owns: a PARAM or STATE input (the runtime replaces those by the
  update) or the fresh result of a non-view aten op, never a view, a batch, a buffer or the
  result of an ``sbpc.*`` op (a collective on a one-device axis returns its input);
- nothing that shares ``x``'s storage is read later or is a graph output.
Only one-program plans are rewritten: a pipeline's tasks run in the schedule's order, not the
graph's, so "later" would need the task order (a gap, docs/runtime.md).

Grouping works on runs of consecutive optimizer aten ops. Inside a run the ops are ordered by
their depth in the run's dependence graph (data, plus "every reader of a storage before the op
that overwrites it"), and the ops of one depth with the same operator and shared arguments
become one foreach call; the order is a topological order of that graph, so every value is
computed before it is read and overwritten after.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any, ClassVar

import networkx as nx

from sbpc.compiler.ir.aten import overwritten, returns_alias
from sbpc.compiler.ir.types import Graph, InputKind, Node, Ref, Role, TensorType
from sbpc.compiler.pass_manager import Fact
from sbpc.runtime.backend import OVERWRITTEN_LISTS, torch_op

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

    def apply(self, graph: Graph, ctx) -> Graph:
        if graph.schedule is not None:
            return graph
        graph = replace(graph, nodes=_overwrite_dead(graph))
        if self.foreach:
            graph = replace(graph, nodes=_group(graph))
        return graph


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


def _overwrite_dead(graph: Graph) -> list[Node]:
    store = _Storages(graph)
    types = {i.value: i.type for i in graph.inputs} | {o: t for n in graph.nodes for o, t in zip(n.outputs, n.types)}
    outputs = {o.value for o in graph.outputs}
    last_read: dict[str, int] = {}  # storage -> last node reading any value in it
    for idx, n in enumerate(graph.nodes):
        for u in n.uses():
            last_read[store.find(u)] = idx
    members: dict[str, set[str]] = {}
    for v in types:
        members.setdefault(store.find(v), set()).add(v)
    nodes = []
    for idx, n in enumerate(graph.nodes):
        x = n.args[0].name if n.args and isinstance(n.args[0], Ref) else None
        op = _inplace_variant(n.op) if n.role == Role.OPTIMIZER and x is not None else None
        s = store.find(x) if op else None
        if (op and len(n.outputs) == 1 and types[x] == n.types[0] and x in store.owned
                and not members[s] & (store.foreign | outputs) and last_read[s] == idx
                and all(store.find(u) != s for u in list(n.uses())[1:])):
            n = replace(n, op=op)
            out = store.find(n.outputs[0])
            store.add(n)  # from here on the result is x's storage
            merged = store.find(x)
            last_read[merged] = max(last_read.get(out, idx), idx)
            members[merged] = members.pop(s) | members.pop(out, set())
        nodes.append(n)
    return nodes


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


def _group(graph: Graph) -> list[Node]:
    nodes, store = graph.nodes, _Storages(graph)
    types = {i.value: i.type for i in graph.inputs} | {o: t for n in nodes for o, t in zip(n.outputs, n.types)}
    out: list[Node] = []
    run: list[Node] = []
    for n in nodes:
        if n.role == Role.OPTIMIZER and n.op.startswith("aten."):
            run.append(n)
            continue
        out.extend(_group_run(run, types, store))
        run = []
        out.append(n)
    out.extend(_group_run(run, types, store))
    return out


def _group_run(run: list[Node], types: dict[str, TensorType], store: _Storages) -> list[Node]:
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
        key = (depth[k], plan, run[k].types[0].dtype, run[k].memory) if plan is not None else ("single", k)
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
        node = replace(node, sbp_in=[known[u] for u in node.uses()])
    return node
