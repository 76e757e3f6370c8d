"""The state of the SBP search, in one typed home, with what every phase asks of it: the
prices of conversions and compute, and the one way to change a choice (``choose``).

The solver (``solver.py``) fills it (inputs, hints, the greedy pass); the refinement moves
(``refine.py``) read and change it. Nothing else keeps search state.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from sbpc.compiler.ir.mesh import MICROBATCH
from sbpc.compiler.ir.types import Graph, Role, TensorType
from sbpc.compiler.sbp.boxing_plan import boxing_cost
from sbpc.compiler.sbp.cost_model import CostModel
from sbpc.compiler.sbp.layer_classes import LayerClasses
from sbpc.compiler.sbp.layout import Layouts, NdSignature
from sbpc.runtime.sbp import NdSbp

Use = tuple[str, tuple[int, ...]]  # a value an op uses, with the positions it takes it at


@dataclass(frozen=True)
class GraphIndex:
    """The graph's structure, shared by every solver of one graph (one per mesh axis, and the
    joint one)."""
    uses: list[list[str]]  # per op: the values it uses, by position
    producer: dict[str, int]  # value -> the op that makes it
    consumers: dict[str, list[int]]  # value -> the ops that read it, each once
    at: list[list[Use]]  # per op: each value it uses once, with its positions

    @classmethod
    def of(cls, graph: Graph) -> GraphIndex:
        uses = [list(n.uses()) for n in graph.nodes]
        at = [[(v, tuple(p for p, u in enumerate(us) if u == v)) for v in dict.fromkeys(us)] for us in uses]
        return cls(uses, graph.producers(), graph.users(), at)


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
    # the decisions
    sbp: dict[str, NdSbp] = field(default_factory=dict)  # value -> its nd-SBP
    why: dict[str, str] = field(default_factory=dict)  # input value -> where its nd-SBP came from
    req: dict[str, dict[tuple, NdSbp]] = field(default_factory=dict)  # value -> (consumer, position) -> needed nd-SBP
    reqc: dict[str, dict[NdSbp, int]] = field(default_factory=dict)  # value -> needed nd-SBP -> positions needing it
    choice: list[int] = field(default_factory=list)  # per op: the index of its candidate
    focus: int | None = None  # the mesh axis refinement works on (None: all)
    # derived from the above (__post_init__); the index's maps are at hand for the hot loops
    axes: tuple[str, ...] = field(init=False)
    sequential: frozenset[int] = field(init=False)  # axes whose steps run one after another (micro-batches)
    types: dict[str, TensorType] = field(init=False)
    uses: list[list[str]] = field(init=False)
    producer: dict[str, int] = field(init=False)
    consumers: dict[str, list[int]] = field(init=False)
    at: list[list[Use]] = field(init=False)
    _box: dict = field(init=False, default_factory=dict)  # (src, dst, type, bucketed) -> price
    bucketed: frozenset[str] = field(init=False)  # weight gradients on their way to the optimizer

    def __post_init__(self):
        self.axes = self.graph.mesh.sbp_axes
        self.sequential = frozenset(a for a, name in enumerate(self.axes) if name == MICROBATCH)
        self.types = self.layouts.types
        self.uses, self.producer, self.consumers, self.at = (self.index.uses, self.index.producer,
                                                             self.index.consumers, self.index.at)
        if not self.choice:
            self.choice = [0] * len(self.graph.nodes)
        self.bucketed = gradient_tail(self.graph, self.consumers)

    def chosen(self, idx: int) -> NdSignature:
        return self.cands[idx][self.choice[idx]]

    # ----- what is needed
    def require(self, v: str, key: tuple, t: NdSbp) -> None:
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

    # ----- costs
    def box(self, src: NdSbp, dst: NdSbp, t: TensorType, bucketed: bool = False) -> float:
        key = (src, dst, t, bucketed)
        if key not in self._box:
            self._box[key] = boxing_cost(src, dst, t, self.sizes, self.model, self.sequential, bucketed)
        return self._box[key]

    def compute(self, idx: int, c: NdSignature) -> float:
        n = self.graph.nodes[idx]
        ts = [self.types[u] for u in self.uses[idx]] + list(n.types)
        return self.model.compute(sum(t.local_nbytes(nd, self.sizes) for t, nd in zip(ts, c.ins + c.outs)))

    def value_cost(self, v: str, src: NdSbp, reqs) -> float:
        """Converting ``v`` from ``src`` into each distinct layout of ``reqs``."""
        bucketed = v in self.bucketed
        return sum(self.box(src, t, self.types[v], bucketed) for t in set(reqs) if t != src)

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
            cost += self.value_cost(v, self.sbp[v], need)
        for j, o in enumerate(n.outputs):
            cost += self.value_cost(o, c.outs[j], self.needs(o))
        return cost

    def cost_of(self, idxs: list[int], values: set[str]) -> float:
        """The ops ``idxs`` and the conversions of ``values``, as chosen now."""
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

    # ----- choices
    def options(self, idx: int) -> list[int]:
        """The candidates a move may give op ``idx``: all of them, or, while refinement works
        on one mesh axis (``focus``), those that agree with the current choice on the others.
        Axis by axis keeps each move small: a few signatures per op instead of their product."""
        if self.focus is None:
            return list(range(len(self.cands[idx])))
        cur, a = self.cands[idx][self.choice[idx]], self.focus
        key = lambda c: tuple(nd[:a] + nd[a + 1:] for nd in c.ins + c.outs)
        k = key(cur)
        return [ci for ci, c in enumerate(self.cands[idx]) if key(c) == k]

    def choose(self, idx: int, ci: int) -> None:
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

    def _set_one(self, idx: int, ci: int) -> None:
        self.choice[idx] = ci
        c = self.cands[idx][ci]
        for v, pos in self.at[idx]:
            for p in pos:
                self.require(v, (idx, p), c.ins[p])
        for j, o in enumerate(self.graph.nodes[idx].outputs):
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


def gradient_tail(graph: Graph, consumers: dict[str, list[int]]) -> frozenset[str]:
    """The backward's values that only the optimizer needs, directly or through backward ops
    that feed nothing else (a weight gradient and its transpose): their reductions are what
    ``coalesce`` buckets and ``overlap`` issues while the backward goes on."""
    nodes = graph.nodes
    tail: set[str] = set()
    for n in reversed(nodes):  # consumers come later in program order
        if n.role != Role.BACKWARD:
            continue
        for o in n.outputs:
            readers = consumers.get(o, [])
            if readers and all(nodes[c].role == Role.OPTIMIZER or
                               (nodes[c].role == Role.BACKWARD and all(x in tail for x in nodes[c].outputs))
                               for c in readers):
                tail.add(o)
    return frozenset(tail)
