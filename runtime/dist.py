"""Ranks over torch.distributed with gloo: joining the process group, one subgroup per mesh-axis
group, and collectives whose failures name the operation, the axis and the peer.

Both ways of starting ranks end here: the local launcher (``runtime.launch``, which hosts the
rendezvous store in the parent and sets ``SBPC_STORE=client``) and torchrun / slurm (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` from the environment, rendezvous ``env://``).

A rank that fails writes its one-line error under ``sbpc/failed/<rank>`` in the rendezvous
store before it exits; a peer whose collective then breaks (connection closed, or no answer
within the timeout) reads that key, so its own error names the rank that failed first.
"""
from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from sbpc.errors import PlanError, RuntimeFailure, SbpcError, UsageError
from sbpc.runtime.backend import Communicator, Work
from sbpc.runtime.topology import Topology

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def _all_reduce_options(op: str) -> dist.AllreduceOptions:
    opts = dist.AllreduceOptions()
    opts.reduceOp = _OPS[op]
    return opts


# the issued all-reduce calls the process group itself with these (dist.all_reduce's checks
# and logging wrappers cost 20-30 us of the rank's thread per call, 8 calls a tensor-parallel step)
_ALL_REDUCE_OPTIONS = {op: _all_reduce_options(op) for op in _OPS}
_FAILED_KEY = "sbpc/failed/{}"


class _State:
    store = None  # the rendezvous store, for failure keys
    timeout: float = 300.0
    leave_hard = False  # this process is a torchrun rank: it ends with os._exit (exit_code)


