"""The backend interface: kernels plus a communicator.

The executor only talks to a ``Backend``: it asks for the kernel of an op name and for the
communicator of the run. ``cpu`` is torch CPU + gloo; ``cuda`` (``runtime/cuda.py``: torch CUDA
kernels, ``runtime/nccl.py``: NCCL via CuPy; never run on a GPU yet) implements the same two
pieces, without touching the executor.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from functools import lru_cache, partial
from typing import Callable

import torch

from sbpc.errors import PlanError, UsageError
from sbpc.runtime import init_ops  # noqa: F401  registers torch.ops.sbpc.trunc_normal_, which init programs call
from sbpc.runtime import input_checks  # noqa: F401  registers torch.ops.sbpc.check_input, which steps call
from sbpc.runtime.topology import Topology


class Communicator(ABC):
    """Collectives over process groups, one instance per rank.

    A group is the tuple of global ranks along one mesh axis (e.g. the tp ranks of a dp row);
    the plan names groups, the communicator owns the transport (gloo, NCCL). Every member of
    the group calls the same collective with same-shaped tensors; position in the tuple is the
    member's index. Results are new tensors (inputs are never modified):

    - ``all_reduce``: elementwise sum (``op="max"``: maximum) over the members.
    - ``all_gather``: the members' tensors concatenated along ``dim`` in group order.
    - ``reduce_scatter``: this member's contiguous chunk along ``dim`` (of ``len(group)`` equal
      chunks) of the ``all_reduce``.
    - ``all_to_all``: ``t`` cut into ``len(group)`` contiguous chunks along ``split_dim``; chunk j
      goes to member j; the received chunks are concatenated along ``concat_dim`` in group order.
    - ``send`` / ``recv``: point to point with a global rank, matched by ``tag``. ``send`` does
      not wait for the receiver: it returns a handle whose ``wait()`` does. ``what`` names the
      transfer (value and task) for the error when the peer dies or never answers.
    - ``gather_objects``: every rank's picklable object, as a list on ``dst`` (None elsewhere).
    - ``broadcast``: ``t`` from rank ``src`` on every rank.
    - ``post_recv``: ``recv`` posted early (a pipeline posts the next task's receives before
      it runs the current one); its ``wait()`` gives the tensor.
    - ``start``: ``all_reduce``, ``all_gather`` or ``reduce_scatter`` (``kind``) issued without
      waiting; the returned work's ``wait()`` gives the result. Every member issues the group's
      collectives in one order (the plan's); between issue and wait the rank computes on. The
      default runs the collective at once (a transport without asynchronous calls).
    """

    rank: int
    world_size: int

    @abstractmethod
    def all_reduce(self, t: torch.Tensor, group: tuple[int, ...], op: str = "sum") -> torch.Tensor: ...

    @abstractmethod
    def all_gather(self, t: torch.Tensor, group: tuple[int, ...], dim: int) -> torch.Tensor: ...

    @abstractmethod
    def reduce_scatter(self, t: torch.Tensor, group: tuple[int, ...], dim: int, op: str = "sum") -> torch.Tensor: ...

    @abstractmethod
    def all_to_all(self, t: torch.Tensor, group: tuple[int, ...], split_dim: int, concat_dim: int) -> torch.Tensor: ...

    @abstractmethod
    def send(self, t: torch.Tensor, peer: int, tag: int = 0, what: str = "send"): ...

    @abstractmethod
    def recv(self, shape: list[int], dtype: torch.dtype, peer: int, tag: int = 0, what: str = "recv") -> torch.Tensor: ...

    @abstractmethod
    def gather_objects(self, obj, dst: int = 0) -> list | None: ...

    @abstractmethod
    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor: ...

    @abstractmethod
    def barrier(self) -> None: ...

    def start(self, kind: str, t: torch.Tensor, group: tuple[int, ...], **kw) -> Work:
        return Done(getattr(self, kind)(t, group, **kw))

    def start_all_reduce_over(self, t: torch.Tensor, group: tuple[int, ...], op: str = "sum") -> Work:
        """An all-reduce whose result may be written over ``t`` (the caller holds ``t`` for
        nothing else): no buffer of its own. A transport without an in-place path makes one."""
        return self.start("all_reduce", t, group, op=op)

    def post_recv(self, shape: list[int], dtype: torch.dtype, peer: int, tag: int = 0, what: str = "recv") -> Work:
        """A receive posted before its value is needed; ``wait()`` gives the tensor. The default
        receives at the wait (a transport whose messages wait in a mailbox anyway)."""
        return _LaterRecv(self, shape, dtype, peer, tag, what)


class Work(ABC):
    """A collective in flight (``Communicator.start``)."""

    @abstractmethod
    def wait(self) -> torch.Tensor: ...


class Done(Work):
    """A collective that already finished."""

    def __init__(self, value: torch.Tensor):
        self.value = value

    def wait(self) -> torch.Tensor:
        return self.value


class _LaterRecv(Work):
    def __init__(self, comm: Communicator, shape, dtype, peer: int, tag: int, what: str):
        self.comm, self.args = comm, (shape, dtype, peer, tag, what)

    def wait(self) -> torch.Tensor:
        return self.comm.recv(*self.args)


class LocalCommunicator(Communicator):
    """The communicator of a one-device mesh: every group is this rank alone, so every
    collective is the identity and there is no peer to send to."""

    rank = 0
    world_size = 1

    def _only_me(self, group: tuple[int, ...]) -> None:
        if tuple(group) != (0,):
            raise PlanError(f"a one-process run cannot communicate with ranks {tuple(group)}",
                            hint="launch as many ranks as the plan's mesh has devices")

    def all_reduce(self, t, group, op="sum"):
        self._only_me(group)
        return t

    def all_gather(self, t, group, dim):
        self._only_me(group)
        return t

    def reduce_scatter(self, t, group, dim, op="sum"):
        self._only_me(group)
        return t

    def all_to_all(self, t, group, split_dim, concat_dim):
        self._only_me(group)
        return t

    def send(self, t, peer, tag=0, what="send"):
        self._only_me((peer,))

    def recv(self, shape, dtype, peer, tag=0, what="recv"):
        self._only_me((peer,))
        raise PlanError("a one-process run has nothing to receive")

    def gather_objects(self, obj, dst=0):
        return [obj]

    def broadcast(self, t, src):
        self._only_me((src,))
        return t

    def barrier(self) -> None:
        pass


def single_device_topology() -> Topology:
    """The topology of a one-device run: no axes, rank 0 (every axis has size 1)."""
    return Topology((), 0)


class Backend(ABC):
    """Kernels, the communicator of this rank and where the rank sits in the mesh."""

    name: str
    device: torch.device

    def __init__(self, communicator: Communicator, topology: Topology | None = None):
        self.communicator = communicator
        if topology is None:  # a GlooCommunicator knows its mesh
            topology = getattr(communicator, "topology", None) or single_device_topology()
        self.topology = topology
        if self.topology.world_size != communicator.world_size and self.topology.axes:
            raise PlanError(f"the mesh {dict(self.topology.axes)} has {self.topology.world_size} devices "
                            f"but the communicator spans {communicator.world_size} ranks",
                            hint="build the communicator for the plan's mesh")
        self._cache: dict[str, Callable] = {}
        self._own: dict[str, Callable] | None = None
        # the micro-batch being computed and how many a step has (``shard_slice`` over "mb")
        self.microbatch, self.microbatches = 0, 1
        # a pipelined step's generator state before each of its random draws (runtime/rng.py)
        self.rng_states: list[torch.Tensor] | None = None
        # issued collectives since the last take_flights: (kind, axis, issued, waited), wall clock
        self.flights: list[tuple[str, str, float, float]] = []

    def take_flights(self) -> list[tuple[str, str, float, float]]:
        """The collectives issued and waited for since the last call (the timeline's comm rows)."""
        out, self.flights = self.flights, []
        return out

    def kernel(self, op: str) -> Callable:
        fn = self._cache.get(op)
        if fn is None:
            fn = self._cache[op] = self._resolve(op)
        return fn

    def _resolve(self, op: str) -> Callable:
        if self._own is None:
            self._own = self.kernels()
        own = self._own
        if op in own:
            return own[op]
        kernel = torch_op(op)
        if kernel is None:
            raise PlanError(f"backend {self.name} has no kernel for op {op}",
                            hint="the plan was compiled by a newer torch or sbpc; recompile it here")
        schema = kernel._schema
        if op == FUSED_ADAMW:
            return partial(_fused_adamw, kernel._op)
        if schema.is_mutable and not schema.returns:  # _foreach_*_: the overwritten list is the result
            return partial(_first_argument, kernel._op)  # the C++ op: no OpOverload frame
        return kernel

    @abstractmethod
    def kernels(self) -> dict[str, Callable]:
        """Backend-specific kernels of the device-neutral ``sbpc.*`` ops."""

    def host_backend(self) -> Backend:
        """The backend the init program runs on (the weights must be eager's CPU init bit for
        bit); the Runner moves its tensors to ``device``."""
        return self

    # Memory transfers (``sbpc.to_host`` / ``sbpc.to_device``, derived by boxing where a value
    # crosses from a device placement to a host one: optimizer offload). Always a new tensor,
    # never an alias, so the two sides never share a storage even where (cpu) they are one
    # memory. A cuda backend overrides ``to_host`` to copy into pinned memory, which makes the
    # copies asynchronous-capable and faster.
    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of ``t`` in host memory."""
        out = torch.empty(t.shape, dtype=t.dtype, device="cpu")
        return out.copy_(t)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of host tensor ``t`` in this backend's device memory."""
        out = torch.empty(t.shape, dtype=t.dtype, device=self.device)
        return out.copy_(t)


def _first_argument(kernel, first, *args, **kwargs):
    kernel(first, *args, **kwargs)
    return first


# torch's fused AdamW (the ``fuse-adamw`` pass): it overwrites the parameters, exp_avgs and
# exp_avg_sqs (arguments 0, 2 and 3) and returns nothing; its results in a plan are those lists
FUSED_ADAMW = "aten._fused_adamw_.default"
OVERWRITTEN_LISTS = {FUSED_ADAMW: (0, 2, 3)}


def _fused_adamw(kernel, params, grads, exp_avgs, exp_avg_sqs, *args, **kwargs):
    """The CPU kernel walks each tensor's storage in memory order, so a transposed (strided)
    gradient would be read in the wrong order: such a tensor goes in as a contiguous copy (a
    written one is copied back). Plans' gradients are contiguous as a rule (a weight gradient's
    ``t(t(mm))`` is), so this costs nothing there. The CUDA kernel also refuses a gradient or
    state whose strides are not its parameter's, which two contiguous tensors can differ in
    along a dim of size 1 ((1, 4) as ``(4, 1)`` or ``(1, 1)``): the test is row-major strides.

    The plan's ``lr`` is the step's learning rate input, a float64 0-d tensor; the kernel takes a
    number, as torch.optim's ``AdamW(fused=True)`` passes its Python float, so the kernel runs
    torch.optim's float-lr arithmetic (on cuda, reading the value waits for the 8 bytes).

    The step counts go in as float32, as torch.optim keeps a fused optimizer's ``step``: the
    CUDA kernel reads each one's memory as a C float whatever its dtype, so the plan's float64
    counter would be read as its low 4 bytes (0.0 for every step up to 2^21: a bias correction
    of 0 and parameters of inf/NaN). The CPU kernel converts; float32 gives it the same value."""
    if isinstance(kwargs.get("lr"), torch.Tensor):
        kwargs = {**kwargs, "lr": kwargs["lr"].item()}
    args = _float32_steps(args)
    lists = [params, grads, exp_avgs, exp_avg_sqs]
    if all(_row_major(t) for ts in lists for t in ts):
        kernel(params, grads, exp_avgs, exp_avg_sqs, *args, **kwargs)
        return [*params, *exp_avgs, *exp_avg_sqs]
    dense = [[t if _row_major(t) else t.clone(memory_format=torch.contiguous_format) for t in ts] for ts in lists]
    kernel(*dense, *args, **kwargs)
    for k in (0, 2, 3):
        for t, d in zip(lists[k], dense[k]):
            if d is not t:
                t.copy_(d)
    return [*params, *exp_avgs, *exp_avg_sqs]


def _row_major(t: torch.Tensor) -> bool:
    """``t``'s strides are those of a new contiguous tensor of its shape (size-1 dims included).
    Asked of every tensor of the update every step (4 per parameter), so the common case is
    answered in C: torch's contiguity ignores only the strides of size-1 dims (and all of an
    empty tensor's), so without such dims it is exactly this test."""
    shape = t.shape
    if 1 not in shape and 0 not in shape:
        return t.is_contiguous()
    expected, step = [], 1
    for size in reversed(t.shape):
        expected.append(step)
        step *= max(size, 1)
    return t.stride() == tuple(reversed(expected))


def _float32_steps(args: tuple) -> tuple:
    """``(max_exp_avg_sqs, state_steps)`` with every step a float32 tensor (each distinct
    tensor converted once: a plan passes its one counter once per parameter)."""
    if len(args) < 2:
        return args
    max_exp_avg_sqs, steps, *rest = args
    converted: dict[int, torch.Tensor] = {}
    out = []
    for s in steps:
        if s.dtype != torch.float32:
            if id(s) not in converted:  # not setdefault: its default would convert every time
                converted[id(s)] = s.to(torch.float32)
            s = converted[id(s)]
        out.append(s)
    return (max_exp_avg_sqs, out, *rest)


@lru_cache(maxsize=None)
def returns_list(op: str) -> bool:
    """The kernel returns a list of tensors (``unbind``, ``split``, ``_foreach_*``): a plan names
    each element, and a list of one element is still a list to unpack."""
    overload = torch_op(op)
    if overload is None:
        return False
    schema = overload._schema
    returns = schema.returns or (schema.arguments[:1] if schema.is_mutable else [])  # _foreach_*_ returns its first list
    return op in OVERWRITTEN_LISTS or (len(returns) == 1 and isinstance(returns[0].type, torch.ListType))


def torch_op(op: str):
    """``"aten.mm.default"`` -> ``torch.ops.aten.mm.default``, or None when torch has no such op."""
    try:
        namespace, packet, overload = op.split(".")
        return getattr(getattr(getattr(torch.ops, namespace), packet), overload)
    except (ValueError, AttributeError, RuntimeError):
        return None


def make_backend(name: str, communicator: Communicator | None = None, topology: Topology | None = None) -> Backend:
    """The backend ``name`` over ``communicator`` (default: the one-device LocalCommunicator) at
    ``topology`` (default: the communicator's ``topology`` if it has one, else a one-device
    mesh, rank 0)."""
    check_backend_name(name)
    if name == "cuda":
        from sbpc.runtime.cuda import CudaBackend

        return CudaBackend(communicator or LocalCommunicator(), topology)
    from sbpc.runtime.cpu import CpuBackend

    return CpuBackend(communicator or LocalCommunicator(), topology)


BACKENDS = ("cpu", "cuda")


def check_backend_name(name: str) -> None:
    if name not in BACKENDS:
        raise UsageError(f"backend {name!r} is not available", hint="available: " + ", ".join(BACKENDS))
