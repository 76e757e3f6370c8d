"""zero: ZeRO stages 1-3 as layouts on the dp axis, written as ``sbpc.hint`` ops.

ZeRO is no special path: it is a choice of SBP that propagation, boxing, coalescing and the
runtime carry out. This pass only says what the choice is, with the mechanism every other
layout choice uses (hints, which pin a value's SBP on an axis):

- stage >= 1: every optimizer state of a parameter is ``S(d)`` on dp (a hint on the state
  input; its other axes follow the parameter). Propagation then runs the update on the
  shard: the gradient ``P -> S(d)`` is a reduce-scatter, the parameter ``B -> S(d)`` a free
  slice, and the updated shard is all-gathered back into the parameter's layout;
- stage >= 2: the gradient is pinned to the same ``S(d)`` where the backward makes it, so
  the full gradient dies there; with micro-batches the pin keeps it partial over them, so each
  micro-batch's gradient is reduce-scattered and the shards accumulate;
- stage 3: the parameter itself is ``S(d)`` on dp as a graph input (its update stays split).
  Its uses gather it; the boxing pass gathers a dp-split parameter again in each phase
  (forward, backward) instead of keeping the forward's copy, and here every value the
  forward computes from parameters alone (a weight's transpose) that the backward reads is
  recomputed in the backward, so no gathered weight lives from the forward to the backward.

``d`` is the first dim that no other axis splits and whose size divides by dp (dim 0 when it
can be); a tensor with no such dim stays as it is (``B`` on dp), named in its ``why``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from sbpc.compiler.frontend.hint_op import OP as HINT_OP, hint_of
from sbpc.compiler.frontend.hints import Hint
from sbpc.compiler.ir.aten import returns_alias
from sbpc.compiler.ir.types import FreshNames, Graph, GraphInput, InputKind, Node, OutputKind, Ref, Role, rename_uses
from sbpc.compiler.memory_options import ZERO_STAGES
from sbpc.compiler.pass_manager import Fact
from sbpc.errors import UsageError
from sbpc.compiler.ir.mesh import MICROBATCH
from sbpc.runtime.sbp import Broadcast, Partial, Sbp, Split

AXIS = "dp"


@dataclass
class Zero:
    name: str = "zero"
    needs: ClassVar[tuple[Fact, ...]] = ()
    provides: ClassVar[tuple[Fact, ...]] = ()
    stage: int = 0  # --zero

    def __post_init__(self):
        given = self.stage
        try:  # options also come as text (`// RUN: zero(stage=3)` of the golden tests)
            self.stage = int(given)
        except (TypeError, ValueError):
            self.stage = -1
        if self.stage not in ZERO_STAGES:
            raise UsageError(f"zero stage {given!r} is not one of 0, 1, 2, 3")

    def apply(self, graph: Graph, ctx) -> Graph:
        dp = graph.mesh.size(AXIS)
        if self.stage != 0 and dp > 1:
            graph = _Rewrite(graph, self.stage, dp).run()
        if graph.mesh.microbatches > 1 and not (self.stage >= 3 and dp > 1):
            # each micro-batch's forward makes its own copy of a weight's cast (a bf16 weight
            # under autocast) and would keep it until its backward: p - s copies in flight on
            # 1F1B stage s. The backward makes its own instead; views of the weight stay.
            params = {p.value for p in graph.inputs_of(InputKind.PARAM)}
            fresh = FreshNames(set(graph.value_types()) | {i.value for i in graph.inputs})
            graph = replace(graph, nodes=_recompute_param_values(graph.nodes, params, fresh, new_storage_only=True))
        return graph


def zero_dim(shape: tuple[int, ...], taken: set[int], dp: int) -> int | None:
    """The dim ZeRO splits over ``dp``: the first one not in ``taken`` (split by another axis)
    whose size divides; None when there is none."""
    return next((d for d, n in enumerate(shape) if d not in taken and n % dp == 0 and n >= dp), None)


class _Rewrite:
    def __init__(self, graph: Graph, stage: int, dp: int):
        self.g, self.stage, self.dp = graph, stage, dp
        self.source = f"--zero {stage}"
        self.fresh = FreshNames(set(graph.value_types()) | {i.value for i in graph.inputs})
        self.param_hint = {n.args[0].name: n for n in graph.nodes if n.op == HINT_OP}

    def _split(self, p: GraphInput) -> int | None:
        """The dp dim of parameter ``p``'s shards (and of its state and gradient)."""
        hint = self.param_hint.get(p.value)
        axes = hint_of(hint).axes if hint is not None else ()
        if any(a == AXIS for a, _ in axes):
            return None  # the user placed it on dp
        taken = {s.dim for _, s in axes if isinstance(s, Split)}
        return zero_dim(p.type.shape, taken, self.dp)

    def _hint(self, value: str, out: str, t, role: Role, loc, dp: Sbp, per_microbatch: bool = False) -> Node:
        # a gradient stays partial over micro-batches where it is pinned: each micro-batch's
        # gradient is reduce-scattered, and the shards accumulate (never the whole gradient)
        mb = ((MICROBATCH, Partial()),) if per_microbatch and self.g.mesh.microbatches > 1 else ()
        spec = Hint(mb + ((AXIS, dp),), self.source).spec()
        return Node([out], HINT_OP, (Ref(value), spec, self.source), {}, [t], role, loc=loc)

    def run(self) -> Graph:
        g = self.g
        params = {p.name: p for p in g.inputs_of(InputKind.PARAM)}
        dims = {name: self._split(p) for name, p in params.items()}
        first_loc = self._first_locs()
        front: list[Node] = []  # hints on inputs, first in the graph
        renames: dict[str, str] = {}
        nodes = list(g.nodes)
        gather: dict[str, Node] = {}  # a parameter's shard -> the hint that gathers it for the model
        if self.stage >= 3:
            for name, p in params.items():
                d = dims[name]
                if d is None:
                    continue
                old = self.param_hint.get(p.value)
                if old is not None:  # the user's hint (tp): dp joins it
                    base = hint_of(old)
                    spec = Hint(base.axes + ((AXIS, Split(d)),), base.source).spec()
                    nodes = [replace(n, args=(n.args[0], spec, n.args[2])) if n is old else n for n in nodes]
                    shard = old.outputs[0]
                else:
                    shard = self.fresh(f"{p.value}_zero")
                    front.append(self._hint(p.value, shard, p.type, Role.FORWARD, first_loc.get(p.value), Split(d)))
                    renames[p.value] = shard
                # the model reads the weight whole (gathered), as ZeRO-3 does; without this pin
                # the search may instead split the matmuls over dp (tensor parallelism on dp)
                # and gather activations, which saves no activation memory
                gather[shard] = self._hint(shard, self.fresh(f"{p.value}_gathered"), p.type, Role.FORWARD,
                                           first_loc.get(p.value), Broadcast())
        for s in g.inputs_of(InputKind.STATE):
            p = params.get(s.state_of)
            d = dims.get(s.state_of)
            if p is None or d is None or s.type.shape != p.type.shape:
                continue
            h = self.fresh(f"{s.value}_zero")
            front.append(self._hint(s.value, h, s.type, Role.OPTIMIZER, first_loc.get(s.value), Split(d)))
            renames[s.value] = h
        nodes = front + [rename_uses(n, lambda v: renames.get(v, v)) for n in nodes]
        if gather:
            whole = {v: h.outputs[0] for v, h in gather.items()}
            out = []
            for n in nodes:
                if n.role != Role.OPTIMIZER and not any(n is h for h in gather.values()):
                    n = rename_uses(n, lambda v: whole.get(v, v))
                out.append(n)
                out.extend(gather[o] for o in n.outputs if o in gather)
            nodes = out
        outputs = list(g.outputs)
        if self.stage >= 2:
            nodes, outputs = self._pin_gradients(nodes, outputs, params, dims)
        if self.stage >= 3:
            nodes = _recompute_param_values(nodes, {p.value for p in params.values()}, self.fresh)
        return replace(g, nodes=nodes, outputs=outputs)

    def _first_locs(self):
        out = {}
        for n in self.g.nodes:
            for u in n.uses():
                out.setdefault(u, n.loc)
        return out

    def _pin_gradients(self, nodes: list[Node], outputs, params, dims):
        """A hint right after each gradient's producer; the optimizer and the step's gradient
        output read the pinned value."""
        grads = {o.value: o.name for o in outputs if o.kind == OutputKind.GRAD and dims.get(o.name) is not None}
        pinned: dict[str, str] = {}
        out: list[Node] = []
        for n in nodes:
            if n.role == Role.OPTIMIZER:
                n = rename_uses(n, lambda v: pinned.get(v, v))
            out.append(n)
            for o, t in zip(n.outputs, n.types):
                if o in grads and o not in pinned:
                    pinned[o] = self.fresh(f"{o}_zero")
                    out.append(self._hint(o, pinned[o], t, Role.BACKWARD, n.loc, Split(dims[grads[o]]), per_microbatch=True))
        outputs = [replace(o, value=pinned.get(o.value, o.value)) if o.kind == OutputKind.GRAD else o for o in outputs]
        return out, outputs


