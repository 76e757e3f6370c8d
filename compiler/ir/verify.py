"""The IR verifier. It runs after every pass; a pass that breaks an invariant is caught here.

Invariants: SSA (one definition per value, defined before use), one type per result, exactly
one loss, gradients and updates name real params/states, outside the init region no mutation
but of a value nothing reads later (the inplace pass's overwrites of dead optimizer values and
of the backward's dying gradient contributions),
placement all-or-nothing, and each nd-SBP has one entry per non-pp mesh axis with split dims
inside the tensor's rank.
"""
from __future__ import annotations

from sbpc.compiler.ir.aten import ACCUMULATE_IN_PLACE, is_mutating, overwritten
from sbpc.compiler.ir.types import Role, Graph, InputKind, Node, OutputKind
from sbpc.runtime.kinds import Collective, MemoryKind
from sbpc.runtime.pipeline_tasks import TRANSFER
from sbpc.runtime.sbp import Split
from sbpc.errors import IRError


def verify(graph: Graph, after: str = "", checked: Graph | None = None) -> None:
    """``checked``: a graph verified before on the same mesh (the one before the pass; the
    caller holds it, so its nodes' ids are not reused). Its nodes that ``graph`` still holds
    passed the check of its nd-SBPs' shapes, the dearest of a node alone, and are not checked
    again: nodes are never changed in place; nor is its init region if the pass kept it. What
    depends on the order and the whole step (SSA, mutations, the signature, the stage
    placement) is checked in full every time."""
    where = f" after pass {after!r}" if after else ""
    foreign = {i.value for i in graph.inputs if i.kind in (InputKind.BATCH, InputKind.BUFFER)}
    mutating = _mutating_ops(graph.nodes)
    defined = _verify_region(graph.nodes, {i.value for i in graph.inputs}, where, mutating, foreign)
    _verify_overwrites(graph, mutating, where)
    for out in graph.outputs:
        if out.value not in defined:
            raise IRError(f"graph output {out.kind.value} {out.name!r} uses undefined value %{out.value}{where}")
    # the init region stands alone (it reads no graph input): the lists ``checked`` holds passed
    if checked is None or graph.init is not checked.init or graph.init_outputs is not checked.init_outputs:
        init_defined = _verify_region(graph.init, set(), where)  # the init region mutates as it likes
        for out in graph.init_outputs:
            if out.value not in init_defined:
                raise IRError(f"init output {out.name!r} uses undefined value %{out.value}{where}")
    _verify_signature(graph, where)
    seen = {id(n) for n in checked.nodes} if checked is not None and checked.mesh == graph.mesh else set()
    _verify_annotations(graph, where, seen)


def _mutating_ops(nodes: list[Node]) -> set[str]:
    """The in-place ops among ``nodes``: the schema is asked once per distinct op, not per node."""
    return {op for op in {n.op for n in nodes} if is_mutating(op)}


def _verify_region(nodes: list[Node], defined: set[str], where: str, forbidden: set[str] = frozenset(),
                   foreign: set[str] = frozenset()) -> set[str]:
    """Checks ``nodes`` given the values ``defined`` before them (not changed); returns those
    and every value the nodes define. ``forbidden``: the in-place ops among them, which only an
    update may be (``_update_overwrite``)."""
    given, defined = defined, set(defined)
    # a few set operations per node, bound once: the verifier runs after every pass, on ~40k nodes
    covers, define = defined.issuperset, defined.update
    for n in nodes:
        if not covers(n.uses()):
            use = next(u for u in n.uses() if u not in defined)
            raise IRError(f"{n.op} uses %{use} before it is defined{where}", location=_loc(n))
        outputs = n.outputs
        if len(n.types) != len(outputs):
            raise IRError(f"{n.op} has {len(outputs)} results but {len(n.types)} types{where}", location=_loc(n))
        if forbidden and n.op in forbidden and not _update_overwrite(n, foreign):
            raise IRError(f"{n.op} mutates a tensor in place, which a plan cannot express{where}", location=_loc(n),
                          hint="write the update out of place (x = x + y instead of x += y)")
        size = len(defined)
        define(outputs)
        if len(defined) != size + len(outputs):  # an output defined before, or twice by this node
            earlier = nodes[:next(k for k, m in enumerate(nodes) if m is n)]
            before = given.union(*(m.outputs for m in earlier))
            twice = next(o for k, o in enumerate(outputs) if o in before or o in outputs[:k])
            raise IRError(f"value %{twice} is defined twice{where}", location=_loc(n))
    return defined


