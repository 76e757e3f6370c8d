"""`sbpc simulate`: a plan's step on a described cluster, from its actor schedule and the
cluster's cost model (``ClusterCost``).

Ranks of one pipeline stage run the same program on equal shards, so each stage role is
simulated once, whatever the mesh. Inside a task, instructions run in program order on a
compute stream; a collective issued without waiting (``sbpc.issue``) runs on its mesh axis's
communication stream and the compute stream stalls only at its ``sbpc.wait``; a blocking
collective stalls it for its whole time; a transfer from another stage is received before the
task starts. The tasks' times then drive the plan's own per-stage firing order
(``plan.pipeline.order``) through ``schedule_sim.timed``, which gives the step, the bubble and
the critical path.

``layers``: a plan compiled with K copies of a repeated layer (``h.0`` .. ``h.{K-1}``) stands
for ``layers`` of them: every instruction of a layer is counted ``layers / K`` times (identical
layers, spread evenly over the stages), gradient buckets and optimizer lists by their members.
Memory figures stay those of the compiled plan.
"""
from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict

from sbpc.compiler.pipelining.schedule_sim import Simulation, timed
from sbpc.compiler.sbp.cost_model import ClusterCost
from sbpc.compiler.sbp.op_work import AttentionKernel, Operand, is_free, op_work
from sbpc.compiler.tools.cluster import Cluster
from sbpc.compiler.tools.memory_report import size_text
from sbpc.errors import UsageError
from sbpc.runtime.kinds import ISSUE, WAIT, Collective
from sbpc.runtime.pipeline import instruction_uses, plan_task_graph
from sbpc.runtime.pipeline_tasks import TRANSFER, Task, fmt
from sbpc.runtime.plan import DTYPES, Instruction, Plan
from sbpc.runtime.sbp import local_shape, parse_nd_sbp
from sbpc.runtime.trace import Span, write_trace

_IR_DTYPE = {torch_name: short for short, torch_name in DTYPES.items()}
_ITEMSIZE = {"f64": 8, "i64": 8, "c64": 8, "f32": 4, "i32": 4, "f16": 2, "bf16": 2, "i16": 2, "i8": 1, "u8": 1, "bool": 1}
_LAYER = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")  # a module list item: "h.3.attn" -> ("h", 3)
_RECOMPUTED = " recompute of "  # in the why of a forward op the recompute pass cloned into the backward


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AxisComm(_Model):
    """Seconds of one step a device spends communicating on a mesh axis."""
    exposed_s: float  # the compute stream waited for it
    overlapped_s: float  # it ran under computation


class RoleResult(_Model):
    role: str  # "stage 0"
    stage: int
    ranks: int
    busy_s: float  # time its tasks ran in the step
    compute_s: float
    model_flops: float  # per device, a step, without recompute
    hardware_flops: float  # with recompute
    comm: dict[str, AxisComm]
    peak_memory_bytes: int  # the plan's estimate (compiler/memory/estimate.py)
    fits: bool  # peak memory within the device's


class PathSegment(_Model):
    """Consecutive critical-path tasks on one stage."""
    stage: int
    first: str
    last: str
    tasks: int
    seconds: float


class SimResult(_Model):
    cluster: str
    mesh: str
    devices: int
    step_time_s: float
    tokens_per_s: float
    tflops_per_device: float  # model FLOPs (no recompute) per device per second, in TFLOP/s
    hardware_tflops_per_device: float  # with recompute
    mfu: float  # model FLOP/s of the peak of the compute dtype
    model_flops: float  # a step, all devices
    hardware_flops: float
    bubble: float  # idle fraction of the step, averaged over stages
    comm: dict[str, AxisComm]  # per mesh axis, the stage role that communicates longest
    roles: list[RoleResult]
    critical_path: list[PathSegment]
    layers: int | None = None  # the repeated layers the plan stood for (None: as compiled)


@dataclass
class _Flight:
    name: str
    axis: str
    start: float
    end: float


@dataclass
class _TaskCost:
    seconds: float = 0.0
    compute: float = 0.0
    model_flops: float = 0.0
    hardware_flops: float = 0.0
    exposed: Counter = field(default_factory=Counter)
    overlapped: Counter = field(default_factory=Counter)
    flights: list[_Flight] = field(default_factory=list)


