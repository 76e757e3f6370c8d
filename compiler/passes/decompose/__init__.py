"""decompose: rewrite fused ops whose math cannot be split into ops whose math can.

Only on a mesh with more than one device (a one-device plan keeps the fused kernels, bit for
bit), and the log-softmax only where a class dim could be split: on a dp, cp or tp axis. The
micro-batch axis splits the batch alone, so a pipelined or accumulating plan without them keeps
the fused ``_log_softmax`` (one pass over the logits, where the rewrite made six: 1x1x2's last
stage spent 0.85 ms more per micro-batch forward than torch's). Each rewrite computes the
same value with ops that have SBP rules:

- ``_log_softmax(x, d)`` = ``x - amax - log(sum(exp(x - amax)))``: with the vocab dim split,
  ``amax`` is ``P(max)`` and the sum ``P`` (vocab-parallel cross-entropy: the logits are
  never gathered); where propagation leaves the class dim whole, ``fuse-log-softmax`` puts the
  fused kernel back;
- ``_log_softmax_backward_data(g, y, d)`` = ``g - exp(y) * sum(g, d)``;
- ``nll_loss_forward`` with ``reduction=mean`` = the ``sum`` reduction divided by the total
  weight, and its backward likewise: with the batch split, the sum and the weight count are
  partial, so the mean is exact even when ignored targets are spread unevenly. Without class
  weights the count is taken from the targets alone (``sum(target != ignore_index)``), so it
  never waits for the logits: micro-batches learn the whole batch's count up front;
- ``nll_loss2d_forward(self[N, C, *S], target[N, *S])``, the per-pixel loss of
  ``cross_entropy`` on ``[N, C, H, W]`` (and on ``[N, C, L]``, ``[N, C, D, H, W]``, which torch
  views as ``[N, C, 1, prod(S)]``) = ``nll_loss_forward`` of one row per pixel: ``self`` permuted
  channels-last and reshaped to ``[N*prod(S), C]``, the target to ``[N*prod(S)]`` (reduction
  none: the loss reshaped back to ``[N, *S]``), and its mean rewritten as above. The batch dim
  leads the merge, so a dp or micro-batch split stays ``S(0)``; its backward likewise, the
  ``[N*prod(S), C]`` gradient reshaped to ``[N, *S, C]`` and permuted back;
- ``index(x, [arange(B)[:, None], arange(L)[None, :]])``, indices that read ``x`` in order,
  = ``x.reshape`` (``iota_index.py``): a padding mask indexed so splits with its batch; a pick
  per row ``x[arange(B), j]`` = ``gather`` along dim 1, its backward ``scatter_add``;
- ``_embedding_bag`` (sum or mean) of ``[B, L]`` ids, whose offsets ``arange(0, B*L, L)`` a
  batch split cannot cut, and its backward = a lookup and a sum over L (``embedding_bag.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from sbpc.compiler.pass_manager import Fact
from sbpc.compiler.ir.mesh import MICROBATCH
from sbpc.compiler.ir.types import DType, FreshNames, Graph, Node, Ref, TensorType
from sbpc.compiler.passes.decompose.embedding_bag import rewrite_bags
from sbpc.compiler.passes.decompose.iota_index import iota_reshape, row_gather
from sbpc.compiler.passes.decompose.like import like

_NONE, _MEAN, _SUM = 0, 1, 2


@dataclass
class Decompose:
    name: str = "decompose"
    needs: ClassVar[tuple[Fact, ...]] = ()
    provides: ClassVar[tuple[Fact, ...]] = ()
    always: bool = False  # also on one-device meshes (tests of the rewrite itself)

    def apply(self, graph: Graph, ctx) -> Graph:
        split = [a for a in graph.mesh.sbp_axes if graph.mesh.size(a) > 1]
        if not self.always and not split:
            return graph
        class_split = self.always or any(a != MICROBATCH for a in split)
        fresh = FreshNames({i.value for i in graph.inputs} | {o for n in graph.nodes for o in n.outputs})
        nodes: list[Node] = []
        types = graph.value_types()
        producers = {o: n for n in graph.nodes for o in n.outputs}
        bags = rewrite_bags(graph.nodes, fresh, producers, types)
        for i, n in enumerate(graph.nodes):
            if i in bags:
                nodes.extend(bags[i])
                continue
            if n.op == "aten.index.Tensor" and (as_view := iota_reshape(n, producers, types)) is not None:
                nodes.append(as_view)
                continue
            if n.op in ("aten.index.Tensor", "aten.index_put.default") and \
                    (per_row := row_gather(n, fresh, producers, types)) is not None:
                nodes.extend(per_row)
                continue
            rewrite = _REWRITES.get(n.op) if class_split or n.op not in _CLASS_DIM else None
            nodes.extend(rewrite(n, fresh, types) if rewrite else [n])
        return replace(graph, nodes=nodes)


def _log_softmax(n: Node, fresh, types) -> list[Node]:
    x, dim = n.args[0], n.args[1]
    t = n.types[0]
    red = TensorType(tuple(1 if i == dim % len(t.shape) else s for i, s in enumerate(t.shape)), t.dtype)
    out = n.outputs[0]
    m, s, e, z, lz = (fresh(f"{out}_{k}") for k in ("max", "shifted", "exp", "sum", "logsum"))
    return [
        like(n, [m], "aten.amax.default", [x, [dim], True], [red]),
        like(n, [s], "aten.sub.Tensor", [x, Ref(m)], [t]),
        like(n, [e], "aten.exp.default", [Ref(s)], [t]),
        like(n, [z], "aten.sum.dim_IntList", [Ref(e), [dim], True], [red]),
        like(n, [lz], "aten.log.default", [Ref(z)], [red]),
        like(n, [out], "aten.sub.Tensor", [Ref(s), Ref(lz)], [t]),
    ]


def _log_softmax_backward(n: Node, fresh, types) -> list[Node]:
    g, y, dim = n.args[0], n.args[1], n.args[2]
    t = n.types[0]
    red = TensorType(tuple(1 if i == dim % len(t.shape) else s for i, s in enumerate(t.shape)), t.dtype)
    out = n.outputs[0]
    sg, e, p = (fresh(f"{out}_{k}") for k in ("gsum", "exp", "prod"))
    return [
        like(n, [sg], "aten.sum.dim_IntList", [g, [dim], True], [red]),
        like(n, [e], "aten.exp.default", [y], [t]),
        like(n, [p], "aten.mul.Tensor", [Ref(e), Ref(sg)], [t]),
        like(n, [out], "aten.sub.Tensor", [g, Ref(p)], [t]),
    ]


def _nll_loss_forward(n: Node, fresh, types) -> list[Node]:
    if n.args[3] != _MEAN:
        return [n]
    out, weight = n.outputs
    total = fresh(f"{out}_sum")
    args = list(n.args)
    args[3] = _SUM
    if n.args[2] is not None:  # class weights: the total weight comes out of the kernel
        return [
            like(n, [total, weight], n.op, args, n.types, n.kwargs),
            like(n, [out], "aten.div.Tensor", [Ref(total), Ref(weight)], [n.types[0]]),
        ]
    # Without class weights the total weight is the count of targets not ignored. Counted from
    # the targets alone it does not depend on the logits, so with micro-batches the count of
    # the whole batch is known before the first forward (the schedule's ``pre`` phase).
    target, ignore = n.args[1], n.args[4]
    kept, unused = fresh(f"{out}_kept"), fresh(f"{weight}_kernel")
    mask = TensorType(types[target.name].shape, "bool")
    return [
        like(n, [total, unused], n.op, args, n.types, n.kwargs),
        like(n, [kept], "aten.ne.Scalar", [target, ignore], [mask]),
        like(n, [weight], "aten.sum.default", [Ref(kept)], [n.types[1]], {"dtype": DType(n.types[1].dtype)}),
        like(n, [out], "aten.div.Tensor", [Ref(total), Ref(weight)], [n.types[0]]),
    ]


def _nll_loss_backward(n: Node, fresh, types) -> list[Node]:
    if n.args[4] != _MEAN:
        return [n]
    g, weight = n.args[0], n.args[6]
    scaled = fresh(f"{n.outputs[0]}_gscaled")
    args = list(n.args)
    args[0], args[4] = Ref(scaled), _SUM
    grad_type = TensorType((), n.types[0].dtype)
    return [
        like(n, [scaled], "aten.div.Tensor", [g, weight], [grad_type]),
        like(n, n.outputs, n.op, args, n.types, n.kwargs),
    ]


def _nll_loss2d_forward(n: Node, fresh, types) -> list[Node]:
    """``nll_loss2d_forward(self[N, C, *S], target[N, *S], ...)`` = ``nll_loss_forward`` of one
    row per pixel (``_pixel_rows``), so the 1-D loss's rules (batch and class splits) and its
    mean rewrite above serve it; reduction none reshapes the per-row loss back to ``[N, *S]``."""
    out, weight = n.outputs
    nodes, rows, targets, types = _pixel_rows(n, n.args[0], n.args[1], fresh, types)
    args = [rows, targets, *n.args[2:]]
    if n.args[3] != _NONE:
        return nodes + _nll_loss_forward(like(n, n.outputs, "aten.nll_loss_forward.default", args, n.types, n.kwargs),
                                         fresh, types)
    loss_t = n.types[0]
    per_row = fresh(f"{out}_per_row")
    return nodes + [
        like(n, [per_row, weight], "aten.nll_loss_forward.default", args,
             [TensorType(types[targets.name].shape, loss_t.dtype), n.types[1]], n.kwargs),
        like(n, [out], "aten.reshape.default", [Ref(per_row), list(loss_t.shape)], [loss_t]),
    ]


def _nll_loss2d_backward(n: Node, fresh, types) -> list[Node]:
    """``nll_loss2d_backward`` = ``nll_loss_backward`` on the rows of ``_pixel_rows`` (with its
    mean rewrite); the ``[N*prod(S), C]`` gradient is reshaped to ``[N, *S, C]`` and permuted
    back to ``[N, C, *S]``."""
    g, out = n.args[0], n.outputs[0]
    nodes, rows, targets, types = _pixel_rows(n, n.args[1], n.args[2], fresh, types)
    if types[g.name].shape:  # reduction none: one gradient per pixel, flattened like the targets
        flat_g = fresh(f"{out}_grows")
        flat_t = TensorType(types[targets.name].shape, types[g.name].dtype)
        nodes.append(like(n, [flat_g], "aten.reshape.default", [g, list(flat_t.shape)], [flat_t]))
        g = Ref(flat_g)
    t, row_t = n.types[0], types[rows.name]
    gout, glast = fresh(f"{out}_gout"), fresh(f"{out}_glast")
    last = (t.shape[0], *t.shape[2:], t.shape[1])
    rank = len(t.shape)
    flat = like(n, [gout], "aten.nll_loss_backward.default", [g, rows, targets, *n.args[3:]],
                [TensorType(row_t.shape, t.dtype)], n.kwargs)
    return nodes + _nll_loss_backward(flat, fresh, types) + [
        like(n, [glast], "aten.reshape.default", [Ref(gout), list(last)], [TensorType(last, t.dtype)]),
        like(n, [out], "aten.permute.default", [Ref(glast), [0, rank - 1, *range(1, rank - 1)]], n.types),
    ]


def _pixel_rows(n: Node, x: Ref, t: Ref, fresh, types) -> tuple[list[Node], Ref, Ref, dict]:
    """The nodes that make ``x[N, C, *S]`` channels-last rows ``[N*prod(S), C]`` and ``t[N, *S]``
    the flat ``[N*prod(S)]``, those two values, and ``types`` with theirs. The batch dim leads
    the merge, so a batch split (dp, micro-batches) passes through the reshapes as ``S(0)``."""
    x_t, t_t = types[x.name], types[t.name]
    rank, classes = len(x_t.shape), x_t.shape[1]
    out = n.outputs[0]
    last, rows, targets = fresh(f"{out}_last"), fresh(f"{out}_rows"), fresh(f"{out}_targets")
    last_t = TensorType((x_t.shape[0], *x_t.shape[2:], classes), x_t.dtype)
    rows_t = TensorType((x_t.numel // classes, classes), x_t.dtype)
    targets_t = TensorType(rows_t.shape[:1], t_t.dtype)
    nodes = [
        like(n, [last], "aten.permute.default", [x, [0, *range(2, rank), 1]], [last_t]),
        like(n, [rows], "aten.reshape.default", [Ref(last), list(rows_t.shape)], [rows_t]),
        like(n, [targets], "aten.reshape.default", [t, list(targets_t.shape)], [targets_t]),
    ]
    return nodes, Ref(rows), Ref(targets), {**types, rows: rows_t, targets: targets_t}


_CLASS_DIM = frozenset({"aten._log_softmax.default", "aten._log_softmax_backward_data.default"})
_REWRITES = {
    "aten._log_softmax.default": _log_softmax,
    "aten._log_softmax_backward_data.default": _log_softmax_backward,
    "aten.nll_loss_forward.default": _nll_loss_forward,
    "aten.nll_loss_backward.default": _nll_loss_backward,
    "aten.nll_loss2d_forward.default": _nll_loss2d_forward,
    "aten.nll_loss2d_backward.default": _nll_loss2d_backward,
}
