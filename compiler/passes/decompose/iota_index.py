"""Indexing by ranges that read a tensor in order, rewritten as the reshape it is (``decompose``).

Hugging Face builds an attention mask from the padding mask as ``pad[arange(B)[:, None, None,
None], arange(L)[None, None, None, :]]``: every index tensor is a range over the whole dim it
indexes, each along its own dim of the result, in the indexed dims' order. Such an
``aten.index.Tensor`` reads each element once, in order: it is ``self.reshape`` to the result's
shape. As an index its rows never split (an index's values name rows of the whole tensor), so a
batch-split padding mask was gathered over micro-batches; as a reshape it splits with its batch.
"""
from __future__ import annotations

import torch

from sbpc.compiler.ir.types import Node, Ref, TensorType
from sbpc.compiler.passes.decompose.like import like as make

_INTS = ("i64", "i32", "i16", "i8", "u8")
# ops whose result holds the input's values in the input's order (same count): a range stays one
_SAME_ORDER = frozenset({"aten.unsqueeze.default", "aten.view.default", "aten.reshape.default",
                         "aten._unsafe_view.default", "aten.alias.default", "aten.clone.default",
                         "aten.squeeze.dim", "aten.squeeze.default", "aten.lift_fresh_copy.default",
                         "aten._to_copy.default"})
_ARANGE = {"aten.arange.default": (0, None), "aten.arange.start": (0, 1), "aten.arange.start_step": (0, 1)}


def _range_length(v: str, producers: dict[str, Node]) -> int | None:
    """n when value ``v`` is ``arange(n)`` (integers from 0, step 1) in some shape, else None."""
    seen = 0
    while (n := producers.get(v)) is not None and seen < 64:
        seen += 1
        if n.types[0].dtype not in _INTS:
            return None
        if n.op in _ARANGE:
            return _arange_length(n)
        if n.op in ("aten.add.Tensor", "aten.sub.Tensor") and len(n.args) == 2 and n.args[1] == 0 \
                and isinstance(n.args[0], Ref) and not n.kwargs:
            v = n.args[0].name
        elif n.op in _SAME_ORDER and n.args and isinstance(n.args[0], Ref):
            v = n.args[0].name
        else:
            return None
    return None


def _arange_length(n: Node) -> int | None:
    a = n.args
    if n.op == "aten.arange.default":
        return a[0] if isinstance(a[0], int) else None
    step = a[2] if len(a) > 2 else 1
    ok = a[0] == 0 and isinstance(a[1], int) and step == 1 and all(isinstance(x, int) for x in a[:3])
    return a[1] if ok else None


def iota_reshape(n: Node, producers: dict[str, Node], types) -> Node | None:
    """``self.reshape(out)`` for an ``aten.index.Tensor`` whose indices read ``self`` in order, else None."""
    self, indices = n.args[0], n.args[1]
    if not isinstance(self, Ref) or not indices or not all(isinstance(i, Ref) for i in indices):
        return None
    shape = types[self.name].shape
    out = n.types[0].shape
    last = -1
    for j, ix in enumerate(indices):
        ishape = types[ix.name].shape
        if types[ix.name].dtype not in _INTS or _range_length(ix.name, producers) != shape[j]:
            return None
        long = [d for d, s in enumerate(ishape) if s != 1]
        if len(long) > 1:
            return None
        if long:  # the range's dim in the result (index shapes align on the right)
            at = len(out) - (len(shape) - len(indices)) - len(ishape) + long[0]
            if at <= last:
                return None
            last = at
    if len([s for s in out if s != 1]) != len([s for s in shape if s != 1]):
        return None  # a range broadcast against another along one dim (a diagonal)
    return make(n, n.outputs, "aten.reshape.default", (self, list(out)), n.types)


def _row_range(ix: Ref, rows: int, width: int, producers: dict[str, Node], types) -> bool:
    """Whether index ``ix`` is ``arange(rows)`` along the first of ``width`` broadcast dims."""
    t = types[ix.name]
    long = [d for d, s in enumerate(t.shape) if s != 1]
    # its one long dim is the first of the broadcast ones (a 1-row range has none)
    along_rows = rows == 1 or (len(t.shape) == width and long == [0])
    return t.dtype in _INTS and _range_length(ix.name, producers) == rows and along_rows


def row_gather(n: Node, fresh, producers: dict[str, Node], types) -> list[Node] | None:
    """``self[arange(B), j]`` (a value per row: CLIP's pooled token, a label's log-probability)
    as ``gather`` along dim 1, and its backward ``index_put`` (``[arange(B), j] += v``) as
    ``scatter_add``: each row reads (writes) its own row, which a batch split keeps local. As an
    index the rows would need the whole tensor. Negative ``j`` counts from the end as indexing does."""
    put = n.op == "aten.index_put.default"
    self, indices = n.args[0], n.args[1]
    if not isinstance(self, Ref) or not isinstance(indices, (list, tuple)) or len(indices) != 2 \
            or not all(isinstance(i, Ref) for i in indices):
        return None
    shape, (first, col) = types[self.name].shape, indices
    if len(shape) < 2 or types[col.name].dtype != "i64":
        return None
    wide = tuple(torch.broadcast_shapes(types[first.name].shape, types[col.name].shape))
    if not wide or wide[0] != shape[0] or not _row_range(first, shape[0], len(wide), producers, types):
        return None
    rest = list(shape[2:])
    b, q = shape[0], 1
    for s in wide[1:]:
        q *= s
    like = lambda o, op, args, t: make(n, [o], op, args, [t])  # one result each
    out = n.outputs[0]
    names = {k: fresh(f"{out}_{k}") for k in ("cols", "neg", "up", "wrap", "rows", "each", "vals", "flat")}
    it = lambda s: TensorType(tuple(s), "i64")
    # a negative column counts from the end, as indexing does; one out of range stays out of range,
    # so gather refuses it as indexing would (a remainder would quietly pick another column)
    nodes = [like(names["cols"], "aten.expand.default", [col, list(wide)], it(wide)),
             like(names["neg"], "aten.lt.Scalar", [Ref(names["cols"]), 0], TensorType(tuple(wide), "bool")),
             like(names["up"], "aten.add.Scalar", [Ref(names["cols"]), shape[1]], it(wide)),
             like(names["wrap"], "aten.where.self", [Ref(names["neg"]), Ref(names["up"]), Ref(names["cols"])], it(wide)),
             like(names["rows"], "aten.reshape.default", [Ref(names["wrap"]), [b, q] + [1] * len(rest)], it([b, q] + [1] * len(rest))),
             like(names["each"], "aten.expand.default", [Ref(names["rows"]), [b, q] + rest], it([b, q] + rest))]
    dt = n.types[0].dtype
    if not put:
        nodes.append(like(names["flat"], "aten.gather.default", [self, 1, Ref(names["each"])], TensorType((b, q, *rest), dt)))
        nodes.append(like(out, "aten.reshape.default", [Ref(names["flat"]), list(wide) + rest], n.types[0]))
        return nodes
    values = n.args[2]
    if not isinstance(values, Ref):
        return None
    full = list(wide) + rest
    nodes.append(like(names["vals"], "aten.expand.default", [values, full], TensorType(tuple(full), dt)))
    nodes.append(like(names["flat"], "aten.reshape.default", [Ref(names["vals"]), [b, q] + rest], TensorType((b, q, *rest), dt)))
    op = "aten.scatter_add.default" if len(n.args) > 3 and n.args[3] else "aten.scatter.src"
    nodes.append(like(out, op, [self, 1, Ref(names["each"]), Ref(names["flat"])], n.types[0]))
    return nodes
