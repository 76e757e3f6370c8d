"""Parameter moves: the search chooses the layout of a parameter without a hint.

By default a parameter without a hint is replicated (``B``) on every axis, and the ops that read
it split it locally where they want it split. Its optimizer then updates the whole replica on
every device, and its gradient is reduced (or gathered) whole. With ``SbpPropagate.param_layouts``
(``sbpc compile --cluster``) the refinement may also change a parameter's layout: the parameter,
its optimizer state (which follows it) and the updates of both take a new layout together; the
ops that read any of them take it as it is, downstream until a result is partial (its
reduction) or nothing changes (``refine._flood``): the optimizer's chain, the layer's GEMM and
the views after it; and the producers upstream of the changed ops make what those now take
(``_pull``): the weight's gradient computed split where it is made, not reduced whole and sliced.
The whole is priced at once: a weight's split pays only with the optimizer work and the
gradient reduction it saves, which no single op sees. The targets are the layouts the weight's
forward and backward readers can take it in.
"""
from __future__ import annotations

from dataclasses import dataclass

from sbpc.compiler.ir.types import InputKind, MemoryKind, OutputKind
from sbpc.compiler.sbp.refine import _flood, _readers, _restore
from sbpc.compiler.sbp.state import SolverState
from sbpc.runtime.sbp import NdSbp, Partial, format_nd_sbp


@dataclass(frozen=True)
class FreeParam:
    """A parameter whose layout the search chooses: the values that take it together (the
    parameter, its optimizer state, and their copies in the other layers of its layer class)
    and the updates that must come back in it (value, the requirement's key)."""
    value: str  # the parameter as the search prices it (a representative's, when layers are tied)
    params: tuple[str, ...]  # it and its copies
    values: tuple[str, ...]  # they and their optimizer state
    updates: tuple[tuple[str, tuple], ...]


def free_params(st: SolverState, hinted: set[str]) -> list[FreeParam]:
    """The parameters without a hint whose optimizer state all has their shape, lives on the
    device and has no hint of its own (a ZeRO-split or offloaded state keeps its parameter
    replicated), in input order; a layer class's copies move with its representative's."""
    g = st.graph
    by_name = {i.name: i for i in g.inputs}
    states: dict[str, list] = {}
    for i in g.inputs:
        if i.state_of in by_name:
            states.setdefault(i.state_of, []).append(i)
    updates = {o.name: (o.value, ("update", o.name)) for o in g.outputs_of(OutputKind.UPDATE)}
    own: dict[str, tuple[list[str], list]] = {}
    for p in g.inputs:
        if p.kind != InputKind.PARAM or p.value in hinted or p.memory != MemoryKind.DEVICE:
            continue
        mine = states.get(p.name, [])
        if any(s.type.shape != p.type.shape or s.value in hinted or s.memory != p.memory for s in mine):
            continue
        names = [p.name] + [s.name for s in mine]
        own[p.value] = [by_name[n].value for n in names], [updates[n] for n in names if n in updates]
    out = []
    for v, (values, ups) in own.items():
        rep = st.vrep.get(v, v)
        if rep != v:
            continue  # moves with its representative
        copies = [c for c, r in st.vrep.items() if r == v and c != v]
        if any(c not in own for c in copies):
            continue  # a copy that cannot move: the class keeps the replica
        for c in copies:
            values += own[c][0]
            ups += own[c][1]
        out.append(FreeParam(v, (v, *copies), tuple(values), tuple(ups)))
    return out


def refine_params(st: SolverState, budget: int = 48) -> bool:
    """Each free parameter tries each layout its readers can take it in (on the focused axis),
    with the flood that follows; kept where the total drops."""
    changed = False
    for fp in st.free_params:
        for t in _targets(st, fp):
            if st.sbp[fp.value] != t and _try_param(st, fp, t, budget):
                changed = True
    return changed


def _targets(st: SolverState, fp: FreeParam) -> list[NdSbp]:
    """The layouts the ops reading the parameter (not its optimizer) can take it in: whole or
    split, on the axes the search may split a parameter on, the others as they are now."""
    cur = st.sbp[fp.value]
    out = set()
    for m in _readers(st, fp.value):
        if m in st.index.once:
            continue
        for ci in st.options(m):
            c = st.cands[m][ci]
            for p, u in enumerate(st.uses[m]):
                if u != fp.value:
                    continue
                t = c.ins[p]
                if any(isinstance(s, Partial) for s in t):
                    continue
                if any(s != cur[a] and (a in st.sequential or (st.focus is not None and a != st.focus))
                       for a, s in enumerate(t)):
                    continue
                out.add(t)
    return sorted(out, key=repr)


def set_layout(st: SolverState, fp: FreeParam, t: NdSbp) -> None:
    for v in fp.values:
        st.sbp[v] = t
    for v, key in fp.updates:
        st.require(v, key, t)


def _try_param(st: SolverState, fp: FreeParam, t: NdSbp, budget: int) -> bool:
    old = st.sbp[fp.value]
    t = st.layouts.intern(t)
    values = set(fp.values) | {v for v, _ in fp.updates}
    saved: dict[int, int] = {}
    set_layout(st, fp, t)
    _flood(st, dict.fromkeys(fp.values, t), saved, budget, to_reductions=True)
    _pull(st, saved, budget)
    nodes = list(saved)
    values |= {u for i in nodes for u in st.uses[i]} | {o for i in nodes for o in st.graph.nodes[i].outputs}
    after = st.cost_of(nodes, values)
    new = {i: st.choice[i] for i in nodes}
    _restore(st, saved)
    set_layout(st, fp, old)
    if after < st.cost_of(nodes, values) * (1 - 1e-9):
        _restore(st, new)
        set_layout(st, fp, t)
        for v in fp.params:
            st.why[v] = f"parameter without a hint: {format_nd_sbp(t)}, the layout the search found cheapest " \
                        "for its readers, its optimizer and its gradient"
        return True
    return False


def _pull(st: SolverState, saved: dict[int, int], budget: int) -> None:
    """Upstream of the flood: a value that a changed op takes in another layout than it has is
    made in that layout by its producer, where one of the producer's candidates does, and so on
    up (at most ``budget`` ops changed in all). A split weight's gradient is so computed split
    where it is made, not reduced whole and sliced for the optimizer."""
    queue = list(saved)
    while queue and len(saved) < budget:
        m = queue.pop(0)
        c = st.cands[m][st.choice[m]]
        for p, u in enumerate(st.uses[m]):
            want, q = c.ins[p], st.producer.get(u)
            if q is None or q in saved or st.sbp[u] == want or st.cls.rep[q] != q:
                continue
            j = st.graph.nodes[q].outputs.index(u)
            fit = [ci for ci in st.options(q) if st.cands[q][ci].outs[j] == want]
            if not fit:
                continue
            saved[q] = st.choice[q]
            st.choose(q, min(fit, key=lambda ci: (round(st.local_cost(q, st.cands[q][ci]), 15), ci)))
            queue.append(q)
