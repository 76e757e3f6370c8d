"""The rule families: one small function per family, named in ``ir_specs/aten.sbp``.

A family reads the op's bound arguments and shapes (``SigCtx``) and returns its loop nest
(``Loops``, see loops.py) plus any extra candidate signatures the nest cannot express (a
strided split of ``split``/``cat``, a masked vocab-parallel kernel). A family may also have a
localizer that turns the logical node into its per-device form (``LocCtx``): local shapes for
shape-valued arguments, a rank-aware ``sbpc.*_masked`` kernel, a 1/k scale after a mean.
"""
from __future__ import annotations

from typing import Any, Callable

from sbpc.compiler.ir.types import Ref
from sbpc.compiler.sbp.rules.loops import (B, Cand, Loops, dim_list, flat_blocks, letters, norm_dim, split_of_blocks,
                                           view_groups, view_nd_exact)
from sbpc.errors import CompileError
from sbpc.runtime.sbp import Partial, Split, local_shape

FAMILIES: dict[str, Callable] = {}
LOCALIZERS: dict[str, Callable] = {}
# family -> whether an nd-signature (one 1-D signature per axis, taken together) is exact, for
# families whose 1-D signatures depend on sizes that another axis' split changes:
# (in shapes, out shapes, in nd-SBPs, out nd-SBPs, axis sizes) -> bool
ND_CHECKS: dict[str, Callable] = {}


def family(name: str, localizer: Callable | None = None, nd: Callable | None = None):
    def deco(fn):
        FAMILIES[name] = fn
        if localizer is not None:
            LOCALIZERS[name] = localizer
        if nd is not None:
            ND_CHECKS[name] = nd
        return fn
    return deco


class SigCtx:
    """What a family sees while enumerating signatures for one node on one axis."""

    def __init__(self, node, bind: dict[str, Any], shapes: dict, parts: tuple[int, ...], dtypes: dict | None = None,
                 axis_size: int = 2):
        self.node, self.bind, self.shapes, self.parts = node, bind, shapes, parts
        self.dtypes, self.axis_size = dtypes or {}, axis_size

    def value(self, a) -> Any:
        from sbpc.compiler.sbp.rules.dsl import LITERALS

        if a.kind != "name":
            return a.value
        return self.bind[a.value] if a.value in self.bind else LITERALS[a.value]

    def tensor(self, a) -> str | None:
        """The parameter name when ``a`` names a tensor argument, else None (scalar, absent)."""
        return a.value if a.kind == "name" and isinstance(self.bind.get(a.value), Ref) else None

    def tensors(self) -> list[str]:
        return [n for n, v in self.bind.items() if isinstance(v, Ref)]

    def shape(self, key) -> tuple[int, ...]:
        return self.shapes[key]

    def out_shape(self, i: int) -> tuple[int, ...]:
        return self.node.types[i].shape


class LocCtx:
    """What a localizer sees: the chosen nd-SBPs by parameter key, and what it may change."""

    def __init__(self, node, bind, ins: dict, outs: list, sizes, axes):
        self.node, self.bind, self.ins, self.outs, self.sizes, self.axes = node, bind, ins, outs, sizes, axes
        self.set: dict[str, Any] = {}  # parameter -> new (local) value
        self.op: str | None = None  # a rank-aware kernel (or another op) replacing the op
        self.args: tuple | None = None  # the replacing op's own positional arguments
        self.masked_axes: list[str] = []
        self.scale = 1.0  # the (first) output is multiplied by this afterwards

    def value(self, a) -> Any:
        from sbpc.compiler.sbp.rules.dsl import LITERALS

        if a.kind != "name":
            return a.value
        return self.bind[a.value] if a.value in self.bind else LITERALS[a.value]

    def local_out(self, i: int) -> list[int]:
        return list(local_shape(self.node.types[i].shape, self.outs[i], self.sizes))

    def nd(self, a) -> tuple:
        return self.ins.get(a.value, (B,) * len(self.axes))

    def mask(self, op: str, axes: list[str]) -> None:
        if axes:
            self.op, self.masked_axes = op, axes


