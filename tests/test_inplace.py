"""The lean update (compiler/passes/inplace.py): in place and per op across parameters, with
exactly the arithmetic of the functional plan, and a runner that hands out copies. (The default
pipeline then fuses an AdamW update into one kernel: tests/test_fuse_adamw.py; here the
inplace pass is tested on its own, without fuse-adamw.)"""
import torch

from conftest import compile_example
from sbpc.compiler.driver import compile_model
from sbpc.compiler.ir.mesh import parse_mesh
from sbpc.compiler.passes import default_pipeline
from sbpc.runtime.backend import make_backend
from sbpc.runtime.runner import BatchSource, Runner

FUNCTIONAL = [p for p in default_pipeline() if p.name not in ("inplace", "fuse-adamw")]
FOREACH = [p for p in default_pipeline() if p.name != "fuse-adamw"]


def _run(plan, steps=2, weights=None):
    runner = Runner(plan, make_backend("cpu"), seed=0, weights=weights)
    batches = BatchSource(plan, 0)
    losses = [runner.step(batches(i)).loss for i in range(steps)]
    return losses, runner.logical_params(), runner.logical_states()


def test_in_place_foreach_update_is_bitwise_the_functional_plan():
    _, source, optimizer = compile_example("mlp.py")
    lean = compile_model(source, parse_mesh("1"), batch_size=4, optimizer=optimizer, passes=FOREACH)
    functional = compile_model(source, parse_mesh("1"), batch_size=4, optimizer=optimizer, passes=FUNCTIONAL)
    opt = [i for i in lean.plan.stages[0].instructions if i.role == "opt"]
    n = len(lean.plan.params)
    # one call per op for all parameters, not one per parameter
    assert len(opt) < len([i for i in functional.plan.stages[0].instructions if i.role == "opt"]) / 3
    assert sum(i.op == "aten._foreach_add_.List" for i in opt) == 1 and n > 2
    a, b = _run(lean.plan), _run(functional.plan)
    assert a[0] == b[0]
    for x, y in zip(a[1:], b[1:]):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_runner_never_hands_out_what_the_next_step_overwrites():
    result, _, _ = compile_example("mlp.py")
    plan = result.plan
    start = {k: v.clone() for k, v in Runner(plan, make_backend("cpu"), seed=0).logical_weights().items()}
    given = {k: v.clone() for k, v in start.items()}
    runner = Runner(plan, make_backend("cpu"), seed=0, weights=given)
    before, states = runner.logical_params(), runner.logical_states()
    runner.step(BatchSource(plan, 0)(0))
    assert all(torch.equal(given[k], start[k]) for k in given)  # the caller's weights are untouched
    assert all(torch.equal(before[k], start[k]) for k in before)  # and so is what it took before the step
    assert all(not s.any() for s in states.values())
    assert not all(torch.equal(runner.logical_params()[k], start[k]) for k in before)  # the step did update
