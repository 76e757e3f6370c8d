"""The local-search moves of SBP propagation's refinement, apart from the solver's state.

``RefinementMoves`` is mixed into ``sbp_propagate._Solver``: every move reads the solver's
candidates (``cands``), choices, needs and cost functions, tries a change and keeps it only
when the total cost goes down. Ties break on fewer partial results, then on rule order, so the
search is deterministic.
"""
from __future__ import annotations

from sbpc.compiler.sbp.layout import NdSignature
from sbpc.runtime.kinds import Collective
from sbpc.runtime.sbp import NdSbp, Partial


class RefinementMoves:
    def refine(self) -> bool:
        changed = False
        for idx in self.active:
            opts = self.options(idx)
            if len(opts) < 2:
                continue
            cur = self.local_cost(idx, self.cands[idx][self.choice[idx]])
            best, best_key = self.choice[idx], (round(cur, 15), partials(self.cands[idx][self.choice[idx]]), self.choice[idx])
            for ci in opts:
                c = self.cands[idx][ci]
                key = (round(self.local_cost(idx, c), 15), partials(c), ci)
                if key < best_key:
                    best, best_key = ci, key
            if best != self.choice[idx]:
                self._set(idx, best)
                changed = True
        return changed

    def refine_values(self) -> bool:
        """Joint moves: all consumers of one value switch to taking it in one layout together.
        Single-op moves cannot leave a state where two consumers share one collective (a
        residual feeding both a layer norm and an add); this move can."""
        changed = False
        for v, idxs in self.consumers.items():
            if len(idxs) < 2:
                continue
            if self.tied:  # through the representatives, when they all take this very value
                idxs = list(dict.fromkeys(self.cls.rep[i] for i in idxs))
                if len(idxs) < 2 or any(v not in self.uses[i] for i in idxs):
                    continue
            targets = {self.cands[i][ci].ins[p] for i in idxs for ci in self.options(i) for p, u in enumerate(self.uses[i]) if u == v}
            for t in sorted(targets, key=repr):
                if all(self.cands[i][self.choice[i]].ins[p] == t for i in idxs
                       for p, u in enumerate(self.uses[i]) if u == v):
                    continue
                changed |= self._try_joint(v, t, idxs)
        return changed

    def refine_cascades(self, budget: int = 24) -> bool:
        """Large moves: give one op another signature, let its neighbours re-choose in turn
        (breadth first, at most ``budget`` ops), and keep the result if the total went down.
        This is how a reduction moves to where it belongs when a chain of ops must follow."""
        changed = False
        for idx in self._hot_nodes():
            for ci in self.options(idx):
                if ci != self.choice[idx] and self._try_cascade(idx, ci, budget):
                    changed = True
        return changed

    def _hot_nodes(self) -> list[int]:
        """Ops next to a conversion that costs more than a local copy: where moves can pay."""
        hot = set()
        for v, reqs in self.req.items():
            if v in self.copies:
                continue
            src = self.sbp.get(v)
            for t in set(reqs.values()):
                if t != src and self.box(src, t, self.types[v]) > self.model.collective(Collective.KEEP_FIRST, self.types[v].nbytes, 2):
                    hot.update(self.cls.rep[k[0]] for k, tt in reqs.items() if tt == t and isinstance(k[0], int))
                    if v in self.producer:
                        hot.add(self.cls.rep[self.producer[v]])
        return sorted(hot)

    def _neighbours(self, idx: int) -> list[int]:
        out = [m for o in self.g.nodes[idx].outputs for m in self.consumers.get(o, ())]
        for v in self.uses[idx]:
            if v in self.producer:
                out.append(self.producer[v])
            out += self.consumers.get(v, ())
        if self.tied:
            out = [self.cls.rep[m] for m in out]
        return [m for m in dict.fromkeys(out) if m != idx]

    def _try_cascade(self, idx: int, ci: int, budget: int) -> bool:
        saved = {idx: self.choice[idx]}
        self._set(idx, ci)
        queue = self._neighbours(idx)
        while queue and len(saved) < budget:
            m = queue.pop(0)
            opts = self.options(m) if m not in saved else []
            if len(opts) < 2:
                continue
            best = min(opts,
                       key=lambda cj: (round(self.local_cost(m, self.cands[m][cj]), 15), cj != self.choice[m], cj))
            if best != self.choice[m]:
                saved[m] = self.choice[m]
                self._set(m, best)
                queue += self._neighbours(m)
        nodes = list(saved)
        values = {u for i in nodes for u in self.uses[i]} | {o for i in nodes for o in self.g.nodes[i].outputs}
        after = self._cost_of(nodes, values)
        new = {i: self.choice[i] for i in nodes}
        for i, c in saved.items():
            self._set(i, c)
        if after < self._cost_of(nodes, values) * (1 - 1e-9):
            for i, c in new.items():
                self._set(i, c)
            return True
        return False

    def _try_joint(self, v: str, t: NdSbp, idxs: list[int]) -> bool:
        touched = {u for i in idxs for u in self.uses[i]} | {o for i in idxs for o in self.g.nodes[i].outputs}
        before = self._cost_of(idxs, touched)
        saved = [self.choice[i] for i in idxs]
        for i in idxs:
            ok = [ci for ci in self.options(i)
                  if all(self.cands[i][ci].ins[p] == t for p, u in enumerate(self.uses[i]) if u == v)]
            if not ok:
                for j, ci in zip(idxs, saved):
                    self._set(j, ci)
                return False
            self._set(i, min(ok, key=lambda ci: (round(self.local_cost(i, self.cands[i][ci]), 15), ci)))
        if self._cost_of(idxs, touched) < before * (1 - 1e-9):
            return True
        for j, ci in zip(idxs, saved):
            self._set(j, ci)
        return False

    def _cost_of(self, idxs: list[int], values: set[str]) -> float:
        if not self.tied:
            cost = sum(self.compute(i, self.cands[i][self.choice[i]]) for i in idxs)
            return cost + sum(self.value_cost(v, self.sbp[v], self.needs(v)) for v in values)
        # a class's ops and values in every layer: the value between two layers once, not as
        # one layer's input and another's output
        cost = sum(self.compute(i, self.cands[i][self.choice[i]]) * len(self.tied.get(i, (i,))) for i in idxs)
        for v in {self.vrep.get(v, v) for v in values}:
            w, odd = self.vweight.get(v, (1, ()))
            cost += w * self.value_cost(v, self.sbp[v], self.needs(v))
            cost += sum(self.value_cost(u, self.sbp[u], self.needs(u)) for u in odd)
        return cost

    def options(self, idx: int) -> list[int]:
        """The candidates refinement may move op ``idx`` to: all of them, or, while it works
        on one mesh axis (``focus``), those that agree with the current choice on the others.
        Axis by axis keeps each move small: a few signatures per op instead of their product."""
        if self.focus is None:
            return list(range(len(self.cands[idx])))
        cur, a = self.cands[idx][self.choice[idx]], self.focus
        key = lambda c: tuple(nd[:a] + nd[a + 1:] for nd in c.ins + c.outs)
        k = key(cur)
        return [ci for ci, c in enumerate(self.cands[idx]) if key(c) == k]


def partials(c: NdSignature) -> int:
    return sum(isinstance(s, Partial) for nd in c.outs for s in nd)
