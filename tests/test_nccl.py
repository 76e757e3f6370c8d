"""The NCCL watchdog, and the whole NcclCommunicator (runtime/nccl.py) over a fake NCCL: ranks are threads, memory is
CPU memory, so the communicator's bookkeeping, streams/events protocol, issued work and the
cuda backend's end-to-end training run without a GPU (tests/test_cuda.py has the rest)."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from conftest import compile_example
from fake_nccl import _on_fake_ranks, fake_cuda  # noqa: F401 - fake_cuda is a fixture
from sbpc.errors import PlanError, RuntimeFailure
from sbpc.runtime.nccl_setup import CommSpec, Watchdog
from sbpc.runtime.topology import Topology


# --- the watchdog ---------------------------------------------------------------------------

class FakeWork:
    def __init__(self, spec, op, started, finished=False):
        self.spec, self.op, self.started, self.finished = spec, op, started, finished

    def done(self):
        return self.finished


def _watchdog(**kw):
    calls = []
    clock = [100.0]
    dog = Watchdog(0, 30.0, abort=lambda: calls.append("abort"), clock=lambda: clock[0], **kw)
    return dog, calls, clock


def test_watchdog_names_the_peer_of_a_stuck_collective_and_aborts():
    dog, calls, clock = _watchdog()
    dog.track(FakeWork(CommSpec((0, 1), "dp"), "all_reduce", started=100.0))
    clock[0] = 129.0
    assert dog.check_once() is None and calls == []
    clock[0] = 131.0
    err = dog.check_once()
    assert "all_reduce over mesh axis dp (ranks (0, 1)) failed on rank 0: no answer from rank 1 within 30s" in str(err)
    assert calls == ["abort"] and err.peer == 1 and err.timed_out
    with pytest.raises(RuntimeFailure, match="no answer from rank 1"):
        dog.track(FakeWork(CommSpec((0, 1), "dp"), "all_gather", started=131.0))  # the next call raises
    assert dog.picked_up


def test_watchdog_forgets_finished_work_and_names_a_failed_peer():
    failed = {}
    dog, calls, clock = _watchdog(peer_failure=lambda ranks: next(((r, failed[r]) for r in ranks if r in failed), None))
    done = FakeWork(CommSpec((0, 1), "dp"), "all_reduce", started=0.0, finished=True)
    dog.track(done)
    assert dog.check_once() is None and not dog.pending  # finished long ago: not a hang
    dog.track(FakeWork(CommSpec((0, 2, 4), "tp"), "reduce_scatter", started=100.0))
    assert dog.check_once() is None
    failed[4] = "RuntimeFailure: CUDA out of memory"
    assert dog.check_once() is None  # pending for less than a second: the store is not asked yet
    clock[0] = 101.5
    err = dog.check_once()
    assert "reduce_scatter over mesh axis tp (ranks (0, 2, 4)) failed on rank 0: rank 4 failed: " \
           "RuntimeFailure: CUDA out of memory" in str(err)
    assert calls == ["abort"] and err.peer == 4


def test_watchdog_reports_nccl_async_errors_and_a_group_timeout_names_all_peers():
    dog, calls, clock = _watchdog(async_error=lambda: "remote process exited or there was a network error")
    dog.track(FakeWork(CommSpec((0, 1), None), "send of %x", started=100.0))
    assert "send of %x over transfer rank 0 -> rank 1 failed on rank 0: NCCL: remote process exited" in str(dog.check_once())
    dog, calls, clock = _watchdog()
    dog.track(FakeWork(CommSpec((0, 1, 2), "dp"), "all_gather", started=100.0))
    clock[0] = 200.0
    assert "no answer from one of ranks (1, 2) within 30s" in str(dog.check_once())


def test_watchdog_thread_ends_a_process_the_abort_did_not_free():
    stuck = []
    dog = Watchdog(0, 0.05, abort=lambda: None, on_stuck=stuck.append, poll=0.01, grace=0.05)
    dog.start()
    dog.track(FakeWork(CommSpec((0, 1), "dp"), "all_reduce", started=time.monotonic()))
    deadline = time.monotonic() + 5
    while not stuck and time.monotonic() < deadline:
        time.sleep(0.01)
    dog.stop()
    assert stuck and "no answer from rank 1" in str(stuck[0])


def test_watchdog_thread_takes_the_ranks_gpu_before_any_cuda_call(monkeypatch):
    """The watchdog's thread runs ``on_start`` first, in itself: the communicator's makes the
    rank's GPU current there (a new thread is on GPU 0, where its event queries and NCCL's
    abort would create a context on every rank of the node)."""
    from sbpc.runtime.nccl import use_device

    where = []
    dog = Watchdog(0, 30.0, abort=lambda: None, poll=0.01, on_start=lambda: where.append(threading.current_thread()))
    dog.start()
    dog.stop()
    assert where == [dog._thread] and where[0] is not threading.current_thread()
    picked = []
    monkeypatch.setattr(torch.cuda, "set_device", picked.append)
    use_device(torch.device("cuda", 3))
    use_device(torch.device("cpu"))  # the fake NCCL's ranks: no GPU to pick
    assert picked == [torch.device("cuda", 3)]


@pytest.mark.parametrize("form", [tuple, bytes], ids=["older-cupy-tuple-id", "newer-cupy-bytes-id"])
def test_nccl_communicator_collectives_on_a_dp_tp_mesh(fake_cuda, form):
    fake_cuda.form = form
    axes = (("dp", 2), ("tp", 2))

    def x_of(rank):
        return torch.arange(24, dtype=torch.float32).reshape(4, 6) * (rank + 1)

    def body(comm):
        tp, dp = comm.topology.group("tp"), comm.topology.group("dp")
        x = x_of(comm.rank)
        return {"sum": comm.all_reduce(x, tp), "max": comm.all_reduce(-x, dp, "max"),
                "gather": comm.all_gather(x, tp, 1), "scatter": comm.reduce_scatter(x, dp, 0),
                "a2a": comm.all_to_all(x, tp, 1, 0), "bf16": comm.all_reduce(x.bfloat16(), tp),
                "async": comm.start("all_gather", x, dp, dim=0).wait(), "alone": comm.all_reduce(x, (comm.rank,))}

    out = _on_fake_ranks(fake_cuda, axes, body, 4)
    topo = Topology(axes, 0)
    for r, got in out.items():
        t = Topology(axes, r)
        tp, dp = t.group("tp"), t.group("dp")
        assert torch.equal(got["sum"], sum(x_of(m) for m in tp))
        assert torch.equal(got["max"], torch.stack([-x_of(m) for m in dp]).amax(0))
        assert torch.equal(got["gather"], torch.cat([x_of(m) for m in tp], dim=1))
        assert torch.equal(got["scatter"], sum(x_of(m) for m in dp).chunk(2, dim=0)[dp.index(r)])
        assert torch.equal(got["a2a"], torch.cat([x_of(m).chunk(2, dim=1)[tp.index(r)] for m in tp], dim=0))
        assert torch.equal(got["bf16"], sum(x_of(m) for m in tp).bfloat16())
        assert torch.equal(got["async"], torch.cat([x_of(m) for m in dp], dim=0))
        assert torch.equal(got["alone"], x_of(r))
    assert topo.world_size == 4


def test_nccl_communicator_transfers_both_ways_between_stages(fake_cuda):
    axes = (("pp", 2), ("dp", 1))

    def body(comm):
        peer = 1 - comm.rank
        mine = torch.full((3, 2), float(comm.rank + 10))
        handle = comm.send(mine, peer, tag=1, what=f"activation to {peer}")
        early = comm.post_recv([3, 2], torch.float32, peer)
        got = early.wait()
        handle.wait()
        return got

    out = _on_fake_ranks(fake_cuda, axes, body, 2)
    assert torch.equal(out[0], torch.full((3, 2), 11.0)) and torch.equal(out[1], torch.full((3, 2), 10.0))


def test_nccl_communicator_refuses_a_group_it_has_not(fake_cuda):
    def body(comm):
        with pytest.raises(PlanError, match=r"all_reduce over ranks \(0, 3\): rank 0 has no NCCL communicator"):
            comm.all_reduce(torch.ones(2), (0, 3))
        with pytest.raises(PlanError, match="no NCCL communicator for rank 0 -> rank 1"):
            comm.send(torch.ones(2), 1)  # no pp axis: no transfers
        return True

    assert _on_fake_ranks(fake_cuda, (("dp", 2),), lambda c: body(c) if c.rank == 0 else True, 2) == {0: True, 1: True}


def test_nccl_communicator_refuses_a_tensor_off_its_device(fake_cuda):
    """NCCL reads raw pointers as device memory: a tensor elsewhere (a host value that a
    pipeline forgot to move; here the meta device stands for it) is one line naming the call."""
    def send(comm):
        with pytest.raises(RuntimeFailure, match=r"send of %x over .* a tensor in meta memory, where NCCL moves cpu's"):
            comm.send(torch.ones(2, device="meta"), 1 - comm.rank, what="send of %x")
        return True

    def all_reduce(comm):
        with pytest.raises(RuntimeFailure, match="all_reduce over .* a tensor in meta memory"):
            comm.all_reduce(torch.ones(2, device="meta"), (0, 1))
        return True

    assert _on_fake_ranks(fake_cuda, (("pp", 2), ("dp", 1)), send, 2) == {0: True, 1: True}
    assert _on_fake_ranks(fake_cuda, (("dp", 2),), all_reduce, 2) == {0: True, 1: True}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gpu_checks_one_rank_communicator_over_the_fake_nccl(fake_cuda, dtype):
    """What bench/gpu_check.py runs on NCCL at world size 1, here over the fake: every
    collective of a one-rank group is its input, and the grouped send to itself arrives."""
    from sbpc.runtime.nccl import self_communicator

    comm = self_communicator(torch.device("cpu"), nccl=fake_cuda)
    try:
        x = torch.arange(24, dtype=torch.float32).reshape(4, 6).to(dtype)
        for got in (comm.all_reduce_async(x, (0,)).wait(), comm.all_reduce_async(x, (0,), "max").wait(),
                    comm.all_gather_async(x, (0,), 1).wait(), comm.reduce_scatter_async(x, (0,), 0).wait(),
                    comm.all_to_all_async(x, (0,), 1, 0).wait(), comm.self_transfer(x)):
            assert got.dtype == dtype and torch.equal(got, x)
    finally:
        comm.close()


def test_the_cuda_backend_trains_a_2x2_plan_over_the_fake_nccl(fake_cuda):
    """The cuda code path end to end without a GPU: CudaBackend (its kernel table, the CPU init,
    the collectives bound to it) over NcclCommunicator (fake NCCL, CPU tensors), four ranks as
    threads on mesh 2x2; the losses are the one-device plan's on the whole batch."""
    from sbpc.compiler.driver import compile_model
    from sbpc.compiler.frontend.model_loader import load_model
    from sbpc.compiler.frontend.optim import OptimizerConfig
    from sbpc.compiler.ir.mesh import parse_mesh
    from sbpc.runtime.backend import make_backend
    from sbpc.runtime.cuda import CudaBackend
    from sbpc.runtime.runner import BatchSource, make_runner

    one, _, _ = compile_example("mlp.py")
    mesh = compile_model(load_model("examples/mlp.py", {}), parse_mesh("2x2"), batch_size=4,
                         optimizer=OptimizerConfig()).plan
    # it communicates (collectives are issued early and waited for late: the overlap pass)
    assert any(ins.op.startswith("sbpc.all_") or ins.op == "sbpc.issue" for ins in mesh.stages[0].instructions)
    batches = [BatchSource(one.plan, 0)(i) for i in range(3)]  # made here: threads share torch's RNG
    ref = make_runner(one.plan, make_backend("cpu"), seed=0)
    want = [ref.step(b).loss for b in batches]
    axes = tuple((a.name, a.size) for a in mesh.mesh)

    def body(comm):
        runner = make_runner(mesh, CudaBackend(comm, comm.topology, device=torch.device("cpu")), seed=0)
        return [runner.step(b).loss for b in batches]

    got = _on_fake_ranks(fake_cuda, axes, body, 4)
    for rank in range(4):
        assert got[rank] == pytest.approx(want, rel=1e-6, abs=1e-7), rank
    kinds = {what for (_, _, what) in fake_cuda.fabric.calls}
    assert "allReduce" in kinds, kinds  # the gradients and the loss went through the fake NCCL


