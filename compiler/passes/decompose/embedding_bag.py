"""``nn.EmbeddingBag`` over a 2-D batch of ids, rewritten as a lookup and a sum (``decompose``).

Given ``[B, L]`` ids, ``nn.EmbeddingBag`` flattens them and makes the offsets itself,
``arange(0, B*L, L)``: offsets into the whole batch, which a batch split cannot cut (a device's
offsets would point past its own ids). Bags of equal length are rows, so with sum or mean and
no per-sample weights, padding index or gradient scaling by frequency the op is ``embedding(weight, ids.reshape(B, L))``
summed over dim 1 (then divided by L), and its backward is ``embedding_dense_backward`` of the
gradient repeated over each bag's L ids (divided by L): ops whose rules split the batch.
Max bags (their argmax) and bags given by the user's own offsets are left as they are.
"""
from __future__ import annotations

from dataclasses import replace

from sbpc.compiler.ir.types import Node, Ref, TensorType
from sbpc.compiler.passes.decompose.like import like as make

_SUM, _MEAN = 0, 1
FORWARD, BACKWARD = "aten._embedding_bag.default", "aten._embedding_bag_backward.default"


def _rows(offsets, indices, producers: dict[str, Node], types) -> tuple[int, int] | None:
    """(B, L) when ``offsets`` is ``arange(0, B*L, L)`` over ``indices`` of B*L ids, else None."""
    if not isinstance(offsets, Ref) or not isinstance(indices, Ref):
        return None
    n = producers.get(offsets.name)
    ids = types[indices.name].shape
    if n is None or n.op != "aten.arange.start_step" or len(ids) != 1:
        return None
    start, end, step = n.args[:3]
    if not all(isinstance(x, int) for x in (start, end, step)) or start != 0 or step <= 0 or end != ids[0]:
        return None
    if end % step or types[offsets.name].shape != (end // step,):
        return None
    return end // step, step


def _arg(n: Node, i: int, default):
    return n.args[i] if len(n.args) > i else default


def rewrite_bags(nodes: list[Node], fresh, producers: dict[str, Node], types) -> dict[int, list[Node]]:
    """Node index -> its lookup-and-sum form, for every bag op over equal rows whose forward's
    other results (offset2bag, bag sizes, argmax) only rewritten backwards read."""
    out = {i: r for i, n in enumerate(nodes) if n.op in (FORWARD, BACKWARD)
           and (r := _rewrite(n, fresh, producers, types)) is not None}
    extra = {o: i for i in out if nodes[i].op == FORWARD for o in nodes[i].outputs[1:]}
    keep = {extra[u] for i, n in enumerate(nodes) if i not in out for u in n.uses() if u in extra}
    return {i: r for i, r in out.items() if i not in keep}


def _rewrite(n: Node, fresh, producers: dict[str, Node], types) -> list[Node] | None:
    """The lookup-and-sum form of an ``_embedding_bag`` (or its backward) over equal rows, else None."""
    if n.op == FORWARD:
        weight, indices, offsets = n.args[:3]
        scale, mode, psw = _arg(n, 3, False), _arg(n, 4, 0), _arg(n, 6, None)
        last, pad = _arg(n, 7, False), _arg(n, 8, -1)
    else:
        grad, indices, offsets = n.args[:3]
        num, scale, mode, psw, pad = n.args[6], n.args[7], n.args[8], n.args[10], _arg(n, 11, -1)
        last = False
    shape = _rows(offsets, indices, producers, types)
    # scale_grad_by_freq counts each id over the whole batch: no rewrite splits that
    if shape is None or mode not in (_SUM, _MEAN) or psw is not None or last or pad not in (-1, None) or scale:
        return None
    b, length = shape
    out = n.outputs[0]
    ids = fresh(f"{out}_ids")
    ids_t = TensorType((b, length), types[indices.name].dtype)
    like = lambda o, op, args, t: make(n, [o], op, args, [t])  # one result each
    nodes = [like(ids, "aten.reshape.default", [indices, [b, length]], ids_t)]
    if n.op == FORWARD:
        t = n.types[0]
        rows, total = fresh(f"{out}_rows"), fresh(f"{out}_sum") if mode == _MEAN else out
        nodes.append(like(rows, "aten.embedding.default", [weight, Ref(ids)], TensorType((b, length, t.shape[1]), t.dtype)))
        nodes.append(like(total, "aten.sum.dim_IntList", [Ref(rows), [1]], t))
        if mode == _MEAN:
            nodes.append(like(out, "aten.div.Tensor", [Ref(total), length], t))
        return nodes
    t = types[grad.name]
    g = grad
    if mode == _MEAN:
        g = Ref(fresh(f"{out}_mean"))
        nodes.append(like(g.name, "aten.div.Tensor", [grad, length], t))
    wide = TensorType((b, 1, t.shape[1]), t.dtype)
    up, each = fresh(f"{out}_bag"), fresh(f"{out}_each")
    nodes.append(like(up, "aten.unsqueeze.default", [g, 1], wide))
    nodes.append(like(each, "aten.expand.default", [Ref(up), [b, length, t.shape[1]]], replace(wide, shape=(b, length, t.shape[1]))))
    nodes.append(like(out, "aten.embedding_dense_backward.default", [Ref(each), Ref(ids), num, -1, False], n.types[0]))
    return nodes
