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