class _Pricer:
    """Seconds and FLOPs of each instruction of a plan on a cluster."""

    def __init__(self, plan: Plan, cost: ClusterCost, attention: AttentionKernel, layers: int | None,
                 attention_dropout: float | None = None):
        self.plan, self.cost, self.attention, self.attention_dropout = plan, cost, attention, attention_dropout
        self.sizes = tuple(a.size for a in plan.mesh if a.name != "pp")
        self.types: dict[str, tuple[tuple[int, ...], str, list[str]]] = {}
        self.module: dict[str, str] = {}
        for spec in [*plan.params, *plan.buffers, *plan.states, *plan.batch]:
            self.types[spec.value] = (tuple(spec.shape), _IR_DTYPE.get(spec.dtype, spec.dtype), spec.sbp)
            self.module[spec.value] = spec.name.split(":")[-1]
        for prog in plan.stages:
            for ins in prog.instructions:
                for o, t in zip(ins.outs, ins.types):
                    self.types[o] = (tuple(t.shape), t.dtype, t.sbp)
                    if ins.loc is not None:
                        self.module[o] = ins.loc.module
        self.factor, self.layer_list = _layer_factor(plan, layers)
        self._operands: dict[str, Operand | None] = {}
        self._local: dict[tuple, tuple[int, ...]] = {}

    def operand(self, value: str) -> Operand | None:
        if value not in self._operands:
            t = self.types.get(value)
            if t is None or t[1] in ("none", "work"):
                self._operands[value] = None
            else:
                shape, dtype, sbp = t
                key = (shape, tuple(sbp))  # many values share a layout: parse and divide once
                if key not in self._local:
                    self._local[key] = tuple(local_shape(shape, parse_nd_sbp(sbp), self.sizes)) if sbp else shape
                self._operands[value] = Operand(self._local[key], _ITEMSIZE.get(dtype, 4))
        return self._operands[value]

    def nbytes(self, value: str) -> int:
        op = self.operand(value)
        return op.nbytes if op is not None else 0

    def in_layer(self, module: str) -> bool:
        m = _LAYER.match(module or "")
        return m is not None and m.group(1) == self.layer_list

    def scale(self, ins: Instruction) -> float:
        """How many times the instruction counts: ``factor`` inside a repeated layer; a list's
        members (buckets, foreach) by their bytes."""
        if self.factor == 1.0:
            return 1.0
        lists = [a for a in ins.args if isinstance(a, list) and any(hasattr(x, "ref") for x in a)]
        if not lists:
            return self.factor if ins.loc is not None and self.in_layer(ins.loc.module) else 1.0
        members = [x.ref for x in lists[0] if hasattr(x, "ref")]
        weights = [(self.nbytes(v), self.factor if self.in_layer(self.module.get(v, "")) else 1.0) for v in members]
        total = sum(w for w, _ in weights)
        return sum(w * f for w, f in weights) / total if total else 1.0

    def kernel(self, ins: Instruction) -> tuple[float, float]:
        """(seconds, FLOPs) of a compute instruction."""
        if is_free(ins.op):
            return 0.0, 0.0
        ins_ops = [o for o in (self.operand(v) for v in instruction_uses(ins)) if o is not None]
        outs = [o for o in (self.operand(v) for v in ins.outs) if o is not None]
        # sbpc.attention(q, k, v, dropout_p, is_causal); its backward (grad, q, k, v, out, lse, dropout_p, is_causal)
        at = {"sbpc.attention": 3, "sbpc.attention_backward": 6}.get(ins.op)
        dropout, causal = (float(ins.args[at] or 0.0), bool(ins.args[at + 1])) if at is not None and len(ins.args) > at + 1 \
            else (0.0, False)
        if at is not None and self.attention_dropout is not None:
            dropout = self.attention_dropout
        dtype = next((self.types[v][1] for v in ins.outs if v in self.types), "f32")
        kernels = op_work(ins.op, ins_ops, outs, causal=causal, dropout=dropout, attention=self.attention)
        return sum(self.cost.kernel(k, dtype) for k in kernels), sum(k.flops for k in kernels)

    def collective(self, ins: Instruction, kind: Collective) -> float:
        refs = ins.args[0] if isinstance(ins.args[0], list) else [ins.args[0]]
        nbytes = sum(self.nbytes(a.ref) for a in refs if hasattr(a, "ref"))
        return self.cost.on_axis(kind, nbytes, str(ins.kwargs.get("axis")))

    def run(self, instructions: list[Instruction], recv_s: float = 0.0) -> _TaskCost:
        """One task: instructions in order on the compute stream, issued collectives on their axis's stream."""
        out = _TaskCost()
        now = recv_s
        if recv_s:
            out.exposed["pp"] += recv_s
        stream_free: dict[str, float] = defaultdict(float)
        flying: dict[str, _Flight] = {}
        for ins in instructions:
            kind = Collective.of(ins.op)
            if ins.op == ISSUE:
                kind = Collective(ins.kwargs["kind"])
                axis = str(ins.kwargs.get("axis"))
                dur = self.collective(ins, kind) * self.scale(ins)
                start = max(now, stream_free[axis])
                stream_free[axis] = start + dur
                flying[ins.outs[0]] = f = _Flight(kind.value, axis, start, start + dur)
                out.flights.append(f)
            elif ins.op == WAIT:
                f = flying.pop(ins.args[0].ref)
                stall = max(0.0, f.end - now)
                out.exposed[f.axis] += stall
                out.overlapped[f.axis] += (f.end - f.start) - stall
                now = max(now, f.end)
            elif kind is not None and kind.moves_data:
                axis = "host" if kind.memory_after is not None else str(ins.kwargs.get("axis"))
                dur = self.collective(ins, kind) * self.scale(ins)
                start = max(now, stream_free[axis])
                stream_free[axis] = start + dur
                out.flights.append(_Flight(kind.value, axis, start, start + dur))
                out.exposed[axis] += start + dur - now
                now = start + dur
            else:
                sec, flops = self.kernel(ins)
                s = self.scale(ins)
                now += sec * s
                out.compute += sec * s
                out.hardware_flops += flops * s
                if not (ins.why and _RECOMPUTED in ins.why):
                    out.model_flops += flops * s
        out.seconds = now
        return out


