"""In-place writes to tensors the forward made itself (and through views of them) become
out-of-place ops with the same values; writes to graph inputs, or through a view with no
inverse, stay in place (capture and the verifier refuse them)."""
import pytest
import torch

from sbpc.compiler.frontend.functionalize import functionalize
from sbpc.compiler.ir.aten import is_mutating
from sbpc.compiler.ir.parser import parse_graph
from sbpc.compiler.ir.printer import format_node
from sbpc.compiler.sbp.rules.validate import run_node

IR = """graph @f mesh<dp=1> {{
  input buffer %buf : f32[8] "buf"
  input batch %x : f32[8] "batch.0"
  input batch %ids : i64[4, 8] "batch.1"
{body}
  output loss %l "loss"
}}
"""


def run(body: str):
    g = parse_graph(IR.format(body=body))
    nodes, rename = functionalize(g.nodes, {i.value for i in g.inputs}, frozenset(["l"]))
    return g, nodes, rename


def lines(body: str):
    _, nodes, rename = run(body)
    return [format_node(n) for n in nodes], rename


def loss_both_ways(body: str):
    """The loss of the graph as written (eager, in place) and as rewritten, from the same inputs."""
    g, nodes, rename = run(body)
    gen = torch.Generator().manual_seed(0)
    inputs = {"buf": torch.randn(8, generator=gen), "x": torch.randn(8, generator=gen),
              "ids": torch.randint(-100, 100, (4, 8), generator=gen)}
    inputs["ids"][0, 3] = -100  # a value the masked fill replaces
    results = []
    for program, loss in ((g.nodes, "l"), (nodes, rename.get("l", "l"))):
        env = {k: v.clone() for k, v in inputs.items()}
        for n in program:
            run_node(n, env)
        results.append(env[loss])
    assert not any(is_mutating(n.op) for n in nodes), [format_node(n) for n in nodes]
    return results


def test_dropout_pattern_becomes_functional():
    out, rename = lines("""  %e = aten.empty_like.default(%x) : f32[8] {role=fwd}
  %b = aten.bernoulli_.float(%e, 0.9) : f32[8] {role=fwd}
  %d = aten.div_.Scalar(%e, 0.9) : f32[8] {role=fwd}
  %m = aten.mul.Tensor(%x, %e) : f32[8] {role=fwd}
  %l = aten.sum.default(%m) : f32[] {role=fwd}""")
    assert out[1].startswith("%b_f = aten.bernoulli.p(%e, 0.9)")
    assert out[2].startswith("%d_f = aten.div.Scalar(%b_f, 0.9)")
    assert out[3].startswith("%m = aten.mul.Tensor(%x, %d_f)")  # later uses see the final value


SHIFT_RIGHT = """  %z = aten.new_zeros.default(%ids, [4, 8], pin_memory=False) : i64[4, 8] {role=fwd}
  %s1 = aten.slice.Tensor(%ids, 1, 0, -1) : i64[4, 7] {role=fwd}
  %c = aten.clone.default(%s1) : i64[4, 7] {role=fwd}
  %s2 = aten.slice.Tensor(%z, 1, 1, 9223372036854775807) : i64[4, 7] {role=fwd}
  %cp = aten.copy_.default(%s2, %c) : i64[4, 7] {role=fwd}
  %sel = aten.select.int(%z, 1, 0) : i64[4] {role=fwd}
  %f = aten.fill_.Scalar(%sel, 5) : i64[4] {role=fwd}
  %eq = aten.eq.Scalar(%z, -100) : bool[4, 8] {role=fwd}
  %mf = aten.masked_fill_.Scalar(%z, %eq, 0) : i64[4, 8] {role=fwd}
  %zf = aten._to_copy.default(%z, dtype=f32) : f32[4, 8] {role=fwd}
  %l = aten.sum.default(%zf) : f32[] {role=fwd}"""


def test_t5_shift_right_writes_through_views_become_scatters():
    out, _ = lines(SHIFT_RIGHT)
    text = "\n".join(out)
    assert "%cp_f = aten.copy.default(%s2, %c)" in text
    assert "aten.slice_scatter.default(%z, %cp_f, 1, 1, 9223372036854775807, 1)" in text
    assert "aten.select_scatter.default(%s2_scatter, %f_f, 1, 0)" in text
    assert "%sel = aten.select.int(%s2_scatter, 1, 0)" in text  # the view of the written base
    eager, functional = loss_both_ways(SHIFT_RIGHT)
    assert torch.equal(eager, functional)


