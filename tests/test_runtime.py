"""The runtime: stepping, weights in and out, and its own errors."""
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, compile_example, sbpc
from sbpc.errors import RuntimeFailure, WeightsError
from sbpc.runtime.backend import LocalCommunicator, make_backend
from sbpc.runtime.runner import BatchSource, Runner
from sbpc.runtime.weights import load_weights, save_weights


def test_training_reduces_the_loss():
    result, _, _ = compile_example("mlp.py")
    runner = Runner(result.plan, make_backend("cpu"), seed=0)
    batch = BatchSource(result.plan, 0)(0)
    losses = [runner.step(batch).loss for _ in range(20)]  # one batch, overfit
    assert losses[-1] < 0.8 * losses[0]


@pytest.mark.parametrize("microbatches", [1, 2])  # Runner, and PipelineRunner (accumulation)
def test_the_timeline_records_only_when_asked(microbatches):
    from sbpc.compiler.driver import compile_model
    from sbpc.compiler.frontend.optim import OptimizerConfig
    from sbpc.compiler.ir.mesh import parse_mesh
    from sbpc.compiler.passes import PipelineOptions
    from sbpc.runtime.runner import make_runner

    _, source, _ = compile_example("mlp.py")
    plan = compile_model(source, parse_mesh("1"), batch_size=4, optimizer=OptimizerConfig(),
                         pipeline=PipelineOptions(microbatches=microbatches)).plan
    batch = BatchSource(plan, 0)(0)
    quiet, traced = (make_runner(plan, make_backend("cpu"), seed=0, timeline=on) for on in (False, True))
    for _ in range(3):
        quiet.step(batch), traced.step(batch)
    assert quiet.timeline.firings == [] and quiet.backend.flights == []  # a long run keeps nothing
    steps = [f.step for f in traced.timeline.firings]
    assert sorted(set(steps)) == [0, 1, 2] and steps.count(0) == steps.count(2) >= microbatches


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_weights_round_trip_and_resume(tmp_path, suffix):
    result, _, _ = compile_example("gpt.py")
    plan = result.plan
    batches = BatchSource(plan, 0)
    a = Runner(plan, make_backend("cpu"), seed=0)
    a.step(batches(0))
    path = str(tmp_path / f"w{suffix}")
    save_weights(a.weights(), path)
    assert os.listdir(tmp_path) == [f"w{suffix}"]  # the temporary file was renamed away
    b = Runner(plan, make_backend("cpu"), weights=load_weights(path, plan))
    for name, t in a.weights().items():
        assert torch.equal(t, b.weights()[name]), name


def test_weights_errors(tmp_path):
    plan = compile_example("mlp.py")[0].plan
    with pytest.raises(WeightsError, match="does not exist"):
        load_weights(str(tmp_path / "none.pt"), plan)
    torch.save({"layers.0.weight": torch.zeros(1)}, tmp_path / "few.pt")
    with pytest.raises(WeightsError, match=r"lacks \d+ tensors"):
        load_weights(str(tmp_path / "few.pt"), plan)
    good = Runner(plan, make_backend("cpu"), seed=0).weights()
    good["layers.0.weight"] = torch.zeros(3, 3)
    torch.save(good, tmp_path / "shape.pt")
    with pytest.raises(WeightsError, match=r"layers\.0\.weight has shape \[3, 3\], the plan expects \[64, 32\]"):
        load_weights(str(tmp_path / "shape.pt"), plan)
    (tmp_path / "junk.pt").write_bytes(b"not a pickle")
    with pytest.raises(WeightsError, match="cannot read weights file"):
        load_weights(str(tmp_path / "junk.pt"), plan)


def test_world_size_mismatch():
    plan = compile_example("mlp.py")[0].plan
    comm = LocalCommunicator()
    comm.world_size = 4
    with pytest.raises(RuntimeFailure, match=r"plan is for 1 ranks but this run has 4"):
        Runner(plan, make_backend("cpu", comm), seed=0)


def test_batch_of_the_wrong_shape():
    plan = compile_example("mlp.py")[0].plan
    runner = Runner(plan, make_backend("cpu"), seed=0)
    with pytest.raises(RuntimeFailure, match=r"batch\.0 is torch\.float32 \[3, 32\], the plan was compiled for float32 \[4, 32\]"):
        runner.step((torch.randn(3, 32), torch.randn(3, 8)))


def test_a_failing_kernel_names_the_instruction_and_the_users_line():
    result, _, _ = compile_example("mlp.py")
    plan = result.plan
    program = plan.stages[0]
    idx = next(i for i, ins in enumerate(program.instructions) if ins.op == "aten.addmm.default")
    bad = program.instructions[idx].model_copy(update={"op": "aten.mm.default"})  # wrong arity
    instructions = [*program.instructions[:idx], bad, *program.instructions[idx + 1:]]
    broken = plan.model_copy(update={"stages": [program.model_copy(update={"instructions": instructions})]})
    runner = Runner(broken, make_backend("cpu"), seed=0)
    with pytest.raises(RuntimeFailure, match=r"aten\.mm\.default -> %addmm failed: .*\(at layers\.0 @ examples/mlp\.py:\d+\)"):
        runner.step(BatchSource(plan, 0)(0))


