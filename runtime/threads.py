"""In-process ranks: the communicator of ranks that are threads of one process, joined by a
shared rendezvous (``ThreadWorld``) instead of gloo. For tests and checks that need many ranks
but not their speed; ``runtime.thread_launch.launch_threads`` starts them.

One rank runs at a time. A rank holds the *baton* while it computes and puts it down only
while it waits in the communicator (for its peers' contributions, a message, a receiver).
Torch's global RNG (and Python's ``random``) is saved when a rank puts the baton down and
restored when it picks it up, so every rank sees its own random stream exactly as a process
would (``torch.manual_seed`` then dropout, ``example_batch``), and nothing else global
(module imports, ``torch.set_num_threads``) races. Ranks start in rank order, each from a
fresh default-seeded torch generator (the state of a new process), with the intra-op threads
a spawned rank would have (the cores divided among the ranks), so kernels round alike.

Exactness. Every collective sees all members' contributions (copies taken when they arrive)
and computes its result in group order: a sum is ``((x_0 + x_1) + x_2) + ...``, a max the
same fold of ``torch.maximum``. With two members this is gloo's result bit for bit (one
addition, commutative); gloo's ring all-reduce over three or more ranks adds in ring order
per segment, so there the sums may differ in the last bit (tests/test_threads.py measures
it). Gathers, all-to-all, point-to-point and broadcasts only move bytes: always identical.

Nothing hangs silently. Every wait is bounded by the communicator's timeout and names the
rank it waited for; when a rank raises, every rank waiting in the communicator ends at once
with ``... failed on rank R: rank N failed: <its error>``; a rank that returns while a peer
waits for it ends that wait too; ranks whose calls do not match (another collective, another
shape) all fail naming both. A rank that hangs outside the communicator cannot be stopped (a
thread cannot be killed): its peers time out, the launcher names it and leaves the daemon
thread behind.
"""
from __future__ import annotations

import pickle
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from sbpc.errors import PlanError, RuntimeFailure
from sbpc.runtime.backend import Communicator, Done, Work
from sbpc.runtime.topology import Topology


@dataclass
class _End:
    """How a rank's function ended: ``error`` is its one-line error (None when it returned)."""
    error: str | None
    secondary: bool  # a wait broken by another rank's failure, not a cause
    timed_out: bool
    time: float


@dataclass
class _Slot:
    """One collective call of a group: the members' contributions, keyed by group index."""
    op: str
    items: dict[int, Any] = field(default_factory=dict)
    sig: dict[int, tuple] = field(default_factory=dict)  # shape and dtype per member, to catch mismatches
    unread: int = 0
    mismatch: str | None = None


@dataclass
class _Message:
    tensor: torch.Tensor
    taken: bool = False


