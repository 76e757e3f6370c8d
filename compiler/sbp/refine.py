"""The local-search moves of SBP propagation's refinement.

Every move reads the search state (``SolverState``: candidates, choices, needs, prices), tries
a change and keeps it only when the total cost goes down. Ties break on fewer partial results,
then on rule order, so the search is deterministic.
"""
from __future__ import annotations

from sbpc.compiler.sbp.layout import NdSignature
from sbpc.compiler.sbp.state import SolverState
from sbpc.runtime.kinds import Collective
from sbpc.runtime.sbp import Broadcast, NdSbp, Partial


def refine_ops(st: SolverState) -> bool:
    """Single-op moves: each op (each layer class) takes its cheapest candidate given the rest."""
    changed = False
    for idx in st.active:
        opts = st.options(idx)
        if len(opts) < 2:
            continue
        cur = st.local_cost(idx, st.cands[idx][st.choice[idx]])
        best, best_key = st.choice[idx], (round(cur, 15), partials(st.cands[idx][st.choice[idx]]), st.choice[idx])
        for ci in opts:
            if ci == st.choice[idx]:
                continue  # its key is the one to beat
            c = st.cands[idx][ci]
            key = (round(st.local_cost(idx, c), 15), partials(c), ci)
            if key < best_key:
                best, best_key = ci, key
        if best != st.choice[idx]:
            st.choose(idx, best)
            changed = True
    return changed


def refine_values(st: SolverState, flood: bool = False) -> bool:
    """Joint moves: all consumers of one value switch to taking it in one layout together.
    Single-op moves cannot leave a state where two consumers share one collective (a
    residual feeding both a layer norm and an add); this move can. With ``flood`` (the solver
    asks for it only when the other moves are stuck: it is the costliest to try), when the
    switch alone does not pay, each result it changed is flooded downstream (``_flood``), one
    at a time, and the whole kept if the total drops: a
    gathered weight that both phases read (Megatron's row-parallel c_proj computed whole,
    its backward slicing rows and all-to-all-ing the heads back) is undone only together with
    the chain of views that then carries the heads' split to the attention's backward."""
    changed = False
    for v, idxs, at in st.shared_reads():
        targets = {st.cands[i][ci].ins[p] for i, pos in at for ci in st.options(i) for p in pos}
        for t in sorted(targets, key=repr):
            if all(st.cands[i][st.choice[i]].ins[p] == t for i, pos in at for p in pos):
                continue
            changed |= _try_joint(st, v, t, idxs, flood)
    return changed


def refine_cascades(st: SolverState, budget: int = 24) -> bool:
    """Large moves: give one op another signature, let its neighbours re-choose in turn
    (breadth first, at most ``budget`` ops), and keep the result if the total went down.
    This is how a reduction moves to where it belongs when a chain of ops must follow."""
    changed = False
    for idx in _hot_nodes(st):
        for ci in st.options(idx):
            if ci != st.choice[idx] and _try_cascade(st, idx, ci, budget):
                changed = True
    return changed


def refine_hoists(st: SolverState, budget: int = 48) -> bool:
    """Moves of a reduction upstream: a partial value is made whole (B) where it is produced,
    and the ops downstream of it that then need no conversion take the signature that reads it
    as it is (their results whole too, in turn), until the flood meets an op that must convert
    anyway. Along a chain of ops linear in the partial input (a norm's backward) each step of
    such a move costs the same (one all-reduce of the same bytes, here or one op later), so
    single-op and cascade moves, which stop on ties, never reach the fork where it pays: a
    weight gradient that no longer needs its own all-reduce. This move prices the whole flood."""
    changed = False
    for v in _partial_values(st):
        if _try_hoist(st, v, budget):
            changed = True
    return changed


def _whole(st: SolverState, nd: NdSbp) -> NdSbp:
    return tuple(Broadcast() if isinstance(s, Partial) and st.focus in (None, a) else s for a, s in enumerate(nd))


def _readers(st: SolverState, v: str) -> list[int]:
    """The ops (representatives, when layers are tied) that read ``v`` itself."""
    out = st.consumers.get(v, ())
    if st.tied:
        out = [st.cls.rep[m] for m in out]
    return [m for m in dict.fromkeys(out) if v in st.uses[m]]


