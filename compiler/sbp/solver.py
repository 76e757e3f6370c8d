"""The SBP solver: fixes the inputs, picks greedily, combines one-axis solutions, refines.

Its state is a ``SolverState`` (``state.py``); the refinement moves (``refine.py``) take that
state. ``SbpPropagate`` (the pass) decides which solvers run on which axes.
"""
from __future__ import annotations

from dataclasses import replace

from sbpc.compiler.frontend.hint_op import OP as HINT_OP, hint_of
from sbpc.compiler.ir.mesh import MICROBATCH
from sbpc.compiler.ir.types import Graph, GraphInput, InputKind, OutputKind, TensorType
from sbpc.compiler.sbp.axis_use import MAX_PROBE
from sbpc.compiler.sbp.cost_model import CostModel
from sbpc.compiler.sbp.layer_classes import LayerClasses
from sbpc.compiler.sbp.layout import Layouts, NdSignature
from sbpc.compiler.sbp.param_moves import free_params, refine_params, set_layout
from sbpc.compiler.sbp.refine import partials, refine_cascades, refine_hoists, refine_ops, refine_values
from sbpc.compiler.sbp.graph_index import GraphIndex
from sbpc.compiler.sbp.state import SolverState
from sbpc.errors import CompileError
from sbpc.runtime.sbp import Broadcast, NdSbp, Partial, Split, divides, format_nd_sbp


