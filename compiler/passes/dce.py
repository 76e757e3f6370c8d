"""dce: remove ops whose results nothing uses. Every op outside init is pure (verified)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from sbpc.compiler.pass_manager import Fact
from sbpc.compiler.ir.types import Graph


@dataclass
class DeadCodeElimination:
    name: str = "dce"
    needs: ClassVar[tuple[Fact, ...]] = ()
    provides: ClassVar[tuple[Fact, ...]] = ()

    def apply(self, graph: Graph, ctx) -> Graph:
        live = {o.value for o in graph.outputs}
        kept = []
        for n in reversed(graph.nodes):
            if any(o in live for o in n.outputs):
                kept.append(n)
                live.update(n.uses())
        kept.reverse()
        return replace(graph, nodes=kept)
