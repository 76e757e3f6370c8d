"""The lean update (compiler/passes/inplace.py): in place and per op across parameters, with
exactly the arithmetic of the functional plan, and a runner that hands out copies. (The default
pipeline then fuses an AdamW update into one kernel: tests/test_fuse_adamw.py; here the
inplace pass is tested on its own, without fuse-adamw.)"""
import pytest
import torch

from conftest import compile_example
from sbpc.compiler.driver import compile_model
from sbpc.compiler.frontend.model_loader import load_model
from sbpc.compiler.frontend.optim import OptimizerConfig
from sbpc.compiler.ir.aten import is_mutating
from sbpc.compiler.ir.mesh import parse_mesh
from sbpc.compiler.ir.types import InputKind, Role
from sbpc.compiler.memory.estimate import estimate_memory
from sbpc.compiler.memory_options import MemoryOptions
from sbpc.compiler.passes import PipelineOptions, default_pipeline
from sbpc.compiler.passes.inplace import InPlace
from sbpc.compiler.passes.schedule import node_tasks
from sbpc.runtime.backend import make_backend
from sbpc.runtime.dist import init_distributed
from sbpc.runtime.kinds import Precision, ScheduleName
from sbpc.runtime.plan import Plan
from sbpc.runtime.runner import BatchSource, Runner, make_runner
from sbpc.runtime.thread_launch import launch_threads

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



# ----- pipelined plans: "later" is the stage's task order (tests/golden/inplace-pipeline.sbpir)

TINY = {"hidden": 64, "heads": 2, "vocab": 128, "seq": 16, "layers": 4}
_plans: dict = {}


def _pipelined(mesh: str, schedule=ScheduleName.ONE_F_ONE_B, v: int = 1, inplace: InPlace | None = InPlace(), **memory):
    """Tiny GPT on a pp mesh, 4 micro-batches; ``inplace=None``: the functional plan (cached)."""
    key = (mesh, schedule, v, repr(inplace), repr(sorted(memory.items())))
    if key not in _plans:
        pipeline = PipelineOptions(schedule=schedule, virtual_stages=v, microbatches=4)
        options = MemoryOptions(**memory)
        passes = [inplace if p.name == "inplace" else p
                  for p in default_pipeline(pipeline, options.recompute, options.zero)]
        _plans[key] = compile_model(load_model("examples/gpt.py", TINY), parse_mesh(mesh), batch_size=8,
                                    optimizer=OptimizerConfig(), pipeline=pipeline, memory=options,
                                    passes=[p for p in passes if p is not None])
    return _plans[key]


def _rank(payload):
    plan = Plan.model_validate_json(payload["plan"])
    runner = make_runner(plan, make_backend("cpu", init_distributed(plan, timeout=60)), seed=0)
    batches = BatchSource(plan, 0)
    losses = [runner.step(batches(i)).loss for i in range(2)]
    return losses, runner.logical_params(), runner.logical_states()


def _run_ranks(plan):
    return launch_threads(plan.world_size, _rank, {"plan": plan.model_dump_json()}, timeout=60)[0]  # rank 0's


def _opt(plan) -> list:
    return [i for prog in plan.stages for i in prog.instructions if i.role == "opt"]


@pytest.mark.parametrize("mesh,schedule,v,memory", [
    ("1x1x2", ScheduleName.ONE_F_ONE_B, 1, {}),
    ("2x1x2", ScheduleName.INTERLEAVED, 2, {"zero": 1, "precision": Precision.BF16}),
])
def test_pipelined_in_place_update_is_bitwise_the_functional_plan(mesh, schedule, v, memory):
    lean, functional = _pipelined(mesh, schedule, v, **memory), _pipelined(mesh, schedule, v, None, **memory)
    assert lean.plan.pipeline is not None
    assert sum(is_mutating(i.op) for i in _opt(lean.plan)) > 20
    assert not any(is_mutating(i.op) for i in _opt(functional.plan))
    a, b = _run_ranks(lean.plan), _run_ranks(functional.plan)
    assert a[0] == b[0]  # both steps' losses
    for x, y in zip(a[1:], b[1:]):  # parameters, optimizer states
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_pipelined_update_holds_one_parameters_temporaries_and_no_second_copy():
    functional = estimate_memory(_pipelined("1x1x2", inplace=None).graph)
    graph = _pipelined("1x1x2", inplace=InPlace(foreach_floor=0)).graph  # no grouping of small parameters' updates
    timeline = []
    lean = estimate_memory(graph, timeline)
    largest = max(p.type.nbytes for p in graph.inputs_of(InputKind.PARAM))
    for old, new in zip(functional, lean):
        # out of place, every stage peaks in its update, holding old and new parameters and state
        assert old.peak_at.startswith("U") and old.params > old.param_bytes and old.optimizer > old.optimizer_bytes
        assert new.total < old.total and new.params == new.param_bytes and new.optimizer == new.optimizer_bytes
    updates = [m.peak - m.held for m in timeline if m.task.startswith("U")]
    # what the update makes: one parameter's denominator and step at a time (and a few scalars)
    assert max(updates) > largest and max(updates) < 2.1 * largest, (updates, largest)


