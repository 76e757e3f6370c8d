"""Parity: the plan against eager PyTorch, same seed, model and data (the product's promise),
verified step by step (docs/check.md); and the mutations a check must catch."""
import re

import pytest
import torch

from conftest import compile_example, drop_collective, input_gradient_all_reduce, sbpc
from sbpc.compiler.tools.check import check_on_ranks, run_check
from sbpc.compiler.tools.deviation import NOISE_RESOLUTION, deviation, grad_deviations, low_precision_noise, update_deviation
from sbpc.compiler.frontend.optim import OptimizerConfig
from sbpc.runtime.backend import make_backend
from sbpc.runtime.plan import RefArg
from sbpc.runtime.runner import Runner

TOL = 1e-5  # the default tolerance (the bar); on one device we measure 0.0


@pytest.mark.parametrize("example", ["gpt.py", "mlp.py", "hf_gpt2.py"])
def test_plan_matches_eager_adamw(example):
    result, source, optimizer = compile_example(example)
    runner = Runner(result.plan, make_backend("cpu"), seed=0)
    report = run_check(result.plan, source, runner, optimizer, steps=3, seed=0, tolerance=TOL)
    assert [r.step for r in report.rows] == ["init", "0", "1", "2"]
    assert report.passed, report.table()
    for row in report.rows[1:]:
        assert row.loss_plan == pytest.approx(row.loss_eager, rel=TOL)
        assert row.grads.value <= TOL and row.update.value <= TOL
    # every parameter was compared: the worst tensor is a real parameter name
    assert report.rows[-1].update.tensor in runner.params


def test_init_replay_is_bitwise_eager_init():
    result, source, optimizer = compile_example("gpt.py")
    runner = Runner(result.plan, make_backend("cpu"), seed=7)
    report = run_check(result.plan, source, runner, optimizer, steps=0, seed=7, tolerance=0.0)
    assert report.rows[0].step == "init" and report.rows[0].update.value == 0.0


def test_sgd_momentum_matches_eager():
    opt = OptimizerConfig(kind="sgd", lr=0.05, momentum=0.9, weight_decay=0.01)
    result, source, optimizer = compile_example("mlp.py", optimizer=opt)
    runner = Runner(result.plan, make_backend("cpu"), seed=1)
    report = run_check(result.plan, source, runner, optimizer, steps=3, seed=1, tolerance=TOL)
    assert report.passed, report.table()
    assert all(r.update.value == 0.0 for r in report.rows[1:]), report.table()  # the same float ops as torch
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


def test_frozen_parameter_is_loaded_and_compared_as_a_buffer():
    from sbpc.compiler.driver import compile_model
    from sbpc.compiler.ir.mesh import parse_mesh
    from sbpc.compiler.frontend.model_loader import load_model

    plan = compile_model(load_model("tests/models/frozen_param.py"), parse_mesh("2x1"), batch_size=4,
                         optimizer=OptimizerConfig()).plan
    assert [b.name for b in plan.buffers] == ["pos.weight"]
    report = check_on_ranks(plan, OptimizerConfig(), steps=2, seed=0, tolerance=TOL, ranks="threads")
    assert report.passed, report.table()


@pytest.mark.parametrize("mesh,m", [("1", 1), ("2x2", 1), ("1x1x2", 2)])
def test_parameter_without_gradient_stays_as_built(mesh, m):
    """A parameter the loss does not reach gets no gradient: torch's AdamW skips it (grad None),
    and the plan, which takes it as a buffer, leaves it as built too."""
    from sbpc.compiler.driver import compile_model
    from sbpc.compiler.ir.mesh import parse_mesh
    from sbpc.compiler.frontend.model_loader import load_model
    from sbpc.compiler.passes import PipelineOptions

    plan = compile_model(load_model("tests/models/unused_param.py"), parse_mesh(mesh).with_microbatches(m), batch_size=4,
                         optimizer=OptimizerConfig(), pipeline=PipelineOptions(microbatches=m)).plan
    frozen = ["pooler.weight", "pooler.bias", "unused_head.weight", "unused_head.bias"]
    assert sorted(b.name for b in plan.buffers) == sorted(frozen)
    assert not {p.name for p in plan.params} & set(frozen)
    report = check_on_ranks(plan, OptimizerConfig(), steps=2, seed=0, tolerance=TOL, ranks="threads")
    assert report.passed, report.table()


