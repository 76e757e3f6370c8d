"""A fake NCCL for tests/test_nccl.py: the whole NcclCommunicator (runtime/nccl.py) runs over it
with ranks as threads and CPU memory; also a fake of the communicator's gloo side."""
from __future__ import annotations

import contextlib
import ctypes
import sys
import threading
import types

import pytest
import torch

from conftest import tcp_client, tcp_store
from sbpc.runtime.nccl_setup import NCCL_TYPES
from sbpc.runtime.topology import Topology


# --- the whole NcclCommunicator over a fake NCCL (threads as ranks, CPU memory) -----------
# What this covers: the communicator's own logic (which communicator a call uses, the NCCL
# ranks and counts it passes, the layouts, grouped sends, pairs per direction) on CPU. What it
# cannot: CuPy's real signatures, CUDA streams and events (faked as no-ops), NCCL itself.

class FakeFabric:
    """NCCL's semantics on host memory: communicators meet by unique id; a collective waits for
    every member's call with the same sequence number; sends go to a mailbox per (comm, src, dst)."""

    def __init__(self):
        self.cond = threading.Condition()
        self.members: dict[tuple, dict[int, "FakeHandle"]] = {}
        self.calls: dict[tuple, dict[int, tuple]] = {}
        self.mail: dict[tuple, list] = {}


DTYPE_OF = {e.value: d for d, e in NCCL_TYPES.items() if d != torch.bool}


def _read(ptr, count, dtype):
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer(bytearray(ctypes.string_at(ptr, nbytes)), dtype=dtype).clone()


def _write(ptr, t):
    data = t.contiguous().view(torch.uint8).numpy().tobytes()
    ctypes.memmove(ptr, data, len(data))


class FakeHandle:
    def __init__(self, fabric, n, uid, rank):
        self.fabric, self.n, self.uid, self.rank, self.seq = fabric, n, tuple(uid), rank, 0
        self.grouped = None
        with fabric.cond:  # ncclCommInitRank: blocks until every member called it
            fabric.members.setdefault(self.uid, {})[rank] = self
            fabric.cond.notify_all()
            assert fabric.cond.wait_for(lambda: len(fabric.members[self.uid]) == n, timeout=10), "init never met"

    def _meet(self, what, payload):
        key = (self.uid, self.seq, what)
        self.seq += 1
        f = self.fabric
        with f.cond:
            f.calls.setdefault(key, {})[self.rank] = payload
            f.cond.notify_all()
            assert f.cond.wait_for(lambda: len(f.calls[key]) == self.n, timeout=10), f"{what} never met"
            return dict(f.calls[key])

    def allReduce(self, send, recv, count, dtype, op, stream):
        parts = self._meet("allReduce", _read(send, count, DTYPE_OF[dtype]))
        stacked = torch.stack([parts[r] for r in range(self.n)])
        _write(recv, stacked.sum(0) if op == 0 else stacked.amax(0))

    def allGather(self, send, recv, count, dtype, stream):
        parts = self._meet("allGather", _read(send, count, DTYPE_OF[dtype]))
        _write(recv, torch.cat([parts[r] for r in range(self.n)]))

    def reduceScatter(self, send, recv, count, dtype, op, stream):
        parts = self._meet("reduceScatter", _read(send, count * self.n, DTYPE_OF[dtype]))
        total = torch.stack([parts[r] for r in range(self.n)]).sum(0)
        _write(recv, total[self.rank * count:(self.rank + 1) * count])

    def send(self, send, count, dtype, peer, stream):
        item = ("send", _read(send, count, DTYPE_OF[dtype]), peer)
        if self.grouped is not None:
            self.grouped.append(item)
        else:
            self._post(*item[1:])

    def recv(self, recv, count, dtype, peer, stream):
        item = ("recv", (recv, count, dtype), peer)
        if self.grouped is not None:
            self.grouped.append(item)
        else:  # asynchronous, as on a GPU: it completes on its stream, after the stream's earlier work
            FakeStream.of(stream).then(lambda: self._take(*item[1:]))

    def _post(self, data, peer):
        with self.fabric.cond:
            self.fabric.mail.setdefault((self.uid, self.rank, peer), []).append(data)
            self.fabric.cond.notify_all()

    def _take(self, where, peer):
        recv, count, dtype = where
        box = (self.uid, peer, self.rank)
        with self.fabric.cond:
            assert self.fabric.cond.wait_for(lambda: self.fabric.mail.get(box), timeout=10), "recv never matched"
            data = self.fabric.mail[box].pop(0)
        assert data.numel() == count and data.dtype == DTYPE_OF[dtype], "send and recv disagree"
        _write(recv, data)

    def flush(self):
        items, self.grouped = self.grouped, None
        for kind, payload, peer in items:  # a group call: every send first, then the receives
            if kind == "send":
                self._post(payload, peer)
        for kind, payload, peer in items:
            if kind == "recv":
                self._take(payload, peer)

    def abort(self):
        pass

    def destroy(self):
        pass

    def check_async_error(self):
        pass


