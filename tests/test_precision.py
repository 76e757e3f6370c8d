"""Mixed precision (docs/precision.md): the forward captured under torch.autocast, fp32 master
weights, optimizer state and gradients; fp16's dynamic loss scaling as graph ops; `sbpc check`
against eager under autocast (and torch.amp.GradScaler), and the wrong plans it must catch."""
import re

import pytest

from conftest import collective_op, drop_collective, input_gradient_all_reduce, input_ref, sbpc, sbpc_check
from sbpc.compiler.driver import compile_model
from sbpc.compiler.frontend.hints import load_config
from sbpc.compiler.frontend.model_loader import load_model
from sbpc.compiler.frontend.optim import OptimizerConfig
from sbpc.compiler.ir.mesh import parse_mesh
from sbpc.compiler.memory_options import MemoryOptions
from sbpc.compiler.tools.check import check_on_ranks, run_check
from sbpc.runtime.backend import make_backend
from sbpc.runtime.kinds import Precision
from sbpc.runtime.runner import Runner

TOL = 1e-5  # the default tolerance, unchanged under autocast (docs/check.md)
OVERFLOW = "tests/models/fp16_overflow.py"


def _plan(model: str, mesh: str, precision: str, config: str | None = None, batch_size: int = 4):
    return compile_model(load_model(model), parse_mesh(mesh), batch_size=batch_size, optimizer=OptimizerConfig(),
                         config=load_config(config) if config else None,
                         memory=MemoryOptions(precision=Precision(precision))).plan


def _corrupt(plan, pick, **update):
    """``plan`` with the first instruction ``pick`` accepts (in any stage) changed by ``update``."""
    stages = list(plan.stages)
    for s, program in enumerate(stages):
        for i, ins in enumerate(program.instructions):
            if pick(ins):
                instructions = list(program.instructions)
                instructions[i] = ins.model_copy(update=update)
                stages[s] = program.model_copy(update={"instructions": instructions})
                return plan.model_copy(update={"stages": stages})
    raise AssertionError("no instruction to corrupt")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_one_device_is_bitwise_eager_under_autocast(precision):
    """The plan is torch's autocast graph: on one device loss, gradients and update are eager's
    to the bit (eager under torch.autocast, fp16 with torch.amp.GradScaler)."""
    plan = _plan("examples/gpt.py", "1", precision)
    report = run_check(plan, load_model("examples/gpt.py"), Runner(plan, make_backend("cpu"), seed=0),
                       OptimizerConfig(), steps=2, seed=0, tolerance=0.0)
    assert report.passed, report.table()
    assert report.rows[-1].loss_plan != report.rows[1].loss_plan  # training moved


def test_master_weights_gradients_and_state_stay_fp32_and_the_matmuls_run_low():
    plan = _plan("examples/gpt.py", "1x2", "bf16", "examples/gpt.megatron.toml")
    assert {p.dtype for p in plan.params} == {"float32"}
    assert {s.dtype for s in plan.states if s.name.startswith("exp_avg")} == {"float32"}
    types = {o: t for ins in plan.stages[0].instructions for o, t in zip(ins.outs, ins.types)}
    assert {types[p.grad].dtype for p in plan.params} == {"f32"}
    assert types[plan.stages[0].loss].dtype == "f32"  # autocast computes the cross-entropy in fp32
    ops = plan.stages[0].instructions
    assert {i.types[0].dtype for i in ops if i.op in ("aten.mm.default", "aten.addmm.default")} == {"bf16"}
    # Megatron's tp all-reduces (2 per layer forward, examples/gpt.py has 2 layers) move bf16
    # the layers' forward all-reduces run in bf16; the vocab-parallel loss's own (reduced in the
    # step, boxing) in fp32
    partial_loss = plan.stages[0].loss.removesuffix("_all_reduce")
    fwd = [(types[input_ref(i)].dtype, input_ref(i) == partial_loss) for i in ops
           if collective_op(i) == "sbpc.all_reduce" and i.role == "fwd"]
    assert sorted(fwd) == [("bf16", False)] * 4 + [("f32", True)], fwd


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_parity_with_eager_autocast_on_dp_and_pipeline(precision):
    """The acceptance: 2x1x2 (dp 2, pp 2, two micro-batches), in-process ranks, 2 steps."""
    r = sbpc_check("examples/gpt.py", "--mesh", "2x1x2", "--precision", precision, "--steps", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"tolerance 1e-05: PASS$", r.stdout.strip()), r.stdout
    if precision == "fp16":
        assert "fp16 loss scaling: 0 of 2 steps skipped" in r.stdout, r.stdout


@pytest.mark.parametrize("mesh,precision,zero", [("1x1x2", "fp16", "0"), ("2x1x2", "bf16", "3"), ("2x1x2", "fp16", "2")])
def test_stage_hints_and_zero_under_autocast(mesh, precision, zero):
    """[stages] hints and a half precision: the backward's own copy of a weight's cast (zero.py)
    took its forward op's hinted chunk, and the IR verifier refused the graph as half partitioned.
    ZeRO-2 under fp16 with micro-batches: the per-micro-batch pin went on the once-a-step unscaled
    gradient instead of the backward's ("keep_first runs once a step ...")."""
    r = sbpc_check("examples/gpt.py", "--mesh", mesh, "--config", "examples/gpt.pp.toml", "--precision", precision,
                   "--zero", zero, "--steps", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"tolerance 1e-05: PASS$", r.stdout.strip()), r.stdout


