"""Start in-process ranks: ``launch_threads(world_size, "module:function" or callable,
payload, timeout=...)`` runs ``function(payload)`` on ``world_size`` threads of this process
with the contract of ``runtime.launch.launch``: the results in rank order, or the error of the
rank that failed first, prefixed ``rank N:`` (an ``SbpcError``: same class, hint and location),
``rank N failed: Type: ...`` or ``rank N hung: ...``. Inside a rank thread
``runtime.dist.init_distributed(mesh, ...)`` returns a ``ThreadCommunicator``
(``runtime/threads.py``) instead of joining gloo, so one launch target serves both modes.
``launch(..., ranks="threads")`` comes here.
"""
from __future__ import annotations

import contextvars
import pickle
import random
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from sbpc.errors import RuntimeFailure
from sbpc.runtime.threads import ThreadCommunicator, ThreadWorld
from sbpc.runtime.topology import Topology


@dataclass(frozen=True)
class _Seat:
    world: ThreadWorld
    rank: int


_SEAT: contextvars.ContextVar[_Seat | None] = contextvars.ContextVar("sbpc_rank_thread", default=None)


def rank_thread_communicator(axes: tuple[tuple[str, int], ...], timeout: float) -> ThreadCommunicator | None:
    """The communicator of ``axes`` when called from a rank thread of ``launch_threads``, else
    None (``runtime.dist.init_distributed`` asks this first)."""
    seat = _SEAT.get()
    if seat is None:
        return None
    return ThreadCommunicator(seat.world, Topology(tuple(axes), seat.rank), timeout=timeout)


def launch_threads(world_size: int, target: str | Callable[[Any], Any], payload: Any, *, timeout: float,
                   grace: float = 3.0, on_output: Callable[[int, str], None] | None = None,
                   threads: int | None = None) -> list[Any]:
    """Run ``target(payload)`` on ``world_size`` rank threads of this process; return each
    rank's result in rank order, or raise as ``runtime.launch.launch`` does. ``timeout`` bounds
    every wait of a rank for another; ``grace`` is how long the others may take to end after
    the first failure; ``on_output(rank, line)`` receives what the ranks print (default: rank
    0's lines to stdout, the others' prefixed ``[rank N]``); ``threads`` sets torch's intra-op
    threads for the run (default: those of a spawned rank, the cores divided among the ranks,
    since a kernel's rounding may depend on its thread count)."""
    from sbpc.runtime.dist import one_line
    from sbpc.runtime.launch import default_threads, error_record, pick_failure, resolve_target

    if world_size < 1:
        raise RuntimeFailure(f"cannot launch {world_size} ranks")
    fn = resolve_target(target) if isinstance(target, str) else target
    world = ThreadWorld(world_size, timeout)
    results: list[Any] = [None] * world_size
    records: dict[int, dict] = {}

    wire = pickle.dumps(payload)  # each rank gets its own copy, as a spawned rank does

    def body(rank: int) -> None:
        _SEAT.set(_Seat(world, rank))
        try:
            world.start(rank)
            results[rank] = fn(pickle.loads(wire))
        except BaseException as err:  # noqa: BLE001 - every failure is reported to the launcher
            if isinstance(err, SystemExit) and err.code in (0, None):
                world.end(rank)
                return
            records[rank] = rec = error_record(rank, err)
            world.end(rank, one_line(err), secondary=rec["secondary"], timed_out=rec["timed_out"])
        else:
            world.end(rank)

    saved_rng, saved_random, saved_threads = torch.get_rng_state(), random.getstate(), torch.get_num_threads()
    torch.set_num_threads(threads or default_threads(world_size))
    stdout = sys.stdout
    sys.stdout = _RankStdout(stdout, on_output or _print_output(stdout))
    try:
        ranks = [threading.Thread(target=body, args=(r,), name=f"sbpc-rank-{r}", daemon=True) for r in range(world_size)]
        for t in ranks:
            t.start()
        hung = _watch(world, ranks, grace)
    finally:
        sys.stdout.flush()
        sys.stdout = stdout
        torch.set_rng_state(saved_rng)
        random.setstate(saved_random)
        torch.set_num_threads(saved_threads)
    if records or hung:
        raise pick_failure(records, hung, timeout) or RuntimeFailure("a rank failed without a trace")
    return results


def _watch(world: ThreadWorld, ranks: list[threading.Thread], grace: float) -> list[int]:
    """Wait for every rank, or until ``grace`` seconds after the first failure (half a second
    when that failure is a timeout: its peers had ``timeout`` already); the ranks still running."""
    with world.cond:
        while True:
            alive = [r for r, t in enumerate(ranks) if r not in world.ended]
            failed = [e for e in world.ended.values() if e.error is not None]
            if not alive:
                break
            if failed:
                first = min(failed, key=lambda e: e.time)
                wait = min(grace, 0.5) if first.timed_out else grace
                left = first.time + wait - time.monotonic()
                if left <= 0:
                    return alive
                world.cond.wait(left)
            else:
                world.cond.wait(1.0)
    for t in ranks:
        t.join()
    return []


class _RankStdout:
    """``sys.stdout`` during a launch: a rank thread's lines go to ``sink(rank, line)``; other
    threads write through."""

    def __init__(self, through, sink: Callable[[int, str], None]):
        self.through, self.sink = through, sink
        self.partial: dict[int, str] = {}
        self.lock = threading.Lock()

    def write(self, text: str) -> int:
        seat = _SEAT.get()
        if seat is None:
            return self.through.write(text)
        with self.lock:
            lines = (self.partial.pop(seat.rank, "") + text).split("\n")
            if lines[-1]:
                self.partial[seat.rank] = lines[-1]
        for line in lines[:-1]:
            self.sink(seat.rank, line + "\n")
        return len(text)

    def flush(self) -> None:
        with self.lock:
            rest, self.partial = self.partial, {}
        for rank, line in rest.items():
            self.sink(rank, line)
        self.through.flush()

    def __getattr__(self, name):
        return getattr(self.through, name)


def _print_output(stream) -> Callable[[int, str], None]:
    def show(rank: int, line: str) -> None:
        stream.write(line if rank == 0 else f"[rank {rank}] {line}")
        stream.flush()
    return show
