"""memory-plan: liveness of every value and the per-device memory estimate.

The lowering frees each value right after its last use; this pass computes the same
liveness to estimate the peak of live activations, records the sizes of params, gradients
and optimizer state, and the estimate of every rank role (``compiler/memory/estimate.py``:
each pp stage's peak with its in-flight micro-batches, by term) in the context's estimates:
all per device (shards, not logical tensors).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from sbpc.compiler.ir.aten import overwritten
from sbpc.compiler.memory.estimate import estimate_memory
from sbpc.compiler.pass_manager import Fact
from sbpc.compiler.ir.types import Graph, InputKind, OutputKind
from sbpc.runtime.kinds import MemoryKind


def _device_bytes(graph: Graph, sizes: tuple[int, ...]) -> dict[str, int]:
    """Bytes each device holds of every value: its shard, once SBP is known (none of a value in
    host memory: the offloaded optimizer's)."""
    out = {i.value: i.type.local_nbytes(i.sbp, sizes) if i.memory == MemoryKind.DEVICE else 0 for i in graph.inputs}
    for n in graph.nodes:
        for o, t, nd in zip(n.outputs, n.types, n.sbp or [None] * len(n.outputs)):
            out[o] = t.local_nbytes(nd, sizes) if n.memory == MemoryKind.DEVICE else 0
    return out


def last_uses(graph: Graph) -> dict[int, list[str]]:
    """Node index -> values that die right after it (graph outputs never die)."""
    keep = {o.value for o in graph.outputs} | {i.value for i in graph.inputs}
    last: dict[str, int] = {}
    for idx, n in enumerate(graph.nodes):
        for v in n.uses():
            last[v] = idx
        for o in n.outputs:
            last.setdefault(o, idx)  # a result nobody reads dies where it is born
    out: dict[int, list[str]] = {}
    for v, idx in last.items():
        if v not in keep:
            out.setdefault(idx, []).append(v)
    for vals in out.values():
        vals.sort()
    return out


@dataclass
class MemoryPlan:
    name: str = "memory-plan"
    needs: ClassVar[tuple[Fact, ...]] = (Fact.SBP,)
    provides: ClassVar[tuple[Fact, ...]] = (Fact.ESTIMATES,)

    def apply(self, graph: Graph, ctx) -> Graph:
        sizes = tuple(graph.mesh.size(a) for a in graph.mesh.sbp_axes)
        nbytes = _device_bytes(graph, sizes)
        dies = last_uses(graph)
        live = peak = 0
        for idx, n in enumerate(graph.nodes):
            if not overwritten(n):  # an in-place result is the storage it overwrote
                live += sum(nbytes[o] for o in n.outputs)
            peak = max(peak, live)
            live -= sum(nbytes[v] for v in dies.get(idx, ()) if v in nbytes)
        params = graph.inputs_of(InputKind.PARAM)
        ctx.estimates.update(
            param_count=sum(p.type.numel for p in params),
            param_bytes=sum(nbytes[p.value] for p in params),
            grad_bytes=sum(nbytes[o.value] for o in graph.outputs_of(OutputKind.GRAD)),
            optimizer_state_bytes=sum(nbytes[s.value] for s in graph.inputs_of(InputKind.STATE)),
            peak_activation_bytes=peak,
            instructions=len(graph.nodes),
            roles=estimate_memory(graph),
        )
        return graph
