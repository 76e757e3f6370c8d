"""Families of the type conversions, shape ops, indexing ops and their backwards, and arange.

Each is a loop nest (loops.py) plus the candidates a nest cannot say: a repeated dim read as a
strided split, a scatter whose split source rows give a partial sum. Shape-valued arguments
(repeats, input sizes) are rewritten to the local shapes by the localizers.
"""
from __future__ import annotations

import torch

from sbpc.compiler.ir.types import Ref
from sbpc.compiler.sbp.rules.families import elementwise, family, view_nd
from sbpc.compiler.sbp.rules.loops import Cand, Loops, dim_list, letters, norm_dim
from sbpc.runtime.plan import DTYPES
from sbpc.runtime.sbp import Partial, Split, local_shape


def _torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, DTYPES[name])


@family("convert")
def convert(c, self):
    """``_to_copy``: elementwise; linear when the conversion widens within floats or within
    integers (rounding to a narrower type is not), non-decreasing always (rounding is)."""
    lp, _ = elementwise(c, self)
    key = c.tensor(self)
    src, dst = _torch_dtype(c.dtypes[key]), _torch_dtype(c.node.types[0].dtype)
    same_kind = src.is_floating_point == dst.is_floating_point and torch.bool not in (src, dst)
    extra = [Cand({key: Partial("max")}, [Partial("max")], "rounding is non-decreasing")]
    if same_kind and dst.itemsize >= src.itemsize and not src.is_complex:
        extra.append(Cand({key: Partial()}, [Partial()], "a widening conversion is linear"))
    return lp, extra


def _repeat_loc(lc, self, repeats):
    """On an axis where the input is whole (``B``) and the output split, each device repeats
    its share of the repeats; where the input is split too, it repeats its block as often."""
    reps = list(lc.value(repeats))
    for k, s_in, s_out in zip(lc.sizes, lc.nd(self), lc.outs[0]):
        if isinstance(s_out, Split) and not isinstance(s_in, Split):
            reps[s_out.dim] //= k
    lc.set[repeats.value] = reps


