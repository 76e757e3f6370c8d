"""normalize: make the captured graph device-neutral and drop autograd bookkeeping.

- The CPU capture yields ``_scaled_dot_product_flash_attention_for_cpu`` (+ backward); they
  become ``sbpc.attention`` / ``sbpc.attention_backward``, which each backend maps to its own
  kernel (flash-for-cpu on cpu; flash or memory-efficient on cuda).
- ``detach`` and ``alias`` are identities once autograd is gone: uses are rewired to the input.
- ``x.new_zeros(size)`` (``new_ones``, ``new_full``, ``new_empty``) becomes ``zeros(size,
  dtype=x's)``: ``x`` gives only a dtype and a device, and as an operand it would tie the new
  tensor's layout to its own (a batch ``x`` gathered over micro-batches for a fresh tensor).
  ``new_empty_strided`` (autograd's buffer for a value a backward copies into: RWKV's and
  RecurrentGemma's scans) is such a ``new_empty`` where its stride is dense (row-major, or a
  permutation of it) and no ``as_strided`` reads it: its values are unset, and the plan's ops
  read values, not memory layouts; another stays as it is.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from sbpc.compiler.pass_manager import Fact
from sbpc.compiler.ir.types import DType, Graph, Node, Sym, TensorType, rename_uses

# (captured op, neutral op, positional parameter names after the tensors' defaults)
_ATTENTION = {
    "aten._scaled_dot_product_flash_attention_for_cpu.default": ("sbpc.attention", 3),
    "aten._scaled_dot_product_flash_attention_for_cpu_backward.default": ("sbpc.attention_backward", 6),
}
_IDENTITY = {"aten.detach.default", "aten.alias.default"}
_FACTORY_OF = {"aten.new_zeros.default": "aten.zeros.default", "aten.new_ones.default": "aten.ones.default",
               "aten.new_full.default": "aten.full.default", "aten.new_empty.default": "aten.empty.memory_format"}

_NEW_EMPTY_STRIDED = "aten.new_empty_strided.default"


@dataclass
class Normalize:
    name: str = "normalize"
    needs: ClassVar[tuple[Fact, ...]] = ()
    provides: ClassVar[tuple[Fact, ...]] = ()

    def apply(self, graph: Graph, ctx) -> Graph:
        rename: dict[str, str] = {}
        nodes: list[Node] = []
        types: dict[str, TensorType] = {}  # made at the first new_* op: most graphs have none
        strided: set[str] | None = None  # likewise
        for n in graph.nodes:
            if any(u in rename for u in n.uses()):  # a copy only where a use changes: most nodes keep theirs
                n = rename_uses(n, lambda v: rename.get(v, v))
            if n.op in _IDENTITY:
                src = n.args[0]
                rename[n.outputs[0]] = src.name
                continue
            if n.op in _ATTENTION:
                n = _neutral_attention(n)
            if n.op == _NEW_EMPTY_STRIDED:
                strided = _as_strided_reads(graph) if strided is None else strided
                n = _unstrided(n, strided)
            if n.op in _FACTORY_OF:
                types = types or graph.value_types()
                n = _plain_factory(n, types)
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


def _dense(size, stride) -> bool:
    """The stride lays the elements out with no gap or overlap: row-major in some order of the dims."""
    if not (isinstance(size, (list, tuple)) and isinstance(stride, (list, tuple))) or len(size) != len(stride):
        return False  # a size or stride computed in the graph: not known here
    step = 1
    for d, st in sorted(((d, st) for d, st in zip(size, stride) if d != 1), key=lambda p: p[1]):  # size-1 dims: any stride
        if st != step:
            return False
        step *= d
    return True


def _as_strided_reads(graph: Graph) -> set[str]:
    return {v for u in graph.nodes if u.op.startswith("aten.as_strided") for v in u.uses()}


def _unstrided(n: Node, strided: set[str]) -> Node:
    if n.outputs[0] in strided or not _dense(n.args[1], n.args[2]):
        return n
    return replace(n, op="aten.new_empty.default", args=n.args[:2])


def _plain_factory(n: Node, types: dict[str, TensorType]) -> Node:
    """``new_zeros(x, size, dtype=None, ...)`` -> ``zeros(size, dtype=<x's dtype>, device=#device, ...)``."""
    dtype = n.kwargs.get("dtype") or DType(types[n.args[0].name].dtype)
    return replace(n, op=_FACTORY_OF[n.op], args=tuple(n.args[1:]),
                   kwargs={**n.kwargs, "dtype": dtype, "device": Sym("device")})
