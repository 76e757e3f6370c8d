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

from sbpc.compiler.sbp.boxing_plan import boxing_cost
from sbpc.compiler.sbp.cost_model import AlphaBeta, CostModel
from sbpc.compiler.frontend.hint_op import OP as HINT_OP
from sbpc.compiler.frontend.hints import parse_spec_string
from sbpc.compiler.sbp.layer_classes import LayerClasses, layer_classes
from sbpc.compiler.ir.mesh import MICROBATCH
from sbpc.compiler.ir.types import Graph, GraphInput, InputKind, OutputKind, TensorType
from sbpc.compiler.sbp.refine import RefinementMoves, partials as _partials
from sbpc.compiler.sbp.layout import Layouts, NdSignature
from sbpc.compiler.sbp.rules import RuleBook
from sbpc.errors import CompileError
from sbpc.runtime.sbp import Broadcast, NdSbp, Partial, Split, divides, format_nd_sbp


@dataclass
class SbpPropagate:
    name: str = "sbp-propagate"
    cost_model: CostModel = field(default_factory=AlphaBeta)
    rules: RuleBook | None = None  # default: ir_specs/aten.sbp
    rounds: int = 6
    # Layer classes (layer_classes): in a graph of at least ``tie_min_nodes`` nodes, the nodes
    # of layers repeated at least ``tie_layers`` times are decided once per class, in a middle
    # layer, and every layer follows. None: never.
    tie_layers: int | None = 4
    tie_min_nodes: int = 1000

    def apply(self, graph: Graph, ctx) -> Graph:
        axes = graph.mesh.sbp_axes
        sizes = tuple(graph.mesh.size(a) for a in axes)
        if all(k == 1 for k in sizes):
            return _all_broadcast(graph, axes)
        # block counts of strided splits come from the whole-graph analysis (sbp_layout)
        rules = self.rules or RuleBook.load(strided_parts=())
        _warn_unruled(graph, rules, getattr(ctx, "log", sys.stderr))
        busy = [a for a, k in enumerate(sizes) if k > 1]
        self._classes = self.classes(graph)
        self._memo: dict = {}  # what the Layouts of this graph share
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
        solver = self._solver(graph, rules, sizes, fixed)
        solver.fix_inputs()
        if not solver.combine(busy, alone):
            solver.greedy()
        self._refine(solver, busy)
        return solver.result()

    def classes(self, graph: Graph) -> LayerClasses | None:
        """The layer classes whose decisions are tied, or None (small graphs, tying off)."""
        if self.tie_layers is None or len(graph.nodes) < self.tie_min_nodes:
            return None
        classes = layer_classes(graph, max(2, self.tie_layers))
        return classes if classes.members else None

    def _solver(self, graph: Graph, rules: RuleBook, sizes: tuple[int, ...], fixed=None) -> "_Solver":
        classes = getattr(self, "_classes", None)
        memo = getattr(self, "_memo", None)
        lay = Layouts(graph, rules, sizes, fixed, classes.rep if classes else None, memo)
        return _Solver(graph, lay, sizes, self.cost_model, classes, memo)

    def _solve(self, graph: Graph, rules: RuleBook, sizes: tuple[int, ...]) -> "_Solver":
        solver = self._solver(graph, rules, sizes)
        solver.fix_inputs()
        solver.greedy()
        self._refine(solver, [a for a, k in enumerate(sizes) if k > 1])
        return solver

    def _refine(self, solver: "_Solver", busy: list[int]) -> None:
        solver.go_live()
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


