"""The state of the SBP search, in one typed home, with what every phase asks of it: the
prices of conversions and compute, and the one way to change a choice (``choose``).

The solver (``solver.py``) fills it (inputs, hints, the greedy pass); the refinement moves
(``refine.py``) read and change it. Nothing else keeps search state.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from sbpc.compiler.ir.aten import shares_storage
from sbpc.compiler.ir.types import Graph, Role, TensorType
from sbpc.compiler.sbp.boxing_plan import boxing_cost
from sbpc.compiler.sbp.cost_model import CostModel
from sbpc.compiler.sbp.layer_classes import LayerClasses
from sbpc.compiler.sbp.layout import Layouts, NdSignature
from sbpc.runtime.sbp import NdSbp

Use = tuple[str, tuple[int, ...]]  # a value an op uses, with the positions it takes it at


def _count(counts: dict[NdSbp, int], old: NdSbp | None, new: NdSbp) -> None:
    """One position moves from needing ``old`` (None: it needed nothing) to needing ``new``."""
    if old is not None:
        if counts[old] == 1:
            del counts[old]
        else:
            counts[old] -= 1
    counts[new] = counts.get(new, 0) + 1


@dataclass(frozen=True)
class GraphIndex:
    """The graph's structure, shared by every solver of one graph (one per mesh axis, and the
    joint one)."""
    uses: list[list[str]]  # per op: the values it uses, by position
    producer: dict[str, int]  # value -> the op that makes it
    consumers: dict[str, list[int]]  # value -> the ops that read it, each once
    at: list[list[Use]]  # per op: each value it uses once, with its positions
    backward: frozenset[int]  # the backward's ops
    # forward values a backward op reads (kept from the forward to the backward), each with
    # whether its bytes are its own (False: a view of a saved value, whose storage is counted there)
    saved: dict[str, bool]

    @classmethod
    def of(cls, graph: Graph) -> GraphIndex:
        uses = [list(n.uses()) for n in graph.nodes]
        at = [[(v, tuple(p for p, u in enumerate(us) if u == v)) for v in dict.fromkeys(us)] for us in uses]
        backward = frozenset(i for i, n in enumerate(graph.nodes) if n.role == Role.BACKWARD)
        read_back = {u for i in backward for u in uses[i]}
        root: dict[str, str] = {}
        for i, n in enumerate(graph.nodes):
            for o in n.outputs:
                root[o] = root.get(uses[i][0], uses[i][0]) if shares_storage(n.op) and uses[i] else o
        saved = {o: root[o] == o or root[o] not in read_back for n in graph.nodes if n.role == Role.FORWARD
                 for o in n.outputs if o in read_back}
        return cls(uses, graph.producers(), graph.users(), at, backward, saved)


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
    live: dict[int, list[int]] | None = None  # representative -> the members `choose` keeps up to date
    live_values: dict[int, tuple[list, list]] = field(default_factory=dict)  # live member -> (uses, results) kept
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
    types: dict[str, TensorType] = field(init=False)
    uses: list[list[str]] = field(init=False)
    producer: dict[str, int] = field(init=False)
    consumers: dict[str, list[int]] = field(init=False)
    at: list[list[Use]] = field(init=False)
    held: dict[str, bool] = field(init=False)  # the saved values whose memory is priced (index.saved, or none)
    _box: dict = field(init=False, default_factory=dict)  # (src, dst, type, bucketed) -> price
    _compute: dict = field(init=False, default_factory=dict)  # (op, candidate) -> its compute price
    _options: dict = field(init=False, default_factory=dict)  # (op, its choice, focus) -> options()
    bucketed: frozenset[str] = field(init=False)  # the values that serve one gradient (gradient_tail)
    # the axes whose gradient buckets every plan makes: those that split the data (the batch, a
    # hinted activation), where replicated weights' gradients are partial (Solver._data_axes)
    bucket_axes: frozenset[int] = frozenset()

    def __post_init__(self):
        self.axes = self.graph.mesh.sbp_axes
        self.sequential = self.graph.mesh.sequential_axes
        self.types = self.layouts.types
        self.uses, self.producer, self.consumers, self.at = (self.index.uses, self.index.producer,
                                                             self.index.consumers, self.index.at)
        # memory is priced only when it has a price: at 0 the search is the time-only one, op for op
        self.held = self.index.saved if self.model.memory(1 << 30) > 0 else {}
        if not self.choice:
            self.choice = [0] * len(self.graph.nodes)
        self.bucketed = gradient_tail(self.graph, self.consumers)

    def chosen(self, idx: int) -> NdSignature:
        return self.cands[idx][self.choice[idx]]

    # ----- what is needed
    def require(self, v: str, key: tuple, t: NdSbp) -> None:
        """Consumer position ``key`` needs ``v`` as ``t``."""
        reqs = self.req.setdefault(v, {})
        old = reqs.get(key)
        if old == t:
            return
        reqs[key] = t
        _count(self.reqc.setdefault(v, {}), old, t)
        if v in self.held and key[0] in self.index.backward:
            _count(self.reqb.setdefault(v, {}), old, t)

    def needs(self, v: str):
        """The layouts ``v`` is needed in."""
        return self.reqc.get(v, {}).keys()

    def back_needs(self, v: str):
        """The layouts backward ops need ``v`` in (only for values whose memory is priced)."""
        return self.reqb.get(v, {}).keys()

    # ----- costs
    def box(self, src: NdSbp, dst: NdSbp, t: TensorType, bucketed: bool = False) -> float:
        """Converting a value of type ``t``; ``bucketed``: one that serves a single gradient,
        whose reductions on ``bucket_axes`` join the buckets made there anyway."""
        key = (src, dst, t, bucketed)
        if key not in self._box:
            self._box[key] = boxing_cost(src, dst, t, self.sizes, self.model, self.sequential,
                                         self.bucket_axes if bucketed else frozenset())
        return self._box[key]

    def compute(self, idx: int, c: NdSignature) -> float:
        key = (idx, c)  # a pure function of the two: the refinement asks again and again
        price = self._compute.get(key)
        if price is None:
            n = self.graph.nodes[idx]
            ts = [self.types[u] for u in self.uses[idx]] + list(n.types)
            price = self._compute[key] = self.model.compute(sum(t.local_nbytes(nd, self.sizes)
                                                                for t, nd in zip(ts, c.ins + c.outs)))
        return price

    def value_cost(self, v: str, src: NdSbp, reqs, back=(), forward=None) -> float:
        """Converting ``v`` from ``src`` into each distinct layout of ``reqs``, and holding what
        the backward reads of it (``back``: the layouts backward ops need; ``forward``: those the
        other ops need, by default as the counts stand)."""
        bucketed = v in self.bucketed
        cost = sum(self.box(src, t, self.types[v], bucketed) for t in set(reqs) if t != src)
        if back and v in self.held:
            cost += min(self.holding(v, src, set(back), self._forward(v) if forward is None else forward))
        return cost

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
        weight = self.in_flight.get(self.graph.nodes[self.producer[v]].stage, 1)
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
        n = self.graph.nodes[idx]
        for v, pos in self.at[idx]:
            # what the other consumers need, and what c needs
            counts, reqs = self.reqc.get(v, {}), self.req.get(v, {})
            mine = [reqs[(idx, p)] for p in pos if (idx, p) in reqs]
            need = {t for t, k in counts.items() if k > mine.count(t)} if mine else set(counts)
            need.update(c.ins[p] for p in pos)
            if v in self.held:  # the same split by phase: which layouts the backward needs
                back, forward = self._phases(v, idx, mine, [c.ins[p] for p in pos])
                cost += self.value_cost(v, self.sbp[v], need, back, forward)
            else:
                cost += self.value_cost(v, self.sbp[v], need)
        for j, o in enumerate(n.outputs):
            cost += self.value_cost(o, c.outs[j], self.needs(o), self.back_needs(o))
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

    def choose(self, idx: int, ci: int) -> None:
        """Op ``idx`` takes candidate ``ci``, and so does every member of its layer class (the
        layouts and needs of members that no cost reads are left as they are: ``go_live``)."""
        ms = self.tied.get(idx)
        if ms is None:
            self._set_one(idx, ci)
            return
        for m in ms:
            self.choice[m] = ci
        if self.live is None:
            for m in ms:
                self._set_one(m, ci)
            return
        for m in self.live[idx]:
            self._set_one(m, ci, *self.live_values[m])

    def _set_one(self, idx: int, ci: int, at: list[Use] | None = None, outs: list[tuple[int, str]] | None = None) -> None:
        """``at`` / ``outs``: the uses and results to keep up to date (default: all of them)."""
        self.choice[idx] = ci
        c = self.cands[idx][ci]
        for v, pos in self.at[idx] if at is None else at:
            for p in pos:
                self.require(v, (idx, p), c.ins[p])
        for j, o in enumerate(self.graph.nodes[idx].outputs) if outs is None else outs:
            self.sbp[o] = c.outs[j]

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
            self.live[r] = [m for m in ms if m == r or m in own
                            or any(v in values for v in self.uses[m]) or any(o in values for o in nodes[m].outputs)]
            # of a member live for one value it shares (the optimizer's hyperparameter read by
            # every layer's update), only that value's needs are kept: no cost reads the rest
            for m in self.live[r]:
                self.live_values[m] = ([(v, pos) for v, pos in self.at[m] if v in values],
                                       [(j, o) for j, o in enumerate(nodes[m].outputs) if o in values])


def gradient_tail(graph: Graph, consumers: dict[str, list[int]]) -> frozenset[str]:
    """The backward's values that serve one parameter's gradient alone: the gradient itself (what
    the optimizer reads) and what only it is computed from (a weight gradient before its
    transpose, a norm weight's products before their sum). Their reductions are what
    ``coalesce`` buckets and ``overlap`` issues while the backward goes on: nothing else in the
    backward waits for them. An activation's gradient is not among them even though the whole
    backward ends in gradients: the gradients of every layer below are computed from it, so its
    reduction blocks the backward where it is needed, one call of its own."""
    nodes = graph.nodes
    # per backward value, the gradient it serves: a value the optimizer reads, or _MANY
    serves: dict[str, str] = {}
    for n in reversed(nodes):  # consumers come later in program order
        if n.role != Role.BACKWARD:
            continue
        for o in n.outputs:
            readers = consumers.get(o, [])
            got = {o} if any(nodes[c].role == Role.OPTIMIZER for c in readers) else set()
            for c in readers:
                if nodes[c].role == Role.BACKWARD:
                    got.update(serves.get(x, _MANY) for x in nodes[c].outputs)
                elif nodes[c].role != Role.OPTIMIZER:
                    got.add(_MANY)
            serves[o] = got.pop() if len(got) == 1 else _MANY
    return frozenset(v for v, g in serves.items() if g != _MANY)


_MANY = ""  # no value is named "": a value serving several gradients, or none
