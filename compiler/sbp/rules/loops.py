"""The loop-nest view of an op, from which most SBP signatures follow.

An op is read as a loop nest over named loop letters (an einsum): every tensor dim is indexed
by one letter, or by none when it never splits (a broadcast, gathered or normalised dim).
Splitting a letter over the axis splits every dim that letter indexes, inputs and outputs
alike; an input without the letter is ``B``; an output without it gets the letter's
reduction (``P`` for a sum, ``P(max)`` for a max), and a letter that is neither carried by
every output nor reduced cannot split. Strided splits ``S(d:p)`` follow the same letters,
because the op treats every index of a loop the same way.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Hashable

from sbpc.errors import CompileError
from sbpc.runtime.sbp import Broadcast, Partial, Sbp, Split

Key = Hashable  # a tensor parameter name, or (name, position) for an element of a tensor list
Dims = list  # one loop letter (str) or None per tensor dim
B = Broadcast()


@dataclass
class Cand:
    """One candidate signature, by parameter key; keys not given are B."""

    ins: dict[Key, Sbp]
    outs: list[Sbp]
    note: str


@dataclass
class Loops:
    ins: dict[Key, Dims] = field(default_factory=dict)
    outs: list[Dims] = field(default_factory=list)
    reduce: dict[str, str] = field(default_factory=dict)  # letter -> "sum" | "max"
    fixed: set = field(default_factory=set)  # letters that never split
    free_out: bool = False  # an output may split a letter no input carries (the op is told its local shape)
    terms: dict = field(default_factory=dict)  # input key -> index of the added term it belongs to


def letters(n: int, start: int = 0) -> list[str]:
    return [chr(ord("a") + start + i) for i in range(n)]


def enumerate_loops(lp: Loops, in_shape, out_shape, parts: tuple[int, ...]) -> list[Cand]:
    """Every single-letter split of the nest, plain and strided."""
    order: list[str] = []
    for dims in [*lp.outs, *lp.ins.values()]:
        for x in dims:
            if x is not None and x not in order:
                order.append(x)
    cands = []
    for x in order:
        if x in lp.fixed:
            continue
        cin = [(key, d) for key, dims in lp.ins.items() for d, y in enumerate(dims) if y == x and in_shape(key)[d] != 1]
        cout = {}
        for i, dims in enumerate(lp.outs):
            for d, y in enumerate(dims):
                if y == x and out_shape(i)[d] != 1:
                    cout[i] = d
        if not cin and not (lp.free_out and cout):
            continue
        red = lp.reduce.get(x)
        if red is None and len(cout) < len(lp.outs):
            continue
        # a summed letter split: an added term that lacks it is partial too, not counted k times
        carried_terms = {lp.terms.get(key) for key, _ in cin}
        lacking = [key for key in lp.ins if key in lp.terms and lp.terms[key] not in carried_terms] if red else []
        for p in (1, *parts):
            ins = {key: Split(d, p) for key, d in cin} | {key: Partial(red) for key in lacking}
            outs = [Split(cout[i], p) if i in cout else Partial(red) for i in range(len(lp.outs))]
            note = f"split {x}" + (f":{p}" if p > 1 else "") + (f" -> {Partial(red)!r}" if len(cout) < len(lp.outs) else "")
            cands.append(Cand(ins, outs, note))
    return cands


def norm_dim(d: Any, rank: int) -> int | None:
    """The one place a dim argument becomes an index: negative dims count from the end, and a
    0-d tensor (which torch lets name dim 0 or -1) has no dim to index (None). Every family
    reads dims through here or ``dim_list``, so no rule can index a shape out of range."""
    if rank == 0:
        return None
    i = int(d) + rank if int(d) < 0 else int(d)
    if not 0 <= i < rank:
        raise CompileError(f"dim {d} is out of range for a tensor of {rank} dims")
    return i


def dim_list(v: Any, rank: int) -> list[int]:
    """A dim argument (int, list, None or [] = all dims) as sorted non-negative dims."""
    if v is None or (isinstance(v, (list, tuple)) and len(v) == 0):
        return list(range(rank))
    if isinstance(v, int):
        v = [v]
    return sorted({i for d in v if (i := norm_dim(d, rank)) is not None})


def view_groups(a: tuple[int, ...], b: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Factor two shapes of equal numel into groups of consecutive dims with equal products."""
    groups, i, j = [], 0, 0
    while i < len(a) or j < len(b):
        gi, gj, pa, pb = [], [], 1, 1
        if i < len(a):
            gi.append(i)
            pa, i = a[i], i + 1
        if j < len(b):
            gj.append(j)
            pb, j = b[j], j + 1
        while pa != pb:
            if pa < pb and i < len(a):
                gi.append(i)
                pa, i = pa * a[i], i + 1
            elif pb < pa and j < len(b):
                gj.append(j)
                pb, j = pb * b[j], j + 1
            else:
                return []  # not a view of equal numel: no split survives it
        groups.append((gi, gj))
    return groups


# A view keeps the row-major order of the elements, so a split is best read on the flattened
# tensor: ``S(d:q)`` of a shape cuts its flat index into ``prod(shape[:d]) * q`` equal blocks,
# each split over the axis, and a device holds its chunk of every block in block order (the
# dims after d ride along inside each chunk). Two splits, one of the view's input and one of its
# output, so lay the flat tensor out alike exactly when they have the same number of flat
# blocks (and each divides its own dim). A split of the batch inside a folded (seq, batch) dim:
# ``[L, B, E]`` ``S(1)`` <-> ``[L*B, E]`` ``S(0:L)``.

def flat_blocks(shape, s: Split) -> int:
    """How many blocks of the flattened tensor the split ``s`` of ``shape`` cuts."""
    return math.prod(shape[:s.dim]) * s.parts


def split_of_blocks(shape, blocks: int, k: int) -> Split | None:
    """The split of ``shape`` over ``k`` devices that cuts its flat index into ``blocks``
    blocks, if one does: a dim d whose leading dims make ``blocks`` whole blocks of it, each
    of which divides by ``k``. None when the chunks would straddle dims (not a split)."""
    for d, n in enumerate(shape):
        before = math.prod(shape[:d])
        if n != 1 and before and blocks % before == 0 and n % (blocks // before) == 0 and n // (blocks // before) % k == 0:
            return Split(d, blocks // before)
    return None


def view_nd_exact(a, b, in_nd, out_nd, sizes) -> bool:
    """Whether a view ``a -> b`` with these nd-SBPs is exact. Axes apply in order, each on the
    shard the earlier ones left, so each axis' splits must cut the same number of flat blocks
    of the local shapes: an earlier axis splitting a dim in front of a later axis' split dim
    changes that count (``[L, B, E]`` ``(S(0), S(1))`` is ``(S(0), S(0:L/k))`` of ``[L*B, E]``)."""
    la, lb = list(a), list(b)
    for si, so, k in zip(in_nd, out_nd, sizes):
        if k == 1 or not (isinstance(si, Split) or isinstance(so, Split)):
            continue
        if not (isinstance(si, Split) and isinstance(so, Split)) or flat_blocks(la, si) != flat_blocks(lb, so):
            return False
        la[si.dim] //= k
        lb[so.dim] //= k
    return True
