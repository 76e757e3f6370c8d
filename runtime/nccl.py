"""The cuda backend's communicator: NCCL through CuPy (``cupy.cuda.nccl``), on CUDA streams.

UNVERIFIED ON A GPU: written against CuPy's and NCCL's documented APIs and never run; only its
pure-Python parts (``runtime.nccl_setup``: the dtype table, which communicators exist and in
what order, the unique-id exchange over a TCPStore, the watchdog) have run, on CPU, in
tests/test_cuda.py.

Communicators. One NCCL communicator per group of ranks that talks: the groups of every mesh
axis (``Topology.groups``, axes in plan order), and for point-to-point one communicator per
ordered pair of ranks of a pp group (``a -> b`` and ``b -> a`` apart, so a send never waits
behind a receive in the other direction: the plan's deadlock proof assumes a send that does
not wait for its receiver). Every rank walks the same global list (``communicator_specs``)
and creates the ones it belongs to in that order; ``ncclCommInitRank`` blocks until every
member has called it, and a total order that all ranks follow cannot wait in a cycle. The
group's first rank makes the unique id and publishes it in the rendezvous TCPStore under
``sbpc/nccl/<key>``; the others read it (``exchange_unique_id``), bounded by the timeout.

Streams. Each communicator has its own stream. A collective first makes that stream wait for
the compute stream (its input is ready), runs there, and records an event; the compute stream
waits for that event only where the result is used (``NcclWork.wait``), so the host never
blocks and compute that does not need the result overlaps the transfer. Tensors that cross
streams are ``record_stream``-ed so the caching allocator does not reuse them early.

Failures. NCCL has no timeout: a dead peer leaves a kernel spinning. A watchdog thread looks
at the pending works; when one is older than the timeout, a peer has written its failure key
(``sbpc/failed/<rank>``, as the gloo path does) or NCCL reports an asynchronous error, it
aborts every communicator (``ncclCommAbort`` ends the spinning kernels), writes this rank's own
failure, and the next call into the communicator raises a ``RuntimeFailure`` naming the op,
the axis and the peer. If the main thread does not come back within ``grace`` seconds (stuck
in a host sync that the abort did not release), the watchdog prints the error and ends the
process (exit 2), so the launcher reports the rank instead of hanging.
"""
from __future__ import annotations

import ctypes
import glob
import os
import time
from functools import partial
from typing import Callable

import torch
from torch.utils._pytree import tree_map

from sbpc.errors import PlanError, RuntimeFailure, UsageError
from sbpc.runtime.backend import Communicator
from sbpc.runtime.nccl_setup import (FAILED_KEY, NCCL_OPS, CommSpec, Watchdog, all_gather_layout, all_to_all_layout,
                                     communicator_specs, exchange_unique_id, mine, nccl_type, reduce_scatter_layout)
from sbpc.runtime.topology import Topology


# --- CuPy and NCCL --------------------------------------------------------------------------

def load_nccl():
    """``cupy.cuda.nccl``, after putting the NCCL wheel's library (nvidia-nccl-cuXX, which a
    CUDA build of torch depends on) in the process so CuPy's binding finds it; a one-line
    UsageError when CuPy or NCCL is missing."""
    _preload_nccl_wheel()
    try:
        from cupy.cuda import nccl
    except ImportError as err:
        raise UsageError(f"--backend cuda on more than one GPU needs CuPy's NCCL binding: {err}",
                         hint="pip install -e '.[cuda]' (cupy-cuda12x), beside a CUDA build of torch") from err
    if not getattr(nccl, "available", True):
        raise UsageError("CuPy is installed but cannot load NCCL",
                         hint="use a CUDA build of torch from pip (it brings nvidia-nccl-cu12 or -cu13), "
                              "or put libnccl.so.2 on LD_LIBRARY_PATH")
    return nccl


