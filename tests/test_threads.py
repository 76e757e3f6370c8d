"""In-process ranks (runtime/threads.py): the thread communicator against gloo op by op, the
failure and hang naming, per-rank random streams, and a plan run on threads that gives gloo's
losses bit for bit.

The gloo side is one launch of real processes per comparison (they cost a torch import each);
every other test runs in this process in well under a second.
"""
from __future__ import annotations

import re
import threading
import time

import pytest
import torch

from sbpc.errors import PlanError, RuntimeFailure
from sbpc.runtime.launch import launch
from sbpc.runtime.thread_launch import launch_threads

TIMEOUT = 60.0
MESH_2X3 = [("dp", 2), ("tp", 3)]  # dp groups of 2 ranks, tp groups of 3


def _data(rank: int, salt: int, *shape: int) -> torch.Tensor:
    """Values of mixed magnitude, so that a different summation order shows in the last bits."""
    g = torch.Generator().manual_seed(1000 * salt + rank)
    return torch.randn(*shape, generator=g) * torch.logspace(-3, 3, shape[-1]) + torch.randn(*shape, generator=g)


def op_results(payload) -> list[tuple[str, torch.Tensor]]:
    """Every communicator op on a 2 x 3 mesh with uneven shapes; runs on gloo ranks or threads."""
    from sbpc.runtime.dist import init_distributed

    comm = init_distributed(MESH_2X3, timeout=payload["timeout"])
    topo, r, out = comm.topology, comm.rank, []
    for axis in ("dp", "tp"):
        group = topo.group(axis)
        out += [
            (f"all_reduce sum {axis}", comm.all_reduce(_data(r, 1, 5, 7), group)),
            (f"all_reduce max {axis}", comm.all_reduce(_data(r, 2, 5, 7), group, "max")),
            (f"all_gather dim 0 {axis}", comm.all_gather(_data(r, 3, 5, 7), group, 0)),
            (f"all_gather dim 1 {axis}", comm.all_gather(_data(r, 4, 5, 7).t(), group, 1)),  # non-contiguous
            (f"reduce_scatter dim 0 {axis}", comm.reduce_scatter(_data(r, 5, 6, 5), group, 0)),
            (f"reduce_scatter max dim 1 {axis}", comm.reduce_scatter(_data(r, 6, 5, 12), group, 1, "max")),
            (f"all_to_all 0->1 {axis}", comm.all_to_all(_data(r, 7, 6, 5), group, 0, 1)),
            (f"all_to_all 1->0 {axis}", comm.all_to_all(_data(r, 8, 5, 6, 3), group, 1, 0)),
        ]
    # issued collectives (the overlap pass's sbpc.issue / sbpc.wait): three in flight on both
    # axes at once, waited for in the reverse order, with a blocking one in between
    dp, tp = topo.group("dp"), topo.group("tp")
    works = [("all_reduce sum dp issued", comm.start("all_reduce", _data(r, 13, 4, 5), dp, op="sum")),
             ("all_gather dim 1 tp issued", comm.start("all_gather", _data(r, 14, 3, 2), tp, dim=1)),
             ("reduce_scatter dim 0 tp issued", comm.start("reduce_scatter", _data(r, 15, 6, 2), tp, dim=0, op="sum"))]
    out.append(("blocking all_reduce between", comm.all_reduce(_data(r, 16, 3), dp)))
    out += [(name, w.wait()) for name, w in reversed(works)]
    # point to point around the ring, two tags sent out of order; the send is waited last
    right, left = (r + 1) % comm.world_size, (r - 1) % comm.world_size
    pending = [comm.send(_data(r, 9, 3, 4), right, tag=2), comm.send(_data(r, 10, 2), right, tag=1)]
    out.append(("recv tag 1", comm.recv([2], torch.float32, left, tag=1)))
    out.append(("recv tag 2", comm.recv([3, 4], torch.float32, left, tag=2)))
    for p in pending:
        p.wait()
    out.append(("broadcast from 4", comm.broadcast(_data(r, 11, 4, 3), 4)))
    gathered = comm.gather_objects({"rank": r, "t": _data(r, 12, 2)}, 0)
    if r == 0:
        out += [(f"gather_objects {g['rank']}", g["t"]) for g in gathered]
    comm.barrier()
    return out


@pytest.fixture(scope="module")
def gloo_results():
    return launch(6, "test_threads:op_results", {"timeout": TIMEOUT}, timeout=TIMEOUT)


def test_the_thread_communicator_equals_gloo_op_by_op(gloo_results):
    threads = launch_threads(6, op_results, {"timeout": TIMEOUT}, timeout=TIMEOUT)
    compared = 0
    last_bit = []
    for rank, (mine, theirs) in enumerate(zip(threads, gloo_results)):
        assert [name for name, _ in mine] == [name for name, _ in theirs]
        for (name, a), (_, b) in zip(mine, theirs):
            assert a.dtype == b.dtype and a.shape == b.shape, (rank, name)
            compared += 1
            if torch.equal(a, b):
                continue
            # gloo's ring adds three ranks' values in ring order per segment, threads in rank
            # order: only those sums may differ, and only by rounding
            assert name.startswith(("all_reduce sum tp", "reduce_scatter dim 0 tp")), (rank, name)
            assert float((a - b).abs().max() / b.abs().max()) < 1e-6, (rank, name)
            last_bit.append((rank, name))
    assert compared == 6 * 23 + 6  # 23 ops per rank (4 of them issued ones), 6 gathered objects on rank 0
    print(f"{compared} results compared; bit-identical except {len(last_bit)} three-rank sums: {sorted(set(n for _, n in last_bit))}")