def test_pipelined_foreach_calls_stay_within_one_task():
    lean, functional = _pipelined("1x1x2"), _pipelined("1x1x2", inplace=None)
    tasks = _tasks_of(functional.graph)
    groups = [i for i in _opt(lean.plan) if i.op.startswith("aten._foreach_")]
    assert len(groups) > 10 and max(len(i.outs) for i in groups) >= 5
    for ins in groups:
        assert len({tasks[o] for o in ins.outs}) == 1, ins  # the members' tasks, compiled without the pass
    # and the once-a-step parts re-derived from the lean plan put every value where it was
    after = _tasks_of(lean.graph)
    assert len(after.keys() & tasks.keys()) > len(tasks) * 0.9
    assert all(tasks[o] == k for o, k in after.items() if o in tasks)


def test_foreach_calls_keep_what_feeds_a_send_apart():
    """DeBERTa's word embedding is tied to the decoder on the other stage, so its new value is
    sent there in the update; its LayerNorm's is not. A foreach call of both would keep the
    LayerNorm's update inputs in the earlier part with the embedding's (the runtime never moves
    what feeds a send later), which the pass refused as a task move on 2x2x2."""
    plan = compile_model(load_model("tests/zoo/deberta_v2.py"), parse_mesh("2x2x2").with_microbatches(2),
                         batch_size=4, optimizer=OptimizerConfig(), passes=FOREACH,
                         pipeline=PipelineOptions(microbatches=2)).plan
    assert any(i.op.startswith("aten._foreach_") for i in _opt(plan))


def _tasks_of(graph) -> dict:
    return {o: key for key, n in zip(node_tasks(graph), graph.nodes) for o in n.outputs}


# ----- the backward's gradient accumulations (tests/golden/inplace-accumulate.sbpir)

def test_backward_accumulations_are_in_place_and_bitwise_the_functional_plan():
    """Each residual's two gradient contributions are summed into the one that dies there
    (``add_``, as autograd's input buffer does), and nothing else of the step changes a bit."""
    source, batch = load_model("examples/gpt.py", TINY), 4
    lean = compile_model(source, parse_mesh("1"), batch_size=batch, optimizer=OptimizerConfig(), passes=FOREACH)
    functional = compile_model(source, parse_mesh("1"), batch_size=batch, optimizer=OptimizerConfig(), passes=FUNCTIONAL)
    accumulate = lambda plan, op: [i for i in plan.stages[0].instructions if i.role == "bwd" and i.op == op]  # noqa: E731
    assert len(accumulate(lean.plan, "aten.add_.Tensor")) == 2 * TINY["layers"]  # two residuals a layer
    assert not accumulate(lean.plan, "aten.add.Tensor") and not accumulate(functional.plan, "aten.add_.Tensor")
    runs = []
    for plan in (lean.plan, functional.plan):
        runner, batches = Runner(plan, make_backend("cpu"), seed=0), BatchSource(plan, 0)
        steps = [runner.step(batches(i), keep_grads=True) for i in range(2)]
        runs.append(([s.loss for s in steps], [s.grads for s in steps], runner.logical_params()))
    (losses, grads, params), (losses_f, grads_f, params_f) = runs
    assert losses == losses_f
    for a, b in [*zip(grads, grads_f), (params, params_f)]:
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_pipelined_backward_accumulations_are_in_place_within_their_task():
    """In a pipelined plan too, each residual's two contributions are summed in place into one
    made by the same task (one micro-batch's firing); the bitwise parity of these plans with
    the functional ones is test_pipelined_in_place_update_is_bitwise_the_functional_plan."""
    for mesh, schedule, v in [("1x1x2", ScheduleName.ONE_F_ONE_B, 1), ("2x1x2", ScheduleName.INTERLEAVED, 2)]:
        lean, functional = _pipelined(mesh, schedule, v), _pipelined(mesh, schedule, v, None)
        graph = lean.graph
        made = _tasks_of(graph)
        sums = [(n, key) for n, key in zip(graph.nodes, node_tasks(graph))
                if n.role == Role.BACKWARD and n.op.startswith("aten.add")]
        assert len(sums) == 2 * TINY["layers"] and all(n.op == "aten.add_.Tensor" for n, _ in sums), mesh
        assert all(made[n.args[0].name] == key for n, key in sums), mesh
        assert not [i for p in functional.plan.stages for i in p.instructions
                    if i.role == "bwd" and i.op == "aten.add_.Tensor"]