# ---------------------------------------------------------------- loop-nest families

@family("broadcast_only")
def broadcast_only(c):
    return None, []


def _aligned(c, names, rank: int, lets: list[str], lp: Loops, out_shape) -> None:
    """Right-aligned broadcasting of ``names`` against an output of ``rank`` dims."""
    for a in names:
        key = c.tensor(a)
        if key is None:
            continue
        shp = c.shape(key)
        off = rank - len(shp)
        dims = []
        for d, s in enumerate(shp):
            x = lets[off + d] if off + d >= 0 else None
            if x is not None and s != 1 and s != out_shape[off + d]:
                lp.fixed.add(x)  # the op changes this dim's extent (slice, pad): it cannot split
            dims.append(x)
        lp.ins[key] = dims


@family("elementwise")
def elementwise(c, *names):
    out = c.out_shape(0)
    lets = letters(len(out))
    lp = Loops(outs=[list(lets) for _ in c.node.types])
    _aligned(c, names, len(out), lets, lp, out)
    return lp, []


@family("einsum")
def einsum(c, spec):
    """``"mn+mk,kn->mn"``: letters per input dim, right-aligned; ``,`` multiplies, ``+`` adds a term.
    A term lacking a summed letter is P (not B) when that letter is split."""
    text = c.value(spec).replace(" ", "")
    lhs, _, rhs = text.partition("->")
    terms = lhs.split("+")
    specs = [f for t in terms for f in t.split(",")]
    names = c.tensors()
    if len(specs) != len(names):
        raise CompileError(f"einsum rule {text!r} of {c.node.op} names {len(specs)} inputs, the op has {len(names)}")

    def fit(s: str, rank: int) -> list:
        return list(s[len(s) - rank:]) if rank else []

    lp = Loops(outs=[fit(rhs, len(c.out_shape(0)))])
    for n, s in zip(names, specs):
        lp.ins[n] = fit(s, len(c.shape(n)))
    lp.reduce = {x: "sum" for x in lhs if x.isalpha() and x not in rhs}
    if len(terms) > 1:
        owner = [t for t, term in enumerate(terms) for _ in term.split(",")]
        lp.terms = {n: owner[i] for i, n in enumerate(names)}
    return lp, []


def _reduce_loc(lc, self, dim, keepdim, kind):
    if lc.value(kind) == "mean":
        for i, k in enumerate(lc.sizes):
            if isinstance(lc.nd(self)[i], Split) and isinstance(lc.outs[0][i], Partial):
                lc.scale /= k


@family("reduce", _reduce_loc)
def reduce(c, self, dim, keepdim, kind):
    """kind "sum" / "mean": a split reduced dim gives P; "max": P(max); "none": it never splits.
    Every output (values and indices of ``max.dim``, ``var_mean``) has the reduced shape."""
    rank = len(c.shape(c.tensor(self)))
    red = dim_list(c.value(dim), rank)
    lets = letters(rank)
    out = [None if d in red else x for d, x in enumerate(lets)] if c.value(keepdim) else \
        [x for d, x in enumerate(lets) if d not in red]
    lp = Loops(ins={c.tensor(self): lets}, outs=[list(out) for _ in c.node.types])
    kind = c.value(kind)
    if kind == "none":
        lp.fixed |= {lets[d] for d in red}
    else:
        lp.reduce = {lets[d]: "max" if kind == "max" else "sum" for d in red}
    return lp, []


