"""Kernels of the collective and boxing instructions the compiler emits.

Each kernel takes the backend first (the CPU backend binds it with ``functools.partial``), so it
reaches ``backend.topology`` (which ranks form the group along ``axis``, and this rank's index
in it) and ``backend.communicator`` (the transport). Along an axis of size 1 every kernel is
the identity (``shard_slice`` / ``keep_first`` included), so one-device plans run unchanged.

Semantics, for one mesh axis of size n on which this rank has index i (other axes untouched;
``S(d:k)`` is the strided split of ``runtime.sbp``, laid out by ``runtime.sharding``):

``sbpc.all_reduce(x, axis, reduce="sum"|"max")``   P / P(max) -> B
    the elementwise sum (max) of x over the group.
``sbpc.all_gather(x, axis, dim, parts=1)``          S(dim:parts) -> B
    ``join_chunks([x_0 .. x_{n-1}], S(dim:parts))``: the logical tensor.
``sbpc.reduce_scatter(x, axis, dim, parts=1, reduce="sum")``   P -> S(dim:parts)
    ``take_chunk(sum_j x_j, S(dim:parts), i, n)``.
``sbpc.reduce_scatter_coalesced(xs, axis, dims, parts, reduce)`` / ``sbpc.all_gather_coalesced(xs, axis, dims, parts)``
    the same for a bucket of tensors, in one call (``all_reduce_coalesced`` likewise).
``sbpc.all_to_all(x, axis, src_dim, dst_dim, src_parts=1, dst_parts=1)``   S(src) -> S(dst)
    x is this rank's shard of L under ``S(src_dim:src_parts)``; the result is its shard of L
    under ``S(dst_dim:dst_parts)``, where L = ``join_chunks([x_0 .. x_{n-1}], S(src_dim:src_parts))``.
``sbpc.shard_slice(x, axis, dim, parts=1)``         B -> S(dim:parts), no communication
    ``take_chunk(x, S(dim:parts), i, n)``.
``sbpc.keep_first(x, axis, reduce="sum")``          B -> P, no communication
    x on index 0, zeros elsewhere (``reduce="max"``: the dtype's lowest value elsewhere), so
    the group's sum (max) is x.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

import torch

from sbpc.errors import PlanError
from sbpc.runtime.backend import Done, Work
from sbpc.runtime.kinds import ISSUE, WAIT, Collective
from sbpc.runtime.sbp import Partial, Split
from sbpc.runtime.sharding import join_chunks, owned, shard_of, take_chunk

if TYPE_CHECKING:
    from sbpc.runtime.backend import Backend


def axis_group(backend: Backend, axis: str) -> tuple[tuple[int, ...], int]:
    """(the global ranks along ``axis`` through this rank, this rank's index among them)."""
    if axis == "mb":  # micro-batches: a sequential axis; this rank is at the current one
        return tuple(range(backend.microbatches)), backend.microbatch
    topo = backend.topology
    if topo.axes and axis not in dict(topo.axes):
        raise PlanError(f"the plan communicates over mesh axis {axis!r}, which this mesh {dict(topo.axes)} lacks",
                        hint="the plan is corrupt or was compiled for another mesh; recompile it")
    return topo.group(axis), topo.index(axis)


def _dim(x: torch.Tensor, dim: int) -> int:
    return dim % x.dim() if x.dim() else dim


def _reduce(reduce: str) -> str:
    if reduce not in ("sum", "max"):
        raise PlanError(f"unknown reduction {reduce!r} in a collective", hint="reduce is 'sum' or 'max'")
    return reduce


# The communicating kernels are written once, as ``_start_<kind>``: the communicator's work
# plus what turns its result into the kernel's. The blocking kernel waits at once; ``issue``
# returns the work and ``wait`` finishes it where the plan's consumer needs the value.

class _Flight(Work):
    """A kernel's collective in flight: ``wait`` finishes it (splits a bucket, joins chunks)."""

    def __init__(self, work: Work, finish: Callable[[torch.Tensor], object]):
        self.work, self.finish = work, finish

    def wait(self):
        return self.finish(self.work.wait())


def _start_all_reduce(backend: Backend, x: torch.Tensor, axis: str, reduce: str = "sum", overwrite: bool = False) -> Work:
    """``overwrite``: the plan holds ``x`` for nothing else (the overlap pass proved it dies
    here and owns its storage), so the result may be written over it."""
    group, _ = axis_group(backend, axis)
    if len(group) == 1:
        return Done(x)
    if overwrite:
        return backend.communicator.start_all_reduce_over(x, group, _reduce(reduce))
    return backend.communicator.start("all_reduce", x, group, op=_reduce(reduce))


def _start_all_reduce_coalesced(backend: Backend, xs: list[torch.Tensor], axis: str, reduce: str = "sum") -> Work:
    """Several all-reduces in one call: the tensors travel as one flat buffer (one dtype), as
    DDP's gradient buckets do, so a step pays one latency instead of one per tensor."""
    group, _ = axis_group(backend, axis)
    if len(group) == 1:
        return Done(list(xs))
    # the flat copy is this kernel's own: reduced in place, it is the result buffer
    work = backend.communicator.start_all_reduce_over(torch.cat([x.reshape(-1) for x in xs]), group, _reduce(reduce))
    shapes, sizes = [x.shape for x in xs], [x.numel() for x in xs]  # not the inputs: they may die at the issue
    return _Flight(work, lambda flat: [piece.view(s) for piece, s in zip(flat.split(sizes), shapes)])


def _start_all_gather(backend: Backend, x: torch.Tensor, axis: str, dim: int, parts: int = 1) -> Work:
    group, _ = axis_group(backend, axis)
    if len(group) == 1:
        return Done(x)
    dim = _dim(x, dim)
    work = backend.communicator.start("all_gather", x, group, dim=dim)
    if parts == 1:
        return work
    return _Flight(work, lambda out: join_chunks(list(out.chunk(len(group), dim=dim)), Split(dim, parts)))


def _arrange(x: torch.Tensor, s: Split, n: int) -> torch.Tensor:
    """``x`` reordered along ``s.dim`` so that its j-th contiguous n-th is ``take_chunk(x, s, j, n)``."""
    if s.parts == 1:
        return x
    return torch.cat([take_chunk(x, s, j, n) for j in range(n)], dim=s.dim)


def _start_reduce_scatter(backend: Backend, x: torch.Tensor, axis: str, dim: int, parts: int = 1,
                          reduce: str = "sum") -> Work:
    group, _ = axis_group(backend, axis)
    if len(group) == 1:
        return Done(x)
    dim = _dim(x, dim)
    return backend.communicator.start("reduce_scatter", _arrange(x, Split(dim, parts), len(group)), group, dim=dim,
                                      op=_reduce(reduce))


def _start_reduce_scatter_coalesced(backend: Backend, xs: list[torch.Tensor], axis: str, dims: list[int],
                                    parts: list[int], reduce: str = "sum") -> Work:
    """Several reduce-scatters in one call (a bucket of ZeRO gradients): rank j's chunk of every
    tensor goes into the j-th n-th of one flat buffer, which is reduce-scattered."""
    group, index = axis_group(backend, axis)
    n = len(group)
    if n == 1:
        return Done(list(xs))
    splits = [Split(_dim(x, d), k) for x, d, k in zip(xs, dims, parts)]
    chunks = [[take_chunk(x, s, j, n) for x, s in zip(xs, splits)] for j in range(n)]
    flat = torch.cat([c.reshape(-1) for per_rank in chunks for c in per_rank])
    work = backend.communicator.start("reduce_scatter", flat, group, dim=0, op=_reduce(reduce))
    shapes, sizes = [c.shape for c in chunks[index]], [c.numel() for c in chunks[index]]
    return _Flight(work, lambda got: [piece.view(s) for piece, s in zip(got.split(sizes), shapes)])


def _start_all_gather_coalesced(backend: Backend, xs: list[torch.Tensor], axis: str, dims: list[int],
                                parts: list[int]) -> Work:
    """Several all-gathers in one call (a bucket of updated ZeRO shards): this rank's shards
    travel as one flat buffer; each tensor is joined from every rank's piece of it."""
    group, _ = axis_group(backend, axis)
    n = len(group)
    if n == 1:
        return Done(list(xs))
    work = backend.communicator.start("all_gather", torch.cat([x.reshape(-1) for x in xs]), group, dim=0)
    shapes, sizes = [x.shape for x in xs], [x.numel() for x in xs]  # not the inputs: they may die at the issue
    splits = [Split(_dim(x, d), k) for x, d, k in zip(xs, dims, parts)]

    def finish(flat):
        per_rank = [piece.split(sizes) for piece in flat.chunk(n)]
        return [join_chunks([per_rank[j][t].view(shape) for j in range(n)], split)
                for t, (shape, split) in enumerate(zip(shapes, splits))]
    return _Flight(work, finish)


_STARTS = {
    Collective.ALL_REDUCE: _start_all_reduce,
    Collective.ALL_REDUCE_COALESCED: _start_all_reduce_coalesced,
    Collective.ALL_GATHER: _start_all_gather,
    Collective.ALL_GATHER_COALESCED: _start_all_gather_coalesced,
    Collective.REDUCE_SCATTER: _start_reduce_scatter,
    Collective.REDUCE_SCATTER_COALESCED: _start_reduce_scatter_coalesced,
}
ISSUABLE = frozenset(_STARTS)  # the kinds ``sbpc.issue`` can start
_KINDS = {c.value for c in Collective}


def _blocking(start):
    def kernel(backend, *args, **kwargs):
        return start(backend, *args, **kwargs).wait()
    kernel.__name__ = kernel.__qualname__ = start.__name__.removeprefix("_start_")
    kernel.__doc__ = start.__doc__
    return kernel


all_reduce = _blocking(_start_all_reduce)
all_reduce_coalesced = _blocking(_start_all_reduce_coalesced)
all_gather = _blocking(_start_all_gather)
all_gather_coalesced = _blocking(_start_all_gather_coalesced)
reduce_scatter = _blocking(_start_reduce_scatter)
reduce_scatter_coalesced = _blocking(_start_reduce_scatter_coalesced)


def issue(backend: Backend, x, kind: str, **kwargs) -> Work:
    """``sbpc.issue(x, kind=..., **kwargs)``: the collective ``sbpc.<kind>(x, **kwargs)`` started
    without waiting; ``sbpc.wait`` of the result gives what ``sbpc.<kind>`` would have."""
    c = Collective(kind) if kind in _KINDS else None
    if c not in _STARTS:
        raise PlanError(f"sbpc.issue cannot start {kind}", hint="the plan is corrupt; recompile it")
    return _Issued(_STARTS[c](backend, x, **kwargs), kind, kwargs.get("axis", ""), time.time())


class _Issued(Work):
    def __init__(self, work: Work, kind: str, axis: str, at: float):
        self.work, self.kind, self.axis, self.at = work, kind, axis, at

    def wait(self):
        return self.work.wait()


def wait(backend: Backend, work: _Issued):
    """``sbpc.wait(%w)``: the result of the collective that ``sbpc.issue`` started as ``%w``."""
    out = work.wait()
    backend.flights.append((work.kind, work.axis, work.at, time.time()))
    return out


def all_to_all(backend: Backend, x: torch.Tensor, axis: str, src_dim: int, dst_dim: int,
               src_parts: int = 1, dst_parts: int = 1) -> torch.Tensor:
    group, index = axis_group(backend, axis)
    n = len(group)
    if n == 1:
        return x
    src, dst = Split(_dim(x, src_dim), src_parts), Split(_dim(x, dst_dim), dst_parts)
    if src == dst:
        return x
    if src.dim == dst.dim:  # re-blocking one dim: the pieces do not commute with the split; gather
        return owned(take_chunk(all_gather(backend, x, axis, src.dim, src.parts), dst, index, n))
    # piece i -> j is take_chunk(x_i, dst, j): slicing dst.dim commutes with assembling src.dim
    got = backend.communicator.all_to_all(_arrange(x, dst, n), group, dst.dim, src.dim)
    if src.parts == 1:
        return got
    return join_chunks(list(got.chunk(n, dim=src.dim)), src)


def shard_slice(backend: Backend, x: torch.Tensor, axis: str, dim: int, parts: int = 1) -> torch.Tensor:
    group, index = axis_group(backend, axis)
    if len(group) == 1:
        return x
    return owned(take_chunk(x, Split(_dim(x, dim), parts), index, len(group)))


def keep_first(backend: Backend, x: torch.Tensor, axis: str, reduce: str = "sum") -> torch.Tensor:
    group, index = axis_group(backend, axis)
    if len(group) == 1:
        return x
    return shard_of(x, Partial(_reduce(reduce)), index, len(group))


def to_host(backend: Backend, x: torch.Tensor) -> torch.Tensor:
    """Optimizer offload: a copy of ``x`` in host memory (the backend's primitive; pinned on cuda)."""
    return backend.to_host(x)


def to_device(backend: Backend, x: torch.Tensor) -> torch.Tensor:
    """A copy of host tensor ``x`` in this rank's device memory."""
    return backend.to_device(x)


_KERNEL = {
    Collective.ALL_REDUCE: all_reduce,
    Collective.ALL_REDUCE_COALESCED: all_reduce_coalesced,
    Collective.ALL_GATHER: all_gather,
    Collective.ALL_GATHER_COALESCED: all_gather_coalesced,
    Collective.REDUCE_SCATTER: reduce_scatter,
    Collective.REDUCE_SCATTER_COALESCED: reduce_scatter_coalesced,
    Collective.ALL_TO_ALL: all_to_all,
    Collective.SHARD_SLICE: shard_slice,
    Collective.KEEP_FIRST: keep_first,
    Collective.TO_HOST: to_host,
    Collective.TO_DEVICE: to_device,
}
KERNELS = {c.op: _KERNEL[c] for c in Collective}  # by op name; a kind without a kernel fails here
KERNELS.update({ISSUE: issue, WAIT: wait})
