"""The multi-rank CPU runtime: real processes over gloo.

Hand-built plans (the compiler does not emit multi-device plans yet) exercise every collective
kernel on meshes dp=2, tp=2 and dp=2 x tp=2, checked against ``runtime.sharding`` on the
logical tensors; a tiny training plan runs sharded and must match its one-device run; the
launcher's watchdog turns a dying, raising or hung rank into a prompt error naming it; under
a torchrun-style environment ``sbpc run`` joins the group instead of spawning.

Each launch starts fresh interpreters (torch import ~3 s each), so launches are few and each
checks much.
"""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, collective_op
from sbpc.errors import RuntimeFailure
from sbpc.runtime.backend import make_backend
from sbpc.runtime.executor import Program
from sbpc.runtime.launch import launch
from sbpc.runtime.plan import (Estimates, InitProgram, Instruction, MeshAxis, ModelRef, OptimizerSpec, ParamSpec, Plan,
                               RefArg, StageProgram, TensorSpec, ValueType)
from sbpc.runtime.runner import Runner
from sbpc.runtime.sbp import Split, parse_nd_sbp
from sbpc.runtime.sharding import local_shard, take_chunk

TIMEOUT = 60.0
MODEL = """import torch


def example_batch(batch_size):
    return torch.randn(batch_size, 6)
"""


# --- a hand-built training plan: loss = sum((x @ w.T)^2), SGD, on mesh dp x tp --------------

def _ins(op, args, out, shape, sbp, *, kwargs=None, role="fwd"):
    return Instruction(op=op, args=args, kwargs=kwargs or {}, outs=[out],
                       types=[ValueType(shape=shape, dtype="f32", sbp=sbp)], role=role,
                       stage=None if role == "init" else 0)


def linear_plan(dp: int, tp: int, model_path: str = "tiny.py") -> Plan:
    """x [8, 6] S(0) on dp; w [4, 6] S(0) on tp (output features); y = x @ w.T is [S(0), S(1)];
    the loss is P on both axes (the runner reduces it for reporting); the weight gradient is
    P on dp, all-reduced by the program, S(0) on tp."""
    def sbp(dp="B", tp="B"):
        return [dp, tp]

    R = lambda v: RefArg(ref=v)  # noqa: E731
    y_sbp = sbp("S(0)", "S(1)")
    instructions = [
        _ins("aten.t.default", [R("w")], "t", [6, 4], sbp(tp="S(1)")),
        _ins("aten.mm.default", [R("x"), R("t")], "y", [8, 4], y_sbp),
        _ins("aten.mul.Tensor", [R("y"), R("y")], "sq", [8, 4], y_sbp),
        _ins("aten.sum.default", [R("sq")], "loss", [], sbp("P", "P")),
        _ins("aten.mul.Tensor", [R("y"), 2.0], "y2", [8, 4], y_sbp, role="bwd"),
        _ins("aten.t.default", [R("y2")], "yt", [4, 8], sbp("S(1)", "S(0)"), role="bwd"),
        _ins("aten.mm.default", [R("yt"), R("x")], "g", [4, 6], sbp("P", "S(0)"), role="bwd"),
        _ins("sbpc.all_reduce", [R("g")], "gr", [4, 6], sbp(tp="S(0)"), kwargs={"axis": "dp"}, role="bwd"),
        _ins("aten.mul.Tensor", [R("gr"), 0.01], "gs", [4, 6], sbp(tp="S(0)"), role="opt"),
        _ins("aten.sub.Tensor", [R("w"), R("gs")], "w2", [4, 6], sbp(tp="S(0)"), role="opt"),
    ]
    init = InitProgram(instructions=[_ins("aten.randn.generator", [[4, 6]], "i0", [4, 6], [], role="init")],
                       outputs={"w": "i0"})
    return Plan(
        sbpc_version="test", model=ModelRef(path=model_path, batch_size=8),
        mesh=[MeshAxis(name="dp", size=dp), MeshAxis(name="tp", size=tp)],
        stages=[StageProgram(stage=0, instructions=instructions, loss="loss")],
        params=[ParamSpec(name="w", value="w", shape=[4, 6], dtype="float32", sbp=sbp(tp="S(0)"), grad="gr", update="w2")],
        buffers=[], states=[],
        batch=[TensorSpec(name="batch.0", value="x", shape=[8, 6], dtype="float32", sbp=sbp(dp="S(0)"))],
        init=init,
        optimizer=OptimizerSpec(kind="sgd", lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, momentum=0.0),
        estimates=Estimates(param_count=24, param_bytes=96, grad_bytes=96, optimizer_state_bytes=0,
                            peak_activation_bytes=0, instructions=len(instructions)))


