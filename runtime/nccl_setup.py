"""The parts of the NCCL communicator (``runtime.nccl``) that need neither CuPy nor a GPU, so
they are tested on CPU (tests/test_cuda.py): the dtype and reduction table, which communicators
exist and the order every rank creates them in, how a collective along a dim becomes NCCL's
call on flat buffers, the unique-id exchange over the rendezvous TCPStore, and the watchdog
that turns a hang into an error naming the peer.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from sbpc.errors import PlanError, RuntimeFailure
from sbpc.runtime.dist import _FAILED_KEY as FAILED_KEY  # a failed rank's one-line error, as on gloo
from sbpc.runtime.topology import Topology

ID_KEY = "sbpc/nccl/{}"


# --- dtypes and reductions ------------------------------------------------------------------

@dataclass(frozen=True)
class NcclEnum:
    """A constant of ``cupy.cuda.nccl`` by name, with its value in nccl.h for a CuPy that lacks
    the name (older CuPy has no ``NCCL_BFLOAT16``; NCCL itself has had it since 2.10)."""
    name: str
    value: int

    def resolve(self, module) -> int:
        return int(getattr(module, self.name, self.value))


# ncclDataType_t (nccl.h). bool travels as uint8 (one byte, 0 or 1): only max (logical or) is a
# reduction of bools; a sum could leave 2, so it is refused.
NCCL_TYPES: dict[torch.dtype, NcclEnum] = {
    torch.int8: NcclEnum("NCCL_INT8", 0),
    torch.uint8: NcclEnum("NCCL_UINT8", 1),
    torch.bool: NcclEnum("NCCL_UINT8", 1),
    torch.int32: NcclEnum("NCCL_INT32", 2),
    torch.int64: NcclEnum("NCCL_INT64", 4),
    torch.float16: NcclEnum("NCCL_FLOAT16", 6),
    torch.float32: NcclEnum("NCCL_FLOAT32", 7),
    torch.float64: NcclEnum("NCCL_FLOAT64", 8),
    torch.bfloat16: NcclEnum("NCCL_BFLOAT16", 9),
}
NCCL_OPS: dict[str, NcclEnum] = {"sum": NcclEnum("NCCL_SUM", 0), "max": NcclEnum("NCCL_MAX", 2)}


def nccl_type(dtype: torch.dtype, op: str | None = None) -> NcclEnum:
    """The NCCL datatype of ``dtype`` (and refuse a reduction NCCL would get wrong)."""
    if dtype not in NCCL_TYPES:
        raise PlanError(f"NCCL cannot move {dtype} tensors",
                        hint="supported: " + ", ".join(str(d).removeprefix("torch.") for d in NCCL_TYPES))
    if op is not None and op not in NCCL_OPS:
        raise PlanError(f"unknown reduction {op!r} in a collective", hint="reduce is 'sum' or 'max'")
    if dtype == torch.bool and op == "sum":
        raise PlanError("a sum of bool tensors over NCCL", hint="reduce bools with 'max' (logical or)")
    return NCCL_TYPES[dtype]


# --- which communicators, in which order ----------------------------------------------------

@dataclass(frozen=True)
class CommSpec:
    """One NCCL communicator: its members (global ranks; the NCCL rank is the position), what
    it serves (a mesh axis, or ``p2p`` from ``ranks[0]`` to ``ranks[1]``) and its store key."""
    ranks: tuple[int, ...]
    axis: str | None  # the mesh axis of a collective group; None for a point-to-point pair

    @property
    def key(self) -> str:
        kind = f"axis-{self.axis}" if self.axis is not None else "p2p"
        return f"{kind}/{'-'.join(map(str, self.ranks))}"

    @property
    def what(self) -> str:
        if self.axis is None:
            return f"transfer rank {self.ranks[0]} -> rank {self.ranks[1]}"
        return f"mesh axis {self.axis} (ranks {self.ranks})"


def communicator_specs(topology: Topology) -> list[CommSpec]:
    """Every communicator of the mesh, in the order all ranks create them: for each SBP axis in
    plan order, each of its groups (``Topology.groups``) of two or more ranks, once; then for each pp
    group, the ordered pairs (a, b), a != b, in lexicographic order. A rank creates the ones it
    is a member of (``mine``), in this order."""
    specs, seen = [], set()
    for axis in topology.sbp_axes:  # pp carries no collectives, only the transfers below
        for group in topology.groups(axis):
            if len(group) > 1 and group not in seen:
                seen.add(group)
                specs.append(CommSpec(group, axis))
    if "pp" in dict(topology.axes):
        for group in topology.groups("pp"):
            specs += [CommSpec((a, b), None) for a in group for b in group if a != b]
    return specs


def mine(specs: list[CommSpec], rank: int) -> list[CommSpec]:
    return [s for s in specs if rank in s.ranks]


# --- tensor layouts around NCCL's flat buffers --------------------------------------------

@dataclass(frozen=True)
class Layout:
    """How a collective along ``dim`` becomes NCCL's call on flat buffers: ``src`` is the
    contiguous buffer NCCL reads, ``out_shape`` the buffer it writes, ``finish`` turns that
    buffer into the Communicator's result: contiguous, as gloo's (a ``torch.cat``) is. A view
    with ``dim`` moved back would do for the values, but its strides differ from what the plan's
    consumers had in eager: a gather along the last dim leaves it strided, which the attention
    kernels refuse and ``view`` may not take."""
    src: torch.Tensor
    out_shape: tuple[int, ...]
    finish: Callable[[torch.Tensor], torch.Tensor]


def all_gather_layout(t: torch.Tensor, n: int, dim: int) -> Layout:
    """NCCL concatenates the members' flat buffers: gather along dim 0 of ``t`` with ``dim``
    moved to the front, then move it back."""
    src = t.detach().movedim(dim, 0).contiguous()
    return Layout(src, (n * src.shape[0], *src.shape[1:]), lambda out: out.movedim(0, dim).contiguous())


def reduce_scatter_layout(t: torch.Tensor, n: int, dim: int) -> Layout:
    """Member i gets the i-th contiguous block of the sum: with ``dim`` in front, block i is
    chunk i along ``dim``."""
    src = t.detach().movedim(dim, 0).contiguous()
    return Layout(src, (src.shape[0] // n, *src.shape[1:]), lambda out: out.movedim(0, dim).contiguous())


def all_to_all_layout(t: torch.Tensor, n: int, split_dim: int, concat_dim: int) -> Layout:
    """Block j of the flat buffer (``split_dim`` in front) goes to member j, and block j of the
    received buffer came from member j; the blocks are joined along ``concat_dim``."""
    src = t.detach().movedim(split_dim, 0).contiguous()

    def finish(out):
        return torch.cat([c.movedim(0, split_dim) for c in out.chunk(n, dim=0)], dim=concat_dim)

    return Layout(src, tuple(src.shape), finish)


# --- the unique id over the rendezvous store -------------------------------------------------

def encode_id(uid) -> bytes:
    """``nccl.get_unique_id()`` as the store's bytes. CuPy has given it as a tuple of 128 signed
    C chars (-128..127) and, in newer releases, as ``bytes`` (``NcclCommunicator(ndev, bytes
    commId, rank)``); a first byte records which, so every member hands its CuPy the leader's form."""
    if isinstance(uid, (bytes, bytearray)):
        return b"B" + bytes(uid)
    return b"T" + bytes((int(b) + 256) % 256 for b in uid)