def test_an_unluckily_small_eager_error_does_not_fail_a_correct_plan():
    """Eager's bf16 loss at the first step of this model came within 5.9e-7 of float64 (u/8000;
    7.3e-4 at the next step), and the correct 2x1x2 plan, 1.2e-4 away, read 6.2e-5 (FAIL) on that
    scale. The noise is floored at LOW_NOISE_FLOOR u of the loss (deviation.low_precision_noise)."""
    r = sbpc_check("tests/models/stop_gradient.py", "--mesh", "2x1x2", "--precision", "bf16", "--steps", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"tolerance 1e-05: PASS$", r.stdout.strip()), r.stdout
    plan, eager = map(float, re.search(r"^ +0 +([0-9.]+) +([0-9.]+) ", r.stdout, re.M).groups())
    assert 1e-5 < abs(plan - eager) < 1e-3, r.stdout  # bf16's reassociation, far above eager's lucky draw


def test_a_dropped_tp_all_reduce_fails_under_bf16():
    """The tolerance grows with bf16's own error, yet Megatron's classic bug still fails: each
    tp rank keeps its partial backward sum."""
    plan = _plan("examples/gpt.py", "1x2", "bf16", "examples/gpt.megatron.toml")
    ops = plan.stages[0].instructions
    # the last one in the backward: layer 0's attention input (Megatron's f), present in every tp
    # plan of this model whatever the planner does with the lm_head
    target = [i for i in ops if input_gradient_all_reduce(plan)(i)][-1]
    types = {o: t for ins in ops for o, t in zip(ins.outs, ins.types)}
    assert types[input_ref(target)].dtype == "bf16"
    broken = drop_collective(plan, lambda i: i is target)
    report = check_on_ranks(broken, OptimizerConfig(), steps=1, seed=0, tolerance=TOL, ranks="threads")
    assert not report.passed and report.table().splitlines()[-1].endswith("FAIL")
    # the gradients alone fail (4.9e-5 measured: the attention branch's share of layer 0's input
    # gradient is small at initialisation, yet 5 times the tolerance), and the tp ranks' copies of
    # the parameters diverge
    assert report.rows[1].grads.value > 3 * TOL, report.table()
    assert report.rows[1].update.tensor.endswith("across ranks") and report.rows[1].update.value > 0.1


def test_fp16_overflow_skips_the_step_counts_it_and_halves_the_scale():
    """At GradScaler's first scale, 2**16, the model's fp16 gradients overflow: the plan keeps
    every parameter and state, counts the skip and halves the scale; then it trains."""
    plan = _plan(OVERFLOW, "2", "fp16")
    report = check_on_ranks(plan, OptimizerConfig(), steps=3, seed=0, tolerance=TOL, ranks="threads")
    assert report.passed, report.table()
    assert report.skipped_steps == 1 and report.loss_scale == 2.0**15, report.table()
    loss = [r.loss_plan for r in report.rows[1:]]
    assert loss[0] == loss[1] != loss[2], report.table()  # step 0 changed nothing
    assert "fp16 loss scaling: 1 of 3 steps skipped (gradients overflowed), plan and eager alike; scale now 32768" \
        in report.table()


def test_free_running_eager_steps_through_its_own_grad_scaler():
    """--free-running under fp16: the free eager trajectory steps and updates its own GradScaler
    (it unscaled in backward; a bare optimizer step left GradScaler unscaled-but-not-updated and
    the next step's unscale_ raised). On one device it skips the overflowing step as the plan does
    and ends on the plan's parameters bit for bit."""
    plan = _plan(OVERFLOW, "1", "fp16")
    report = run_check(plan, load_model(OVERFLOW), Runner(plan, make_backend("cpu"), seed=0), OptimizerConfig(),
                       steps=3, seed=0, tolerance=TOL, free_running=True)
    assert report.passed and report.skipped_steps == 1, report.table()
    assert report.free.losses_eager == report.free.losses_plan and report.free.params.value == 0, report.table()


def test_sbpc_run_reports_the_skipped_steps(tmp_path):
    out = tmp_path / "plan.json"
    r = sbpc("compile", OVERFLOW, "--precision", "fp16", "-o", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    r = sbpc("run", str(out), "--steps", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "fp16 loss scaling: 1 of 2 steps skipped (gradients overflowed); loss scale 32768" in r.stdout, r.stdout


def test_a_plan_that_ignores_the_overflow_fails():
    """The skip is part of the plan: a plan that updates from overflowed gradients anyway (its
    skip test never true) fails the check in that step."""
    plan = _plan(OVERFLOW, "1", "fp16")
    skip = lambda i: i.op == "aten.gt.Scalar" and i.role == "opt" and i.outs[0].startswith("skip_")
    ins = next(i for i in plan.stages[0].instructions if skip(i))
    broken = _corrupt(plan, skip, args=[ins.args[0], 2**40])
    report = run_check(broken, load_model(OVERFLOW), Runner(broken, make_backend("cpu"), seed=0), OptimizerConfig(),
                       steps=1, seed=0, tolerance=TOL)
    assert not report.passed and ", update " in report.worst[1], report.table()
