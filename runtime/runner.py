"""Run a plan step by step: weights, optimizer state, batches, loss.

The runtime never imports the compiler. It imports the model file only to call
``example_batch`` for synthetic batches, which is plain PyTorch.

On a mesh of many ranks each rank holds only its shards: parameters and buffers come from the
seeded init program (identical logical tensors on every rank) or a weights file, cut with
``sharding.local_shard`` by their nd-SBP at this rank's coordinates; optimizer states start as
zeros of the local shape; each step's logical batch is cut the same way. Values leave the rank
in logical form only through ``Runner.gather`` (the loss for reporting, gradients with
``keep_grads``, ``logical_params`` / ``logical_weights`` for checks and checkpoints,
``logical_states`` for `sbpc check`, which compares each step's optimizer update).
"""
from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from sbpc.errors import ModelError, RuntimeFailure
from sbpc.runtime.backend import Backend, torch_op
from sbpc.runtime.executor import Program
from sbpc.runtime.kinds import MemoryKind
from sbpc.runtime.model_file import batch_tuple, import_model_file
from sbpc.runtime.overlap import check_plan as check_issue_order
from sbpc.runtime.plan import GRAD_NORM, LR, Plan, TensorSpec
from sbpc.runtime.rng import draws, replay
from sbpc.runtime.sbp import Broadcast, NdSbp, Partial, Split, local_shape, parse_nd_sbp
from sbpc.runtime.sharding import combine, local_shard, pad_to, unpad
from sbpc.runtime.weights import init_weights


@dataclass(frozen=True)
class Firing:
    """One actor firing on this rank, for the timeline (wall-clock seconds, comparable
    between the processes of one machine)."""
    task: str  # "F1.3": forward of chunk 1, micro-batch 3; "step" for a one-program plan
    start: float
    end: float
    step: int
    stream: str = "compute"  # "comm dp": a collective in flight on axis dp (issue to wait)


class Timeline:
    """The actor firings of a run, for ``--trace``. It records only when asked
    (``make_runner(..., timeline=True)``): a training run of many steps would otherwise keep
    every firing of every step (thousands a step under a pipeline schedule) until it ends."""

    def __init__(self, on: bool):
        self.on = on
        self.firings: list[Firing] = []

    def record(self, label: str | Callable[[], str], start: float, step: int, backend: Backend) -> None:
        """One firing that began at ``start`` and ends now, with the collectives that completed
        in it. The backend's list of those is emptied either way, so it cannot grow either."""
        flights = backend.take_flights()
        if not self.on:
            return
        self.firings.append(Firing(label if isinstance(label, str) else label(), start, time.time(), step))
        self.firings += [Firing(name, a, b, step, f"comm {axis}") for name, axis, a, b in flights]


@dataclass(frozen=True)
class LocalBatch:
    """A batch already cut for this rank: each batch input as ``Runner.batch_part`` cuts it (a
    data loader that reads only this rank's rows hands these to ``step``)."""
    tensors: tuple[torch.Tensor, ...]


@dataclass
class StepResult:
    loss: float
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    # the global norm of the gradients before clipping, on every rank, where the plan computes it
    # (compiled with --clip-grad); None where it does not
    grad_norm: float | None = None


def _import_library_ops(plan: Plan) -> None:
    """A plan may name ops that a library registers with torch when it is imported (Hugging
    Face's ``transformers.grouped_mm_fallback``): a fresh rank process has not imported it. The
    model file imports it, so it is run once (as for its batches) when torch lacks one of them."""
    ops = {i.op for s in plan.stages for i in s.instructions} | {i.op for i in plan.init.instructions}
    missing = sorted(op for op in ops if not op.startswith("sbpc.") and torch_op(op) is None)
    if not missing:
        return
    try:
        import_model_file(plan.model.path, "_sbpc_ops_")
    except Exception as e:  # the kernel lookup would then fail with a less useful message
        raise ModelError(f"the plan names {missing[0]}, which torch has not registered, and importing its model file "
                         f"{plan.model.path} (which registers it) failed: {type(e).__name__}: {e}",
                         hint="run from the directory the plan was compiled in, with the model's libraries "
                              "installed") from None


