"""The text IR: print -> parse -> print is the identity, and parse errors point at the input."""
import math
import re
import struct

import pytest

from filecheck import filecheck
from sbpc.compiler.ir.parser import parse_graph
from sbpc.compiler.ir.printer import print_graph
from sbpc.compiler.ir.types import (
    DTYPES, DType, Graph, GraphInput, GraphOutput, InputKind, Node, OutputKind, Ref, Role,
    SourceLoc, Sym, TensorType,
)
from sbpc.compiler.ir.mesh import Mesh
from sbpc.runtime.sbp import Broadcast, Partial, Split
from sbpc.errors import IRError

F32 = "f32"

# The example of the format, verbatim: it must parse and print back byte for byte.
SPEC = """\
graph @gpt mesh<dp=1> {
  input param %wte_weight : f32[256, 64] "wte.weight"
  input batch %batch_0 : i64[4, 32] "batch.0" {sbp=[S(0)]}
  input state %exp_avg_0 : f32[256, 64] "exp_avg:wte.weight"
  %view = aten.view.default(%x, [128, 64]) : f32[128, 64] {role=fwd, stage=0, sbp=[[B]], loc="h.0.attn" @ "examples/gpt.py":48}
  %a, %b, %c = aten.native_layer_norm.default(%x, [64], %w, None, 1e-05) : (f32[4, 64], f32[4, 1], f32[4, 1]) {role=fwd}
  %t = aten.arange.start(0, 16, dtype=i64, layout=#strided, device=#device, pin_memory=False) : i64[16] {role=fwd}
  %s = aten.sum.dim_IntList(%x, [0], True) : f32[1, 64] {role=bwd, loc="" @ "m.py":3}
  output loss %getitem_25 "loss"
  output grad %g0 "wte.weight"
  output update %p_new "wte.weight"
}
init {
  %i0 = aten.empty.memory_format([256, 64], dtype=f32, layout=#strided, device=#device, pin_memory=False) : f32[256, 64] {role=init}
  aten.normal_.default(%i0, 0.0, 0.02) {role=init}
  output init %i0 "wte.weight"
}
"""


def t(*shape, dtype=F32):
    return TensorType(tuple(shape), dtype)


def spec_graph() -> Graph:
    """SPEC, built by hand."""
    factory = {"dtype": DType("f32"), "layout": Sym("strided"), "device": Sym("device"), "pin_memory": False}
    return Graph(
        "gpt", Mesh((("dp", 1),)),
        inputs=[
            GraphInput(InputKind.PARAM, "wte_weight", t(256, 64), "wte.weight"),
            GraphInput(InputKind.BATCH, "batch_0", t(4, 32, dtype="i64"), "batch.0", (Split(0),)),
            GraphInput(InputKind.STATE, "exp_avg_0", t(256, 64), "exp_avg:wte.weight"),
        ],
        nodes=[
            Node(["view"], "aten.view.default", (Ref("x"), [128, 64]), {}, [t(128, 64)], Role.FORWARD,
                 SourceLoc("h.0.attn", "examples/gpt.py", 48), 0, [(Broadcast(),)]),
            Node(["a", "b", "c"], "aten.native_layer_norm.default", (Ref("x"), [64], Ref("w"), None, 1e-05), {},
                 [t(4, 64), t(4, 1), t(4, 1)], Role.FORWARD),
            Node(["t"], "aten.arange.start", (0, 16), {**factory, "dtype": DType("i64")}, [t(16, dtype="i64")],
                 Role.FORWARD),
            Node(["s"], "aten.sum.dim_IntList", (Ref("x"), [0], True), {}, [t(1, 64)], Role.BACKWARD,
                 SourceLoc("", "m.py", 3)),
        ],
        outputs=[
            GraphOutput(OutputKind.LOSS, "getitem_25", "loss"),
            GraphOutput(OutputKind.GRAD, "g0", "wte.weight"),
            GraphOutput(OutputKind.UPDATE, "p_new", "wte.weight"),
        ],
        init=[
            Node(["i0"], "aten.empty.memory_format", ([256, 64],), factory, [t(256, 64)], Role.INIT),
            Node([], "aten.normal_.default", (Ref("i0"), 0.0, 0.02), {}, [], Role.INIT),
        ],
        init_outputs=[GraphOutput(OutputKind.INIT, "i0", "wte.weight")],
    )