@family("histc")
def histc(c, self, min, max):
    """``histc``: each element falls in a bin fixed by ``min`` and ``max`` alone, so any split
    of the input counts its block's elements and the counts add (``P``). With ``min == max``
    torch takes the range from the data (each block's own extremes would shift the bins):
    then nothing splits."""
    if c.value(min) == c.value(max):
        return None, []
    lets = letters(len(c.shape(c.tensor(self))))
    return Loops(ins={c.tensor(self): lets}, outs=[[None]], reduce={x: "sum" for x in lets}), []


@family("check_input")
def check_input(c, x, bad):
    """``sbpc.check_input(x, bad)``: ``x`` passes through as it is (``B``, ``P``, ``P(max)``);
    ``bad`` is read for any true element, which each device finds in its own block, so it is
    ``B`` or split on any dim, whatever ``x`` is."""
    xk, bk = c.tensor(x), c.tensor(bad)
    shape = c.shape(bk)
    splits = [B] + [Split(d, p) for d, n in enumerate(shape) if n != 1 for p in (1, *c.parts)]
    return None, [Cand({xk: sx, bk: sb}, [sx], f"check {sb!r}")
                  for sx in (B, Partial("sum"), Partial("max")) for sb in splits]


@family("complex_view")
def complex_view(c, self):
    """``view_as_complex`` ([..., 2] real -> [...] complex) and ``view_as_real`` (back): the
    leading dims map one to one; the (real, imaginary) pair never splits."""
    rank_in, rank_out = len(c.shape(c.tensor(self))), len(c.out_shape(0))
    lets = letters(min(rank_in, rank_out))
    pair = [*lets, None]
    ins, out = (pair, lets) if rank_in > rank_out else (lets, pair)
    return Loops(ins={c.tensor(self): ins}, outs=[out]), []


@family("transpose")
def transpose(c, self, dim0, dim1):
    rank = len(c.shape(c.tensor(self)))
    lets = letters(rank)
    out = list(lets)
    if rank >= 2:
        a, b = norm_dim(c.value(dim0), rank), norm_dim(c.value(dim1), rank)
        out[a], out[b] = out[b], out[a]
    return Loops(ins={c.tensor(self): lets}, outs=[out]), []


@family("permute")
def permute(c, self, dims):
    rank = len(c.shape(c.tensor(self)))
    lets = letters(rank)
    return Loops(ins={c.tensor(self): lets}, outs=[[lets[norm_dim(d, rank)] for d in c.value(dims)]]), []


@family("select")
def select(c, self, dim):
    rank = len(c.shape(c.tensor(self)))
    d = norm_dim(c.value(dim), rank)
    lets = letters(rank)
    return Loops(ins={c.tensor(self): lets}, outs=[lets[:d] + lets[d + 1:]], fixed={lets[d]}), []


def _size_loc(lc, self, size=None):
    if size is not None and size.kind == "name" and lc.value(size) is not None:
        lc.set[size.value] = lc.local_out(0)


def view_nd(in_shapes, out_shapes, ins, outs, sizes) -> bool:
    return view_nd_exact(in_shapes[0], out_shapes[0], ins[0], outs[0], sizes)


@family("view", _size_loc, view_nd)
def view(c, self, size=None):
    """A split maps to the split of the other side that cuts as many blocks of the flattened
    tensor (loops.flat_blocks): the leading dims of each factor group map plainly (the loop
    nest), a split of an inner dim of a folded group maps to a strided split of the folded dim
    and back (``[L, B, E]`` ``S(1)`` <-> ``[L*B, E]`` ``S(0:L)``)."""
    key = c.tensor(self)
    a, b = c.shape(key), c.out_shape(0)
    ins, outs = [None] * len(a), [None] * len(b)
    for g, (gi, gj) in enumerate(view_groups(a, b)):
        li = [d for d in gi if a[d] != 1]
        lj = [d for d in gj if b[d] != 1]
        if li and lj:
            ins[li[0]] = outs[lj[0]] = f"g{g}"
    extra = []
    for src, dst, forward in ((a, b, True), (b, a, False)):
        for d in range(len(src)):
            for q in (1, *c.parts):
                s = Split(d, q)
                if src[d] in (0, 1) or src[d] % (q * c.axis_size) or 0 in src:  # an empty tensor has no blocks
                    continue
                t = split_of_blocks(dst, flat_blocks(src, s), c.axis_size)
                if t is not None:
                    s_in, s_out = (s, t) if forward else (t, s)
                    extra.append(Cand({key: s_in}, [s_out], f"flat blocks {flat_blocks(src, s)}"))
    return Loops(ins={key: ins}, outs=[outs]), extra


