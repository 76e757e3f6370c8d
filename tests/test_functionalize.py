"""In-place ops on private temporaries become out-of-place; anything observable stays."""
from sbpc.compiler.frontend.functionalize import functionalize
from sbpc.compiler.ir.parser import parse_graph
from sbpc.compiler.ir.printer import format_node

IR = """graph @f mesh<dp=1> {{
  input buffer %buf : f32[8] "buf"
  input batch %x : f32[8] "batch.0"
{body}
  output loss %l "loss"
}}
"""


def run(body: str):
    g = parse_graph(IR.format(body=body))
    nodes, rename = functionalize(g.nodes, {i.value for i in g.inputs})
    return [format_node(n) for n in nodes], rename


def test_dropout_pattern_becomes_functional():
    lines, rename = run("""  %e = aten.empty_like.default(%x) : f32[8] {role=fwd}
  %b = aten.bernoulli_.float(%e, 0.9) : f32[8] {role=fwd}
  %d = aten.div_.Scalar(%e, 0.9) : f32[8] {role=fwd}
  %m = aten.mul.Tensor(%x, %e) : f32[8] {role=fwd}
  %l = aten.sum.default(%m) : f32[] {role=fwd}""")
    assert lines[1].startswith("%b_f = aten.bernoulli.p(%e, 0.9)")
    assert lines[2].startswith("%d_f = aten.div.Scalar(%b_f, 0.9)")
    assert lines[3].startswith("%m = aten.mul.Tensor(%x, %d_f)")  # later uses see the final value
    assert rename["e"] == "d_f"


def test_mutating_an_input_or_a_viewed_tensor_stays_in_place():
    lines, _ = run("""  %a = aten.add_.Tensor(%buf, %x) : f32[8] {role=fwd}
  %e = aten.empty_like.default(%x) : f32[8] {role=fwd}
  %v = aten.view.default(%e, [2, 4]) : f32[2, 4] {role=fwd}
  %z = aten.zero_.default(%e) : f32[8] {role=fwd}
  %l = aten.sum.default(%v) : f32[] {role=fwd}""")
    assert lines[0].startswith("%a = aten.add_.Tensor(%buf, %x)")
    assert lines[3].startswith("%z = aten.zero_.default(%e)")  # %v would observe it