def test_a_view_read_after_its_base_is_written_is_made_again():
    body = """  %e = aten.mul.Tensor(%x, 2.0) : f32[8] {role=fwd}
  %v = aten.view.default(%e, [2, 4]) : f32[2, 4] {role=fwd}
  %t = aten.t.default(%v) : f32[4, 2] {role=fwd}
  %z = aten.add_.Tensor(%e, %buf) : f32[8] {role=fwd}
  %w = aten.mul.Tensor(%t, %t) : f32[4, 2] {role=fwd}
  %l = aten.sum.default(%w) : f32[] {role=fwd}"""
    out, _ = lines(body)
    assert any(o.startswith("%v_v1 = aten.view.default(%z_f, [2, 4])") for o in out)
    assert any(o.startswith("%t_v1 = aten.t.default(%v_v1)") for o in out)
    eager, functional = loss_both_ways(body)
    assert torch.equal(eager, functional)


@pytest.mark.parametrize("chain", [
    ["%v = aten.view.default(%e, [2, 4]) : f32[2, 4]", "%t = aten.t.default(%v) : f32[4, 2]",
     "%w = aten.mul_.Scalar(%t, 3.0) : f32[4, 2]"],  # through a transpose of a reshape
    ["%v = aten.view.default(%e, [2, 4]) : f32[2, 4]", "%t = aten.permute.default(%v, [1, 0]) : f32[4, 2]",
     "%w = aten.fill_.Scalar(%t, 1.5) : f32[4, 2]"],
    ["%v0, %v1 = aten.split.Tensor(%e, 5) : (f32[5], f32[3])", "%t = aten.unsqueeze.default(%v1, 0) : f32[1, 3]",
     "%w = aten.add_.Tensor(%t, 1.0) : f32[1, 3]"],
    ["%v = aten.view.default(%e, [2, 4]) : f32[2, 4]", "%t0, %t = aten.unbind.int(%v) : (f32[4], f32[4])",
     "%w = aten.neg_.default(%t) : f32[4]"],
    ["%v = aten.slice.Tensor(%e, 0, 2, 8, 2) : f32[3]", "%w = aten.mul_.Tensor(%v, %v) : f32[3]"],
], ids=["transpose", "permute", "split", "unbind", "strided-slice"])
def test_writes_through_view_chains_keep_eager_values(chain):
    body = "\n".join(f"  {line} {{role=fwd}}" for line in [
        "%e = aten.mul.Tensor(%x, 2.0) : f32[8]", *chain,
        "%s = aten.mul.Tensor(%e, %x) : f32[8]", "%l = aten.sum.default(%s) : f32[]"])
    eager, functional = loss_both_ways(body)
    assert torch.equal(eager, functional)


def test_writing_an_input_or_through_a_view_without_inverse_stays_in_place():
    out, _ = lines("""  %a = aten.add_.Tensor(%buf, %x) : f32[8] {role=fwd}
  %v = aten.slice.Tensor(%x, 0, 0, 4) : f32[4] {role=fwd}
  %b = aten.mul_.Scalar(%v, 2.0) : f32[4] {role=fwd}
  %e = aten.mul.Tensor(%x, 2.0) : f32[8] {role=fwd}
  %s = aten.as_strided.default(%e, [4], [2]) : f32[4] {role=fwd}
  %z = aten.zero_.default(%s) : f32[4] {role=fwd}
  %l = aten.sum.default(%e) : f32[] {role=fwd}""")
    assert out[0].startswith("%a = aten.add_.Tensor(%buf, %x)")  # a graph input
    assert out[2].startswith("%b = aten.mul_.Scalar(%v, 2.0)")  # a view of a graph input
    assert out[5].startswith("%z = aten.zero_.default(%s)")  # as_strided has no inverse here


def test_a_default_probability_the_trace_left_out_is_written_out():
    """F.dropout(p=0.5) draws with ``bernoulli_(0.5)``, which the trace records as
    ``bernoulli_.float(%e)`` (0.5 is its default); ``bernoulli.p`` has no default for p."""
    out, _ = lines("""  %e = aten.empty_like.default(%x) : f32[8] {role=fwd}
  %b = aten.bernoulli_.float(%e) : f32[8] {role=fwd}
  %m = aten.mul.Tensor(%x, %e) : f32[8] {role=fwd}
  %l = aten.sum.default(%m) : f32[] {role=fwd}""")
    assert out[1].startswith("%b_f = aten.bernoulli.p(%e, 0.5)")