def _update_overwrite(n: Node, foreign: set[str]) -> bool:
    """The mutations a step may hold (the ``inplace`` pass makes them): an optimizer op, or a
    backward gradient accumulation (``add_``), overwriting values the step owns (not a batch or
    a buffer); ``_verify_overwrites`` checks that nothing reads them afterwards."""
    over = overwritten(n)
    role = n.role == Role.OPTIMIZER or (n.role == Role.BACKWARD and n.op == ACCUMULATE_IN_PLACE)
    return role and bool(over) and not foreign.intersection(over)


def _verify_overwrites(graph: Graph, mutating: set[str], where: str) -> None:
    """A value overwritten in place is read by nothing that runs after it on its device stage
    (a pipeline's stage runs by its task order), sent by no transfer, and is no graph output.
    ``mutating``: the in-place ops among the nodes."""
    if not mutating:
        return
    from sbpc.compiler.passes.schedule import execution_positions  # the runtime's task cut and order

    over = {v for n in graph.nodes if n.op in mutating for v in overwritten(n)}
    at = execution_positions(graph)
    outputs = {o.value for o in graph.outputs}
    last: dict[tuple[str, int], tuple[int, int]] = {}
    sent: set[str] = set()
    for (stage, pos), n in zip(at, graph.nodes):
        if over.isdisjoint(n.uses()):  # most nodes read no overwritten value: one set operation
            continue
        for u in n.uses():
            if u not in over:
                continue
            if n.op == TRANSFER:
                sent.add(u)
            else:
                last[(u, stage)] = max(last.get((u, stage), pos), pos)
    for (stage, pos), n in zip(at, graph.nodes):
        if n.op not in mutating:
            continue
        for v in overwritten(n):
            why = "a graph output" if v in outputs else "sent to another stage" if v in sent \
                else "read later" if last.get((v, stage), pos) > pos else None
            if why:
                raise IRError(f"{n.op} overwrites %{v}, which is {why}{where}",
                              location=_loc(n), hint="only a value nothing reads afterwards may be updated in place")


def _verify_signature(graph: Graph, where: str) -> None:
    losses = graph.outputs_of(OutputKind.LOSS)
    if len(losses) != 1:
        raise IRError(f"graph has {len(losses)} loss outputs, expected exactly one{where}")
    params = {i.name for i in graph.inputs_of(InputKind.PARAM)}
    states = {i.name for i in graph.inputs_of(InputKind.STATE)}
    for out in graph.outputs_of(OutputKind.GRAD):
        if out.name not in params:
            raise IRError(f"gradient output names {out.name!r}, which is not a parameter{where}")
    buffers = {i.name for i in graph.inputs_of(InputKind.BUFFER)}
    updatable = params | states | buffers  # once: a 1T graph has ~100k update outputs
    for out in graph.outputs_of(OutputKind.UPDATE):
        if out.name not in updatable:
            raise IRError(f"update output names {out.name!r}, which is not a parameter, buffer or optimizer state{where}")
    if graph.init_outputs:
        needed = params | {i.name for i in graph.inputs_of(InputKind.BUFFER)}
        missing = needed - {o.name for o in graph.init_outputs}
        if missing:
            raise IRError(f"init region does not build {sorted(missing)[:3]}{where}")