FLOATS = [0.0, -0.0, 1.0, -2.0, 0.1, 1e-05, 1e16, 1.5e300, 5e-324, -1.7976931348623157e308,
          math.inf, -math.inf, 123456789.125]


def wide_graph() -> Graph:
    """Every construct of the format that SPEC leaves out."""
    mesh = Mesh((("pp", 4), ("dp", 4), ("cp", 2), ("tp", 8)))
    odd = 'quote " backslash \\ tab \t newline \n unicode \u00e9 \U0001f600 // not a comment'
    return Graph(
        "wide_2", mesh,
        inputs=[
            GraphInput(InputKind.BUFFER, "buf", t(), odd, (Broadcast(), Partial("max"), Split(-1))),
            GraphInput(InputKind.PARAM, "w", t(8, 8, dtype="bf16"), "h.0.w", ()),
        ],
        nodes=[
            Node(["n0"], "aten.full.default", ([2, 3], -7), {"dtype": DType("f16")}, [t(2, 3, dtype="f16")],
                 Role.OPTIMIZER, stage=3, sbp=[(Split(1), Partial(), Broadcast())]),
            Node(["f"], "sbpc.floats", tuple(FLOATS), {"eps": 1.0, "neg": -0.0}, [t()], Role.FORWARD),
            Node(["cat"], "aten.cat.default", ([Ref("n0"), Ref("f")], -1), {}, [t(4, 3)], Role.BACKWARD,
                 SourceLoc(odd, "dir with space/f\"q\".py", 1), 0, [(Broadcast(), Broadcast(), Broadcast())]),
            Node(["x_1", "y"], "aten._scaled_dot_product_flash_attention_for_cpu.default",
                 ([], [[]], [[1, [2, []]], "s"], "", None, True, False, -9223372036854775808, 2**70),
                 {"scale": None, "name": "a\"b", "syms": [Sym("contiguous_format"), Sym("device")]},
                 [t(0, dtype="i8"), t(1, 1, 1, 1, 1, dtype="c64")], Role.FORWARD,
                 SourceLoc("h.1", "x.py", 99), 1, [(), ()]),
            Node([], "sbpc.barrier", (), {}, [], Role.OPTIMIZER, stage=2),
            Node([f"d_{d}" for d in DTYPES], "sbpc.dtypes", tuple(DType(d) for d in DTYPES), {},
                 [t(1, dtype=d) for d in DTYPES], Role.FORWARD),
            # keywords of the grammar are fine where it expects a name or a value
            Node(["init", "input"], "output.graph", (Ref("output"), Ref("True")), {"role": 1, "init": 2},
                 [t(1), t(2)], Role.INIT, sbp=[(Broadcast(),), (Split(0),)]),
            Node(["u"], "my_op.x", (Ref("init"),), {}, [t(1)], Role.FORWARD),
        ],
        outputs=[GraphOutput(kind, f"n{i}", kind.value) for i, kind in enumerate(OutputKind)],
    )


GRAPHS = {"spec": spec_graph, "wide": wide_graph,
          "empty": lambda: Graph("e", Mesh(())),
          "init_only": lambda: Graph("i", Mesh((("tp", 2),)), init_outputs=[GraphOutput(OutputKind.INIT, "p", "p")])}


def test_spec_text_round_trips_byte_for_byte():
    assert parse_graph(SPEC) == spec_graph()
    assert print_graph(spec_graph()) == SPEC


@pytest.mark.parametrize("name", GRAPHS)
def test_round_trip(name):
    graph = GRAPHS[name]()
    text = print_graph(graph)
    parsed = parse_graph(text)
    assert parsed == graph
    assert print_graph(parsed) == text


