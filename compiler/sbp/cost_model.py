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
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

from sbpc.runtime.kinds import Collective


class CostModel(Protocol):
    def collective(self, kind: Collective, nbytes: int, k: int) -> float:
        """``kind`` of the boxing step; ``nbytes``: the bytes each device holds before it."""

    def compute(self, nbytes: int) -> float:
        """An op that reads and writes ``nbytes`` on each device."""

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