def _layer_factor(plan: Plan, layers: int | None) -> tuple[float, str | None]:
    """(layers / K, the module list of the repeated layer), K its copies in the plan."""
    if layers is None:
        return 1.0, None
    seen: dict[str, set[int]] = defaultdict(set)
    per_stage: dict[str, dict[int, set[int]]] = defaultdict(lambda: defaultdict(set))  # by the parameters read
    p = plan.pipeline.stages if plan.pipeline is not None else 1
    param_of = {s.value: s.name for s in plan.params}
    for prog in plan.stages:
        for ins in prog.instructions:
            m = _LAYER.match(ins.loc.module if ins.loc else "")
            if m:
                seen[m.group(1)].add(int(m.group(2)))
            for v in instruction_uses(ins):
                m = _LAYER.match(param_of.get(v, ""))
                if m:
                    per_stage[m.group(1)][prog.stage % p].add(int(m.group(2)))
    if not seen:
        raise UsageError("--layers: the plan has no repeated layer (no module list such as h.0, h.1, ...)",
                         hint="compile the model with all its layers, or with fewer copies of a layer list")
    name = max(seen, key=lambda k: len(seen[k]))
    k = len(seen[name])
    counts = {len(v) for v in per_stage[name].values()}
    if layers < k or layers % p or len(counts) > 1 or len(per_stage[name]) != p:
        raise UsageError(f"--layers {layers}: the plan holds {k} copies of {name}.N over {p} stages "
                         f"({', '.join(str(len(per_stage[name][s])) for s in sorted(per_stage[name]))} per stage)",
                         hint="the copies must be spread evenly over the stages and --layers must be a multiple of pp "
                              "and at least the compiled count")
    return layers / k, name


def simulate(plan: Plan, cluster: Cluster, *, attention: AttentionKernel | str = AttentionKernel.FLASH,
             layers: int | None = None, attention_dropout: float | None = None) -> SimResult:
    """The predicted step of ``plan`` on ``cluster`` (see the module docstring). ``attention_dropout``:
    the plan's attention ops stand for ones with this dropout on their probabilities (None: as compiled)."""
    result, _ = _simulate(plan, cluster, AttentionKernel(attention), layers, attention_dropout)
    return result


