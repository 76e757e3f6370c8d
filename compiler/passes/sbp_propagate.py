"""sbp-propagate: choose an nd-SBP for every value and the signature of every op.

Inputs are fixed first: hinted parameters take their hint (``sbpc.hint`` ops on inputs),
optimizer state follows its parameter, batch inputs are ``S(0)`` on dp, everything else
``B``. Each op then picks among its candidate nd-signatures (``sbp_layout``) the one of least
cost: the boxing its inputs need, priced by the cost model, plus its compute. A greedy pass
in program order is followed by rounds of coordinate descent in which each op also sees what
its consumers need, until no op can lower the total. Ties go to fewer partial results, then
to the rule's order, so the result is deterministic.

Axes of size one carry ``B`` everywhere. Results: ``Node.sbp`` (per output), ``Node.sbp_in``
(what the op needs of each input; the boxing pass makes it so), and ``why`` for explain.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace

from sbpc.compiler.boxing_plan import boxing_cost
from sbpc.compiler.cost_model import AlphaBeta, CostModel
from sbpc.compiler.hint_op import OP as HINT_OP
from sbpc.compiler.hints import parse_spec_string
from sbpc.compiler.mesh import MICROBATCH
from sbpc.compiler.ir.types import Graph, GraphInput, InputKind, OutputKind, TensorType
from sbpc.compiler.sbp_layout import Layouts, NdSignature
from sbpc.compiler.sbp_rules import RuleBook
from sbpc.errors import CompileError
from sbpc.runtime.sbp import Broadcast, NdSbp, Partial, Split, divides, format_nd_sbp


@dataclass
class SbpPropagate:
    name: str = "sbp-propagate"
    cost_model: CostModel = field(default_factory=AlphaBeta)
    rules: RuleBook | None = None  # default: ir_specs/aten.sbp
    rounds: int = 6

    def apply(self, graph: Graph, ctx) -> Graph:
        axes = graph.mesh.sbp_axes
        sizes = tuple(graph.mesh.size(a) for a in axes)
        if all(k == 1 for k in sizes):
            return _all_broadcast(graph, axes)
        # block counts of strided splits come from the whole-graph analysis (sbp_layout)
        rules = self.rules or RuleBook.load(strided_parts=())
        _warn_unruled(graph, rules, getattr(ctx, "log", sys.stderr))
        busy = [a for a, k in enumerate(sizes) if k > 1]
        if len(busy) == 1:
            return self._solve(graph, rules, sizes).result()
        # Several axes: solve each alone (the others one device), then start the joint search
        # from their combination. Axes interact only through tensor sizes and nested splits, so
        # the combination is nearly optimal, and one-axis problems are small.
        alone = [self._solve(graph, rules, tuple(k if b == a else 1 for b, k in enumerate(sizes))) for a in busy]
        # Micro-batching is data parallelism in time: its one-axis solution (batch split, weight
        # gradients partial) is final, and the device axes are searched around it. This keeps
        # every micro-batch collective a reduction, and the joint candidates as few as without it.
        fixed = {a: [s.cands[i][s.choice[i]] for i in range(len(graph.nodes))]
                 for a, s in zip(busy, alone) if axes[a] == MICROBATCH}
        solver = _Solver(graph, Layouts(graph, rules, sizes, fixed), sizes, self.cost_model)
        solver.fix_inputs()
        if not solver.combine(busy, alone):
            solver.greedy()
        self._refine(solver, busy)
        return solver.result()

    def _solve(self, graph: Graph, rules: RuleBook, sizes: tuple[int, ...]) -> "_Solver":
        solver = _Solver(graph, Layouts(graph, rules, sizes), sizes, self.cost_model)
        solver.fix_inputs()
        solver.greedy()
        self._refine(solver, [a for a, k in enumerate(sizes) if k > 1])
        return solver

    def _refine(self, solver: "_Solver", busy: list[int]) -> None:
        for _ in range(self.rounds):
            changed = False
            for a in busy:
                solver.focus = a if len(busy) > 1 else None
                changed |= solver.refine() | solver.refine_values() | solver.refine_cascades()
            if not changed:
                break
        solver.focus = None


def _all_broadcast(graph: Graph, axes) -> Graph:
    b = tuple(Broadcast() for _ in axes)
    inputs = [replace(i, sbp=tuple(Split(0) if i.kind == InputKind.BATCH and a == "dp" else Broadcast() for a in axes))
              for i in graph.inputs]
    nodes = [replace(n, sbp=[b] * len(n.outputs), sbp_in=None) for n in graph.nodes]
    return replace(graph, inputs=inputs, nodes=nodes)


def _warn_unruled(graph: Graph, rules: RuleBook, log) -> None:
    seen = set()
    for n in graph.nodes:
        if n.op != HINT_OP and not rules.has_rule(n.op) and n.op not in seen:
            seen.add(n.op)
            where = f" (first at {n.loc})" if n.loc else ""
            print(f"sbpc: warning: no SBP rule for {n.op}{where}; it runs replicated (B) on every device", file=log)


class _Solver:
    def __init__(self, graph: Graph, layouts: Layouts, sizes: tuple[int, ...], model: CostModel):
        self.g, self.lay, self.sizes, self.model = graph, layouts, sizes, model
        self.axes = graph.mesh.sbp_axes
        self.sequential = frozenset(a for a, name in enumerate(self.axes) if name == MICROBATCH)
        self.types: dict[str, TensorType] = layouts.types
        self.cands: list[list[NdSignature]] = [layouts.candidates(i) for i in range(len(graph.nodes))]
        self.uses = [list(n.uses()) for n in graph.nodes]
        self.producer = {o: idx for idx, n in enumerate(graph.nodes) for o in n.outputs}
        self.consumers: dict[str, list[int]] = {}
        for idx, uses in enumerate(self.uses):
            for v in dict.fromkeys(uses):
                self.consumers.setdefault(v, []).append(idx)
        self.sbp: dict[str, NdSbp] = {}
        self.why: dict[str, str] = {}
        self.req: dict[str, dict[tuple, NdSbp]] = {}  # value -> (consumer, position) -> needed nd-SBP
        self.choice: list[int] = [0] * len(graph.nodes)
        self.focus: int | None = None  # the mesh axis refinement works on
        self._box: dict = {}
        self._hint_filters()

    # ----- inputs and hints
    def fix_inputs(self) -> None:
        hinted = {n.args[0].name: n for n in self.g.nodes if n.op == HINT_OP and n.args[0].name in
                  {i.value for i in self.g.inputs}}
        by_name = {i.name: i for i in self.g.inputs}
        for i in self.g.inputs:
            if i.kind == InputKind.STATE and i.name.partition(":")[2] in by_name:
                continue  # after its parameter
            self.sbp[i.value], self.why[i.value] = self._input_sbp(i, hinted.get(i.value))
        for i in self.g.inputs:
            param = by_name.get(i.name.partition(":")[2]) if i.kind == InputKind.STATE else None
            if param is not None:
                same = param.type.shape == i.type.shape
                self.sbp[i.value] = self.sbp[param.value] if same else self._bcast()
                self.why[i.value] = f"optimizer state of {param.name}: " + ("its parameter's layout" if same else "B")
        for o in self.g.outputs_of(OutputKind.UPDATE):
            src = by_name[o.name].value
            self.req.setdefault(o.value, {})[("update", o.name)] = self.sbp[src]

    def _bcast(self) -> NdSbp:
        return tuple(Broadcast() for _ in self.axes)

    def _input_sbp(self, i: GraphInput, hint_node) -> tuple[NdSbp, str]:
        nd = list(self._bcast())
        if hint_node is not None:
            where = hint_node.args[2]
            for axis, s in parse_spec_string(hint_node.args[1], where):
                if axis in self.axes and self.sizes[self.axes.index(axis)] > 1:
                    if isinstance(s, Split):
                        s = Split(s.dim, max(s.parts, self.lay.block_count(i.value, s.dim)))
                    nd[self.axes.index(axis)] = s
            self._check_divides(i.type, tuple(nd), f"{i.kind.value} {i.name!r}", where)
            return tuple(nd), f"hint {hint_node.args[1]} at {where}"
        split = [a for a in (MICROBATCH, "dp") if a in self.axes and self.sizes[self.axes.index(a)] > 1]
        if i.kind == InputKind.BATCH and split:
            k = 1
            for a in split:
                nd[self.axes.index(a)] = Split(0)
                k *= self.sizes[self.axes.index(a)]
            if not i.type.shape or i.type.shape[0] % k:
                over = " x ".join(f"{a}={self.sizes[self.axes.index(a)]}" for a in split)
                raise CompileError(f"{i.name} has shape {list(i.type.shape)}: its batch dim does not divide over {over}",
                                   hint=f"use a --batch-size that is a multiple of {k}")
            names = {"dp": "dp (data parallel)", MICROBATCH: "mb (micro-batches)"}
            return tuple(nd), "batch input: S(0) on " + " and ".join(names[a] for a in split)
        what = "parameter without a hint" if i.kind == InputKind.PARAM else i.kind.value
        return tuple(nd), f"{what}: B (replicated)"

    def _check_divides(self, t: TensorType, nd: NdSbp, what: str, where: str) -> None:
        if not divides(t.shape, nd, self.sizes):
            bad = next(f"{a}={k}" for a, k, s in zip(self.axes, self.sizes, nd) if isinstance(s, Split)
                       and not divides(t.shape, tuple(x if x is s else Broadcast() for x in nd), self.sizes))
            raise CompileError(f"SBP {format_nd_sbp(nd)} of {what} does not divide its shape {list(t.shape)} over {bad}",
                               location=where, hint="pick a split dim whose size is a multiple of the axis size, or B")

    def _hint_filters(self) -> None:
        for idx, n in enumerate(self.g.nodes):
            if n.op != HINT_OP:
                continue
            want = {self.axes.index(a): s for a, s in parse_spec_string(n.args[1], n.args[2]) if a in self.axes}
            ok = [c for c in self.cands[idx] if all(self.sizes[a] == 1 or _same_kind(c.outs[0][a], s) for a, s in want.items())]
            if not ok:
                src = next((i for i in self.g.inputs if i.value == n.args[0].name), None)
                what = f"{src.kind.value} {src.name!r}" if src else f"a {n.types[0].dtype} value"
                axes = ", ".join(f"{self.axes[a]}={self.sizes[a]}" for a in want if self.sizes[a] > 1)
                raise CompileError(f"SBP {n.args[1]} of {what} does not divide its shape {list(n.types[0].shape)} over {axes}",
                                   location=n.args[2], hint="pick a split dim whose size is a multiple of the axis size, or B")
            self.cands[idx] = ok

    # ----- costs
    def box(self, src: NdSbp, dst: NdSbp, t: TensorType) -> float:
        key = (src, dst, t)
        if key not in self._box:
            self._box[key] = boxing_cost(src, dst, t, self.sizes, self.model, self.sequential)
        return self._box[key]

    def compute(self, idx: int, c: NdSignature) -> float:
        n = self.g.nodes[idx]
        ts = [self.types[u] for u in self.uses[idx]] + list(n.types)
        return self.model.compute(sum(t.local_nbytes(nd, self.sizes) for t, nd in zip(ts, c.ins + c.outs)))

    def value_cost(self, v: str, src: NdSbp, reqs) -> float:
        return sum(self.box(src, t, self.types[v]) for t in set(reqs) if t != src)

    # ----- search
    def combine(self, busy: list[int], alone: list["_Solver"]) -> bool:
        """Take, for every op, the nd-signature made of what each one-axis solution chose on
        its axis; an op with no such candidate (the combination does not divide) is picked
        greedily. False when no op combines."""
        picks = []
        for idx in range(len(self.g.nodes)):
            want = [(a, s.cands[idx][s.choice[idx]]) for a, s in zip(busy, alone)]
            match = next((ci for ci, c in enumerate(self.cands[idx])
                          if all(tuple(nd[a] for nd in c.ins + c.outs) == tuple(nd[a] for nd in w.ins + w.outs)
                                 for a, w in want)), None)
            if match is None:
                match = self._add_combined(idx, want)
            picks.append(match)
        if all(ci is None for ci in picks):
            return False
        # an op whose one-axis choices do not combine (their nested splits do not divide)
        # picks greedily among its own candidates, given what its producers chose
        for idx, ci in enumerate(picks):
            if ci is None:
                self._greedy_pick(idx)
            else:
                self._set(idx, ci)
        return True

    def _add_combined(self, idx: int, want) -> int | None:
        """The candidate made of each axis's one-axis choice, added when the capped candidate
        list left it out; None when it does not divide."""
        n = self.g.nodes[idx]
        first = want[0][1]
        width = len(self.axes)

        def nd(pos: int) -> NdSbp:
            out = [Broadcast()] * width
            for a, w in want:
                out[a] = (w.ins + w.outs)[pos][a]
            return tuple(out)

        count = len(first.ins) + len(first.outs)
        sbps = [nd(p) for p in range(count)]
        shapes = [self.types[u].shape for u in self.uses[idx]] + [t.shape for t in n.types]
        if not all(divides(shape, x, self.sizes) for shape, x in zip(shapes, sbps)):
            return None
        notes = tuple(next((w.notes[a] for b, w in want if b == a), "all B") for a in range(width))
        self.cands[idx].append(NdSignature(tuple(sbps[:len(first.ins)]), tuple(sbps[len(first.ins):]), notes))
        return len(self.cands[idx]) - 1

    def greedy(self) -> None:
        for idx in range(len(self.g.nodes)):
            self._greedy_pick(idx)

    def _greedy_pick(self, idx: int) -> None:
        best, best_key = 0, None
        for ci, c in enumerate(self.cands[idx]):
            cost = 0.0
            for pos, v in enumerate(self.uses[idx]):
                have = set(self.req.get(v, {}).values())
                if c.ins[pos] != self.sbp[v] and c.ins[pos] not in have:
                    cost += self.greedy_box(self.sbp[v], c.ins[pos], self.types[v])
            for j, o in enumerate(self.g.nodes[idx].outputs):
                cost += self.value_cost(o, c.outs[j], self.req.get(o, {}).values())
            key = (round(cost, 12), _partials(c), ci)
            if best_key is None or key < best_key:
                best, best_key = ci, key
        self._set(idx, best)

    def greedy_box(self, src: NdSbp, dst: NdSbp, t: TensorType) -> float:
        """How the first pass prices a conversion. It cannot see consumers yet, so it is
        pessimistic about partial values: it prices a reduce-scatter as the all-reduce its
        consumers will likely need. Refinement then prices everything exactly."""
        via_b = tuple(Broadcast() if isinstance(d, Split) and isinstance(s, Partial) else d for s, d in zip(src, dst))
        if via_b != dst:
            return self.box(src, via_b, t) + self.box(via_b, dst, t)
        return self.box(src, dst, t)

    def local_cost(self, idx: int, c: NdSignature) -> float:
        cost = self.compute(idx, c)
        n = self.g.nodes[idx]
        for v in set(self.uses[idx]):
            reqs = {k: t for k, t in self.req.get(v, {}).items() if k[0] != idx}
            reqs.update({(idx, p): c.ins[p] for p, u in enumerate(self.uses[idx]) if u == v})
            cost += self.value_cost(v, self.sbp[v], reqs.values())
        for j, o in enumerate(n.outputs):
            cost += self.value_cost(o, c.outs[j], self.req.get(o, {}).values())
        return cost

    def refine(self) -> bool:
        changed = False
        for idx in range(len(self.g.nodes)):
            opts = self.options(idx)
            if len(opts) < 2:
                continue
            cur = self.local_cost(idx, self.cands[idx][self.choice[idx]])
            best, best_key = self.choice[idx], (round(cur, 15), _partials(self.cands[idx][self.choice[idx]]), self.choice[idx])
            for ci in opts:
                c = self.cands[idx][ci]
                key = (round(self.local_cost(idx, c), 15), _partials(c), ci)
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
            src = self.sbp.get(v)
            for t in set(reqs.values()):
                if t != src and self.box(src, t, self.types[v]) > self.model.collective("keep_first", self.types[v].nbytes, 2):
                    hot.update(k[0] for k, tt in reqs.items() if tt == t and isinstance(k[0], int))
                    if v in self.producer:
                        hot.add(self.producer[v])
        return sorted(hot)

    def _neighbours(self, idx: int) -> list[int]:
        out = [m for o in self.g.nodes[idx].outputs for m in self.consumers.get(o, ())]
        for v in self.uses[idx]:
            if v in self.producer:
                out.append(self.producer[v])
            out += self.consumers.get(v, ())
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
        cost = sum(self.compute(i, self.cands[i][self.choice[i]]) for i in idxs)
        return cost + sum(self.value_cost(v, self.sbp[v], self.req.get(v, {}).values()) for v in values)

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

    def _set(self, idx: int, ci: int) -> None:
        self.choice[idx] = ci
        c = self.cands[idx][ci]
        for v in set(self.uses[idx]):
            self.req.setdefault(v, {}).update({(idx, p): c.ins[p] for p, u in enumerate(self.uses[idx]) if u == v})
        for j, o in enumerate(self.g.nodes[idx].outputs):
            self.sbp[o] = c.outs[j]

    def result(self) -> Graph:
        nodes = []
        for idx, n in enumerate(self.g.nodes):
            c = self.cands[idx][self.choice[idx]]
            rules = "; ".join(f"{a}: {note}" for a, k, note in zip(self.axes, self.sizes, c.notes) if k > 1)
            why = f"{n.op} by rule [{rules}], the cheapest of {len(self.cands[idx])} signatures " \
                  f"(compute + boxing {self.local_cost(idx, c):.3g} s)"
            nodes.append(replace(n, sbp=list(c.outs), sbp_in=list(c.ins), why=why))
        inputs = [replace(i, sbp=self.sbp[i.value], why=self.why[i.value]) for i in self.g.inputs]
        return replace(self.g, inputs=inputs, nodes=nodes)


def _same_kind(a, b) -> bool:
    if isinstance(a, Split) and isinstance(b, Split):
        return a.dim == b.dim
    return a == b


def _partials(c: NdSignature) -> int:
    return sum(isinstance(s, Partial) for nd in c.outs for s in nd)