def decode_id(data: bytes) -> tuple[int, ...] | bytes:
    form, raw = data[:1], data[1:]
    if form == b"B":
        return bytes(raw)
    return tuple(b - 256 if b > 127 else b for b in raw)


def exchange_unique_id(store, spec: CommSpec, rank: int, make_id: Callable[[], tuple[int, ...] | bytes], *,
                       timeout: float, poll: float = 0.05) -> tuple[int, ...] | bytes:
    """The unique id of ``spec``'s communicator: its first rank makes it (``make_id``) and writes
    it to the store; the others wait for it, at most ``timeout`` seconds, and fail naming that
    rank when it reported a failure or never wrote the id."""
    key, leader = ID_KEY.format(spec.key), spec.ranks[0]
    if rank == leader:
        uid = make_id()
        store.set(key, encode_id(uid))
        return uid
    deadline = time.monotonic() + timeout
    while not store.check([key]):
        if store.check([FAILED_KEY.format(leader)]):
            why = store.get(FAILED_KEY.format(leader)).decode(errors="replace")
            raise _secondary(f"NCCL setup of {spec.what} failed on rank {rank}: rank {leader} failed: {why}", leader)
        if time.monotonic() >= deadline:
            raise _secondary(f"NCCL setup of {spec.what} failed on rank {rank}: no unique id from rank {leader} "
                             f"within {timeout:g}s (it hung or died)", leader, timed_out=True)
        time.sleep(poll)
    return decode_id(store.get(key))


def _secondary(message: str, peer: int | None, *, timed_out: bool = False) -> RuntimeFailure:
    err = RuntimeFailure(message, hint="the first failing rank's error is the cause; raise --timeout if a rank is only slow")
    err.secondary, err.peer, err.timed_out = True, peer, timed_out
    return err


