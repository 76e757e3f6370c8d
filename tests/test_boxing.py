"""Boxing, validated by execution: every SBP transition on real gloo ranks, and the boxing pass."""
from __future__ import annotations

import itertools

import pytest

from sbpc.compiler.sbp.boxing_plan import plan_boxing
from sbpc.compiler.ir.types import TensorType
from sbpc.errors import CompileError
from sbpc.runtime.launch import launch
from sbpc.runtime.sbp import Broadcast, Partial, Split

SOURCES = ["B", "P", "P(max)", "S(0)", "S(1)", "S(0:2)"]
TARGETS = ["B", "P", "S(0)", "S(1)", "S(0:2)"]


def _pairs(ndim_axes: int):
    srcs = list(itertools.product(SOURCES, repeat=ndim_axes))
    dsts = list(itertools.product(TARGETS, repeat=ndim_axes))
    return [(list(s), list(d)) for s in srcs for d in dsts if s != d]


@pytest.mark.parametrize("axes", [[("tp", 2)], [("tp", 4)], [("dp", 2), ("tp", 2)]], ids=["tp2", "tp4", "dp2xtp2"])
def test_every_transition_by_execution(axes):
    pairs = _pairs(len(axes))
    world = 1
    for _, k in axes:
        world *= k
    results = launch(world, "boxing_worker:run", {"axes": axes, "pairs": pairs, "shape": [8, 16]}, timeout=120)
    assert len(pairs) > 20
    assert results[0] == [], "\n".join(results[0][:10])


def test_design_table_collectives():
    t, k = TensorType((8, 16), "f32"), (2,)
    kinds = lambda a, b: [s.kind for s in plan_boxing((a,), (b,), t, k)]
    assert kinds(Partial(), Broadcast()) == ["all_reduce"]
    assert kinds(Partial(), Split(1)) == ["reduce_scatter"]
    assert kinds(Split(0), Broadcast()) == ["all_gather"]
    assert kinds(Split(0), Split(1)) == ["all_to_all"]
    assert kinds(Broadcast(), Split(0)) == ["shard_slice"]
    assert kinds(Broadcast(), Partial()) == ["keep_first"]
    assert kinds(Partial("max"), Broadcast()) == ["all_reduce"]
    assert plan_boxing((Partial("max"),), (Broadcast(),), t, k)[0].kwargs == (("reduce", "max"),)


def test_independent_axes_convert_in_one_step_each():
    t = TensorType((8, 16), "f32")
    steps = plan_boxing((Partial(), Split(1)), (Split(0), Broadcast()), t, (2, 2))
    assert [(s.axis, s.kind) for s in steps] == [(0, "reduce_scatter"), (1, "all_gather")]


def test_independent_axes_shrink_inside_out_and_grow_outside_in():
    """A gradient reduce-scattered over dp and tp crosses the outer (slow) axis at 1/tp of its
    size; a gather over both moves the small shard on the outer axis, the big one on the inner."""
    t = TensorType((8, 16), "f32")
    order = lambda src, dst, seq=frozenset(): [(s.axis, s.kind) for s in plan_boxing(src, dst, t, (2, 2), seq)]
    assert order((Partial(), Partial()), (Split(1), Split(0))) == [(1, "reduce_scatter"), (0, "reduce_scatter")]
    assert order((Split(1), Split(0)), (Broadcast(), Broadcast())) == [(0, "all_gather"), (1, "all_gather")]
    assert order((Partial(), Partial()), (Broadcast(), Split(0))) == [(1, "reduce_scatter"), (0, "all_reduce")]
    # the micro-batch axis accumulates first: the other reductions then run once a step
    assert order((Partial(), Partial()), (Broadcast(), Split(0)), frozenset({0})) == [(0, "all_reduce"),
                                                                                    (1, "reduce_scatter")]
    # sums and maxima do not commute: mesh order
    assert order((Partial("max"), Partial()), (Broadcast(), Split(0))) == [(0, "all_reduce"), (1, "reduce_scatter")]


def test_nested_splits_of_one_dim_gather_inside_out():
    t = TensorType((8, 16), "f32")
    steps = plan_boxing((Split(0), Split(0)), (Broadcast(), Split(0)), t, (2, 2))
    assert [(s.axis, s.kind) for s in steps] == [(1, "all_gather"), (0, "all_gather"), (1, "shard_slice")]


def test_no_boxing_into_partial_max():
    with pytest.raises(CompileError, match=r"no boxing converts B into P\(max\)"):
        plan_boxing((Broadcast(),), (Partial("max"),), TensorType((4,), "f32"), (2,))


def test_verifier_catches_a_missing_conversion():
    from sbpc.compiler.ir.parser import parse_graph
    from sbpc.compiler.ir.verify import verify_boxed
    from sbpc.errors import IRError

    graph = parse_graph("""graph @g mesh<dp=1, tp=2> {
      input param %w : f32[8, 4] "w" {sbp=[B, S(0)]}
      input batch %x : f32[2, 8] "batch.0" {sbp=[B, S(1)]}
      %y = aten.mm.default(%x, %w) : f32[2, 4] {role=fwd, sbp=[[B, P]], sbp_in=[[B, S(1)], [B, S(0)]]}
      %l = aten.sum.default(%y) : f32[] {role=fwd, sbp=[[B, B]], sbp_in=[[B, B]]}
      output loss %l "loss"
    }""")
    with pytest.raises(IRError, match=r"aten\.sum\.default needs %y as \[B, B\] but it is \[B, P\]: boxing is missing"):
        verify_boxed(graph)