@family("expand", _size_loc)
def expand(c, self, size):
    out = c.out_shape(0)
    lets = letters(len(out))
    shp = c.shape(c.tensor(self))
    off = len(out) - len(shp)
    ins = [lets[off + d] if s == out[off + d] else None for d, s in enumerate(shp)]
    return Loops(ins={c.tensor(self): ins}, outs=[lets], free_out=True), []


def _factory_loc(lc, size=None):
    _size_loc(lc, None, size)


@family("factory", _factory_loc)
def factory(c, size=None):
    lets = letters(len(c.out_shape(0))) if size is not None else [None] * len(c.out_shape(0))
    return Loops(outs=[lets], free_out=True), []


@family("like")
def like(c, self):
    key = c.tensor(self)
    lets = letters(len(c.shape(key)))
    extra = [Cand({key: p}, [B], f"values of {key} unused") for p in (Partial(), Partial("max"))]
    return Loops(ins={key: lets}, outs=[list(lets)]), extra


def _split_loc(lc, self, dim, sizes=None):
    if sizes is None or sizes.kind != "name":
        return
    d = norm_dim(lc.value(dim), len(lc.node.types[0].shape))
    old = lc.value(sizes)
    local = [lc.local_out(i)[d] for i in range(len(lc.node.types))]
    lc.set[sizes.value] = local[0] if isinstance(old, int) else local


@family("split", _split_loc)
def split(c, self, dim, sizes=None):
    key = c.tensor(self)
    shp = c.shape(key)
    d = norm_dim(c.value(dim), len(shp))
    lets = letters(len(shp))
    lp = Loops(ins={key: lets}, outs=[list(lets) for _ in c.node.types], fixed={lets[d]})
    n = len(c.node.types)
    pieces = {c.out_shape(i)[d] for i in range(n)}
    extra = []
    if len(pieces) == 1 and n * pieces.pop() == shp[d]:
        for q in (1, *c.parts):
            extra.append(Cand({key: Split(d, n * q)}, [Split(d, q)] * n, f"strided split {d}:{n * q} -> {n} pieces"))
    return lp, extra


@family("cat")
def cat(c, tensors, dim):
    out = c.out_shape(0)
    d = norm_dim(c.value(dim), len(out))
    lets = letters(len(out))
    keys = [(tensors.value, j) for j, v in enumerate(c.value(tensors)) if isinstance(v, Ref)]
    # torch skips 1-D empty inputs of another rank (legacy cat): they stay B and take no part
    full = [key for key in keys if len(c.shape(key)) == len(out)]
    lp = Loops(outs=[lets], fixed={lets[d]})
    for key in keys:
        lp.ins[key] = list(lets) if key in full else [None] * len(c.shape(key))
    extra = []
    if full and len(full) == len(keys) and len({c.shape(key)[d] for key in full}) == 1:
        n = len(keys)
        for q in (1, *c.parts):
            extra.append(Cand({key: Split(d, q) for key in keys}, [Split(d, n * q)], f"cat of {n} splits -> strided {d}:{n * q}"))
    return lp, extra


@family("layer_norm")
def layer_norm(c, input, normalized_shape, weight, bias):
    rank = len(c.shape(c.tensor(input)))
    lead = rank - len(c.value(normalized_shape))
    lets = letters(rank)
    stat = lets[:lead] + [None] * (rank - lead)
    lp = Loops(ins={c.tensor(input): lets}, outs=[lets, stat, stat], fixed=set(lets[lead:]))
    return lp, []


