"""Run a plan step by step: weights, optimizer state, batches, loss.

The runtime never imports the compiler. It imports the model file only to call
``example_batch`` for synthetic batches, which is plain PyTorch.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from sbpc.errors import ModelError, RuntimeFailure
from sbpc.runtime.backend import Backend
from sbpc.runtime.executor import Program
from sbpc.runtime.model_file import import_model_file
from sbpc.runtime.plan import Plan
from sbpc.runtime.weights import init_weights


@dataclass
class StepResult:
    loss: float
    grads: dict[str, torch.Tensor] = field(default_factory=dict)


class Runner:
    """Holds one rank's parameters, buffers and optimizer state, and steps the plan."""

    def __init__(self, plan: Plan, backend: Backend, *, seed: int = 0, weights: dict[str, torch.Tensor] | None = None):
        if plan.world_size != backend.communicator.world_size:
            raise RuntimeFailure(f"plan is for {plan.world_size} ranks but this run has {backend.communicator.world_size}",
                                 hint="launch as many ranks as the plan's mesh has devices")
        self.plan, self.backend = plan, backend
        stage = plan.stages[0]
        specs = [*plan.params, *plan.buffers, *plan.states, *plan.batch]
        # outputs: the loss, then each param's gradient and update, then each state's update
        outputs = [stage.loss, *(p.grad for p in plan.params), *(p.update for p in plan.params),
                   *(s.update for s in plan.states)]
        self.program = Program(stage.instructions, [s.value for s in specs], outputs, backend,
                               name=f"stage{stage.stage}")
        tensors = weights if weights is not None else init_weights(plan, backend, seed)
        dev = backend.device
        self.params = {p.name: tensors[p.name].to(dev) for p in plan.params}
        self.buffers = {b.name: tensors[b.name].to(dev) for b in plan.buffers}
        self.states = {s.name: torch.zeros(s.shape, dtype=getattr(torch, s.dtype), device=dev) for s in plan.states}

    def step(self, batch: tuple[torch.Tensor, ...], *, rng_seed: int | None = None,
             keep_grads: bool = False) -> StepResult:
        """One training step. ``rng_seed`` seeds torch's RNG first, so dropout masks are those of
        an eager step seeded the same way (the program draws them in eager's order)."""
        self._check_batch(batch)
        if rng_seed is not None:
            torch.manual_seed(rng_seed)
        env = [*self.params.values(), *self.buffers.values(), *self.states.values(),
               *(b.to(self.backend.device) for b in batch)]
        loss, *rest = self.program.run(env)
        n = len(self.plan.params)
        grads = dict(zip(self.params, rest[:n])) if keep_grads else {}
        self.params = dict(zip(self.params, rest[n:2 * n]))
        self.states = dict(zip(self.states, rest[2 * n:]))
        return StepResult(loss=float(loss), grads=grads)

    def weights(self) -> dict[str, torch.Tensor]:
        return {**self.params, **self.buffers}

    def _check_batch(self, batch) -> None:
        if len(batch) != len(self.plan.batch):
            raise RuntimeFailure(f"batch has {len(batch)} tensors, the plan takes {len(self.plan.batch)}")
        for t, spec in zip(batch, self.plan.batch):
            if list(t.shape) != spec.shape or str(t.dtype) != f"torch.{spec.dtype}":
                raise RuntimeFailure(f"{spec.name} is {t.dtype} {list(t.shape)}, the plan was compiled for {spec.dtype} {spec.shape}",
                                     hint="recompile with the batch size and --set values used here")


def batch_seed(seed: int, step: int) -> int:
    """The torch seed before ``example_batch`` of a step; `sbpc check` uses the same."""
    return 2 * (seed * 1_000_003 + step)


def step_seed(seed: int, step: int) -> int:
    """The torch seed before a step's forward (dropout); `sbpc check` seeds eager the same.
    Odd where batch seeds are even, so the two streams never share a seed."""
    return 2 * (seed * 1_000_003 + step) + 1


class BatchSource:
    """Synthetic batches from the model file's ``example_batch``."""

    def __init__(self, plan: Plan, seed: int):
        path = plan.model.path
        if not os.path.isfile(path):
            raise ModelError(f"the plan's model file {path!r} is not here; it is needed for example_batch()",
                             hint="run from the directory the plan was compiled in, or copy the model file along")
        self.fn = import_model_file(path, "_sbpc_batches_").example_batch
        self.plan, self.seed = plan, seed

    def __call__(self, step: int) -> tuple[torch.Tensor, ...]:
        torch.manual_seed(batch_seed(self.seed, step))
        batch = self.fn(self.plan.model.batch_size, **self.plan.model.sets)
        return (batch,) if isinstance(batch, torch.Tensor) else tuple(batch)