# --- the watchdog ---------------------------------------------------------------------------

class Watchdog:
    """Turns a hang into an error. ``track(work)`` registers a work with ``done()``, ``started``,
    ``op`` and ``spec``; every ``poll`` seconds the thread drops finished works and fails the run
    when the oldest pending one is older than ``timeout``, a peer of a work pending longer than
    ``ask_after`` reported a failure (``peer_failure(ranks) -> (rank, message) | None``) or
    ``async_error()`` returns a message. Failing means: record the error, call ``abort()``, and, unless the main thread
    picks the error up (``raise_if_failed``) within ``grace`` seconds, ``on_stuck(error)``
    (by default: print it and end the process with exit code 2). ``on_start()`` runs first in
    the thread (the communicator makes its GPU the thread's current device there)."""

    def __init__(self, rank: int, timeout: float, *, abort: Callable[[], None],
                 peer_failure: Callable[[tuple[int, ...]], tuple[int, str] | None] = lambda ranks: None,
                 async_error: Callable[[], str | None] = lambda: None,
                 on_stuck: Callable[[RuntimeFailure], None] | None = None, poll: float = 0.1, grace: float = 10.0,
                 ask_after: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 on_start: Callable[[], None] = lambda: None):
        self.rank, self.timeout, self.poll, self.grace, self.clock = rank, timeout, poll, grace, clock
        self.ask_after = ask_after
        self.on_start = on_start
        self.abort, self.peer_failure, self.async_error = abort, peer_failure, async_error
        self.on_stuck = on_stuck or _exit_stuck
        self.pending: deque = deque()
        self.error: RuntimeFailure | None = None
        self.picked_up = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=f"sbpc-nccl-watchdog-{self.rank}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2 * self.poll + 1)

    def track(self, work) -> None:
        self.raise_if_failed()
        with self._lock:
            self.pending.append(work)

    def raise_if_failed(self) -> None:
        if self.error is not None:
            self.picked_up = True
            raise self.error

    def check_once(self) -> RuntimeFailure | None:
        """One look at the pending works (the thread calls this every ``poll`` seconds)."""
        with self._lock:
            while self.pending and self.pending[0].done():
                self.pending.popleft()
            works = list(self.pending)
        if not works or self.error is not None:
            return self.error
        oldest, now = works[0], self.clock()
        failure = None
        # the store is asked only about works pending for a while (a healthy one takes
        # milliseconds), once per communicator: thousands of ranks do not poll it needlessly
        slow = {w.spec: w for w in reversed(works) if now - w.started > self.ask_after}
        for work in slow.values():
            hit = self.peer_failure(tuple(r for r in work.spec.ranks if r != self.rank))
            if hit is not None:
                failure = _secondary(f"{work.op} over {work.spec.what} failed on rank {self.rank}: "
                                     f"rank {hit[0]} failed: {hit[1]}", hit[0])
                break
        if failure is None:
            why = self.async_error()
            if why is not None:
                failure = _secondary(f"{oldest.op} over {oldest.spec.what} failed on rank {self.rank}: NCCL: {why}",
                                     _only_peer(oldest.spec.ranks, self.rank))
        if failure is None and now - oldest.started > self.timeout:
            peer = _only_peer(oldest.spec.ranks, self.rank)
            who = f"rank {peer}" if peer is not None else \
                f"one of ranks {tuple(r for r in oldest.spec.ranks if r != self.rank)}"
            failure = _secondary(f"{oldest.op} over {oldest.spec.what} failed on rank {self.rank}: "
                                 f"no answer from {who} within {self.timeout:g}s (it hung or died)", peer, timed_out=True)
        if failure is not None:
            self.error = failure
            try:
                self.abort()
            except Exception:  # noqa: BLE001 - a failed abort must not hide the error
                pass
        return self.error

    def _loop(self) -> None:
        self.on_start()
        failed_at = None
        while not self._stop.wait(self.poll):
            if self.check_once() is None:
                continue
            failed_at = failed_at if failed_at is not None else self.clock()
            if not self.picked_up and self.clock() - failed_at > self.grace:
                self.on_stuck(self.error)
                return


def _only_peer(ranks: tuple[int, ...], rank: int) -> int | None:
    peers = [r for r in ranks if r != rank]
    return peers[0] if len(peers) == 1 else None


def _exit_stuck(err: RuntimeFailure) -> None:
    print(f"sbpc: error: {err}", file=sys.stderr, flush=True)
    os._exit(2)