def repeat_nd(in_shapes, out_shapes, ins, outs, sizes) -> bool:
    """Whether a repeat with these nd-SBPs is exact. Axes apply in order, each on the shard the
    earlier ones left, which holds ``t`` copies of the input (r at first). An input ``S(d:q)``
    takes ``S(D:t*q)``; with the input whole along d, each device keeps ``t/k`` whole copies,
    which is ``S(D:c)`` only where each of the c blocks splits into whole copies (c*k divides t).
    So the output dim takes either layout (the copies split, as a batch folded in front of the
    heads is: plain; or each copy split: strided), and the layout analysis may offer either
    block count: both are checked here."""
    a, b = in_shapes[0], out_shapes[0]
    off = len(b) - len(a)
    times = [b[D] // a[D - off] if D >= off and a[D - off] else b[D] for D in range(len(b))]
    for si, so, k in zip(ins[0], outs[0], sizes):
        if k == 1 or not isinstance(so, Split):
            continue
        t = times[so.dim]
        if isinstance(si, Split) and si.dim == so.dim - off:
            if so.parts != t * si.parts:
                return False
        elif t % (so.parts * k):
            return False
        else:
            times[so.dim] = t // k
    return True


@family("repeat", _repeat_loc, repeat_nd)
def repeat(c, self, repeats):
    """A dim repeated r times is r blocks of the input: an input ``S(d:q)`` gives ``S(d:r*q)``;
    with the input ``B``, an output split over k devices (k dividing r) repeats r/k times each."""
    key, reps = c.tensor(self), list(c.value(repeats))
    shp = c.shape(key)
    off = len(reps) - len(shp)
    lets = letters(len(reps))
    ins = [lets[off + d] if reps[off + d] == 1 else None for d in range(len(shp))]
    extra = []
    for D, r in enumerate(reps):
        d = D - off
        if r > 1 and d >= 0 and shp[d] > 1:
            for q in (1, *c.parts):
                extra.append(Cand({key: Split(d, q)}, [Split(D, r * q)], f"repeat {r} of split {d}"))
        if r > 1 and r % c.axis_size == 0:
            extra.append(Cand({}, [Split(D)], f"each device repeats {r // c.axis_size} of {r}"))
    return Loops(ins={key: ins}, outs=[lets]), extra


@family("roll")
def roll(c, self, dims):
    """Rolled dims never split; no dims rolls the flattened tensor, so nothing splits."""
    lp, _ = elementwise(c, self)
    rank = len(c.out_shape(0))
    lp.fixed |= {lp.outs[0][d] for d in dim_list(c.value(dims), rank)}
    return lp, []


@family("flip")
def flip(c, self, dims):
    lp, _ = elementwise(c, self)
    rank = len(c.out_shape(0))
    v = c.value(dims)
    lp.fixed |= {lp.outs[0][d] for d in (dim_list(v, rank) if v else [])}
    return lp, []


@family("unbind")
def unbind(c, self, dim):
    rank = len(c.shape(c.tensor(self)))
    d = norm_dim(c.value(dim), rank)
    lets = letters(rank)
    out = lets[:d] + lets[d + 1:]
    return Loops(ins={c.tensor(self): lets}, outs=[list(out) for _ in c.node.types], fixed={lets[d]}), []


@family("stack")
def stack(c, tensors, dim):
    rank = len(c.out_shape(0))
    d = norm_dim(c.value(dim), rank)
    lets = letters(rank)
    lp = Loops(outs=[lets], fixed={lets[d]})
    for j, v in enumerate(c.value(tensors)):
        if isinstance(v, Ref):
            lp.ins[(tensors.value, j)] = lets[:d] + lets[d + 1:]
    return lp, []


def _sizes_loc(lc, size, *tensors):
    lc.set[size.value] = lc.local_out(0)


@family("sized", _sizes_loc)
def sized(c, size, *tensors):
    """An elementwise op told its output shape (``slice_backward``): dims whose extent the op
    changes never split, and the shape argument becomes the local shape."""
    return elementwise(c, *tensors)


@family("unselect", _sizes_loc)
def unselect(c, size, grad, dim):
    """``select_backward``: the gradient of the selected slice, zeros elsewhere."""
    rank = len(c.out_shape(0))
    d = norm_dim(c.value(dim), rank)
    lets = letters(rank)
    return Loops(ins={c.tensor(grad): lets[:d] + lets[d + 1:]}, outs=[lets], fixed={lets[d]}), []


@family("index_select")
def index_select(c, self, dim, index):
    """Other dims split with the input; a split index gives a split output dim (self ``B``)."""
    rank = len(c.shape(c.tensor(self)))
    if rank == 0:
        return None, []
    d = norm_dim(c.value(dim), rank)
    lets = letters(rank)
    ins = list(lets)
    ins[d] = None
    has_index = len(c.shape(c.tensor(index))) == 1
    out = list(lets)
    out[d] = "i" if has_index else None
    return Loops(ins={c.tensor(self): ins, c.tensor(index): ["i"] if has_index else []}, outs=[out], fixed={lets[d]}), []


def _scatter_nest(c, self, dim, index, src, reduce: bool):
    """scatter / scatter_add: the index iterates over its own shape; off the scatter dim, index
    row j writes self row j from src row j, so such a dim splits where all three agree. With
    ``reduce`` (a sum), index and src rows split along the scatter dim give each device a
    partial sum, self ``P`` with them (it is added once)."""
    key, ix, sk = c.tensor(self), c.tensor(index), c.tensor(src) if src is not None else None
    shp, ishp = c.shape(key), c.shape(ix)
    sshp = c.shape(sk) if sk is not None else ishp
    rank = len(shp)
    if rank == 0 or len(ishp) != rank or len(sshp) != rank:
        return None
    d = norm_dim(c.value(dim), rank)
    lets = letters(rank)
    rows = [None if e == d else x for e, x in enumerate(lets)]
    along = [("i" if e == d else x) for e, x in enumerate(lets)]
    lp = Loops(ins={key: rows, ix: along}, outs=[list(rows)], fixed={lets[d]})
    lp.fixed |= {lets[e] for e in range(rank) if e != d and not shp[e] == ishp[e] == sshp[e]}
    if sk is not None:
        lp.ins[sk] = list(along)
    if reduce and sk is not None and sshp[d] == ishp[d]:
        lp.reduce, lp.terms = {"i": "sum"}, {key: 0, ix: 1, sk: 1}
    else:
        lp.fixed.add("i")
    return lp


@family("scatter")
def scatter(c, self, dim, index, src=None):
    return _scatter_nest(c, self, dim, index, src, reduce=False), []


@family("scatter_add")
def scatter_add(c, self, dim, index, src):
    return _scatter_nest(c, self, dim, index, src, reduce=True), []


@family("index_copy")
def index_copy(c, self, dim, index, source):
    """Source rows written at ``index`` along dim: the other dims split together."""
    lp, extra = index_add(c, self, dim, index, source)
    if lp is not None:
        lp.reduce, lp.terms = {}, {}
        lp.fixed.add("i")
    return lp, extra


@family("unselect_into")
def unselect_into(c, self, src, dim):
    """``select_scatter``: src written into the selected slice of self; other dims split together."""
    rank = len(c.shape(c.tensor(self)))
    d = norm_dim(c.value(dim), rank)
    lets = letters(rank)
    return Loops(ins={c.tensor(self): lets, c.tensor(src): lets[:d] + lets[d + 1:]}, outs=[lets], fixed={lets[d]}), []


@family("index_add")
def index_add(c, self, dim, index, source):
    """self + source rows added at ``index`` along dim: other dims split together; split
    source rows (with their index entries) give a partial sum, self ``P`` with them."""
    key, ix, sk = c.tensor(self), c.tensor(index), c.tensor(source)
    rank = len(c.shape(key))
    if rank == 0 or len(c.shape(ix)) != 1 or len(c.shape(sk)) != rank:
        return None, []
    d = norm_dim(c.value(dim), rank)
    lets = letters(rank)
    rows = [None if e == d else x for e, x in enumerate(lets)]
    lp = Loops(ins={key: rows, ix: ["i"], sk: [("i" if e == d else x) for e, x in enumerate(lets)]},
               outs=[list(rows)], reduce={"i": "sum"}, terms={key: 0, ix: 1, sk: 1})
    return lp, []


@family("index_put")
def index_put(c, self, indices, values, accumulate):
    """Indexed leading dims never split; the trailing dims split with the values' matching
    dims (a broadcast values dim stays ``B``). Accumulating, the put positions split too (a
    partial sum, below)."""
    vals = c.value(indices)
    keys = [(indices.value, j) for j in range(len(vals))]
    if not all(isinstance(v, Ref) for v in vals) or any(c.dtypes.get(k) in ("bool", "u8") for k in keys):
        return None, []  # x[:, idx] = v and masks: only B for now
    key, vk = c.tensor(self), c.tensor(values)
    shp = c.shape(key)
    n = len(vals)
    lets = letters(len(shp))
    lp = Loops(ins={key: [None] * n + lets[n:]}, outs=[[None] * n + lets[n:]])
    for k in keys:
        lp.ins[k] = [None] * len(c.shape(k))
    wide = list(torch.broadcast_shapes(*(tuple(c.shape(k)) for k in keys)))  # the put positions
    br = len(wide)
    res = [None] * br + lets[n:]  # the indexed result's dims, to which values broadcast
    if c.value(accumulate):
        # each put position adds its values into self: split the positions (every index tensor
        # and the values along them, a batch's gradient into an embedding table read as
        # ``weight[ids]``) and each device's sum is a part of the total, self a partial term
        res = [f"i{d}" for d in range(br)] + lets[n:]
        for k in keys:
            ks = c.shape(k)
            lp.ins[k] = [res[br - len(ks) + d] if ks[d] == wide[br - len(ks) + d] else None for d in range(len(ks))]
        lp.reduce = {x: "sum" for x in res[:br]}
        lp.terms = {key: 0, vk: 1, **{k: 1 for k in keys}}
    vs = c.shape(vk)
    full = wide + list(shp[n:])
    lp.ins[vk] = [res[len(res) - len(vs) + d] if vs[d] == full[len(res) - len(vs) + d] else None
                  for d in range(len(vs))]
    extra = []
    if c.value(accumulate):  # self + the values put: linear in both together
        extra.append(Cand({key: Partial(), vk: Partial()}, [Partial()], "accumulate: self+values P"))
    return lp, extra


def _unflatten_loc(lc, self, dim, sizes):
    d = norm_dim(lc.value(dim), len(lc.node.types[0].shape) - len(lc.value(sizes)) + 1)
    lc.set[sizes.value] = lc.local_out(0)[d:d + len(lc.value(sizes))]


@family("unflatten", _unflatten_loc, view_nd)
def unflatten(c, self, dim, sizes):
    from sbpc.compiler.sbp.rules.families import view

    return view(c, self)


def _arange_loc(lc, *args):
    axes = [ax for ax, s in zip(lc.axes, lc.outs[0]) if isinstance(s, Split)]
    if axes:
        lc.mask("sbpc.arange_shard", axes)
        lc.set["parts"] = next(s.parts for s in lc.outs[0] if isinstance(s, Split))


@family("arange", _arange_loc)
def arange(c, *args):
    """Split, each device making its own block of the range (``sbpc.arange_shard``)."""
    return Loops(outs=[["a"]], free_out=True), []


def _squeeze_loc(lc, self):
    # a split dim may be 1 on a device though not in the logical tensor: squeeze() would drop it
    lc.op = "aten.reshape.default"
    lc.args = (lc.node.args[0], lc.local_out(0))


@family("squeeze", _squeeze_loc, view_nd)
def squeeze(c, self):
    """``squeeze``: a view, run as a reshape to the local shape (squeeze of a dim that is not 1 is
    a no-op, but its block on a device may be 1)."""
    from sbpc.compiler.sbp.rules.families import view

    return view(c, self)


@family("pad")
def pad(c, self, pad):
    """``constant_pad_nd``: a dim padded (or cut, by a negative pad) on either side never splits;
    ``pad`` lists (before, after) pairs from the last dim backwards."""
    lp, _ = elementwise(c, self)
    rank = len(c.out_shape(0))
    p = list(c.value(pad))
    for i in range(0, len(p), 2):
        if p[i] or (i + 1 < len(p) and p[i + 1]):
            lp.fixed.add(lp.outs[0][rank - 1 - i // 2])
    return lp, []


@family("unfold")
def unfold(c, self, dimension):
    """``Tensor.unfold(d, size, step)``: windows along ``d`` (their count in place of ``d``, each
    window's elements a new last dim). Every other dim splits with the input; ``d`` never (a
    window may straddle two blocks)."""
    rank = len(c.shape(c.tensor(self)))
    lets = letters(rank)
    d = norm_dim(c.value(dimension), max(rank, 1))
    if rank:
        lets[d] = None
    return Loops(ins={c.tensor(self): lets}, outs=[[*lets, None]]), []


def _unfold_backward_loc(lc, grad_in, input_sizes, dim):
    lc.set[input_sizes.value] = lc.local_out(0)  # the kernel is told its local input's shape


@family("unfold_backward", _unfold_backward_loc)
def unfold_backward(c, grad_in, input_sizes, dim):
    """Its backward: the windows summed back into the input's shape, split as ``unfold``."""
    rank = len(c.out_shape(0))
    lets = letters(rank)
    d = norm_dim(c.value(dim), max(rank, 1))
    if rank:
        lets[d] = None
    return Loops(ins={c.tensor(grad_in): [*lets, None]}, outs=[lets]), []
