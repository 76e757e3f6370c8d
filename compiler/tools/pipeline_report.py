"""What `sbpc inspect --schedule` and `sbpc compile --trace` show of a pipelined plan."""
from __future__ import annotations

from sbpc.compiler.pipelining.schedule_sim import Simulation, simulate
from sbpc.runtime.kinds import ISSUE, WAIT
from sbpc.runtime.pipeline import plan_task_graph
from sbpc.runtime.pipeline_tasks import Task, fmt
from sbpc.runtime.plan import Plan
from sbpc.runtime.trace import Span, write_trace


def simulate_plan(plan: Plan) -> Simulation:
    """The unit-cost simulation of the plan's actors (forward 1, backward 2 per chunk)."""
    spec = plan.pipeline
    return simulate(plan_task_graph(plan), spec.schedule, spec.stages, spec.virtual_stages)


def write_simulated_trace(plan: Plan, path: str) -> Simulation:
    """The simulated timeline in the format of `sbpc run --trace` (one cost unit = 1 ms), with
    the overlap the plan records: each issued collective on a ``comm <axis>`` row from its
    issue to its wait, placed in its task's slice by instruction position (the unit-cost
    simulation has no time per instruction)."""
    sim = simulate_plan(plan)
    spans = [Span(s.device, fmt(s.task), s.start, s.end) for s in sim.timeline]
    spans += _issued_spans(plan, sim)
    write_trace(path, spans, {d: f"stage {d} (simulated)" for d in range(len(sim.order))}, scale=1e3)
    return sim


def _issued_spans(plan: Plan, sim: Simulation) -> list[Span]:
    graph = plan_task_graph(plan)
    program = {prog.stage: prog.instructions for prog in plan.stages}  # by chunk
    flights: dict[tuple, list[tuple[str, str, float, float]]] = {}  # task key -> (name, axis, from, to) in [0, 1]
    for key, body in graph.bodies.items():
        at = {it.outs[0]: k for k, it in enumerate(body.kernels) if it.op == ISSUE}
        n = max(len(body.kernels), 1)
        for k, it in enumerate(body.kernels):
            if it.op == WAIT and it.uses[0] in at:
                issue = program[key[0]][body.kernels[at[it.uses[0]]].index]
                flights.setdefault(key, []).append((issue.kwargs["kind"], str(issue.kwargs.get("axis")),
                                                    at[it.uses[0]] / n, (k + 1) / n))
    out = []
    for s in sim.timeline:
        span = s.end - s.start
        out += [Span(s.device, f"{kind} {fmt(s.task)}", s.start + a * span, s.start + b * span, stream=f"comm {axis}")
                for kind, axis, a, b in flights.get(s.task.key, [])]
    return out


def schedule_text(plan: Plan) -> str:
    spec = plan.pipeline
    if spec is None:
        return "// one stage, one micro-batch: no pipeline schedule"
    sim = simulate_plan(plan)
    p, m, v = spec.stages, spec.microbatches, spec.virtual_stages
    ideal = (p - 1) / (m * v + p - 1) if v == 1 else (p - 1) / v / (m + (p - 1) / v)
    lines = [f"// schedule {spec.schedule}: {p} stages x {v} chunks, {m} micro-batches; "
             f"bubble {sim.bubble():.3f} simulated (unit cost), {ideal:.3f} analytic"]
    for d, order in enumerate(spec.order):
        held = sim.peak_in_flight[d]
        lines.append(f"stage {d}: regsts {spec.in_flight[d]}, peak in flight {held}: "
                     + " ".join(fmt(Task(t.chunk, t.phase, t.mb, t.part)) for t in order))
    lines.append("// Pc.j pre, Fc.j forward, Bc.j backward of chunk c, micro-batch j; Uc/k part k of its once-a-step update")
    return "\n".join(lines)
