"""The work of one op on one device: FLOPs and bytes of memory traffic, from the op and its
local shapes (never a table per model), and the op class whose efficiency prices it.

- matmul-like ops (mm, addmm, bmm, baddbmm, linear, matmul, convolution and its backward) are
  GEMMs: ``2 m k n`` FLOPs per product, their operands and result as traffic (the result's
  bytes also apart: ``Kernel.written``);
- attention (``sbpc.attention`` and its backward) is priced as the kernel that runs it:
  ``flash`` (one fused kernel, causal blocks skipped, the s x s scores never stored) or
  ``materialized`` (two batched GEMMs with the s x s scores written to memory and read back
  by a softmax, and a dropout when it has one, between them, as Megatron-LM did before flash
  attention);
- views are free; every other op is memory-bound: the bytes of its tensor inputs and outputs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Sequence


class OpClass(StrEnum):
    GEMM = "gemm"
    ATTENTION = "attention"
    MEMORY = "memory"


class AttentionKernel(StrEnum):
    FLASH = "flash"
    MATERIALIZED = "materialized"


@dataclass(frozen=True)
class Kernel:
    flops: float
    nbytes: float  # all its memory traffic, ``written`` included
    klass: OpClass
    written: float = 0.0  # of which a GEMM's result: after its main loop where the epilogue is serial


@dataclass(frozen=True)
class Operand:
    """A tensor an op reads or writes, on this device."""
    shape: tuple[int, ...]
    itemsize: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


# ops that make a view or a name, no kernel
VIEWS = frozenset(f"aten.{n}" for n in (
    "view.default", "_unsafe_view.default", "reshape.default", "t.default", "transpose.int", "permute.default",
    "expand.default", "split.Tensor", "split_with_sizes.default", "slice.Tensor", "select.int", "unsqueeze.default",
    "squeeze.dim", "squeeze.default", "alias.default", "detach.default", "as_strided.default", "unbind.int",
    "chunk.default", "_reshape_alias.default", "view_as.default", "expand_as.default", "lift_fresh_copy.default",
)) | {"getitem", "sbpc.keep_first", "sbpc.mb_accumulate", "sbpc.transfer"}

GEMMS = frozenset(f"aten.{n}" for n in ("mm.default", "addmm.default", "bmm.default", "baddbmm.default",
                                        "linear.default", "matmul.default", "convolution.default",
                                        "convolution_backward.default"))
# a mixture of experts' grouped products (rows [S, K] each against its expert's [K, N]) and the
# backward of Hugging Face's CPU fallback (both gradients)
GROUPED = frozenset({"transformers.grouped_mm_fallback.default", "transformers.grouped_mm_fallback_backward.default"})
ATTENTION = frozenset({"sbpc.attention", "sbpc.attention_backward"})


def is_free(op: str) -> bool:
    """No kernel: a view, a name, or a collective (priced by the link model)."""
    return op in VIEWS or op.startswith("sbpc.") and op not in ATTENTION and op != "sbpc.shard_slice"


def op_work(op: str, ins: Sequence[Operand], outs: Sequence[Operand], *, causal: bool = False,
            dropout: float = 0.0, attention: AttentionKernel = AttentionKernel.FLASH) -> list[Kernel]:
    """The kernels ``op`` runs with local inputs ``ins`` (tensor arguments, in order) and outputs ``outs``."""
    if is_free(op):
        return []
    traffic = sum(t.nbytes for t in ins) + sum(t.nbytes for t in outs)
    if op in GEMMS:
        return [Kernel(_gemm_flops(op, ins, outs), traffic, OpClass.GEMM, sum(t.nbytes for t in outs))]
    if op in GROUPED:  # (rows, weights, group ends[, grad]): 2 S K N, twice that for the backward's two gradients
        flops = 2.0 * ins[0].numel * ins[1].shape[-1] * (2 if op.endswith("_backward.default") else 1)
        return [Kernel(flops, traffic, OpClass.GEMM, sum(t.nbytes for t in outs))]
    if op in ATTENTION:
        return _attention(op == "sbpc.attention_backward", ins, outs, causal, dropout > 0, attention)
    if op == "aten.embedding.default":  # reads the rows it gathers, not the whole table
        return [Kernel(0.0, ins[1].nbytes + 2 * sum(t.nbytes for t in outs), OpClass.MEMORY)]
    return [Kernel(float(sum(t.numel for t in outs)), traffic, OpClass.MEMORY)]


def _gemm_flops(op: str, ins: Sequence[Operand], outs: Sequence[Operand]) -> float:
    if op == "aten.convolution.default":  # (input, weight, ...): 2 FLOPs per output element per weight element of its group
        return 2.0 * outs[0].numel * math.prod(ins[1].shape[1:])
    if op == "aten.convolution_backward.default":  # (grad_out, input, weight, ...): both gradients, twice the forward
        return 4.0 * ins[0].numel * math.prod(ins[2].shape[1:])
    a, b = (ins[1], ins[2]) if op in ("aten.addmm.default", "aten.baddbmm.default") else (ins[0], ins[1])
    k = a.shape[-1]
    if op == "aten.linear.default":  # weight [n, k]
        return 2.0 * math.prod(a.shape[:-1]) * k * b.shape[0]
    return 2.0 * outs[0].numel * k


def _attention(backward: bool, ins: Sequence[Operand], outs: Sequence[Operand], causal: bool, dropout: bool,
               kernel: AttentionKernel) -> list[Kernel]:
    # forward ins: q, k, v; backward ins: grad_out, q, k, v, out, logsumexp
    q, k = (ins[1], ins[2]) if backward else (ins[0], ins[1])
    *batch, s, d = q.shape
    t = k.shape[-2]
    bh = math.prod(batch)
    product = 2.0 * bh * s * t * d  # one of the two s x t products (QK^T, PV)
    io = sum(x.nbytes for x in ins) + sum(x.nbytes for x in outs)
    if kernel == AttentionKernel.FLASH:
        # forward: QK^T and PV; backward: those again (recomputed) plus dV, dP, dQ, dK: 2.5x
        flops = product * (5 if backward else 2) * (0.5 if causal else 1.0)
        return [Kernel(flops, io, OpClass.ATTENTION)]
    # Megatron-LM (2021): baddbmm writes the scores, a fused scale-mask-softmax reads and writes
    # them, bmm reads the probabilities; no causal blocks are skipped. The backward: dP = dO V^T
    # (written), dV = P^T dO (P read), softmax backward (P and dP read, dS written), dQ = dS K
    # and dK = dS^T Q (dS read twice).
    # With dropout on the probabilities, a dropout kernel reads them and writes them and a
    # 1-byte mask; its backward reads the gradient and the mask and writes the gradient.
    scores = bh * s * t * q.itemsize
    drop = [Kernel(0.0, (2 + 1 / q.itemsize) * scores, OpClass.MEMORY)] if dropout else []
    hq, hk = bh * s * d * q.itemsize, bh * t * d * q.itemsize  # a [b, h, s|t, d] operand of the queries, the keys
    # each GEMM's ``written``: the scores (QK^T, dP) or [b, h, s|t, d] results
    if backward:
        return [Kernel(product, scores + hq + hk, OpClass.GEMM, scores), Kernel(product, scores + hq + hk, OpClass.GEMM, hk),
                *drop, Kernel(0.0, 3 * scores, OpClass.MEMORY),
                Kernel(2 * product, 2 * scores + 2 * (hq + hk), OpClass.GEMM, hq + hk)]
    return [Kernel(product, scores + hq + hk, OpClass.GEMM, scores), Kernel(0.0, 2 * scores, OpClass.MEMORY), *drop,
            Kernel(product, scores + hk + hq, OpClass.GEMM, hq)]