def _verify_annotations(graph: Graph, where: str, seen: set[int] = frozenset()) -> None:
    """Stage placement all-or-nothing; nd-SBP shapes of the nodes not in ``seen`` (ids)."""
    # Before stage-partition only hinted forward ops carry a stage; once a backward or
    # optimizer op has one, the partition has run and every op must have one. (One count
    # decides the usual cases, every op placed or none, without a walk of the nodes.)
    stages = [n.stage for n in graph.nodes]
    if 0 < stages.count(None) < len(stages) and \
            any(s is not None and n.role != Role.FORWARD for s, n in zip(stages, graph.nodes)):
        n = graph.nodes[stages.index(None)]
        raise IRError(f"{n.op} has no stage while other ops do{where}", location=_loc(n))
    naxes = len(graph.mesh.sbp_axes)
    for n in [n for n in graph.nodes if n.sbp is not None and id(n) not in seen]:
        if len(n.sbp) != len(n.outputs):
            raise IRError(f"{n.op} has {len(n.sbp)} nd-SBPs for {len(n.outputs)} results{where}", location=_loc(n))
        for nd, t in zip(n.sbp, n.types):
            if len(nd) != naxes:
                raise IRError(f"{n.op} has an nd-SBP of {len(nd)} entries on a mesh with {naxes} SBP axes{where}",
                              location=_loc(n))
            for s in nd:
                if isinstance(s, Split) and not 0 <= s.dim < len(t.shape):
                    raise IRError(f"{n.op} splits dim {s.dim} of a rank-{len(t.shape)} tensor{where}", location=_loc(n))


def _loc(n: Node) -> str | None:
    return str(n.loc) if n.loc else None


def verify_boxed(graph: Graph) -> None:
    """After boxing: every op receives exactly the nd-SBP it asked for, in its own memory (a
    transfer, from the other one), and each updated parameter or state leaves the step in the
    layout and memory it came in with."""
    sbp = {i.value: i.sbp for i in graph.inputs}
    mem = {i.value: i.memory for i in graph.inputs}
    for n in graph.nodes:
        kind = Collective.of(n.op)
        moved = kind.memory_after if kind is not None else None
        if moved is not None and moved != n.memory:
            raise IRError(f"{n.op} leaves its result in {moved.value} memory but is placed on {n.memory.value}",
                          location=_loc(n), hint="this is a compiler bug; run with --print-after-all to see the pass")
        for u in n.uses():
            have = mem.get(u, MemoryKind.DEVICE)
            if (have == n.memory) == (moved is not None):
                raise IRError(f"{n.op} on {n.memory.value} reads %{u} from {have.value} memory: "
                              f"{'a transfer that moves nothing' if moved else 'a transfer is missing'}",
                              location=_loc(n), hint="this is a compiler bug; run with --print-after-all to see the pass")
        for o in n.outputs:
            mem[o] = n.memory
        if n.sbp_in is not None:
            uses = list(n.uses())
            if len(uses) != len(n.sbp_in):
                raise IRError(f"{n.op} has {len(n.sbp_in)} input SBPs for {len(uses)} inputs", location=_loc(n))
            for u, need in zip(uses, n.sbp_in):
                if sbp.get(u) != need:
                    raise IRError(f"{n.op} needs %{u} as {_fmt(need)} but it is {_fmt(sbp.get(u))}: boxing is missing",
                                  location=_loc(n), hint="this is a compiler bug; run with --print-after-all to see the pass")
        for o, nd in zip(n.outputs, n.sbp or []):
            sbp[o] = nd
    inputs = {i.name: i for i in graph.inputs}
    for o in graph.outputs_of(OutputKind.UPDATE):
        if sbp.get(o.value) != inputs[o.name].sbp:
            raise IRError(f"update of {o.name!r} is {_fmt(sbp.get(o.value))} but the input is {_fmt(inputs[o.name].sbp)}")
        if mem.get(o.value) != inputs[o.name].memory:
            raise IRError(f"update of {o.name!r} is in {mem.get(o.value).value} memory but the input is in "
                          f"{inputs[o.name].memory.value}")


def _fmt(nd) -> str:
    return "none" if nd is None else "[" + ", ".join(map(repr, nd)) + "]"