class Solver:
    def __init__(self, graph: Graph, layouts: Layouts, sizes: tuple[int, ...], model: CostModel,
                 classes: LayerClasses | None = None, index: GraphIndex | None = None,
                 in_flight: dict[int, int] | None = None, param_layouts: bool = False):
        cls, cands = _tie(graph, layouts, classes)
        self.param_layouts = param_layouts  # whether the search chooses unhinted parameters' layouts (param_moves)
        self.state = SolverState(graph, layouts, sizes, model, index or GraphIndex.of(graph), cls, cands,
                                 active=cls.active(), tied=dict(cls.members), in_flight=in_flight or {})
        self._hint_filters()

    # ----- inputs and hints
    def fix_inputs(self) -> None:
        st, g = self.state, self.state.graph
        hinted = {n.args[0].name: n for n in g.nodes if n.op == HINT_OP and n.args[0].name in
                  {i.value for i in g.inputs}}
        by_name = {i.name: i for i in g.inputs}
        for i in g.inputs:
            if i.state_of in by_name:
                continue  # after its parameter
            st.sbp[i.value], st.why[i.value] = self._input_sbp(i, hinted.get(i.value))
        for i in g.inputs:
            param = by_name.get(i.state_of)
            if param is not None:
                same = _follows(i.type.shape, param.type.shape, st.sbp[param.value])
                st.sbp[i.value] = st.sbp[param.value] if same else self._bcast()
                st.why[i.value] = f"optimizer state of {param.name}: " + ("its parameter's layout" if same else "B")
                if same and i.value in hinted:  # ZeRO: split on dp (compiler/passes/zero.py)
                    st.sbp[i.value], st.why[i.value] = self._state_sbp(i, param, hinted[i.value])
        for i in g.inputs:
            st.sbp[i.value] = st.layouts.intern(st.sbp[i.value])
        for o in g.outputs_of(OutputKind.UPDATE):
            src = by_name[o.name].value
            st.require(o.value, ("update", o.name), st.sbp[src])
        st.bucket_axes = self._data_axes()
        self._weigh()
        if self.param_layouts:
            st.free_params = free_params(st, set(hinted))

    def _data_axes(self) -> frozenset[int]:
        """The axes that split the data the weights see before any choice is made: a batch
        input's (dp) and a hinted activation's (sequence parallelism's tp). A weight replicated
        on such an axis has a partial gradient there unless its input is gathered, so gradient
        buckets are made there anyway; where only weights are split (Megatron's tp), a gradient
        is partial only by the solver's choice."""
        st, g = self.state, self.state.graph
        inputs = {i.value for i in g.inputs}
        out = {a for i in g.inputs if i.kind == InputKind.BATCH for a, s in enumerate(st.sbp[i.value])
               if isinstance(s, Split)}
        for n in g.nodes:
            if n.op == HINT_OP and n.args[0].name not in inputs:
                out.update(st.axes.index(a) for a, s in hint_of(n).axes
                           if isinstance(s, Split) and a in st.axes and st.sizes[st.axes.index(a)] > 1)
        return frozenset(out)

    def _state_sbp(self, i: GraphInput, param: GraphInput, hint_node) -> tuple[NdSbp, str]:
        """An optimizer state with a hint of its own: its parameter's layout, the hinted axes
        replaced (strided like the parameter where the parameter's dim is strided)."""
        st = self.state
        nd = list(st.sbp[param.value])
        hint = hint_of(hint_node)
        for axis, s in hint.axes:
            if axis in st.axes and st.sizes[st.axes.index(axis)] > 1:
                if isinstance(s, Split):
                    s = Split(s.dim, max(s.parts, st.layouts.block_count(param.value, s.dim),
                                         st.layouts.block_count(i.value, s.dim)))
                nd[st.axes.index(axis)] = s
        self._check_divides(i.type, tuple(nd), f"optimizer state {i.name!r}", hint.source)
        return tuple(nd), f"optimizer state of {param.name}: its parameter's layout, {hint.spec()} by {hint.source}"

    def _bcast(self) -> NdSbp:
        return tuple(Broadcast() for _ in self.state.axes)

    def _input_sbp(self, i: GraphInput, hint_node) -> tuple[NdSbp, str]:
        st = self.state
        axes, sizes = st.axes, st.sizes
        nd = list(self._bcast())
        if hint_node is not None:
            hint = hint_of(hint_node)
            where = hint.source
            for axis, s in hint.axes:
                if axis in axes and sizes[axes.index(axis)] > 1:
                    if isinstance(s, Split):
                        s = Split(s.dim, max(s.parts, st.layouts.block_count(i.value, s.dim)))
                    nd[axes.index(axis)] = s
            self._check_divides(i.type, tuple(nd), f"{i.kind.value} {i.name!r}", where)
            return tuple(nd), f"hint {hint.spec()} at {where}"
        split = [a for a in (MICROBATCH, "dp") if a in axes and sizes[axes.index(a)] > 1]
        if i.kind == InputKind.BATCH and split:
            for a in split:
                nd[axes.index(a)] = Split(0)
            # judged on the whole mesh: a one-axis solve (sbp_propagate) sees the other axes as one
            # device, and the batch must divide over all of them at once
            mesh = st.graph.mesh
            whole = [a for a in (MICROBATCH, "dp") if mesh.size(a) > 1]
            rows = 1
            for a in whole:
                rows *= mesh.size(a)
            if not i.type.shape or i.type.shape[0] % rows:
                over = " x ".join(f"{a}={mesh.size(a)}" for a in whole)
                raise CompileError(f"{i.name} has shape {list(i.type.shape)}: its batch dim does not divide over {over}",
                                   hint=f"use a --batch-size that is a multiple of {rows}")
            names = {"dp": "dp (data parallel)", MICROBATCH: "mb (micro-batches)"}
            return tuple(nd), "batch input: S(0) on " + " and ".join(names[a] for a in split)
        what = "parameter without a hint" if i.kind == InputKind.PARAM else i.kind.value
        return tuple(nd), f"{what}: B (replicated)"

    def _check_divides(self, t: TensorType, nd: NdSbp, what: str, where: str) -> None:
        axes, sizes = self.state.axes, self.state.sizes
        if not divides(t.shape, nd, sizes):
            a = next(a for a, s in enumerate(nd) if isinstance(s, Split)
                     and not divides(t.shape, tuple(x if x is s else Broadcast() for x in nd), sizes))
            raise CompileError(f"SBP {format_nd_sbp(nd)} of {what} does not divide its shape {list(t.shape)} over "
                               f"{axes[a]}={sizes[a]}{_valid_sizes(t.shape, nd, sizes, a, axes[a])}",
                               location=where, hint=_DIVIDE_HINT)

    def _hint_filters(self) -> None:
        st = self.state
        axes, sizes = st.axes, st.sizes
        for idx in st.active:
            n = st.graph.nodes[idx]
            if n.op != HINT_OP:
                continue
            hint = hint_of(n)
            want = {axes.index(a): s for a, s in hint.axes if a in axes}
            ok = [c for c in st.cands[idx] if all(sizes[a] == 1 or _same_kind(c.outs[0][a], s) for a, s in want.items())]
            if not ok:
                src = next((i for i in st.graph.inputs if i.value == n.args[0].name), None)
                what = f"{src.kind.value} {src.name!r}" if src else f"a {n.types[0].dtype} value"
                over = ", ".join(f"{axes[a]}={sizes[a]}" for a in want if sizes[a] > 1)
                shape = n.types[0].shape
                nd = tuple(want.get(a, Broadcast()) for a in range(len(axes)))
                valid = "".join(_valid_sizes(shape, nd, sizes, a, axes[a]) for a, s in want.items()
                                if sizes[a] > 1 and isinstance(s, Split) and not divides(shape, nd, sizes))
                raise CompileError(f"SBP {hint.spec()} of {what} does not divide its shape {list(shape)} over {over}{valid}",
                                   location=hint.source, hint=_DIVIDE_HINT)
            for m in st.tied.get(idx, (idx,)):
                st.cands[m] = ok

    def _weigh(self) -> None:
        """How a representative's costs stand for its class. A member whose surroundings are
        the representative's (the same classes produce and consume each of its values, the
        same inputs) costs what the representative costs: its class counts the representative
        that many times. Any other member (the first and the last layer) is priced on its own.
        The same for values: a member's result stands for the representative's, and so does
        a layer's own input (its parameters)."""
        st = self.state
        if not st.tied:
            return
        rep, nodes, uses, reads = st.cls.rep, st.graph.nodes, st.uses, st.index.reads
        # what the weights depend on besides the graph: the classes, and the layouts of the
        # inputs their ops read. Solvers of one graph (one per mesh axis, the joint one) mostly
        # agree on both: the weights are then found once
        tied = {m for ms in st.tied.values() for m in ms}
        key = (tuple(rep), tuple((i.value, st.sbp[i.value]) for i in st.graph.inputs
                                 if any(c in tied for c in st.consumers.get(i.value, ()))))
        found = st.index.weighs.get(key)
        if found is not None:
            st.weight, st.vweight, st.vrep, st.copies = found
            return
        seen: dict[str, tuple] = {}

        hyper = st.index.hyper

        def vctx(v: str):
            if v not in seen:
                p = st.producer.get(v)
                if p is not None and hyper[p] and not st.types[v].shape:
                    # a scalar of hyperparameters alone (Adam's bias correction, a copy per
                    # pipeline chunk): nothing splits it, so its conversions are free and
                    # which other ops read it changes no reader's price
                    seen[v] = ("hyper", rep[p], nodes[p].outputs.index(v))
                    return seen[v]
                src = ("node", rep[p], nodes[p].outputs.index(v)) if p is not None else ("input", st.sbp.get(v))
                seen[v] = src, tuple(sorted({(rep[c], q) for c, q in reads.get(v, ())}))
            return seen[v]

        def ctx(i: int):
            return tuple(vctx(v) for v in uses[i] + list(nodes[i].outputs))

        for r, ms in st.tied.items():
            mine = ctx(r)
            odd = [m for m in ms if m != r and ctx(m) != mine]
            w = len(ms) - len(odd)
            st.weight[r] = (w, odd)
            for j, ro in enumerate(nodes[r].outputs):
                st.vweight[ro] = (w, [nodes[m].outputs[j] for m in odd])
                for m in ms:
                    st.vrep[nodes[m].outputs[j]] = ro
            for p, u in enumerate(uses[r]):
                copies = [uses[m][p] for m in ms]
                if u in st.producer or u in st.vweight or len(set(copies)) != len(copies):
                    continue  # a result (done above) or a value every layer shares
                st.vweight[u] = (w, [uses[m][p] for m in odd])
                for c in copies:
                    st.vrep.setdefault(c, u)
        # the values a search looks at: all but those a representative's stands for
        odd_values = {v for _, extra in st.vweight.values() for v in extra}
        st.copies = {v for v, r in st.vrep.items() if v != r and v not in odd_values}
        st.index.weighs[key] = st.weight, st.vweight, st.vrep, st.copies  # never changed after

    # ----- search
    def combine(self, busy: list[int], alone: list[Solver]) -> bool:
        """Take, for every op, the nd-signature made of what each one-axis solution chose on
        its axis; an op with no such candidate (the combination does not divide) is picked
        greedily. False when no op combines."""
        st = self.state
        picks = {}
        for idx in st.active:
            want = [(a, s.state.chosen(idx)) for a, s in zip(busy, alone)]
            match = next((ci for ci, c in enumerate(st.cands[idx])
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
            if picks[st.cls.rep[idx]] is None:
                self._greedy_pick(idx)
            else:
                st.choose(st.cls.rep[idx], picks[st.cls.rep[idx]])
        return True

    def adopt_params(self, busy: list[int], alone: list[Solver]) -> None:
        """The free parameters take, on each axis, what its one-axis solution chose for them,
        where the combination divides their shape."""
        st = self.state
        for fp in st.free_params:
            nd = list(st.sbp[fp.value])
            for a, s in zip(busy, alone):
                nd[a] = s.state.sbp[fp.value][a]
            t = st.layouts.intern(tuple(nd))
            if t != st.sbp[fp.value] and divides(st.types[fp.value].shape, t, st.sizes):
                set_layout(st, fp, t)

    def _first_members(self) -> list[int]:
        """Program order, each layer class at its first member: there every producer has chosen."""
        out, seen = [], set()
        for idx, r in enumerate(self.state.cls.rep):
            if r not in seen:
                seen.add(r)
                out.append(idx)
        return out

    def _add_combined(self, idx: int, want) -> int | None:
        """The candidate made of each axis's one-axis choice, added when the capped candidate
        list left it out; None when it is not exact (a split does not divide, or the axes do not
        hold together)."""
        st = self.state
        first = want[0][1]
        width = len(st.axes)

        def nd(pos: int) -> NdSbp:
            out = [Broadcast()] * width
            for a, w in want:
                out[a] = (w.ins + w.outs)[pos][a]
            return tuple(out)

        count = len(first.ins) + len(first.outs)
        sbps = [nd(p) for p in range(count)]
        ins, outs = tuple(sbps[:len(first.ins)]), tuple(sbps[len(first.ins):])
        if not st.layouts.exact(idx, ins, outs):
            return None
        notes = tuple(next((w.notes[a] for b, w in want if b == a), "all B") for a in range(width))
        st.cands[idx].append(NdSignature(tuple(map(st.layouts.intern, ins)), tuple(map(st.layouts.intern, outs)), notes))
        return len(st.cands[idx]) - 1

    def greedy(self) -> None:
        for idx in self._first_members():
            self._greedy_pick(idx)

    def _greedy_pick(self, idx: int) -> None:
        """Op ``idx`` (and its layer class) takes its cheapest candidate given what its
        producers chose; a class is priced at its representative once that one's producers
        have chosen, else at ``idx``, its first member."""
        st = self.state
        r = st.cls.rep[idx]
        if r != idx and all(v in st.sbp for v in st.uses[r]):
            idx = r
        best, best_key = 0, None
        for ci, c in enumerate(st.cands[idx]):
            cost = 0.0
            for pos, v in enumerate(st.uses[idx]):
                have = st.needs(v)
                if c.ins[pos] != st.sbp[v] and c.ins[pos] not in have:
                    cost += self.greedy_box(st.sbp[v], c.ins[pos], st.types[v], v in st.index.step_read)
            for j, o in enumerate(st.graph.nodes[idx].outputs):
                cost += st.value_cost(o, c.outs[j], st.needs(o), st.back_needs(o))
            key = (round(cost, 12), partials(c), ci)
            if best_key is None or key < best_key:
                best, best_key = ci, key
        st.choose(st.cls.rep[idx], best)

    def greedy_box(self, src: NdSbp, dst: NdSbp, t: TensorType, step_read: bool = False) -> float:
        """How the first pass prices a conversion. It cannot see consumers yet, so it is
        pessimistic about partial values: it prices a reduce-scatter as the all-reduce its
        consumers will likely need. Refinement then prices everything exactly."""
        box = self.state.box
        via_b = tuple(Broadcast() if isinstance(d, Split) and isinstance(s, Partial) else d for s, d in zip(src, dst))
        if via_b != dst:
            return box(src, via_b, t, step_read=step_read) + box(via_b, dst, t, step_read=step_read)
        return box(src, dst, t, step_read=step_read)

    def refine(self, busy: list[int], rounds: int) -> None:
        """Rounds of the refinement moves, axis by axis when several are ``busy``, until none
        lowers the total (at most ``rounds``)."""
        st = self.state
        st.go_live()
        for _ in range(rounds):
            changed = False
            for a in busy:
                st.focus = a if len(busy) > 1 else None
                moved = refine_ops(st) | refine_values(st) | refine_cascades(st) | refine_hoists(st)
                if st.free_params:
                    moved |= refine_params(st)
                # the joint moves' floods are the costliest to try: only where the others are stuck
                changed |= moved or refine_values(st, flood=True)
            if not changed:
                break
        st.focus = None

    def result(self) -> Graph:
        st = self.state
        whys: dict[int, str] = {}
        for idx in st.active:
            n, c = st.graph.nodes[idx], st.chosen(idx)
            rules = "; ".join(f"{a}: {note}" for a, k, note in zip(st.axes, st.sizes, c.notes) if k > 1)
            whys[idx] = f"{n.op} by rule [{rules}], the cheapest of {len(st.cands[idx])} signatures " \
                        f"(compute + boxing {st.local_cost(idx, c):.3g} s)"
            if idx in st.tied:
                whys[idx] += f", for its layer class of {len(st.tied[idx])} ops (as decided in " \
                             f"{n.loc.module if n.loc else 'this layer'})"
        nodes, exact = [], {}
        for idx, n in enumerate(st.graph.nodes):
            c, r = st.chosen(idx), st.cls.rep[idx]
            # the members of a class have one op, the same types and this very candidate:
            # checked once for them all
            key = r if c is st.chosen(r) else idx
            ok = exact.get(key)
            if ok is None:
                ok = exact[key] = st.layouts.exact(idx, c.ins, c.outs)
            if not ok:  # a bug in a move: never emit a wrong plan
                raise RuntimeError(f"the SBP search chose an inexact signature for {n.op} -> %{n.outputs[0]}: "
                                   f"{list(c.ins)} -> {list(c.outs)}")
            nodes.append(n.replace(sbp=[tuple(o) for o in c.outs], sbp_in=[tuple(i) for i in c.ins],
                                 why=whys[r]))
        inputs = [replace(i, sbp=tuple(st.sbp[i.value]), why=st.why[i.value]) for i in st.graph.inputs]
        return replace(st.graph, inputs=inputs, nodes=nodes, regather=st.regathered())


def _tie(graph: Graph, layouts: Layouts, classes: LayerClasses | None) -> tuple[LayerClasses, list[list[NdSignature]]]:
    """Candidates, and the layer classes whose members follow their representative. A
    member shares its representative's candidate list (so every choice copied to it is
    one of its own candidates); one whose candidates differ leaves its class."""
    count = len(graph.nodes)
    cls = classes.copy() if classes else LayerClasses(list(range(count)))
    cands: list[list[NdSignature]] = [None] * count  # type: ignore[list-item]
    for i in cls.active():
        cands[i] = layouts.candidates(i)
    for r, ms in list(cls.members.items()):
        for m in ms:
            if m == r:
                continue
            if layouts.same_candidates(m, r):
                cands[m] = cands[r]
            else:
                cls.drop(m)
                cands[m] = layouts.candidates(m)
    return cls, cands


def _same_kind(a, b) -> bool:
    if isinstance(a, Split) and isinstance(b, Split):
        return a.dim == b.dim
    return a == b


def _follows(state: tuple[int, ...], param: tuple[int, ...], nd: NdSbp) -> bool:
    """Whether an optimizer state can take its parameter's layout ``nd``: its shape, or (ZeRO on a
    dp that divides none of its dims: compiler/passes/zero.py) its shape padded along a dim no
    axis splits."""
    split = {s.dim for s in nd if isinstance(s, Split)}
    return len(state) == len(param) and all(a == b or d not in split for d, (a, b) in enumerate(zip(state, param)))


_DIVIDE_HINT = "use one of those sizes, or pick a split dim whose size is a multiple of the axis size, or B"


def _valid_sizes(shape, nd: NdSbp, sizes, a: int, name: str) -> str:
    """The suffix ``; valid tp for it: 1, 2, 4``: the sizes of axis ``a`` (up to MAX_PROBE, the
    other axes kept) at which ``nd`` divides ``shape``, what the user may pick instead."""
    valid = [k for k in range(1, MAX_PROBE + 1) if divides(shape, nd, tuple(k if b == a else s for b, s in enumerate(sizes)))]
    return f"; valid {name} for it: {', '.join(map(str, valid))}"
