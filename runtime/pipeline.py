"""Run a pipelined plan: this rank's actors fire in the order the compiler proved deadlock-free.

Each task of the plan (``pipeline_tasks``) becomes one generated ``Program``. A step slices the
batch into micro-batches (by each batch input's ``microbatch`` SBP, then by this rank's device
coordinates), and walks ``plan.pipeline.order[stage]``. Before a task fires it receives what
other stages sent it; when it finishes it adds its micro-batch's share to the accumulators
(gradients, the loss, a token count) and sends what later stages read, without waiting for
them. Values of micro-batch j live until the last task of j on this rank has run: that is the
regst whose count the schedule fixed. A receive that outlives ``--timeout``, or a peer that
dies, raises a ``RuntimeFailure`` naming the peer rank and the pending transfer.
"""
from __future__ import annotations

import time
import torch

from sbpc.errors import RuntimeFailure
from sbpc.runtime.backend import Backend
from sbpc.runtime.executor import Program
from sbpc.runtime.kinds import MemoryKind
from sbpc.runtime.pipeline_firing import Out, Post, Recv, TaskRun
from sbpc.runtime.pipeline_tasks import TRANSFER, Body, Item, Task, TaskGraph, fmt, replay
from sbpc.runtime.plan import DTYPES, GRAD_NORM, Instruction, Plan, RefArg
from sbpc.runtime.runner import LocalBatch, Runner, StepResult
from sbpc.runtime.sbp import parse_sbp
from sbpc.runtime.sharding import owned, take_chunk, unpad


def instruction_uses(ins: Instruction) -> list[str]:
    out: list[str] = []

    def walk(a):
        if isinstance(a, RefArg):
            out.append(a.ref)
        elif isinstance(a, list):
            for x in a:
                walk(x)

    for a in [*ins.args, *ins.kwargs.values()]:
        walk(a)
    return out


def plan_task_graph(plan: Plan) -> TaskGraph:
    items = [Item(i, ins.op, tuple(ins.outs), tuple(instruction_uses(ins)), ins.role, prog.stage,
                  ins.kwargs.get("src") if isinstance(ins.kwargs.get("src"), int) else None)
             for prog in plan.stages for i, ins in enumerate(prog.instructions)]
    outs = [plan.stages[0].loss, *(p.grad for p in plan.params), *(p.update for p in plan.params),
            *(s.update for s in plan.states), *(b.update for b in plan.written_buffers),
            *(r.value for r in plan.pipeline.replicas), *plan.metrics.values()]
    return TaskGraph(items, outs, plan.pipeline.microbatches)


def check_order(plan: Plan, graph: TaskGraph | None = None) -> list[list[Task]]:
    """The plan's per-stage orders, replayed first: the compiler proved them, and an edited
    plan must fail here, in one line, not by hanging the ranks."""
    graph = graph or plan_task_graph(plan)
    orders = [[Task(t.chunk, t.phase, t.mb, t.part) for t in dev] for dev in plan.pipeline.order]
    replay(graph, orders, lambda c: c % plan.pipeline.stages)
    return orders


def transfer_sequences(plan: Plan) -> tuple[dict[tuple[int, int], list[tuple[str, int | None]]],
                                             dict[tuple[int, int], list[tuple[str, int | None]]]]:
    """Per (sending stage, receiving stage): the transfers (value, micro-batch) in the order the
    sender issues its sends and in the order the receiver posts its receives, as
    ``PipelineRunner.step`` walks its stage's order (receives before a task, sends after it)."""
    graph, p = plan_task_graph(plan), plan.pipeline.stages
    sent: dict[tuple[int, int], list] = {}
    received: dict[tuple[int, int], list] = {}
    for stage, order in enumerate(check_order(plan, graph)):
        for task in order:
            for it in graph.bodies[task.key].recvs:
                if it.src % p != stage:
                    received.setdefault((it.src % p, stage), []).append((it.outs[0], task.mb))
            for snd in graph.sends.get(task.key, []):
                if snd.dst_chunk % p != stage:
                    sent.setdefault((stage, snd.dst_chunk % p), []).append((snd.out, task.mb))
    return sent, received


