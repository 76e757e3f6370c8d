"""What a plan communicates: every collective with its axis, phase, module and bytes; and
`sbpc explain`: why a value has its SBP."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from sbpc.runtime import plan as P
from sbpc.compiler.ir.types import TensorType
from sbpc.runtime.kinds import Collective as Kind
from sbpc.runtime.kinds import WAIT
from sbpc.runtime.overlap import blocking, uses
from sbpc.runtime.pipeline_tasks import TRANSFER
from sbpc.runtime.sbp import parse_nd_sbp


def _kind(op: str) -> str | None:
    """What the report calls op ``op``: its boxing kind, ``transfer`` (a send/recv between
    pipeline stages), or None (not communication)."""
    if op == TRANSFER:
        return "transfer"
    kind = Kind.of(op)
    return kind.value if kind is not None else None


@dataclass(frozen=True)
class Collective:
    kind: str  # a boxing kind (all_reduce, ..., to_host, or a local step) or transfer
    axis: str  # a mesh axis; pp for a transfer, host for a to_host / to_device
    role: str  # fwd, bwd, opt
    module: str  # the module path of the op it serves
    loc: str
    value: str
    nbytes: int  # bytes each device holds of the input
    call: int = 0  # tensors fused into one call (a gradient bucket) share it
    chunk: int = 0  # the stage program (pipeline chunk) that makes the call
    index: int = 0  # the call's position in that program (an overlapped one's sbpc.issue)

    @property
    def moves_data(self) -> bool:
        return self.kind == "transfer" or Kind(self.kind).moves_data


def collectives(plan: P.Plan) -> list[Collective]:
    sizes = tuple(a.size for a in plan.mesh if a.name != "pp")
    out = []
    for call, (chunk, index, ins) in enumerate(_calls(plan)):
        kind, bucket = _kind(ins.op), Kind.of(ins.op)
        if bucket is not None and bucket.single != bucket:  # a bucket: one call, counted per tensor
            kind, values = bucket.single.value, [a.ref for a in ins.args[0]]
        elif kind is not None:
            values = [ins.args[0].ref]
        else:
            continue
        for j, value in enumerate(values):
            t = ins.types[j]
            src = parse_nd_sbp(ins.sbp_in[j]) if ins.sbp_in else parse_nd_sbp(t.sbp)
            nbytes = TensorType(tuple(t.shape), t.dtype).local_nbytes(src, sizes)
            # a send/recv between stages crosses pp; a to_host / to_device, the device's link to its host
            axis = "pp" if kind == "transfer" else "host" if Kind(kind).memory_after else str(ins.kwargs.get("axis"))
            out.append(Collective(kind, axis, ins.role, ins.loc.module if ins.loc else "",
                                  str(ins.loc) if ins.loc else "", value, nbytes, call, chunk, index))
    return out


def _calls(plan: P.Plan):
    """(chunk, position, instruction) of the plan's instructions, an issued collective as the
    blocking call it stands for, at its issue's position."""
    for st in plan.stages:
        positions = [k for k, ins in enumerate(st.instructions) if ins.op != WAIT]  # blocking() drops the waits
        for k, ins in zip(positions, blocking(st.instructions)):
            yield st.stage, k, ins


@dataclass(frozen=True)
class StepTotal:
    """The collectives of one kind on one mesh axis in one phase, counted per step."""
    kind: str
    axis: str
    role: str
    tensors: int  # per micro-batch for pre/fwd/bwd, per step for opt
    calls: int  # per step: a bucket is one call, a micro-batch's collectives run once per micro-batch
    nbytes: int  # per step, each device's input bytes


def per_step(plan: P.Plan) -> list[StepTotal]:
    """The plan's communication per (kind, axis, phase), sorted by those."""
    # a pipelined plan runs its pre/fwd/bwd collectives once per micro-batch
    m = plan.pipeline.microbatches if plan.pipeline is not None else 1
    times = lambda role: m if role in ("pre", "fwd", "bwd") else 1
    groups: dict[tuple[str, str, str], list[Collective]] = {}
    for c in collectives(plan):
        if c.moves_data:
            groups.setdefault((c.kind, c.axis, c.role), []).append(c)
    return [StepTotal(kind, axis, role, len(cs), len({c.call for c in cs}) * times(role),
                      sum(c.nbytes for c in cs) * times(role))
            for (kind, axis, role), cs in sorted(groups.items())]


