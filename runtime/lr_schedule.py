"""The learning rate of each training step: linear warmup, then cosine (or linear) decay to a
floor, as Megatron-LM's ``OptimizerParamScheduler`` does.

A pure function of the step, so a resumed run recomputes the rate from the step alone and a
checkpoint needs to store nothing but the step and this config.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from sbpc.errors import UsageError


class DecayStyle(str, Enum):
    COSINE = "cosine"
    LINEAR = "linear"
    CONSTANT = "constant"


@dataclass(frozen=True)
class LrSchedule:
    """``lr`` is the peak, reached at the end of warmup; from there the rate decays to
    ``min_lr`` at step ``decay_steps`` (counted from step 0, warmup included) and stays there."""
    lr: float
    min_lr: float = 0.0
    warmup_steps: int = 0
    decay_steps: int = 0  # 0: no decay after warmup
    style: DecayStyle = DecayStyle.COSINE

    def __post_init__(self) -> None:
        if not self.lr > 0 or not math.isfinite(self.lr):
            raise UsageError(f"--lr {self.lr:g} must be a positive number", hint="pass the peak rate, e.g. --lr 1e-3")
        if not 0 <= self.min_lr <= self.lr:
            raise UsageError(f"--min-lr {self.min_lr:g} must be between 0 and --lr {self.lr:g}",
                             hint="the floor of the decay is at most the peak, e.g. --min-lr 0.1 x --lr")
        if self.warmup_steps < 0 or self.decay_steps < 0:
            raise UsageError(f"warmup and decay steps must not be negative "
                             f"(got --lr-warmup-steps {self.warmup_steps}, --lr-decay-steps {self.decay_steps})",
                             hint="pass 0 or more steps")
        if self.decay_steps and self.decay_steps < self.warmup_steps:
            raise UsageError(f"--lr-decay-steps {self.decay_steps} ends before the warmup "
                             f"(--lr-warmup-steps {self.warmup_steps})",
                             hint="decay steps count from step 0, warmup included: pass at least the warmup steps")

    def __call__(self, step: int) -> float:
        """The rate of step ``step`` (0-based). Warmup ramps ``lr * (step + 1) / warmup_steps``,
        so that step 0 already learns (Megatron's ramp starts at 0 and wastes it) and the last
        warmup step runs at the peak."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.style == DecayStyle.CONSTANT or not self.decay_steps:
            return self.lr
        if step >= self.decay_steps:
            return self.min_lr
        span = self.decay_steps - self.warmup_steps
        ratio = (step - self.warmup_steps) / span if span else 1.0
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0) if self.style == DecayStyle.COSINE else 1.0 - ratio
        return self.min_lr + coeff * (self.lr - self.min_lr)
