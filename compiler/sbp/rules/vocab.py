"""Families of the vocab-parallel ops and the losses.

A split vocabulary (embedding rows, log-prob classes) is served by masked, rank-aware kernels
(``runtime/shard_ops.py``): each rank handles the ids in its block and leaves zeros (a ``P``
value) elsewhere. Loss reductions decide whether a batch split gives ``P`` (sum) or needs a
global denominator (mean: a 1/k scale, or no split at all).
"""
from __future__ import annotations

from sbpc.compiler.sbp.rules.families import _aligned, elementwise, family
from sbpc.compiler.sbp.rules.loops import B, Cand, Loops, letters
from sbpc.runtime.sbp import Partial, Split

def _masked_axes(lc, a, want) -> list[str]:
    return [ax for ax, s in zip(lc.axes, lc.nd(a)) if want(s)]


def _embedding_loc(lc, weight, indices):
    lc.mask("sbpc.embedding_masked", _masked_axes(lc, weight, lambda s: s == Split(0)))


@family("embedding", _embedding_loc)
def embedding(c, weight, indices):
    w, ix = c.tensor(weight), c.tensor(indices)
    n = len(c.shape(ix))
    lets = letters(n + 1)
    lp = Loops(ins={w: ["v", lets[n]], ix: lets[:n]}, outs=[lets], fixed={"v"})
    return lp, [Cand({w: Split(0)}, [Partial()], "vocab split: masked lookup -> P")]


def _embedding_bwd_loc(lc, grad_output, indices, num_weights, scale_grad_by_freq):
    lc.set[num_weights.value] = lc.local_out(0)[0]
    lc.mask("sbpc.embedding_dense_backward_masked", [ax for ax, s in zip(lc.axes, lc.outs[0]) if s == Split(0)])


@family("embedding_dense_backward", _embedding_bwd_loc)
def embedding_dense_backward(c, grad_output, indices, num_weights, scale_grad_by_freq):
    g, ix = c.tensor(grad_output), c.tensor(indices)
    n = len(c.shape(ix))
    lets = letters(n + 1)
    lp = Loops(ins={g: lets, ix: lets[:n]}, outs=[["v", lets[n]]], fixed={"v"})
    if not c.value(scale_grad_by_freq):
        lp.reduce = {x: "sum" for x in lets[:n]}  # counts per rank would differ from the global ones
    else:
        lp.fixed |= set(lets[:n])
    return lp, [Cand({}, [Split(0)], "vocab split: masked scatter -> S(0)")]


def _class_dim(c, self) -> int:
    return len(c.shape(c.tensor(self))) - 1


def _nll_fwd_loc(lc, self, target, weight, reduction):
    lc.mask("sbpc.nll_loss_forward_masked",
            [ax for ax, s, t in zip(lc.axes, lc.nd(self), lc.nd(target)) if isinstance(s, Split) and t == B])


@family("nll_loss_forward", _nll_fwd_loc)
def nll_loss_forward(c, self, target, weight, reduction):
    x, t = c.tensor(self), c.tensor(target)
    cd = _class_dim(c, self)
    lets = ["n", "c"][2 - len(c.shape(x)):]
    red = c.value(reduction)  # 0 none, 1 mean, 2 sum
    lp = Loops(ins={x: lets, t: lets[:-1]}, outs=[lets[:-1] if red == 0 else [], []], fixed={"c"})
    if c.tensor(weight):
        lp.ins[c.tensor(weight)] = [None]
    if red == 1:
        lp.fixed.add("n")  # mean divides by a global total weight
    else:
        lp.reduce = {"n": "sum"}  # sum: both outputs partial; none: the (zero) total weight
    extra = [Cand({x: Split(cd)}, [Partial(), B], "class split: masked pick -> P"),
             Cand({x: Partial()}, [Partial(), B], "linear in self")]
    return lp, extra


def _nll_bwd_loc(lc, grad_output, self, target):
    lc.mask("sbpc.nll_loss_backward_masked",
            [ax for ax, s, t in zip(lc.axes, lc.nd(self), lc.nd(target)) if isinstance(s, Split) and t == B])


