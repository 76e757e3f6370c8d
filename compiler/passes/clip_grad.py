"""clip-grad: ``--clip-grad``'s clipping by the global norm, in the layouts the update reads.

What ``torch.nn.utils.clip_grad_norm_`` does, as ops of the step:

    total = sqrt(sum over gradients of sum(g * g))        coef = min(max_norm / (total + 1e-6), 1)
    g' = g * coef                                         (every optimizer read of g reads g')

It runs after SBP propagation, so it adds no choice for the solver to weigh: each gradient is
squared in the nd-SBP its first optimizer reader takes it in (the update's layout: split where
the update is split, whole where it is replicated), the sum of a split square is partial on
that axis, and a replicated one is counted once. The running sum is partial on every axis where
a term is (a whole term joins as ``keep_first``: free), so boxing adds one all-reduce of 4 bytes
per axis that splits some gradient's update (tp for Megatron's split weights, dp under ZeRO) and
nothing on the others. On a pipeline the sum runs stage by stage in chunk order and the
coefficient goes back to each chunk: boxing turns those reads into transfers, which the
schedule orders with the rest of the step's transfers (so the order proof covers them).

The norm is a graph output (``metric "grad_norm"``, ``StepResult.grad_norm``): the norm of the
gradients before clipping. Under fp16 the gradients are the unscaled ones, and a norm that is
not finite comes of a gradient that is not: the scaler's verdict skips that step. torch sums the
squares of per-tensor norms; here the squares themselves: the same number up to rounding.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from sbpc.compiler.ir.types import FreshNames, Graph, GraphOutput, Node, OutputKind, Ref, Role, TensorType, rename_uses
from sbpc.compiler.pass_manager import Fact
from sbpc.errors import CompileError, UsageError
from sbpc.runtime.plan import GRAD_NORM
from sbpc.runtime.sbp import Broadcast, NdSbp, Partial, Split

NORM_EPS = 1e-6  # clip_grad_norm_'s


@dataclass
class ClipGrad:
    name: str = "clip-grad"
    needs: ClassVar[tuple[Fact, ...]] = (Fact.SBP,)
    provides: ClassVar[tuple[Fact, ...]] = ()
    max_norm: float | None = None  # --clip-grad; None: the pass does nothing

    def __post_init__(self):
        if self.max_norm is not None:
            self.max_norm = float(self.max_norm)  # a golden file's option is text
            if not self.max_norm > 0:
                raise UsageError(f"clip-grad max_norm {self.max_norm} must be > 0")

    def apply(self, graph: Graph, ctx) -> Graph:
        if self.max_norm is None:
            return graph
        return _clip(graph, self.max_norm)


@dataclass(frozen=True)
class _Grad:
    value: str
    type: TensorType
    layout: NdSbp  # as its first optimizer reader takes it
    stage: int | None
    reader: Node


def _clip(graph: Graph, max_norm: float) -> Graph:
    nodes = graph.nodes
    users = graph.users()
    made = graph.producers()
    types = graph.value_types()
    grads: list[_Grad] = []
    for o in graph.outputs_of(OutputKind.GRAD):
        readers = [i for i in users.get(o.value, []) if nodes[i].role == Role.OPTIMIZER]
        if not readers:
            continue
        reader = nodes[readers[0]]
        # sbp_in None: one device per stage (sbp-propagate makes every value B, needing no conversion)
        need = reader.sbp_in[list(reader.uses()).index(o.value)] if reader.sbp_in is not None else \
            tuple(Broadcast() for _ in graph.mesh.sbp_axes)
        layout = tuple(Broadcast() if isinstance(s, Partial) else s for s in need)
        grads.append(_Grad(o.value, types[o.value], layout, reader.stage, reader))
    if not grads:
        return graph
    # after every gradient is made (the backward, fp16's unscale), before the first optimizer read
    at = max(made.get(g.value, -1) for g in grads) + 1
    first_read = min(i for g in grads for i in users[g.value] if nodes[i].role == Role.OPTIMIZER)
    if first_read < at:
        raise CompileError("clip-grad: an optimizer op reads a gradient before every gradient is made",
                           hint="report this plan: the update is interleaved with the backward")
    fresh = FreshNames(set(types))
    axes = len(grads[0].layout)
    whole = tuple(Broadcast() for _ in range(axes))
    block: list[Node] = []

    def op(name: str, target: str, args: tuple, t: TensorType, ins: list[NdSbp], out: NdSbp, like: _Grad) -> str:
        v = fresh(name)
        block.append(Node([v], target, args, {}, [t], Role.OPTIMIZER, stage=like.stage, sbp=[out], sbp_in=ins,
                          memory=like.reader.memory, why="clip-grad: the global gradient norm"))
        return v

    # the sum in chunk order, so that on a pipeline it crosses each stage boundary once
    ordered = sorted(grads, key=lambda g: g.stage or 0)
    total, total_sbp = None, None
    for g in ordered:
        scalar = TensorType((), g.type.dtype)
        sq = op("clip_sq", "aten.mul.Tensor", (Ref(g.value), Ref(g.value)), g.type, [g.layout, g.layout], g.layout, g)
        part = tuple(Partial() if isinstance(s, Split) else Broadcast() for s in g.layout)
        term = op("clip_sum", "aten.sum.default", (Ref(sq),), scalar, [g.layout], part, g)
        if total is None:
            total, total_sbp = term, part
            continue
        joint = tuple(Partial() if isinstance(a, Partial) or isinstance(b, Partial) else Broadcast()
                      for a, b in zip(total_sbp, part))
        total = op("clip_total", "aten.add.Tensor", (Ref(total), Ref(term)), scalar, [joint, joint], joint, g)
        total_sbp = joint
    last = ordered[-1]
    scalar = TensorType((), last.type.dtype)
    norm = op("clip_norm", "aten.sqrt.default", (Ref(total),), scalar, [whole], whole, last)
    # max_norm / (norm + eps) as eager's Tensor.__rtruediv__ computes it: reciprocal, then the product
    shifted = op("clip_shifted", "aten.add.Tensor", (Ref(norm), NORM_EPS), scalar, [whole], whole, last)
    inverse = op("clip_inverse", "aten.reciprocal.default", (Ref(shifted),), scalar, [whole], whole, last)
    ratio = op("clip_ratio", "aten.mul.Tensor", (Ref(inverse), max_norm), scalar, [whole], whole, last)
    coef = fresh("clip_coef")
    block.append(Node([coef], "aten.clamp.default", (Ref(ratio), None, 1.0), {}, [scalar], Role.OPTIMIZER,
                      stage=last.stage, sbp=[whole], sbp_in=[whole], memory=last.reader.memory,
                      why="clip-grad: the clip coefficient"))
    clipped = {g.value: op(f"{g.value}_clipped", "aten.mul.Tensor", (Ref(g.value), Ref(coef)), g.type,
                           [g.layout, whole], g.layout, g) for g in grads}
    rest = [_read_clipped(n, clipped) if n.role == Role.OPTIMIZER else n for n in nodes[at:]]
    return replace(graph, nodes=nodes[:at] + block + rest,
                   outputs=list(graph.outputs) + [GraphOutput(OutputKind.METRIC, norm, GRAD_NORM)])


def _read_clipped(n: Node, clipped: dict[str, str]) -> Node:
    return rename_uses(n, lambda v: clipped.get(v, v)) if any(u in clipped for u in n.uses()) else n
