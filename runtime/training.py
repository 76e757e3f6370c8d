"""The training loop of one rank: batches in, a step per batch at the schedule's learning rate,
the log on rank 0. Every rank runs it (the step's collectives and the memory gather need all).
"""
from __future__ import annotations

import math
import resource
import sys
import time
from dataclasses import dataclass, field
from typing import IO

import torch

from sbpc.runtime.checkpoint import Checkpointer, TrainState
from sbpc.runtime.data import Batches
from sbpc.runtime.flops import step_flops
from sbpc.runtime.lr_schedule import LrSchedule
from sbpc.runtime.precision import LOSS_SCALE, SKIPPED_STEPS
from sbpc.runtime.runner import Runner, step_seed
from sbpc.runtime.train_log import LogOptions, StepLog, TrainLog


@dataclass(frozen=True)
class TrainOptions:
    steps: int  # in all: a resumed run goes on from ``start`` to here
    seed: int
    schedule: LrSchedule
    log: LogOptions = field(default_factory=LogOptions)
    start: int = 0  # steps already done (a resumed run)
    saves: Checkpointer | None = None  # checkpoints after the steps it is due and after the last
    schedule_state: dict | None = None  # what a checkpoint records of the schedule


@dataclass
class TrainResult:
    losses: list[float]
    seconds: float
    logs: list[StepLog]


def train_loop(runner: Runner, batches: Batches, options: TrainOptions, out: IO[str] | None) -> TrainResult:
    plan, comm = runner.plan, runner.backend.communicator
    flops = step_flops(plan)
    log = TrainLog(options.log, options.steps, out, start=options.start)
    losses, logs = [], []
    since, window_start, nan = 0, time.perf_counter(), 0
    skipped_before = _skipped(runner)
    start = window_start
    try:
        for step in range(options.start, options.steps):
            lr = options.schedule(step)
            result = runner.step(batches.next(), rng_seed=step_seed(options.seed, step), lr=lr)
            losses.append(result.loss)
            norm = result.grad_norm
            nan += not math.isfinite(result.loss) or (norm is not None and not math.isfinite(norm))
            since += 1
            log.advance(step + 1, result.loss)
            done = step + 1
            if done % options.log.interval == 0 or done == options.steps:
                now = time.perf_counter()
                seconds = (now - window_start) / since
                skipped = _skipped(runner)
                entry = StepLog(iteration=done, steps=options.steps, consumed=done * plan.model.batch_size,
                                elapsed_ms=seconds * 1e3, tflops=flops / seconds / plan.world_size / 1e12,
                                lr=lr, batch=plan.model.batch_size,
                                loss=result.loss, loss_scale=_loss_scale(runner), grad_norm=norm,
                                skipped=skipped - skipped_before, nan=nan)
                log.step(entry)
                logs.append(entry)
                since, nan, skipped_before, window_start = 0, 0, skipped, time.perf_counter()
            if step == options.start:
                _memory(runner, log, f"after step {step + 1}")
            if options.saves is not None and (options.saves.due(done) or done == options.steps):
                state = TrainState(step=done, seed=options.seed, data=batches.state().model_dump(),
                                   schedule=options.schedule_state)
                log.say(f"saved checkpoint of step {done} to {options.saves.save(runner, state)}")
        elapsed = time.perf_counter() - start
        ran = options.steps - options.start
        if ran > 0:
            log.say(f"{ran} steps in {elapsed:.2f}s ({ran / elapsed:.2f} steps/s)")
            _memory(runner, log, "peak")
    finally:
        log.close()
    return TrainResult(losses, elapsed, logs)


def _local_state(runner: Runner, name: str) -> float | None:
    """An optimizer state every rank holds whole (fp16's scaler), read on this rank: no collective."""
    t = runner.states.get(name)
    return float(t) if t is not None and t.numel() == 1 else None


def _loss_scale(runner: Runner) -> float:
    scale = _local_state(runner, LOSS_SCALE)
    return scale if scale is not None else 1.0


def _skipped(runner: Runner) -> int:
    n = _local_state(runner, SKIPPED_STEPS)
    return int(n) if n is not None else 0


def peak_bytes(device: torch.device) -> int:
    """This process's peak: the CUDA caching allocator's on a GPU, else the resident set's high
    water mark (Linux ``VmHWM``, which includes the interpreter and the libraries; not
    ``ru_maxrss``, which a spawned rank inherits from the launcher across exec)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS counts bytes, the BSDs KiB


def _memory(runner: Runner, log: TrainLog, when: str) -> None:
    """Rank 0 prints every rank's measured peak and, where the plan has one, the estimate of its
    stage. A gather: every rank calls it."""
    stage = runner.topology.index("pp")
    mine = (runner.backend.communicator.rank, stage, peak_bytes(runner.backend.device))
    parts = runner.backend.communicator.gather_objects(mine, 0)
    if parts is None:
        return
    mib = lambda b: f"{b / 2**20:.1f}"
    what = "max allocated" if runner.backend.device.type == "cuda" else "resident set of the process"
    measured = " ".join(f"r{r}:{mib(b)}" for r, _, b in sorted(parts))
    roles = {r.stage: r.total for r in runner.plan.estimates.roles}
    line = f"memory {when} (MiB per rank, {what}): {measured}"
    if roles:
        estimated = " ".join(f"stage {s}:{mib(roles[s])}" for s in sorted({s for _, s, _ in parts}) if s in roles)
        line += f"; estimated (plan tensors only, docs/memory.md): {estimated}"
    log.say(line)
