"""The optimizer step's per-step input, the learning rate (``Plan.hyper``, ``Runner.step(lr=)``):
each step's update is torch.optim's with ``param_groups[i]["lr"]`` set to that step's value, on
every layout (``sbpc check --lr-schedule``)."""
import pytest
import torch

from conftest import compile_example
from sbpc.compiler.driver import compile_model
from sbpc.compiler.frontend.model_loader import load_model
from sbpc.compiler.frontend.optim import OptimizerConfig
from sbpc.compiler.ir.mesh import parse_mesh
from sbpc.compiler.memory_options import MemoryOptions
from sbpc.compiler.passes import PipelineOptions
from sbpc.compiler.tools.check import check_on_ranks, run_check
from sbpc.errors import RuntimeFailure
from sbpc.runtime.backend import make_backend
from sbpc.runtime.runner import BatchSource, Runner

TOL = 1e-5
# warmup, a peak, a decay to 0 and back: every step another lr, one of them 0
SCHEDULE = (2e-4, 3e-2, 0.0, 5e-3)


@pytest.mark.parametrize("optimizer", [OptimizerConfig(), OptimizerConfig(kind="sgd", lr=0.05, momentum=0.9)],
                         ids=["adamw-fused", "sgd-momentum"])
def test_each_step_is_torch_optim_at_that_steps_lr(optimizer):
    """On one device the plan's update is torch's own arithmetic (fused AdamW: the same kernel;
    SGD: the same float ops): 0 at every lr. A plan that kept the compiled lr would be off by
    the whole step from step 1 on."""
    result, source, _ = compile_example("mlp.py", optimizer=optimizer)
    plan = result.plan
    assert plan.optimizer.fused == (optimizer.kind == "adamw")
    report = run_check(plan, source, Runner(plan, make_backend("cpu"), seed=0), optimizer, steps=4, seed=0,
                       tolerance=TOL, lrs=SCHEDULE)
    assert report.passed, report.table()
    assert all(r.update.value == 0.0 for r in report.rows[1:]), report.table()
    plain = run_check(plan, source, Runner(plan, make_backend("cpu"), seed=0), optimizer, steps=4, seed=0,
                      tolerance=TOL)
    assert [r.loss_plan for r in report.rows[2:]] != [r.loss_plan for r in plain.rows[2:]]  # the lr took effect


def test_no_lr_is_the_compiled_lr_and_another_lr_changes_the_step():
    result, _, _ = compile_example("gpt.py")
    plan = result.plan
    batch = BatchSource(plan, 0)(0)
    after = []
    for lr in (None, plan.optimizer.lr, 10 * plan.optimizer.lr):
        runner = Runner(plan, make_backend("cpu"), seed=0)
        runner.step(batch, lr=lr)
        after.append(runner.params)
    same = lambda a, b: all(torch.equal(a[n], b[n]) for n in a)
    assert same(after[0], after[1]) and not same(after[0], after[2])


@pytest.mark.parametrize("lr", [float("nan"), -1e-3, "1e-3"])
def test_a_learning_rate_that_is_not_one_is_refused(lr):
    result, _, _ = compile_example("mlp.py")
    runner = Runner(result.plan, make_backend("cpu"), seed=0)
    with pytest.raises(RuntimeFailure, match="is not a finite number >= 0"):
        runner.step(BatchSource(result.plan, 0)(0), lr=lr)


LAYOUTS = {
    "2x1-zero3": dict(mesh="2x1", memory=MemoryOptions(zero=3)),
    "1x1x2-1f1b": dict(mesh="1x1x2", pipeline=PipelineOptions(microbatches=2)),
    "1-offload": dict(mesh="1", memory=MemoryOptions(offload="optimizer")),
    "2x1-fp16-zero1": dict(mesh="2x1", memory=MemoryOptions(zero=1, precision="fp16")),
}


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_lr_schedule_parity_on_every_kind_of_plan(layout):
    """ZeRO-3's sharded update, a pipeline's per-stage updates, the host's update (offload) and
    fp16's skip-or-step all read the step's lr."""
    kw = dict(LAYOUTS[layout])
    mesh = parse_mesh(kw.pop("mesh"))
    optimizer = OptimizerConfig()
    plan = compile_model(load_model("examples/gpt.py"), mesh, batch_size=4, optimizer=optimizer, **kw).plan
    assert [h.name for h in plan.hyper] == ["lr"]
    report = check_on_ranks(plan, optimizer, steps=3, seed=0, tolerance=TOL, ranks="threads", lrs=SCHEDULE)
    assert report.passed, report.table()


# ----- gradient clipping by the global norm (--clip-grad)