def test_a_megatron_sp_gpt_on_2x2_trains_over_the_fake_nccl(fake_cuda, monkeypatch):
    """Tensor parallelism over NcclCommunicator: gathers and reduce-scatters along dims 0 and 1
    (strided chunks included), coalesced buckets, on dp and tp; the losses are the one-device
    plan's. Attention runs the CPU kernels here (the CUDA ones need a GPU: tests/test_cuda.py)."""
    from sbpc.compiler.driver import compile_model
    from sbpc.compiler.frontend.hints import load_config
    from sbpc.compiler.frontend.model_loader import load_model
    from sbpc.compiler.frontend.optim import OptimizerConfig
    from sbpc.compiler.ir.mesh import parse_mesh
    from sbpc.runtime import cpu, cuda
    from sbpc.runtime.backend import make_backend
    from sbpc.runtime.runner import BatchSource, make_runner

    monkeypatch.setattr(cuda, "attention", cpu._attention)
    monkeypatch.setattr(cuda, "attention_backward", cpu._attention_backward)
    source = load_model("examples/gpt.py", {"sp": True})
    one = compile_model(source, parse_mesh("1"), batch_size=4, optimizer=OptimizerConfig()).plan
    plan = compile_model(source, parse_mesh("2x2"), batch_size=4, optimizer=OptimizerConfig(),
                         config=load_config("examples/gpt.megatron.toml")).plan
    issued = [(i.kwargs["kind"], i.kwargs.get("dim")) for i in plan.stages[0].instructions if i.op == "sbpc.issue"]
    assert ("all_gather", 1) in issued and ("reduce_scatter", 1) in issued and ("all_gather", 0) in issued
    batches = [BatchSource(one, 0)(i) for i in range(2)]
    ref = make_runner(one, make_backend("cpu"), seed=0)
    want = [ref.step(b).loss for b in batches]

    def body(comm):
        runner = make_runner(plan, cuda.CudaBackend(comm, comm.topology, device=torch.device("cpu")), seed=0)
        return [runner.step(b).loss for b in batches]

    got = _on_fake_ranks(fake_cuda, tuple((a.name, a.size) for a in plan.mesh), body, 4)
    for rank in range(4):
        assert got[rank] == pytest.approx(want, rel=1e-5), rank