def fifo_mismatch(plan: Plan) -> str | None:
    """Where a transport that matches a pair's sends and receives in issue order (NCCL: no
    tags) would hand a receive the wrong tensor: the first pair and position whose sent and
    received transfers differ, or None when every pair is first-in first-out."""
    if plan.pipeline is None:
        return None
    sent, received = transfer_sequences(plan)
    for pair in sorted(set(sent) | set(received)):
        a, b = sent.get(pair, []), received.get(pair, [])
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return (f"stage {pair[0]} -> stage {pair[1]}: transfer {i} is sent as %{x[0]} of micro-batch {x[1]} "
                        f"but received as %{y[0]} of micro-batch {y[1]}")
        if len(a) != len(b):
            return f"stage {pair[0]} -> stage {pair[1]}: {len(a)} sends but {len(b)} receives"
    return None


def host_transfers(plan: Plan) -> frozenset[str]:
    """The transfers whose value lives in host memory: under optimizer offload, scalars the
    optimizer makes on the host and a later stage's optimizer reads there (a bias correction
    from the shared step counter; fp16's skip verdict). gloo sends CPU tensors as they are;
    NCCL reads and writes device memory only, so the runner moves such a value to the device
    to send it and back to the host where it is received (``PipelineRunner._fire``)."""
    host = {s.value for s in [*plan.params, *plan.buffers, *plan.states] if s.memory == MemoryKind.HOST}
    host |= {o for prog in plan.stages for ins in prog.instructions if ins.memory == MemoryKind.HOST for o in ins.outs}
    return frozenset(ins.outs[0] for prog in plan.stages for ins in prog.instructions
                     if ins.op == TRANSFER and ins.args and isinstance(ins.args[0], RefArg) and ins.args[0].ref in host)


