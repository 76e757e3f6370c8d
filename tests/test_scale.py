"""Compile-time scaling: decisions tied per layer class (layer_classes) on repeated layers.

SBP propagation decides the ops of repeated layers once per class, at a middle layer, and
copies the decision to every layer. This must give legal plans (every op's signature one of
its own candidates) and the per-layer choices the untied search makes. (The 1T compile on
6x8x64 that this exists for is in `make bench`, bench/compile_bench.py, not here.)
"""
from __future__ import annotations

import re
from collections import Counter

import pytest

from sbpc.compiler.frontend.capture import capture
from sbpc.compiler.sbp.cost_model import AlphaBeta
from sbpc.compiler.sbp.layer_classes import blank_layers, layer_classes
from sbpc.compiler.ir.mesh import parse_mesh
from sbpc.compiler.frontend.model_loader import load_model
from sbpc.compiler.frontend.optim import OptimizerConfig
from sbpc.compiler.pass_manager import CompileContext
from sbpc.compiler.passes import PipelineOptions, default_pipeline
from sbpc.compiler.passes.sbp_propagate import SbpPropagate
from sbpc.compiler.sbp.solver import Solver
from sbpc.compiler.sbp.layout import Layouts
from sbpc.compiler.sbp.rules import RuleBook

LAYERS = 6


@pytest.fixture(scope="module")
def graph():
    """gpt tiny with 6 layers on dp 2 x tp 2 x pp 2, 2 micro-batches: the graph sbp-propagate sees."""
    pipeline = PipelineOptions(microbatches=2)
    mesh = parse_mesh("2x2x2").with_microbatches(2)
    g = capture(load_model("examples/gpt.py", {"preset": "tiny", "layers": LAYERS}), mesh, 8, OptimizerConfig(), None)
    ctx = CompileContext(verify=False)
    for p in default_pipeline(pipeline):
        if p.name == SbpPropagate.name:
            return g
        g = p.apply(g, ctx)


@pytest.fixture(scope="module")
def solved(graph):
    ctx = CompileContext(verify=False)
    return SbpPropagate(tie_layers=None).apply(graph, ctx), SbpPropagate().apply(graph, ctx)


def _layer(n) -> int | None:
    layer = blank_layers(n.loc.module if n.loc else "")[1]
    return layer[0] if layer else None