def test_pipelined_transfers_are_fifo_per_pair_and_a_plan_that_is_not_is_refused():
    """NCCL matches a pair's transfers in issue order: the compiler's interleaved schedule is
    first-in first-out per (sender, receiver); an order that receives micro-batch 1 before 0 is
    refused for cuda, naming the pair and the transfer."""
    from sbpc.compiler.driver import compile_model
    from sbpc.compiler.frontend.model_loader import load_model
    from sbpc.compiler.frontend.optim import OptimizerConfig
    from sbpc.compiler.ir.mesh import parse_mesh
    from sbpc.compiler.passes import PipelineOptions
    from sbpc.runtime.cuda import require_fifo_transfers
    from sbpc.runtime.kinds import ScheduleName
    from sbpc.runtime.pipeline import fifo_mismatch, transfer_sequences

    plan = compile_model(load_model("examples/gpt.py", {"layers": 4}), parse_mesh("1x1x2"), batch_size=4,
                         optimizer=OptimizerConfig(),
                         pipeline=PipelineOptions(ScheduleName.INTERLEAVED, virtual_stages=2, microbatches=2)).plan
    sent, received = transfer_sequences(plan)
    assert set(sent) == {(0, 1), (1, 0)} and sent == received
    assert fifo_mismatch(plan) is None
    require_fifo_transfers(plan)
    # stage 1 runs its first forward of micro-batch 1 before that of micro-batch 0
    order = [list(stage) for stage in plan.pipeline.order]
    first = [i for i, t in enumerate(order[1]) if t.phase == "fwd" and t.chunk == 1]
    i, j = first[0], first[1]
    assert (order[1][i].mb, order[1][j].mb) == (0, 1)
    order[1][i], order[1][j] = order[1][j], order[1][i]
    swapped = plan.model_copy(update={"pipeline": plan.pipeline.model_copy(update={"order": order})})
    why = fifo_mismatch(swapped)
    assert why is not None and why.startswith("stage 0 -> stage 1: transfer 0 is sent as %") and "micro-batch 0" in why
    with pytest.raises(PlanError, match="not first-in first-out, which NCCL needs: stage 0 -> stage 1"):
        require_fifo_transfers(swapped)


