"""Parity: the plan against eager PyTorch, same seed, model and data (the product's promise)."""
import pytest

from conftest import compile_example
from sbpc.compiler.tools.check import run_check
from sbpc.compiler.frontend.optim import OptimizerConfig
from sbpc.runtime.backend import make_backend
from sbpc.runtime.plan import RefArg
from sbpc.runtime.runner import Runner

TOL = 1e-5  # max relative deviation, fp32 (the bar); on one device we measure 0.0


@pytest.mark.parametrize("example", ["gpt.py", "mlp.py", "hf_gpt2.py"])
def test_plan_matches_eager_adamw(example):
    result, source, optimizer = compile_example(example)
    runner = Runner(result.plan, make_backend("cpu"), seed=0)
    report = run_check(result.plan, source, runner, optimizer, steps=3, seed=0, tolerance=TOL)
    assert [r.step for r in report.rows] == ["init", "0", "1", "2"]
    assert report.passed, report.table()
    for row in report.rows[1:]:
        assert row.loss_plan == pytest.approx(row.loss_eager, rel=TOL)
        assert row.grads.value <= TOL and row.params.value <= TOL
    # every parameter was compared: the worst tensor is a real parameter name
    assert report.rows[-1].params.tensor in runner.params


def test_init_replay_is_bitwise_eager_init():
    result, source, optimizer = compile_example("gpt.py")
    runner = Runner(result.plan, make_backend("cpu"), seed=7)
    report = run_check(result.plan, source, runner, optimizer, steps=0, seed=7, tolerance=0.0)
    assert report.rows[0].step == "init" and report.rows[0].params.value == 0.0


def test_sgd_momentum_matches_eager():
    opt = OptimizerConfig(kind="sgd", lr=0.05, momentum=0.9, weight_decay=0.01)
    result, source, optimizer = compile_example("mlp.py", optimizer=opt)
    runner = Runner(result.plan, make_backend("cpu"), seed=1)
    report = run_check(result.plan, source, runner, optimizer, steps=3, seed=1, tolerance=TOL)
    assert report.passed, report.table()
    assert report.rows[-1].loss_plan != report.rows[1].loss_plan  # training moved


def test_computed_buffers_are_rebuilt_by_init_replay():
    from sbpc.compiler.driver import compile_model
    from sbpc.compiler.ir.mesh import parse_mesh
    from sbpc.compiler.frontend.model_loader import load_model

    source = load_model("tests/models/causal_buffer.py")
    opt = OptimizerConfig()
    result = compile_model(source, parse_mesh("1"), batch_size=2, optimizer=opt)
    assert {b.name for b in result.plan.buffers} == {"mask", "scale"}
    runner = Runner(result.plan, make_backend("cpu"), seed=3)
    report = run_check(result.plan, source, runner, opt, steps=2, seed=3, tolerance=TOL)
    assert report.passed, report.table()


def test_check_detects_a_wrong_plan():
    """A check that cannot fail proves nothing: corrupt one instruction and watch it fail."""
    result, source, optimizer = compile_example("mlp.py")
    plan = result.plan
    program = plan.stages[0]
    idx = next(i for i, ins in enumerate(program.instructions) if ins.op == "aten.relu.default")
    bad = program.instructions[idx].model_copy(update={"op": "aten.sigmoid.default"})
    instructions = list(program.instructions)
    instructions[idx] = bad
    broken = plan.model_copy(update={"stages": [program.model_copy(update={"instructions": instructions})]})
    runner = Runner(broken, make_backend("cpu"), seed=0)
    report = run_check(broken, source, runner, optimizer, steps=1, seed=0, tolerance=TOL)
    assert not report.passed
    assert "FAIL" in report.table()


def test_dropout_masks_match_eager():
    """CPU dropout is empty_like + bernoulli_ + div_: functionalized, seeded per step, exact."""
    result, source, optimizer = compile_example("gpt.py", sets={"dropout": 0.1})
    ops = {i.op for i in result.plan.stages[0].instructions}
    assert "aten.bernoulli.p" in ops and "aten.bernoulli_.float" not in ops
    runner = Runner(result.plan, make_backend("cpu"), seed=0)
    report = run_check(result.plan, source, runner, optimizer, steps=2, seed=0, tolerance=TOL)
    assert report.passed, report.table()
    no_dropout = compile_example("gpt.py")
    assert report.rows[1].loss_plan != pytest.approx(run_check(
        no_dropout[0].plan, no_dropout[1], Runner(no_dropout[0].plan, make_backend("cpu"), seed=0), no_dropout[2],
        steps=1, seed=0, tolerance=TOL).rows[1].loss_plan, abs=1e-6)  # dropout really is on


def test_hf_gpt2_with_sdpa_attention_and_an_explicit_mask():
    result, source, optimizer = compile_example("hf_gpt2.py", sets={"attn": "sdpa"})
    attn = [i for i in result.plan.stages[0].instructions if i.op == "sbpc.attention"]
    assert len(attn) == 2 and all(isinstance(i.kwargs["attn_mask"], RefArg) for i in attn)
    runner = Runner(result.plan, make_backend("cpu"), seed=0)
    report = run_check(result.plan, source, runner, optimizer, steps=2, seed=0, tolerance=TOL)
    assert report.passed, report.table()