def reference_run(steps: int, seed: int = 0, batches=None):
    """The one-device run of the linear plan: (losses, grads per step, final weight)."""
    runner = Runner(linear_plan(1, 1), make_backend("cpu"), seed=seed)
    losses, grads = [], []
    for step in range(steps):
        result = runner.step(batches(step) if batches else _batch(step), keep_grads=True)
        losses.append(result.loss)
        grads.append(result.grads["w"])
    return losses, grads, runner.params["w"]


def _batch(step: int) -> tuple[torch.Tensor]:
    return (torch.randn(8, 6, generator=torch.Generator().manual_seed(100 + step)),)


# --- checks run inside the ranks ---------------------------------------------------------

def check_kernels(backend) -> int:
    """Every collective kernel along every mesh axis, through a generated Program, against
    runtime.sharding on the logical tensors. Returns the number of values checked."""
    topo = backend.topology
    L = torch.randn(12, 8, generator=torch.Generator().manual_seed(7))
    checked = 0
    for axis, n in topo.axes:
        if n == 1:
            continue
        group, i = topo.group(axis), topo.index(axis)
        partials = {g: torch.randn(12, 8, generator=torch.Generator().manual_seed(1000 + g)) for g in group}
        total = sum(partials[g] for g in group)
        biggest = torch.stack([partials[g] for g in group]).amax(0)

        def chunk(t, dim, parts=1, j=i):
            return take_chunk(t, Split(dim, parts), j, n).contiguous()

        inputs = {"L": L, "p": partials[topo.rank], "x_s0": chunk(L, 0), "x_s1p2": chunk(L, 1, 2),
                  "x_s0p3": chunk(L, 0, 3), "x_s1": chunk(L, 1), "dead": partials[topo.rank].clone()}
        cases = [  # (op, input, kwargs, expected)
            ("sbpc.all_reduce", "p", {}, total),
            ("sbpc.all_reduce", "dead", {"overwrite": True}, total),  # reduced into its input: no buffer
            ("sbpc.all_reduce", "p", {"reduce": "max"}, biggest),
            ("sbpc.all_gather", "x_s0", {"dim": 0}, L),
            ("sbpc.all_gather", "x_s1p2", {"dim": 1, "parts": 2}, L),
            ("sbpc.all_gather", "x_s0p3", {"dim": -2, "parts": 3}, L),
            ("sbpc.reduce_scatter", "p", {"dim": 0}, chunk(total, 0)),
            ("sbpc.reduce_scatter", "p", {"dim": 0, "parts": 3}, chunk(total, 0, 3)),
            ("sbpc.reduce_scatter", "p", {"dim": 1, "parts": 2, "reduce": "max"}, chunk(biggest, 1, 2)),
            ("sbpc.all_to_all", "x_s0p3", {"src_dim": 0, "src_parts": 3, "dst_dim": 1, "dst_parts": 2}, chunk(L, 1, 2)),
            ("sbpc.all_to_all", "x_s1", {"src_dim": 1, "dst_dim": 0}, chunk(L, 0)),
            ("sbpc.all_to_all", "x_s1p2", {"src_dim": 1, "src_parts": 2, "dst_dim": 0, "dst_parts": 3}, chunk(L, 0, 3)),
            ("sbpc.all_to_all", "x_s0p3", {"src_dim": 0, "src_parts": 3, "dst_dim": 0}, chunk(L, 0)),  # re-blocking
            ("sbpc.shard_slice", "L", {"dim": 1, "parts": 2}, chunk(L, 1, 2)),
            ("sbpc.keep_first", "L", {}, L if i == 0 else torch.zeros_like(L)),
            ("sbpc.keep_first", "L", {"reduce": "max"}, L if i == 0 else torch.full_like(L, torch.finfo(L.dtype).min)),
        ]
        names = list(inputs)
        instructions = [Instruction(op=op, args=[RefArg(ref=src)], kwargs={"axis": axis, **kw}, outs=[f"o{k}"],
                                    types=[ValueType(shape=list(want.shape), dtype="f32")], role="fwd", stage=0)
                        for k, (op, src, kw, want) in enumerate(cases)]
        program = Program(instructions, names, [f"o{k}" for k in range(len(cases))], backend, name="kernels")
        for (op, src, kw, want), got in zip(cases, program.run([inputs[k] for k in names])):
            torch.testing.assert_close(got, want, msg=lambda m: f"{op}({src}, axis={axis}, {kw}) on rank {topo.rank}: {m}")
            if kw.get("overwrite"):
                assert got.data_ptr() == inputs[src].data_ptr(), "gloo reduces an overwritable input in place"
            checked += 1
        torch.testing.assert_close(inputs["p"], partials[topo.rank], rtol=0, atol=0)  # not overwritten
    return checked


