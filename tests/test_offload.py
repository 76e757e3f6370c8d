"""Optimizer offload (`--offload optimizer`, compiler/passes/offload.py): the optimizer's state,
master copy and update placed in host memory, the transfers derived by boxing, parity with
eager on data, pipeline and ZeRO meshes and under bf16, the transfer counts, the estimate's
host column, and a stale master copy that the check must catch."""
from __future__ import annotations

import re
from collections import Counter

import pytest

from conftest import sbpc_check
from sbpc.compiler.driver import compile_captured, compile_model
from sbpc.compiler.frontend.capture import capture
from sbpc.compiler.frontend.model_loader import load_model
from sbpc.compiler.frontend.optim import OptimizerConfig
from sbpc.compiler.ir.mesh import parse_mesh
from sbpc.compiler.ir.parser import parse_graph
from sbpc.compiler.ir.printer import print_graph
from sbpc.compiler.ir.types import Role
from sbpc.compiler.memory_options import MemoryOptions
from sbpc.compiler.passes import InPlace, default_pipeline
from sbpc.compiler.tools.check import run_check
from sbpc.compiler.tools.comm_report import collectives
from sbpc.compiler.tools.memory_report import memory_json
from sbpc.runtime.backend import make_backend
from sbpc.runtime.kinds import MemoryKind
from sbpc.runtime.runner import Runner

OFFLOAD = MemoryOptions(offload="optimizer")


# ----- parity: in-process ranks, 2 steps (the acceptance meshes)
@pytest.mark.parametrize("args", [("--mesh", "2x1"), ("--mesh", "2x2x2", "--zero", "2"),
                                  ("--mesh", "2x1x2", "--precision", "bf16")], ids=["2x1", "2x2x2-zero2", "2x1x2-bf16"])
def test_offload_parity(args):
    r = sbpc_check("examples/gpt.py", *args, "--offload", "optimizer", "--steps", "2", ranks="threads", timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"largest deviation .*: PASS", r.stdout), r.stdout


# ----- placement and transfers, from compiles only
@pytest.fixture(scope="module")
def gpt():
    src = load_model("examples/gpt.py")
    return src, capture(src, parse_mesh("2x1"), 4, OptimizerConfig())


_COMPILED: dict[MemoryOptions, object] = {}


def _compile(gpt, memory: MemoryOptions):
    """One compile per option set for the whole module."""
    if memory not in _COMPILED:
        src, graph = gpt
        _COMPILED[memory] = compile_captured(graph, src, batch_size=4, optimizer=OptimizerConfig(), memory=memory)
    return _COMPILED[memory]


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@pytest.mark.parametrize("zero", [0, 2])
def test_one_transfer_each_way_per_parameter(gpt, zero):
    result = _compile(gpt, MemoryOptions(zero=zero, offload="optimizer"))
    plan, graph = result.plan, result.graph
    # every optimizer op and state on the host, everything else on the device
    assert {n.memory for n in graph.nodes if n.role == Role.OPTIMIZER and not n.op.startswith("sbpc.")} \
        == {MemoryKind.HOST}
    assert {n.memory for n in graph.nodes if n.role != Role.OPTIMIZER} == {MemoryKind.DEVICE}
    assert {s.memory for s in plan.states} == {MemoryKind.HOST}
    assert {p.memory for p in plan.params} == {MemoryKind.DEVICE}
    masters = {s.copies for s in plan.states if s.init == "param"}
    assert masters == {p.name for p in plan.params}
    cs = [c for c in collectives(plan) if c.moves_data]
    to_host = [c for c in cs if c.kind == "to_host"]
    to_device = [c for c in cs if c.kind == "to_device"]
    shard = lambda p: 4 * _numel(p.shape) // (2 if zero else 1)  # noqa: E731 (every GPT tensor divides by dp=2)
    # one device -> host per gradient (the reduced gradient, or its ZeRO-2 shard) ...
    assert Counter(c.nbytes for c in to_host) == Counter(shard(p) for p in plan.params)
    assert {c.axis for c in to_host + to_device} == {"host"}
    # ... and one host -> device per updated parameter (shard), per step
    assert Counter(c.nbytes for c in to_device) == Counter(shard(p) for p in plan.params)
    # the gradient is reduced on the device before it moves: nothing partial crosses
    moves = [i for st in plan.stages for i in st.instructions if i.op == "sbpc.to_host"]
    assert moves and not [i for i in moves if any(s.startswith("P") for s in i.sbp_in[0])]
    if zero:  # the device all-gathers each updated shard it got back
        gathers = [c for c in cs if c.kind == "all_gather" and c.role == "opt"]
        assert sorted(c.value for c in gathers) == sorted(c_out for c_out in _outs(plan, "sbpc.to_device"))
    # the text IR round-trips the placement
    text = print_graph(graph)
    assert "mem=host" in text and print_graph(parse_graph(text)) == text


def _outs(plan, op: str) -> list[str]:
    return [o for st in plan.stages for i in st.instructions if i.op == op for o in i.outs]


