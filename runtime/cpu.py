"""The cpu backend: torch CPU kernels; across processes, gloo (``runtime.dist.GlooCommunicator``)."""
from __future__ import annotations

from functools import partial

import torch

from sbpc.runtime import collectives
from sbpc.runtime.backend import Backend, Communicator
from sbpc.runtime.host_memory import keep_freed_memory
from sbpc.runtime.topology import Topology

aten = torch.ops.aten


def _attention(q, k, v, dropout_p, is_causal, attn_mask=None, scale=None):
    return aten._scaled_dot_product_flash_attention_for_cpu.default(
        q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)


def _attention_backward(grad, q, k, v, out, lse, dropout_p, is_causal, attn_mask=None, scale=None):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
        grad, q, k, v, out, lse, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)


def constant(values, shape, dtype):
    return torch.tensor(values, dtype=dtype).reshape(shape)


class CpuBackend(Backend):
    name = "cpu"
    device = torch.device("cpu")

    def __init__(self, communicator: Communicator, topology: Topology | None = None):
        super().__init__(communicator, topology)
        # a step frees and reallocates the same sizes every time: keep them in the process
        # instead of faulting them in again each step (runtime/host_memory.py)
        self.keeps_freed_memory = keep_freed_memory()

    def kernels(self):
        """Device-neutral ``sbpc.*`` kernels: attention, constants, the SBP shard ops of
        ``runtime.shard_ops`` (when present) and the collectives; the last two bound to this backend."""
        table = {
            "sbpc.attention": _attention,
            "sbpc.attention_backward": _attention_backward,
            "sbpc.constant": constant,
        }
        table.update({op: partial(fn, self) for op, fn in shard_op_kernels().items()})
        table.update({op: partial(fn, self) for op, fn in collectives.KERNELS.items()})
        return table


def shard_op_kernels() -> dict:
    """``runtime.shard_ops.KERNELS`` (``fn(backend, *args, **kw)``), or nothing while that module does not exist."""
    try:
        from sbpc.runtime.shard_ops import KERNELS
    except ModuleNotFoundError as err:
        if err.name != "sbpc.runtime.shard_ops":
            raise
        return {}
    return dict(KERNELS)
