"""Families of the convolution, pooling, upsampling and padding ops, and of the other layers
of neural networks: diagonal and diag_embed, nn.Bilinear, the normalizations (batch, group,
RMS, weight), grid sampling and cdist.

These ops mix a fixed number of trailing spatial dims (never split: a window or a resampling
crosses block boundaries); the leading batch and channel dims split freely, and a
convolution's channels contract like a matmul.
"""
from __future__ import annotations

import math

from sbpc.compiler.sbp.rules.families import family
from sbpc.compiler.sbp.rules.loops import B, Cand, Loops, letters, norm_dim
from sbpc.runtime.sbp import Partial, Split


def _spatial_nest(c, n, tensors) -> Loops:
    k = c.value(n)
    lp = Loops()
    lead = None
    for a in tensors:
        key = c.tensor(a)
        if key is None:
            continue
        r = len(c.shape(key))
        lp.ins[key] = letters(r - k) + [None] * k
        lead = r - k if lead is None else lead
    for t in c.node.types:
        lp.outs.append(letters(len(t.shape) - k) + [None] * k)
    return lp


@family("spatial")
def spatial(c, n, *tensors):
    """Pooling, upsampling, reflection/replication padding and their backwards: the last
    ``n`` dims never split, the leading (batch, channel) dims split together."""
    return _spatial_nest(c, n, tensors), []


def _spatial_sized_loc(lc, size, n, *tensors):
    lc.set[size.value] = lc.local_out(0)


@family("spatial_sized", _spatial_sized_loc)
def spatial_sized(c, size, n, *tensors):
    """The same for a backward told its input's full shape (``upsample_*_backward``)."""
    return _spatial_nest(c, n, tensors), []


@family("convolution")
def convolution(c, input, weight, bias, transposed, groups):
    """Batch split -> split output; output channels split with the weight; input channels
    split with the weight -> P (the bias, an added term, P too). Grouped: batch only."""
    x, w, b = c.tensor(input), c.tensor(weight), c.tensor(bias)
    r = len(c.shape(x))
    sp = [None] * (r - 2)
    wl = ["c", "o"] if c.value(transposed) else ["o", "c"]
    lp = Loops(ins={x: ["n", "c", *sp], w: [*wl, *sp]}, outs=[["n", "o", *sp]], reduce={"c": "sum"})
    if b:
        lp.ins[b] = ["o"]
        lp.terms = {b: 0, x: 1, w: 1}
    if c.value(groups) != 1:
        lp.fixed |= {"c", "o"}
    return lp, []