def _simulate(plan: Plan, cluster: Cluster, attention: AttentionKernel, layers: int | None,
              attention_dropout: float | None = None):
    mesh = tuple((a.name, a.size) for a in plan.mesh)
    pricer = _Pricer(plan, ClusterCost(cluster, mesh), attention, layers, attention_dropout)
    program = {prog.stage: prog.instructions for prog in plan.stages}
    if plan.pipeline is None:
        one = pricer.run(program[0])
        task = Task(0, "fwd", 0)
        sim = Simulation([[task]], [1], [1])
        from sbpc.compiler.pipelining.schedule_sim import Slice

        sim.timeline.append(Slice(task, 0, 0.0, one.seconds))
        costs, p, graph = {task.key: one}, 1, None
    else:
        spec = plan.pipeline
        p = spec.stages
        graph = plan_task_graph(plan)
        costs = {}
        for key, body in graph.bodies.items():
            recv = sum(pricer.cost.point_to_point(pricer.nbytes(it.outs[0]))
                       for it in body.recvs if it.src is not None and it.src % p != key[0] % p)
            costs[key] = pricer.run([program[key[0]][it.index] for it in body.kernels], recv)
        order = [[Task(t.chunk, t.phase, t.mb, t.part) for t in dev] for dev in spec.order]
        sim = timed(graph, order, lambda t: costs[t.key].seconds, spec.in_flight)
    step = sim.makespan
    ranks = plan.world_size // p
    per_device: list[_TaskCost] = [_TaskCost() for _ in range(p)]
    for s in sim.timeline:
        c, acc = costs[s.task.key], per_device[s.device]
        acc.seconds += c.seconds
        acc.compute += c.compute
        acc.model_flops += c.model_flops
        acc.hardware_flops += c.hardware_flops
        acc.exposed.update(c.exposed)
        acc.overlapped.update(c.overlapped)
    memory = {r.stage: r.total for r in plan.estimates.roles}
    roles = []
    for d, acc in enumerate(per_device):
        axes = sorted(set(acc.exposed) | set(acc.overlapped))
        peak = memory.get(d, 0)
        roles.append(RoleResult(role=f"stage {d}", stage=d, ranks=ranks, busy_s=acc.seconds, compute_s=acc.compute,
                                model_flops=acc.model_flops, hardware_flops=acc.hardware_flops,
                                comm={a: AxisComm(exposed_s=acc.exposed[a], overlapped_s=acc.overlapped[a]) for a in axes},
                                peak_memory_bytes=peak, fits=peak <= cluster.device.memory))
    comm = {}
    for a in sorted({a for r in roles for a in r.comm}):
        worst = max((r.comm[a] for r in roles if a in r.comm), key=lambda c: c.exposed_s + c.overlapped_s)
        comm[a] = worst
    model = sum(r.model_flops for r in roles) * ranks
    hardware = sum(r.hardware_flops for r in roles) * ranks
    n = plan.world_size
    per_dev = model / n / step if step > 0 else 0.0
    peak = cluster.peak(plan.precision.compute.value.replace("fp16", "f16").replace("fp32", "f32"))
    result = SimResult(
        cluster=cluster.name, mesh="x".join(f"{a.name}={a.size}" for a in plan.mesh), devices=n, step_time_s=step,
        tokens_per_s=_tokens(plan) / step if step > 0 else 0.0, tflops_per_device=per_dev / 1e12,
        hardware_tflops_per_device=(hardware / n / step if step > 0 else 0.0) / 1e12, mfu=per_dev / peak,
        model_flops=model, hardware_flops=hardware, bubble=sim.bubble() if plan.pipeline is not None else 0.0,
        comm=comm, roles=roles, critical_path=_critical_path(graph, sim), layers=layers)
    return result, (sim, costs)


def _tokens(plan: Plan) -> int:
    """Tokens of a step: the elements of the first integer batch input (ids), else its samples."""
    for b in plan.batch:
        if b.dtype.startswith("int"):
            return math.prod(b.shape)
    return plan.batch[0].shape[0] if plan.batch and plan.batch[0].shape else 1