class FakeGloo:
    """The communicator's gloo side (broadcasts and gathers of Python objects, the barrier): a
    meeting per call of every rank, on host memory."""

    def __init__(self, fabric, rank, world):
        self.fabric, self.rank, self.n, self.seq = fabric, rank, world, 0

    def _meet(self, what, payload):
        key = ("gloo", self.seq, what)
        self.seq += 1
        f = self.fabric
        with f.cond:
            f.calls.setdefault(key, {})[self.rank] = payload
            f.cond.notify_all()
            assert f.cond.wait_for(lambda: len(f.calls[key]) == self.n, timeout=10), f"gloo {what} never met"
            return dict(f.calls[key])

    def broadcast(self, t, src):
        return self._meet("broadcast", t.clone())[src].clone()

    def gather_objects(self, obj, dst=0):
        parts = self._meet("gather", obj)
        return [parts[r] for r in range(self.n)] if self.rank == dst else None

    def barrier(self):
        self._meet("barrier", None)


class FakeNccl:
    """The slice of ``cupy.cuda.nccl`` the communicator calls."""
    NCCL_FLOAT32 = 7

    def __init__(self, form=tuple):
        self.fabric, self.local, self.form = FakeFabric(), threading.local(), form
        self.counter = iter(range(1, 10 ** 6))

    def get_unique_id(self):
        k = next(self.counter)
        uid = tuple(((k * 7 + i) % 256) - 128 for i in range(128))
        return uid if self.form is tuple else bytes(b + 128 for b in uid)

    def NcclCommunicator(self, n, uid, rank):  # noqa: N802 - CuPy's name
        assert isinstance(uid, self.form), f"this CuPy takes a {self.form.__name__} id, not {type(uid).__name__}"
        handle = FakeHandle(self.fabric, n, uid, rank)
        self.local.handles = getattr(self.local, "handles", []) + [handle]
        return handle

    def groupStart(self):  # noqa: N802
        for h in self.local.handles:
            h.grouped = []

    def groupEnd(self):  # noqa: N802
        for h in self.local.handles:
            h.flush()


class FakeStream:
    """A CUDA stream of host threads: work queued with ``then`` runs in order, each call after
    the one before; an event recorded on it is done when the work queued so far is. A receive
    runs there (asynchronous, as NCCL's is), so a receive posted early does not block the rank."""

    streams: dict[int, "FakeStream"] = {}  # by cuda_stream, the handle NCCL calls get

    def __init__(self):
        self.cuda_stream = id(self)
        self.streams[self.cuda_stream] = self
        self.last: FakeThread | None = None

    @classmethod
    def of(cls, handle: int) -> "FakeStream":
        return cls.streams[handle]

    def then(self, fn) -> None:
        self.last = FakeThread(fn, self.last)

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        if event.thread is not None:
            event.thread.join()


class FakeThread:
    def __init__(self, fn, after):
        self.error = None

        def run():
            if after is not None:
                after.thread.join()
            try:
                fn()
            except BaseException as err:  # noqa: BLE001 - handed to the waiter
                self.error = err

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self):
        self.thread.join(30)
        if self.error is not None:
            raise self.error


class FakeEvent:
    thread: FakeThread | None = None

    def record(self, stream=None):
        self.thread = getattr(stream, "last", None)

    def query(self):
        return self.thread is None or not self.thread.thread.is_alive()


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: FakeStream())
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: FakeEvent())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: None)
    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(Device=lambda i: types.SimpleNamespace(use=lambda: None))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    return FakeNccl()


def _on_fake_ranks(fake, axes, body, world):
    """``body(comm)`` on every rank of ``axes``, each rank a thread with its NcclCommunicator."""
    from sbpc.runtime.nccl import NcclCommunicator

    master = tcp_store(world)
    results, errors = {}, []

    def rank_main(rank):
        try:
            comm = NcclCommunicator(Topology(axes, rank), torch.device("cpu"), store=tcp_client(master), timeout=10,
                                    nccl=fake, gloo=FakeGloo(fake.fabric, rank, world))
            try:
                results[rank] = body(comm)
            finally:
                comm.close()
        except Exception as err:  # noqa: BLE001
            errors.append((rank, err))

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return results
