"""random-draws: number a pipelined step's random ops in eager's order.

Eager draws every random op of the step from one generator, in program order. One stage and
one micro-batch reproduce that by construction (every rank runs every random op in order), and
nothing is needed. A pipeline does not: a stage skips the draws of the stages before it, and
micro-batches interleave. So here every random op becomes ``sbpc.random_shard`` with ``draw=k``,
its place among the step's draws; the runtime replays the draws in that order at the start of
the step, records the generator state before each, and op k restores state k before it draws
(runtime/rng.py). A random op that reads values (``bernoulli(probs)``, ``native_dropout``, a
fused attention with dropout) cannot be replayed from shapes alone and is refused, naming it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from sbpc.compiler.ir.types import Graph, Node
from sbpc.compiler.pass_manager import Fact
from sbpc.compiler.sbp.rules.random_ops import draws_randomly, reads_values
from sbpc.errors import CompileError
from sbpc.runtime.rng import RANDOM_SHARD


@dataclass
class RandomDraws:
    name: str = "random-draws"
    needs: ClassVar[tuple[Fact, ...]] = (Fact.LOCAL,)
    provides: ClassVar[tuple[Fact, ...]] = ()

    def apply(self, graph: Graph, ctx) -> Graph:
        if graph.mesh.size("pp") == 1 and graph.mesh.microbatches == 1:
            return graph
        axes = list(graph.mesh.sbp_axes)
        nodes, k = [], 0
        for n in graph.nodes:
            if draws_randomly(n):
                n = _numbered(n, k, axes)
                k += 1
            nodes.append(n)
        return replace(graph, nodes=nodes)


def _numbered(n: Node, k: int, axes: list[str]) -> Node:
    if n.op == RANDOM_SHARD:
        return replace(n, kwargs={**n.kwargs, "draw": k})
    if reads_values(n):
        raise CompileError(f"{n.op} draws random numbers from its inputs' values, so a pipeline cannot give it "
                           "eager's random stream", location=str(n.loc) if n.loc else None,
                           hint="use --microbatches 1 on a mesh without pp, or draw the mask from shapes alone "
                                "(torch.rand_like(x) < p, nn.Dropout)")
    whole = ["B"] * len(axes)  # a replicated draw: every rank keeps the whole logical tensor
    return replace(n, op=RANDOM_SHARD, kwargs={**n.kwargs, "op": n.op, "shape": list(n.types[0].shape),
                                                   "sbp": whole, "axes": axes, "draw": k})