def test_group_norm_splits_the_micro_batches_of_a_pipeline():
    from sbpc.compiler.driver import compile_model
    from sbpc.compiler.ir.mesh import parse_mesh
    from sbpc.compiler.frontend.model_loader import load_model
    from sbpc.compiler.passes import PipelineOptions

    plan = compile_model(load_model("tests/models/unet_gn.py"), parse_mesh("2x1x2").with_microbatches(2), batch_size=8,
                         optimizer=OptimizerConfig(), pipeline=PipelineOptions(microbatches=2)).plan
    report = check_on_ranks(plan, OptimizerConfig(), steps=2, seed=0, tolerance=TOL, ranks="threads")
    assert report.passed, report.table()


def _corrupt(plan, pick, **update):
    """``plan`` with the first instruction ``pick`` accepts changed by ``update``."""
    program = plan.stages[0]
    idx = next(i for i, ins in enumerate(program.instructions) if pick(ins))
    instructions = list(program.instructions)
    instructions[idx] = instructions[idx].model_copy(update=update)
    return plan.model_copy(update={"stages": [program.model_copy(update={"instructions": instructions})]})


def _fails(report, kind: str) -> None:
    assert not report.passed
    assert report.table().splitlines()[-1].endswith("FAIL")
    assert f", {kind} " in report.worst[1], report.table()


def test_check_detects_a_wrong_plan():
    """A check that cannot fail proves nothing: corrupt one instruction and watch it fail."""
    result, source, optimizer = compile_example("mlp.py")
    broken = _corrupt(result.plan, lambda ins: ins.op == "aten.relu.default", op="aten.sigmoid.default")
    report = run_check(broken, source, Runner(broken, make_backend("cpu"), seed=0), optimizer, steps=1, seed=0,
                       tolerance=TOL)
    _fails(report, "grad")


def test_check_detects_a_wrong_optimizer_update():
    """beta1 of AdamW changed from 0.9 to 0.8 in the one fused AdamW call of every parameter's
    update: loss and gradients are right, the update is not."""
    result, source, optimizer = compile_example("mlp.py")
    fused = lambda ins: ins.op == "aten._fused_adamw_.default"
    ins = next(i for i in result.plan.stages[0].instructions if fused(i))
    broken = _corrupt(result.plan, fused, kwargs={**ins.kwargs, "beta1": 0.8})
    report = run_check(broken, source, Runner(broken, make_backend("cpu"), seed=0), optimizer, steps=1, seed=0,
                       tolerance=TOL)
    _fails(report, "update")
    assert report.rows[1].loss.value == 0.0 and report.rows[1].grads.value == 0.0


def test_gradient_deviation_judges_an_exactly_zero_gradient_on_the_step_scale():
    """A key bias under softmax has a gradient that is zero in exact arithmetic: its entries are
    rounding noise (~1e-10 of the step's largest gradient G), and two correct programs differ
    by all of it. On its own scale that is a deviation of 2; on GRAD_FLOOR * G it is noise.
    A real error of the same tensor, 1e-6 G, still fails."""
    torch.manual_seed(0)
    g = torch.full((64,), 0.1)  # G = 0.1
    noise = torch.randn(64) * 1e-11
    eager = {"w": g, "k_bias": noise}
    # measured: up to 2 * 3e-11 / (GRAD_FLOOR * G) ~ 7e-7, a margin of 15 below the tolerance
    assert max(grad_deviations({"w": g, "k_bias": -noise}, eager).values()) < TOL / 10
    assert grad_deviations({"w": g, "k_bias": noise + 1e-7}, eager)["k_bias"] > TOL
    assert grad_deviations({"w": g * (1 + 1e-4), "k_bias": noise}, eager)["w"] > TOL  # own scale for the rest