CLIP = 0.05  # gpt.py's gradients have a norm near 1.6: every step is clipped (coefficient about 0.03)
CLIPPED = {
    "1": dict(mesh="1"),
    "2x1": dict(mesh="2x1"),
    "1x2-megatron": dict(mesh="1x2", config="examples/gpt.megatron.toml"),
    "2x1x2": dict(mesh="2x1x2", pipeline=PipelineOptions(microbatches=2)),
    "2x1-zero1": dict(mesh="2x1", memory=MemoryOptions(zero=1)),
    "2x1-zero3": dict(mesh="2x1", memory=MemoryOptions(zero=3)),
}


def _plan(layout: dict, optimizer: OptimizerConfig):
    from sbpc.compiler.frontend.hints import load_config

    kw = dict(layout)
    mesh, config = parse_mesh(kw.pop("mesh")), kw.pop("config", None)
    return compile_model(load_model("examples/gpt.py"), mesh, batch_size=4, optimizer=optimizer,
                         config=load_config(config) if config else None, **kw).plan


@pytest.mark.parametrize("layout", CLIPPED, ids=list(CLIPPED))
def test_clipped_step_is_clip_grad_norm_then_torch_optim(layout):
    """The plan's norm against clip_grad_norm_'s of the same gradients (over all shards, stages
    and replicas: a B gradient counted once, a split one summed), and the update against
    torch.optim's step on the clipped gradients; the coefficient is well below 1, so clipping
    happened on every step."""
    optimizer = OptimizerConfig(clip_grad=CLIP)
    plan = _plan(CLIPPED[layout], optimizer)
    assert plan.optimizer.clip_grad == CLIP and list(plan.metrics) == ["grad_norm"]
    report = check_on_ranks(plan, optimizer, steps=2, seed=0, tolerance=TOL, ranks="threads", lrs=SCHEDULE)
    assert report.passed, report.table()
    assert len(report.clip_coefs) == 2 and all(c < 0.1 for c in report.clip_coefs), report.clip_coefs
    assert "gradient clipping at norm 0.05: 2 of 2 steps clipped" in report.table()


def test_the_step_reports_the_norm_only_where_it_is_computed():
    plain, _, _ = compile_example("mlp.py")
    clipped, _, _ = compile_example("mlp.py", optimizer=OptimizerConfig(clip_grad=1e-3))
    batch = BatchSource(plain.plan, 0)(0)
    assert Runner(plain.plan, make_backend("cpu"), seed=0).step(batch).grad_norm is None
    runner = Runner(clipped.plan, make_backend("cpu"), seed=0)
    result = runner.step(batch, keep_grads=True)
    eager = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in result.grads.values()])))
    assert result.grad_norm == pytest.approx(eager, rel=1e-6) and result.grad_norm > 1e-3


COUNTED = {  # what clipping adds to the step's data-moving collectives (kind, axis, role): (calls, bytes each)
    "2x1": ({}, dict(mesh="2x1")),  # the update is replicated on dp: its gradients are whole, summed once
    "2x1-zero2": ({("all_reduce", "dp", "opt"): 1}, dict(mesh="2x1", memory=MemoryOptions(zero=2))),
    "1x2-megatron": ({("all_reduce", "tp", "opt"): 1}, dict(mesh="1x2", config="examples/gpt.megatron.toml")),
    "2x2-megatron-zero1": ({("all_reduce", "dp", "opt"): 1, ("all_reduce", "tp", "opt"): 1},
                           dict(mesh="2x2", config="examples/gpt.megatron.toml", memory=MemoryOptions(zero=1))),
    # stage 0's partial sum to stage 1, the coefficient back
    "1x1x2": ({("transfer", "pp", "opt"): 2}, dict(mesh="1x1x2", pipeline=PipelineOptions(microbatches=2))),
}
# calls the norm's all-reduce absorbs: under ZeRO-2 no gradient is all-reduced, so the loss's
# all-reduce is a call of its own, and with clipping it rides in the norm's (coalesce)
ABSORBED = {"2x1-zero2": {("all_reduce", "dp", "fwd"): 1}}


@pytest.mark.parametrize("layout", COUNTED, ids=list(COUNTED))
def test_clipping_adds_one_small_all_reduce_per_axis_that_shards_the_update(layout):
    """Megatron's count: the norm costs one all-reduce of one number per mesh axis on which
    some gradient's update is split (tp for the split weights, dp under ZeRO), and nothing else
    changes: clip-grad runs after propagation, in the layouts the update reads."""
    from collections import Counter

    from sbpc.compiler.tools.comm_report import collectives

    added, kw = COUNTED[layout]
    calls = lambda plan: Counter((c.kind, c.axis, c.role) for c in {c.call: c for c in collectives(plan)
                                                                     if c.moves_data}.values())
    plain = calls(_plan(kw, OptimizerConfig()))
    clipped_plan = _plan(kw, OptimizerConfig(clip_grad=1.0))
    assert calls(clipped_plan) - plain == Counter(added) and plain - calls(clipped_plan) == Counter(ABSORBED.get(layout, {}))
    assert all(c.nbytes == 4 for c in collectives(clipped_plan) if c.value.startswith("clip_"))
