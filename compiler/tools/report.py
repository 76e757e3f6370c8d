"""`sbpc report PLAN -o report.html` (and `sbpc inspect --html`): the plan as one standalone
HTML page, rendered with jinja2 from ``codegen_templates/report.html.j2``.

The page needs no network: its CSS is inline and its pictures are inline SVG drawn here (the
pipeline timeline, the memory bars), with no script at all. Times are the compiler's cost
model (``plan_costs``), the memory the plan's estimates, the communication ``comm_report``'s;
given a cluster, a section shows `sbpc simulate`'s prediction on it.
"""
from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from importlib import resources

import jinja2

from sbpc.compiler.tools.cluster import Cluster
from sbpc.compiler.tools.comm_report import collectives, per_step
from sbpc.compiler.tools.memory_report import COLUMNS, size_text
from sbpc.compiler.tools.plan_costs import PlanCost, plan_cost
from sbpc.compiler.tools.simulate import simulate
from sbpc.runtime.files import write_atomic
from sbpc.runtime.pipeline_tasks import PER_MICROBATCH, fmt
from sbpc.runtime.plan import Plan

PHASE_COLOURS = {"pre": "#9e9e9e", "fwd": "#4e79a7", "bwd": "#f28e2b", "opt": "#59a14f"}
TERM_COLOURS = dict(zip(COLUMNS[:-1], ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#b07aa1")))
WIDTH = 960  # px of the drawing area of the timeline and the memory bars
ROW = 26  # px per timeline or memory row
TOP_BOXINGS = 12
GRID_LIMIT = 256  # rank grids of at most this many ranks per pp stage are drawn cell by cell
STAGE_GRIDS = 8  # pp stages whose grid is drawn; the rest are listed by rank range


@dataclass(frozen=True)
class Rect:
    x: float
    y: float
    w: float
    colour: str
    label: str  # drawn inside when it fits
    title: str  # the tooltip


@dataclass(frozen=True)
class RankGrid:
    stage: int | None  # the pp coordinate; None without a pp axis
    first: int
    last: int
    row_axis: str
    col_label: str  # the axes the columns enumerate, "tp" or "cp,tp"
    cols: list[str]  # each column's coordinates
    rows: list[list[int]]  # rank per (row, column); empty when the grid is too big to draw


@dataclass(frozen=True)
class CommRow:
    kind: str
    axis: str
    role: str
    calls: int
    tensors: int
    nbytes: int
    seconds: float


@dataclass(frozen=True)
class Boxing:
    kind: str
    axis: str
    role: str
    values: str
    nbytes: int  # per call
    per_step: int  # firings per step
    seconds: float  # per step
    loc: str


def render_report(plan: Plan, cluster: Cluster | None = None) -> str:
    """The page; with ``cluster``, also `sbpc simulate`'s prediction on it (its own section)."""
    source = resources.files("sbpc.codegen_templates").joinpath("report.html.j2").read_text()
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    counts = collections.Counter((i.role, i.op) for s in plan.stages for i in s.instructions)
    order = {"fwd": 0, "bwd": 1, "opt": 2}
    op_counts = sorted(counts.items(), key=lambda kv: (order.get(kv[0][0], 3), -kv[1], kv[0][1]))
    cost = plan_cost(plan)
    timeline, span = _timeline(plan, cost)
    comm, boxings = _communication(plan, cost)
    return env.from_string(source).render(
        plan=plan, op_counts=op_counts, cost=cost, grids=rank_grids(plan), timeline=timeline, span=span,
        memory=_memory_bars(plan), terms=TERM_COLOURS, phases=PHASE_COLOURS, comm=comm, boxings=boxings,
        width=WIDTH, row=ROW, stage_grids=STAGE_GRIDS,
        mib=lambda b: f"{b / 2**20:,.2f} MiB", size=size_text, ms=_time_text,
        flop=_flop_text, layers=_layers_text, sim=simulate(plan, cluster) if cluster is not None else None)


def write_report(plan: Plan, path: str, cluster: Cluster | None = None) -> None:
    write_atomic(path, render_report(plan, cluster))


def rank_grids(plan: Plan) -> list[RankGrid]:
    """Per pp stage, its ranks as a grid: the first non-pp axis down, the others across."""
    axes = [(a.name, a.size) for a in plan.mesh]
    pp = dict(axes).get("pp", 1)
    inner = [(n, s) for n, s in axes if n != "pp"]
    per_stage = math.prod(s for _, s in inner)
    row_axis, rows_n = inner[0] if inner else ("dp", 1)
    rest = inner[1:]
    cols_n = math.prod(s for _, s in rest)
    cols = [",".join(f"{n}={c}" for (n, _), c in zip(rest, _unravel(j, [s for _, s in rest]))) for j in range(cols_n)]
    grids = []
    for st in range(pp):
        first = _rank(plan, {"pp": st}) if "pp" in dict(axes) else 0
        rows = []
        if per_stage <= GRID_LIMIT:
            for r in range(rows_n):
                rows.append([_rank(plan, {"pp": st, row_axis: r, **dict(zip([n for n, _ in rest],
                                                                          _unravel(j, [s for _, s in rest])))})
                             for j in range(cols_n)])
        grids.append(RankGrid(st if "pp" in dict(axes) else None, first, first + per_stage - 1, row_axis,
                              ",".join(n for n, _ in rest), cols if per_stage <= GRID_LIMIT else [], rows))
    return grids


def _unravel(j: int, sizes: list[int]) -> list[int]:
    out = []
    for s in reversed(sizes):
        out.append(j % s)
        j //= s
    return out[::-1]


def _rank(plan: Plan, coords: dict[str, int]) -> int:
    """The rank at ``coords`` (axes not named: 0), row-major in the plan's axis order."""
    rank = 0
    for a in plan.mesh:
        rank = rank * a.size + coords.get(a.name, 0)
    return rank


def _timeline(plan: Plan, cost: PlanCost) -> tuple[list[Rect], float]:
    """The pipeline's simulated firings, one row per device stage; a one-program plan's phases
    in one row. x in px of ``WIDTH``."""
    if cost.simulation is not None:
        slices = [(s.device, s.task.phase, s.start, s.end, fmt(s.task)) for s in cost.simulation.timeline]
    else:
        slices, t = [], 0.0
        for phase in ("pre", "fwd", "bwd", "opt"):
            d = cost.phase_s.get(phase, 0.0)
            if d > 0:
                slices.append((0, phase, t, t + d, phase))
                t += d
    span = max((end for _, _, _, end, _ in slices), default=0.0)
    scale = WIDTH / span if span > 0 else 0.0
    rects = [Rect(start * scale, device * ROW, max((end - start) * scale, 0.5), PHASE_COLOURS.get(phase, "#999"),
                  name if (end - start) * scale > 8 * len(name) else "",
                  f"{name} on stage {device}: {start * 1e3:.3f}-{end * 1e3:.3f} ms")
             for device, phase, start, end, name in slices if end > start]
    return rects, span


def _memory_bars(plan: Plan) -> list[tuple[str, int, list[Rect], float]]:
    """Per rank role: (role, total, its terms as stacked bars, where they end), all on one scale."""
    roles = plan.estimates.roles
    top = max((r.total for r in roles), default=0)
    scale = WIDTH / top if top > 0 else 0.0
    out = []
    for i, r in enumerate(roles):
        x, rects = 0.0, []
        for term, colour in TERM_COLOURS.items():
            n = getattr(r, term)
            if n > 0:
                rects.append(Rect(x, i * ROW, n * scale, colour, term if n * scale > 8 * len(term) else "",
                                  f"{r.role} {term}: {size_text(n)}"))
                x += n * scale
        out.append((r.role, r.total, rects, x))
    return out


def _communication(plan: Plan, cost: PlanCost) -> tuple[list[CommRow], list[Boxing]]:
    """The communication per kind, axis and phase, and the costliest calls per step."""
    m = plan.pipeline.microbatches if plan.pipeline is not None else 1
    calls: dict[tuple[int, int], list] = {}
    for c in collectives(plan):
        if c.moves_data:
            calls.setdefault((c.chunk, c.index), []).append(c)
    per_row: dict[tuple[str, str, str], float] = collections.defaultdict(float)
    boxings = []
    for at, cs in calls.items():
        c = cs[0]
        times = m if c.role in PER_MICROBATCH else 1
        seconds = cost.call_s.get(at, 0.0) * times
        per_row[(c.kind, c.axis, c.role)] += seconds
        values = ", ".join(f"%{x.value}" for x in cs[:3]) + (f" (+{len(cs) - 3})" if len(cs) > 3 else "")
        boxings.append(Boxing(c.kind, c.axis, c.role, values, sum(x.nbytes for x in cs), times, seconds,
                              c.loc or f"stage {c.chunk} instruction {c.index}"))
    rows = [CommRow(t.kind, t.axis, t.role, t.calls, t.tensors, t.nbytes, per_row[(t.kind, t.axis, t.role)])
            for t in per_step(plan)]
    boxings.sort(key=lambda b: -b.seconds)
    return rows, boxings[:TOP_BOXINGS]


def _time_text(s: float) -> str:
    return f"{s:,.2f} s" if s >= 1 else f"{s * 1e3:,.3f} ms"


def _flop_text(n: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} FLOP"


def _layers_text(layers: list[str]) -> str:
    return ", ".join(layers) if len(layers) <= 6 else f"{', '.join(layers[:3])}, ... {', '.join(layers[-2:])} ({len(layers)})"