def test_gradient_deviation_allows_eagers_own_float32_error_and_no_more():
    """A tensor under a cancellation (a LayerNorm over two features) has a gradient that eager's
    float32 gets right only to n (measured against float64): two correct programs differ by a
    few n. It is judged on n / NOISE_RESOLUTION: 10 n passes, 100 n fails, and a tensor that
    eager resolves keeps its own scale."""
    g = torch.full((64,), 0.1)  # G = 0.1
    small = torch.full((64,), 1e-6)  # below GRAD_FLOOR * G: judged on 1e-4 without the noise term
    n = 1e-9
    eager = {"w": g, "small": small}
    noise = {"w": 1e-8, "small": n}
    assert grad_deviations({"w": g, "small": small + 10 * n}, eager)["small"] > TOL  # the floor alone fails it
    assert grad_deviations({"w": g, "small": small + 10 * n}, eager, noise)["small"] < TOL
    assert grad_deviations({"w": g, "small": small + 100 * n}, eager, noise)["small"] > TOL
    assert grad_deviations({"w": g * (1 + 1e-4), "small": small}, eager, noise)["w"] > TOL


def test_a_low_precision_loss_is_judged_at_least_on_the_dtypes_resolution():
    """Under bf16 a loss whose eager error happened to be tiny (or unmeasured) is judged on
    LOW_NOISE_FLOOR u of itself: 1e-3 of it (u/4, the reassociation of a correct plan is about
    u/40) passes, 1e-2 (2.6 u) fails; float32 keeps the measured noise alone."""
    loss, eager = torch.tensor(1.0), 1.0

    def dev(diff, dtype):
        n = low_precision_noise(1e-9, eager, dtype)
        return deviation(loss + diff, torch.tensor(eager), max(eager, n / NOISE_RESOLUTION))

    assert dev(1e-3, torch.bfloat16) < TOL < dev(1e-2, torch.bfloat16)
    assert dev(1e-4, torch.float16) < TOL < dev(2e-3, torch.float16)
    assert low_precision_noise(1e-9, eager, torch.float32) == 1e-9
    assert dev(1e-4, torch.float32) > TOL


def test_ill_conditioned_gradients_pass_on_a_correct_plan_and_a_wrong_one_fails():
    """A fuzz model with a LayerNorm over two features: the gradients of its first block are
    cancellation residue, 1e-5 of G, which float32 resolves to 1e-3 of themselves. The default
    check passes the correct plan and still fails one with a corrupted forward op."""
    from conftest import sbpc_check
    args = ["tests/fuzz_models.py", "--set", "seed=15", "--mesh", "2x1", "--allow-replicated", "--steps", "2"]
    r = sbpc_check(*args)
    assert r.returncode == 0 and re.search(r"largest deviation .*: PASS", r.stdout), r.stdout + r.stderr
    from sbpc.compiler.driver import compile_model
    from sbpc.compiler.frontend.model_loader import load_model
    from sbpc.compiler.ir.mesh import parse_mesh
    source, optimizer = load_model("tests/fuzz_models.py", {"seed": 15}), OptimizerConfig()
    plan = compile_model(source, parse_mesh("1"), batch_size=4, optimizer=optimizer).plan
    v_proj = lambda ins: ins.op == "aten.addmm.default" and ins.loc is not None and ins.loc.module == "blocks.0.attn.v"
    broken = _corrupt(plan, v_proj, kwargs={"beta": 2.0})  # the value bias counted twice
    report = run_check(broken, source, Runner(broken, make_backend("cpu"), seed=0), optimizer, steps=1, seed=0,
                       tolerance=TOL)
    _fails(report, "grad")


