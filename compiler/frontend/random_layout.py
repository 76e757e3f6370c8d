"""Random draws into a tensor laid out other than row-major, drawn in eager's order.

Dropout draws its mask with ``empty_like(x).bernoulli_(1 - p)``: ``empty_like`` keeps ``x``'s
strides, and the draw fills the tensor in memory order. When ``x`` is channels-last (a
convolution's output, SegFormer's decode head), eager's mask is drawn in ``N, H, W, C`` order,
while a plan's values keep no strides (the IR holds shapes): its draw, row-major, put the same
random numbers at other positions (``sbpc check`` failed on every mesh, one device too).

The trace knows the strides (the fake tensors have them), so capture writes such a draw in the
order eager's memory has: ``empty`` of the dims in memory order (the physical shape, row-major),
the draw on it, then ``permute`` back to the logical dims. Every value is eager's, and the
three ops have SBP rules (the draw splits as any random op, ``docs/sbp_rules.md``).
"""
from __future__ import annotations

import torch

from sbpc.compiler.ir.aten import is_random
from sbpc.compiler.ir.types import DType, Node, Ref, TensorType, users

EMPTY_LIKE = "aten.empty_like.default"


def memory_orders(graph: torch.fx.Graph, names: dict) -> dict[str, list[int]]:
    """IR value of each ``empty_like`` whose tensor is dense but not row-major -> its dims in
    memory order (outermost first)."""
    out = {}
    for n in graph.nodes:
        val = n.meta.get("val")
        if n.op != "call_function" or str(n.target) != EMPTY_LIKE or not isinstance(val, torch.Tensor):
            continue
        if val.is_contiguous() or val.dim() < 2:
            continue
        order = sorted(range(val.dim()), key=lambda d: (-val.stride(d), d))
        if val.permute(order).is_contiguous():  # dense, no overlap: a permutation of row-major
            out[names[n]] = order
    return out


def draw_in_memory_order(nodes: list[Node], orders: dict[str, list[int]]) -> list[Node]:
    """Each random op that reads one of ``orders``' tensors (all of whose readers are random
    ops) draws on the physical shape, and its result is permuted back."""
    if not orders:
        return nodes
    readers = users(nodes)
    out = []
    for i, n in enumerate(nodes):
        order = orders.get(n.outputs[0]) if n.op == EMPTY_LIKE else None
        if order is not None and all(is_random(nodes[j].op) for j in readers.get(n.outputs[0], [])):
            t = n.types[0]
            phys = TensorType(tuple(t.shape[d] for d in order), t.dtype)
            out.append(Node(n.outputs, "aten.empty.memory_format", ([*phys.shape],), {"dtype": DType(t.dtype)},
                            [phys], n.role, loc=n.loc))
            continue
        carrier = n.args[0] if n.args and isinstance(n.args[0], Ref) else None
        order = orders.get(carrier.name) if carrier is not None and is_random(n.op) else None
        if order is not None and all(is_random(nodes[j].op) for j in readers.get(carrier.name, [])):
            phys = TensorType(tuple(n.types[0].shape[d] for d in order), n.types[0].dtype)
            drawn = f"{n.outputs[0]}_in_memory_order"
            back = sorted(range(len(order)), key=order.__getitem__)
            out.append(Node([drawn], n.op, n.args, n.kwargs, [phys], n.role, loc=n.loc))
            out.append(Node(n.outputs, "aten.permute.default", (Ref(drawn), back), {}, n.types, n.role, loc=n.loc))
            continue
        out.append(n)
    return out