def test_unknown_backend():
    from sbpc.errors import UsageError

    with pytest.raises(UsageError, match="backend 'tpu' is not available"):
        make_backend("tpu")


def test_runtime_never_imports_the_compiler(tmp_path):
    plan = str(tmp_path / "plan.json")
    assert sbpc("compile", "examples/mlp.py", "-o", plan).returncode == 0
    code = ("import sys; from sbpc.runtime.cli import main; rc = main([%r, '--steps', '2']);"
            "bad = [m for m in sys.modules if m.startswith('sbpc.compiler')]; print('COMPILER', bad); sys.exit(rc)") % plan
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert " iteration        2/       2 | " in proc.stdout
    assert "COMPILER []" in proc.stdout


def test_local_communicator_is_identity_and_refuses_peers():
    from sbpc.errors import PlanError

    comm = LocalCommunicator()
    t = torch.arange(4.0)
    assert comm.all_reduce(t, (0,)) is t and comm.all_gather(t, (0,), 0) is t
    assert comm.reduce_scatter(t, (0,), 0) is t and comm.all_to_all(t, (0,), 0, 0) is t
    with pytest.raises(PlanError, match=r"cannot communicate with ranks \(0, 1\)"):
        comm.all_reduce(t, (0, 1))
    with pytest.raises(PlanError, match=r"cannot communicate with ranks \(1,\)"):
        comm.send(t, 1)


def test_batches_need_the_model_file_recorded_in_the_plan(tmp_path):
    from sbpc.errors import ModelError

    plan = compile_example("mlp.py")[0].plan
    moved = plan.model_copy(update={"model": plan.model.model_copy(update={"path": str(tmp_path / "gone.py")})})
    with pytest.raises(ModelError, match=r"the plan's model file '.*gone\.py' is not here"):
        BatchSource(moved, 0)


def _t(x: str, out: str, free=(), op="aten.t.default", args=()):
    from sbpc.runtime.plan import Instruction, RefArg, ValueType

    return Instruction(op=op, args=[RefArg(ref=x), *args], outs=[out], types=[ValueType(shape=[2, 3], dtype="float32")],
                       free=list(free), role="bwd")


def test_undone_transposes_bind_the_tensor_itself():
    from sbpc.runtime.executor import _undone_transposes

    # t(t(x)) where the inner t has no other reader: neither is a kernel call
    assert _undone_transposes([_t("x", "a"), _t("a", "b", free=["a"])], ["b"]) == {0: "x", 1: "a"}
    # the inner one is read elsewhere: it stays a call, the outer binds x (alive until the end)
    assert _undone_transposes([_t("x", "a"), _t("a", "b"), _t("a", "c", free=["a"])], ["b", "c"]) == {1: "x", 2: "x"}
    # ... but not where x is freed before the outer one
    ins = [_t("x", "a", free=["x"]), _t("a", "b"), _t("a", "c", free=["a"])]
    assert _undone_transposes(ins, ["b", "c"]) == {}
    # transposes of the same two dims undo each other, of other dims do not; chains of three
    # undo their first pair only
    swap = [_t("x", "a", op="aten.transpose.int", args=[1, 0]), _t("a", "b", op="aten.transpose.int", args=[0, -1])]
    assert _undone_transposes(swap, ["b"]) == {0: "x", 1: "a"}
    assert _undone_transposes([_t("x", "a"), _t("a", "b"), _t("b", "c")], ["c"]) == {0: "x", 1: "a"}


def test_a_step_with_transposes_undone_is_the_same_bit_for_bit(monkeypatch):
    import sbpc.runtime.executor as executor

    plan = compile_example("gpt.py")[0].plan
    fast = Runner(plan, make_backend("cpu"), seed=0)
    calls = sum("k[" in line for line in fast.program.source.splitlines())
    monkeypatch.setattr(executor, "_undone_transposes", lambda *a: {})
    slow = Runner(plan, make_backend("cpu"), seed=0)
    assert calls < sum("k[" in line for line in slow.program.source.splitlines()) == len(plan.stages[0].instructions)
    make = BatchSource(plan, 0)
    for i in range(2):
        a, b = fast.step(make(i), keep_grads=True), slow.step(make(i), keep_grads=True)
        assert a.loss == b.loss and all(torch.equal(a.grads[n], b.grads[n]) for n in a.grads)
    assert all(torch.equal(fast.params[n], slow.params[n]) for n in fast.params)
    assert all(torch.equal(fast.states[n], slow.states[n]) for n in fast.states)


