"""Run on every rank by test_boxing: apply each planned boxing to a real sharded tensor."""
from __future__ import annotations

import torch

from sbpc.compiler.sbp.boxing_plan import plan_boxing
from sbpc.compiler.ir.types import TensorType
from sbpc.runtime.backend import make_backend
from sbpc.runtime.dist import init_distributed
from sbpc.runtime.sbp import Partial, Split, parse_nd_sbp
from sbpc.runtime.sharding import combine, take_chunk


def layout(x: torch.Tensor, nd, coords, sizes, seed: int) -> torch.Tensor:
    """This rank's value of logical ``x`` laid out as ``nd``; partial values are random summands
    (or, for P(max), one holder of the value and smaller values elsewhere), the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    for a, (s, i, k) in enumerate(zip(nd, coords, sizes)):
        if isinstance(s, Split):
            x = take_chunk(x, s, i, k)
        elif isinstance(s, Partial):
            noise = [torch.randn(x.shape, generator=gen) for _ in range(k)]
            if s.reduce == "max":
                x = x if i == 0 else x - noise[i].abs() - 0.1
            else:
                x = x - sum(noise[1:]) if i == 0 else noise[i]
    return x


def gather(backend, t: torch.Tensor, nd) -> torch.Tensor:
    comm, topo = backend.communicator, backend.topology
    for axis, s in reversed(list(zip(topo.sbp_axes, nd))):
        group = topo.group(axis)
        if len(group) == 1:
            continue
        pieces = list(comm.all_gather(t.contiguous(), group, 0).chunk(len(group), dim=0)) if t.dim() else None
        if isinstance(s, Split):
            t = combine(pieces, s)
        elif isinstance(s, Partial):
            t = combine(pieces, s)
    return t


def run(payload: dict) -> list[str]:
    axes = payload["axes"]
    comm = init_distributed(axes, timeout=60)
    backend = make_backend("cpu", comm, comm.topology)
    coords, sizes = comm.topology.sbp_coords(), comm.topology.sbp_sizes()
    failures = []
    shape = payload["shape"]
    x = torch.arange(float(torch.Size(shape).numel())).reshape(shape) / 7 - 3
    for n, (src_text, dst_text) in enumerate(payload["pairs"]):
        src, dst = parse_nd_sbp(src_text), parse_nd_sbp(dst_text)
        t = layout(x, src, coords, sizes, seed=n)
        steps = plan_boxing(src, dst, TensorType(tuple(shape), "f32"), sizes)
        for step in steps:
            t = backend.kernel(step.op)(t, axis=comm.topology.sbp_axes[step.axis], **dict(step.kwargs))
        got = gather(backend, t, dst)
        if not torch.allclose(got, x, atol=1e-5):
            failures.append(f"{src_text} -> {dst_text} via {[s.kind for s in steps]}")
    return failures
