"""Cut a logical tensor into a device's shard, and put shards back together.

One implementation of the SBP layout, shared by the runtime (materialising parameters,
gathering results for `sbpc check`) and the compiler's rule validation, so the layout the
rules are proven against is the layout the ranks use.
"""
from __future__ import annotations

import torch

from sbpc.runtime.sbp import NdSbp, Partial, Sbp, Split


def take_chunk(t: torch.Tensor, s: Split, index: int, size: int) -> torch.Tensor:
    """Device ``index``'s chunk of ``t`` under split ``s`` over ``size`` devices."""
    if size == 1:
        return t
    n = t.shape[s.dim]
    block = n // s.parts
    chunk = block // size
    pieces = [t.narrow(s.dim, p * block + index * chunk, chunk) for p in range(s.parts)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=s.dim)


def join_chunks(chunks: list[torch.Tensor], s: Split) -> torch.Tensor:
    """Inverse of ``take_chunk``: the chunks of all devices, in axis order, back into one tensor."""
    if len(chunks) == 1:
        return chunks[0]
    if s.parts == 1:
        return torch.cat(chunks, dim=s.dim)
    per = [c.chunk(s.parts, dim=s.dim) for c in chunks]  # per device: its chunk of each block
    return torch.cat([per[d][p] for p in range(s.parts) for d in range(len(chunks))], dim=s.dim)


def shard_of(t: torch.Tensor, sbp: Sbp, index: int, size: int) -> torch.Tensor:
    """The shard of a replicated logical tensor that device ``index`` holds under ``sbp``.
    ``P`` keeps the value on device 0 and zeros elsewhere (``P(max)``: the lowest value)."""
    if isinstance(sbp, Split):
        return take_chunk(t, sbp, index, size)
    if isinstance(sbp, Partial) and index != 0:
        return torch.zeros_like(t) if sbp.reduce == "sum" else torch.full_like(t, _lowest(t.dtype))
    return t


def unpad(t: torch.Tensor, shape) -> torch.Tensor:
    """``t`` cut to ``shape`` from the start of each dim: the logical tensor of a ZeRO-padded
    optimizer state or gradient (compiler/passes/zero.py pads at the end with zeros)."""
    if tuple(t.shape) == tuple(shape):
        return t
    return t[tuple(slice(0, n) for n in shape)]


def pad_to(t: torch.Tensor, shape) -> torch.Tensor:
    """``t`` zero-padded at the end of each dim to ``shape`` (``unpad`` undoes it)."""
    if tuple(t.shape) == tuple(shape):
        return t
    out = t.new_zeros(tuple(shape))
    out[tuple(slice(0, n) for n in t.shape)] = t
    return out


def local_shard(t: torch.Tensor, nd: NdSbp, coords: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    """Device at ``coords`` (one index per SBP axis)'s shard of logical ``t``; axes apply in order."""
    for s, i, k in zip(nd, coords, sizes):
        t = shard_of(t, s, i, k)
    return owned(t)


def owned(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous in a storage of its own size. A chunk on a leading dim is a view whose
    storage is the whole tensor: held as a shard, it would keep all of the logical tensor
    (every other device's part) alive."""
    t = t.contiguous()
    return t.clone() if t.untyped_storage().nbytes() > t.numel() * t.element_size() else t


def combine(shards: list[torch.Tensor], sbp: Sbp) -> torch.Tensor:
    """The logical value of one axis' shards (in axis order) under ``sbp``."""
    if isinstance(sbp, Split):
        return join_chunks(shards, sbp)
    if isinstance(sbp, Partial):
        out = shards[0]
        for s in shards[1:]:
            out = out + s if sbp.reduce == "sum" else torch.maximum(out, s)
        return out
    return shards[0]


def _lowest(dtype: torch.dtype):
    return torch.finfo(dtype).min if dtype.is_floating_point else torch.iinfo(dtype).min if dtype != torch.bool else False