def test_a_list_result_of_one_tensor_is_unpacked():
    """unbind of a size-1 dim (a one-layer GRU's initial state) and split into one piece return
    a list of one tensor: the plan's one result is that tensor, not the list."""
    from sbpc.runtime.executor import Program
    from sbpc.runtime.plan import Instruction, RefArg, ValueType

    f32 = lambda *shape: ValueType(shape=list(shape), dtype="float32")
    ins = [Instruction(op="aten.unbind.int", args=[RefArg(ref="x")], outs=["h"], types=[f32(2, 3)], role="fwd"),
           Instruction(op="aten.split.Tensor", args=[RefArg(ref="h"), 3, 1], outs=["p"], types=[f32(2, 3)], role="fwd"),
           Instruction(op="aten.mul.Tensor", args=[RefArg(ref="p"), 2.0], outs=["y"], types=[f32(2, 3)], role="fwd")]
    x = torch.randn(1, 2, 3)
    (y,) = Program(ins, ["x"], ["y"], make_backend("cpu")).run([x])
    assert torch.equal(y, x[0] * 2)


def test_save_plan_signs_the_plan_as_a_whole_dump_would(tmp_path):
    """save_plan serializes once and appends the digest; the file is what dumping the signed
    model gives, and load_plan's digest check accepts it."""
    from sbpc.runtime.plan import load_plan, save_plan

    plan = compile_example("mlp.py")[0].plan
    path = tmp_path / "plan.json"
    save_plan(plan, str(path))
    signed = plan.model_copy(update={"digest": plan.content_digest()})
    assert path.read_text() == signed.model_dump_json()
    assert load_plan(str(path)) == signed


@pytest.mark.parametrize("column", [5, -6])
def test_a_picked_column_out_of_range_fails_as_indexing_does(column):
    """``x[arange(B), j]`` runs as a gather (tests/models/row_pick.py); a ``j`` outside the row
    is refused, as eager indexing refuses it, and not wrapped round to another column."""
    from sbpc.compiler.driver import compile_model
    from sbpc.compiler.frontend.model_loader import load_model
    from sbpc.compiler.frontend.optim import OptimizerConfig
    from sbpc.compiler.ir.mesh import parse_mesh
    from sbpc.compiler.passes import default_pipeline
    from sbpc.compiler.passes.decompose import Decompose

    # the rewrite runs on one device too, so that one process can run the plan
    passes = [Decompose(always=True) if p.name == "decompose" else p for p in default_pipeline()]
    plan = compile_model(load_model(str(ROOT / "tests/models/row_pick.py"), {}), parse_mesh("1"), batch_size=4,
                         optimizer=OptimizerConfig(), passes=passes).plan
    assert any(ins.op == "aten.gather.default" for ins in plan.stages[0].instructions)
    runner = Runner(plan, make_backend("cpu"), seed=0)
    ids, lengths, y = BatchSource(plan, 0)(0)
    runner.step((ids, lengths, y))  # in range, -1 included (the model file's batch has it)
    y = y.clone()
    y[1] = column  # the head has 5 classes
    with pytest.raises(RuntimeFailure, match=r"aten\.gather\.default .*index"):
        runner.step((ids, lengths, y))


def test_ops_a_library_registers_are_imported_through_the_model_file(tmp_path):
    """A rank process has not imported the library that registers a plan's custom op (Hugging
    Face's ``transformers.grouped_mm_fallback``); the runner imports the model file, which
    does. Where that import fails, the error says so, not "no kernel"."""
    from sbpc.errors import ModelError

    result, _, _ = compile_example("mlp.py")
    lib = tmp_path / "lib_model.py"
    lib.write_text("import torch\n"
                   "@torch.library.custom_op('sbpc_test_lib::twice', mutates_args=())\n"
                   "def twice(x: torch.Tensor) -> torch.Tensor:\n"
                   "    return x * 2\n")
    stage = result.plan.stages[0]
    ops = [i.model_copy(update={"op": "sbpc_test_lib.twice.default"}) if i.op == "aten.relu.default" else i
           for i in stage.instructions]
    plan = result.plan.model_copy(update={"stages": [stage.model_copy(update={"instructions": ops})]})

    def at(path):
        return plan.model_copy(update={"model": plan.model.model_copy(update={"path": str(path)})})

    with pytest.raises(ModelError, match="the plan names sbpc_test_lib.twice.default, which torch has not registered"):
        Runner(at(tmp_path / "gone.py"), make_backend("cpu"), seed=0)
    plan = at(lib)
    runner = Runner(plan, make_backend("cpu"), seed=0)  # the file registered the op
    assert runner.step(BatchSource(result.plan, 0)(0)).loss > 0