def _partial_values(st: SolverState) -> list[str]:
    """Partial results (on the focused axis) that some reader takes partial, in program order."""
    out = []
    for idx in st.active:
        if st.tied and st.cls.rep[idx] != idx:
            continue
        for o in st.graph.nodes[idx].outputs:
            src = st.sbp.get(o)
            if src is None or _whole(st, src) == src:
                continue
            if any(t == src for t in st.needs(o)):
                out.append(o)
    return out


def _try_hoist(st: SolverState, v: str, budget: int) -> bool:
    made: dict[str, NdSbp] = {v: _whole(st, st.sbp[v])}  # the values the flood changed: their new layouts
    saved: dict[int, int] = {}
    queue = _readers(st, v)
    while queue and len(saved) < budget:
        m = queue.pop(0)
        if m in saved:
            continue
        opts = st.options(m)
        # what m is given: the flood's layouts, and the others as it takes them now
        cur = st.cands[m][st.choice[m]]
        have = [made.get(u, t) for u, t in zip(st.uses[m], cur.ins)]
        exact = [ci for ci in opts if list(st.cands[m][ci].ins) == have]
        if exact:
            best = min(exact, key=lambda cj: (partials(st.cands[m][cj]), round(st.local_cost(m, st.cands[m][cj]), 15), cj))
        else:
            best = min(opts, key=lambda cj: (round(st.local_cost(m, st.cands[m][cj]), 15), cj != st.choice[m], cj))
        if best == st.choice[m]:
            continue
        queue += _choose_spreading(st, m, best, made, saved)
    if not saved:
        return False
    return _keep_if_cheaper(st, saved)


def _hot_nodes(st: SolverState) -> list[int]:
    """Ops next to a conversion that costs more than a local copy: where moves can pay."""
    hot = set()
    for v, reqs in st.searched_needs():
        src = st.sbp.get(v)
        for t in set(reqs.values()):
            step_read = v in st.index.step_read  # a copy as often as the conversion runs
            copy = st.model.collective(Collective.KEEP_FIRST, st.types[v].nbytes, 2) * (1 if step_read else st.microbatches)
            if t != src and st.box(src, t, st.types[v], step_read=step_read) > copy:
                hot.update(st.cls.rep[k[0]] for k, tt in reqs.items() if tt == t and isinstance(k[0], int))
                if v in st.producer:
                    hot.add(st.cls.rep[st.producer[v]])
    return sorted(hot)


def _neighbours(st: SolverState, idx: int) -> list[int]:
    out = [m for o in st.graph.nodes[idx].outputs for m in st.consumers.get(o, ())]
    for v in st.uses[idx]:
        if v in st.producer:
            out.append(st.producer[v])
        out += st.consumers.get(v, ())
    if st.tied:
        out = [st.cls.rep[m] for m in out]
    return [m for m in dict.fromkeys(out) if m != idx]


def _try_cascade(st: SolverState, idx: int, ci: int, budget: int) -> bool:
    saved = {idx: st.choice[idx]}
    st.choose(idx, ci)
    queue = _neighbours(st, idx)
    while queue and len(saved) < budget:
        m = queue.pop(0)
        opts = st.options(m) if m not in saved else []
        if len(opts) < 2:
            continue
        best = min(opts, key=lambda cj: (round(st.local_cost(m, st.cands[m][cj]), 15), cj != st.choice[m], cj))
        if best != st.choice[m]:
            saved[m] = st.choice[m]
            st.choose(m, best)
            queue += _neighbours(st, m)
    return _keep_if_cheaper(st, saved)


