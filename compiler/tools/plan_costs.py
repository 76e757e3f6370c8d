"""What a plan costs per device under the propagation's cost model, for `sbpc diff` and
`sbpc report`: FLOPs and seconds per instruction, per stage program (chunk) and per step.

An op's seconds are ``RooflineCost``'s (the larger of its local flops at the peak and its local
bytes at the memory bandwidth, the stage policy's model), a collective's ``AlphaBeta``'s on the
size of its axis, a transfer's ``AlphaBeta.transfer``. Local means on one device: an op whose
result is split or partial over an axis does 1/size of the logical work there. The step time
adds each program's costs with no overlap (an upper bound where the plan overlaps
communication); a pipelined plan's step is its own firing order (``plan.pipeline.order``) timed
with these costs per firing (``schedule_sim.timed``). This is the cost model the compiler
optimises, not a prediction for real hardware: `sbpc simulate` (``simulate.py``) gives that, on
a described cluster, and `sbpc diff --cluster` / `sbpc report --cluster` use it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from sbpc.compiler.ir.aten import returns_alias
from sbpc.compiler.ir.types import DTYPE_BY_TORCH_NAME, TensorType
from sbpc.compiler.pipelining.schedule_sim import Simulation, timed
from sbpc.compiler.pipelining.stage_policy import RooflineCost, flops, layer_key
from sbpc.compiler.raise_plan import raise_plan
from sbpc.compiler.sbp.cost_model import AlphaBeta
from sbpc.compiler.tools.comm_report import collectives
from sbpc.runtime.kinds import ISSUE, WAIT, Collective as Kind
from sbpc.runtime.overlap import uses
from sbpc.runtime.pipeline import plan_task_graph
from sbpc.runtime.pipeline_tasks import PER_MICROBATCH, Task
from sbpc.runtime.plan import Plan, ValueType
from sbpc.runtime.sbp import parse_nd_sbp

SOURCE = "cost model (AlphaBeta collectives + roofline compute at 100 TFLOP/s, 200 GB/s; no overlap)"


@dataclass
class StageCost:
    """One stage program (a pipeline chunk) per device and step: all its micro-batches."""
    chunk: int
    device_stage: int  # the pp coordinate that runs it
    layers: list[str] = field(default_factory=list)  # layer units of its forward, in order (h.0, wte, ...)
    params: int = 0  # parameter elements it owns (updates), logical
    flops: float = 0.0
    compute_s: float = 0.0
    comm_s: float = 0.0

    @property
    def time_s(self) -> float:
        return self.compute_s + self.comm_s


@dataclass
class PlanCost:
    stages: list[StageCost]
    step_time_s: float
    simulation: Simulation | None  # the pipelined plan's timed actors (seconds); None: one program
    phase_s: dict[str, float]  # seconds per phase (pre, fwd, bwd, opt) summed over the programs
    call_s: dict[tuple[int, int], float]  # one firing of each collective call, by (chunk, position)
    source: str = SOURCE


def plan_cost(plan: Plan, cost: RooflineCost | None = None, comm: AlphaBeta | None = None) -> PlanCost:
    cost = cost or RooflineCost()
    comm = comm or AlphaBeta()
    seconds, flop, call_s = _instruction_costs(plan, cost, comm)
    m = plan.pipeline.microbatches if plan.pipeline is not None else 1
    p = plan.pipeline.stages if plan.pipeline is not None else 1
    stages = {prog.stage: StageCost(prog.stage, prog.stage % p) for prog in plan.stages}
    phase_s: dict[str, float] = {}
    for prog in plan.stages:
        st = stages[prog.stage]
        for k, ins in enumerate(prog.instructions):
            times = m if ins.role in PER_MICROBATCH else 1
            s = seconds.get((prog.stage, k), 0.0) * times
            if (prog.stage, k) in call_s:
                st.comm_s += s
            else:
                st.compute_s += s
            st.flops += flop.get((prog.stage, k), 0.0) * times
            phase_s[ins.role] = phase_s.get(ins.role, 0.0) + s
            if ins.role == "fwd" and ins.loc is not None and ins.loc.module:
                unit = layer_key(ins.loc.module)
                if unit not in st.layers:
                    st.layers.append(unit)
    owner = {o: prog.stage for prog in plan.stages for ins in prog.instructions for o in ins.outs}
    for prm in plan.params:
        if prm.update in owner:
            stages[owner[prm.update]].params += math.prod(prm.shape)
    rows = [stages[c] for c in sorted(stages)]
    if plan.pipeline is None:
        return PlanCost(rows, sum(st.time_s for st in rows), None, phase_s, call_s)
    graph = plan_task_graph(plan)
    per_task = {key: sum(seconds.get(it.index_key, 0.0) for it in [*body.kernels, *body.recvs])
                for key, body in graph.bodies.items()}
    spec = plan.pipeline
    order = [[Task(t.chunk, t.phase, t.mb, t.part) for t in dev] for dev in spec.order]
    sim = timed(graph, order, lambda t: per_task.get(t.key, 0.0), spec.in_flight)
    return PlanCost(rows, sim.makespan, sim, phase_s, call_s)


def _instruction_costs(plan: Plan, cost: RooflineCost, comm: AlphaBeta) -> tuple[dict, dict, dict]:
    """Seconds and local flops per (chunk, position) of one firing of each instruction, and
    the seconds of the collective calls alone."""
    sizes = {a.name: a.size for a in plan.mesh}
    axes = [a.name for a in plan.mesh if a.name != "pp"]
    shard = tuple(sizes[a] for a in axes)
    seconds: dict[tuple[int, int], float] = {}
    flop: dict[tuple[int, int], float] = {}
    calls: dict[tuple[int, int], list] = {}
    for c in collectives(plan):
        if c.moves_data:
            calls.setdefault((c.chunk, c.index), []).append(c)
    for at, members in calls.items():
        c, nbytes = members[0], sum(x.nbytes for x in members)  # a bucket is one call of all its bytes
        if c.kind == "transfer":
            seconds[at] = comm.transfer(nbytes)
        elif c.axis in sizes:
            seconds[at] = comm.collective(Kind(c.kind), nbytes, sizes[c.axis])
        else:  # to_host / to_device: the host link, priced like a transfer
            seconds[at] = comm.transfer(nbytes)
    graph = raise_plan(plan)
    types = graph.value_types()
    values = _value_types(plan)
    nodes = iter(graph.nodes)  # raise_plan keeps the plan's instruction order
    for prog in plan.stages:
        for k, ins in enumerate(prog.instructions):
            node = next(nodes)
            at = (prog.stage, k)
            if at in calls or ins.op in (ISSUE, WAIT) or Kind.of(ins.op) is not None or ins.op.startswith("sbpc.transfer"):
                continue
            split = math.prod(sizes[a] for a, s in zip(axes, ins.types[0].sbp) if s != "B") if ins.types and ins.types[0].sbp else 1
            flop[at] = flops(node, types) / split
            nbytes = 0
            if not returns_alias(ins.op):
                ins_sbp = ins.sbp_in or []
                for j, u in enumerate(uses(ins)):
                    if u in values:
                        nbytes += _local(values[u], ins_sbp[j] if j < len(ins_sbp) else None, shard)
                nbytes += sum(_local(t, None, shard) for t in ins.types)
            seconds[at] = cost.seconds(flop[at], nbytes)
    return seconds, flop, {at: seconds[at] for at in calls}


def _value_types(plan: Plan) -> dict[str, ValueType]:
    out = {s.value: ValueType(shape=s.shape, dtype=DTYPE_BY_TORCH_NAME[s.dtype], sbp=s.sbp)
           for s in [*plan.params, *plan.buffers, *plan.states, *plan.batch]}
    for prog in plan.stages:
        for ins in prog.instructions:
            out.update(zip(ins.outs, ins.types))
    return out


def _local(t: ValueType, sbp: list[str] | None, shard: tuple[int, ...]) -> int:
    nd = sbp if sbp is not None else t.sbp
    if t.dtype in ("none", "work"):
        return 0
    return TensorType(tuple(t.shape), t.dtype).local_nbytes(parse_nd_sbp(nd) if nd else None, shard)
