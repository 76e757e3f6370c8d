"""`sbpc diff A B`: what changes from plan A to plan B, by meaning rather than by text.

Value names differ between two compiles (a boxing inserted early renames everything after it),
so values are matched by what they are:

- parameters, their gradients, optimizer state and batch inputs by name (``h.0.attn.c_attn.weight``,
  ``exp_avg:h.0.attn.c_attn.weight``, ``batch.0``);
- every other value (an activation, a backward intermediate, an update) by the instruction that
  makes it: its phase, op, module path and file:line, in program order. The two plans' sequences
  of such keys are aligned as a text diff aligns lines (longest matching runs,
  ``difflib.SequenceMatcher``), so an op one plan adds (a vocab-parallel mask, ZeRO's backward
  transpose) shifts nothing after it; communication (collectives, issues, waits, transfers) is not
  a value here but counted by kind below.

An nd-SBP is compared per mesh axis name; an axis one plan lacks has size 1 there, i.e. B.
Collectives come from ``comm_report.per_step``, memory from the plan's estimates (per rank
role, by term), the step time from `sbpc simulate` on a cluster when one is given, else from
``plan_costs`` (the compiler's own cost model).
"""
from __future__ import annotations

import difflib

from pydantic import BaseModel, computed_field

from sbpc.compiler.tools.comm_report import per_step
from sbpc.compiler.tools.memory_report import COLUMNS, size_text
from sbpc.compiler.tools.cluster import Cluster
from sbpc.compiler.tools.plan_costs import SOURCE, plan_cost
from sbpc.compiler.tools.simulate import simulate
from sbpc.runtime.kinds import ISSUE, WAIT, Collective as Kind
from sbpc.runtime.pipeline_tasks import TRANSFER
from sbpc.runtime.plan import Plan, ValueType

SPEC_KINDS = ("param", "grad", "state", "batch")
EXAMPLES = 3  # names the text shows of each kind of SBP change (--all: every one)


class PlanSide(BaseModel):
    path: str
    model: str
    mesh: dict[str, int]
    devices: int
    instructions: int


class SbpChange(BaseModel):
    what: str  # param, grad, state, batch or value
    name: str  # a spec's name; for a value, its key "phase op module @ file:line"
    a: list[str]  # nd-SBP over ``PlanDiff.axes``
    b: list[str]
    value_a: str | None = None  # the value's name in each plan
    value_b: str | None = None


class Matched(BaseModel):
    what: str
    matched: int
    changed: int
    only_a: int
    only_b: int


class Figure(BaseModel):
    a: float
    b: float

    @computed_field
    @property
    def delta(self) -> float:
        return self.b - self.a


class CommRow(BaseModel):
    kind: str
    axis: str
    role: str
    calls: Figure
    nbytes: Figure


class MemoryRow(BaseModel):
    role: str  # "stage 0"; a role only one plan has is 0 in the other
    terms: dict[str, Figure]  # COLUMNS of memory_report, bytes per device


class PlanDiff(BaseModel):
    a: PlanSide
    b: PlanSide
    axes: list[str]
    matched: list[Matched]
    changes: list[SbpChange]
    collectives: list[CommRow]
    calls: Figure  # per step
    bytes_moved: Figure  # per step, each device's input bytes of every collective and transfer
    memory: list[MemoryRow]
    peak_memory: Figure  # the fullest role's total, bytes per device
    step_time_s: Figure
    step_time_source: str