class _Solver(RefinementMoves):
    def __init__(self, graph: Graph, layouts: Layouts, sizes: tuple[int, ...], model: CostModel,
                 classes: LayerClasses | None = None, memo: dict | None = None):
        self.g, self.lay, self.sizes, self.model = graph, layouts, sizes, model
        self.axes = graph.mesh.sbp_axes
        self.sequential = frozenset(a for a, name in enumerate(self.axes) if name == MICROBATCH)
        self.types: dict[str, TensorType] = layouts.types
        self._tie(classes)
        memo = memo if memo is not None else {}
        if "index" not in memo:  # the graph's structure, shared by the solvers of one graph
            uses = [list(n.uses()) for n in graph.nodes]
            producer, consumers = graph.producers(), graph.users()
            # per op: each value it uses once, with the positions it takes it at
            at = [[(v, tuple(p for p, u in enumerate(us) if u == v)) for v in dict.fromkeys(us)] for us in uses]
            memo["index"] = uses, producer, consumers, at
        self.uses, self.producer, self.consumers, self.at = memo["index"]
        self.sbp: dict[str, NdSbp] = {}
        self.why: dict[str, str] = {}
        self.req: dict[str, dict[tuple, NdSbp]] = {}  # value -> (consumer, position) -> needed nd-SBP
        self.reqc: dict[str, dict[NdSbp, int]] = {}  # value -> needed nd-SBP -> how many positions need it
        self.choice: list[int] = [0] * len(graph.nodes)
        self.focus: int | None = None  # the mesh axis refinement works on
        self._box: dict = {}
        self._hint_filters()

    def _tie(self, classes: LayerClasses | None) -> None:
        """Candidates, and the layer classes whose members follow their representative. A
        member shares its representative's candidate list (so every choice copied to it is
        one of its own candidates); one whose candidates differ leaves its class."""
        count = len(self.g.nodes)
        self.cls = classes.copy() if classes else LayerClasses(list(range(count)))
        self.cands: list[list[NdSignature]] = [None] * count  # type: ignore[list-item]
        for i in self.cls.active():
            self.cands[i] = self.lay.candidates(i)
        for r, ms in list(self.cls.members.items()):
            for m in ms:
                if m == r:
                    continue
                if self.lay.same_candidates(m, r):
                    self.cands[m] = self.cands[r]
                else:
                    self.cls.drop(m)
                    self.cands[m] = self.lay.candidates(m)
        self.active = self.cls.active()
        self.tied = {r: ms for r, ms in self.cls.members.items()}
        self.vrep: dict[str, str] = {}  # filled in by _weigh
        self.weight: dict[int, tuple[int, list[int]]] = {}
        self.vweight: dict[str, tuple[int, list[str]]] = {}
        self.copies: set[str] = set()  # values that another layer's copy stands for
        self.live: dict[int, list[int]] | None = None  # representative -> the members _set keeps up to date

    def _weigh(self) -> None:
        """How a representative's costs stand for its class. A member whose surroundings are
        the representative's (the same classes produce and consume each of its values, the
        same inputs) costs what the representative costs: its class counts the representative
        that many times. Any other member (the first and the last layer) is priced on its own.
        The same for values: a member's result stands for the representative's, and so does
        a layer's own input (its parameters)."""
        if not self.tied:
            return
        rep, nodes = self.cls.rep, self.g.nodes
        seen: dict[str, tuple] = {}

        def vctx(v: str):
            if v not in seen:
                p = self.producer.get(v)
                src = ("node", rep[p], nodes[p].outputs.index(v)) if p is not None else ("input", self.sbp.get(v))
                seen[v] = src, tuple(sorted({(rep[c], q) for c in self.consumers.get(v, ()) for q, u in enumerate(self.uses[c]) if u == v}))
            return seen[v]

        def ctx(i: int):
            return tuple(vctx(v) for v in self.uses[i] + list(nodes[i].outputs))

        for r, ms in self.tied.items():
            mine = ctx(r)
            odd = [m for m in ms if m != r and ctx(m) != mine]
            w = len(ms) - len(odd)
            self.weight[r] = (w, odd)
            for j, ro in enumerate(nodes[r].outputs):
                self.vweight[ro] = (w, [nodes[m].outputs[j] for m in odd])
                for m in ms:
                    self.vrep[nodes[m].outputs[j]] = ro
            for p, u in enumerate(self.uses[r]):
                copies = [self.uses[m][p] for m in ms]
                if u in self.producer or u in self.vweight or len(set(copies)) != len(copies):
                    continue  # a result (done above) or a value every layer shares
                self.vweight[u] = (w, [self.uses[m][p] for m in odd])
                for c in copies:
                    self.vrep.setdefault(c, u)
        # the values a search looks at: all but those a representative's stands for
        odd_values = {v for _, extra in self.vweight.values() for v in extra}
        self.copies = {v for v, r in self.vrep.items() if v != r and v not in odd_values}

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
            self._require(o.value, ("update", o.name), self.sbp[src])
        self._weigh()

    def _require(self, v: str, key: tuple, t: NdSbp) -> None:
        """Consumer position ``key`` needs ``v`` as ``t``."""
        reqs = self.req.setdefault(v, {})
        counts = self.reqc.setdefault(v, {})
        old = reqs.get(key)
        if old == t:
            return
        if old is not None:
            if counts[old] == 1:
                del counts[old]
            else:
                counts[old] -= 1
        reqs[key] = t
        counts[t] = counts.get(t, 0) + 1

    def needs(self, v: str):
        """The layouts ``v`` is needed in."""
        return self.reqc.get(v, {}).keys()

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
        for idx in self.active:
            n = self.g.nodes[idx]
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
            for m in self.tied.get(idx, (idx,)):
                self.cands[m] = ok

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
        """Converting ``v`` from ``src`` into each distinct layout of ``reqs``."""
        return sum(self.box(src, t, self.types[v]) for t in set(reqs) if t != src)

    # ----- search
    def combine(self, busy: list[int], alone: list["_Solver"]) -> bool:
        """Take, for every op, the nd-signature made of what each one-axis solution chose on
        its axis; an op with no such candidate (the combination does not divide) is picked
        greedily. False when no op combines."""
        picks = {}
        for idx in self.active:
            want = [(a, s.cands[idx][s.choice[idx]]) for a, s in zip(busy, alone)]
            match = next((ci for ci, c in enumerate(self.cands[idx])
                          if all(tuple(nd[a] for nd in c.ins + c.outs) == tuple(nd[a] for nd in w.ins + w.outs)
                                 for a, w in want)), None)
            if match is None:
                match = self._add_combined(idx, want)
            picks[idx] = match
        if all(ci is None for ci in picks.values()):
            return False
        # an op whose one-axis choices do not combine (their nested splits do not divide)
        # picks greedily among its own candidates, given what its producers chose
        for idx in self._first_members():
            if picks[self.cls.rep[idx]] is None:
                self._greedy_pick(idx)
            else:
                self._set(self.cls.rep[idx], picks[self.cls.rep[idx]])
        return True

    def _first_members(self) -> list[int]:
        """Program order, each layer class at its first member: there every producer has chosen."""
        out, seen = [], set()
        for idx, r in enumerate(self.cls.rep):
            if r not in seen:
                seen.add(r)
                out.append(idx)
        return out

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
        for idx in self._first_members():
            self._greedy_pick(idx)

    def _greedy_pick(self, idx: int) -> None:
        """Op ``idx`` (and its layer class) takes its cheapest candidate given what its
        producers chose; a class is priced at its representative once that one's producers
        have chosen, else at ``idx``, its first member."""
        r = self.cls.rep[idx]
        if r != idx and all(v in self.sbp for v in self.uses[r]):
            idx = r
        best, best_key = 0, None
        for ci, c in enumerate(self.cands[idx]):
            cost = 0.0
            for pos, v in enumerate(self.uses[idx]):
                have = self.needs(v)
                if c.ins[pos] != self.sbp[v] and c.ins[pos] not in have:
                    cost += self.greedy_box(self.sbp[v], c.ins[pos], self.types[v])
            for j, o in enumerate(self.g.nodes[idx].outputs):
                cost += self.value_cost(o, c.outs[j], self.needs(o))
            key = (round(cost, 12), _partials(c), ci)
            if best_key is None or key < best_key:
                best, best_key = ci, key
        self._set(self.cls.rep[idx], best)

    def greedy_box(self, src: NdSbp, dst: NdSbp, t: TensorType) -> float:
        """How the first pass prices a conversion. It cannot see consumers yet, so it is
        pessimistic about partial values: it prices a reduce-scatter as the all-reduce its
        consumers will likely need. Refinement then prices everything exactly."""
        via_b = tuple(Broadcast() if isinstance(d, Split) and isinstance(s, Partial) else d for s, d in zip(src, dst))
        if via_b != dst:
            return self.box(src, via_b, t) + self.box(via_b, dst, t)
        return self.box(src, dst, t)

    def local_cost(self, idx: int, c: NdSignature) -> float:
        """What op ``idx`` costs in candidate ``c`` (its compute and the conversions of its
        values); for a representative, what its whole layer class costs."""
        if idx in self.weight:
            w, odd = self.weight[idx]
            return w * self._local_cost(idx, c) + sum(self._local_cost(m, c) for m in odd)
        return self._local_cost(idx, c)

    def _local_cost(self, idx: int, c: NdSignature) -> float:
        cost = self.compute(idx, c)
        n = self.g.nodes[idx]
        for v, pos in self.at[idx]:
            # what the other consumers need, and what c needs
            counts, reqs = self.reqc.get(v, {}), self.req.get(v, {})
            mine = [reqs[(idx, p)] for p in pos if (idx, p) in reqs]
            need = {t for t, k in counts.items() if k > mine.count(t)} if mine else set(counts)
            need.update(c.ins[p] for p in pos)
            cost += self.value_cost(v, self.sbp[v], need)
        for j, o in enumerate(n.outputs):
            cost += self.value_cost(o, c.outs[j], self.needs(o))
        return cost

    def _set(self, idx: int, ci: int) -> None:
        """Op ``idx`` takes candidate ``ci``, and so does every member of its layer class (the
        layouts and needs of members that no cost reads are left as they are: ``go_live``)."""
        ms = self.tied.get(idx)
        if ms is None:
            self._set_one(idx, ci)
            return
        for m in ms:
            self.choice[m] = ci
        for m in (ms if self.live is None else self.live[idx]):
            self._set_one(m, ci)

    def go_live(self) -> None:
        """From now on (refinement), keep up to date only the layouts and needs that costs
        read: those of the values of representatives, of ops in no class and of the members
        priced on their own (``_weigh``). The members that touch none of these are copies
        whose state no cost reads; their choices still follow."""
        if not self.tied or self.live is not None:
            return
        nodes = self.g.nodes
        read = [i for i, r in enumerate(self.cls.rep) if r == i]
        read += [m for _, odd in self.weight.values() for m in odd]
        values = {v for i in read for v in self.uses[i]} | {o for i in read for o in nodes[i].outputs}
        own = {m for _, odd in self.weight.values() for m in odd}
        self.live = {}
        for r, ms in self.tied.items():
            self.live[r] = [m for m in ms if m == r or m in own
                            or any(v in values for v in self.uses[m]) or any(o in values for o in nodes[m].outputs)]

    def _set_one(self, idx: int, ci: int) -> None:
        self.choice[idx] = ci
        c = self.cands[idx][ci]
        for v, pos in self.at[idx]:
            for p in pos:
                self._require(v, (idx, p), c.ins[p])
        for j, o in enumerate(self.g.nodes[idx].outputs):
            self.sbp[o] = c.outs[j]

    def result(self) -> Graph:
        whys: dict[int, str] = {}
        for idx in self.active:
            n, c = self.g.nodes[idx], self.cands[idx][self.choice[idx]]
            rules = "; ".join(f"{a}: {note}" for a, k, note in zip(self.axes, self.sizes, c.notes) if k > 1)
            whys[idx] = f"{n.op} by rule [{rules}], the cheapest of {len(self.cands[idx])} signatures " \
                        f"(compute + boxing {self.local_cost(idx, c):.3g} s)"
            if idx in self.tied:
                whys[idx] += f", for its layer class of {len(self.tied[idx])} ops (as decided in " \
                             f"{n.loc.module if n.loc else 'this layer'})"
        nodes = []
        for idx, n in enumerate(self.g.nodes):
            c = self.cands[idx][self.choice[idx]]
            nodes.append(replace(n, sbp=list(c.outs), sbp_in=list(c.ins), why=whys[self.cls.rep[idx]]))
        inputs = [replace(i, sbp=self.sbp[i.value], why=self.why[i.value]) for i in self.g.inputs]
        return replace(self.g, inputs=inputs, nodes=nodes)


def _same_kind(a, b) -> bool:
    if isinstance(a, Split) and isinstance(b, Split):
        return a.dim == b.dim
    return a == b
