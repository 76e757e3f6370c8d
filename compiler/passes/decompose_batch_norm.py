"""Training-mode batch norm as sums over the batch, so a dp split stays split (SyncBatchNorm).

The fused kernel needs the whole batch (its rule gathers it on dp). Written as per-channel sums
over the batch and spatial dims divided by the global count, the statistics of a split batch
are partial sums: boxing all-reduces a few per-channel numbers instead of gathering the
activations, and every rank normalises its own samples with the whole batch's statistics. The
running statistics follow eager's update (``momentum * batch + (1 - momentum) * running``,
the variance unbiased by ``count / (count - 1)``). The backward is the kernel's formula:
``grad_input = w * rstd / count * (count * g - sum(g) - xhat * sum(g * xhat))``.

Only the affine form with every gradient asked for is rewritten; anything else keeps the
fused kernel, which is as exact, with the gather.
"""
from __future__ import annotations

import math

from sbpc.compiler.ir.types import Node, Ref, TensorType

FORWARD = "aten._native_batch_norm_legit_functional.default"
BACKWARD = "aten.native_batch_norm_backward.default"


class _Builder:
    """Appends ops that stand for ``n`` (its location, role and stage) with fresh names."""

    def __init__(self, n: Node, fresh, like):
        self.n, self.fresh, self.like, self.nodes = n, fresh, like, []

    def op(self, tag: str, op: str, args, t: TensorType, out: str | None = None) -> Ref:
        name = out or self.fresh(f"{self.n.outputs[0]}_{tag}")
        self.nodes.append(self.like(self.n, [name], op, args, [t]))
        return Ref(name)


def _dims(shape) -> tuple[list[int], list[int], int]:
    """The reduced dims (all but the channel), a per-channel value's broadcast shape, the count."""
    dims = [0, *range(2, len(shape))]
    return dims, [1, shape[1]] + [1] * (len(shape) - 2), math.prod(shape[d] for d in dims)


def batch_norm_forward(n: Node, fresh, types, like) -> list[Node]:
    x, w, b, rm, rv, training, momentum, eps = n.args
    if training is not True or w is None or b is None:
        return [n]
    t = types[x.name]
    dims, bshape, count = _dims(t.shape)
    if count < 2:
        return [n]
    stat = TensorType(tuple(bshape), t.dtype)
    chan = TensorType((t.shape[1],), t.dtype)
    out, save_mean, save_rstd, new_rm, new_rv = n.outputs
    k = _Builder(n, fresh, like)
    mean = k.op("mean", "aten.div.Scalar", [k.op("sum", "aten.sum.dim_IntList", [x, dims, True], stat), count], stat)
    xc = k.op("centered", "aten.sub.Tensor", [x, mean], t)
    sq = k.op("sq", "aten.mul.Tensor", [xc, xc], t)
    var = k.op("var", "aten.div.Scalar", [k.op("sqsum", "aten.sum.dim_IntList", [sq, dims, True], stat), count], stat)
    rstd = k.op("rstd", "aten.rsqrt.default", [k.op("var_eps", "aten.add.Scalar", [var, eps], stat)], stat)
    xhat = k.op("xhat", "aten.mul.Tensor", [xc, rstd], t)
    scaled = k.op("scaled", "aten.mul.Tensor", [xhat, k.op("w", "aten.view.default", [w, bshape], stat)], t)
    k.op("", "aten.add.Tensor", [scaled, k.op("b", "aten.view.default", [b, bshape], stat)], t, out=out)
    m = k.op("", "aten.view.default", [mean, [t.shape[1]]], chan, out=save_mean)
    k.op("", "aten.view.default", [rstd, [t.shape[1]]], chan, out=save_rstd)
    unbiased = k.op("unbiased", "aten.mul.Scalar", [k.op("var_c", "aten.view.default", [var, [t.shape[1]]], chan),
                                                     count / (count - 1)], chan)
    for running, batch, new in ((rm, m, new_rm), (rv, unbiased, new_rv)):
        kept = k.op("kept", "aten.mul.Scalar", [running, 1 - momentum], chan)
        k.op("", "aten.add.Tensor", [kept, k.op("moved", "aten.mul.Scalar", [batch, momentum], chan)], chan, out=new)
    return k.nodes


def batch_norm_backward(n: Node, fresh, types, like) -> list[Node]:
    g, x, w, rm, rv, save_mean, save_rstd, train, eps, mask = n.args
    if train is not True or w is None or list(mask) != [True, True, True]:
        return [n]
    t = types[x.name]
    dims, bshape, count = _dims(t.shape)
    stat = TensorType(tuple(bshape), t.dtype)
    chan = TensorType((t.shape[1],), t.dtype)
    grad_in, grad_w, grad_b = n.outputs
    k = _Builder(n, fresh, like)
    mean = k.op("mean", "aten.view.default", [save_mean, bshape], stat)
    rstd = k.op("rstd", "aten.view.default", [save_rstd, bshape], stat)
    xhat = k.op("xhat", "aten.mul.Tensor", [k.op("centered", "aten.sub.Tensor", [x, mean], t), rstd], t)
    gb = k.op("", "aten.sum.dim_IntList", [g, dims], chan, out=grad_b)
    gw = k.op("", "aten.sum.dim_IntList", [k.op("gx", "aten.mul.Tensor", [g, xhat], t), dims], chan, out=grad_w)
    inner = k.op("gn", "aten.sub.Tensor", [k.op("gcount", "aten.mul.Scalar", [g, count], t),
                                           k.op("gb", "aten.view.default", [gb, bshape], stat)], t)
    inner = k.op("gi", "aten.sub.Tensor", [inner, k.op("xgw", "aten.mul.Tensor",
                                                       [xhat, k.op("gw", "aten.view.default", [gw, bshape], stat)], t)], t)
    factor = k.op("factor", "aten.div.Scalar", [k.op("wr", "aten.mul.Tensor", [k.op("w", "aten.view.default", [w, bshape], stat),
                                                                                rstd], stat), count], stat)
    k.op("", "aten.mul.Tensor", [inner, factor], t, out=grad_in)
    return k.nodes