# ----- failures: nothing hangs, the culprit is named

def misbehave(payload, release: threading.Event | None = None):
    """Rank ``victim`` misbehaves (``mode``); the others wait for it in an all_reduce over dp."""
    from sbpc.runtime.dist import init_distributed

    comm = init_distributed([("dp", payload["ranks"])], timeout=payload["timeout"])
    group = tuple(range(payload["ranks"]))
    if comm.rank == payload["victim"]:
        mode = payload["mode"]
        if mode == "sbpc":
            raise PlanError("the plan is bad", hint="fix it")
        if mode == "raise":
            raise ValueError("boom\nsecond line")
        if mode == "hang":
            release.wait(60)  # holds the baton: nobody else runs meanwhile
        if mode == "return":
            return comm.rank
        if mode == "other op":
            return comm.all_gather(torch.ones(3), group, 0)
        if mode == "other shape":
            return comm.all_reduce(torch.ones(4), group)
    return comm.all_reduce(torch.ones(3), group)


def _misbehave(mode: str, ranks: int = 3, victim: int = 1, timeout: float = TIMEOUT):
    payload = {"ranks": ranks, "victim": victim, "mode": mode, "timeout": timeout}
    release = threading.Event()
    start = time.monotonic()
    try:
        with pytest.raises(RuntimeFailure if mode != "sbpc" else PlanError) as info:
            if mode == "hang":
                launch_threads(ranks, lambda p: misbehave(p, release), payload, timeout=timeout)
            else:
                launch(ranks, "test_threads:misbehave", payload, timeout=timeout, ranks="threads")
    finally:
        release.set()  # the hung thread ends
    return str(info.value), info.value, time.monotonic() - start


def test_an_sbpc_error_comes_back_whole_with_its_rank_and_the_others_stop_waiting():
    text, err, took = _misbehave("sbpc", victim=2)
    assert text == "rank 2: the plan is bad; hint: fix it" and err.rank == 2
    assert took < 5  # the waiting ranks ended at once, not after the 60 s timeout


def test_another_exception_is_named_with_its_first_line():
    text, err, took = _misbehave("raise")
    assert text.startswith("rank 1 failed: ValueError: boom; hint:") and err.rank == 1
    assert "second line" in err.detail and took < 5


def test_a_hung_rank_is_named_after_the_timeout_like_on_gloo():
    # the same message as tests/test_dist.py's gloo launch gives
    text, err, took = _misbehave("hang", ranks=2, timeout=1)
    assert re.match(r"rank 1 hung: rank 0 gave up waiting for it after 1s \(all_reduce over mesh axis dp \(ranks "
                    r"\(0, 1\)\) failed on rank 0: no answer from rank 1 within 1s \(it hung or died\)\)", text), text
    assert err.rank == 1 and took < 10


def test_a_hung_rank_0_is_named_by_the_rank_that_waited_to_run():
    text, err, _ = _misbehave("hang", ranks=2, victim=0, timeout=1)
    assert text.startswith("rank 0 hung: rank 1 gave up waiting for it after 1s (start of rank 1 failed on rank 1: "
                           "no answer from rank 0 within 1s"), text
    assert err.rank == 0


def pipeline_misbehave(payload):
    """Rank 0 sends to rank 1 and receives its answer; rank 1 fails or leaves instead."""
    from sbpc.runtime.dist import init_distributed

    comm = init_distributed([("pp", 2)], timeout=payload["timeout"])
    if comm.rank == 0:
        sent = comm.send(torch.ones(2), 1, tag=7, what="send of %x")
        if payload["mode"] == "raise":
            return comm.recv([2], torch.float32, 1, tag=8, what="recv of %y")
        sent.wait()
        return None
    if payload["mode"] == "raise":
        raise KeyError("lost")
    return None  # "leave": never receives


@pytest.mark.parametrize("mode,message", [
    ("raise", r"rank 1 failed: KeyError: 'lost'"),
    ("leave", r"rank 0: send of %x over mesh axis pp \(ranks \(0, 1\)\) failed on rank 0: rank 1 returned without joining it"),
])
def test_point_to_point_waits_end_naming_the_peer(mode, message):
    start = time.monotonic()
    with pytest.raises(RuntimeFailure, match=f"^{message}"):
        launch_threads(2, pipeline_misbehave, {"mode": mode, "timeout": TIMEOUT}, timeout=TIMEOUT)
    assert time.monotonic() - start < 5


def test_a_rank_that_returns_while_its_peers_wait_is_named():
    text, err, took = _misbehave("return", ranks=2)
    assert text.startswith("rank 0: all_reduce over mesh axis dp (ranks (0, 1)) failed on rank 0: rank 1 returned "
                           "without joining it"), text
    assert took < 5