@family("layer_norm_backward")
def layer_norm_backward(c, grad_out, input, normalized_shape, mean, rstd, weight, bias):
    rank = len(c.shape(c.tensor(input)))
    lead = rank - len(c.value(normalized_shape))
    lets = letters(rank)
    stat = lets[:lead] + [None] * (rank - lead)
    # an output the backward does not need (output_mask) is an empty placeholder: it has no dims
    outs = [dims if len(c.out_shape(i)) == len(dims) else [] for i, dims in
            enumerate([lets, [None] * (rank - lead), [None] * (rank - lead)])]
    lp = Loops(ins={c.tensor(grad_out): lets, c.tensor(input): lets, c.tensor(mean): stat, c.tensor(rstd): stat},
               outs=outs, reduce={x: "sum" for x in lets[:lead]}, fixed=set(lets[lead:]))
    return lp, []


def _attn_loops(c, qs, ks, mask, dropout_p, is_causal, outs, t_reduce: bool):
    if c.value(dropout_p):
        return Loops(), False  # random dropout: each rank would draw another mask
    lp = Loops(fixed={"s", "d"} | ({"t"} if c.value(is_causal) else set()))
    for a in qs:
        if c.tensor(a):
            lp.ins[c.tensor(a)] = list("bhtd")[:len(c.shape(c.tensor(a)))]
    for a in ks:
        lp.ins[c.tensor(a)] = list("bhsd")
    if c.tensor(mask):
        m = c.shape(c.tensor(mask))
        lp.ins[c.tensor(mask)] = list("bhts")[4 - len(m):]
    lp.outs = [list(o) for o in outs]
    if t_reduce:
        lp.reduce = {"t": "sum"}
    return lp, True


@family("attention")
def attention(c, query, key, value, attn_mask, dropout_p, is_causal):
    lp, _ = _attn_loops(c, [query], [key, value], attn_mask, dropout_p, is_causal, ["bhtd", "bht"], False)
    return lp, []


@family("attention_backward")
def attention_backward(c, grad_out, query, key, value, out, lse, attn_mask, dropout_p, is_causal):
    lp, _ = _attn_loops(c, [grad_out, query, out, lse], [key, value], attn_mask, dropout_p, is_causal,
                        ["bhtd", "bhsd", "bhsd"], True)
    return lp, []


def _gather_lets(c, self, dim, index):
    shp, idx = c.shape(c.tensor(self)), c.shape(c.tensor(index))
    d = norm_dim(c.value(dim), len(shp))
    lets = letters(len(idx))
    if len(idx) != len(shp):  # 0-d self with a 0-d index: nothing to split
        return None, []
    ins = [None if i == d or shp[i] != idx[i] else lets[i] for i in range(len(shp))]
    # off the gathered dim, index row i reads self row i: a shorter index dim cannot split alone
    fixed = {lets[i] for i in range(len(shp)) if i != d and shp[i] != idx[i]}
    return Loops(ins={c.tensor(self): ins, c.tensor(index): lets}, outs=[lets], fixed=fixed), []


family("gather")(_gather_lets)


@family("index")
def index(c, self, indices):
    vals = c.value(indices)
    if not all(isinstance(v, Ref) for v in vals):
        return None, []  # None entries (x[:, idx]): only B for now
    shp = c.shape(c.tensor(self))
    keys = [(indices.value, j) for j in range(len(vals))]
    br = max(len(c.shape(k)) for k in keys)
    lets = letters(br)
    rest = letters(len(shp) - len(vals), start=br)
    lp = Loops(ins={c.tensor(self): [None] * len(vals) + rest}, outs=[lets + rest])
    for k in keys:
        r = len(c.shape(k))
        lp.ins[k] = lets[br - r:]
    return lp, []
