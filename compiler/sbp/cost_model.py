"""Cost models for SBP propagation: what a collective and an op cost, in seconds.

A cost model is a parameter of the propagation pass, never hard-wired. ``AlphaBeta`` is the
classic latency-bandwidth model of ring collectives over k devices (alpha per step, beta per
byte) plus a fixed cost per collective call, and a memory-bound compute term (gamma per byte
an op touches). The per-call cost is why one all-reduce beats the reduce-scatter +
all-gather pair that moves the same bytes, unless the pair saves real compute in between.

Memory is priced too, as a Lagrangian weight: ``memory_price`` seconds per byte a device holds
from the forward to the backward (activations saved for the backward, per in-flight
micro-batch). At 0 (the default) the search minimises time alone. Under ``--device-memory`` the
driver raises the price along ``MEMORY_PRICES`` until the plan fits (``compiler/driver.py``):
the price is the policy, the solver only adds ``memory(bytes)`` to what it minimises.

``ClusterCost`` is the model of a described cluster (FLOPs and bytes per op over the device's
peaks, collectives over the links the rank map puts each group on); ``sbpc simulate`` runs
plans over it (compiler/tools/simulate.py, docs/cost_model.md), and ``sbpc compile --cluster``
plans with it.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from sbpc.runtime.kinds import Collective

if TYPE_CHECKING:
    from sbpc.compiler.sbp.op_work import Kernel, Operand
    from sbpc.compiler.tools.cluster import AxisGroups, Cluster


class CostModel(Protocol):
    def collective(self, kind: Collective, nbytes: int, k: int) -> float:
        """``kind`` of the boxing step; ``nbytes``: the bytes each device holds before it."""

    def compute(self, nbytes: int) -> float:
        """An op that reads and writes ``nbytes`` on each device."""

    def op(self, op: str, ins: Sequence["Operand"], outs: Sequence["Operand"], dtype: str) -> float:
        """The kernels of ``op`` on each device, given its local tensor inputs and outputs."""

    def transfer(self, nbytes: int) -> float:
        """A send/recv of ``nbytes`` between pipeline stages (matching ranks)."""

    def bucketed(self, kind: Collective, nbytes: int, k: int) -> float:
        """``kind`` as a member of a gradient bucket that is made anyway: fused with the others
        into one call (``coalesce``) and issued while the backward continues (``overlap``)."""

    def memory(self, nbytes: int) -> float:
        """Holding ``nbytes`` on each device from the forward to the backward (0: memory is free)."""


@dataclass(frozen=True)
class AlphaBeta:
    alpha: float = 20e-6  # s per ring step (latency)
    launch: float = 50e-6  # s per collective call (launch, synchronisation): favours fewer, larger ones
    beta: float = 1 / 10e9  # s per byte over a link
    gamma: float = 1 / 200e9  # s per byte touched by a kernel
    # s per byte between pipeline stages: stages sit on different nodes, whose link is slower
    # than the one inside a tensor-parallel group
    stage_beta: float = 4 / 10e9
    memory_price: float = 0.0  # s per byte held for the backward (the Lagrangian weight of memory)

    def collective(self, kind: Collective, nbytes: int, k: int) -> float:
        a, b, c = self.alpha, self.beta, self.launch
        if kind == Collective.ALL_REDUCE:
            return c + 2 * (k - 1) * a + 2 * (k - 1) / k * nbytes * b
        if kind == Collective.ALL_GATHER:
            return c + (k - 1) * a + (k - 1) * nbytes * b
        if kind in (Collective.REDUCE_SCATTER, Collective.ALL_TO_ALL):
            return c + (k - 1) * a + (k - 1) / k * nbytes * b
        if kind in (Collective.SHARD_SLICE, Collective.KEEP_FIRST):
            return self.gamma * nbytes  # local: no link, a copy at most
        raise ValueError(f"unknown boxing step {kind}")

    def bucketed(self, kind: Collective, nbytes: int, k: int) -> float:
        # a bucket of up to 25 MB pays one call and one ring latency for all its members, so a
        # member pays its bytes alone; pricing it per call made the solver gather activations
        # (dozens of blocking calls a step) rather than all-reduce weight gradients (one bucket).
        # Only where the bucket's call is made anyway: on an axis that splits the data (the
        # batch; a hinted activation, as sequence parallelism's), whose replicated weights have
        # partial gradients (SolverState.bucket_axes). Elsewhere (Megatron's tp) a gradient is
        # partial only by the solver's choice, and its reduction pays a call:
        # priced at its bytes, Llama's RMSNorm weight gradients were left partial on tp (5
        # calls more than Megatron's none, at 0.4 us each instead of 90)
        return self.collective(kind, nbytes, k) - self.collective(kind, 0, k)

    def compute(self, nbytes: int) -> float:
        return self.gamma * nbytes

    def op(self, op: str, ins: Sequence["Operand"], outs: Sequence["Operand"], dtype: str) -> float:
        return self.compute(sum(t.nbytes for t in ins) + sum(t.nbytes for t in outs))  # bytes touched, views too

    def transfer(self, nbytes: int) -> float:
        return self.launch + self.alpha + nbytes * self.stage_beta

    def memory(self, nbytes: int) -> float:
        return self.memory_price * nbytes

    def priced(self, links: float) -> AlphaBeta:
        """This model with a byte held priced as ``links`` moves of it over a link (``links * beta``)."""
        return replace(self, memory_price=links * self.beta)


# The prices the driver tries under --device-memory, in link-moves per byte held (see AlphaBeta.priced),
# cheapest first: 0 is the time-optimal plan; 1 trades a collective for memory where they move
# the same bytes (at scale, Megatron's choice: keep the sequence-parallel input, gather it again
# in the backward); the steeper ones also outweigh the per-call costs of small tensors.
MEMORY_PRICES = (0.0, 1.0, 16.0, 256.0)


@dataclass(frozen=True)
class ClusterCost:
    """The cost model of a described cluster (``compiler/tools/cluster.py``) for a mesh.

    Kernels: the roofline of the op's work (``op_work``), ``max(flops / (peak x efficiency of
    its class), bytes / (memory bandwidth x memory efficiency))``; a GEMM on a device whose
    epilogue is serial (``Device.gemm_epilogue``) writes its result after that, at the same
    memory bandwidth. Collectives: ring (or,
    where latency wins, double binary tree) over the link the group really uses: the intra-node
    link for a group inside a node; the NIC for one whose members sit one per node; and for a
    group with several members on each of several nodes the hierarchical algorithm: a
    reduce-scatter inside the node, the all-reduce of a 1/local share across nodes (every
    device on its own NIC), an all-gather inside the node. ``mesh`` is in rank order."""
    cluster: "Cluster"
    mesh: tuple[tuple[str, int], ...]
    memory_price: float = 0.0

    @functools.cached_property
    def groups(self) -> dict[str, "AxisGroups"]:
        from sbpc.compiler.tools.cluster import axis_groups

        return axis_groups(list(self.mesh), self.cluster.node.devices)

    # ----- kernels
    def kernel(self, k: "Kernel", dtype: str) -> float:
        from sbpc.compiler.sbp.op_work import OpClass

        c, eff = self.cluster, self.cluster.efficiency
        bw = c.device.memory_bandwidth * eff.memory
        if k.klass == OpClass.MEMORY:
            return c.device.kernel_overhead + k.nbytes / bw
        share = eff.gemm if k.klass == OpClass.GEMM else eff.attention
        compute = k.flops / (c.peak(dtype) * share)
        if k.klass == OpClass.GEMM and c.device.gemm_epilogue == "serial":  # the result written after the main loop
            return c.device.kernel_overhead + max(compute, (k.nbytes - k.written) / bw) + k.written / bw
        return c.device.kernel_overhead + max(compute, k.nbytes / bw)

    # ----- links
    def _link(self, inter: bool) -> tuple[float, float]:
        """(bytes/s achieved, latency) of the intra-node link or the NIC."""
        c, eff = self.cluster, self.cluster.efficiency
        if inter:
            return c.network.bandwidth * eff.network / c.network.oversubscription, c.network.latency
        return c.node.link.bandwidth * eff.link, c.node.link.latency

    def _flat(self, kind: Collective, nbytes: float, n: int, inter: bool) -> float:
        """``kind`` over one ring of ``n`` devices on one link type; ``nbytes`` each holds before."""
        if n <= 1:
            return 0.0
        bw, lat = self._link(inter)
        if kind == Collective.ALL_REDUCE:
            ring = 2 * (n - 1) * lat + 2 * (n - 1) / n * nbytes / bw
            tree = 2 * math.ceil(math.log2(n)) * lat + 2 * nbytes / bw  # a double binary tree: latency log n
            return min(ring, tree)
        if kind == Collective.ALL_GATHER:
            return (n - 1) * lat + (n - 1) * nbytes / bw
        if kind in (Collective.REDUCE_SCATTER, Collective.ALL_TO_ALL):
            return (n - 1) * lat + (n - 1) / n * nbytes / bw
        raise ValueError(f"{kind} is not a collective over a ring")

    def on_axis(self, kind: Collective, nbytes: float, axis: str) -> float:
        """Seconds of ``kind`` (a one-tensor or bucket kind) over the groups of mesh axis ``axis``."""
        kind = kind.single
        if not kind.moves_data:  # a local slice or zero fill: one pass over the bytes
            return self.compute(nbytes)
        if kind.memory_after is not None:  # to or from host memory (offloaded optimizer)
            return nbytes / self.cluster.device.host_bandwidth
        g = self.groups[axis]
        return self._grouped(kind, nbytes, g.size, g.local, g.nodes)

    def _grouped(self, kind: Collective, nbytes: float, n: int, local: int, nodes: int) -> float:
        if nodes <= 1:
            return self._flat(kind, nbytes, n, inter=False)
        if local <= 1:
            return self._flat(kind, nbytes, n, inter=True)
        if kind == Collective.ALL_REDUCE:
            return (2 * self._flat(Collective.REDUCE_SCATTER, nbytes, local, False)
                    + self._flat(Collective.ALL_REDUCE, nbytes / local, nodes, True))
        if kind == Collective.ALL_GATHER:  # across nodes the shards of one local index, then inside the node
            return self._flat(Collective.ALL_GATHER, nbytes, nodes, True) + self._flat(Collective.ALL_GATHER, nbytes * nodes, local, False)
        if kind == Collective.REDUCE_SCATTER:
            return self._flat(Collective.REDUCE_SCATTER, nbytes, local, False) + self._flat(Collective.REDUCE_SCATTER, nbytes / local, nodes, True)
        # all-to-all: the share for other nodes over the NICs while the local share crosses the link
        return max(self._flat(Collective.ALL_TO_ALL, nbytes * (n - local) / n * nodes / (nodes - 1), nodes, True),
                   self._flat(Collective.ALL_TO_ALL, nbytes * local / n, local, False))

    def point_to_point(self, nbytes: float, axis: str = "pp") -> float:
        """A send/recv between matching ranks of neighbouring groups on ``axis`` (pipeline stages)."""
        g = self.groups.get(axis)
        bw, lat = self._link(inter=g is None or g.crosses_nodes)
        return lat + nbytes / bw

    # ----- the CostModel protocol (no axis named: a group of k is placed inside a node when it fits)
    def collective(self, kind: Collective, nbytes: int, k: int) -> float:
        if kind in (Collective.SHARD_SLICE, Collective.KEEP_FIRST):
            return self.compute(nbytes)
        d = self.cluster.node.devices
        return self._grouped(kind.single, nbytes, k, min(k, d), math.ceil(k / d))

    def bucketed(self, kind: Collective, nbytes: int, k: int) -> float:
        return self.collective(kind, nbytes, k) - self.collective(kind, 0, k)

    def compute(self, nbytes: int) -> float:
        return nbytes / (self.cluster.device.memory_bandwidth * self.cluster.efficiency.memory)

    def op(self, op: str, ins: Sequence["Operand"], outs: Sequence["Operand"], dtype: str) -> float:
        from sbpc.compiler.sbp.op_work import op_work

        return sum(self.kernel(k, dtype) for k in op_work(op, ins, outs))

    def priced(self, links: float) -> "ClusterCost":
        """This model with a byte held priced as ``links`` moves of it over the intra-node link
        (``AlphaBeta.priced``'s ladder, on this cluster's link)."""
        return replace(self, memory_price=links / self._link(inter=False)[0])

    def transfer(self, nbytes: int) -> float:
        return self.point_to_point(nbytes)

    def memory(self, nbytes: int) -> float:
        return self.memory_price * nbytes
