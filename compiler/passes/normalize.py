"""normalize: make the captured graph device-neutral and drop autograd bookkeeping.

- The CPU capture yields ``_scaled_dot_product_flash_attention_for_cpu`` (+ backward); they
  become ``sbpc.attention`` / ``sbpc.attention_backward``, which each backend maps to its own
  kernel (flash-for-cpu on cpu; flash or memory-efficient on cuda).
- ``detach`` and ``alias`` are identities once autograd is gone: uses are rewired to the input.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from sbpc.compiler.pass_manager import Fact
from sbpc.compiler.ir.types import Graph, Node, rename_uses

# (captured op, neutral op, positional parameter names after the tensors' defaults)
_ATTENTION = {
    "aten._scaled_dot_product_flash_attention_for_cpu.default": ("sbpc.attention", 3),
    "aten._scaled_dot_product_flash_attention_for_cpu_backward.default": ("sbpc.attention_backward", 6),
}
_IDENTITY = {"aten.detach.default", "aten.alias.default"}


@dataclass
class Normalize:
    name: str = "normalize"
    needs: ClassVar[tuple[Fact, ...]] = ()
    provides: ClassVar[tuple[Fact, ...]] = ()

    def apply(self, graph: Graph, ctx) -> Graph:
        rename: dict[str, str] = {}
        nodes: list[Node] = []
        for n in graph.nodes:
            if any(u in rename for u in n.uses()):  # a copy only where a use changes: most nodes keep theirs
                n = rename_uses(n, lambda v: rename.get(v, v))
            if n.op in _IDENTITY:
                src = n.args[0]
                rename[n.outputs[0]] = src.name
                continue
            if n.op in _ATTENTION:
                n = _neutral_attention(n)
            nodes.append(n)
        outputs = [replace(o, value=rename.get(o.value, o.value)) for o in graph.outputs]
        return replace(graph, nodes=nodes, outputs=outputs)


def _neutral_attention(n: Node) -> Node:
    op, ntensors = _ATTENTION[n.op]
    args = list(n.args) + [None] * (ntensors + 2 - len(n.args))
    dropout_p = args[ntensors] if args[ntensors] is not None else 0.0
    is_causal = bool(args[ntensors + 1])
    kwargs = {"attn_mask": n.kwargs.get("attn_mask"), "scale": n.kwargs.get("scale")}
    return replace(n, op=op, args=tuple(args[:ntensors]) + (dropout_p, is_causal), kwargs=kwargs)