def _recompute_param_values(nodes: list[Node], params: set[str], fresh: FreshNames,
                            new_storage_only: bool = False) -> list[Node]:
    """Backward readers of a forward value computed from parameters alone read a copy computed
    in the backward, so the forward's value, and the gathered weight it may hold, die with the
    forward. (The optimizer reads the shards, never the gathered weight.) ``new_storage_only``:
    only values with a storage of their own (a cast, not a view or hint of the weight)."""
    derived: set[str] = set(params)
    own: set[str] = set()  # derived values that are not views of a parameter's storage
    fwd_producer: dict[str, Node] = {}
    for n in nodes:
        if n.role in (Role.FORWARD, Role.PRE) and n.outputs and all(u in derived for u in n.uses()) and list(n.uses()):
            derived.update(n.outputs)
            if not (n.op == HINT_OP or returns_alias(n.op)) or any(u in own for u in n.uses()):
                own.update(n.outputs)
            for o in n.outputs:
                fwd_producer[o] = n
    if new_storage_only:
        fwd_producer = {v: n for v, n in fwd_producer.items() if v in own}
    copies: dict[tuple[str, Role], str] = {}
    out: list[Node] = []

    def copy(v: str, role: Role) -> str:
        p = fwd_producer.get(v)
        if p is None:
            return v
        if (v, role) not in copies:
            uses = {u: copy(u, role) for u in dict.fromkeys(p.uses())}
            names = [fresh(f"{o}_{role.value}") for o in p.outputs]
            out.append(replace(rename_uses(p, lambda u: uses.get(u, u)), outputs=names, role=role))
            for o, name in zip(p.outputs, names):
                copies[(o, role)] = name
        return copies[(v, role)]

    for n in nodes:
        if n.role == Role.BACKWARD:
            n = rename_uses(n, lambda u: copy(u, n.role) if u in fwd_producer else u)
        out.append(n)
    return out