@pytest.mark.parametrize("mode,called", [("other op", "all_gather float32 [3] 0"), ("other shape", "all_reduce float32 [4] sum")])
def test_ranks_calling_different_collectives_fail_naming_both(mode, called):
    text, _, took = _misbehave(mode, ranks=2)
    assert re.match(r"rank [01]: (all_reduce|all_gather) over mesh axis dp \(ranks \(0, 1\)\) failed on rank [01]: rank \d called ",
                    text), text
    assert called in text and "all_reduce float32 [3] sum" in text and took < 5


def test_a_rank_thread_outside_a_launch_joins_gloo_as_before():
    from sbpc.runtime.thread_launch import rank_thread_communicator

    assert rank_thread_communicator((("dp", 2),), 1.0) is None


def test_an_unknown_rank_mode_is_a_usage_error():
    from sbpc.errors import UsageError

    with pytest.raises(UsageError, match="ranks 'thread' is not one of processes, threads"):
        launch(2, "test_threads:misbehave", {}, timeout=1, ranks="thread")


# ----- what makes threads stand in for processes: own random streams, own output

def random_streams(payload):
    """Seed, draw, communicate, draw: each rank's draws must be those of its seed alone."""
    from sbpc.runtime.dist import init_distributed

    comm = init_distributed([("dp", 3)], timeout=TIMEOUT)
    torch.manual_seed(comm.rank)
    a = torch.rand(4)
    comm.barrier()
    b = torch.randn(4)
    comm.all_reduce(torch.ones(1), (0, 1, 2))
    print(f"rank {comm.rank} drew")
    return torch.cat([a, b, torch.rand(2)])


def test_each_rank_thread_has_its_own_random_stream_and_output():
    lines = []
    got = launch_threads(3, random_streams, None, timeout=TIMEOUT, on_output=lambda r, line: lines.append((r, line)))
    for rank, t in enumerate(got):
        torch.manual_seed(rank)
        assert torch.equal(t, torch.cat([torch.rand(4), torch.randn(4), torch.rand(2)])), rank
    assert sorted(lines) == [(r, f"rank {r} drew\n") for r in range(3)]


def test_the_callers_random_state_and_threads_are_restored():
    torch.manual_seed(5)
    threads = torch.get_num_threads()
    launch_threads(3, random_streams, None, timeout=TIMEOUT, on_output=lambda r, line: None, threads=1)
    assert torch.get_num_threads() == threads
    after = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(after, torch.rand(3))


# ----- a plan on threads: gloo's losses bit for bit, and a passing check

def _pipelined_plan(tmp_path):
    from sbpc.compiler.driver import compile_model
    from sbpc.compiler.frontend.model_loader import load_model
    from sbpc.compiler.frontend.optim import OptimizerConfig
    from sbpc.compiler.ir.mesh import parse_mesh
    from sbpc.compiler.passes import PipelineOptions
    from sbpc.runtime.plan import save_plan

    source = load_model("examples/gpt.py", {"hidden": 32, "heads": 2, "vocab": 64, "seq": 16, "layers": 2})
    plan = compile_model(source, parse_mesh("2x1x2"), batch_size=8, optimizer=OptimizerConfig(),
                         pipeline=PipelineOptions(microbatches=2)).plan
    path = tmp_path / "plan.json"
    save_plan(plan, str(path))
    return plan, path


def test_a_pipelined_data_parallel_plan_gives_gloos_losses_bit_for_bit_on_threads(tmp_path):
    """Sends and receives with tags, isend handles, broadcasts, dp all-reduces of 2 ranks:
    the thread run must be the process run exactly. One real 4-process gloo launch."""
    _, path = _pipelined_plan(tmp_path)
    payload = {"plan": str(path), "steps": 2, "seed": 0, "backend": "cpu", "weights": None, "save": None,
               "threads": None, "timeout": TIMEOUT, "debug": False, "trace": None}
    quiet = lambda r, line: None  # noqa: E731
    on_gloo = launch(4, "sbpc.runtime.cli:run_rank", payload, timeout=TIMEOUT, on_output=quiet)
    on_threads = launch(4, "sbpc.runtime.cli:run_rank", payload, timeout=TIMEOUT, on_output=quiet, ranks="threads")
    assert [r["losses"] for r in on_threads] == [r["losses"] for r in on_gloo]
    assert len({tuple(r["losses"]) for r in on_threads}) == 1  # every rank reports the step's loss


def test_check_on_threads_passes_a_pipelined_plan_and_matches_eager(tmp_path):
    from sbpc.compiler.frontend.optim import OptimizerConfig
    from sbpc.compiler.tools.check import check_on_ranks

    plan, _ = _pipelined_plan(tmp_path)
    report = check_on_ranks(plan, OptimizerConfig(), steps=2, seed=0, tolerance=1e-5,
                            timeout=TIMEOUT, ranks="threads")
    assert report.passed, report.table()
    assert [row.step for row in report.rows] == ["init", "0", "1"]