@pytest.mark.parametrize("offload", ["none", "optimizer"])
def test_an_interleaved_pipeline_trains_over_the_fake_nccl(fake_cuda, monkeypatch, offload):
    """Pipeline parallelism over NcclCommunicator: every activation, gradient and optimizer
    scalar crosses stages as an NCCL send and receive on the pair's own communicator, matched
    in issue order (the fake's mailboxes are first-in first-out, as NCCL is: no tags), posted
    one task early; interleaved, 2 chunks a stage, 4 micro-batches; the losses are the
    one-device plan's."""
    from sbpc.compiler.driver import compile_model
    from sbpc.compiler.frontend.model_loader import load_model
    from sbpc.compiler.frontend.optim import OptimizerConfig
    from sbpc.compiler.ir.mesh import parse_mesh
    from sbpc.compiler.memory_options import MemoryOptions
    from sbpc.compiler.passes import PipelineOptions
    from sbpc.runtime import cpu, cuda
    from sbpc.runtime.backend import Backend, make_backend
    from sbpc.runtime.kinds import ScheduleName
    from sbpc.runtime.runner import BatchSource, make_runner

    monkeypatch.setattr(cuda, "attention", cpu._attention)
    monkeypatch.setattr(cuda, "attention_backward", cpu._attention_backward)
    monkeypatch.setattr(cuda.CudaBackend, "to_host", Backend.to_host)  # pinned memory needs a GPU
    source = load_model("examples/gpt.py", {"layers": 4})
    memory = MemoryOptions(offload=offload)
    one = compile_model(source, parse_mesh("1"), batch_size=8, optimizer=OptimizerConfig(), memory=memory).plan
    plan = compile_model(source, parse_mesh("1x1x2"), batch_size=8, optimizer=OptimizerConfig(), memory=memory,
                         pipeline=PipelineOptions(ScheduleName.INTERLEAVED, virtual_stages=2, microbatches=4)).plan
    cuda.require_fifo_transfers(plan)
    batches = [BatchSource(one, 0)(i) for i in range(2)]
    ref = make_runner(one, make_backend("cpu"), seed=0)
    want = [ref.step(b).loss for b in batches]

    def body(comm):
        runner = make_runner(plan, cuda.CudaBackend(comm, comm.topology, device=torch.device("cpu")), seed=0)
        return [runner.step(b).loss for b in batches]

    got = _on_fake_ranks(fake_cuda, tuple((a.name, a.size) for a in plan.mesh), body, 2)
    for rank in range(2):
        assert got[rank] == pytest.approx(want, rel=1e-5), rank
    sends = [k for k in fake_cuda.fabric.mail]
    assert sends and all(not box for box in fake_cuda.fabric.mail.values())  # every send was received
