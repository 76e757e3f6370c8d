"""How to turn one nd-SBP into another: the steps, each one collective on one mesh axis.

Shared by the propagation pass (to price a conversion) and the boxing pass (to emit it), so
what is priced is what is emitted. Per axis (the DESIGN table):

    P -> B  all_reduce          S -> B     all_gather       S(i) -> S(j)  all_to_all
    P -> S  reduce_scatter      B -> S     shard_slice      B -> P        keep_first
    P(max) -> B  all_reduce(max)

Axes are independent when no tensor dim is split by two different axes across source and
target; then each axis converts directly. Otherwise (nested splits of one dim) the safe route
gathers axis by axis from the innermost out, then splits from the outermost in. Axes of size
one never reach here: propagation keeps every value ``B`` on them.
"""
from __future__ import annotations

from dataclasses import dataclass

from sbpc.compiler.ir.types import TensorType
from sbpc.errors import CompileError
from sbpc.runtime.kinds import Collective
from sbpc.runtime.sbp import Broadcast, NdSbp, Partial, Sbp, Split


@dataclass(frozen=True)
class Step:
    axis: int  # index into the mesh's SBP axes
    kind: Collective
    kwargs: tuple[tuple[str, object], ...]
    after: NdSbp  # the nd-SBP once this step is done

    @property
    def op(self) -> str:
        return self.kind.op


def plan_boxing(src: NdSbp, dst: NdSbp, t: TensorType, sizes: tuple[int, ...],
                sequential: frozenset[int] = frozenset()) -> list[Step]:
    """``sequential``: the micro-batch axis, whose steps (accumulating over micro-batches) come
    first, so that the other axes' run once a step, not once a micro-batch."""
    if src == dst:
        return []
    if _independent(src, dst):
        steps, cur = [], src
        for a in _axis_order(src, dst, sequential):
            for kind, kw, to in _one_axis(src[a], dst[a]):
                cur = _set(cur, a, to)
                steps.append(Step(a, kind, kw, cur))
        return steps
    steps, cur = [], src
    for a in reversed(range(len(src))):  # innermost first: undo nested splits from the inside
        if not _keeps(src, dst, a) and not isinstance(cur[a], Broadcast):
            for kind, kw, to in _one_axis(cur[a], Broadcast()):
                cur = _set(cur, a, to)
                steps.append(Step(a, kind, kw, cur))
    for a in range(len(src)):
        if cur[a] != dst[a]:
            for kind, kw, to in _one_axis(cur[a], dst[a]):
                cur = _set(cur, a, to)
                steps.append(Step(a, kind, kw, cur))
    return steps


def _axis_order(src: NdSbp, dst: NdSbp, sequential: frozenset[int]) -> list[int]:
    """The order in which independent axes convert: any order gives the same tensor, but not
    the same bytes. The axes that shrink the local tensor (reduce-scatter, slice) go first,
    innermost first, so that the outer axis (dp, across nodes) moves the smallest tensor; the
    axes that grow it (gathers) go last, outermost first, for the same reason; the rest
    (all-reduce, all-to-all) in between, on the shrunk tensor. A gradient reduce-scattered over
    dp and tp thus crosses the nodes at 1/tp of its size. Partials of different reductions
    (sum and max) do not commute: they keep the mesh order. The ``sequential`` axes come first."""
    if len({s.reduce for s in src if isinstance(s, Partial)}) > 1:
        return list(range(len(src)))

    def phase(a: int) -> int:
        kinds = {k for k, _, _ in _one_axis(src[a], dst[a])}
        if Collective.ALL_GATHER in kinds:
            return 2
        return 0 if kinds & {Collective.REDUCE_SCATTER, Collective.SHARD_SLICE} else 1

    axes = range(len(src))
    return sorted(axes, key=lambda a: (a not in sequential, phase(a), -a if phase(a) == 0 else a))


# On a sequential axis (micro-batches) only a reduction (accumulation across the step's
# micro-batches) or a local slice / mask can run: anything that needs several micro-batches
# at once inside a micro-batch would stall the pipeline.
SEQUENTIAL_STEPS = frozenset({Collective.ALL_REDUCE, Collective.SHARD_SLICE, Collective.KEEP_FIRST})