class ThreadWorld:
    """The shared state of ``size`` rank threads: the baton, collective slots, mailboxes and
    how each rank ended. Every field is guarded by ``cond``."""

    def __init__(self, size: int, timeout: float):
        self.size, self.timeout = size, timeout
        self.cond = threading.Condition()
        self.holder: int | None = None  # the rank that runs now
        self.started = 0  # ranks start in rank order
        self.slots: dict[tuple[tuple[int, ...], int], _Slot] = {}
        self.calls: list[dict[tuple[int, ...], int]] = [{} for _ in range(size)]  # per rank: calls per group
        self.mail: dict[tuple[int, int, int], deque[_Message]] = {}
        self.ended: dict[int, _End] = {}
        fresh = torch.Generator().get_state()
        self.rng = [(fresh.clone(), random.getstate()) for _ in range(size)]

    # ----- the baton (cond held)
    def _put_down(self, rank: int) -> None:
        if self.holder == rank:
            self.rng[rank] = (torch.get_rng_state(), random.getstate())
            self.holder = None
            self.cond.notify_all()

    def _pick_up(self, rank: int) -> None:
        self.holder = rank
        torch.set_rng_state(self.rng[rank][0])
        random.setstate(self.rng[rank][1])

    def start(self, rank: int) -> None:
        """Take the baton for the first time, after every lower rank has."""
        with self.cond:
            self.wait(rank, lambda: self.started == rank, lambda: list(range(self.started, rank)), f"start of rank {rank}",
                      self.timeout)
            self.started += 1

    def end(self, rank: int, error: str | None = None, *, secondary: bool = False, timed_out: bool = False) -> None:
        with self.cond:
            self.ended[rank] = _End(error, secondary, timed_out, time.monotonic())
            if self.started == rank:  # it failed before it started: let the next one start
                self.started += 1
            self._put_down(rank)
            self.cond.notify_all()

    def wait(self, rank: int, ready: Callable[[], bool], missing: Callable[[], list[int]], where: str,
             timeout: float) -> None:
        """Put the baton down, wait until ``ready()`` and the baton is free, pick it up. Ends
        with a named error when a rank failed, when a rank waited for has ended, or after
        ``timeout`` seconds (naming the ranks still missing, or the one holding the baton).
        ``cond`` is held."""
        self._put_down(rank)
        deadline = time.monotonic() + timeout
        while True:
            self._check(rank, [] if ready() else missing(), where)
            if ready() and self.holder is None:
                self._pick_up(rank)
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._timed_out(rank, missing() if not ready() else [self.holder], where, timeout)
            self.cond.wait(left)

    def _check(self, rank: int, missing: list[int], where: str) -> None:
        primary = {r: e for r, e in self.ended.items() if e.error is not None and not e.secondary}
        if primary:
            named = [r for r in missing if r in primary]
            peer = min(named) if named else min(primary, key=lambda r: (primary[r].time, r))
            raise _broken(f"{where} failed on rank {rank}: rank {peer} failed: {primary[peer].error}", peer)
        gone = [r for r in missing if r in self.ended]
        if gone:
            peer, end = gone[0], self.ended[gone[0]]
            if end.error is not None:
                raise _broken(f"{where} failed on rank {rank}: rank {peer} failed: {end.error}", peer)
            err = RuntimeFailure(f"{where} failed on rank {rank}: rank {peer} returned without joining it",
                                 hint="the ranks ran different collectives; the plan is corrupt or the ranks diverged")
            err.peer = peer
            raise err

    @staticmethod
    def _timed_out(rank: int, missing: list[int], where: str, timeout: float) -> RuntimeFailure:
        who = f"rank {missing[0]}" if len(missing) == 1 else f"ranks {tuple(missing)}"
        err = _broken(f"{where} failed on rank {rank}: no answer from {who} within {timeout:g}s "
                      f"(it hung or died)", missing[0] if missing else None)
        err.timed_out = True
        return err

    # ----- collectives and messages (called by a rank holding the baton)
    def exchange(self, rank: int, group: tuple[int, ...], op: str, item: Any, sig: tuple, where: str,
                 timeout: float) -> list:
        """Contribute ``item`` to this rank's next call on ``group``; every member's item, in
        group order, once all have arrived. ``sig`` must agree between the members."""
        return self.collect(rank, group, self.contribute(rank, group, op, item, sig), where, timeout)

    def contribute(self, rank: int, group: tuple[int, ...], op: str, item: Any, sig: tuple) -> tuple:
        """Put ``item`` into this rank's next call on ``group`` without waiting (an issued
        collective); returns the call's key for ``collect``."""
        with self.cond:
            calls = self.calls[rank]
            key = (group, calls.get(group, 0))
            calls[group] = key[1] + 1
            slot = self.slots.setdefault(key, _Slot(op, unread=len(group)))
            me = group.index(rank)
            if slot.mismatch is None and (slot.op != op or any(s != sig for s in slot.sig.values())):
                other = next(group[i] for i in slot.sig)
                slot.mismatch = (f"rank {rank} called {op} {_fmt_sig(sig)} where rank {other} called "
                                 f"{slot.op} {_fmt_sig(slot.sig[group.index(other)])}")
            slot.items[me], slot.sig[me] = item, sig
            self.cond.notify_all()
            return key

    def collect(self, rank: int, group: tuple[int, ...], key: tuple, where: str, timeout: float) -> list:
        """Every member's item of call ``key``, in group order, once all have contributed."""
        with self.cond:
            slot = self.slots[key]
            self.wait(rank, lambda: len(slot.items) == len(group) or slot.mismatch is not None,
                      lambda: [g for i, g in enumerate(group) if i not in slot.items], where, timeout)
            slot.unread -= 1
            if slot.unread == 0:
                del self.slots[key]
            if slot.mismatch is not None:
                raise RuntimeFailure(f"{where} failed on rank {rank}: {slot.mismatch}",
                                     hint="the ranks ran different collectives; the plan is corrupt or the ranks diverged")
            return [slot.items[i] for i in range(len(group))]

    def post(self, src: int, dst: int, tag: int, t: torch.Tensor) -> _Message:
        msg = _Message(t)
        with self.cond:
            self.mail.setdefault((src, dst, tag), deque()).append(msg)
            self.cond.notify_all()
        return msg

    def take(self, src: int, dst: int, tag: int, where: str, timeout: float) -> torch.Tensor:
        with self.cond:
            box = self.mail.setdefault((src, dst, tag), deque())
            self.wait(dst, lambda: bool(box), lambda: [src], where, timeout)
            msg = box.popleft()
            msg.taken = True
            self.cond.notify_all()
            return msg.tensor

    def delivered(self, rank: int, peer: int, msg: _Message, where: str, timeout: float) -> None:
        with self.cond:
            self.wait(rank, lambda: msg.taken, lambda: [peer], where, timeout)


