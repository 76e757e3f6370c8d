"""stage-partition: give every op its pipeline chunk (its placement on the pp axis).

There are ``pp * virtual_stages`` chunks; ``Node.stage`` is the chunk, and chunk c runs on
pp stage c % pp. Forward ops may arrive with a chunk from a stage hint (``sbpc.stage`` in
code or ``[stages]`` in the config); a policy (``compiler/pipelining/stage_policy.py``) cuts the rest
into contiguous groups. The rules every result obeys, and ``check_stages`` enforces:

- along a forward data edge the chunk never decreases: no value goes back to an earlier chunk;
- the loss is in the last chunk;
- a backward op is in the chunk of the forward op it differentiates (the one with its source
  line), and along a backward edge the chunk never increases;
- an optimizer op is in the chunk of its parameter (that of the parameter's first reader); one
  computed from hyperparameters alone (the SGD step's -lr, which cse merged for every parameter)
  runs on every chunk that reads it, a copy per chunk, instead of being sent (``per_chunk_hyper_ops``);
- an op that depends on no batch input (a weight transpose, a constant) goes with its first
  reader; a parameter read in several chunks (tied weights) is allowed, see ``param_chunks``.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar

from sbpc.compiler.pass_manager import Fact
from sbpc.compiler.ir.aten import hyper_only
from sbpc.compiler.ir.types import FreshNames, Graph, InputKind, Node, OutputKind, Role, rename_uses
from sbpc.compiler.pipelining.stage_policy import (CostBalanced, GraphFacts, PartitionProblem, RooflineCost, StagePolicy,
                                                    first_readers, in_flight, layer_key, place_backward, profile)
from sbpc.errors import CompileError, UsageError

_HINT_FIX = "check the sbpc.stage scopes and the [stages] globs of the parallel config (docs/pipeline.md)"


@dataclass
class StagePartition:
    name: str = "stage-partition"
    needs: ClassVar[tuple[Fact, ...]] = ()
    provides: ClassVar[tuple[Fact, ...]] = (Fact.STAGES,)
    policy: StagePolicy = field(default_factory=CostBalanced)
    virtual_stages: int = 1  # chunks per pp stage (interleaved schedule)
    microbatches: int = 1  # the policy prices the activations each chunk keeps in flight

    def apply(self, graph: Graph, ctx) -> Graph:
        for key in ("virtual_stages", "microbatches"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UsageError(f"{key} must be an integer >= 1, not {value!r}")
        chunks = graph.mesh.size("pp") * self.virtual_stages
        stages = assign_stages(graph, chunks, self.policy, self.microbatches)
        out = replace(graph, nodes=[n.replace(stage=s) for n, s in zip(graph.nodes, stages)])
        out = per_chunk_hyper_ops(out)
        hinted = sorted({n.stage for n in graph.nodes if n.stage is not None and n.role == Role.FORWARD})
        check_stages(out, chunks, hinted)
        return out


def assign_stages(graph: Graph, chunks: int, policy: StagePolicy, microbatches: int = 1) -> list[int]:
    """One chunk per node: hints and data flow bound each forward op, the policy cuts within
    the bounds, then backward, free and optimizer ops follow (see the module doc)."""
    nodes = graph.nodes
    role = [n.role for n in nodes]
    fwd = [r == Role.FORWARD for r in role]
    facts = GraphFacts.of(graph) if chunks > 1 else None  # shared with the policy's profile
    hint = _hints(graph, chunks, facts.producer if facts else graph.producers())
    if facts is None:
        return [0] * len(nodes)
    preds, readers = facts.preds, facts.readers
    lo = _lower_bounds(nodes, preds, fwd, hint)
    hi = [chunks - 1] * len(nodes)
    for i in reversed(range(len(nodes))):
        if fwd[i]:
            hi[i] = min([hint[i] if hint[i] is not None else chunks - 1] + [hi[r] for r in readers[i] if fwd[r]])
    # Ops that read no batch data (weight transposes, masks from constants) carry no activation
    # from chunk to chunk: they are placed with their first reader, not cut by the policy.
    batch = {i.value for i in graph.inputs_of(InputKind.BATCH)}
    on_batch = [False] * len(nodes)
    for i, n in enumerate(nodes):
        on_batch[i] = any(u in batch for u in n.uses()) or any(on_batch[p] for p in preds[i])
    free = [fwd[i] and hint[i] is None and not on_batch[i] for i in range(len(nodes))]

    stage: list[int | None] = [None] * len(nodes)
    problem = replace(_problem(graph, chunks, microbatches, fwd, free, readers, lo, hi), facts=facts)
    per_unit = policy(problem)
    if len(per_unit) != len(problem.units) or any(not 0 <= c < chunks for c in per_unit) or per_unit != sorted(per_unit):
        raise CompileError(f"stage policy {policy!r} returned an invalid partition",
                           hint="a policy gives each unit a chunk in range, non-decreasing in program order")
    for unit, chunk in zip(problem.units, per_unit):
        for i in unit:  # clamping keeps hinted ops where they are and every edge monotone
            stage[i] = min(max(chunk, lo[i]), hi[i])
    for i in reversed(range(len(nodes))):
        if free[i]:
            placed = [stage[r] for r in readers[i] if fwd[r] and stage[r] is not None]
            stage[i] = min(placed) if placed else None
    place_backward(nodes, preds, readers, stage, chunks - 1)
    for i in range(len(nodes)):  # free forward ops that only backward reads
        if fwd[i] and stage[i] is None:
            stage[i] = next((stage[r] for r in readers[i] if stage[r] is not None), lo[i])
    first = first_readers(graph, stage)
    for i, owned in facts.owners.items():
        if owned:
            stage[i] = min(first.get(p, 0) for p in owned)
    for i in reversed(range(len(nodes))):  # shared optimizer ops (the step): with their first chunk
        if stage[i] is None:
            stage[i] = min((stage[r] for r in readers[i] if stage[r] is not None), default=0)
    return stage


def per_chunk_hyper_ops(graph: Graph) -> Graph:
    """Each optimizer op computed from hyperparameters and constants alone, placed, runs on every
    chunk that reads it: a copy per further chunk (results renamed ``<value>_chunk<c>``, right
    after the original, which moves to a reading chunk). Sent instead, it made every later
    stage's update wait in the ``opt`` phase for the first stage's, which under 1F1B finishes
    its backward last, and the step's loss, broadcast from the last stage, waited for both."""
    hyper = {i.value for i in graph.inputs_of(InputKind.HYPER)}
    nodes = graph.nodes
    producer = graph.producers()
    pure = hyper_only(graph)
    # the chunks that read each pure op's results (a step output: its own chunk too)
    results = {o.value for o in graph.outputs}
    need = [{n.stage} if pure[k] and set(n.outputs) & results else set() for k, n in enumerate(nodes)]
    for k in reversed(range(len(nodes))):  # a pure op's readers come after it: its need is complete
        for u in nodes[k].uses():
            p = producer.get(u)
            if p is not None and pure[p]:
                need[p] |= need[k] if pure[k] else {nodes[k].stage}
    if not any(len(need[k] - {nodes[k].stage}) for k in range(len(nodes)) if pure[k]):
        return graph
    fresh = FreshNames(set(producer) | hyper | {i.value for i in graph.inputs})
    name: dict[tuple[str, int], str] = {}  # (value, chunk) -> the chunk's copy of a pure value
    out: list[Node] = []
    for k, n in enumerate(nodes):
        if not pure[k]:
            renamed = any((u, n.stage) in name for u in n.uses())  # a copy only where a use changes
            out.append(rename_uses(n, lambda v: name.get((v, n.stage), v)) if renamed else n)
            continue
        home = n.stage if n.stage in need[k] or not need[k] else min(need[k])
        for c in sorted({home} | need[k]):
            outs = n.outputs if c == home else [fresh(f"{o}_chunk{c}") for o in n.outputs]
            name.update(((o, c), new) for o, new in zip(n.outputs, outs) if c != home)
            out.append(rename_uses(n, lambda v: name.get((v, c), v)).replace(outputs=outs, stage=c))
    return replace(graph, nodes=out)