def test_layer_classes(graph):
    classes = layer_classes(graph, min_members=4)
    assert classes.members and all(len(m) == LAYERS for m in classes.members.values())
    # the representative is in a middle layer, so that its neighbours are layers too
    # (autograd's sums of residual gradients have no module: None)
    assert {_layer(graph.nodes[r]) for r in classes.members} - {None} == {LAYERS // 2}
    # forward, backward and optimizer ops of the layers are tied, and so is autograd's sum of
    # the residual's gradients, which has no module
    tied = [graph.nodes[i] for r, ms in classes.members.items() for i in ms]
    assert {n.role.value for n in tied} == {"fwd", "bwd", "opt"}
    assert any(n.op == "aten.add.Tensor" and not n.loc.module for n in tied)
    # most of the graph follows a representative; the rest (embedding, head, loss) is its own
    per_layer = len(tied) // LAYERS
    assert classes.tied == len(tied) - len(classes.members) and per_layer > 100
    assert len(classes.active()) < len(graph.nodes) // 3
    # every member has its class's op and types
    for r, ms in classes.members.items():
        assert len({(graph.nodes[i].op, tuple(graph.nodes[i].types)) for i in ms}) == 1


def test_tied_choices_are_legal_candidates(graph, solved):
    _, tied = solved
    sizes = tuple(graph.mesh.size(a) for a in graph.mesh.sbp_axes)
    lay = Layouts(graph, RuleBook.load(strided_parts=()), sizes)
    for i, n in enumerate(tied.nodes):
        cands = {(c.ins, c.outs) for c in lay.candidates(i)}
        # or the combination of one-axis choices that the joint search may add (_add_combined)
        assert (tuple(n.sbp_in), tuple(n.sbp)) in cands or _combines(n, lay, i), (i, n.op, n.loc)


def _combines(n, lay, i) -> bool:
    """The signature is, axis by axis, one of the node's 1-D signatures."""
    for a, k in enumerate(lay.sizes):
        ones = {(tuple(s.ins), tuple(s.outs)) for x in lay.per_size[k][i] for s in lay.with_strides(lay.graph.nodes[i], x)}
        if (tuple(nd[a] for nd in n.sbp_in), tuple(nd[a] for nd in n.sbp)) not in ones:
            return False
    return True


def test_tied_solve_matches_untied(graph, solved):
    untied, tied = solved
    diff = [i for i, (a, b) in enumerate(zip(untied.nodes, tied.nodes)) if (a.sbp, a.sbp_in) != (b.sbp, b.sbp_in)]
    # every layer makes the choices of the untied search (at most a few ops of a boundary layer differ)
    per_layer = Counter(_layer(tied.nodes[i]) for i in diff)
    assert all(per_layer[layer] == 0 for layer in range(1, LAYERS - 1)), per_layer
    # within a class, every layer makes one choice
    classes = layer_classes(graph, min_members=4)
    for r, ms in classes.members.items():
        assert len({(repr(tied.nodes[i].sbp), repr(tied.nodes[i].sbp_in)) for i in ms}) == 1
    # and the estimated cost of the plan is the untied one's, to a fraction of a percent
    assert _cost(graph, tied) <= _cost(graph, untied) * 1.005
    assert all(re.search(r"layer class of \d+ ops", tied.nodes[i].why or "") for r in classes.members for i in classes.members[r])


def _cost(graph, solved) -> float:
    """The cost model's total for the signatures of ``solved`` (compute plus every conversion)."""
    sizes = tuple(graph.mesh.size(a) for a in graph.mesh.sbp_axes)
    solver = Solver(graph, Layouts(graph, RuleBook.load(strided_parts=()), sizes), sizes, AlphaBeta())
    solver.fix_inputs()
    s = solver.state
    for i, n in enumerate(solved.nodes):
        sig = (tuple(n.sbp_in), tuple(n.sbp))
        ci = next((ci for ci, c in enumerate(s.cands[i]) if (c.ins, c.outs) == sig), None)
        if ci is None:
            s.cands[i].append(type(s.cands[i][0])(sig[0], sig[1], s.cands[i][0].notes))
            ci = len(s.cands[i]) - 1
        s.choose(i, ci)
    return s.cost_of(list(range(len(graph.nodes))), set(s.sbp) | set(s.req))


def _odd_members(layers: int) -> int:
    """How many members of a layer class the solver must price on their own (``Solver._weigh``)
    for gpt tiny with ``layers`` layers on pp 4 (Adam: bias corrections copied per chunk)."""
    mesh = parse_mesh("1x1x4").with_microbatches(4)
    g = capture(load_model("examples/gpt.py", {"preset": "tiny", "layers": layers}), mesh, 8, OptimizerConfig(), None)
    ctx = CompileContext(verify=False)
    for p in default_pipeline(PipelineOptions(microbatches=4)):
        if p.name == SbpPropagate.name:
            break
        g = p.apply(g, ctx)
    sizes = tuple(g.mesh.size(a) for a in g.mesh.sbp_axes)
    solver = Solver(g, Layouts(g, RuleBook.load(strided_parts=()), sizes), sizes, AlphaBeta(), layer_classes(g, 4))
    solver.fix_inputs()
    return sum(len(odd) for _, odd in solver.state.weight.values())


def test_per_chunk_copies_keep_pricing_independent_of_depth():
    """Each pipeline chunk computes its own copy of Adam's bias corrections (per_chunk_hyper_ops).
    Were the copies not a class, every layer's update would read a value no other layer reads
    and be priced alone: the search's work would grow with the depth (the 1T's sbp-propagate
    took 34 s, 11 s with the class)."""
    assert _odd_members(8) == _odd_members(16)