def test_an_ill_conditioned_loss_is_judged_on_eagers_own_error_and_a_wrong_one_fails():
    """A KL divergence of close distributions (about 1e-2, the residue of terms of about 2):
    float32 gets it right only to ~5e-6 of itself, so on its size alone a correct 2x1 plan read
    7e-6, at the edge of the tolerance. On eager's own float32 error it reads ~5e-7; a plan whose
    loss is off by 0.1% still fails, on the loss."""
    from sbpc.compiler.driver import compile_model
    from sbpc.compiler.frontend.model_loader import load_model
    from sbpc.compiler.ir.mesh import parse_mesh

    source, optimizer = load_model("tests/models/kl_distill.py", {}), OptimizerConfig()
    plan = compile_model(source, parse_mesh("2x1"), batch_size=4, optimizer=optimizer).plan
    report = check_on_ranks(plan, optimizer, steps=3, seed=0, tolerance=TOL, ranks="threads")
    assert report.passed and max(r.loss.value for r in report.rows[1:]) < 2e-6, report.table()
    one = compile_model(source, parse_mesh("1"), batch_size=4, optimizer=optimizer).plan
    batchmean = lambda ins: ins.op == "aten.div.Tensor" and ins.role == "fwd"  # the sum over the batch / 4
    div = next(i for i in one.stages[0].instructions if batchmean(i))
    broken = _corrupt(one, batchmean, args=[div.args[0], div.args[1] * 1.001])
    report = run_check(broken, source, Runner(broken, make_backend("cpu"), seed=0), optimizer, steps=1, seed=0,
                       tolerance=TOL)
    _fails(report, "loss")


def test_a_complex_tensor_is_compared_with_its_imaginary_part():
    """``.double()`` of a complex tensor drops its imaginary part: a plan wrong only there passed."""
    from sbpc.compiler.tools.deviation import deviation

    plan, eager = torch.tensor([1 + 1j, 2 - 1j]), torch.tensor([1 + 2j, 2 - 1j])
    assert deviation(plan, eager, 1.0) == 1.0
    assert update_deviation(plan, eager, eager - 0.5j) == 2.0  # a step of 0.5, all in the imaginary part


def test_update_deviation_is_relative_to_the_step():
    before = torch.ones(8)
    eager = before - 1e-3
    assert update_deviation(eager.clone(), eager, before) == 0.0
    # a 1% wrong step is 1e-5 of the parameter but 1e-2 of the step: it fails
    assert update_deviation(before - 1.01e-3, eager, before) > 1e-3


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


# ----- many ranks: one real gloo launch (15-45 s here), the rest as threads of this process