def _critical_path(graph, sim: Simulation) -> list[PathSegment]:
    """Back from the last task to finish: at each task, what made it start when it did (a
    task it reads from, or the one before it on its stage)."""
    if not sim.timeline:
        return []
    if graph is None:  # one program, one task
        return [PathSegment(stage=0, first="step", last="step", tasks=1, seconds=sim.makespan)]
    by_task = {s.task: s for s in sim.timeline}
    prev_on_device: dict[Task, object] = {}
    for d in range(len(sim.order)):
        slices = sorted((s for s in sim.timeline if s.device == d), key=lambda s: s.start)
        for a, b in zip(slices, slices[1:]):
            prev_on_device[b.task] = a
    deps = {t: graph.deps(t) for t in by_task}
    cur = max(sim.timeline, key=lambda s: s.end)
    path = [cur]
    while True:
        cands = [by_task[x] for x in deps.get(cur.task, []) if x in by_task]
        if cur.task in prev_on_device:
            cands.append(prev_on_device[cur.task])
        cands = [c for c in cands if c.end <= cur.start + 1e-12]
        if not cands:
            break
        cur = max(cands, key=lambda s: s.end)
        path.append(cur)
    path.reverse()
    segments: list[PathSegment] = []
    for s in path:
        if segments and segments[-1].stage == s.device:
            last = segments[-1]
            segments[-1] = last.model_copy(update=dict(last=fmt(s.task), tasks=last.tasks + 1,
                                                       seconds=last.seconds + s.end - s.start))
        else:
            segments.append(PathSegment(stage=s.device, first=fmt(s.task), last=fmt(s.task), tasks=1, seconds=s.end - s.start))
    return segments


def write_sim_trace(plan: Plan, cluster: Cluster, path: str, *, attention: AttentionKernel | str = AttentionKernel.FLASH,
                    layers: int | None = None, attention_dropout: float | None = None) -> SimResult:
    """``simulate`` and its timeline in the format of `sbpc run --trace`: one track per stage
    role, a compute row and a ``comm <axis>`` row per axis with each collective where it flies."""
    result, (sim, costs) = _simulate(plan, cluster, AttentionKernel(attention), layers, attention_dropout)
    one_task = plan.pipeline is None
    spans = []
    for s in sim.timeline:
        spans.append(Span(s.device, "step" if one_task else fmt(s.task), s.start, s.end))
        spans += [Span(s.device, f"{f.name} {'' if one_task else fmt(s.task)}".strip(), s.start + f.start, s.start + f.end,
                       stream=f"comm {f.axis}") for f in costs[s.task.key].flights]
    ranks = plan.world_size // len(sim.order)
    write_trace(path, spans, {d: f"stage {d} ({ranks} ranks, simulated on {cluster.name})" for d in range(len(sim.order))})
    return result


def _seconds(s: float) -> str:
    return f"{s:,.3f} s" if s >= 1 else f"{s * 1e3:,.2f} ms" if s >= 1e-3 else f"{s * 1e6:,.1f} us"


def result_text(r: SimResult) -> str:
    lines = [f"simulated on {r.cluster} ({r.devices} devices, mesh {r.mesh})"
             + (f", {r.layers} layers extrapolated from the compiled copies" if r.layers else ""),
             f"  step time          {_seconds(r.step_time_s)}",
             f"  tokens/s           {r.tokens_per_s:,.0f}",
             f"  model TFLOP/s      {r.tflops_per_device:.1f} per device (MFU {r.mfu:.1%})",
             f"  hardware TFLOP/s   {r.hardware_tflops_per_device:.1f} per device, with recompute "
             f"({r.hardware_flops / max(r.model_flops, 1):.2f}x the model FLOPs)",
             f"  pipeline bubble    {r.bubble:.1%}"]
    for a, c in r.comm.items():
        lines.append(f"  comm {a:<4}          exposed {_seconds(c.exposed_s)}, overlapped {_seconds(c.overlapped_s)}")
    lines.append(f"  {'role':<10} {'ranks':>6} {'busy':>11} {'compute':>11} {'peak memory':>12}  fits")
    for role in r.roles:
        lines.append(f"  {role.role:<10} {role.ranks:>6} {_seconds(role.busy_s):>11} {_seconds(role.compute_s):>11} "
                     f"{size_text(role.peak_memory_bytes):>12}  {'yes' if role.fits else 'NO'}")
    path = " -> ".join(f"stage {s.stage} {s.first}..{s.last} ({s.tasks})" if s.tasks > 1 else f"stage {s.stage} {s.first}"
                       for s in r.critical_path)
    lines.append(f"  critical path      {path if len(path) < 600 else path[:600] + ' ...'}")
    return "\n".join(lines)