def test_wide_graph_prints_as_documented():
    text = print_graph(wide_graph())
    filecheck(text, r"""
        CHECK: graph @wide_2 mesh<pp=4, dp=4, cp=2, tp=8> {
        CHECK-NEXT: input buffer %buf : f32[] "quote \" backslash \\ tab \t newline \n unicode \u00e9 \ud83d\ude00 // not a comment" {sbp=[B, P(max), S(-1)]}
        CHECK-NEXT: input param %w : bf16[8, 8] "h.0.w" {sbp=[]}
        CHECK-NEXT: %n0 = aten.full.default([2, 3], -7, dtype=f16) : f16[2, 3] {role=opt, stage=3, sbp=[[S(1), P, B]]}
        CHECK-NEXT: %f = sbpc.floats(0.0, -0.0, 1.0, -2.0, 0.1, 1e-05, 1e+16, 1.5e+300, 5e-324, -1.7976931348623157e+308, inf, -inf, 123456789.125, eps=1.0, neg=-0.0) : f32[] {role=fwd}
        CHECK-NEXT: %cat = aten.cat.default([%n0, %f], -1)
        CHECK-SAME: {role=bwd, stage=0, sbp=[[B, B, B]], loc="quote
        CHECK-SAME: @ "dir with space/f\"q\".py":1}
        CHECK-NEXT: %x_1, %y = aten._scaled_dot_product_flash_attention_for_cpu.default([], [[]], [[1, [2, []]], "s"], "", None, True, False, -9223372036854775808, 1180591620717411303424, scale=None, name="a\"b", syms=[#contiguous_format, #device])
        CHECK-SAME: : (i8[0], c64[1, 1, 1, 1, 1]) {role=fwd, stage=1, sbp=[[], []], loc="h.1" @ "x.py":99}
        CHECK-NEXT: {{^  }}sbpc.barrier() {role=opt, stage=2}
        CHECK-NEXT: %d_f64, %d_f32, {{.*}} = sbpc.dtypes(f64, f32, {{.*}}, bool, c64
        CHECK-SAME: : (f64[1], f32[1], {{.*}}, bool[1], c64[1]
        CHECK-NEXT: %init, %input = output.graph(%output, %True, role=1, init=2) : (f32[1], f32[2]) {role=init, sbp=[[B], [S(0)]]}
        CHECK-NEXT: %u = my_op.x(%init) : f32[1] {role=fwd}
        CHECK-NEXT: output loss %n0 "loss"
        CHECK-NEXT: output grad %n1 "grad"
        CHECK-NEXT: output update %n2 "update"
        CHECK-NEXT: output init %n3 "init"
        CHECK-NEXT: output metric %n4 "metric"
        CHECK-NEXT: {{^}}}
        CHECK-NOT: init {
    """)


def test_init_region_only_when_present():
    filecheck(print_graph(GRAPHS["empty"]()), "CHECK: graph @e mesh<> {\nCHECK-NEXT: {{^}}}\nCHECK-NOT: init")
    filecheck(print_graph(GRAPHS["init_only"]()), "CHECK: {{^}}}\nCHECK-NEXT: {{^}}init {\nCHECK-NEXT: output init %p")


def test_floats_round_trip_bit_exactly():
    args = parse_graph(print_graph(wide_graph())).nodes[1].args
    assert [struct.pack("<d", a) for a in args] == [struct.pack("<d", f) for f in FLOATS]
    assert all(type(a) is float for a in args)  # 1.0 stays a float, never the int 1


def test_nan_round_trips():
    g = Graph("n", Mesh(()), nodes=[Node(["y"], "aten.fill.Scalar", (Ref("x"), math.nan), {"v": [math.nan]},
                                         [t(2)], Role.FORWARD)])
    text = print_graph(g)
    assert "aten.fill.Scalar(%x, nan, v=[nan])" in text
    node = parse_graph(text).nodes[0]
    assert math.isnan(node.args[1]) and math.isnan(node.kwargs["v"][0])
    assert print_graph(parse_graph(text)) == text