def check_gather(runner) -> int:
    """Runner.gather inverts local_shard for nd-SBPs over every axis of a 2 x 2 mesh."""
    topo = runner.topology
    L = torch.randn(8, 12, generator=torch.Generator().manual_seed(3))
    nds = [["S(0)", "S(1)"], ["S(1)", "S(1:3)"], ["S(0)", "S(0)"], ["P", "S(1:2)"], ["S(0:2)", "P(max)"],
           ["B", "P"], ["P", "P"], ["B", "B"], ["P(max)", "S(0)"]]
    for nd in nds:
        local = local_shard(L, parse_nd_sbp(nd), topo.sbp_coords(), topo.sbp_sizes())
        torch.testing.assert_close(runner.gather(local, nd), L, msg=lambda m: f"gather {nd}: {m}")
        torch.testing.assert_close(runner.gather(local, parse_nd_sbp(nd)), L)
    return len(nds)


def check_training(comm, dp: int, tp: int) -> None:
    """The linear plan sharded over dp x tp steps like its one-device run: loss, gathered
    gradients, logical parameters; each rank holds only its shard."""
    plan = linear_plan(dp, tp)
    runner = Runner(plan, make_backend("cpu", comm, comm.topology), seed=0)
    assert list(runner.params["w"].shape) == [4 // tp, 6]
    losses, grads, final = reference_run(2)
    for step in range(2):
        result = runner.step(_batch(step), keep_grads=True)
        assert result.loss == pytest.approx(losses[step], rel=1e-5)
        torch.testing.assert_close(result.grads["w"], grads[step])
    torch.testing.assert_close(runner.logical_params()["w"], final)
    torch.testing.assert_close(runner.logical_weights()["w"], final)
    # --weights: every rank gets the logical state dict and keeps its shard
    loaded = Runner(plan, runner.backend, weights={"w": final})
    topo = comm.topology
    assert torch.equal(loaded.params["w"], local_shard(final, parse_nd_sbp(["B", "S(0)"]), topo.sbp_coords(), topo.sbp_sizes()))


def two_rank_checks(payload):
    from sbpc.runtime.dist import init_distributed

    checked = 0
    for dp, tp in [(2, 1), (1, 2)]:
        comm = init_distributed([("dp", dp), ("tp", tp)], timeout=payload["timeout"])
        comm._native_reduce_scatter = tp == 1  # tp=2: the all_reduce + chunk fallback
        checked += check_kernels(make_backend("cpu", comm, comm.topology))
        check_training(comm, dp, tp)
    return checked


def four_rank_checks(payload):
    from sbpc.runtime.dist import init_distributed

    comm = init_distributed(linear_plan(2, 2), timeout=payload["timeout"])
    backend = make_backend("cpu", comm, comm.topology)
    checked = check_kernels(backend)
    checked += check_gather(Runner(linear_plan(2, 2), backend, seed=0))
    check_training(comm, 2, 2)
    return checked


def misbehave(payload):
    """Rank ``victim`` exits or hangs; the others wait for it in an all_reduce."""
    from sbpc.runtime.dist import init_distributed

    comm = init_distributed([("dp", payload["ranks"])], timeout=payload["timeout"])
    if comm.rank == payload["victim"]:
        if payload["mode"] == "exit":
            os._exit(1)
        if payload["mode"] == "hang":
            time.sleep(120)
    comm.all_reduce(torch.ones(3), tuple(range(payload["ranks"])))
    return comm.rank


# --- tests -------------------------------------------------------------------------------

def test_kernels_and_training_on_dp2_and_tp2():
    assert launch(2, "test_dist:two_rank_checks", {"timeout": TIMEOUT}, timeout=TIMEOUT) == [32, 32]


def test_kernels_gather_and_training_on_a_2x2_mesh():
    assert launch(4, "test_dist:four_rank_checks", {"timeout": TIMEOUT}, timeout=TIMEOUT) == [41] * 4


def test_a_rank_that_dies_ends_the_launch_naming_it():
    start = time.monotonic()
    with pytest.raises(RuntimeFailure, match=r"^rank 1 exited with code 1 without reporting an error"):
        launch(2, "test_dist:misbehave", {"ranks": 2, "victim": 1, "mode": "exit", "timeout": TIMEOUT}, timeout=TIMEOUT)
    assert time.monotonic() - start < 30


def test_a_hung_rank_is_named_after_the_timeout():
    start = time.monotonic()
    with pytest.raises(RuntimeFailure, match=r"^rank 1 hung: rank 0 gave up waiting for it after 2s .*all_reduce over mesh axis dp"):
        launch(2, "test_dist:misbehave", {"ranks": 2, "victim": 1, "mode": "hang", "timeout": 2}, timeout=2)
    assert time.monotonic() - start < 30


@pytest.fixture
def dp2_plan(tmp_path):
    from sbpc.runtime.plan import save_plan

    (tmp_path / "tiny.py").write_text(MODEL)
    path = tmp_path / "plan.json"
    save_plan(linear_plan(2, 1, str(tmp_path / "tiny.py")), str(path))
    return path


def _cli_reference(tmp_path, steps: int):
    """One-device losses and final weight of `sbpc run` with seed 0 (batches from tiny.py)."""
    from sbpc.runtime.runner import BatchSource

    source = BatchSource(linear_plan(1, 1, str(tmp_path / "tiny.py")), 0)
    return reference_run(steps, batches=source)


def _losses(stdout: str) -> list[float]:
    return [float(x) for x in re.findall(r"^ iteration .*\| lm loss: (\S+) \|", stdout, re.M)]


def test_sbpc_run_spawns_the_ranks_of_a_multi_device_plan(tmp_path, dp2_plan):
    exe = os.path.join(os.path.dirname(sys.executable), "sbpc")
    save = tmp_path / "w.pt"
    proc = subprocess.run([exe, "run", str(dp2_plan), "--steps", "3", "--save", str(save)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    losses, _, final = _cli_reference(tmp_path, 3)
    assert _losses(proc.stdout) == pytest.approx(losses, rel=1e-5)
    assert re.search(r"^3 steps in .* steps/s\)$", proc.stdout, re.M)
    assert f"saved weights to {save}" in proc.stdout
    saved = torch.load(save)
    assert list(saved) == ["w"]
    torch.testing.assert_close(saved["w"], final)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_under_torchrun_sbpc_run_joins_the_group_instead_of_spawning(tmp_path, dp2_plan):
    exe = os.path.join(os.path.dirname(sys.executable), "sbpc-run")
    port = str(_free_port())
    procs = [subprocess.Popen([exe, str(dp2_plan), "--steps", "2", "--timeout", "60"], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
             for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1] for o in outs]
    losses, _, _ = _cli_reference(tmp_path, 2)
    assert _losses(outs[0][0]) == pytest.approx(losses, rel=1e-5)  # rank 0 reports
    assert outs[1][0] == ""  # rank 1 prints nothing: it is a rank, not a launcher


def test_world_size_mismatch_under_torchrun(dp2_plan, monkeypatch, capsys):
    from sbpc.runtime.cli import main

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert main([str(dp2_plan), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(r"sbpc-run: error: plan is for 2 ranks but WORLD_SIZE is 3; hint: start 2 processes "
                        r"\(e\.g\. torchrun --nproc-per-node 2\), or recompile the plan for a mesh of 3 devices\n", err)


def test_one_device_runs_ignore_a_one_rank_torchrun(dp2_plan, tmp_path, monkeypatch, capsys):
    from sbpc.runtime.cli import main
    from sbpc.runtime.plan import save_plan

    one = tmp_path / "one.json"
    save_plan(linear_plan(1, 1, str(tmp_path / "tiny.py")), str(one))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main([str(one), "--steps", "1"]) == 0
    assert re.search(r"^ iteration +1/ +1 \|", capsys.readouterr().out, re.M)


def test_collectives_on_one_device_are_the_identity():
    backend = make_backend("cpu")
    x = torch.arange(6.0).reshape(2, 3)
    for op, kw in [("sbpc.all_reduce", {}), ("sbpc.all_gather", {"dim": 0, "parts": 2}),
                   ("sbpc.reduce_scatter", {"dim": 1}), ("sbpc.all_to_all", {"src_dim": 0, "dst_dim": 1}),
                   ("sbpc.shard_slice", {"dim": 0}), ("sbpc.keep_first", {})]:
        assert backend.kernel(op)(x, axis="tp", **kw) is x


def test_gloo_communicator_needs_a_process_group():
    from sbpc.runtime.dist import GlooCommunicator
    from sbpc.runtime.topology import Topology

    with pytest.raises(RuntimeFailure, match="needs an initialised process group"):
        GlooCommunicator(Topology((("dp", 2),), 0))



def test_an_error_in_the_spawned_ranks_is_one_line_with_exit_code_2(tmp_path, dp2_plan):
    exe = os.path.join(os.path.dirname(sys.executable), "sbpc")
    torch.save({"w": torch.zeros(3, 3)}, tmp_path / "bad.pt")
    proc = subprocess.run([exe, "run", str(dp2_plan), "--weights", str(tmp_path / "bad.pt")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    # every rank raises the same WeightsError; it comes back whole, naming the lowest rank
    assert re.fullmatch(r"sbpc: error: rank 0: weights file \S+bad\.pt: w has shape \[3, 3\], the plan expects \[4, 6\]"
                        r"; hint: .*\n", proc.stderr), proc.stderr
    assert proc.stdout == ""


def test_a_compiled_data_parallel_plan_matches_its_one_device_run(tmp_path):
    """End to end with the compiler: examples/mlp.py for dp=2 on two spawned ranks."""
    from sbpc.compiler.driver import compile_model
    from sbpc.compiler.ir.mesh import parse_mesh
    from sbpc.compiler.frontend.model_loader import load_model
    from sbpc.compiler.frontend.optim import OptimizerConfig
    from sbpc.runtime.plan import save_plan
    from sbpc.runtime.runner import BatchSource, step_seed

    source = load_model("examples/mlp.py", {})
    plan = compile_model(source, parse_mesh("dp=2"), batch_size=4, optimizer=OptimizerConfig()).plan
    assert any(collective_op(ins).startswith("sbpc.all_") for ins in plan.stages[0].instructions)
    path = tmp_path / "dp2.json"
    save_plan(plan, str(path))
    payload = {"plan": str(path), "steps": 3, "seed": 0, "backend": "cpu", "weights": None, "save": None,
               "threads": None, "timeout": TIMEOUT, "debug": False}
    results = launch(2, "sbpc.runtime.cli:run_rank", payload, timeout=TIMEOUT, on_output=lambda r, line: None)
    one = compile_model(source, parse_mesh("1"), batch_size=4, optimizer=OptimizerConfig()).plan
    runner, batches = Runner(one, make_backend("cpu"), seed=0), BatchSource(one, 0)
    expected = [runner.step(batches(s), rng_seed=step_seed(0, s)).loss for s in range(3)]
    for r in results:
        assert r["losses"] == pytest.approx(expected, rel=1e-5)
