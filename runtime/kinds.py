"""The named kinds the compiler and the runtime share, one enum each (no heavy imports, so the
command line can use them before it loads anything)."""
from __future__ import annotations

import enum


class ScheduleName(enum.StrEnum):
    """The pipeline schedules sbpc derives (``compiler/pipelining/schedule_sim.py``)."""
    ONE_F_ONE_B = "1f1b"
    GPIPE = "gpipe"
    INTERLEAVED = "interleaved"  # Megatron's interleaved 1F1B over virtual stages

    @classmethod
    def names(cls) -> str:
        return ", ".join(s.value for s in cls)


class Collective(enum.StrEnum):
    """The boxing ops: ``sbpc.<kind>`` in the IR and the plan, kernels in ``collectives.py``."""
    ALL_REDUCE = "all_reduce"  # P -> B
    ALL_REDUCE_COALESCED = "all_reduce_coalesced"  # a gradient bucket: one call for many tensors
    ALL_GATHER = "all_gather"  # S -> B
    ALL_GATHER_COALESCED = "all_gather_coalesced"  # a bucket of updated ZeRO shards gathered in one call
    REDUCE_SCATTER = "reduce_scatter"  # P -> S
    REDUCE_SCATTER_COALESCED = "reduce_scatter_coalesced"  # a bucket of ZeRO gradients: one call
    ALL_TO_ALL = "all_to_all"  # S(i) -> S(j)
    SHARD_SLICE = "shard_slice"  # B -> S, local
    KEEP_FIRST = "keep_first"  # B -> P, local
    TO_HOST = "to_host"  # device memory -> host memory, same SBP (optimizer offload)
    TO_DEVICE = "to_device"  # host memory -> device memory, same SBP

    @property
    def op(self) -> str:
        return f"sbpc.{self.value}"

    @property
    def moves_data(self) -> bool:
        """Whether it communicates (the others stay on the device)."""
        return self not in (Collective.SHARD_SLICE, Collective.KEEP_FIRST)

    @property
    def memory_after(self) -> MemoryKind | None:
        """Where a memory transfer leaves its result (None: not a transfer, it stays where it is)."""
        return {Collective.TO_HOST: MemoryKind.HOST, Collective.TO_DEVICE: MemoryKind.DEVICE}.get(self)

    @property
    def single(self) -> Collective:
        """The one-tensor kind a bucket fuses (itself for a one-tensor kind)."""
        return _SINGLE.get(self, self)

    @classmethod
    def of(cls, op: str) -> Collective | None:
        """The kind of op name ``op`` (``"sbpc.all_gather"``), None for any other op."""
        return _BY_OP.get(op)


_BY_OP = {c.op: c for c in Collective}
_SINGLE = {Collective.ALL_REDUCE_COALESCED: Collective.ALL_REDUCE, Collective.ALL_GATHER_COALESCED: Collective.ALL_GATHER,
           Collective.REDUCE_SCATTER_COALESCED: Collective.REDUCE_SCATTER}
COALESCED = {v: k for k, v in _SINGLE.items()}  # one-tensor kind -> its bucket kind


# A collective issued without waiting and the point where its result is needed (``overlap``
# pass): ``%w = sbpc.issue(x, kind="all_reduce_coalesced", ...) : work[]``, then
# ``%a, %b = sbpc.wait(%w)`` gives what ``sbpc.all_reduce_coalesced(x, ...)`` would have.
ISSUE = "sbpc.issue"
WAIT = "sbpc.wait"


class MemoryKind(enum.StrEnum):
    """Which memory a placement's values live in (``--offload optimizer`` puts the optimizer's
    state and update on the host; everything else is on the device)."""
    DEVICE = "device"
    HOST = "host"


class Precision(enum.StrEnum):
    """Compute precision (``--precision``); master weights and optimizer state stay fp32."""
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"  # with dynamic loss scaling


class Recompute(enum.StrEnum):
    """Activation recompute (``--recompute``): what the backward recomputes instead of keeping."""
    NONE = "none"
    SELECTIVE = "selective"  # Korthikanti et al. 2022: keep matmul outputs, recompute the cheap memory-heavy ops
    FULL = "full"  # keep each layer's input, recompute the layer
    AUTO = "auto"  # the least recompute that fits --device-memory