class PipelineRunner(Runner):
    def __init__(self, plan: Plan, backend: Backend, *, seed: int = 0, weights: dict[str, torch.Tensor] | None = None,
                 timeline: bool = False):
        self._bind(plan, backend, timeline)
        spec = plan.pipeline
        self.spec, self.m, self.p = spec, spec.microbatches, spec.stages
        self.stage = self.topology.index("pp")
        self.graph = plan_task_graph(plan)
        self.order = check_order(plan, self.graph)[self.stage]
        programs = {prog.stage: prog for prog in plan.stages}
        self.programs: dict[tuple[int, str, int], Program] = {}
        for key, body in self.graph.bodies.items():
            if key[0] % self.p == self.stage:
                self.programs[key] = _program(programs[key[0]].instructions, body, backend)
        self.types = {o: t for prog in plan.stages for ins in prog.instructions for o, t in zip(ins.outs, ins.types)}
        mine = {v for key, b in self.graph.bodies.items() if key[0] % self.p == self.stage for v in b.inputs}
        self._inputs_here = mine
        self._batch_here = {b.value for b in plan.batch if b.value in mine}  # the batch tensors this stage reads
        self._made_here = {o for key, b in self.graph.bodies.items() if key[0] % self.p == self.stage
                           for it in b.kernels + b.recvs + b.reads for o in it.outs}
        # a buffer the forward overwrites without reading it (spectral norm's u, the out= of its
        # power iteration) is held where it is written
        self._load(weights, seed, {p.name for p in plan.params if p.value in mine},
                   {b.name for b in plan.buffers if b.value in mine or b.update in self._made_here},
                   {s.name for s in plan.states if s.value in mine})
        self._tags = {s.out: s.tag for ss in self.graph.sends.values() for s in ss}  # one per transfer
        self._host_transfers = host_transfers(plan)
        self.steps = 0
        self._last_of_mb = self._last_tasks()
        self._stage_cache: dict[str, int] = {}
        self.runs = [self._task_run(t) for t in self.order]

    # ----- one step
    def step(self, batch: tuple[torch.Tensor, ...] | LocalBatch, *, rng_seed: int | None = None,
             keep_grads: bool = False, lr: float | None = None) -> StepResult:
        self._check_batch(batch)
        step_env: dict[str, torch.Tensor] = {v: t for v, t in self._hyper(lr).items() if v in self._inputs_here}
        self._seed_step(rng_seed)
        for group, specs in ((self.params, self.plan.params), (self.buffers, self.plan.buffers),
                             (self.states, self.plan.states)):
            step_env.update({s.value: group[s.name] for s in specs if s.name in group})
        envs = self._microbatches(batch)
        acc: dict[str, torch.Tensor] = {}
        owned: set[str] = set()  # accumulators this step allocated, which it adds into in place
        local: dict[tuple[str, int | None], torch.Tensor] = {}
        sends = []
        posted: dict[tuple[str, int | None], object] = {}
        self.backend.microbatches = self.m
        runs = self.runs
        if runs:
            self._post(runs[0], posted)
        for k, run in enumerate(runs):
            start = time.time()
            sends += self._fire(run, runs[k + 1] if k + 1 < len(runs) else None, envs, step_env, acc, owned, local, posted)
            if run.frees_mb:
                envs[run.mb] = {}  # the micro-batch's regst is free
            self.timeline.record(run.label, start, self.steps, self.backend)
        for s in sends:
            s.wait()
        self.steps += 1
        if self.m == 1:  # the loss and gradients were never accumulated: they are the micro-batch's
            step_env = {**envs[0], **step_env}
        return self._finish(step_env, keep_grads)

    def _fire(self, run: TaskRun, nxt: TaskRun | None, envs, step_env, acc, owned, local, posted) -> list:
        """Run one task: receive, post the receives of the next task ``nxt``, run its program,
        accumulate, send. A method so that its inputs and results (locals here) die when it
        returns: only the environments, the accumulators, the posted receives and the pending
        sends hold tensors between tasks."""
        env = envs[run.mb] if run.mb is not None else step_env
        for r in run.recvs:
            if r.here:
                env[r.out] = local.pop(r.key)
                continue
            value = posted.pop(r.key).wait()
            if r.host and value.device.type != "cpu":  # came over NCCL
                value = self.backend.to_host(value)
            env[r.out] = value
        if nxt is not None:  # the next task's receives fly while this one computes
            self._post(nxt, posted)
        for out, use in run.reads:
            env[out] = acc[use]
        self.backend.microbatch = run.mb or 0
        values = [env[v] if v in env else step_env[v] if v in step_env else envs[0][v] for v in run.inputs]
        values += [env[v] for v in run.local_inputs]
        outs = run.program.run(values)
        env.update(zip(run.outputs, outs))
        for i, v, fresh in run.accumulate:
            _accumulate(acc, owned, v, outs[i], fresh)
        pending = []
        for s in run.sends:
            value = env[s.value]
            if s.here:
                local[s.key] = value
                continue
            if value.device != self.backend.device:  # a host value (host_transfers) on a GPU rank: NCCL sends device memory
                value = self.backend.to_device(value)
            pending.append(self.backend.communicator.send(value, s.peer, s.tag, what=s.what))
        return pending

    def _post(self, run: TaskRun, posted) -> None:
        """Post the receives of a task from other stages (gloo ``irecv``), so that a value
        arriving while the task before it computes is taken without waiting."""
        post_recv = self.backend.communicator.post_recv
        for p in run.posts:
            posted[p.key] = post_recv(p.shape, p.dtype, p.peer, p.tag, what=p.what)

    def _task_run(self, task: Task) -> TaskRun:
        """What firing ``task`` does, but the tensors (``pipeline_firing``)."""
        body, label, mb = self.graph.bodies[task.key], fmt(task), task.mb
        posts, recvs = [], []
        for it in body.recvs:
            out, here = it.outs[0], it.src % self.p == self.stage
            recvs.append(Recv((out, mb), out, here, out in self._host_transfers))
            if not here:
                vt = self.types[out]
                posts.append(Post((out, mb), _local_shape(vt, self), getattr(torch, DTYPES[vt.dtype]), self._peer(it.src),
                                  self._tag(out, mb), f"recv of %{out} for {label} on stage {self.stage}"))
        sends = tuple(Out(s.value, (s.out, mb), s.dst_chunk % self.p == self.stage, self._peer(s.dst_chunk),
                          self._tag(s.out, mb), f"send of %{s.value} from {label} on stage {self.stage}")
                      for s in self.graph.sends.get(task.key, []))
        accumulate = tuple((i, v, v in self.graph.owned) for i, v in enumerate(body.outputs) if v in self.graph.accumulated)
        return TaskRun(label, mb, self.programs[task.key], tuple(posts), tuple(recvs),
                       tuple((it.outs[0], it.uses[0]) for it in body.reads), tuple(body.inputs),
                       tuple(it.outs[0] for it in body.recvs + body.reads), tuple(body.outputs), accumulate, sends,
                       mb is not None and self._last_of_mb.get(mb) == task)

    def batch_part(self, t: torch.Tensor, i: int) -> torch.Tensor:
        """This rank's part of logical batch input ``i``: its shard of each micro-batch, joined in
        micro-batch order along the micro-batch split (``_microbatch`` cuts it back)."""
        spec = self.plan.batch[i]
        if spec.microbatch is None or self.m == 1:
            return self._shard(t, spec)
        split = parse_sbp(spec.microbatch)
        return torch.cat([self._shard(take_chunk(t, split, j, self.m), spec) for j in range(self.m)], dim=split.dim)

    def _microbatches(self, batch) -> list[dict[str, torch.Tensor]]:
        """Per micro-batch, its part of this rank's part of each batch input this stage reads
        (the rank's part cut once; each micro-batch's piece in a storage of its own, so that
        freeing one micro-batch's values frees its piece)."""
        local = isinstance(batch, LocalBatch)
        envs: list[dict[str, torch.Tensor]] = [{} for _ in range(self.m)]
        for i, (b, spec) in enumerate(zip(batch.tensors if local else batch, self.plan.batch)):
            if spec.value not in self._batch_here:
                continue
            part = (b if local else self.batch_part(b, i)).to(self.backend.device)
            split = parse_sbp(spec.microbatch) if spec.microbatch is not None and self.m > 1 else None
            for j, env in enumerate(envs):
                env[spec.value] = part if split is None else owned(take_chunk(part, split, j, self.m))
        return envs

    def _peer(self, chunk: int) -> int:
        return self.topology.rank_of({**self.topology.coords, "pp": chunk % self.p})

    def _tag(self, out: str, mb: int | None) -> int:
        return self._tags[out] * (self.m + 1) + (0 if mb is None else mb + 1)

    def _last_tasks(self) -> dict[int, Task]:
        last: dict[int, Task] = {}
        for t in self.order:
            if t.mb is not None:
                last[t.mb] = t
        return last if self.m > 1 else {}  # one micro-batch: the update reads its values

    # ----- results
    def _finish(self, step_env, keep_grads: bool) -> StepResult:
        plan = self.plan
        owned = {p.name: p.update for p in plan.params if p.update in step_env and p.update in self._made_here}
        replicas = {r.name: r.value for r in self.spec.replicas if r.chunk % self.p == self.stage}
        for name in self.params:
            value = owned.get(name) or replicas.get(name)
            if value is None:
                raise RuntimeFailure(f"stage {self.stage} holds parameter {name} but receives no new value for it",
                                     hint="the plan is corrupt; recompile it")
            self.params[name] = step_env[value]
        for s in plan.states:
            if s.name in self.states:
                self.states[s.name] = step_env[s.update] if s.update in self._made_here else step_env[replicas[s.name]]
        for b in self.written_buffers:  # the stage whose forward wrote it holds it
            if b.name in self.buffers and b.update in self._made_here:
                self.buffers[b.name] = step_env[b.update]
        loss = self._scalar(step_env, plan.stages[0].loss)
        metrics = {name: self._scalar(step_env, v) for name, v in plan.metrics.items()}
        grads = self._collect({p.name: (step_env.get(p.grad), self._value_sbp(self.types.get(p.grad), fallback=p))
                               for p in plan.params if p.grad in self._made_here}) if keep_grads else {}
        return StepResult(loss=loss, grads=self._logical(grads or {}), grad_norm=metrics.get(GRAD_NORM))

    def _scalar(self, step_env, name: str) -> float:
        """A 0-d value of the step (the loss, a metric) on every rank: gathered on the stage that
        makes it, broadcast from that stage's lead."""
        here = name in self._made_here
        value = torch.zeros(()) if not here else self.gather(step_env[name], self._value_sbp(self.types[name]))
        owner = self.topology.rank_of({**self.topology.coords, "pp": self._stage_of(name),
                                       **{a: 0 for a in self.topology.sbp_axes}})
        return float(self.backend.communicator.broadcast(value.detach().reshape(()).to(torch.float64), owner))

    def _stage_of(self, name: str) -> int:
        if name not in self._stage_cache:  # the loss and metrics, every step: the scan runs once
            self._stage_cache[name] = next(prog.stage for prog in self.plan.stages for ins in prog.instructions
                                           if name in ins.outs) % self.p
        return self._stage_cache[name]

    def _collect(self, values: dict[str, tuple]) -> dict[str, torch.Tensor] | None:
        """Logical tensors of the named values, on rank 0: each stage gathers what it made
        (a collective within the stage), and stage leads send theirs to rank 0. Copies: the
        next step overwrites parameters and states in place (in-process ranks pass objects as is)."""
        local = {n: self._copy(t, nd) for n, (t, nd) in values.items()}
        lead = all(i == 0 for i in self.coords)
        parts = self.backend.communicator.gather_objects(local if lead else {}, 0)
        if parts is None:
            return None
        out: dict[str, torch.Tensor] = {}
        for part in parts:
            out.update(part)
        return out

    def logical_params(self) -> dict[str, torch.Tensor]:
        """Every parameter as its logical tensor, on rank 0 (elsewhere {}). Every rank must call it."""
        mine = {p.name: (self.params[p.name], self.spec_sbp[p.name]) for p in self.plan.params
                if p.name in self.params and self._owner_here(p)}
        return self._collect(mine) or {}

    def logical_states(self) -> dict[str, torch.Tensor]:
        """Every optimizer state as its logical tensor, on rank 0 (elsewhere {}), from the stage
        whose optimizer updates it. Every rank must call it."""
        mine = {s.name: (self.states[s.name], self.spec_sbp[s.name]) for s in self.plan.states
                if s.name in self.states and s.update in self._made_here}
        return self._logical(self._collect(mine) or {})

    def _logical(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {n: unpad(t, self.logical_shape[n]) for n, t in tensors.items()}

    def replica_spread(self) -> dict[str, float]:
        """``Runner.replica_spread`` over the ranks of each stage, for what the stage updates, and
        over the stages that hold a tied weight (the owner's copy and those that receive its new
        value); on rank 0 (elsewhere {}). Every rank must call it."""
        mine = {**{p.name: (self.params[p.name], self.spec_sbp[p.name]) for p in self.plan.params
                   if p.name in self.params and self._owner_here(p)},
                **{s.name: (self.states[s.name], self.spec_sbp[s.name]) for s in self.plan.states
                   if s.name in self.states and s.update in self._made_here}}
        spreads = self._spreads(mine)
        tied = {r.name for r in self.spec.replicas}
        copies = {p.name: self.gather(self.params[p.name], self.spec_sbp[p.name]).double() for p in self.plan.params
                  if p.name in tied and p.name in self.params}
        lead = all(i == 0 for i in self.coords)
        parts = self.backend.communicator.gather_objects((spreads, copies) if lead else ({}, {}), 0)
        out: dict[str, float] = {}
        held: dict[str, list[torch.Tensor]] = {}
        for part, stage_copies in parts or []:
            out.update(part)
            for name, t in stage_copies.items():
                held.setdefault(name, []).append(t)
        for name, ts in held.items():
            both = torch.stack(ts)
            out[name] = max(out.get(name, 0.0), float((both.amax(0) - both.amin(0)).max()))
        return out

    def logical_weights(self) -> dict[str, torch.Tensor]:
        mine = {p.name: (self.params[p.name], self.spec_sbp[p.name]) for p in self.plan.params
                if p.name in self.params and self._owner_here(p)}
        return self._collect({**mine, **self._my_buffers()}) or {}

    def logical_buffers(self) -> dict[str, torch.Tensor]:
        """Every buffer as its logical tensor, on rank 0 (elsewhere {}). Every rank must call it."""
        return self._collect(self._my_buffers()) or {}

    def _my_buffers(self) -> dict:
        """The buffers this stage answers for: those its forward writes, and of the others those
        it is the first to read (each logical tensor comes from one stage)."""
        return {b.name: (self.buffers[b.name], self.spec_sbp[b.name]) for b in self.plan.buffers
                if b.name in self.buffers and self._answers_for(b)}

    def checkpoint_tensors(self) -> dict:
        """What this stage updates (a tied weight from its owner's stage only) and the buffers it
        answers for (``_my_buffers``): each logical tensor comes from one stage."""
        from sbpc.runtime.checkpoint import Held

        return {**{p.name: Held(self.params[p.name], p, "param") for p in self.plan.params
                   if p.name in self.params and self._owner_here(p)},
                **{b.name: Held(self.buffers[b.name], b, "buffer") for b in self.plan.buffers
                   if b.name in self.buffers and self._answers_for(b)},
                **{s.name: Held(self.states[s.name], s, "state") for s in self.plan.states
                   if s.name in self.states and s.update in self._made_here}}

    def _owner_here(self, p) -> bool:
        return p.update in self._made_here

    def _answers_for(self, b) -> bool:
        return b.update in self._made_here if b.update is not None else self._first_holder(b.value)

    def _first_holder(self, value: str) -> bool:
        stages = sorted({key[0] % self.p for key, b in self.graph.bodies.items() if value in b.inputs})
        return bool(stages) and stages[0] == self.stage


def _accumulate(acc: dict[str, torch.Tensor], owned: set[str], v: str, t: torch.Tensor, fresh: bool) -> None:
    """Add a micro-batch's ``t`` into the step's sum of ``v``. The first result itself is the
    sum. ``fresh`` (``TaskGraph.owned``: new storage that nothing but the sum reads) lets the
    later results be added into it in place, as torch's AccumulateGrad does: no allocation.
    Otherwise it may share storage with a value still held (a sent activation, a view), so it
    is never written: the second is added out of place into a new tensor that only ``acc``
    holds, and later ones into that in place (one allocation a step instead of m - 1). The same
    additions in the same order: bit for bit the out-of-place sum."""
    if v not in acc:
        acc[v] = t
        if fresh:
            owned.add(v)
    elif v in owned:
        acc[v].add_(t)
    else:
        acc[v] = acc[v] + t
        owned.add(v)


def _program(instructions: list[Instruction], body: Body, backend: Backend) -> Program:
    """The generated function of one task, with frees recomputed for the task alone."""
    kept = set(body.outputs)
    last: dict[str, int] = {}
    for k, it in enumerate(body.kernels):
        for u in it.uses:
            last[u] = k
    local = {o for it in body.kernels for o in it.outs} | set(body.inputs) | {it.outs[0] for it in body.recvs + body.reads}
    dies: dict[int, list[str]] = {}
    for v, k in last.items():
        if v in local and v not in kept:
            dies.setdefault(k, []).append(v)
    code = [instructions[it.index].model_copy(update={"free": sorted(dies.get(k, []))})
            for k, it in enumerate(body.kernels)]
    inputs = body.inputs + [it.outs[0] for it in body.recvs + body.reads]
    return Program(code, inputs, body.outputs, backend, name=f"chunk{body.chunk}_{body.phase}{body.part}")


def _local_shape(vt, runner: PipelineRunner) -> list[int]:
    from sbpc.runtime.sbp import local_shape
    return list(local_shape(vt.shape, runner._nd(vt.sbp), runner.sizes)) if vt.sbp else list(vt.shape)


