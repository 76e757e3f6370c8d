"""Round trips on every example: text IR print -> parse -> print, plan -> JSON -> plan,
and plan -> raised IR == the IR that was lowered."""
import json

import pytest

from conftest import EXAMPLE_FILES, compile_example
from sbpc.compiler.ir.parser import parse_graph
from sbpc.compiler.ir.printer import print_graph
from sbpc.compiler.raise_plan import raise_plan
from sbpc.runtime.plan import Plan, load_plan, save_plan


@pytest.mark.parametrize("example", EXAMPLE_FILES)
def test_text_ir_round_trip(example):
    graph = compile_example(example)[0].graph
    text = print_graph(graph)
    assert print_graph(parse_graph(text)) == text
    assert parse_graph(text) == graph


@pytest.mark.parametrize("example", EXAMPLE_FILES)
def test_plan_json_round_trip(example, tmp_path):
    plan = compile_example(example)[0].plan
    assert Plan.model_validate_json(plan.model_dump_json()) == plan
    save_plan(plan, str(tmp_path / "p.json"))
    loaded = load_plan(str(tmp_path / "p.json"))
    assert loaded.digest == plan.content_digest() and loaded.model_copy(update={"digest": None}) == plan
    # the digest is of the content, not of the text: a pretty-printed plan still loads
    (tmp_path / "pretty.json").write_text(json.dumps(json.loads((tmp_path / "p.json").read_text()), indent=2))
    assert load_plan(str(tmp_path / "pretty.json")) == loaded


@pytest.mark.parametrize("example", EXAMPLE_FILES)
def test_raised_plan_is_the_lowered_ir(example):
    result = compile_example(example)[0]
    assert print_graph(raise_plan(result.plan)) == print_graph(result.graph)


def test_complex_arguments_round_trip_through_the_plan_json():
    """A complex scalar (``torch.polar``'s backward multiplies by 1j) is ``{"complex": [re, im]}``,
    each part Python's repr: exact, inf and nan included."""
    import math
    import struct

    from sbpc.compiler.lower import encode_arg
    from sbpc.compiler.raise_plan import decode_arg
    from sbpc.runtime.plan import Instruction

    zs = [1j, complex(-0.0, 0.1), complex(math.inf, -1e-300)]
    ins = Instruction(op="aten.mul.Scalar", args=[encode_arg(x) for x in [zs[0], zs]], role="fwd")
    back = [decode_arg(a) for a in Instruction.model_validate_json(ins.model_dump_json()).args]
    parts = lambda z: struct.pack("<dd", z.real, z.imag)
    assert parts(back[0]) == parts(zs[0]) and [parts(z) for z in back[1]] == [parts(z) for z in zs]
    assert json.loads(ins.model_dump_json())["args"][0] == {"complex": ["0.0", "1.0"]}