@family("nll_loss_backward", _nll_bwd_loc)
def nll_loss_backward(c, grad_output, self, target):
    x, t, g = c.tensor(self), c.tensor(target), c.tensor(grad_output)
    cd = _class_dim(c, self)
    lets = ["n", "c"][2 - len(c.shape(x)):]
    lp = Loops(ins={x: lets, t: lets[:-1], g: ["n"] if len(c.shape(g)) == 1 and len(lets) == 2 else []},
               outs=[lets], fixed={"c"})
    return lp, [Cand({x: Split(cd)}, [Split(cd)], "class split: masked scatter")]


def _mean_scale(lc, reduction, self, *_):
    """Reduction mean: each rank divides by its own element (or row) count, 1/k of the whole,
    so the result is scaled by 1/k for every axis that splits ``self``."""
    if lc.value(reduction) == 1:
        for i, k in enumerate(lc.sizes):
            if isinstance(lc.nd(self)[i], Split):
                lc.scale /= k


def _mean_scale_backward(lc, reduction, grad_output, self, *_):
    _mean_scale(lc, reduction, self)


@family("pointwise_loss", _mean_scale)
def pointwise_loss(c, reduction, self, *rest):
    """A loss elementwise in ``self`` and the tensors after it (target, weights, broadcast
    against ``self``): mse, smooth L1, Huber, soft margin, binary cross-entropy (with logits).
    Any split; a sum or mean reduction sums every split letter into ``P`` (mean: 1/k)."""
    shape = c.shape(c.tensor(self))
    lets = letters(len(shape))
    red = c.value(reduction)
    lp = Loops(outs=[lets if red == 0 else []])
    _aligned(c, [self, *rest], len(shape), lets, lp, shape)
    if red:
        lp.reduce = {x: "sum" for x in lets}
    return lp, []


@family("pointwise_loss_backward", _mean_scale_backward)
def pointwise_loss_backward(c, reduction, grad_output, self, *rest):
    """The gradient of a ``pointwise_loss``: elementwise in every tensor (mean: 1/k)."""
    return elementwise(c, grad_output, self, *rest)


def _row_dims(c, a, lets: list[str]) -> list:
    """The letters of a row loss's tensor: a per-class ``weight`` never splits; a target or
    mask of ``self``'s rank has its rows and classes, a class per row (or a 0-d per-row
    gradient) the rows alone."""
    rank = len(c.shape(c.tensor(a)))
    if a.value == "weight":
        return [None] * rank
    return lets[:rank]


@family("row_loss", _mean_scale)
def row_loss(c, reduction, self, *rest):
    """A loss over each row's classes (multi-class and multi-label margin losses; ``self`` is
    ``[N, C]`` or ``[C]``): the rows split, the classes never; a sum or mean reduction over the
    rows gives ``P`` (mean: 1/k). Extra outputs (multilabel's ``is_target``) are ``self``-shaped."""
    lets = ["n", "c"][2 - len(c.shape(c.tensor(self))):]
    red = c.value(reduction)
    lp = Loops(outs=[lets[:-1] if red == 0 else [], *(lets for _ in c.node.types[1:])], fixed={"c"})
    for a in (self, *rest):
        if c.tensor(a):
            lp.ins[c.tensor(a)] = _row_dims(c, a, lets)
    if red:
        lp.reduce = {x: "sum" for x in lets[:-1]}
    return lp, []


@family("row_loss_backward", _mean_scale_backward)
def row_loss_backward(c, reduction, grad_output, self, *rest):
    """The gradient of a ``row_loss``: rows split with ``self`` (mean: 1/k), classes never."""
    lets = ["n", "c"][2 - len(c.shape(c.tensor(self))):]
    lp = Loops(outs=[lets], fixed={"c"})
    for a in (grad_output, self, *rest):
        if c.tensor(a):
            lp.ins[c.tensor(a)] = _row_dims(c, a, lets)
    return lp, []