def test_estimate_counts_offloaded_state_on_the_host(gpt):
    device = _compile(gpt, MemoryOptions(zero=2)).plan.estimates
    off = _compile(gpt, MemoryOptions(zero=2, offload="optimizer")).plan.estimates
    (d,), (o,) = device.roles, off.roles
    assert d.optimizer > 0 and d.host == 0
    assert o.optimizer == 0 and o.optimizer_bytes == 0 and off.optimizer_state_bytes == 0
    assert o.total < d.total
    # the host holds the state (ZeRO-2: 8 bytes per parameter / dp) and the master shard (4 / dp)
    state = d.optimizer_bytes
    master = sum(4 * _numel(p.shape) // 2 for p in _compile(gpt, MemoryOptions(zero=2)).plan.params)  # dp=2
    assert o.host >= state + master
    row = memory_json(off.roles, None)[0]
    assert row["host"] == o.host and {"role", "params", "grads", "optimizer", "activations", "buffers", "total",
                                      "fits"} <= set(row)


# ----- a broken offload must fail the check
def _stale(plan, what: str):
    """The plan with one side of the offload never refreshed: ``master``, the host's copy keeps
    its old value (the next update reads the stale copy); ``device``, the device's parameter
    keeps its old value (the update never moves back)."""
    if what == "master":
        return plan.model_copy(update={"states": [s.model_copy(update={"update": s.value}) if s.init == "param" else s
                                                  for s in plan.states]})
    return plan.model_copy(update={"params": [p.model_copy(update={"update": p.value}) for p in plan.params]})


@pytest.mark.parametrize("what, step", [("master", "1"), ("device", "0")])
def test_a_stale_copy_fails_the_check(what, step):
    source = load_model("examples/mlp.py")
    optimizer = OptimizerConfig()
    # functional updates (no inplace pass), so the master's old and new values are two tensors
    passes = [p for p in default_pipeline(offload="optimizer") if not isinstance(p, InPlace)]
    plan = compile_model(source, parse_mesh("1"), batch_size=4, optimizer=optimizer, memory=OFFLOAD, passes=passes).plan
    if what == "master":
        good = run_check(plan, source, Runner(plan, make_backend("cpu"), seed=0), optimizer, steps=2, seed=0,
                         tolerance=1e-5)
        assert good.passed, good.table()
    broken = _stale(plan, what)
    report = run_check(broken, source, Runner(broken, make_backend("cpu"), seed=0), optimizer, steps=2, seed=0,
                       tolerance=1e-5)
    assert not report.passed
    row = report.rows[1 + int(step)]
    assert row.update.value > 1e-5 and row.grads.value <= 1e-5, report.table()  # only the update is wrong
    if what == "master":  # the first update is right; the second starts from the stale copy
        assert report.rows[1].update.value <= 1e-5, report.table()


def test_advice_proposes_offload_when_it_is_the_cheapest_change_that_fits(tmp_path):
    # mlp on one device: 110 kB at its peak (the fused update allocates nothing), 82 kB with the
    # optimizer on the host; recompute frees nothing there, so offload is the first change that fits 100 KB
    from conftest import sbpc
    out = sbpc("compile", "examples/mlp.py", "--device-memory", "100KB", "-o", str(tmp_path / "p.json"))
    assert out.returncode == 2
    assert "its biggest term is optimizer" in out.stderr
    assert "hint: the cheapest change that fits: --offload optimizer (" in out.stderr, out.stderr


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_pipelined_offload_transfers_host_values_to_host_readers(precision):
    """Under offload a pipeline sends values the optimizer makes on the host (a bias correction
    from the shared step counter, fp16's skip verdict, the new counter itself) to another
    stage's host optimizer or host state.
    ``host_transfers`` names exactly those: the receiver puts them back in host memory after
    NCCL (which moves device memory only) and every reader of them runs on the host, while every
    other transfer (activations, gradients) has device readers only."""
    from sbpc.compiler.passes import PipelineOptions
    from sbpc.runtime.kinds import Precision
    from sbpc.runtime.pipeline import host_transfers, instruction_uses
    from sbpc.runtime.pipeline_tasks import TRANSFER

    source = load_model("examples/gpt.py", {})
    plan = compile_model(source, parse_mesh("1x1x2"), batch_size=8, optimizer=OptimizerConfig(),
                         memory=MemoryOptions(offload="optimizer", precision=Precision(precision)),
                         pipeline=PipelineOptions(microbatches=2)).plan
    host = host_transfers(plan)
    transfers = {o for st in plan.stages for ins in st.instructions if ins.op == TRANSFER for o in ins.outs}
    specs = {s.name: s for s in [*plan.params, *plan.states]}
    # a transfer's readers: the instructions that read it, and the state or parameter it becomes
    # on a stage that holds a copy (a replica: the shared step counter, a tied weight)
    readers = {t: {ins.memory for st in plan.stages for ins in st.instructions if t in instruction_uses(ins)}
               | {specs[r.name].memory for r in plan.pipeline.replicas if r.value == t} for t in transfers}
    assert host and host < transfers
    for t in transfers:
        assert readers[t] == ({MemoryKind.HOST} if t in host else {MemoryKind.DEVICE}), (t, readers[t])
    on_device = compile_model(source, parse_mesh("1x1x2"), batch_size=8, optimizer=OptimizerConfig(),
                              pipeline=PipelineOptions(microbatches=2)).plan
    assert not host_transfers(on_device)