def _preload_nccl_wheel() -> None:
    """dlopen the wheel's libnccl.so.2 globally (as torch does for its CUDA wheels): a binding
    that asks for the soname then gets it even though the wheel's folder is not on the path.
    Where torch already loaded it, this is the same file and so the same library."""
    try:
        import nvidia.nccl  # the namespace package of nvidia-nccl-cu12 and -cu13 alike
    except ImportError:
        return
    for root in getattr(nvidia.nccl, "__path__", []):
        for lib in sorted(glob.glob(os.path.join(root, "lib", "libnccl.so*"))):
            try:
                ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
                return
            except OSError:
                continue


def use_device(device: torch.device) -> None:
    """Make ``device`` the calling thread's current GPU. A new thread starts on GPU 0, and its
    first CUDA call (the watchdog's event queries, NCCL's abort) would create a context there:
    on every rank of a node, memory of GPU 0 that no rank asked for."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


class NcclWork:
    """A collective or transfer issued on a communication stream. ``wait()`` makes the compute
    stream wait for it (the host does not block) and returns the result; ``done()`` asks the
    event without blocking (the watchdog's view)."""

    def __init__(self, comm: NcclCommunicator, spec: CommSpec, op: str, event, result, finish=None):
        self.comm, self.spec, self.op, self.event, self.result = comm, spec, op, event, result
        self.finish = finish  # the compute-stream step that turns the raw buffer into the result
        self.started = time.monotonic()
        self._waited = False

    def done(self) -> bool:
        return bool(self.event.query())

    def wait(self):
        self.comm.watchdog.raise_if_failed()
        if not self._waited:
            self.comm.compute.wait_event(self.event)
            self._waited = True
            if self.finish is not None:
                self.result = self.finish(self.result)
        return self.result

    def synchronize(self):
        """Block the host until the work is done, bounded by the watchdog."""
        while not self.done():
            self.comm.watchdog.raise_if_failed()
            time.sleep(0.001)
        return self.wait()


class _Ready:
    """A collective over one rank: its result is its input."""

    def __init__(self, value):
        self.value = value

    def wait(self):
        return self.value


class _HostWork:
    """A blocking host call the watchdog bounds (a communicator's setup)."""

    def __init__(self, spec: CommSpec, op: str):
        self.spec, self.op, self.started, self.finished = spec, op, time.monotonic(), False

    def done(self) -> bool:
        return self.finished


class _Group:
    """One CuPy NCCL communicator and its stream."""

    def __init__(self, spec: CommSpec, handle, stream: torch.cuda.Stream):
        self.spec, self.handle, self.stream = spec, handle, stream


class NcclCommunicator(Communicator):
    """The communicator of one rank over NCCL (see the module docstring). Gathers of Python
    objects and the barrier go over gloo (``gloo``, the process group the launcher joined), as
    they carry no tensors worth a GPU."""

    def __init__(self, topology: Topology, device: torch.device, *, store, timeout: float, gloo=None,
                 nccl=None, watchdog: Watchdog | None = None):
        self.topology, self.device, self.store, self.timeout = topology, device, store, timeout
        self.rank, self.world_size = topology.rank, topology.world_size
        self.gloo = gloo
        self.nccl = nccl or load_nccl()
        self.compute = torch.cuda.current_stream(device)
        self.groups: dict[tuple[int, ...], _Group] = {}  # collective groups, by ranks
        self.pairs: dict[tuple[int, int], _Group] = {}  # point to point, by (src, dst)
        self.watchdog = watchdog or Watchdog(self.rank, timeout, abort=self.abort, peer_failure=self._peer_failure,
                                             async_error=self._async_error, on_start=partial(use_device, device))
        self.watchdog.start()  # before the setup: ncclCommInitRank blocks until every member calls it
        self._make_communicators()

    # --- setup ---------------------------------------------------------------------------

    def _make_communicators(self) -> None:
        import cupy

        cupy.cuda.Device(self.device.index).use()  # NCCL binds a communicator to the current device
        for spec in mine(communicator_specs(self.topology), self.rank):
            uid = exchange_unique_id(self.store, spec, self.rank, self.nccl.get_unique_id, timeout=self.timeout)
            setup = _HostWork(spec, "NCCL setup")
            self.watchdog.track(setup)  # a member that never joins: the watchdog ends this rank, naming it
            try:
                handle = self.nccl.NcclCommunicator(len(spec.ranks), uid, spec.ranks.index(self.rank))
            except Exception as err:
                raise RuntimeFailure(f"NCCL setup of {spec.what} failed on rank {self.rank}: {type(err).__name__}: {err}",
                                     hint="NCCL_DEBUG=INFO shows why; every rank must reach this point") from err
            finally:
                setup.finished = True
            group = _Group(spec, handle, torch.cuda.Stream(self.device))
            if spec.axis is None:
                self.pairs[(spec.ranks[0], spec.ranks[1])] = group
            else:
                self.groups.setdefault(spec.ranks, group)

    def abort(self) -> None:
        for group in [*self.groups.values(), *self.pairs.values()]:
            try:
                group.handle.abort()
            except Exception:  # noqa: BLE001 - abort what can be aborted
                pass

    def close(self) -> None:
        self.watchdog.stop()
        for group in [*self.groups.values(), *self.pairs.values()]:
            try:
                group.handle.destroy()
            except Exception:  # noqa: BLE001
                pass

    def _peer_failure(self, ranks: tuple[int, ...]) -> tuple[int, str] | None:
        try:
            for r in ranks:
                if self.store.check([FAILED_KEY.format(r)]):
                    return r, self.store.get(FAILED_KEY.format(r)).decode(errors="replace")
        except Exception:  # noqa: BLE001 - a store that is gone tells nothing
            return None
        return None

    def _async_error(self) -> str | None:
        for group in [*self.groups.values(), *self.pairs.values()]:
            try:
                group.handle.check_async_error()
            except Exception as err:  # noqa: BLE001 - CuPy raises NcclError
                return f"{type(err).__name__}: {err}"
        return None

    # --- issuing -------------------------------------------------------------------------

    def _group(self, op: str, group: tuple[int, ...]) -> _Group:
        found = self.groups.get(tuple(group))
        if found is None:
            raise PlanError(f"{op} over ranks {tuple(group)}: rank {self.rank} has no NCCL communicator for them",
                            hint="collectives run along one mesh axis; the plan is corrupt or for another mesh")
        return found

    def _issue(self, op: str, group: _Group, inputs: list[torch.Tensor], outputs: list[torch.Tensor],
               call: Callable[[int], None], result, finish=None) -> NcclWork:
        """Run ``call(stream_handle)`` on the group's stream once the compute stream has made the
        inputs; returns the work whose event the result's users wait on."""
        self.watchdog.raise_if_failed()
        for t in (*inputs, *outputs):  # NCCL takes raw pointers: a host one would be read as device memory
            if t.device != self.device:
                raise RuntimeFailure(f"{op} over {group.spec.what} on rank {self.rank}: a tensor in {t.device} memory, "
                                     f"where NCCL moves {self.device}'s only",
                                     hint="this is a bug in sbpc (a host value must be moved to the device first); report it")
        stream = group.stream
        stream.wait_stream(self.compute)
        for t in (*inputs, *outputs):
            t.record_stream(stream)  # the allocator must not hand these out while NCCL uses them
        with torch.cuda.stream(stream):
            try:
                call(stream.cuda_stream)
            except Exception as err:
                raise RuntimeFailure(f"{op} over {group.spec.what} failed on rank {self.rank}: "
                                     f"{type(err).__name__}: {err}",
                                     hint="NCCL_DEBUG=WARN shows NCCL's view; the first failing rank's error is the cause") from err
            event = torch.cuda.Event()
            event.record(stream)
        work = NcclWork(self, group.spec, op, event, result, finish)
        self.watchdog.track(work)
        return work

    def _enum(self, dtype: torch.dtype, op: str | None = None) -> tuple[int, int | None]:
        t = nccl_type(dtype, op).resolve(self.nccl)
        return t, (NCCL_OPS[op].resolve(self.nccl) if op is not None else None)

    # --- asynchronous collectives (the synchronous ones below wait on these) ---------------

    def all_reduce_async(self, t, group, op="sum") -> NcclWork:
        g = self._group("all_reduce", group)
        src = t.detach().contiguous()
        out = torch.empty_like(src)
        dtype, red = self._enum(src.dtype, op)
        return self._issue("all_reduce", g, [src], [out],
                           lambda s: g.handle.allReduce(src.data_ptr(), out.data_ptr(), src.numel(), dtype, red, s), out)

    def all_gather_async(self, t, group, dim) -> NcclWork:
        g = self._group("all_gather", group)
        lay = all_gather_layout(t, len(group), dim)
        src, out = lay.src, lay.src.new_empty(lay.out_shape)
        dtype, _ = self._enum(src.dtype)
        return self._issue("all_gather", g, [src], [out],
                           lambda s: g.handle.allGather(src.data_ptr(), out.data_ptr(), src.numel(), dtype, s),
                           out, finish=lay.finish)

    def reduce_scatter_async(self, t, group, dim, op="sum") -> NcclWork:
        g = self._group("reduce_scatter", group)
        lay = reduce_scatter_layout(t, len(group), dim)
        src, out = lay.src, lay.src.new_empty(lay.out_shape)
        dtype, red = self._enum(src.dtype, op)
        return self._issue("reduce_scatter", g, [src], [out],
                           lambda s: g.handle.reduceScatter(src.data_ptr(), out.data_ptr(), out.numel(), dtype, red, s),
                           out, finish=lay.finish)

    def all_to_all_async(self, t, group, split_dim, concat_dim) -> NcclWork:
        g = self._group("all_to_all", group)
        n = len(group)
        lay = all_to_all_layout(t, n, split_dim, concat_dim)
        src, out = lay.src, lay.src.new_empty(lay.out_shape)
        count, item = src.numel() // n, src.element_size()
        dtype, _ = self._enum(src.dtype)

        def call(s):  # NCCL has no all-to-all: n sends and n receives in one group call
            self.nccl.groupStart()
            try:
                for j in range(n):
                    g.handle.send(src.data_ptr() + j * count * item, count, dtype, j, s)
                    g.handle.recv(out.data_ptr() + j * count * item, count, dtype, j, s)
            finally:
                self.nccl.groupEnd()

        return self._issue("all_to_all", g, [src], [out], call, out, finish=lay.finish)

    def start(self, kind: str, t, group, **kw):
        """``kind`` (all_reduce, all_gather, reduce_scatter, all_to_all) issued without waiting;
        the work's ``wait()`` gives the result (the overlap's asynchronous interface)."""
        if len(group) == 1:
            return _Ready(t)
        if kind not in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
            raise PlanError(f"no asynchronous {kind} on NCCL", hint="the plan is corrupt or from a newer sbpc")
        return getattr(self, f"{kind}_async")(t, group, **kw)

    def post_recv(self, shape, dtype, peer, tag=0, what="recv"):
        """A receive posted now on the pair's stream (before its task runs); ``wait()`` gives it."""
        g = self._pair(what, peer, self.rank)
        out = torch.empty(shape, dtype=dtype, device=self.device)
        kind, _ = self._enum(dtype)
        frm = g.spec.ranks.index(peer)
        return self._issue(what, g, [], [out], lambda s: g.handle.recv(out.data_ptr(), out.numel(), kind, frm, s), out)

    # --- the Communicator interface ----------------------------------------------------------

    def all_reduce(self, t, group, op="sum"):
        return t if len(group) == 1 else self.all_reduce_async(t, group, op).wait()

    def all_gather(self, t, group, dim):
        return t if len(group) == 1 else self.all_gather_async(t, group, dim).wait()

    def reduce_scatter(self, t, group, dim, op="sum"):
        return t if len(group) == 1 else self.reduce_scatter_async(t, group, dim, op).wait()

    def all_to_all(self, t, group, split_dim, concat_dim):
        return t if len(group) == 1 else self.all_to_all_async(t, group, split_dim, concat_dim).wait()

    def _pair(self, what: str, src: int, dst: int) -> _Group:
        found = self.pairs.get((src, dst))
        if found is None:
            raise PlanError(f"{what}: rank {self.rank} has no NCCL communicator for rank {src} -> rank {dst}",
                            hint="transfers run between the stages of one pp group; the plan is corrupt or for another mesh")
        return found

    def send(self, t, peer, tag=0, what="send"):
        """Issue the send; the handle's ``wait()`` orders the compute stream after it. NCCL
        matches sends and receives of a pair in issue order (it has no tags)."""
        g = self._pair(what, self.rank, peer)
        src = t.detach().contiguous()
        dtype, _ = self._enum(src.dtype)
        to = g.spec.ranks.index(peer)
        return self._issue(what, g, [src], [], lambda s: g.handle.send(src.data_ptr(), src.numel(), dtype, to, s), None)

    def recv(self, shape, dtype, peer, tag=0, what="recv"):
        return self.post_recv(shape, dtype, peer, tag, what).wait()

    def broadcast(self, t, src):
        if self.world_size == 1:
            return t
        if self.gloo is None:
            raise RuntimeFailure("broadcast needs the gloo process group", hint="start ranks with sbpc run or torchrun")
        return self.gloo.broadcast(t.detach().cpu(), src).to(self.device)  # rare (checks): not worth a world NCCL communicator

    def gather_objects(self, obj, dst=0):
        """Over gloo, with tensors on the CPU in transit (a pickled CUDA tensor would land on the
        sender's device index in the receiver) and back on this rank's GPU after."""
        if self.world_size == 1:
            return [obj]
        host = tree_map(lambda x: x.detach().cpu() if isinstance(x, torch.Tensor) else x, obj)
        parts = self.gloo.gather_objects(host, dst)
        if parts is None:
            return None
        return [tree_map(lambda x: x.to(self.device) if isinstance(x, torch.Tensor) else x, p) for p in parts]

    def synchronize(self) -> None:
        """Wait on the host until the compute stream (and every communication it waits for) is
        done, bounded by the watchdog instead of a blocking ``cudaStreamSynchronize``."""
        event = torch.cuda.Event()
        event.record(self.compute)
        while not event.query():
            self.watchdog.raise_if_failed()
            time.sleep(0.001)

    def barrier(self):
        self.synchronize()
        if self.world_size > 1:
            self.gloo.barrier()

    def self_transfer(self, t: torch.Tensor) -> torch.Tensor:
        """A send to this rank and its receive, in one NCCL group call (NCCL's only way to
        send to oneself without waiting on itself): the GPU check's test of send/recv."""
        g = self._group("send/recv to self", (self.rank,))
        src = t.detach().contiguous()
        out = torch.empty_like(src)
        dtype, _ = self._enum(src.dtype)

        def call(s):
            self.nccl.groupStart()
            try:
                g.handle.send(src.data_ptr(), src.numel(), dtype, 0, s)
                g.handle.recv(out.data_ptr(), out.numel(), dtype, 0, s)
            finally:
                self.nccl.groupEnd()

        return self._issue("send/recv to self", g, [src], [out], call, out).wait()


def self_communicator(device: torch.device, *, timeout: float = 60.0, nccl=None) -> NcclCommunicator:
    """A one-rank communicator whose group ``(0,)`` is a real one-rank NCCL communicator (a mesh
    never makes one: its collectives are the identity), so one GPU can run NCCL's calls: the
    GPU check (bench/gpu_check.py) uses it."""
    nccl = nccl or load_nccl()
    comm = NcclCommunicator(Topology((), 0), device, store=None, timeout=timeout, nccl=nccl)
    spec = CommSpec((0,), "self")
    comm.groups[(0,)] = _Group(spec, nccl.NcclCommunicator(1, nccl.get_unique_id(), 0), torch.cuda.Stream(device))
    return comm