def test_default_check_passes_with_adamw_on_data_parallel():
    """The user's first check: defaults only (AdamW, tolerance 1e-5). The free-running
    comparison used to fail here (Adam amplifies the rounding noise of the key bias)."""
    r = sbpc("check", "examples/gpt.py", "--mesh", "2x1", timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "3 steps, adamw" in r.stdout and re.search(r"tolerance 1e-05: PASS$", r.stdout.strip()), r.stdout
    assert len(re.findall(r"^\s+\d\s", r.stdout, re.M)) == 3


def _ranks_plan(mesh: str, config: str | None = None, optimizer: OptimizerConfig = OptimizerConfig(), **kw):
    from sbpc.compiler.driver import compile_model
    from sbpc.compiler.frontend.hints import load_config
    from sbpc.compiler.frontend.model_loader import load_model
    from sbpc.compiler.ir.mesh import parse_mesh

    return compile_model(load_model("examples/gpt.py"), parse_mesh(mesh), batch_size=4, optimizer=optimizer,
                         config=load_config(config) if config else None, **kw).plan


def test_default_check_passes_on_a_pipeline_and_reports_the_free_running_curves():
    from sbpc.compiler.passes import PipelineOptions

    plan = _ranks_plan("1x1x2", pipeline=PipelineOptions(microbatches=2))
    assert plan.pipeline is not None
    report = check_on_ranks(plan, OptimizerConfig(), steps=2, seed=0, tolerance=TOL, free_running=True,
                            ranks="threads")
    assert report.passed, report.table()
    assert [r.step for r in report.rows] == ["init", "0", "1"]
    free = report.free
    assert free.losses_plan == [r.loss_plan for r in report.rows[1:]] and len(free.losses_eager) == 2
    assert "free-running (a report, not the verdict" in report.table()


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sgd_update_is_bitwise_torch_on_a_tp_mesh(momentum):
    """torch's SGD adds with alpha (one fused rounding: fma(d_p, -lr, p)); a plan that rounds
    lr * d_p first is one ulp of p off, which at lr 1e-3 is 2.5e-4 of the step: FAIL on a correct
    plan. Given the same gradients and state the update must agree bit for bit."""
    opt = OptimizerConfig(kind="sgd", lr=1e-3, weight_decay=0.01, momentum=momentum)
    plan = _ranks_plan("1x2", "examples/gpt.megatron.toml", optimizer=opt)
    report = check_on_ranks(plan, opt, steps=2, seed=0, tolerance=TOL, ranks="threads")
    assert report.passed, report.table()
    assert all(r.update.value == 0.0 for r in report.rows[1:]), report.table()
    assert report.rows[-1].loss_plan != report.rows[1].loss_plan  # training moved


def test_check_detects_a_dropped_all_reduce():
    """Megatron's classic bug: the backward all-reduce at a column-parallel input is lost, so
    each tp rank keeps its partial sum. The plan still runs; the check must say FAIL."""
    plan = _ranks_plan("1x2", "examples/gpt.megatron.toml")
    broken = drop_collective(plan, input_gradient_all_reduce(plan))
    report = check_on_ranks(broken, OptimizerConfig(), steps=1, seed=0, tolerance=TOL, ranks="threads")
    assert not report.passed and report.table().splitlines()[-1].endswith("FAIL")
    row = report.rows[1]
    assert row.grads.value > 0.1, report.table()  # rank 0's gradients lack the other rank's part
    # the gathers return rank 0's copy of a replicated parameter; the other rank updated its
    # copy with other gradients, and the check sees that as well
    assert row.update.tensor.endswith("across ranks") and row.update.value > 0.1, report.table()


def test_check_detects_a_stale_tied_weight_on_another_stage():
    """GPT-2 ties wte and lm_head: on 1x1x2 the last stage holds a copy of wte and takes its new
    value from the owner's update. A plan whose copy never updates is wrong from the first step;
    the check compares the stages' copies, so one step shows it."""
    from sbpc.compiler.driver import compile_model
    from sbpc.compiler.frontend.model_loader import load_model
    from sbpc.compiler.ir.mesh import parse_mesh
    from sbpc.compiler.passes import PipelineOptions

    plan = compile_model(load_model("examples/hf_gpt2.py"), parse_mesh("1x1x2"), batch_size=4,
                         optimizer=OptimizerConfig(), pipeline=PipelineOptions(microbatches=2)).plan
    (replica,) = plan.pipeline.replicas
    param = next(p for p in plan.params if p.name == replica.name)
    stale = replica.model_copy(update={"value": param.value})  # keeps the value it had
    broken = plan.model_copy(update={"pipeline": plan.pipeline.model_copy(update={"replicas": [stale]})})
    report = check_on_ranks(broken, OptimizerConfig(), steps=1, seed=0, tolerance=TOL, ranks="threads")
    assert not report.passed and report.table().splitlines()[-1].endswith("FAIL")
    assert report.worst[1] == f"step 0, update {replica.name} across ranks", report.table()
    assert report.rows[1].grads.value <= TOL  # the step itself was right


@pytest.mark.parametrize("a_shape,b_shape", [((16, 8), (4, 8, 4)), ((8, 16), (16, 4)), ((4, 4, 8), (8, 16))])
def test_the_float64_grouped_matmul_is_torchs_by_its_definition(a_shape, b_shape):
    """``torch._grouped_mm`` has no float64 CPU kernel; the check's float64 reference computes it
    per group (compiler/tools/float64_kernels.py): the rows of a 2-D left operand grouped, the
    inner dim of two 2-D operands, or the columns of a 2-D right operand. Equal to torch's in
    float32, and in float64 under the mode, where torch alone raises."""
    from sbpc.compiler.tools.float64_kernels import Float64Kernels, _grouped_mm

    torch.manual_seed(0)
    ends = torch.tensor([4, 4, 12, 16], dtype=torch.int32)  # an empty group included
    a, b = torch.randn(a_shape), torch.randn(b_shape)
    assert torch.equal(_grouped_mm(a, b, ends), torch._grouped_mm(a, b, offs=ends))
    with pytest.raises(RuntimeError):
        torch._grouped_mm(a.double(), b.double(), offs=ends)
    with Float64Kernels():
        wide = torch._grouped_mm(a.double(), b.double(), offs=ends)
    assert wide.dtype == torch.float64 and torch.allclose(wide.float(), _grouped_mm(a, b, ends), atol=1e-5)
