"""cse: common subexpression elimination.

Two pure ops with the same operator and arguments compute the same value; the later one is
replaced by the earlier. This folds, for example, the optimizer's per-parameter bias
corrections (functions of the step alone) into one computation per step. Random ops are
never merged: two dropout masks are two draws.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from sbpc.compiler.pass_manager import Fact
from sbpc.compiler.ir.aten import is_random
from sbpc.compiler.ir.types import Graph, Node, Ref, rename_uses
from sbpc.compiler.sbp.rowwise import region_of


@dataclass
class CommonSubexpressionElimination:
    name: str = "cse"
    needs: ClassVar[tuple[Fact, ...]] = ()
    provides: ClassVar[tuple[Fact, ...]] = ()

    def apply(self, graph: Graph, ctx) -> Graph:
        seen: dict[tuple, Node] = {}
        rowwise = frozenset(graph.rowwise)
        rename: dict[str, str] = {}
        nodes = []
        for n in graph.nodes:
            if any(u in rename for u in n.uses()):  # a copy only where a use changes: most nodes keep theirs
                n = rename_uses(n, lambda v: rename.get(v, v))
            key = _key(n)
            if key is not None and rowwise:  # a row-wise region's op is its devices' own (sbp/rowwise.py)
                key = (key, region_of(n, rowwise))
            first = seen.get(key) if key is not None else None
            if first is not None and first.types == n.types:
                rename.update(zip(n.outputs, first.outputs))
                continue
            if key is not None:
                seen[key] = n
            nodes.append(n)
        outputs = [replace(o, value=rename.get(o.value, o.value)) for o in graph.outputs]
        return replace(graph, nodes=nodes, outputs=outputs)


def _key(n: Node):
    if is_random(n.op):
        return None
    return (n.op, _freeze(n.args), _freeze(sorted(n.kwargs.items())) if n.kwargs else _NO_KWARGS)


_NO_KWARGS = ("list",)  # _freeze(sorted({}.items())), the key of most nodes' kwargs


def _freeze(a):
    if type(a) is Ref:  # most arguments: what the last line makes of them, without its two checks
        return ("Ref", a)
    if isinstance(a, (list, tuple)):
        return tuple(("list", *(_freeze(x) for x in a)))
    if isinstance(a, float):
        return ("float", repr(a))  # 1 and 1.0 and True must not merge
    return (type(a).__name__, a)
