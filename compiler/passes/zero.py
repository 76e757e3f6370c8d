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
can be).

A parameter with no such dim (dp = 6 and hidden 25600 = 2^10 * 25) is padded, as Megatron's
distributed optimizer and DeepSpeed pad their flat buffer: its largest dim that no other axis
splits, of size ``n``, becomes ``n'``, the next multiple of dp, in the logical graph of its
update. Its gradient is zero-padded where the backward makes it (``aten.slice_backward``: the
gradient of a slice, zeros elsewhere, linear, so a partial gradient pads as partial), the
optimizer reads the parameter zero-padded the same way, its optimizer states *are* the padded
tensors (their graph inputs have the padded shape), and the update ops run on padded values;
the new parameter is cut back to ``n`` (``aten.slice``) before it becomes the update output.
Zero rows stay zero through AdamW and SGD (gradient 0, parameter 0, moments 0: update 0, and
weight decay of 0 is 0), and they add nothing to a sum over gradients (fp16's overflow check).
The ``S(d)`` hints above then apply to the padded tensors: the padded gradient ``P -> S(d)`` is a
reduce-scatter, each device updates ``n'/dp`` rows, and the cut all-gathers the new parameter.

So a padded state's logical tensor is its parameter's shape with zero rows at the end of ``d``:
the plan's state spec says the padded shape, the runtime starts it at zeros (an offloaded master
copy as its parameter, zero-padded), and what leaves the runtime (``logical_states``, the step's
gradients, `sbpc check`) is cut back to the parameter's shape. The parameter itself is never
padded: under ZeRO-3 a padded parameter stays whole on dp (its gradient and state are split,
stage 2), since a padded parameter input would change its logical shape for the model, the
initialiser and saved weights. A tensor with no dim to pad (a scalar, or every dim split by
another axis) stays as it is (``B`` on dp).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from sbpc.compiler.frontend.hint_op import OP as HINT_OP, hint_of
from sbpc.compiler.frontend.hints import Hint
from sbpc.compiler.frontend.loss_scale import scaled_gradient
from sbpc.compiler.ir.aten import returns_alias
from sbpc.compiler.ir.types import (FreshNames, Graph, GraphInput, InputKind, Node, OutputKind, Ref, Role, TensorType,
                                    rename_uses)
from sbpc.compiler.memory_options import ZERO_STAGES
from sbpc.compiler.pass_manager import Fact
from sbpc.compiler.sbp.layout import Layouts
from sbpc.compiler.sbp.rules import RuleBook
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
            raise UsageError(f"zero stage {given!r} is not one of 0, 1, 2, 3",
                             hint="1 shards optimizer state over dp, 2 also gradients, 3 also parameters")

    def apply(self, graph: Graph, ctx) -> Graph:
        dp = graph.mesh.size(AXIS)
        if self.stage != 0 and dp > 1:
            graph = _Rewrite(graph, self.stage, dp).run()
        elif self.stage != 0:  # the user asked for sharding that this mesh cannot give
            print(f"sbpc: warning: --zero {self.stage} shards over dp, and this mesh has dp=1: it changes nothing "
                  "(a mesh of the form DPxTP..., with DP > 1, shards)", file=ctx.log)
        if graph.mesh.microbatches > 1 and not (self.stage >= 3 and dp > 1):
            # each micro-batch's forward makes its own copy of a weight's cast (a bf16 weight
            # under autocast) and would keep it until its backward: p - s copies in flight on
            # 1F1B stage s. The backward makes its own instead; views of the weight stay.
            params = {p.value for p in graph.inputs_of(InputKind.PARAM)}
            fresh = FreshNames(set(graph.value_types()) | {i.value for i in graph.inputs})
            graph = replace(graph, nodes=_recompute_param_values(graph.nodes, params, fresh, new_storage_only=True))
        return graph