def _broken(message: str, peer: int | None) -> RuntimeFailure:
    err = RuntimeFailure(message, hint="the first failing rank's error is the cause; raise --timeout if a rank is only slow")
    err.secondary, err.peer, err.timed_out = True, peer, False
    return err


def _fmt_sig(sig: tuple) -> str:
    return " ".join(str(s) for s in sig if s is not None)


def _sig(t: torch.Tensor, *extra) -> tuple:
    return (str(t.dtype).removeprefix("torch."), list(t.shape), *extra)


class ThreadCommunicator(Communicator):
    """The communicator of one rank thread (see the module docstring for the semantics). Groups
    are those of the mesh axes, as on gloo; a group of one rank is the identity."""

    def __init__(self, world: ThreadWorld, topology: Topology, *, timeout: float | None = None):
        if topology.world_size != world.size:
            from sbpc.runtime.dist import world_size_mismatch

            raise world_size_mismatch(topology.world_size, world.size)
        self.world, self.topology = world, topology
        self.rank, self.world_size = topology.rank, world.size
        self.timeout = timeout if timeout is not None else world.timeout
        self._axis: dict[tuple[int, ...], str] = {}
        for axis, _ in topology.axes:
            for group in topology.groups(axis):
                if self.rank in group and len(group) > 1:
                    self._axis.setdefault(group, axis)

    def _where(self, op: str, group: tuple[int, ...]) -> str:
        axis = self._axis.get(group)
        return f"{op} over mesh axis {axis} (ranks {group})" if axis else f"{op} with ranks {group}"

    def _exchange(self, op: str, group, item, sig: tuple) -> list:
        return self._contribute(op, group, item, sig).wait()

    def _contribute(self, op: str, group, item, sig: tuple, finish: Callable[[list], Any] = lambda items: items) -> _Issued:
        group = tuple(group)
        if group not in self._axis and group != tuple(range(self.world_size)):
            raise PlanError(f"{op} over ranks {group}: rank {self.rank} has no process group for them",
                            hint="collectives run along one mesh axis; the plan is corrupt or for another mesh")
        return _Issued(self, group, self.world.contribute(self.rank, group, op, item, sig), self._where(op, group), finish)

    def _tensors(self, op: str, t: torch.Tensor, group, *extra, finish=lambda items: items) -> _Issued:
        return self._contribute(op, group, t.detach().clone(memory_format=torch.contiguous_format), _sig(t, *extra), finish)

    def start(self, kind, t, group, **kw):
        """Issued collectives: this rank's contribution goes in now, ``wait`` collects the
        others' (the baton is put down only there), so an issued call never blocks."""
        if len(group) == 1:
            return Done(t)
        return getattr(self, f"_{kind}")(t, group, **kw)

    def all_reduce(self, t, group, op="sum"):
        return self.start("all_reduce", t, group, op=op).wait()

    def all_gather(self, t, group, dim):
        return self.start("all_gather", t, group, dim=dim).wait()

    def reduce_scatter(self, t, group, dim, op="sum"):
        return self.start("reduce_scatter", t, group, dim=dim, op=op).wait()

    def _all_reduce(self, t, group, op="sum"):
        _reduction(op)
        return self._tensors("all_reduce", t, group, op, finish=lambda parts: _fold(parts, op))

    def _all_gather(self, t, group, dim):
        return self._tensors("all_gather", t, group, dim, finish=lambda parts: torch.cat(parts, dim=dim))

    def _reduce_scatter(self, t, group, dim, op="sum"):
        _reduction(op)
        size, i = t.shape[dim] // len(group), list(group).index(self.rank)
        return self._tensors("reduce_scatter", t, group, dim, op,
                             finish=lambda parts: _fold([p.narrow(dim, i * size, size) for p in parts], op))

    def all_to_all(self, t, group, split_dim, concat_dim):
        n = len(group)
        if n == 1:
            return t
        if t.shape[split_dim] % n:
            raise RuntimeFailure(f"{self._where('all_to_all', tuple(group))} failed on rank {self.rank}: dim {split_dim} "
                                 f"of {list(t.shape)} does not split into {n} equal chunks",
                                 hint="the plan is corrupt; recompile it")
        parts = self._tensors("all_to_all", t, group, split_dim, concat_dim).wait()
        i = list(group).index(self.rank)
        return torch.cat([p.chunk(n, dim=split_dim)[i] for p in parts], dim=concat_dim)

    def send(self, t, peer, tag=0, what="send"):
        self._peer_ok(peer, what)
        msg = self.world.post(self.rank, peer, tag, t.detach().clone(memory_format=torch.contiguous_format))
        return _Pending(self, msg, peer, self._where(what, (self.rank, peer)))

    def recv(self, shape, dtype, peer, tag=0, what="recv"):
        self._peer_ok(peer, what)
        where = self._where(what, (peer, self.rank))
        got = self.world.take(peer, self.rank, tag, where, self.timeout)
        if list(got.shape) != list(shape) or got.dtype != dtype:
            raise RuntimeFailure(f"{where} failed on rank {self.rank}: rank {peer} sent {_fmt_sig(_sig(got))}, "
                                 f"expected {str(dtype).removeprefix('torch.')} {list(shape)}",
                                 hint="the plan is corrupt; recompile it")
        return got

    def _peer_ok(self, peer: int, what: str) -> None:
        if not 0 <= peer < self.world_size or peer == self.rank:
            raise PlanError(f"{what}: rank {self.rank} cannot exchange with rank {peer} of {self.world_size}",
                            hint="the plan is corrupt or for another mesh")

    def gather_objects(self, obj, dst=0):
        items = self._exchange("gather of results", tuple(range(self.world_size)), pickle.dumps(obj), ())
        return [pickle.loads(b) for b in items] if self.rank == dst else None

    def broadcast(self, t, src):
        if self.world_size == 1:
            return t
        return self._tensors("broadcast", t, tuple(range(self.world_size)), f"from rank {src}").wait()[src]

    def barrier(self):
        if self.world_size > 1:
            self._exchange("barrier", tuple(range(self.world_size)), None, ())