def _conv_bwd_loc(lc, grad_output, weight, bias_sizes, transposed, groups):
    if lc.value(bias_sizes) is None:
        return
    parts = math.prod(k for k, s in zip(lc.sizes, lc.nd(grad_output)) if s == Split(1))
    lc.set[bias_sizes.value] = [lc.value(bias_sizes)[0] // parts]


@family("convolution_backward", _conv_bwd_loc)
def convolution_backward(c, grad_output, weight, bias_sizes, transposed, groups):
    """(grad_input, grad_weight, grad_bias): a batch split sums the weight and bias gradients
    (P); an output-channel split leaves grad_input P; an input-channel split leaves the bias
    gradient whole on every device. Grouped: batch only."""
    g, w = c.tensor(grad_output), c.tensor(weight)
    x = next(k for k in c.tensors() if k not in (g, w))
    wo, wc = (1, 0) if c.value(transposed) else (0, 1)
    cands = [Cand({g: Split(0), x: Split(0)}, [Split(0), Partial(), Partial()], "batch split")]
    if c.value(groups) == 1:
        cands += [Cand({g: Split(1), w: Split(wo)}, [Partial(), Split(wo), Split(0)], "output channels split"),
                  Cand({x: Split(1), w: Split(wc)}, [Split(1), Split(wc), B], "input channels split")]
    return None, cands


@family("diagonal")
def diagonal(c, self, dim1, dim2):
    """The two diagonal dims never split; the others pass, the diagonal becomes the last dim."""
    rank = len(c.shape(c.tensor(self)))
    d1, d2 = norm_dim(c.value(dim1), rank), norm_dim(c.value(dim2), rank)
    lets = letters(rank)
    out = [x for d, x in enumerate(lets) if d not in (d1, d2)] + [None]
    return Loops(ins={c.tensor(self): lets}, outs=[out], fixed={lets[d1], lets[d2]}), []


@family("diag_embed")
def diag_embed(c, self, dim1, dim2):
    """``diag_embed``, the reverse of ``diagonal``: the input's last dim becomes the diagonal of
    output dims ``dim1`` and ``dim2`` (neither splits); the other dims pass in order."""
    rank = len(c.shape(c.tensor(self)))
    d1, d2 = norm_dim(c.value(dim1), rank + 1), norm_dim(c.value(dim2), rank + 1)
    lead = iter(letters(rank - 1))
    out = [None if d in (d1, d2) else next(lead) for d in range(rank + 1)]
    return Loops(ins={c.tensor(self): [*letters(rank - 1), None]}, outs=[out]), []


@family("trilinear")
def trilinear(c, i1, i2, i3, expand1, expand2, expand3, sumdim):
    """``_trilinear`` (``nn.Bilinear``: ``x1 W x2``): each input is the whole loop nest with the
    dims of its ``expand`` list left out (unsqueezed); the ``sumdim`` dims are summed and
    dropped from the output. A split kept dim splits the output, a split summed dim gives
    ``P``; so the batch splits everything, the output features split with the weight."""
    rank = len(c.shape(c.tensor(i1))) + len(c.value(expand1))
    lets = letters(rank)
    ins = {c.tensor(t): [x for d, x in enumerate(lets) if d not in c.value(e)]
           for t, e in ((i1, expand1), (i2, expand2), (i3, expand3))}
    summed = set(c.value(sumdim))
    out = [x for d, x in enumerate(lets) if d not in summed]
    return Loops(ins=ins, outs=[out], reduce={lets[d]: "sum" for d in summed}), []


def _norm_stat(c, i: int, lets: list, lead: int) -> list:
    return lets[:lead] + [None] * (len(c.out_shape(i)) - lead)


@family("rms_norm")
def rms_norm(c, input, normalized_shape):
    """``_fused_rms_norm``: the leading dims split; the normalised dims never. (Its backward has
    no CPU kernel to prove a rule on, so it has none.)"""
    rank = len(c.shape(c.tensor(input)))
    lead = rank - len(c.value(normalized_shape))
    lets = letters(rank)
    outs = [lets] + [_norm_stat(c, i, lets, lead) for i in range(1, len(c.node.types))]
    return Loops(ins={c.tensor(input): lets}, outs=outs, fixed=set(lets[lead:])), []


@family("batch_norm")
def batch_norm(c, input, training, *channel):
    """Batch norm forward (native and the functional forms): the channel dim splits with every
    per-channel tensor; the batch splits only without training (running statistics)."""
    x = c.tensor(input)
    shp = c.shape(x)
    lets = ["n", "c"] + [None] * (len(shp) - 2)
    lp = Loops(ins={x: lets}, fixed=set())
    for a in channel:
        if c.tensor(a):
            lp.ins[c.tensor(a)] = ["c"]
    lp.outs = [lets] + [["c"] if c.out_shape(i) in ((shp[1],), (0,)) else [None] * len(c.out_shape(i))
                        for i in range(1, len(c.node.types))]
    if c.value(training) is not False:
        lp.fixed.add("n")
    return lp, []


@family("batch_norm_backward")
def batch_norm_backward(c, grad_out, input, train, *channel):
    """(grad_input, grad_weight, grad_bias): channel split throughout; without training, a
    batch split sums the weight and bias gradients (P)."""
    g, x = c.tensor(grad_out), c.tensor(input)
    lets = ["n", "c"] + [None] * (len(c.shape(x)) - 2)
    per_channel = [["c"] if len(c.out_shape(i)) == 1 else [None] * len(c.out_shape(i)) for i in (1, 2)]
    lp = Loops(ins={g: lets, x: lets}, outs=[lets, *per_channel])  # an output left out by output_mask is 0-d
    for a in channel:
        if c.tensor(a):
            lp.ins[c.tensor(a)] = ["c"]
    if c.value(train):
        lp.fixed.add("n")
    else:
        lp.reduce = {"n": "sum"}
    return lp, []


def _group_norm_loc(lc, input, N):
    """The kernel is told the batch size: a device's is its share of the batch."""
    parts = math.prod(k for k, s in zip(lc.sizes, lc.nd(input)) if isinstance(s, Split) and s.dim == 0)
    lc.set[N.value] = lc.value(N) // parts


@family("group_norm", _group_norm_loc)
def group_norm(c, input, N):
    """Group norm forward (out, mean, rstd of [N, groups]): statistics per sample and group, so
    the batch splits (with the statistics); channels never do (a group spans several); weight
    and bias stay whole."""
    lets = ["n"] + [None] * (len(c.shape(c.tensor(input))) - 1)
    stats = [["n", None] if len(c.out_shape(i)) == 2 else [None] * len(c.out_shape(i)) for i in (1, 2)]
    return Loops(ins={c.tensor(input): lets}, outs=[lets, *stats]), []


def _group_norm_bwd_loc(lc, grad_out, input, mean, rstd, N):
    _group_norm_loc(lc, input, N)


@family("group_norm_backward", _group_norm_bwd_loc)
def group_norm_backward(c, grad_out, input, mean, rstd, N):
    """(grad_input, grad_weight, grad_bias): a batch split sums the weight and bias gradients (P)."""
    lets = ["n"] + [None] * (len(c.shape(c.tensor(input))) - 1)
    ins = {c.tensor(grad_out): lets, c.tensor(input): lets, c.tensor(mean): ["n", None], c.tensor(rstd): ["n", None]}
    grad_in = lets if len(c.out_shape(0)) == len(lets) else [None] * len(c.out_shape(0))  # output_mask: 0-d
    outs = [grad_in] + [[None] * len(c.out_shape(i)) for i in (1, 2)]
    return Loops(ins=ins, outs=outs, reduce={"n": "sum"}), []


@family("grid_sample")
def grid_sample(c, input, grid):
    """``grid_sampler_2d/3d``: input ``[N, C, *S]`` read at grid ``[N, *T, k]`` gives
    ``[N, C, *T]``: the batch splits everything, the channels split with the input (the grid
    ``B``), an output position dim with the grid (the input ``B``: any position may read any
    pixel); the input's own spatial dims never split."""
    x, g = c.tensor(input), c.tensor(grid)
    k = len(c.shape(g)) - 2
    pos = letters(k, start=2)
    lp = Loops(ins={x: ["a", "b", *[None] * k], g: ["a", *pos, None]}, outs=[["a", "b", *pos]])
    return lp, []


@family("grid_sample_backward")
def grid_sample_backward(c, grad_output, input, grid):
    """Its backward: the input's gradient sums over the output positions, the grid's over
    the channels (each ``P`` when that letter splits)."""
    x, g = c.tensor(input), c.tensor(grid)
    k = len(c.shape(g)) - 2
    pos = letters(k, start=2)
    outs = [["a", "b", *[None] * k] if t.shape else [] for t in c.node.types[:1]] + [["a", *pos, None]]
    lp = Loops(ins={c.tensor(grad_output): ["a", "b", *pos], x: ["a", "b", *[None] * k], g: ["a", *pos, None]},
               outs=outs, reduce={"b": "sum", **{p: "sum" for p in pos}})
    return lp, []


def _cdist_lead(c, x1, x2) -> tuple[list, list]:
    """The batch dims of two cdist operands: letters where both have the same batch shape (they
    split together), else none (broadcast batch dims never split)."""
    s1, s2 = c.shape(c.tensor(x1)), c.shape(c.tensor(x2))
    if len(s1) == len(s2) and s1[:-2] == s2[:-2]:
        lead = letters(len(s1) - 2, start=3)
        return lead, lead
    return [None] * (len(s1) - 2), [None] * (len(s2) - 2)


@family("cdist")
def cdist(c, x1, x2):
    """``_cdist_forward``: ``[*B, P, M]`` against ``[*B, R, M]`` gives ``[*B, P, R]``: the
    batch, the rows of either side (the other ``B``); the feature dim never (a p-norm)."""
    l1, l2 = _cdist_lead(c, x1, x2)
    out = [None] * (len(c.out_shape(0)) - 2) if l1 != l2 else l1
    lp = Loops(ins={c.tensor(x1): [*l1, "p", None], c.tensor(x2): [*l2, "r", None]}, outs=[[*out, "p", "r"]])
    return lp, []


@family("cdist_backward")
def cdist_backward(c, grad, x1, x2, cdist):
    """Its backward (``x1``'s gradient): rows of ``x1`` split with it, rows of ``x2`` sum -> ``P``.
    With broadcast batch dims the gradient comes out in the broadcast shape: no batch letter."""
    l1, l2 = _cdist_lead(c, x1, x2)
    ranks = {len(c.shape(c.tensor(grad))), len(c.out_shape(0)), len(l1) + 2}
    if l1 != l2 or len(ranks) > 1:
        l1, l2 = [None] * (len(c.shape(c.tensor(x1))) - 2), [None] * (len(c.shape(c.tensor(x2))) - 2)
    rows = lambda rank: [*l1, "p"] if rank == len(l1) + 2 else [None] * (rank - 2) + ["p"]
    g, out = len(c.shape(c.tensor(grad))), len(c.out_shape(0))
    lp = Loops(ins={c.tensor(grad): [*rows(g), "r"], c.tensor(x1): [*l1, "p", None], c.tensor(x2): [*l2, "r", None],
                    c.tensor(cdist): [*rows(g), "r"]}, outs=[[*rows(out), None]], reduce={"r": "sum"})
    return lp, []


def _affine_grid_loc(lc, theta, size):
    lc.set[size.value] = [lc.local_out(0)[0], *lc.value(size)[1:]]  # the kernel is told its local batch


@family("affine_grid", _affine_grid_loc)
def affine_grid(c, theta, size):
    """``affine_grid_generator``: one grid ``[N, *S, k]`` per batch row of ``theta``
    ``[N, k, k+1]``: the batch splits (the kernel told its local ``N``), nothing else."""
    lp = Loops(ins={c.tensor(theta): ["a", None, None]}, outs=[["a", *[None] * (len(c.out_shape(0)) - 1)]])
    return lp, []


def _per_dim(c, dim, *tensors) -> dict:
    """Each tensor's dims: ``dim`` (of the first tensor's rank) the letter ``a``, the others none."""
    d = norm_dim(c.value(dim), len(c.shape(c.tensor(tensors[0]))))
    return {c.tensor(t): ["a" if i == d else None for i in range(len(c.shape(c.tensor(t))))] for t in tensors}


@family("weight_norm")
def weight_norm(c, v, g, dim):
    """``_weight_norm_interface``: ``w = v * g / |v|``, the norm over every dim of ``v`` but
    ``dim`` (``g`` and the norms keep ``dim``, size 1 elsewhere): ``dim`` splits everything
    together, no other dim (a norm is not the sum of the devices' norms)."""
    ins = _per_dim(c, dim, v, g)
    return Loops(ins=ins, outs=[ins[c.tensor(v)], ins[c.tensor(g)]]), []


@family("weight_norm_backward")
def weight_norm_backward(c, grad_w, v, g, norms, dim):
    """Its backward, ``(grad_v, grad_g)``: the same, ``dim`` alone splits."""
    ins = _per_dim(c, dim, grad_w, v, g, norms)
    return Loops(ins=ins, outs=[ins[c.tensor(v)], ins[c.tensor(g)]]), []
