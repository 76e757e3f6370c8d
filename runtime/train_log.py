"""What a training run tells its reader, on rank 0: one line per logged step with Megatron-LM's
keys, a progress bar with an ETA in a terminal (tqdm; plain lines otherwise), the same keys per
logged step in a JSON-lines metrics file, and optional TensorBoard scalars."""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import IO

from sbpc.errors import UsageError
from sbpc.runtime.files import check_output_dir, check_output_path

# the keys of a logged step, in Megatron-LM's order and spelling ("per GPU" reads "per device")
ITERATION, CONSUMED, ELAPSED, THROUGHPUT = ("iteration", "consumed samples", "elapsed time per iteration (ms)",
                                            "throughput per device (TFLOP/s/device)")
LR, BATCH, LOSS, LOSS_SCALE, GRAD_NORM = "learning rate", "global batch size", "lm loss", "loss scale", "grad norm"
SKIPPED, NAN = "number of skipped iterations", "number of nan iterations"


@dataclass(frozen=True)
class StepLog:
    """One logged step. Times and counts cover the steps since the last logged one, as
    Megatron's do: ``elapsed_ms`` is their mean, ``skipped`` and ``nan`` their counts."""
    iteration: int  # 1-based: the steps done
    steps: int  # of the run
    consumed: int  # samples trained on so far
    elapsed_ms: float
    tflops: float  # per device
    lr: float | None  # None: the plan's compiled lr (a plan without an lr input)
    batch: int
    loss: float
    loss_scale: float
    grad_norm: float | None  # None: the plan does not report it
    skipped: int
    nan: int

    def record(self) -> dict:
        return {ITERATION: self.iteration, CONSUMED: self.consumed, ELAPSED: round(self.elapsed_ms, 3),
                THROUGHPUT: round(self.tflops, 6), LR: self.lr, BATCH: self.batch, LOSS: _finite(self.loss),
                LOSS_SCALE: self.loss_scale, GRAD_NORM: _finite(self.grad_norm), SKIPPED: self.skipped, NAN: self.nan}

    def line(self) -> str:
        lr = f"{self.lr:.6E}" if self.lr is not None else "-"
        norm = f"{self.grad_norm:.3f}" if self.grad_norm is not None else "-"
        return (f" iteration {self.iteration:8d}/{self.steps:8d} | {CONSUMED}: {self.consumed:12d} | "
                f"{ELAPSED}: {self.elapsed_ms:.1f} | {THROUGHPUT}: {self.tflops:.3g} | {LR}: {lr} | "
                f"{BATCH}: {self.batch:5d} | {LOSS}: {self.loss:.6E} | {LOSS_SCALE}: {self.loss_scale:.1f} | "
                f"{GRAD_NORM}: {norm} | {SKIPPED}: {self.skipped:3d} | {NAN}: {self.nan:3d} |")


def _finite(x: float | None) -> float | str | None:
    """JSON has no nan or inf: they are written as strings."""
    return x if x is None or math.isfinite(x) else str(x)


@dataclass(frozen=True)
class LogOptions:
    interval: int = 1
    metrics: str | None = None  # a JSON-lines file
    tensorboard: str | None = None  # a directory
    progress: bool | None = None  # None: a bar when the output is a terminal


def check_log_options(options: LogOptions) -> None:
    """Refuse bad flags before any rank starts."""
    if options.interval < 1:
        raise UsageError(f"--log-interval {options.interval} must be at least 1",
                         hint="log every N steps with --log-interval N, e.g. 10")
    if options.metrics:
        check_output_path(options.metrics, "metrics (--metrics)")
    if options.tensorboard:
        check_output_dir(options.tensorboard, "TensorBoard logs (--tensorboard)")
        _summary_writer()


def _summary_writer():
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:  # torch's writer needs the tensorboard package
        raise UsageError("--tensorboard needs the tensorboard package, which is not installed",
                         hint="pip install tensorboard, or drop --tensorboard (metrics.jsonl has the same scalars)") from err
    return SummaryWriter


# rank 0 of spawned ranks draws no bar of its own (its stdout is the launcher's pipe): it prints
# one such line per step, which the launcher turns into its bar (``ProgressRelay``)
PROGRESS_MARK = "\x1fsbpc-progress "


class ProgressBar:
    """tqdm's bar with an ETA; text goes above it."""

    def __init__(self, total: int, out: IO[str], initial: int = 0):
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=initial, file=out, unit="step", dynamic_ncols=True, leave=True)

    def update(self, done: int, loss: float) -> None:
        self.bar.set_postfix_str(f"lm loss {loss:.4f}", refresh=False)
        self.bar.update(done - self.bar.n)

    def write(self, text: str) -> None:
        self.bar.write(text.rstrip("\n"), file=self.bar.fp)

    def close(self) -> None:
        self.bar.close()


class ProgressRelay:
    """The launcher's side: rank 0's lines pass through, its progress lines drive a bar."""

    def __init__(self, out: IO[str]):
        self.out, self.bar = out, None

    def line(self, text: str) -> None:
        if text.startswith(PROGRESS_MARK):
            done, total, loss = text[len(PROGRESS_MARK):].split()
            if self.bar is None:
                self.bar = ProgressBar(int(total), self.out, initial=int(done) - 1)
            self.bar.update(int(done), float(loss))
        elif self.bar is not None:
            self.bar.write(text)
        else:
            self.out.write(text)
            self.out.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def wants_progress(out: IO[str]) -> bool:
    return hasattr(out, "isatty") and out.isatty()


class TrainLog:
    """Rank 0's side of the log; ``out`` None (the other ranks) makes every call a no-op. A bar
    is drawn when ``options.progress`` asks (default: ``out`` is a terminal); into a pipe, as
    progress lines for the launcher."""

    def __init__(self, options: LogOptions, steps: int, out: IO[str] | None, start: int = 0):
        self.options, self.out, self.steps = options, out, steps
        self.bar: ProgressBar | None = None
        self.relay = False
        self.metrics = self.board = None
        if out is None:
            return
        tty = wants_progress(out)
        if (options.progress if options.progress is not None else tty) and steps > start:
            if tty:
                self.bar = ProgressBar(steps, out, initial=start)
            else:
                self.relay = True
        if options.metrics:
            self.metrics = open(options.metrics, "a" if start else "w")
        if options.tensorboard:
            os.makedirs(options.tensorboard, exist_ok=True)
            self.board = _summary_writer()(options.tensorboard)

    def say(self, text: str) -> None:
        """A line above the bar (or a plain line)."""
        if self.out is None:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, file=self.out, flush=True)

    def advance(self, done: int, loss: float) -> None:
        if self.bar is not None:
            self.bar.update(done, loss)
        elif self.relay:
            print(f"{PROGRESS_MARK}{done} {self.steps} {loss!r}", file=self.out, flush=True)

    def step(self, log: StepLog) -> None:
        if self.out is None:
            return
        self.say(log.line())
        if self.metrics is not None:
            self.metrics.write(json.dumps(log.record()) + "\n")
            self.metrics.flush()
        if self.board is not None:
            for key, value in log.record().items():
                if key != ITERATION and isinstance(value, (int, float)):
                    self.board.add_scalar(key, value, log.iteration)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.board is not None:
            self.board.close()