class Runner:
    """Holds one rank's parameters, buffers and optimizer state, and steps the plan."""

    def __init__(self, plan: Plan, backend: Backend, *, seed: int = 0, weights: dict[str, torch.Tensor] | None = None,
                 timeline: bool = False):
        self._bind(plan, backend, timeline)
        if len(plan.stages) != 1 or plan.pipeline is not None:
            raise RuntimeFailure(f"plan has {len(plan.stages)} pipeline stages; Runner runs one",
                                 hint="use runtime.pipeline.PipelineRunner (make_runner picks it)")
        stage = plan.stages[0]
        specs = [*plan.params, *plan.buffers, *plan.states, *plan.batch, *plan.hyper]
        # outputs: the loss, then each param's gradient and update, each state's update, each
        # written buffer's new value, the metrics
        outputs = [stage.loss, *(p.grad for p in plan.params), *(p.update for p in plan.params),
                   *(s.update for s in plan.states), *(b.update for b in plan.written_buffers), *plan.metrics.values()]
        self.program = Program(stage.instructions, [s.value for s in specs], outputs, backend,
                               name=f"stage{stage.stage}")
        types = {o: t for ins in stage.instructions for o, t in zip(ins.outs, ins.types)}
        self.loss_sbp = self._value_sbp(types.get(stage.loss))
        self.metric_sbp = {name: self._value_sbp(types.get(v)) for name, v in plan.metrics.items()}
        self.grad_sbp = {p.name: self._value_sbp(types.get(p.grad), fallback=p) for p in plan.params}
        self._load(weights, seed, {p.name for p in plan.params}, {b.name for b in plan.buffers},
                   {s.name for s in plan.states})
        self.steps = 0

    def _bind(self, plan: Plan, backend: Backend, timeline: bool) -> None:
        check_issue_order(plan)  # an edited plan whose waits would hang fails here, on every rank
        _import_library_ops(plan)
        if plan.world_size != backend.communicator.world_size:
            raise RuntimeFailure(f"plan is for {plan.world_size} ranks but this run has {backend.communicator.world_size}",
                                 hint="launch as many ranks as the plan's mesh has devices")
        axes = tuple((a.name, a.size) for a in plan.mesh)
        if plan.world_size > 1 and tuple(backend.topology.axes) != axes:
            raise RuntimeFailure(f"plan's mesh {dict(axes)} is not the backend's mesh {dict(backend.topology.axes)}",
                                 hint="build the communicator with runtime.dist.init_distributed(plan, ...)")
        self.plan, self.backend = plan, backend
        self.timeline = Timeline(timeline)
        self.written_buffers = plan.written_buffers  # asked every step: listed once
        self.topology = backend.topology
        self.coords, self.sizes = self.topology.sbp_coords(), self.topology.sbp_sizes()
        specs = [*plan.params, *plan.buffers, *plan.states, *plan.batch]
        self.spec_sbp = {s.name: self._nd(s.sbp) for s in specs}
        self._draws = draws([ins for prog in plan.stages for ins in prog.instructions])
        # what leaves the runtime is logical: a ZeRO-padded state (and gradient) is cut back to
        # its parameter's shape
        self.logical_shape = {**{p.name: p.shape for p in plan.params},
                              **{s.name: s.unpadded or s.shape for s in plan.states}}

    def _seed_step(self, rng_seed: int | None) -> None:
        """Seed torch's RNG as eager's step is seeded; a pipelined plan then replays the step's
        draws and keeps the generator state before each (runtime/rng.py)."""
        if rng_seed is not None:
            torch.manual_seed(rng_seed)
        if self._draws:
            self.backend.rng_states = replay(self._draws)

    def _load(self, weights, seed: int, params: set[str], buffers: set[str], states: set[str]) -> None:
        """This rank's shards of the named params and buffers, and zeroed optimizer states."""
        dev = self.backend.device
        # the step overwrites parameters in place (the compiler's inplace pass): not a caller's tensors
        tensors = dict(weights) if weights is not None else init_weights(self.plan, self.backend, seed)
        scaling = self.plan.precision.loss_scaling
        fill = lambda s: scaling.init_scale if s.init == "loss_scale" and scaling is not None else 0

        def state(s) -> torch.Tensor:
            if s.init == "param":  # a host copy of its parameter (optimizer offload), cut by its own SBP
                return self._place(self._shard(pad_to(tensors[s.copies], s.shape), s), s)
            return self._place(torch.full(local_shape(s.shape, self.spec_sbp[s.name], self.sizes), fill(s),
                                          dtype=getattr(torch, s.dtype), device=dev), s)

        self.states = {s.name: state(s) for s in self.plan.states if s.name in states}
        self.params = {p.name: _owned(self._place(self._shard(tensors.pop(p.name), p), p), weights)
                       for p in self.plan.params if p.name in params}
        self.buffers = {b.name: self._place(self._shard(tensors.pop(b.name), b), b) for b in self.plan.buffers
                        if b.name in buffers}
        del tensors

    def _place(self, t: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
        """``t`` in the memory the plan holds ``spec`` in (host: the offloaded optimizer's state)."""
        return self.backend.to_host(t) if spec.memory == MemoryKind.HOST else t.to(self.backend.device)

    def _nd(self, sbp: list[str]) -> NdSbp:
        """The nd-SBP of a plan entry, one per sbp axis of the mesh (missing entries: B)."""
        nd = parse_nd_sbp(sbp) if sbp else ()
        n = len(self.topology.sbp_axes)
        return tuple(nd[:n]) + (Broadcast(),) * (n - len(nd)) if n else nd

    def _value_sbp(self, vtype, fallback: TensorSpec | None = None) -> NdSbp:
        """The nd-SBP of a program value from the type of the instruction that defines it."""
        if vtype is not None and vtype.sbp:
            return self._nd(vtype.sbp)
        return self._nd(fallback.sbp if fallback is not None else [])

    def _shard(self, t: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
        """This rank's shard of the logical tensor of ``spec``."""
        if not self.sizes:
            return t
        return local_shard(t, self.spec_sbp[spec.name], self.coords, self.sizes)

    def batch_part(self, t: torch.Tensor, i: int) -> torch.Tensor:
        """This rank's part of logical batch input ``i``: what ``step`` feeds its program (a
        ``LocalBatch`` holds these)."""
        return self._shard(t, self.plan.batch[i])

    def _hyper(self, lr: float | None) -> dict[str, torch.Tensor]:
        """The step's scalar inputs by value: the learning rate ``lr`` (None: the plan's
        ``optimizer.lr``) as a float64 0-d tensor, torch.optim's Python float, where the update
        runs (the host under optimizer offload)."""
        lr = self.plan.optimizer.lr if lr is None else lr
        if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not math.isfinite(lr) or lr < 0:
            raise RuntimeFailure(f"learning rate {lr!r} is not a finite number >= 0",
                                 hint="pass step(lr=) a float, or None for the plan's optimizer.lr")
        values = {LR: float(lr)}
        return {s.value: self._place(torch.tensor(values[s.name], dtype=torch.float64), s) for s in self.plan.hyper}

    def step(self, batch: tuple[torch.Tensor, ...] | LocalBatch, *, rng_seed: int | None = None,
             keep_grads: bool = False, lr: float | None = None) -> StepResult:
        """One training step on the logical ``batch`` (or this rank's ``LocalBatch`` of it).
        ``rng_seed`` seeds torch's RNG first, so dropout masks are those of an eager step seeded
        the same way (the program draws them in eager's order). ``lr`` is the step's learning
        rate (None: the plan's ``optimizer.lr``), what torch.optim reads from
        ``param_groups[i]["lr"]``: a schedule sets it each step."""
        self._check_batch(batch)
        hyper = self._hyper(lr)
        self._seed_step(rng_seed)
        parts = batch.tensors if isinstance(batch, LocalBatch) else \
            [self.batch_part(b, i) for i, b in enumerate(batch)]
        env = [*self.params.values(), *self.buffers.values(), *self.states.values(),
               *(b.to(self.backend.device) for b in parts), *hyper.values()]
        start = time.time()
        loss, *rest = self.program.run(env)
        self.timeline.record("step", start, self.steps, self.backend)
        self.steps += 1
        n = len(self.plan.params)
        grads = {name: unpad(self.gather(g, self.grad_sbp[name]), self.logical_shape[name])
                 for name, g in zip(self.params, rest[:n])} if keep_grads else {}
        self.params = dict(zip(self.params, rest[n:2 * n]))
        rest = rest[2 * n:]
        self.states = dict(zip(self.states, rest[:len(self.states)]))
        rest = rest[len(self.states):]
        written = self.written_buffers
        self.buffers.update((b.name, t) for b, t in zip(written, rest[:len(written)]))
        metrics = {name: float(self.gather(t, self.metric_sbp[name]))
                   for name, t in zip(self.plan.metrics, rest[len(written):])}
        return StepResult(loss=float(self.gather(loss, self.loss_sbp)), grads=grads, grad_norm=metrics.get(GRAD_NORM))

    def checkpoint_tensors(self) -> dict:
        """The tensors this rank writes to a checkpoint (runtime/checkpoint.py), by name: on one
        program, all it holds."""
        from sbpc.runtime.checkpoint import Held

        return {**{p.name: Held(self.params[p.name], p, "param") for p in self.plan.params if p.name in self.params},
                **{b.name: Held(self.buffers[b.name], b, "buffer") for b in self.plan.buffers if b.name in self.buffers},
                **{s.name: Held(self.states[s.name], s, "state") for s in self.plan.states if s.name in self.states}}

    def weights(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers (its shards; on one device, the logical tensors)."""
        return {**self.params, **self.buffers}

    def logical_params(self) -> dict[str, torch.Tensor]:
        """Every parameter as its logical tensor, a copy the next step does not overwrite. A
        collective: every rank must call it."""
        return {p.name: self._copy(self.params[p.name], self.spec_sbp[p.name]) for p in self.plan.params}

    def _copy(self, t: torch.Tensor, nd: NdSbp) -> torch.Tensor:
        """``gather``, and a copy where the gather returned this rank's own tensor (one device, B),
        which the next step may overwrite in place."""
        out = self.gather(t, nd)
        return out.clone() if out is t else out

    def logical_weights(self) -> dict[str, torch.Tensor]:
        """Parameters and buffers as logical tensors (a state_dict). A collective: every rank must call it."""
        return {**self.logical_params(), **self.logical_buffers()}

    def logical_buffers(self) -> dict[str, torch.Tensor]:
        """Every buffer as its logical tensor, a copy the next step does not overwrite. A
        collective: every rank must call it."""
        return {b.name: self._copy(self.buffers[b.name], self.spec_sbp[b.name]) for b in self.plan.buffers}

    def logical_states(self) -> dict[str, torch.Tensor]:
        """Every optimizer state (the step counter included) as its logical tensor. A collective:
        every rank must call it."""
        return {s.name: unpad(self._copy(self.states[s.name], self.spec_sbp[s.name]), self.logical_shape[s.name])
                for s in self.plan.states}

    def replica_spread(self) -> dict[str, float]:
        """For each parameter and optimizer state, the largest elementwise difference between the
        logical tensors the ranks hold of it (0 when all copies agree). The gathers take a
        replicated tensor from this rank's copy alone; `sbpc check` asks whether the others agree.
        A collective: every rank must call it."""
        return self._spreads({**{p.name: (self.params[p.name], self.spec_sbp[p.name]) for p in self.plan.params},
                              **{s.name: (self.states[s.name], self.spec_sbp[s.name]) for s in self.plan.states}})

    def _spreads(self, values: dict[str, tuple[torch.Tensor, NdSbp]]) -> dict[str, float]:
        """max - min over the ranks of this stage of each gathered value (a max-reduce per mesh
        axis covers the sub-mesh), in float64 so the difference is exact."""
        comm = self.backend.communicator
        out = {}
        for name, (t, nd) in values.items():
            hi = self.gather(t, nd).double()
            lo = -hi
            for axis in self.topology.sbp_axes:
                group = self.topology.group(axis)
                if len(group) > 1:
                    hi, lo = comm.all_reduce(hi, group, "max"), comm.all_reduce(lo, group, "max")
            out[name] = float((hi + lo).max()) if hi.numel() else 0.0
        return out

    def gather(self, t: torch.Tensor, nd: NdSbp | list[str]) -> torch.Tensor:
        """The logical tensor of this rank's shard ``t`` laid out as ``nd``: axis by axis, last
        axis first (undoing ``local_shard``), S by all_gather + ``sharding.combine``, P by
        all_reduce, B as is. A collective: every rank of the mesh must call it with its shard."""
        if nd and isinstance(nd[0], str):
            nd = parse_nd_sbp(nd)
        comm = self.backend.communicator
        if t.device != self.backend.device:  # offloaded state: collectives run on the device (NCCL)
            t = self.backend.to_device(t)
        for axis, s in reversed(list(zip(self.topology.sbp_axes, nd))):
            group = self.topology.group(axis)
            if len(group) == 1 or isinstance(s, Broadcast):
                continue
            if isinstance(s, Partial):
                t = comm.all_reduce(t, group, s.reduce)
            elif isinstance(s, Split):
                t = combine(list(comm.all_gather(t, group, s.dim).chunk(len(group), dim=s.dim)), s)
        return t

    def _check_batch(self, batch) -> None:
        local = isinstance(batch, LocalBatch)
        tensors = batch.tensors if local else batch
        if len(tensors) != len(self.plan.batch):
            raise RuntimeFailure(f"batch has {len(tensors)} tensors, the plan takes {len(self.plan.batch)}",
                                 hint="example_batch() changed since the compile; recompile the plan")
        for t, spec in zip(tensors, self.plan.batch):
            shape = list(local_shape(spec.shape, self.spec_sbp[spec.name], self.sizes)) if local else spec.shape
            if list(t.shape) != shape or str(t.dtype) != f"torch.{spec.dtype}":
                part = " (this rank's part)" if local else ""
                raise RuntimeFailure(f"{spec.name} is {t.dtype} {list(t.shape)}, the plan was compiled for "
                                     f"{spec.dtype} {shape}{part}",
                                     hint="recompile with the batch size and --set values used here")


def _owned(t: torch.Tensor, given) -> torch.Tensor:
    """A parameter the runner may overwrite: a copy of a caller's tensor (``weights=``), which
    sharding and ``.to`` can hand back as is."""
    return t.clone() if given is not None and any(t is w for w in given.values()) else t


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
        return batch_tuple(self.fn(self.plan.model.batch_size, **self.plan.model.sets))[0]


def make_runner(plan: Plan, backend: Backend, **kw) -> Runner:
    """The runner of ``plan``: ``PipelineRunner`` for pipelined plans (stages or micro-batches)."""
    if plan.pipeline is not None:
        from sbpc.runtime.pipeline import PipelineRunner
        return PipelineRunner(plan, backend, **kw)
    return Runner(plan, backend, **kw)