def under_torchrun() -> bool:
    """Whether this process was started by torchrun, slurm or another launcher that sets RANK and
    WORLD_SIZE (then ``sbpc run`` joins that group instead of spawning ranks)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def env_world_size() -> int:
    return _env_int("WORLD_SIZE")


def _env_int(name: str) -> int:
    value = os.environ.get(name, "")
    try:
        return int(value)
    except ValueError:
        raise RuntimeFailure(f"environment variable {name}={value!r} is not an integer",
                             hint="launch with torchrun, or unset RANK and WORLD_SIZE to let sbpc spawn the ranks") from None


def init_process_group(timeout: float) -> None:
    """Join the gloo process group described by the environment (idempotent). ``timeout``
    bounds the rendezvous and every later collective."""
    if dist.is_initialized():
        return
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), os.environ.get("MASTER_PORT", "")
    td = timedelta(seconds=timeout)
    try:
        if os.environ.get("SBPC_STORE") == "client":  # the sbpc launcher hosts the store
            store = dist.TCPStore(addr, int(port), world, is_master=False, timeout=td)
        else:
            store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=td))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=td)
    except Exception as err:
        raise RuntimeFailure(f"rank {rank} could not join the {world}-rank process group at {addr}:{port}: "
                             f"{type(err).__name__}: {_first_line(err)}",
                             hint="every rank must start within --timeout and reach MASTER_ADDR:MASTER_PORT") from err
    _State.store, _State.timeout = store, timeout


def leave_hard_at_exit() -> None:
    """This process is a rank of an outside launcher (torchrun, slurm): its CLI entry point ends
    it with ``os._exit`` (``exit_code``), whatever happens after this call."""
    _State.leave_hard = True


def exit_code(code: int) -> int:
    """The last step of a CLI entry point: ``code`` unchanged, unless this process is a torchrun
    rank (``leave_hard_at_exit``), which then ends with ``os._exit(code)`` after flushing its output.

    Why: gloo's worker threads drop their reference to a finished work object (and so to its
    tensors' Python objects) a moment after the waiter wakes. When that moment falls inside
    interpreter teardown the thread cannot take the GIL, and the process aborts with "terminate
    called without an active exception" (rank 0, after the final gather of results). Spawned ranks
    leave the same way (``runtime.launch.worker_main``). Only the torchrun path asks for it: a
    process that joins a group for a while (a test) keeps its normal exit."""
    if not _State.leave_hard:
        return code
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def init_distributed(mesh, *, timeout: float, backend: str = "cpu") -> Communicator:
    """Join the process group (from the environment) and build the communicator of ``mesh``:
    a Plan, a Topology, or ``[(axis, size), ...]`` in rank order. Refuses a WORLD_SIZE that is
    not the mesh's device count before touching the network. In a rank thread of
    ``runtime.thread_launch.launch_threads`` the communicator is that run's ``ThreadCommunicator``.
    ``backend="cuda"``: NCCL on this rank's GPU (``runtime.nccl``), its unique ids exchanged over
    the rendezvous store; gloo still carries Python objects and the barrier."""
    from sbpc.runtime.thread_launch import rank_thread_communicator

    axes = mesh_axes(mesh)
    in_process = rank_thread_communicator(axes, timeout)
    if in_process is not None:
        if backend != "cpu":
            raise UsageError(f"rank threads run on the cpu backend only, not {backend}",
                             hint="use --ranks processes (one process per GPU) with --backend cuda")
        return in_process
    world = 1
    for _, size in axes:
        world *= size
    if "WORLD_SIZE" in os.environ and env_world_size() != world:
        raise world_size_mismatch(world, env_world_size())
    init_process_group(timeout)
    gloo = GlooCommunicator(Topology(axes, dist.get_rank()), timeout=timeout)
    if backend != "cuda":
        return gloo
    from sbpc.runtime.cuda import local_device
    from sbpc.runtime.nccl import NcclCommunicator

    return NcclCommunicator(gloo.topology, local_device(), store=_State.store, timeout=timeout, gloo=gloo)


def world_size_mismatch(plan_world: int, env_world: int) -> RuntimeFailure:
    return RuntimeFailure(f"plan is for {plan_world} ranks but WORLD_SIZE is {env_world}",
                          hint=f"start {plan_world} processes (e.g. torchrun --nproc-per-node {plan_world}), "
                               f"or recompile the plan for a mesh of {env_world} devices")


def mesh_axes(mesh) -> tuple[tuple[str, int], ...]:
    if isinstance(mesh, Topology):
        return tuple(mesh.axes)
    if hasattr(mesh, "mesh"):  # a Plan
        return tuple((a.name, a.size) for a in mesh.mesh)
    return tuple((str(n), int(s)) for n, s in mesh)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    _State.store = None


def report_failure(rank: int, err: BaseException) -> None:
    """Tell the other ranks (through the store) that this rank failed, and why, in one line.
    Secondary failures (a collective broken by another rank) are not reported."""
    if _State.store is None or getattr(err, "secondary", False):
        return
    try:
        _State.store.set(_FAILED_KEY.format(rank), one_line(err))
    except Exception:
        pass  # the store may be gone already; the launcher still names this rank


def failed_ranks(ranks: Sequence[int], wait: float = 1.0) -> dict[int, str]:
    """The ranks among ``ranks`` that reported a failure, with their one-line errors; waits up to
    ``wait`` seconds for a report to arrive (a dying peer writes it before it closes its sockets)."""
    store = _State.store
    if store is None:
        return {}
    deadline = time.monotonic() + wait
    while True:
        try:
            found = {r: store.get(_FAILED_KEY.format(r)).decode(errors="replace")
                     for r in ranks if store.check([_FAILED_KEY.format(r)])}
        except Exception:
            return {}
        if found or time.monotonic() >= deadline:
            return found
        time.sleep(0.05)


def one_line(err: BaseException) -> str:
    if isinstance(err, SbpcError):
        return str(err)
    return f"{type(err).__name__}: {_first_line(err)}"


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


class GlooCommunicator(Communicator):
    """The communicator of one rank of a process group over gloo.

    At construction every rank creates one subgroup per group of every mesh axis, iterating the
    axes in plan order and ``Topology.groups(axis)`` in order, so all ranks call ``new_group``
    identically (torch requires it). A group that spans the whole world reuses the default
    group; a group of one rank is never created and its collectives are the identity.

    ``reduce_scatter`` uses gloo's own reduce_scatter where this torch has it, and otherwise an
    all_reduce followed by taking this rank's chunk.
    """

    def __init__(self, topology: Topology, *, timeout: float | None = None):
        if not dist.is_initialized():
            raise RuntimeFailure("the gloo communicator needs an initialised process group",
                                 hint="call runtime.dist.init_distributed first")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if topology.world_size != self.world_size or topology.rank != self.rank:
            raise world_size_mismatch(topology.world_size, self.world_size)
        self.topology = topology
        self.timeout = timeout if timeout is not None else _State.timeout
        self._groups: dict[tuple[int, ...], object] = {}
        self._axis: dict[tuple[int, ...], str] = {}
        world = tuple(range(self.world_size))
        td = timedelta(seconds=self.timeout)
        made: set[tuple[int, ...]] = set()
        for axis, _ in topology.axes:
            for group in topology.groups(axis):
                if len(group) == 1 or group in made:
                    continue
                made.add(group)
                pg = dist.group.WORLD if group == world else dist.new_group(list(group), timeout=td, backend="gloo")
                if self.rank in group:
                    self._groups[group], self._axis[group] = pg, axis
        self._native_reduce_scatter = True
        self._world_pg = None

    # --- plumbing -------------------------------------------------------------------------

    def _pg(self, op: str, group: tuple[int, ...]):
        group = tuple(group)
        pg = self._groups.get(group)
        if pg is None:
            if group == tuple(range(self.world_size)):
                return dist.group.WORLD
            raise PlanError(f"{op} over ranks {group}: rank {self.rank} has no process group for them",
                            hint="collectives run along one mesh axis; the plan is corrupt or for another mesh")
        return pg

    def _run(self, op: str, group: tuple[int, ...], fn: Callable[[object], None], *, world: bool = False) -> None:
        pg = dist.group.WORLD if world else self._pg(op, group)
        try:
            fn(pg)
        except SbpcError:
            raise
        except Exception as err:
            raise self._failure(op, tuple(group), err) from err

    def _failure(self, op: str, group: tuple[int, ...], err: Exception) -> RuntimeFailure:
        axis = self._axis.get(group)
        where = f"{op} over mesh axis {axis} (ranks {group})" if axis else f"{op} with ranks {group}"
        peers = [r for r in group if r != self.rank]
        failed = failed_ranks(peers)
        text = _first_line(err)
        timed_out = "timeout" in text.lower() or "timed out" in text.lower()
        if failed:
            peer = min(failed)
            why = f"rank {peer} failed: {failed[peer]}"
        elif timed_out:
            peer = peers[0] if len(peers) == 1 else None
            who = f"rank {peer}" if peer is not None else f"one of ranks {tuple(peers)}"
            why = f"no answer from {who} within {self.timeout:g}s (it hung or died)"
        else:
            peer = peers[0] if len(peers) == 1 else None
            why = f"{type(err).__name__}: {text}"
        failure = RuntimeFailure(f"{where} failed on rank {self.rank}: {why}",
                                 hint="the first failing rank's error is the cause; raise --timeout if a rank is only slow")
        failure.secondary, failure.peer, failure.timed_out = True, peer, timed_out
        return failure

    # --- collectives ----------------------------------------------------------------------

    def all_reduce(self, t, group, op="sum"):
        if len(group) == 1:
            return t
        out = t.detach().clone(memory_format=torch.contiguous_format)
        self._run("all_reduce", group, lambda pg: dist.all_reduce(out, op=_OPS[op], group=pg))
        return out

    def all_gather(self, t, group, dim):
        if len(group) == 1:
            return t
        src = t.detach().contiguous()
        bufs = [torch.empty_like(src) for _ in group]
        self._run("all_gather", group, lambda pg: dist.all_gather(bufs, src, group=pg))
        return torch.cat(bufs, dim=dim)

    def reduce_scatter(self, t, group, dim, op="sum"):
        n = len(group)
        if n == 1:
            return t
        index = list(group).index(self.rank)
        if self._native_reduce_scatter:
            chunks = [c.contiguous() for c in t.detach().chunk(n, dim=dim)]
            out = torch.empty_like(chunks[index])
            try:
                self._run("reduce_scatter", group, lambda pg: dist.reduce_scatter(out, chunks, op=_OPS[op], group=pg))
                return out
            except RuntimeFailure as err:
                cause = str(err.__cause__ or "").lower()
                if "not supported" not in cause and "unsupported" not in cause and "not implemented" not in cause:
                    raise
                self._native_reduce_scatter = False  # same torch on every rank: all fall back together
        full = self.all_reduce(t, group, op)
        return full.narrow(dim, index * (full.shape[dim] // n), full.shape[dim] // n).clone()

    def all_to_all(self, t, group, split_dim, concat_dim):
        n = len(group)
        if n == 1:
            return t
        src = t.detach().movedim(split_dim, 0).contiguous()  # the chunks to send lie along dim 0
        out = torch.empty_like(src)
        self._run("all_to_all", group, lambda pg: dist.all_to_all_single(out, src, group=pg))
        pieces = [c.movedim(0, split_dim) for c in out.chunk(n, dim=0)]  # piece from member i
        return torch.cat(pieces, dim=concat_dim)

    def start(self, kind, t, group, **kw):
        """gloo's asynchronous collectives (``async_op=True``): the work runs on the process
        group's own thread while this rank computes; ``wait`` names a failure as a blocking
        call would. reduce_scatter without gloo's native one runs blocking (its fallback)."""
        if len(group) == 1 or (kind == "reduce_scatter" and not self._native_reduce_scatter):
            return super().start(kind, t, group, **kw)
        op = kw.get("op", "sum")
        if kind == "all_reduce":
            return self._start_all_reduce(t.detach().clone(memory_format=torch.contiguous_format), group, op)
        if kind == "all_gather":
            src = t.detach().contiguous()
            bufs = [torch.empty_like(src) for _ in group]
            issue, finish = (lambda pg: dist.all_gather(bufs, src, group=pg, async_op=True)), (lambda: torch.cat(bufs, dim=kw["dim"]))
        elif kind == "reduce_scatter":
            chunks = [c.contiguous() for c in t.detach().chunk(len(group), dim=kw["dim"])]
            out = torch.empty_like(chunks[list(group).index(self.rank)])
            issue, finish = (lambda pg: dist.reduce_scatter(out, chunks, op=_OPS[op], group=pg, async_op=True)), (lambda: out)
        else:
            raise PlanError(f"no asynchronous {kind}", hint="the plan is corrupt; recompile it")
        works = []
        self._run(kind, group, lambda pg: works.append(issue(pg)))
        return _Async(self, works[0], kind, tuple(group), finish)

    def start_all_reduce_over(self, t, group, op="sum"):
        """gloo reduces in place: a contiguous ``t`` is the result buffer (no copy, no allocation)."""
        if len(group) == 1 or not t.is_contiguous():
            return self.start("all_reduce", t, group, op=op)
        return self._start_all_reduce(t.detach(), group, op)

    def _start_all_reduce(self, out, group, op):
        works = []
        self._run("all_reduce", group, lambda pg: works.append(pg.allreduce([out], _ALL_REDUCE_OPTIONS[op])))
        return _Async(self, works[0], "all_reduce", tuple(group), lambda: out)

    def send(self, t, peer, tag=0, what="send"):
        src = t.detach().contiguous()
        # the world group's own send (what dist.isend calls after its argument checks): a
        # pipeline sends and posts receives several times per task
        try:
            work = self._world().send([src], peer, tag)
        except Exception as err:
            raise self._failure(what, (self.rank, peer), err) from err
        return _Pending(self, work, what, (self.rank, peer), src)

    def recv(self, shape, dtype, peer, tag=0, what="recv"):
        out = torch.empty(shape, dtype=dtype)
        self._run(what, (peer, self.rank), lambda pg: dist.recv(out, src=peer, tag=tag), world=True)
        return out

    def post_recv(self, shape, dtype, peer, tag=0, what="recv"):
        out = torch.empty(shape, dtype=dtype)
        try:
            work = self._world().recv([out], peer, tag)
        except Exception as err:
            raise self._failure(what, (peer, self.rank), err) from err
        return _Async(self, work, what, (peer, self.rank), lambda: out)

    def _world(self):
        """The default process group (in it, a rank's index is its global rank)."""
        if self._world_pg is None:
            self._world_pg = dist.group.WORLD
        return self._world_pg

    def gather_objects(self, obj, dst=0):
        out = [None] * self.world_size if self.rank == dst else None
        self._run("gather of results", tuple(range(self.world_size)),
                  lambda pg: dist.gather_object(obj, out, dst=dst), world=True)
        return out

    def broadcast(self, t, src):
        out = t.detach().clone(memory_format=torch.contiguous_format)
        self._run("broadcast", tuple(range(self.world_size)), lambda pg: dist.broadcast(out, src=src), world=True)
        return out

    def barrier(self):
        self._run("barrier", tuple(range(self.world_size)), lambda pg: dist.barrier(), world=True)


class _Async(Work):
    """A collective issued with ``async_op=True``; ``wait`` turns a failure into a named error."""

    def __init__(self, comm: GlooCommunicator, work, kind: str, group: tuple[int, ...], finish: Callable[[], torch.Tensor]):
        self.comm, self.work, self.kind, self.group, self.finish = comm, work, kind, group, finish

    def wait(self) -> torch.Tensor:
        try:
            self.work.wait()
        except Exception as err:
            raise self.comm._failure(self.kind, self.group, err) from err
        return self.finish()


class _Pending:
    """A send in flight; ``wait`` turns a dead or silent receiver into a named error."""

    def __init__(self, comm: GlooCommunicator, work, what: str, group: tuple[int, ...], keep: torch.Tensor):
        self.comm, self.work, self.what, self.group, self.keep = comm, work, what, group, keep

    def wait(self) -> None:
        try:
            self.work.wait()
        except Exception as err:
            raise self.comm._failure(self.what, self.group, err) from err
