"""The state of the SBP search, in one typed home, with what every phase asks of it: the
prices of conversions and compute, and the one way to change a choice (``choose``).

The solver (``solver.py``) fills it (inputs, hints, the greedy pass); the refinement moves
(``refine.py``) read and change it. Nothing else keeps search state.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from sbpc.compiler.ir.types import Graph, TensorType, dtype_size
from sbpc.compiler.sbp.boxing_plan import boxing_cost
from sbpc.compiler.sbp.graph_index import GraphIndex, Use
from sbpc.compiler.sbp.cost_model import CostModel
from sbpc.compiler.sbp.layer_classes import LayerClasses
from sbpc.compiler.sbp.layout import Layouts, NdSignature
from sbpc.compiler.sbp.op_work import Operand
from sbpc.runtime.sbp import NdSbp, local_shape

_NONE: dict = {}  # an empty mapping to look things up in; never written


def _count_n(counts: dict[NdSbp, int], old: NdSbp, new: NdSbp, n: int) -> None:
    """``n`` positions move from needing ``old`` to needing ``new``: ``_count`` n times over."""
    k = counts[old]
    if k == n:
        del counts[old]
    else:
        counts[old] = k - n
    counts[new] = counts.get(new, 0) + n


def _count(counts: dict[NdSbp, int], old: NdSbp | None, new: NdSbp) -> None:
    """One position moves from needing ``old`` (None: it needed nothing) to needing ``new``."""
    if old is not None:
        k = counts[old]
        if k == 1:
            del counts[old]
        else:
            counts[old] = k - 1
    counts[new] = counts.get(new, 0) + 1


@dataclass
class SolverState:
    graph: Graph
    layouts: Layouts
    sizes: tuple[int, ...]  # per SBP axis of the mesh (1: the axis is left out of this search)
    model: CostModel
    index: GraphIndex
    # layer classes (layer_classes): a member follows its representative
    cls: LayerClasses
    cands: list[list[NdSignature]]  # per op: its candidate nd-signatures (a member shares its representative's)
    active: list[int]  # the ops that are decided: representatives and ops in no class
    tied: dict[int, list[int]]  # representative -> members, itself included
    # how a representative's costs stand for its class (Solver.weigh)
    weight: dict[int, tuple[int, list[int]]] = field(default_factory=dict)  # rep -> (times it counts, members priced alone)
    vweight: dict[str, tuple[int, list[str]]] = field(default_factory=dict)  # the same for values
    vrep: dict[str, str] = field(default_factory=dict)  # value -> the representative's value it stands for
    copies: set[str] = field(default_factory=set)  # values that another layer's copy stands for
    live: dict[int, _Live] | None = None  # representative -> what `choose` keeps up to date of its class
    # the decisions
    sbp: dict[str, NdSbp] = field(default_factory=dict)  # value -> its nd-SBP
    why: dict[str, str] = field(default_factory=dict)  # input value -> where its nd-SBP came from
    req: dict[str, dict[tuple, NdSbp]] = field(default_factory=dict)  # value -> (consumer, position) -> needed nd-SBP
    reqc: dict[str, dict[NdSbp, int]] = field(default_factory=dict)  # value -> needed nd-SBP -> positions needing it
    choice: list[int] = field(default_factory=list)  # per op: the index of its candidate
    focus: int | None = None  # the mesh axis refinement works on (None: all)
    in_flight: dict[int, int] = field(default_factory=dict)  # pipeline chunk -> micro-batches it holds at once (default 1)
    reqb: dict[str, dict[NdSbp, int]] = field(default_factory=dict)  # the part of reqc that backward ops need
    # derived from the above (__post_init__); the index's maps are at hand for the hot loops
    axes: tuple[str, ...] = field(init=False)
    sequential: frozenset[int] = field(init=False)  # axes whose steps run one after another (micro-batches)
    microbatches: int = field(init=False)  # how often a per-micro-batch op runs a step (1: no such axis searched)
    types: dict[str, TensorType] = field(init=False)
    uses: list[list[str]] = field(init=False)
    producer: dict[str, int] = field(init=False)
    consumers: dict[str, list[int]] = field(init=False)
    at: list[list[Use]] = field(init=False)
    held: dict[str, bool] = field(init=False)  # the saved values whose memory is priced (index.saved, or none)
    _box: dict = field(init=False, default_factory=dict)  # (src, dst, type, bucketed) -> price
    _compute: dict = field(init=False, default_factory=dict)  # (op, id(candidate)) -> (candidate, its compute price)
    _prices: dict = field(init=False, default_factory=dict)  # (value, id(src), id(dst)) -> (src, dst, box price)
    _shared_reads: list | None = field(init=False, default=None)  # shared_reads(), once found
    _searched: tuple | None = field(init=False, default=None)  # (len(req), searched_needs()) once found
    _options: dict = field(init=False, default_factory=dict)  # (op, its choice, focus) -> options()
    bucketed: frozenset[str] = field(init=False)  # the values that serve one gradient (gradient_tail)
    # the axes whose gradient buckets every plan makes: those that split the data (the batch, a
    # hinted activation), where replicated weights' gradients are partial (Solver._data_axes)
    bucket_axes: frozenset[int] = frozenset()
    # the parameters whose layouts the search chooses (param_moves.FreeParam; none by default)
    free_params: list = field(default_factory=list)

    def __post_init__(self):
        self.axes = self.graph.mesh.sbp_axes
        self.sequential = self.graph.mesh.sequential_axes
        self.microbatches = 1
        for a in self.sequential:
            self.microbatches *= self.sizes[a]
        self.types = self.layouts.types
        self.uses, self.producer, self.consumers, self.at = (self.index.uses, self.index.producer,
                                                             self.index.consumers, self.index.at)
        # memory is priced only when it has a price: at 0 the search is the time-only one, op for op
        self.held = self.index.saved if self.model.memory(1 << 30) > 0 else {}
        if not self.choice:
            self.choice = [0] * len(self.graph.nodes)
        self.bucketed = self.index.bucketed

    def chosen(self, idx: int) -> NdSignature:
        # a member's choice is its representative's (once refinement runs, ``choose`` keeps
        # only the representative's entry of ``choice`` up to date)
        return self.cands[idx][self.choice[self.cls.rep[idx]]]

    # ----- what is needed
    def require(self, v: str, key: tuple, t: NdSbp) -> None:
        """Consumer position ``key`` needs ``v`` as ``t``."""
        reqs = self.req.get(v)
        if reqs is None:
            reqs = self.req[v] = {}
        old = reqs.get(key)
        if old == t:
            return
        reqs[key] = t
        counts = self.reqc.get(v)
        if counts is None:
            counts = self.reqc[v] = {}
        _count(counts, old, t)
        if v in self.held and key[0] in self.index.backward:
            _count(self.reqb.setdefault(v, {}), old, t)

    def needs(self, v: str):
        """The layouts ``v`` is needed in."""
        return self.reqc.get(v, {}).keys()

    def back_needs(self, v: str):
        """The layouts backward ops need ``v`` in (only for values whose memory is priced)."""
        return self.reqb.get(v, {}).keys()

    # ----- costs
    def box(self, src: NdSbp, dst: NdSbp, t: TensorType, bucketed: bool = False, step_read: bool = False) -> float:
        """Converting a value of type ``t``, a step's worth (``boxing_cost``); ``bucketed``: one
        that serves a single gradient, whose reductions on ``bucket_axes`` join the buckets made
        there anyway; ``step_read``: one only the optimizer reads, converted once a step."""
        key = (src, dst, t, bucketed, step_read)
        if key not in self._box:
            self._box[key] = boxing_cost(src, dst, t, self.sizes, self.model, self.sequential,
                                         self.bucket_axes if bucketed else frozenset(), self.microbatches, step_read)
        return self._box[key]

    def compute(self, idx: int, c: NdSignature) -> float:
        # a pure function of the two: the refinement asks again and again. Keyed by the
        # candidate's identity (hashing a signature hashes every layout in it); the entry keeps
        # the candidate, so its id is not reused while the entry lives
        found = self._compute.get((idx, id(c)))
        if found is not None and found[0] is c:
            return found[1]
        n = self.graph.nodes[idx]
        ins = [Operand(local_shape(t.shape, nd, self.sizes), dtype_size(t.dtype))
               for t, nd in zip((self.types[u] for u in self.uses[idx]), c.ins)]
        outs = [Operand(local_shape(t.shape, nd, self.sizes), dtype_size(t.dtype)) for t, nd in zip(n.types, c.outs)]
        price = self.model.op(n.op, ins, outs, n.types[0].dtype if n.types else "f32")
        if idx not in self.index.once:  # the forward and the backward run once per micro-batch
            price *= self.microbatches
        self._compute[(idx, id(c))] = (c, price)
        return price

    def value_cost(self, v: str, src: NdSbp, reqs, back=(), forward=None) -> float:
        """Converting ``v`` from ``src`` into each distinct layout of ``reqs``, and holding what
        the backward reads of it (``back``: the layouts backward ops need; ``forward``: those the
        other ops need, by default as the counts stand)."""
        cost, prices = 0, self._prices  # as sum() adds: from 0, in the set's order
        for t in set(reqs):
            if t is not src and t != src:
                found = prices.get((v, id(src), id(t)))
                cost += found[2] if found is not None and found[0] is src and found[1] is t else self._convert(v, src, t)
        if back and v in self.held:
            cost += min(self.holding(v, src, set(back), self._forward(v) if forward is None else forward))
        return cost

    def _convert(self, v: str, src: NdSbp, dst: NdSbp) -> float:
        """``box`` for value ``v``, memoized by the layouts' identities (the candidates' layouts
        are few objects, asked for again and again; hashing one hashes each of its axes). The
        entry keeps both layouts, so their ids are not reused while it lives."""
        key = (v, id(src), id(dst))
        found = self._prices.get(key)
        if found is not None and found[0] is src and found[1] is dst:
            return found[2]
        price = self.box(src, dst, self.types[v], v in self.bucketed, v in self.index.step_read)
        self._prices[key] = (src, dst, price)
        return price

    def _forward(self, v: str) -> set:
        counts, back = self.reqc.get(v, {}), self.reqb.get(v, {})
        return {x for x, k in counts.items() if k > back.get(x, 0)}

    def holding(self, v: str, src: NdSbp, back: set, forward: set) -> tuple[float, float]:
        """What keeping ``v`` for the backward costs: (the forward's conversions kept, each made
        again in the backward). Boxing converts right before the first op that needs a layout and
        shares the result, so a layout both phases need is kept from the forward (its bytes held);
        made again in the backward instead, it costs its conversion once more and holds ``src``.
        A layout only the backward needs is made there, from ``src``, which is then held."""
        t, sizes = self.types[v], self.sizes
        # the bytes held while the chunk holds its micro-batches in flight; priced once per
        # micro-batch, like the conversions it weighs against (a price is a step's worth), so
        # that MEMORY_PRICES mean what they did: link-moves per byte held
        weight = self.in_flight.get(self.graph.nodes[self.producer[v]].stage, 1) * self.microbatches
        own = t.local_nbytes(src, sizes) if self.held[v] else 0  # a view: counted at its saved root
        shared = [x for x in back if x != src and x in forward]
        src_held = src in back or any(x != src and x not in forward for x in back)
        keep = self.model.memory(weight * (own * src_held + sum(t.local_nbytes(x, sizes) for x in shared)))
        if not shared:
            return keep, keep
        return keep, sum(self.box(src, x, t) for x in shared) + self.model.memory(weight * own)

    def regathered(self) -> frozenset[str]:
        """The saved values whose conversions are cheaper made again in the backward (boxing's cue)."""
        again = {}
        for v in self.held:
            back = self.back_needs(v)
            if back and v not in self.copies:
                keep, other = self.holding(v, self.sbp[v], set(back), self._forward(v))
                again[v] = other < keep
        # a layer's copy does what the value it stands for does
        return frozenset(v for v in self.held if again.get(self.vrep.get(v, v) if v in self.copies else v, False))

    def local_cost(self, idx: int, c: NdSignature) -> float:
        """What op ``idx`` costs in candidate ``c`` (its compute and the conversions of its
        values); for a representative, what its whole layer class costs."""
        if idx in self.weight:
            w, odd = self.weight[idx]
            return w * self._local_cost(idx, c) + sum(self._local_cost(m, c) for m in odd)
        return self._local_cost(idx, c)

    def _local_cost(self, idx: int, c: NdSignature) -> float:
        cost = self.compute(idx, c)
        reqc, req, sbp, held, value_cost, ins = self.reqc, self.req, self.sbp, self.held, self.value_cost, c.ins
        for v, pos in self.at[idx]:
            # what the other consumers need, and what c needs
            counts, reqs = reqc.get(v, _NONE), req.get(v, _NONE)
            if len(pos) == 1:  # most ops read a value once: the general case's sets, without its lists
                p = pos[0]
                mine1 = reqs.get((idx, p))
                if mine1 is None:
                    need = set(counts)
                    mine = []
                else:
                    need = {t for t, k in counts.items() if k > (t == mine1)}
                    mine = [mine1]
                need.add(ins[p])
            else:
                mine = [reqs[(idx, p)] for p in pos if (idx, p) in reqs]
                need = {t for t, k in counts.items() if k > mine.count(t)} if mine else set(counts)
                need.update(ins[p] for p in pos)
            if v in held:  # the same split by phase: which layouts the backward needs
                back, forward = self._phases(v, idx, mine, [ins[p] for p in pos])
                cost += value_cost(v, sbp[v], need, back, forward)
            else:
                cost += value_cost(v, sbp[v], need)
        reqb, outs = self.reqb, c.outs
        for j, o in enumerate(self.graph.nodes[idx].outputs):
            cost += value_cost(o, outs[j], reqc.get(o, _NONE).keys(), reqb.get(o, _NONE).keys())
        return cost

    def _phases(self, v: str, idx: int, mine: list[NdSbp], wanted: list[NdSbp]) -> tuple[set, set]:
        """The layouts the backward and the other ops need of ``v`` when op ``idx`` takes it as
        ``wanted`` instead of ``mine``."""
        counts, bcounts = self.reqc.get(v, {}), self.reqb.get(v, {})
        fcounts = {x: k - bcounts.get(x, 0) for x, k in counts.items() if k > bcounts.get(x, 0)}
        own = bcounts if idx in self.index.backward else fcounts
        need = {x for x, k in own.items() if k > mine.count(x)} | set(wanted)
        if idx in self.index.backward:
            return need, set(fcounts)
        return set(bcounts), need

    def cost_of(self, idxs: list[int], values: set[str]) -> float:
        """The ops ``idxs`` and the conversions of ``values``, as chosen now."""
        if not self.tied:
            cost = sum(self.compute(i, self.cands[i][self.choice[i]]) for i in idxs)
            return cost + sum(self.value_cost(v, self.sbp[v], self.needs(v), self.back_needs(v)) for v in values)
        # a class's ops and values in every layer: the value between two layers once, not as
        # one layer's input and another's output
        cost = sum(self.compute(i, self.cands[i][self.choice[i]]) * len(self.tied.get(i, (i,))) for i in idxs)
        for v in {self.vrep.get(v, v) for v in values}:
            w, odd = self.vweight.get(v, (1, ()))
            cost += w * self.value_cost(v, self.sbp[v], self.needs(v), self.back_needs(v))
            cost += sum(self.value_cost(u, self.sbp[u], self.needs(u), self.back_needs(u)) for u in odd)
        return cost

    # ----- choices
    def options(self, idx: int) -> tuple[int, ...]:
        """The candidates a move may give op ``idx``: all of them, or, while refinement works
        on one mesh axis (``focus``), those that agree with the current choice on the others.
        Axis by axis keeps each move small: a few signatures per op instead of their product."""
        memo = (idx, self.choice[idx], self.focus)  # a pure function of these: moves ask again and again
        found = self._options.get(memo)
        if found is not None:
            return found
        if self.focus is None:
            found = tuple(range(len(self.cands[idx])))
        else:
            cur, a = self.cands[idx][self.choice[idx]], self.focus
            key = lambda c: tuple(nd[:a] + nd[a + 1:] for nd in c.ins + c.outs)
            k = key(cur)
            found = tuple(ci for ci, c in enumerate(self.cands[idx]) if key(c) == k)
        self._options[memo] = found
        return found

    def searched_needs(self) -> list[tuple[str, dict[tuple, NdSbp]]]:
        """(value, its ``req``) of every value with needs but the copies (``copies``): what the
        search looks at. Found again only when values gained needs (they never lose them)."""
        if self._searched is None or self._searched[0] != len(self.req):
            self._searched = len(self.req), [(v, reqs) for v, reqs in self.req.items() if v not in self.copies]
        return self._searched[1]

    def shared_reads(self) -> list[tuple[str, list[int], list[tuple[int, tuple[int, ...]]]]]:
        """The values that several decided ops read (through their representatives, when they
        all read this very value), each with those ops and the positions each reads it at:
        where a joint move can pay (``refine_values``). The graph's structure alone decides
        them, so they are found once."""
        if self._shared_reads is None:
            out = []
            for v, idxs in self.consumers.items():
                if len(idxs) < 2:
                    continue
                if self.tied:
                    idxs = list(dict.fromkeys(self.cls.rep[i] for i in idxs))
                    if len(idxs) < 2 or any(v not in self.uses[i] for i in idxs):
                        continue
                out.append((v, idxs, [(i, tuple(p for p, u in enumerate(self.uses[i]) if u == v)) for i in idxs]))
            self._shared_reads = out
        return self._shared_reads

    def choose(self, idx: int, ci: int) -> None:
        """Op ``idx`` takes candidate ``ci``, and so does every member of its layer class (the
        layouts and needs of members that no cost reads are left as they are: ``go_live``; a
        member's choice is read through its representative: ``chosen``)."""
        ms = self.tied.get(idx)
        if ms is None:
            self._set_all((idx,), ci)
            return
        if self.live is None:
            self._set_all(ms, ci)
            return
        self.choice[idx] = ci
        live = self.live[idx]
        c = self.cands[idx][ci]  # every member shares its representative's candidate list
        ins = c.ins
        for v, keys, p, back in live.shared:
            self._require_all(v, keys, ins[p], back)
        for v, key, p in live.own:
            self.require(v, key, ins[p])
        outs = c.outs
        for o, j in live.results:
            self.sbp[o] = outs[j]

    def _require_all(self, v: str, keys: tuple, t: NdSbp, back: bool) -> None:
        """``require(v, key, t)`` for every key of ``keys``, in one step: every key needs the
        same layout now (they are positions of one class's members, which always choose
        together), so the counts move by ``len(keys)`` at once; the dicts end as the one-by-one
        updates leave them, their order included."""
        reqs = self.req[v]
        old = reqs[keys[0]]
        if old == t:
            return
        for k in keys:
            reqs[k] = t
        _count_n(self.reqc[v], old, t, len(keys))
        if back:
            _count_n(self.reqb[v], old, t, len(keys))

    def _set_all(self, ms, ci: int) -> None:
        """Ops ``ms`` take candidate ``ci``: ``require`` for each of their uses (inlined: the
        first choice of every member of every layer class comes through here), and their
        results' layouts."""
        req, reqc, held, backward, sbp = self.req, self.reqc, self.held, self.index.backward, self.sbp
        for m in ms:
            self.choice[m] = ci
            c = self.cands[m][ci]
            ins = c.ins
            held_here = held if m in backward else _NONE
            for v, pos in self.at[m]:
                reqs = req.get(v)
                if reqs is None:
                    reqs = req[v] = {}
                for p in pos:
                    t, key = ins[p], (m, p)
                    old = reqs.get(key)
                    if old == t:
                        continue
                    reqs[key] = t
                    counts = reqc.get(v)
                    if counts is None:
                        counts = reqc[v] = {}
                    _count(counts, old, t)
                    if v in held_here:
                        _count(self.reqb.setdefault(v, {}), old, t)
            outs = c.outs
            for j, o in enumerate(self.graph.nodes[m].outputs):
                sbp[o] = outs[j]

    def go_live(self) -> None:
        """From now on (refinement), keep up to date only the layouts and needs that costs
        read: those of the values of representatives, of ops in no class and of the members
        priced on their own (``weight``). The members that touch none of these are copies
        whose state no cost reads; their choices still follow."""
        if not self.tied or self.live is not None:
            return
        nodes = self.graph.nodes
        read = [i for i, r in enumerate(self.cls.rep) if r == i]
        read += [m for _, odd in self.weight.values() for m in odd]
        values = {v for i in read for v in self.uses[i]} | {o for i in read for o in nodes[i].outputs}
        own = {m for _, odd in self.weight.values() for m in odd}
        self.live = {}
        for r, ms in self.tied.items():
            live = [m for m in ms if m == r or m in own
                    or not values.isdisjoint(self.uses[m]) or not values.isdisjoint(nodes[m].outputs)]
            # of a member live for one value it shares (the optimizer's hyperparameter read by
            # every layer's update), only that value's needs are kept: no cost reads the rest
            self.live[r] = _Live.of([(m, v, p) for m in live for v, pos in self.at[m] if v in values for p in pos],
                                    [(o, j) for m in live for j, o in enumerate(nodes[m].outputs) if o in values],
                                    self.held, self.index.backward)


@dataclass
class _Live:
    """What ``choose`` keeps up to date of one layer class once refinement runs (``go_live``)."""
    # a value every live member reads once, at one position: (value, their keys, the position,
    # whether they are backward ops reading a held value), updated in one step (_require_all)
    shared: list[tuple[str, tuple, int, bool]]
    own: list[tuple[str, tuple, int]]  # the other (value, key, position) needs, in program order
    results: list[tuple[str, int]]  # (value, output index) of the members' results

    @classmethod
    def of(cls, uses: list[tuple[int, str, int]], results: list[tuple[str, int]], held, backward) -> _Live:
        by_value: dict[str, list[tuple[int, int]]] = {}
        for m, v, p in uses:
            by_value.setdefault(v, []).append((m, p))
        shared, own = [], []
        for v, at in by_value.items():
            members = [m for m, _ in at]
            phases = {v in held and m in backward for m in members}
            if len(at) > 1 and len({p for _, p in at}) == 1 and len(set(members)) == len(members) and len(phases) == 1:
                shared.append((v, tuple(at), at[0][1], phases.pop()))
            else:
                own += [(v, (m, p), p) for m, p in at]
        return cls(shared, own, results)