def _hints(graph: Graph, chunks: int, producer: dict[str, int]) -> list[int | None]:
    """Forward ops' chunks from stage hints; the loss is pinned to the last chunk."""
    hint = [n.stage if n.role == Role.FORWARD else None for n in graph.nodes]
    pp = graph.mesh.size("pp")
    for n, h in zip(graph.nodes, hint):
        if h is not None and not 0 <= h < chunks:
            raise CompileError(f"{n.op} is hinted to chunk {h}, but there are {chunks} chunks "
                               f"(pp={pp} x {chunks // pp} virtual stages)", location=_loc(n), hint=_HINT_FIX)
    loss = producer.get(graph.outputs_of(OutputKind.LOSS)[0].value)
    if loss is not None and graph.nodes[loss].role == Role.FORWARD:
        n = graph.nodes[loss]
        if hint[loss] not in (None, chunks - 1):
            raise CompileError(f"the loss ({n.op}) is hinted to chunk {hint[loss]}, but it is computed in the last "
                               f"chunk, {chunks - 1}", location=_loc(n), hint=_HINT_FIX)
        hint[loss] = chunks - 1
    return hint


def _lower_bounds(nodes: list[Node], preds, fwd, hint) -> list[int]:
    """The least chunk of each forward op: the largest hint upstream. A hint below it is the
    one impossible request, reported with both ops."""
    lo, src = [0] * len(nodes), [-1] * len(nodes)
    for i, n in enumerate(nodes):
        if not fwd[i]:
            continue
        best, origin = 0, -1
        for p in preds[i]:
            if fwd[p] and lo[p] > best:
                best, origin = lo[p], src[p]
        if hint[i] is not None and hint[i] < best:
            o = nodes[origin]
            raise CompileError(f"{n.op} is hinted to chunk {hint[i]} but depends on {o.op}"
                               f"{f' ({o.loc})' if o.loc else ''}, which is in the later chunk {best}: forward "
                               f"values only flow to the same or a later chunk", location=_loc(n), hint=_HINT_FIX)
        lo[i], src[i] = (hint[i], i) if hint[i] is not None else (best, origin)
    return lo