def diff_plans(a: Plan, b: Plan, path_a: str, path_b: str, cluster: Cluster | None = None) -> PlanDiff:
    axes = _axes(a) + [x for x in _axes(b) if x not in _axes(a)]
    matched, changes = [], []
    for what in SPEC_KINDS:
        sa, sb = _specs(a, what), _specs(b, what)
        common = [n for n in sa if n in sb]
        rows = [SbpChange(what=what, name=n, a=_over(a, sa[n].sbp, axes), b=_over(b, sb[n].sbp, axes)) for n in common]
        rows = [r for r in rows if r.a != r.b]
        matched.append(Matched(what=what, matched=len(common), changed=len(rows),
                               only_a=len(sa) - len(common), only_b=len(sb) - len(common)))
        changes += rows
    ka, kb = _values(a), _values(b)
    sm = difflib.SequenceMatcher(None, [k for k, _, _ in ka], [k for k, _, _ in kb], autojunk=False)
    pairs = [(ka[blk.a + i], kb[blk.b + i]) for blk in sm.get_matching_blocks() for i in range(blk.size)]
    rows = [SbpChange(what="value", name=key, a=_over(a, ta.sbp, axes), b=_over(b, tb.sbp, axes), value_a=va, value_b=vb)
            for (key, va, ta), (_, vb, tb) in pairs]
    rows = [r for r in rows if r.a != r.b]
    matched.append(Matched(what="value", matched=len(pairs), changed=len(rows), only_a=len(ka) - len(pairs),
                           only_b=len(kb) - len(pairs)))
    changes += rows
    comm = _collectives(a, b)
    calls = Figure(a=sum(r.calls.a for r in comm), b=sum(r.calls.b for r in comm))
    moved = Figure(a=sum(r.nbytes.a for r in comm), b=sum(r.nbytes.b for r in comm))
    memory = _memory(a, b)
    if cluster is not None:
        step = Figure(a=simulate(a, cluster).step_time_s, b=simulate(b, cluster).step_time_s)
        source = f"sbpc simulate on cluster {cluster.name}"
    else:
        step = Figure(a=plan_cost(a).step_time_s, b=plan_cost(b).step_time_s)
        source = SOURCE
    peak = Figure(a=max(r.total for r in a.estimates.roles), b=max(r.total for r in b.estimates.roles))
    return PlanDiff(a=_side(a, path_a), b=_side(b, path_b), axes=axes, matched=matched, changes=changes,
                    collectives=comm, calls=calls, bytes_moved=moved, memory=memory, peak_memory=peak,
                    step_time_s=step, step_time_source=source)


def _axes(plan: Plan) -> list[str]:
    return [x.name for x in plan.mesh if x.name != "pp"]


def _over(plan: Plan, sbp: list[str], axes: list[str]) -> list[str]:
    mine = dict(zip(_axes(plan), sbp))
    return [mine.get(x, "B") for x in axes]


def _side(plan: Plan, path: str) -> PlanSide:
    return PlanSide(path=path, model=plan.model.path, mesh={x.name: x.size for x in plan.mesh},
                    devices=plan.world_size, instructions=plan.estimates.instructions)


def _specs(plan: Plan, what: str) -> dict:
    if what == "param":
        return {p.name: p for p in plan.params}
    if what == "state":
        return {s.name: s for s in plan.states}
    if what == "batch":
        return {s.name: s for s in plan.batch}
    made = {o: t for prog in plan.stages for ins in prog.instructions for o, t in zip(ins.outs, ins.types)}
    return {p.name: made[p.grad] for p in plan.params if p.grad in made}


def _values(plan: Plan) -> list[tuple[str, str, ValueType]]:
    """(key, value, type) of every result of a non-communication instruction, in program order."""
    out = []
    for prog in plan.stages:
        for ins in prog.instructions:
            if ins.op in (ISSUE, WAIT, TRANSFER) or Kind.of(ins.op) is not None:
                continue
            where = str(ins.loc) if ins.loc else "no source"
            for j, (v, t) in enumerate(zip(ins.outs, ins.types)):
                if t.dtype in ("none", "work"):
                    continue
                out.append((f"{ins.role} {ins.op}{f'#{j}' if len(ins.outs) > 1 else ''} {where}", v, t))
    return out


def _collectives(a: Plan, b: Plan) -> list[CommRow]:
    ta = {(t.kind, t.axis, t.role): t for t in per_step(a)}
    tb = {(t.kind, t.axis, t.role): t for t in per_step(b)}
    rows = []
    for key in sorted(ta.keys() | tb.keys()):
        x, y = ta.get(key), tb.get(key)
        rows.append(CommRow(kind=key[0], axis=key[1], role=key[2],
                            calls=Figure(a=x.calls if x else 0, b=y.calls if y else 0),
                            nbytes=Figure(a=x.nbytes if x else 0, b=y.nbytes if y else 0)))
    return rows


def _memory(a: Plan, b: Plan) -> list[MemoryRow]:
    ra, rb = {r.role: r for r in a.estimates.roles}, {r.role: r for r in b.estimates.roles}
    roles = list(ra) + [r for r in rb if r not in ra]
    get = lambda r, c: getattr(r, c) if r is not None else 0
    return [MemoryRow(role=role, terms={c: Figure(a=get(ra.get(role), c), b=get(rb.get(role), c)) for c in COLUMNS})
            for role in roles]


