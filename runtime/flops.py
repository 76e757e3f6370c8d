"""Model FLOPs of a training step, read from the plan, for the throughput in the training log.

What is counted: the forward's matrix products and attention, from the logical shapes of the
plan's forward instructions (``mm``, ``addmm``, ``bmm``, ``baddbmm``: 2MNK; a mixture of experts'
grouped products: 2MNK over its token-expert pairs, the active experts only; ``sbpc.attention``:
4 b h s t d for QK^T and PV, the whole s x t square even when causal, as Megatron-LM counts it),
once per micro-batch, times 3 for forward + backward (the backward's two products per forward
one). Not counted: elementwise ops, norms, softmax, the optimizer, and recomputed forwards
(recompute clones run as backward work): these are model FLOPs, the figure MFU is defined
with, not the FLOPs the hardware ran. For GPT this is ``72 B s l h^2 (1 + s/6h) + 6 B s h V``
(Narayanan et al. 2021 without recompute; their V term, 72/16, carries recompute's factor),
exactly, for examples/gpt.py (tests/test_train.py).
"""
from __future__ import annotations

import math

from sbpc.runtime.plan import Plan

_MATMULS = {"aten.mm.default": 0, "aten.addmm.default": 1, "aten.bmm.default": 0, "aten.baddbmm.default": 1}
# a mixture of experts' grouped products, (rows [S, K], weights [E, K, N], group ends): each row
# meets its own expert's weight, 2 S K N (Hugging Face's CPU fallback and torch's kernel)
_GROUPED = frozenset({"transformers.grouped_mm_fallback.default", "aten._grouped_mm.default"})
_ATTENTION = "sbpc.attention"


def step_flops(plan: Plan) -> int:
    """Model FLOPs of one training step of the whole batch (all devices together)."""
    shapes: dict[str, list[int]] = {s.value: s.shape for s in [*plan.params, *plan.buffers, *plan.batch]}
    forward = 0
    for prog in plan.stages:
        for ins in prog.instructions:
            shapes.update((o, t.shape) for o, t in zip(ins.outs, ins.types))
        for ins in prog.instructions:
            if ins.role == "fwd" and ins.types:
                forward += _flops(ins, shapes)
    microbatches = plan.pipeline.microbatches if plan.pipeline is not None else 1
    return 3 * forward * microbatches


def _flops(ins, shapes: dict[str, list[int]]) -> int:
    refs = [shapes.get(getattr(a, "ref", None)) for a in ins.args]
    out = ins.types[0].shape
    if ins.op in _MATMULS:
        a = refs[_MATMULS[ins.op]] if len(refs) > _MATMULS[ins.op] else None
        return 2 * math.prod(out) * a[-1] if a else 0
    if ins.op in _GROUPED and refs and refs[0]:
        return 2 * math.prod(out) * refs[0][-1]
    if ins.op == _ATTENTION and len(refs) >= 2 and refs[0] and refs[1]:
        q, k = refs[0], refs[1]
        return 4 * math.prod(q[:-1]) * k[-2] * q[-1]
    return 0