def zero_dim(shape: tuple[int, ...], taken: set[int], dp: int, blocks=lambda d: 1) -> int | None:
    """The dim ZeRO splits over ``dp``: the first one not in ``taken`` (split by another axis)
    whose size divides, each of its ``blocks(d)`` strided blocks (a fused qkv's q, k and v) too;
    None when there is none."""
    return next((d for d, n in enumerate(shape) if d not in taken and n % (dp * blocks(d)) == 0 and n >= dp), None)


@dataclass(frozen=True)
class Pad:
    """A parameter's update padded along ``dim`` from ``size`` to ``padded`` (a multiple of dp)."""
    dim: int
    size: int
    padded: int

    def shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return shape[:self.dim] + (self.padded,) + shape[self.dim + 1:]


def pad_dim(shape: tuple[int, ...], taken: set[int], dp: int) -> Pad | None:
    """For a tensor ``zero_dim`` finds no dim of: its largest dim not in ``taken`` that dp does not
    divide (the first of equal ones: the least padding), padded to a multiple of dp; None when
    that leaves each device as much as the whole dim (size 1) or no dim is free."""
    # a dim dp divides gains no rows from padding (it failed on its strided blocks)
    free = [d for d in range(len(shape)) if d not in taken and shape[d] > 1 and shape[d] % dp]
    if not free:
        return None
    d = max(free, key=lambda i: (shape[i], -i))
    return Pad(d, shape[d], -(-shape[d] // dp) * dp)


class _Rewrite:
    def __init__(self, graph: Graph, stage: int, dp: int):
        self.g, self.stage, self.dp = graph, stage, dp
        self.source = f"--zero {stage}"
        self.fresh = FreshNames(set(graph.value_types()) | {i.value for i in graph.inputs})
        self.param_hint = {n.args[0].name: n for n in graph.nodes if n.op == HINT_OP}
        # the block counts propagation will give each dim (a fused qkv weight's dim 0 is S(_:3)
        # wherever it splits, once any axis can split its q, k and v blocks)
        sizes = tuple(graph.mesh.size(a) for a in graph.mesh.sbp_axes)
        self.blocks = Layouts(graph, RuleBook.load(strided_parts=()), sizes).block_count

    def _taken(self, p: GraphInput) -> set[int] | None:
        """The dims of parameter ``p`` that other axes split (its hint); None when the user
        placed it on dp."""
        hint = self.param_hint.get(p.value)
        axes = hint_of(hint).axes if hint is not None else ()
        if any(a == AXIS for a, _ in axes):
            return None
        return {s.dim for _, s in axes if isinstance(s, Split)}

    def _split(self, p: GraphInput) -> int | None:
        """The dp dim of parameter ``p``'s shards (and of its state and gradient), unpadded."""
        taken = self._taken(p)
        return None if taken is None else zero_dim(p.type.shape, taken, self.dp, lambda d: self.blocks(p.value, d))

    def _pad(self, p: GraphInput) -> Pad | None:
        taken = self._taken(p)
        return None if taken is None else pad_dim(p.type.shape, taken, self.dp)

    def _hint(self, value: str, out: str, t, role: Role, loc, dp: Sbp, per_microbatch: bool = False) -> Node:
        # a gradient stays partial over micro-batches where it is pinned: each micro-batch's
        # gradient is reduce-scattered, and the shards accumulate (never the whole gradient)
        mb = ((MICROBATCH, Partial()),) if per_microbatch and self.g.mesh.microbatches > 1 else ()
        spec = Hint(mb + ((AXIS, dp),), self.source).spec()
        return Node([out], HINT_OP, (Ref(value), spec, self.source), {}, [t], role, loc=loc)

    def run(self) -> Graph:
        params = {p.name: p for p in self.g.inputs_of(InputKind.PARAM)}
        dims = {name: self._split(p) for name, p in params.items()}  # the parameter's own dp dim (stage 3)
        pads = {name: pad for name, p in params.items() if dims[name] is None and (pad := self._pad(p)) is not None}
        if pads:
            self.g = _PadUpdates(self.g, params, pads, self.fresh).run()
        g = self.g
        # the dp dim of the state and gradient: the parameter's, or the padded one
        state_dims = dims | {name: pad.dim for name, pad in pads.items()}
        state_shape = {name: pads[name].shape(p.type.shape) if name in pads else p.type.shape
                       for name, p in params.items()}
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
            d = state_dims.get(s.state_of)
            if d is None or s.type.shape != state_shape[s.state_of]:
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
            nodes, outputs = self._pin_gradients(nodes, outputs, state_dims)
        if self.stage >= 3:
            nodes = _recompute_param_values(nodes, {p.value for p in params.values()}, self.fresh)
        return replace(g, nodes=nodes, outputs=outputs)

    def _first_locs(self):
        out = {}
        for n in self.g.nodes:
            for u in n.uses():
                out.setdefault(u, n.loc)
        return out

    def _pin_gradients(self, nodes: list[Node], outputs, dims):
        """A hint right after each gradient's producer; the optimizer and the step's gradient
        output read the pinned value."""
        made = _backward_made(nodes)
        grads = {made(o.value): o.name for o in outputs if o.kind == OutputKind.GRAD and dims.get(o.name) is not None}
        pinned: dict[str, str] = {}
        out: list[Node] = []
        for n in nodes:
            if n.role == Role.OPTIMIZER:
                n = rename_uses(n, lambda v: pinned.get(v, v))
            out.append(n)
            for o, t in zip(n.outputs, n.types):
                if o in grads and o not in pinned:
                    pinned[o] = self.fresh(f"{o}_zero")
                    # split per micro-batch only where the backward makes it: a once-a-step value
                    # (a padded fp16 gradient) is split once a step
                    out.append(self._hint(o, pinned[o], t, Role.BACKWARD, n.loc, Split(dims[grads[o]]),
                                          per_microbatch=n.role == Role.BACKWARD))
        outputs = [replace(o, value=pinned.get(o.value, o.value)) if o.kind == OutputKind.GRAD else o for o in outputs]
        return out, outputs


class _PadUpdates:
    """Each padded parameter's update on padded tensors (the module's docstring): its state
    inputs take the padded shape, the gradient is padded after the op that makes it, the
    optimizer reads the parameter padded, every optimizer value computed from these takes the
    padded shape, and the new parameter is cut back before it becomes the update output."""

    def __init__(self, graph: Graph, params: dict[str, GraphInput], pads: dict[str, Pad], fresh: FreshNames):
        self.g, self.params, self.pads, self.fresh = graph, params, pads, fresh
        grads = {o.name: o.value for o in graph.outputs if o.kind == OutputKind.GRAD}
        # values the optimizer must read padded -> their parameter's name: the parameter, its gradient
        self.pending = {params[name].value: name for name in pads} | {grads[name]: name for name in pads if name in grads}
        self.padded: dict[str, str] = {}  # such a value -> its padded copy
        self.owner: dict[str, str] = {}  # a value of a padded update -> its parameter's name

    def _padded_type(self, name: str, t: TensorType) -> TensorType:
        return TensorType(self.pads[name].shape(t.shape), t.dtype)

    def _pad(self, value: str, t: TensorType, like: Node) -> Node:
        """``value`` zero-padded: the gradient of its slice, placed and located like ``like``."""
        name, pad = self.pending[value], self.pads[self.pending[value]]
        out = self.padded[value] = self.fresh(f"{value}_pad")
        self.owner[out] = name
        padded = self._padded_type(name, t)
        return Node([out], "aten.slice_backward.default", (Ref(value), list(padded.shape), pad.dim, 0, pad.size, 1),
                    {}, [padded], like.role, loc=like.loc, memory=like.memory)

    def _retype(self, n: Node) -> Node:
        """An optimizer op reading a padded update's values computes padded values of that
        parameter's shape (the update math names no shape: optim.py); scalars stay."""
        owners = {self.owner[u] for u in n.uses() if u in self.owner}
        if not owners:
            return n
        types = []
        for o, t in zip(n.outputs, n.types):
            name = next((q for q in sorted(owners) if t.shape == self.params[q].type.shape), None)
            if name is not None:
                t = self._padded_type(name, t)
                self.owner[o] = name
            types.append(t)
        return replace(n, types=types)

    def run(self) -> Graph:
        g, params, pads = self.g, self.params, self.pads
        inputs = []
        for i in g.inputs:
            name = i.state_of
            if i.kind == InputKind.STATE and name in pads and i.type.shape == params[name].type.shape:
                i = replace(i, type=self._padded_type(name, i.type))
                self.owner[i.value] = name
            inputs.append(i)
        new_param = {o.value: o.name for o in g.outputs if o.kind == OutputKind.UPDATE and o.name in pads}
        cut: dict[str, str] = {}  # a padded new parameter -> its cut
        types = g.value_types()
        nodes: list[Node] = []
        for n in g.nodes:
            if n.role == Role.OPTIMIZER:  # the parameter (and a gradient no op makes) padded before its first read
                nodes.extend(self._pad(u, types[u], n) for u in dict.fromkeys(n.uses())
                             if u in self.pending and u not in self.padded)
                n = self._retype(rename_uses(n, lambda v: self.padded.get(v, v)))
            nodes.append(n)
            for o, t in zip(n.outputs, n.types):
                if o in self.pending and o not in self.padded:  # a gradient: padded where it is made
                    nodes.append(self._pad(o, t, n))
                if o in new_param and self.owner.get(o) == new_param[o]:
                    pad = pads[new_param[o]]
                    cut[o] = self.fresh(f"{o}_cut")
                    nodes.append(Node([cut[o]], "aten.slice.Tensor", (Ref(o), pad.dim, 0, pad.size, 1), {},
                                      [TensorType(params[new_param[o]].type.shape, t.dtype)], n.role, loc=n.loc,
                                      memory=n.memory))
        outputs = []
        for o in g.outputs:
            if o.kind == OutputKind.GRAD and o.name in pads:
                o = replace(o, value=self.padded.get(o.value, o.value))
            elif o.kind == OutputKind.UPDATE and o.name in pads:
                o = replace(o, value=cut.get(o.value, o.value))
            outputs.append(o)
        return replace(g, inputs=inputs, nodes=nodes, outputs=outputs)


def _backward_made(nodes: list[Node]):
    """``made(value)``: for a gradient output's value, the value the backward makes: the value
    itself, or under fp16 the scaled gradient that the once-a-step unscale multiplies."""
    producer = {o: n for n in nodes for o in n.outputs}
    types = {o: t for n in nodes for o, t in zip(n.outputs, n.types)}

    def made(value: str) -> str:
        v = value
        while v in producer and (scaled := scaled_gradient(producer[v], v, types)) is not None:
            v = scaled
        return v if v in producer and producer[v].role == Role.BACKWARD else value

    return made


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

    def copy(v: str, role: Role, stage: int | None) -> str:
        p = fwd_producer.get(v)
        if p is None:
            return v
        if (v, role) not in copies:
            uses = {u: copy(u, role, stage) for u in dict.fromkeys(p.uses())}
            names = [fresh(f"{o}_{role.value}") for o in p.outputs]
            # the chunk of its (first) backward reader: none before stage-partition, which
            # places backward ops itself (a hinted forward op's chunk would mark the graph as
            # partitioned, and the IR verifier then wants a chunk on every op)
            out.append(rename_uses(p, lambda u: uses.get(u, u)).replace(outputs=names, role=role, stage=stage))
            for o, name in zip(p.outputs, names):
                copies[(o, role)] = name
        return copies[(v, role)]

    for n in nodes:
        if n.role == Role.BACKWARD:
            n = rename_uses(n, lambda u: copy(u, n.role, n.stage) if u in fwd_producer else u)
        out.append(n)
    return out