def summary(plan: P.Plan) -> str:
    totals = per_step(plan)
    if not totals:
        return "// no collectives: every op runs on its own shard"
    m = plan.pipeline.microbatches if plan.pipeline is not None else 1
    times = lambda role: m if role in ("pre", "fwd", "bwd") else 1
    calls = sum(t.calls for t in totals)
    tensors = sum(t.tensors * times(t.role) for t in totals)
    fused = f" ({tensors} tensors)" if tensors != calls else ""
    per_mb = f" ({m} micro-batches)" if m > 1 else ""
    lines = [f"// {calls} collective calls per step{per_mb}{fused}, {sum(t.nbytes for t in totals) / 2**20:.2f} MiB in:"]
    for t in totals:
        each = f" ({t.tensors} per micro-batch)" if times(t.role) > 1 else ""
        lines.append(f"//   {t.tensors * times(t.role):4d} x {t.kind:<15} on {t.axis:<3} {t.role}{each}")
    return "\n".join(lines)


def table(plan: P.Plan) -> str:
    rows = [f"{'phase':<5}  {'collective':<15}  {'axis':<4}  {'bytes':>10}  {'value':<24}  module @ file:line"]
    cs = [c for c in collectives(plan) if c.moves_data]
    sizes = Counter(c.call for c in cs)
    for c in cs:
        kind = c.kind if sizes[c.call] == 1 else f"{c.kind}*"
        rows.append(f"{c.role:<5}  {kind:<15}  {c.axis:<4}  {c.nbytes:>10}  %{c.value:<23}  {c.loc}")
    if any(n > 1 for n in sizes.values()):
        rows.append("(* fused with its neighbours into one call: a gradient bucket)")
    return "\n".join(rows)


def explain(plan: P.Plan, name: str) -> str:
    """Why ``name`` (a value ``%x``/``x`` or a parameter, buffer or state name) has its SBP."""
    from sbpc.errors import UsageError

    key = name.removeprefix("%")
    specs = [*plan.params, *plan.buffers, *plan.states, *plan.batch]
    for s in specs:
        if key in (s.name, s.value):
            lines = [f"{s.name} (%{s.value}) : {s.dtype}{s.shape} sbp=[{', '.join(s.sbp)}]", f"  because: {s.why or 'not recorded'}"]
            return "\n".join(lines + _consumers(plan, s.value))
    for st in plan.stages:
        for ins in st.instructions:
            if key in ins.outs:
                t = ins.types[ins.outs.index(key)]
                lines = [f"%{key} : {t.dtype}{t.shape} sbp=[{', '.join(t.sbp)}]",
                         f"  made by {ins.op}" + (f" at {ins.loc}" if ins.loc else ""),
                         f"  because: {ins.why or 'not recorded'}"]
                if ins.sbp_in:
                    ins_refs = uses(ins)
                    lines += [f"  it takes %{r} as [{', '.join(nd)}]" for r, nd in zip(ins_refs, ins.sbp_in)]
                return "\n".join(lines + _consumers(plan, key))
    raise UsageError(f"no value or parameter named {name!r} in the plan",
                     hint="name a parameter (h.0.attn.c_attn.weight) or a value from `sbpc inspect` (%addmm)")


def _consumers(plan: P.Plan, value: str) -> list[str]:
    lines = []
    for st in plan.stages:
        for ins in blocking(st.instructions):  # an overlapped collective as the call it stands for
            kind = Kind.of(ins.op)
            if value in uses(ins) and kind is not None and kind.single == kind:
                lines.append(f"  boxed by {kind.op}(axis={ins.kwargs.get('axis')}) -> %{ins.outs[0]} "
                             f"[{', '.join(ins.types[0].sbp)}]" + (f" for {ins.loc}" if ins.loc else ""))
    return lines
