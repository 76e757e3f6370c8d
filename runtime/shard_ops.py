"""Rank-aware compute kernels: the local half of ops whose vocab or class dim is split, and
the local block of a split ``arange``, the local shard of a random draw (``runtime.rng``).

Each kernel computes what its rank holds from its own shard and its mesh coordinate, and
never communicates; the compiler's boxing does the rest (a masked lookup gives a partial sum,
``P``, that an all-reduce or reduce-scatter completes). ``axis`` names the mesh axis (or the
axes, outermost first) the dim is split over; the rank's block of that dim starts at
``position * local_size``, where position folds the rank's coordinates on those axes in mesh
order, matching ``runtime.sharding.local_shard``.

``KERNELS`` maps op name -> ``fn(backend, *args, **kwargs)``; a backend binds its own
``backend.topology`` with ``functools.partial(fn, backend)``.
"""
from __future__ import annotations

import torch

from sbpc.runtime.rng import RANDOM_SHARD, random_shard

aten = torch.ops.aten


def _offset(backend, axis: str | list[str], local: int) -> int:
    topo = backend.topology
    pos = 0
    for a in [axis] if isinstance(axis, str) else axis:
        pos = pos * topo.size(a) + topo.index(a)
    return pos * local


def embedding_masked(backend, weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False, *, axis):
    """Rows of this rank's vocab block for the ids in its range, zeros elsewhere (a ``P`` value)."""
    n = weight.shape[0]
    local = indices - _offset(backend, axis, n)
    hit = (local >= 0) & (local < n)
    out = aten.embedding.default(weight, torch.where(hit, local, 0))
    return out * hit.unsqueeze(-1).to(out.dtype)


def embedding_dense_backward_masked(backend, grad_output, indices, num_weights, padding_idx, scale_grad_by_freq, *, axis):
    """This rank's ``num_weights`` rows of the embedding gradient (``S(0)``), from the full grad and ids."""
    off = _offset(backend, axis, num_weights)
    width = grad_output.shape[-1]
    ids = indices.reshape(-1)
    local = ids - off
    hit = (local >= 0) & (local < num_weights) & (ids != padding_idx)
    rows = local[hit]
    grad = grad_output.reshape(-1, width)[hit]
    if scale_grad_by_freq:
        counts = torch.bincount(rows, minlength=num_weights).to(grad.dtype)
        grad = grad / counts[rows].unsqueeze(-1)
    out = torch.zeros(num_weights, width, dtype=grad_output.dtype, device=grad_output.device)
    return out.index_add_(0, rows, grad)


def _picked(self, target, weight, ignore_index, off):
    """(rows hit in this rank's class block, local class ids, per-row class weight, valid rows)."""
    n = self.shape[-1]
    valid = target != ignore_index
    local = target - off
    hit = valid & (local >= 0) & (local < n)
    w = weight[torch.where(valid, target, 0)] if weight is not None else torch.ones_like(target, dtype=self.dtype)
    w = torch.where(valid, w, torch.zeros_like(w))
    return hit, torch.where(hit, local, 0), w


def nll_loss_forward_masked(backend, self, target, weight, reduction, ignore_index, *, axis):
    """The loss terms of the targets in this rank's class block (``P``); total weight is global (``B``)."""
    hit, local, w = _picked(self, target, weight, ignore_index, _offset(backend, axis, self.shape[-1]))
    picked = self.gather(-1, local.unsqueeze(-1)).squeeze(-1) if self.dim() == 2 else self[local]
    terms = -picked * w * hit.to(self.dtype)
    total = w.sum().to(self.dtype)
    if reduction == 0 and self.dim() != 1:  # torch reports no total weight for a batch left unreduced
        return terms, torch.zeros((), dtype=self.dtype, device=self.device)
    if reduction == 0:
        return terms, total
    out = terms.sum()
    return (out / total if reduction == 1 else out), total


def nll_loss_backward_masked(backend, grad_output, self, target, weight, reduction, ignore_index, total_weight, *, axis):
    """The gradient columns of this rank's class block (``S(class)``)."""
    hit, local, w = _picked(self, target, weight, ignore_index, _offset(backend, axis, self.shape[-1]))
    g = -w * hit.to(self.dtype) * grad_output
    if reduction == 1:
        g = g / total_weight
    out = torch.zeros_like(self)
    if self.dim() == 1:
        return out.index_put_((local,), g, accumulate=True)
    return out.scatter_(-1, local.unsqueeze(-1), g.unsqueeze(-1).expand(-1, 1).clone())


def arange_shard(backend, *args, axis, parts=1, **kwargs):
    """This rank's block of ``arange(*args)`` split on dim 0 (``S(0)`` or strided ``S(0:parts)``).
    The range is made whole and cut, so every element equals the single-device one bit for bit
    (a float range computed from a shifted start could round differently); it is 1-D and
    small (positions), which makes that cheap."""
    from sbpc.runtime.sbp import Split
    from sbpc.runtime.sharding import owned, take_chunk

    topo = backend.topology
    pos, k = 0, 1
    for a in [axis] if isinstance(axis, str) else axis:
        pos, k = pos * topo.size(a) + topo.index(a), k * topo.size(a)
    op = (aten.arange.default, aten.arange.start, aten.arange.start_step)[len(args) - 1]
    return owned(take_chunk(op(*args, **kwargs), Split(0, parts), pos, k))


KERNELS = {
    "sbpc.arange_shard": arange_shard,
    "sbpc.embedding_masked": embedding_masked,
    "sbpc.embedding_dense_backward_masked": embedding_dense_backward_masked,
    "sbpc.nll_loss_forward_masked": nll_loss_forward_masked,
    "sbpc.nll_loss_backward_masked": nll_loss_backward_masked,
    RANDOM_SHARD: random_shard,
}