class _Issued(Work):
    """A collective this rank has contributed to; ``wait`` collects the members' items."""

    def __init__(self, comm: ThreadCommunicator, group: tuple[int, ...], key: tuple, where: str,
                 finish: Callable[[list], Any]):
        self.comm, self.group, self.key, self.where, self.finish = comm, group, key, where, finish

    def wait(self):
        c = self.comm
        return self.finish(c.world.collect(c.rank, self.group, self.key, self.where, c.timeout))


class _Pending:
    """A send in flight; ``wait`` returns once the receiver has taken the message."""

    def __init__(self, comm: ThreadCommunicator, msg: _Message, peer: int, where: str):
        self.comm, self.msg, self.peer, self.where = comm, msg, peer, where

    def wait(self) -> None:
        self.comm.world.delivered(self.comm.rank, self.peer, self.msg, self.where, self.comm.timeout)


def _reduction(op: str) -> None:
    if op not in ("sum", "max"):
        raise PlanError(f"reduction {op!r} is not one of sum, max", hint="the plan is corrupt; recompile it")


def _fold(parts: list[torch.Tensor], op: str) -> torch.Tensor:
    """``parts[0] (op) parts[1] (op) ...`` left to right, in a new tensor."""
    out = parts[0].clone()
    for p in parts[1:]:
        if op == "max":
            torch.maximum(out, p, out=out)
        else:
            out.add_(p)
    return out