def _try_joint(st: SolverState, v: str, t: NdSbp, idxs: list[int], flood: bool, budget: int = 24) -> bool:
    touched = {u for i in idxs for u in st.uses[i]} | {o for i in idxs for o in st.graph.nodes[i].outputs}
    before = st.cost_of(idxs, touched)
    saved = {i: st.choice[i] for i in idxs}
    outs = {o: st.sbp[o] for i in idxs for o in st.graph.nodes[i].outputs}
    if not _switch(st, v, t, idxs):
        _restore(st, saved)
        return False
    if st.cost_of(idxs, touched) < before * (1 - 1e-9):
        return True
    changed = [o for o, old in outs.items() if st.sbp[o] != old] if flood else []
    switched = {i: st.choice[i] for i in idxs}  # what _switch chose: the same from the same state
    _restore(st, saved)
    for o in changed:
        _restore(st, switched)
        flooded = dict(saved)
        _flood(st, {o: st.sbp[o]}, flooded, budget)
        if len(flooded) == len(saved):  # nothing followed: the switch alone, which did not pay
            _restore(st, saved)
            continue
        if _keep_if_cheaper(st, flooded):
            return True
    return False


def _switch(st: SolverState, v: str, t: NdSbp, idxs: list[int]) -> bool:
    """Every op of ``idxs`` takes ``v`` as ``t``, each in its cheapest such signature (False: one has none)."""
    for i in idxs:
        ok = [ci for ci in st.options(i)
              if all(st.cands[i][ci].ins[p] == t for p, u in enumerate(st.uses[i]) if u == v)]
        if not ok:
            return False
        st.choose(i, min(ok, key=lambda ci: (round(st.local_cost(i, st.cands[i][ci]), 15), ci)))
    return True


def _restore(st: SolverState, saved: dict[int, int]) -> None:
    for i, ci in saved.items():
        st.choose(i, ci)


def _flood(st: SolverState, made: dict[str, NdSbp], saved: dict[int, int], budget: int,
           to_reductions: bool = False) -> None:
    """The readers of the values in ``made`` (value -> its new layout) take them as they are,
    each in its cheapest signature that does, and so on downstream with the results that
    change, at most ``budget`` ops; ``saved`` gets each changed op's choice before. Single
    steps along such a chain cost the same (the conversion one op later), so only the whole
    flood, priced by the caller, shows where the conversion disappears. With ``to_reductions``
    a partial result stops the flood: its readers keep what they take (its reduction)."""
    queue = [m for o in made for m in _readers(st, o)]
    while queue and len(saved) < budget:
        m = queue.pop(0)
        if m in saved:
            continue
        fit = [ci for ci in st.options(m)
               if all(st.cands[m][ci].ins[p] == made[u] for p, u in enumerate(st.uses[m]) if u in made)]
        if not fit or st.choice[m] in fit:
            continue
        best = min(fit, key=lambda ci: (round(st.local_cost(m, st.cands[m][ci]), 15), ci))
        nxt = _choose_spreading(st, m, best, made, saved)
        if to_reductions:
            whole = [o for o in st.graph.nodes[m].outputs if o in made and not any(isinstance(s, Partial) for s in made[o])]
            nxt = [r for o in whole for r in _readers(st, o)]
        queue += nxt


def _choose_spreading(st: SolverState, m: int, ci: int, made: dict[str, NdSbp], saved: dict[int, int]) -> list[int]:
    """Op ``m`` takes candidate ``ci`` (its choice before goes to ``saved``); each result whose
    layout changes goes to ``made``. Returns the readers of those results: where a flood goes next."""
    before = [st.sbp[o] for o in st.graph.nodes[m].outputs]
    saved[m] = st.choice[m]
    st.choose(m, ci)
    nxt: list[int] = []
    for o, old in zip(st.graph.nodes[m].outputs, before):
        if st.sbp[o] != old:
            made[o] = st.sbp[o]
            nxt += _readers(st, o)
    return nxt


def partials(c: NdSignature) -> int:
    return sum(isinstance(s, Partial) for nd in c.outs for s in nd)


def _keep_if_cheaper(st: SolverState, saved: dict[int, int]) -> bool:
    """Keep the choices made since ``saved`` (node -> its choice before) only if they strictly
    lower the cost of the nodes and values they touch; else restore ``saved``."""
    nodes = list(saved)
    values = {u for i in nodes for u in st.uses[i]} | {o for i in nodes for o in st.graph.nodes[i].outputs}
    after = st.cost_of(nodes, values)
    new = {i: st.choice[i] for i in nodes}
    for i, c in saved.items():
        st.choose(i, c)
    if after < st.cost_of(nodes, values) * (1 - 1e-9):
        for i, c in new.items():
            st.choose(i, c)
        return True
    return False