def _signed(x: float, fmt) -> str:
    return ("+" if x > 0 else "-" if x < 0 else "") + fmt(abs(x))


def _pct(f: Figure) -> str:
    return f" ({f.delta / f.a:+.0%})" if f.a else ""


def diff_text(d: PlanDiff, show_all: bool = False) -> str:
    """The diff as text; ``show_all``: every changed name, not the first ``EXAMPLES`` of each change."""
    mesh = lambda s: " ".join(f"{k}={v}" for k, v in s.mesh.items())
    lines = [f"a: {d.a.path} ({d.a.model}, mesh {mesh(d.a)}, {d.a.devices} devices, {d.a.instructions} instructions)",
             f"b: {d.b.path} ({d.b.model}, mesh {mesh(d.b)}, {d.b.devices} devices, {d.b.instructions} instructions)"]
    if d.a.model != d.b.model:
        lines.append("note: the plans are of different model files; only names and source lines that agree match")
    sbp = lambda nd: "[" + ", ".join(nd) + "]"
    names = {"param": "parameters", "grad": "gradients", "state": "optimizer state", "batch": "batch inputs",
             "value": "values (matched by phase, op and source line)"}
    lines.append(f"\nSBP changes (nd-SBP over {', '.join(d.axes)}), by change:")
    for m in d.matched:
        extra = "".join(f", {n} only in {s}" for n, s in ((m.only_a, "a"), (m.only_b, "b")) if n)
        lines.append(f"  {names[m.what]}: {m.changed} of {m.matched} changed{extra}")
        groups: dict[tuple[str, str], list[SbpChange]] = {}
        for c in d.changes:
            if c.what == m.what:
                groups.setdefault((sbp(c.a), sbp(c.b)), []).append(c)
        for (fa, fb), rows in groups.items():
            shown = rows if show_all else rows[:EXAMPLES]
            more = f" (and {len(rows) - len(shown)} more)" if len(shown) < len(rows) else ""
            if m.what != "value":
                lines.append(f"    {fa} -> {fb}: {len(rows)}: {', '.join(c.name for c in shown)}{more}")
                continue
            lines.append(f"    {fa} -> {fb}: {len(rows)}{more and ', such as'}")
            lines += [f"      %{c.value_a}: {c.name}" + (f" (%{c.value_b} in b)" if c.value_b != c.value_a else "")
                      for c in shown]
    lines.append("\ncollectives per step (calls; bytes of each device's inputs):")
    lines.append(f"  {'kind':<15} {'axis':<4} {'phase':<5} {'a':>5} {'b':>5} {'delta':>6}  {'a':>10} {'b':>10} {'delta':>11}")
    mb = lambda x: size_text(int(x))
    for r in d.collectives:
        lines.append(f"  {r.kind:<15} {r.axis:<4} {r.role:<5} {r.calls.a:>5.0f} {r.calls.b:>5.0f} {r.calls.delta:>+6.0f}  "
                     f"{mb(r.nbytes.a):>10} {mb(r.nbytes.b):>10} {_signed(r.nbytes.delta, mb):>11}")
    lines.append(f"  {'total':<26} {d.calls.a:>5.0f} {d.calls.b:>5.0f} {d.calls.delta:>+6.0f}  "
                 f"{mb(d.bytes_moved.a):>10} {mb(d.bytes_moved.b):>10} {_signed(d.bytes_moved.delta, mb):>11}")
    lines.append(f"bytes moved per step: {size_text(int(d.bytes_moved.a))} -> {size_text(int(d.bytes_moved.b))}, "
                 f"{_signed(d.bytes_moved.delta, lambda x: size_text(int(x)))}{_pct(d.bytes_moved)}")
    lines.append("\nmemory per device at each rank role's peak:")
    lines.append(f"  {'role':<10} {'term':<12} {'a':>10} {'b':>10} {'delta':>11}")
    for r in d.memory:
        for term, f in r.terms.items():
            if f.a or f.b:
                lines.append(f"  {r.role:<10} {term:<12} {size_text(int(f.a)):>10} {size_text(int(f.b)):>10} "
                             f"{_signed(f.delta, lambda x: size_text(int(x))):>11}")
    ms = lambda x: f"{x * 1e3:.3f} ms"
    t = d.step_time_s
    lines.append(f"\npredicted step time: {ms(t.a)} -> {ms(t.b)}, {_signed(t.delta, ms)}{_pct(t)}")
    lines.append(f"  ({d.step_time_source})")
    return "\n".join(lines)