def boxing_cost(src: NdSbp, dst: NdSbp, t: TensorType, sizes: tuple[int, ...], model,
                sequential: frozenset[int] = frozenset(), bucketed: frozenset[int] = frozenset(),
                microbatches: int = 1, step_read: bool = False) -> float:
    """Seconds the conversion takes a step under ``model``; infinite where no boxing exists
    (into P(max)) or where it would exchange data between micro-batches (``sequential`` axes).
    ``bucketed``: the axes on which ``t``'s reductions join a gradient bucket that is made
    anyway (``model.bucketed``); on the others each is a call of its own.

    How often each step runs (``schedule`` gives the micro-batch axis its meaning): a step on
    the micro-batch axis is a pass of every micro-batch over its part (the accumulation of a
    gradient: an add per micro-batch), not a collective; a step on a value that differs per
    micro-batch (split or partial on that axis) runs once per micro-batch; on a value that is
    whole for the step, once a step when it was just accumulated (the optimizer's phase) or
    only the optimizer reads it (``step_read``), else once per micro-batch (the forward and
    backward read a parameter). ``microbatches``: the micro-batch axis's size in this search."""
    try:
        steps = plan_boxing(src, dst, t, sizes, sequential)
    except CompileError:
        return float("inf")
    m = microbatches
    per_mb = lambda nd: any(not isinstance(nd[a], Broadcast) for a in sequential)
    # accumulated over the micro-batches, the rest runs in the optimizer's phase
    whole = 1 if step_read or (per_mb(src) and not per_mb(dst)) else m
    cost, cur = 0.0, src
    for s in steps:
        if s.axis in sequential and s.kind not in SEQUENTIAL_STEPS:
            return float("inf")
        nbytes = t.local_nbytes(cur, sizes)
        if s.axis in sequential:
            cost += m * model.compute(nbytes)
        elif s.axis in bucketed and s.kind in _BUCKETED:
            cost += (m if per_mb(cur) else whole) * model.bucketed(s.kind, nbytes, sizes[s.axis])
        else:
            cost += (m if per_mb(cur) else whole) * model.collective(s.kind, nbytes, sizes[s.axis])
        cur = s.after
    return cost


_BUCKETED = frozenset({Collective.ALL_REDUCE, Collective.REDUCE_SCATTER})  # what coalesce fuses in the backward


def _keeps(src: NdSbp, dst: NdSbp, a: int) -> bool:
    """Whether axis ``a`` can stay as it is while the others convert: it already has the
    target SBP, and no outer axis that splits the same dim (in source or target) changes,
    because a nested split is a split of the outer axis's chunk."""
    if src[a] != dst[a]:
        return False
    if not isinstance(src[a], Split):
        return True
    d = src[a].dim
    return all(src[c] == dst[c] for c in range(a)
               if any(isinstance(x, Split) and x.dim == d for x in (src[c], dst[c])))


def _set(nd: NdSbp, a: int, s: Sbp) -> NdSbp:
    return nd[:a] + (s,) + nd[a + 1:]


def _shared_dims(src: NdSbp, dst: NdSbp) -> set[int]:
    """Tensor dims that more than one axis splits, in the source or the target."""
    by_dim: dict[int, set[int]] = {}
    for nd in (src, dst):
        for a, s in enumerate(nd):
            if isinstance(s, Split):
                by_dim.setdefault(s.dim, set()).add(a)
    return {d for d, axes in by_dim.items() if len(axes) > 1}


def _independent(src: NdSbp, dst: NdSbp) -> bool:
    return not _shared_dims(src, dst)


def _split_kw(prefix: str, s: Split) -> tuple:
    return ((f"{prefix}dim", s.dim), (f"{prefix}parts", s.parts))


def _one_axis(a: Sbp, b: Sbp) -> list[tuple[Collective, tuple, Sbp]]:
    """The steps that convert one axis from ``a`` to ``b``: (kind, kwargs, result)."""
    if a == b:
        return []
    if isinstance(a, Partial):
        if isinstance(b, Broadcast):
            return [(Collective.ALL_REDUCE, (("reduce", a.reduce),), b)]
        if isinstance(b, Split) and a.reduce == "sum":
            return [(Collective.REDUCE_SCATTER, (("dim", b.dim), ("parts", b.parts), ("reduce", "sum")), b)]
        return _one_axis(a, Broadcast()) + _one_axis(Broadcast(), b)
    if isinstance(a, Split):
        if isinstance(b, Broadcast):
            return [(Collective.ALL_GATHER, (("dim", a.dim), ("parts", a.parts)), b)]
        if isinstance(b, Split) and a.dim != b.dim:
            return [(Collective.ALL_TO_ALL, _split_kw("src_", a) + _split_kw("dst_", b), b)]
        return _one_axis(a, Broadcast()) + _one_axis(Broadcast(), b)
    # a is B
    if isinstance(b, Split):
        return [(Collective.SHARD_SLICE, (("dim", b.dim), ("parts", b.parts)), b)]
    if isinstance(b, Partial) and b.reduce == "sum":
        return [(Collective.KEEP_FIRST, (), b)]
    raise CompileError(f"no boxing converts {a!r} into {b!r}", hint="this is a bug in an SBP rule; report it")
