"""Mixed precision, shared by the compiler (capture under autocast) and `sbpc check` (eager under
autocast): one autocast context per ``Precision``, and the dynamic loss scaling of fp16.

Low precision comes from ``torch.autocast`` itself, so the casts follow torch's policy op by op
(docs/precision.md); what autocast does not do, fp16's loss scaling, follows
``torch.amp.GradScaler`` to the operation."""
from __future__ import annotations

import contextlib

import torch

from sbpc.runtime.kinds import Precision

# fp16's scaler states (graph inputs and outputs, plan states, checkpoints)
LOSS_SCALE, GROWTH_TRACKER, SKIPPED_STEPS = "loss_scale", "growth_tracker", "skipped_steps"
COMPUTE_DTYPE = {Precision.FP32: torch.float32, Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}


def autocast(precision: Precision, device_type: str = "cpu"):
    """The context the forward runs in: torch.autocast for bf16 and fp16. The CPU policy is the
    one traced, whatever device runs the plan (the casts are ops of the plan); `sbpc check
    --backend cuda` runs eager under CUDA's policy, which may cast a few more ops."""
    if precision == Precision.FP32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=COMPUTE_DTYPE[precision])