def test_complex_numbers_round_trip_bit_exactly():
    """A complex scalar (autograd's ``grad * 1j`` in ``torch.polar``'s backward) as ``complex(re, im)``."""
    zs = [1j, complex(-0.0, 2.5), complex(0.1, -1e-300), complex(math.inf, -math.inf)]
    g = Graph("c", Mesh(()), nodes=[Node(["y"], "aten.mul.Scalar", (Ref("x"), zs[0]), {"v": zs}, [t(2)], Role.FORWARD)])
    text = print_graph(g)
    assert "aten.mul.Scalar(%x, complex(0.0, 1.0), v=[complex(0.0, 1.0), complex(-0.0, 2.5)," in text
    node = parse_graph(text).nodes[0]
    parts = lambda z: struct.pack("<dd", z.real, z.imag)
    assert type(node.args[1]) is complex and [parts(z) for z in node.kwargs["v"]] == [parts(z) for z in zs]
    assert print_graph(parse_graph(text)) == text


def test_tuples_print_as_lists():
    g = Graph("tup", Mesh(()), nodes=[Node(["y"], "aten.view.default", (Ref("x"), (2, (3, 4))), {"k": ()},
                                           [t(2, 12)], Role.FORWARD)])
    text = print_graph(g)
    assert "aten.view.default(%x, [2, [3, 4]], k=[])" in text
    assert parse_graph(text).nodes[0].args == (Ref("x"), [2, [3, 4]])


def test_whitespace_and_comments_are_free():
    text = """// a comment before the graph
    graph@gpt   mesh < dp = 1 >{// after the brace
      input param%wte_weight:f32 [ 256 ,64 ]"wte.weight"
      input batch %batch_0 : i64[4, 32] "batch.0" { sbp = [ S( 0 ) ] }
      input state %exp_avg_0 : f32[256, 64]
          "exp_avg:wte.weight"
      %view=aten.view.default(%x,[128,64]):f32[128,64]{role=fwd,stage=0,sbp=[[B]],loc="h.0.attn"@"examples/gpt.py":48}
      %a,%b,%c=aten.native_layer_norm.default(%x,[64],%w,None,1e-05):(f32[4,64],f32[4,1],f32[4,1]){role=fwd}
      %t = aten.arange.start(0, 16, dtype = i64, layout = #strided, device = #device, pin_memory = False)
           : i64[16] { role = fwd }  // comments end at the line end
      %s = aten.sum.dim_IntList(%x, [0], True) : f32[1, 64] {role=bwd, loc="" @ "m.py":3}
      output loss %getitem_25 "loss" output grad %g0 "wte.weight"
      output update %p_new "wte.weight"
    } init { %i0 = aten.empty.memory_format([256, 64], dtype=f32, layout=#strided, device=#device,
      pin_memory=False) : f32[256, 64] {role=init} aten.normal_.default(%i0, 0.0, 0.02) {role=init}
      output init %i0 "wte.weight" }
    // trailing"""
    assert parse_graph(text) == spec_graph()


def test_undefined_value_is_not_a_parse_error():
    graph = parse_graph('graph @g mesh<> {\n  %y = aten.relu.default(%nowhere) : f32[1] {role=fwd}\n  output loss %z "loss"\n}\n')
    assert graph.nodes[0].args == (Ref("nowhere"),)


def parse_error(text: str, *patterns: str) -> IRError:
    with pytest.raises(IRError) as err:
        parse_graph(text, "model.ir")
    for p in patterns:
        text = f"{err.value.message}\n{err.value.detail}\nhint: {err.value.hint}"
        assert re.search(p, text, re.M), f"{p!r} not in:\n{text}"
    return err.value


def edit(old: str, new: str) -> str:
    assert old in SPEC
    return SPEC.replace(old, new, 1)


def test_error_unknown_dtype_in_type():
    parse_error(edit("f32[128, 64] {", "f33[128, 64] {"),
                r"^model\.ir:5:46: unknown dtype 'f33'$",
                r"^    +%view = aten\.view\.default\(%x, \[128, 64\]\) : f33\[128, 64\] \{role=fwd",
                r"^ {49}\^$",
                r"hint: dtypes: f64, f32, .*bf16")


def test_error_unknown_dtype_in_argument():
    parse_error(edit("dtype=i64", "dtype=i65"), r"^model\.ir:7:39: unknown dtype 'i65'$", r"^ {42}\^$",
                r"hint: dtypes:")


