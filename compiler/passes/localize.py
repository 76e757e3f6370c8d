"""localize: give every op the arguments of the shard each device holds.

Types stay logical (with their nd-SBP); what changes are the arguments that spell a shape
(view sizes, split sizes, factory sizes become local), and ops whose sharded form is a
different kernel (a masked embedding lookup over a split vocabulary, a partial mean that
needs a scale). The rule book knows how, op by op; the ops of a row-wise region get their
device's row count where they spell it (``sbp/rowwise.py``). Collectives from the boxing pass are
already physical. After this pass the program is the SPMD program every device runs.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from sbpc.compiler.pass_manager import Fact
from sbpc.compiler.ir.types import Graph, Node
from sbpc.compiler.sbp.rowwise import localize_rowwise, region_of
from sbpc.compiler.sbp.rules import RuleBook
from sbpc.runtime.kinds import Collective
from sbpc.runtime.sbp import Broadcast


@dataclass
class Localize:
    name: str = "localize"
    needs: ClassVar[tuple[Fact, ...]] = (Fact.BOXED,)
    provides: ClassVar[tuple[Fact, ...]] = (Fact.LOCAL,)
    rules: RuleBook | None = None

    def apply(self, graph: Graph, ctx) -> Graph:
        axes = graph.mesh.sbp_axes
        sizes = tuple(graph.mesh.size(a) for a in axes)
        if all(k == 1 for k in sizes):
            return graph
        rules = self.rules or RuleBook.load()
        nodes: list[Node] = []
        rowwise = frozenset(graph.rowwise)
        for n in graph.nodes:
            if Collective.of(n.op) is not None:
                nodes.append(n)
            elif _replicated(n):  # same arguments, but its input may come from a collective
                nodes.append(_reshape(n))
            elif region_of(n, rowwise):  # a device runs a row-wise region on its own rows
                nodes.append(_reshape(localize_rowwise(n, sizes)))
            else:
                nodes.extend(_reshape(m) for m in rules.localize(n, list(n.sbp_in or []), list(n.sbp or []), sizes, axes))
        return replace(graph, nodes=nodes)


_VIEWS = ("aten.view.default", "aten._unsafe_view.default")


def _reshape(n: Node) -> Node:
    """A device's tensors do not have the strides the trace saw: shards, and the contiguous
    results of collectives, are laid out afresh, and kernels such as CPU flash attention lay out
    their output like their input. So a view that was legal in the trace may not be on a device,
    even of a replicated value (e.g. ``permute(2, 0, 1, 3).view`` after attention on gathered
    heads, where the trace's ``contiguous()`` was a no-op and left no copy). The graph is
    functional, so reshape (a copy only where needed) computes the same value."""
    return n.replace(op="aten.reshape.default") if n.op in _VIEWS else n


def _replicated(n: Node) -> bool:
    return all(isinstance(s, Broadcast) for nd in (n.sbp or []) + (n.sbp_in or []) for s in nd)