def _problem(graph, chunks, microbatches, fwd, free, readers, lo, hi) -> PartitionProblem:
    order = [i for i in range(len(graph.nodes)) if fwd[i] and not free[i]]
    units: list[list[int]] = []
    key = object()
    for i in order:
        loc = graph.nodes[i].loc
        k = layer_key(loc.module) if loc is not None else key  # no module: stays with the op before
        if not units or k != key:
            units.append([])
        units[-1].append(i)
        key = k
    if len(units) < graph.mesh.size("pp"):
        _too_few_units(graph, units)
    if len(units) < chunks:  # more virtual chunks than layers: cut between ops
        units = [[i] for i in order]
    group: list[int | None] = [None] * len(graph.nodes)
    for u, unit in enumerate(units):
        for i in unit:
            group[i] = u
    for i in reversed(range(len(graph.nodes))):
        if free[i]:  # costed with the unit of its first reader
            group[i] = min((group[r] for r in readers[i] if fwd[r] and group[r] is not None), default=None)
    ulo = [max(lo[i] for i in unit) for unit in units]
    uhi = [min(hi[i] for i in unit) for unit in units]
    for u in range(1, len(units)):  # monotone bounds; clamping ops afterwards restores exact ones
        ulo[u] = max(ulo[u], ulo[u - 1])
    for u in reversed(range(len(units) - 1)):
        uhi[u] = min(uhi[u], uhi[u + 1])
    uhi = [max(a, b) for a, b in zip(ulo, uhi)]
    return PartitionProblem(graph, chunks, microbatches, units, ulo, uhi, group)


def _too_few_units(graph: Graph, units: list[list[int]]) -> None:
    """More pipeline stages than layer units: a stage would be empty or cut a layer in two."""
    pp = graph.mesh.size("pp")
    names = [(layer_key(graph.nodes[u[0]].loc.module) if graph.nodes[u[0]].loc else "") or "(root)" for u in units]
    shown = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
    raise CompileError(f"pp={pp} needs a layer unit per pipeline stage, but the model has only {len(units)} to cut "
                       f"between ({shown}); the maximum pp is {len(units)}",
                       hint="pipeline stages are cut between layers (numbered modules such as h.3) and other "
                            "top-level modules, never inside one; use a smaller pp or a deeper model")