def test_error_bad_sbp_in_attrs():
    parse_error(edit("sbp=[[B]]", "sbp=[[S(x)]]"), r"^model\.ir:5:85: bad SBP 'S\(x\)'$",
                r"sbp=\[\[S\(x\)\]\]", r"^ {88}\^$", r"hint: write S\(dim\), S\(dim:blocks\), B, P or P\(max\)")
    parse_error(edit("sbp=[[B]]", "sbp=[[B, Q]]"), r"^model\.ir:5:88: bad SBP 'Q'$")
    parse_error(edit("{sbp=[S(0)]}", "{sbp=[P(min)]}"), r"^model\.ir:3:53: bad SBP 'P\(min\)'$")


def test_error_unterminated_list():
    parse_error(edit("[128, 64])", "[128, 64)"),
                r"^model\.ir:5:41: unexpected '\)', expected ',' or '\]'$",
                r"^ {44}\^$", r"hint: a list may be missing its closing '\]'")
    parse_error("graph @g mesh<> {\n  %y = aten.relu.default([1, 2\n",
                r"^model\.ir:2:31: unexpected end of input, expected ',' or '\]'$",
                r"^    +%y = aten\.relu\.default\(\[1, 2$", r"^ {34}\^$")


def test_error_unknown_role():
    parse_error(edit("role=bwd", "role=back"), r"^model\.ir:8:63: unknown role 'back'$",
                r"^ {66}\^$", r"hint: role is one of pre, fwd, bwd, opt, init")


def test_error_unknown_kinds():
    parse_error(edit("input state", "input stat"), r"^model\.ir:4:9: unknown input kind 'stat'$",
                r"hint: input kind is one of param, buffer, state, batch")
    parse_error(edit("output grad", "output grads"), r"^model\.ir:10:10: unknown output kind 'grads'$")


def test_error_unterminated_string():
    parse_error(edit('"loss"', '"loss'), r"^model\.ir:9:27: unexpected character '\"'$",
                r"hint: a string may be unterminated")


def test_error_attributes_out_of_order():
    parse_error(edit("role=fwd, stage=0", "stage=0, role=fwd"), r"^model\.ir:5:60: unexpected 'stage', expected 'role'$")


def test_error_result_and_type_counts_differ():
    parse_error(edit("%a, %b, %c =", "%a, %b ="),
                r"^model\.ir:6:12: aten\.native_layer_norm\.default has 2 results but 3 types$")


def test_error_bad_mesh():
    parse_error(edit("mesh<dp=1>", "mesh<dp=1, pp=2>"), r"^model\.ir:1:17: mesh axes out of rank order$")
    parse_error(edit("mesh<dp=1>", "mesh<xp=1>"), r"^model\.ir:1:17: unknown mesh axis 'xp'$")


def test_error_input_after_node():
    parse_error(edit('  output loss', '  input param %late : f32[1] "late"\n  output loss'),
                r"^model\.ir:9:3: unexpected 'input', expected ")


def test_error_empty_text_and_default_source():
    with pytest.raises(IRError, match=r"^<ir>:1:1: unexpected end of input, expected 'graph'"):
        parse_graph("")


def test_node_replace_is_dataclasses_replace_with_the_uses_it_reads():
    """Node.replace (the passes' fast copy) makes the node dataclasses.replace makes, and its
    uses follow new arguments while unchanged ones keep the cached tuple."""
    import dataclasses

    n = Node(["y"], "aten.add.Tensor", (Ref("a"), Ref("b")), {"alpha": 1}, [TensorType((2,), F32)], Role.FORWARD,
             why="hinted")
    uses = n.uses()
    same = n.replace(stage=3, sbp=[(Broadcast(),)])
    assert same == dataclasses.replace(n, stage=3, sbp=[(Broadcast(),)]) and same.why == "hinted"
    assert same.uses() is uses
    moved = n.replace(args=(Ref("c"),), kwargs={"out": [Ref("d")]})
    assert moved.uses() == ("c", "d") and n.uses() == ("a", "b")
    with pytest.raises(TypeError, match="no field '_uses'"):
        n.replace(_uses=None)
