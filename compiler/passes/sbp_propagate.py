"""sbp-propagate: choose an nd-SBP for every value and the signature of every op.

Inputs are fixed first: hinted parameters take their hint (``sbpc.hint`` ops on inputs),
optimizer state follows its parameter, batch inputs are ``S(0)`` on dp, everything else
``B``. Each op then picks among its candidate nd-signatures (``sbp/layout.py``) the one of least
cost: the boxing its inputs need, priced by the cost model, plus its compute. A greedy pass
in program order is followed by rounds of coordinate descent in which each op also sees what
its consumers need, until no op can lower the total. Ties go to fewer partial results, then
to the rule's order, so the result is deterministic.

The ops of a row-wise region (``Graph.rowwise``, ``sbp/rowwise.py``: Hugging Face's experts)
take their region's one signature instead of their rules'; the result's ``rowwise`` keeps the
regions split on some axis, for ``localize``.

Axes of size one carry ``B`` everywhere. Results: ``Node.sbp`` (per output), ``Node.sbp_in``
(what the op needs of each input; the boxing pass makes it so), and ``why`` for explain.
The search itself is ``sbp/solver.py`` (its state: ``sbp/state.py``; its moves: ``sbp/refine.py``);
this pass decides which axes are solved alone and which together.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from typing import ClassVar

from sbpc.compiler.pass_manager import Fact
from sbpc.compiler.sbp.axis_use import check_axes_split
from sbpc.compiler.frontend.hint_op import OP as HINT_OP
from sbpc.compiler.ir.mesh import MICROBATCH
from sbpc.compiler.ir.types import Graph, InputKind
from sbpc.compiler.sbp.cost_model import AlphaBeta, CostModel
from sbpc.compiler.sbp.layer_classes import LayerClasses, layer_classes
from sbpc.compiler.sbp.layout import Layouts
from sbpc.compiler.sbp.rowwise import Regions, find_regions
from sbpc.compiler.sbp.rules import RuleBook
from sbpc.compiler.sbp.rules.random_ops import reads_values
from sbpc.compiler.sbp.solver import Solver
from sbpc.compiler.sbp.graph_index import GraphIndex
from sbpc.compiler.pipelining.schedule_sim import regsts
from sbpc.runtime.kinds import ScheduleName
from sbpc.runtime.sbp import Broadcast, Split


@dataclass
class SbpPropagate:
    name: str = "sbp-propagate"
    needs: ClassVar[tuple[Fact, ...]] = ()
    provides: ClassVar[tuple[Fact, ...]] = (Fact.SBP,)
    cost_model: CostModel = field(default_factory=AlphaBeta)
    rules: RuleBook | None = None  # default: ir_specs/aten.sbp
    rounds: int = 6
    # Layer classes (layer_classes): in a graph of at least ``tie_min_nodes`` nodes, the nodes
    # of layers repeated at least ``tie_layers`` times are decided once per class, in a middle
    # layer, and every layer follows. None: never.
    tie_layers: int | None = 4
    tie_min_nodes: int = 1000
    # how the pipeline runs, for the memory term: a chunk holds the activations of the
    # micro-batches its schedule keeps in flight (schedule_sim.regsts)
    schedule: ScheduleName = ScheduleName.ONE_F_ONE_B
    virtual_stages: int = 1
    # whether the search also chooses the layouts of parameters without a hint (param_moves);
    # off: they are replicated. `sbpc compile --cluster` turns it on
    param_layouts: bool = False

    def apply(self, graph: Graph, ctx) -> Graph:
        axes = graph.mesh.sbp_axes
        sizes = tuple(graph.mesh.size(a) for a in axes)
        if all(k == 1 for k in sizes):
            return replace(_all_broadcast(graph, axes), rowwise=())
        # block counts of strided splits come from the whole-graph analysis (sbp_layout)
        rules = self.rules or RuleBook.load(strided_parts=())
        out, regions = self._propagate(graph, ctx, rules, sizes)
        check_axes_split(out, rules, getattr(ctx, "allow_replicated", False), getattr(ctx, "log", sys.stderr))
        split = tuple(r.module for r in regions.regions if regions.axes(r, axes, sizes))
        return replace(out, rowwise=split)

    def _propagate(self, graph: Graph, ctx, rules: RuleBook, sizes: tuple[int, ...]) -> tuple[Graph, Regions]:
        """The graph with every op's signature, and its row-wise regions (sbp/rowwise.py)."""
        # the graph's structure and value types, found once for the classes and every solver
        index, types = GraphIndex.of(graph), graph.value_types()
        regions = find_regions(graph, types)
        _warn_unruled(graph, rules, regions, getattr(ctx, "log", sys.stderr))
        axes = graph.mesh.sbp_axes
        busy = [a for a, k in enumerate(sizes) if k > 1]
        shared = _Shared(self.classes(graph, types, index.hyper), index, {"types": types, "rowwise": regions})
        if len(busy) == 1:
            return self._solve(graph, rules, sizes, shared).result(), regions
        # Several axes: solve each alone (the others one device), then start the joint search
        # from their combination. Axes interact only through tensor sizes and nested splits, so
        # the combination is nearly optimal, and one-axis problems are small.
        alone = [self._solve(graph, rules, tuple(k if b == a else 1 for b, k in enumerate(sizes)), shared) for a in busy]
        # Micro-batching is data parallelism in time: its one-axis solution (batch split, weight
        # gradients partial) is final, and the device axes are searched around it. This keeps
        # every micro-batch collective a reduction, and the joint candidates as few as without it.
        fixed = {a: [s.state.chosen(i) for i in range(len(graph.nodes))]
                 for a, s in zip(busy, alone) if axes[a] == MICROBATCH}
        solver = self._solver(graph, rules, sizes, shared, fixed)
        solver.fix_inputs()
        solver.adopt_params(busy, alone)
        if not solver.combine(busy, alone):
            solver.greedy()
        solver.refine(busy, self.rounds)
        return solver.result(), regions

    def classes(self, graph: Graph, types=None, hyper=None) -> LayerClasses | None:
        """The layer classes whose decisions are tied, or None (small graphs, tying off);
        ``types`` and ``hyper``: as ``layer_classes`` takes them."""
        if self.tie_layers is None or len(graph.nodes) < self.tie_min_nodes:
            return None
        classes = layer_classes(graph, max(2, self.tie_layers), types, hyper)
        return classes if classes.members else None

    def _solver(self, graph: Graph, rules: RuleBook, sizes: tuple[int, ...], shared: _Shared, fixed=None) -> Solver:
        classes = shared.classes
        lay = Layouts(graph, rules, sizes, fixed, classes.rep if classes else None, shared.memo)
        return Solver(graph, lay, sizes, self.cost_model, classes, shared.index, self.in_flight(graph),
                      self.param_layouts)

    def in_flight(self, graph: Graph) -> dict[int, int]:
        """Pipeline chunk -> the micro-batches whose activations it holds at once (interleaved:
        its device's count shared by its chunks)."""
        p, m, v = graph.mesh.size("pp"), graph.mesh.size(MICROBATCH), self.virtual_stages
        if p * v == 1:
            return {}
        return {c: max(1, regsts(self.schedule, c % p, p, m, v) // v) for c in range(p * v)}

    def _solve(self, graph: Graph, rules: RuleBook, sizes: tuple[int, ...], shared: _Shared) -> Solver:
        solver = self._solver(graph, rules, sizes, shared)
        solver.fix_inputs()
        solver.greedy()
        solver.refine([a for a, k in enumerate(sizes) if k > 1], self.rounds)
        return solver


@dataclass
class _Shared:
    """What the solvers of one graph share: its layer classes, its structure and the
    signature lists of its Layouts (``memo``)."""
    classes: LayerClasses | None
    index: GraphIndex
    memo: dict = field(default_factory=dict)


def _all_broadcast(graph: Graph, axes) -> Graph:
    b = tuple(Broadcast() for _ in axes)
    inputs = [replace(i, sbp=tuple(Split(0) if i.kind == InputKind.BATCH and a == "dp" else Broadcast() for a in axes))
              for i in graph.inputs]
    nodes = [replace(n, sbp=[b] * len(n.outputs), sbp_in=None) for n in graph.nodes]
    return replace(graph, inputs=inputs, nodes=nodes)


def _warn_unruled(graph: Graph, rules: RuleBook, regions: Regions, log) -> None:
    """Ops that run replicated for want of a rule (a row-wise region's ops need none), and the
    row-wise modules not split as regions, with why."""
    for module, why in regions.refused:
        print(f"sbpc: note: {module} is row-wise, but its ops are not split as one region: {why}", file=log)
    seen, split = set(), regions.of_node
    for i, n in enumerate(graph.nodes):
        if i in split:
            continue
        if n.op != HINT_OP and not rules.has_rule(n.op) and n.op not in seen:
            seen.add(n.op)
            where = f" (first at {n.loc})" if n.loc else ""
            print(f"sbpc: warning: no SBP rule for {n.op}{where}; it runs replicated (B) on every device", file=log)
        elif reads_values(n) and n.op not in seen:
            seen.add(n.op)
            where = f" (first at {n.loc})" if n.loc else ""
            print(f"sbpc: warning: {n.op}{where} draws random numbers from its inputs' values, so it runs replicated "
                  "(B) on every device, its inputs gathered; a mask drawn from shapes alone (nn.Dropout, "
                  "torch.rand_like(x) < p) splits", file=log)