def check_stages(graph: Graph, num_chunks: int, hinted: list[int] | None = None) -> None:
    """The placement rules (see the module doc); a violation names the op and its line.
    ``hinted``: the chunks the user's stage hints name, which an empty chunk is blamed on."""
    made = {v: graph.nodes[i] for v, i in graph.producers().items()}
    stage = {v: n.stage for v, n in made.items()}
    role = {v: n.role for v, n in made.items()}
    used = [0] * num_chunks
    for n in graph.nodes:
        if n.stage is None or not 0 <= n.stage < num_chunks:
            raise CompileError(f"{n.op} is placed on chunk {n.stage}, outside 0..{num_chunks - 1}", location=_loc(n))
        if n.role == Role.FORWARD:
            used[n.stage] += 1
        for u in n.uses():
            if role.get(u) == n.role == Role.FORWARD and stage[u] > n.stage:
                raise CompileError(f"{n.op} in chunk {n.stage} reads %{u} from the later chunk {stage[u]}: forward "
                                   "values only flow to the same or a later chunk", location=_loc(n), hint=_HINT_FIX)
            if role.get(u) == n.role == Role.BACKWARD and stage[u] < n.stage:
                raise CompileError(f"{n.op} in chunk {n.stage} reads the gradient %{u} of the earlier chunk "
                                   f"{stage[u]}: gradients only flow to the same or an earlier chunk", location=_loc(n))
    loss = graph.outputs_of(OutputKind.LOSS)[0].value
    if loss in stage and stage[loss] != num_chunks - 1:
        raise CompileError(f"the loss is in chunk {stage[loss]}, not the last chunk {num_chunks - 1}", hint=_HINT_FIX)
    if 0 in used and hinted:  # the partitioner cuts within the hints' bounds: they left the chunk nothing
        named = ", ".join(map(str, hinted))
        raise CompileError(f"pipeline chunk {used.index(0)} of {num_chunks} gets no forward op: the stage hints "
                           f"(the config's [stages], sbpc.stage scopes) place modules on chunk{'s' * (len(hinted) > 1)} "
                           f"{named} only",
                           hint=f"spread the hints over chunks 0-{num_chunks - 1} for this mesh (pp x virtual stages), "
                                "or drop [stages] and let the partitioner cut")
    if 0 in used:
        raise CompileError(f"pipeline chunk {used.index(0)} of {num_chunks} gets no forward op",
                           hint="use fewer pipeline stages (pp) or virtual stages, or move ops onto it with stage hints")


def param_chunks(graph: Graph) -> dict[str, set[int]]:
    """Param value -> the chunks whose forward or backward ops read it (through ``sbpc.hint``
    ops). More than one chunk: a tied weight, which each of them must hold."""
    readers = graph.users()
    out = {}
    for p in graph.inputs_of(InputKind.PARAM):
        chunks, todo = set(), [p.value]
        while todo:
            for n in (graph.nodes[i] for i in readers.get(todo.pop(), [])):
                if n.op == "sbpc.hint":
                    todo.extend(n.outputs)
                elif n.role in (Role.FORWARD, Role.BACKWARD) and n.stage is not None:
                    chunks.add(n.stage)
        out[p.value] = chunks
    return out


def stage_summary(graph: Graph, cost: RooflineCost | None = None, microbatches: int = 1) -> list[str]:
    """One line per chunk of a partitioned graph: its modules, ops, and the costs the policy
    balanced (compute, activations in flight, parameters + state, bytes sent on)."""
    chunks = max((n.stage for n in graph.nodes if n.stage is not None), default=-1) + 1
    if chunks == 0:
        return []
    prof = profile(graph, [n.stage for n in graph.nodes], chunks, cost or RooflineCost())
    mods: list[list[str]] = [[] for _ in range(chunks)]
    for n in graph.nodes:
        key = layer_key(n.loc.module) if n.loc is not None else ""
        if n.role == Role.FORWARD and key and key not in mods[n.stage]:
            mods[n.stage].append(key)
    pp = graph.mesh.size("pp")
    lines = []
    for c in range(chunks):
        # an enclosing module (model.transformer around its blocks) says less than its children
        keys = [k for k in mods[c] if not any(o.startswith(k + ".") for o in mods[c])] or ["(root)"]
        span = f"{keys[0]} .. {keys[-1]}" if len(keys) > 1 else keys[0]
        f, b, o = prof.ops[c]
        k = in_flight(c, chunks, microbatches)
        lines.append(f"chunk {c} (pp stage {c % pp}): {span}; {f} fwd / {b} bwd / {o} opt ops; "
                     f"compute {_us(prof.compute[c])}; activations {_mb(prof.saved[c])} x {k} in flight; "
                     f"params+state {_mb(prof.static[c])}; sends {_mb(prof.crossing[c + 1])}")
    return lines


def _us(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s >= 1e-3 else f"{s * 1e6:.1f} us"


def _mb(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"


def _loc(n: Node) -> str | None:
    return str(n.loc) if n.loc else None
