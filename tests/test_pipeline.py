"""Pipeline schedules: the actor simulation, the deadlock proof, traces, and failure on ranks.

Parity of pipelined plans with eager PyTorch is in test_pipeline_parity.py.
"""
import json
import os
import re
import time

import pytest
import torch

from conftest import sbpc
from sbpc.compiler.pipelining.schedule_sim import regsts, simulate
from sbpc.errors import CompileError, PlanError, RuntimeFailure
from sbpc.runtime.launch import launch
from sbpc.runtime.pipeline_tasks import Item, Task, TaskGraph, fmt, replay

TIMEOUT = 120


def chain(chunks: int, m: int) -> TaskGraph:
    """A pipeline of ``chunks`` chunks: forward c reads forward c-1's activation, backward c
    reads backward c+1's gradient and its own forward; the last forward makes the loss."""
    items, i = [], 0

    def add(op, outs, uses, phase, chunk, src=None):
        nonlocal i
        items.append(Item(i, op, tuple(outs), tuple(uses), phase, chunk, src))
        i += 1

    for c in range(chunks):
        x = "x" if c == 0 else f"a{c - 1}_in"
        if c:
            add("sbpc.transfer", [x], [f"a{c - 1}"], "fwd", c, c - 1)
        add("aten.relu.default", [f"a{c}"], [x], "fwd", c)
    for c in reversed(range(chunks)):
        g = f"a{c}" if c == chunks - 1 else f"g{c + 1}_in"
        if c < chunks - 1:
            add("sbpc.transfer", [g], [f"g{c + 1}"], "bwd", c, c + 1)
        add("aten.mul.Tensor", [f"g{c}"], [g, f"a{c}"], "bwd", c)
        add("sbpc.mb_accumulate", [f"acc{c}"], [f"g{c}"], "opt", c)
    return TaskGraph(items, [f"acc{c}" for c in range(chunks)], m)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8), (4, 16), (8, 32)])
def test_bubble_matches_the_analytic_fraction(schedule, p, m):
    sim = simulate(chain(p, m), schedule, p, 1)
    analytic = (p - 1) / (m + p - 1)
    assert sim.bubble() == pytest.approx(analytic, rel=0.05)


@pytest.mark.parametrize("p,m,v", [(4, 8, 2), (4, 16, 2), (4, 16, 4), (2, 8, 2)])
def test_interleaving_divides_the_bubble_by_about_v(p, m, v):
    plain = simulate(chain(p, m), "1f1b", p, 1).bubble()
    inter = simulate(chain(p * v, m), "interleaved", p, v).bubble()
    assert inter == pytest.approx((p - 1) / v / (m + (p - 1) / v), rel=0.05)  # Megatron's interleaved bubble
    assert inter == pytest.approx(plain / v, rel=0.2)


@pytest.mark.parametrize("p,m", [(4, 8), (4, 2), (2, 6)])
def test_1f1b_keeps_at_most_p_minus_s_micro_batches_in_flight(p, m):
    sim = simulate(chain(p, m), "1f1b", p, 1)
    assert sim.in_flight == [min(p - s, m) for s in range(p)]
    assert sim.peak_in_flight == [min(p - s, m) for s in range(p)]


def test_gpipe_keeps_every_micro_batch_in_flight():
    sim = simulate(chain(4, 6), "gpipe", 4, 1)
    assert sim.peak_in_flight == [6] * 4
    # forward of every micro-batch before any backward, on every stage
    for order in sim.order:
        phases = [t.phase for t in order if t.phase in ("fwd", "bwd")]
        assert phases == ["fwd"] * 6 + ["bwd"] * 6


def test_regsts_follow_the_schedule_and_stage():
    assert [regsts("1f1b", s, 4, 8, 1) for s in range(4)] == [4, 3, 2, 1]
    assert [regsts("interleaved", s, 4, 8, 2) for s in range(4)] == [11, 9, 7, 5]
    assert regsts("gpipe", 0, 4, 8, 1) == 8


def test_a_derived_order_replays_without_deadlock():
    g = chain(4, 8)
    sim = simulate(g, "1f1b", 4, 1)
    replay(g, sim.order, lambda c: c)  # raises on a cycle


def test_a_broken_order_is_a_deadlock_naming_stages_and_tasks():
    """Megatron's classic hang: stage 1 runs both forwards before its first backward while
    stage 0 wants that backward before its second forward."""
    g = chain(2, 2)
    order = [[Task(0, "fwd", 0), Task(0, "bwd", 0), Task(0, "fwd", 1), Task(0, "bwd", 1), Task(0, "opt", None)],
             [Task(1, "fwd", 0), Task(1, "fwd", 1), Task(1, "bwd", 0), Task(1, "bwd", 1), Task(1, "opt", None)]]
    with pytest.raises(PlanError, match=r"^pipeline deadlock: stage 0 waits in B0\.0 for B1\.0 on stage 1; "
                                        r"stage 1 waits in F1\.1 for F0\.1 on stage 0"):
        replay(g, order, lambda c: c)


def test_an_order_that_drops_a_task_is_refused():
    g = chain(2, 2)
    order = simulate(g, "1f1b", 2, 1).order
    order[1] = order[1][:-1]
    with pytest.raises(PlanError, match="does not list every task exactly once"):
        replay(g, order, lambda c: c)


def test_unknown_schedule_is_a_compile_error():
    with pytest.raises(CompileError, match="unknown pipeline schedule 'zigzag'"):
        simulate(chain(2, 2), "zigzag", 2, 1)


# --- compiled plans ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def pp4_plan(tmp_path_factory):
    path = tmp_path_factory.mktemp("pp") / "pp4.json"
    r = sbpc("compile", "examples/gpt.py", "--mesh", "1x1x4", "--microbatches", "4", "--batch-size", "8",
             "-o", str(path), "--trace", str(path.with_suffix(".sim.json")))
    assert r.returncode == 0, r.stderr
    return path


def test_inspect_schedule_shows_1f1b_and_the_analytic_bubble(pp4_plan):
    out = sbpc("inspect", str(pp4_plan), "--schedule").stdout
    assert "schedule 1f1b: 4 stages x 1 chunks, 4 micro-batches; bubble 0.429 simulated (unit cost), 0.429 analytic" in out
    assert re.search(r"^stage 0: regsts 4, peak in flight 4: F0\.0 F0\.1 F0\.2 F0\.3 B0\.0 B0\.1 B0\.2 B0\.3 U0$", out, re.M)
    assert re.search(r"^stage 3: regsts 1, peak in flight 1: (P3\.\d )*F3\.0 B3\.0 F3\.1 B3\.1", out, re.M)


def test_compile_writes_the_simulated_timeline(pp4_plan):
    trace = json.loads(pp4_plan.with_suffix(".sim.json").read_text())
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in slices} == {0, 1, 2, 3}
    assert sum(e["name"].startswith("F") for e in slices) == 16  # 4 chunks x 4 micro-batches
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {f"stage {d} (simulated)" for d in range(4)}


def test_the_simulated_timeline_shows_issued_collectives_beside_compute(tmp_path):
    """dp 2 x pp 2: the gradient buckets the overlap pass issues are on a ``comm dp`` row of
    their stage, inside the slice of the task that issues and waits for them."""
    path = tmp_path / "dp_pp.json"
    r = sbpc("compile", "examples/gpt.py", "--mesh", "2x1x2", "--microbatches", "2", "-o", str(path),
             "--trace", str(path.with_suffix(".sim.json")))
    assert r.returncode == 0, r.stderr
    events = json.loads(path.with_suffix(".sim.json").read_text())["traceEvents"]
    rows = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    slices = [e for e in events if e["ph"] == "X"]
    comm = [e for e in slices if rows[(e["pid"], e["tid"])] == "comm dp"]
    assert comm and {e["pid"] for e in comm} == {0, 1}
    for e in comm:
        task = e["name"].split()[-1]
        owner = next(c for c in slices if c["pid"] == e["pid"] and c["name"] == task and rows[(c["pid"], c["tid"])] == "compute")
        assert owner["ts"] <= e["ts"] and e["ts"] + e["dur"] <= owner["ts"] + owner["dur"] + 1e-3


def test_run_trace_has_one_track_per_rank_and_a_slice_per_firing(pp4_plan, tmp_path):
    trace_path = tmp_path / "run.json"
    r = sbpc("run", str(pp4_plan), "--steps", "2", "--trace", str(trace_path), "--timeout", "60")
    assert r.returncode == 0, r.stderr
    assert "wrote the timeline of" in r.stdout
    events = json.loads(trace_path.read_text())["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    plan = json.loads(pp4_plan.read_text())
    per_step = sum(len(o) for o in plan["pipeline"]["order"])
    assert len(slices) == 2 * per_step
    assert {e["pid"] for e in slices} == {0, 1, 2, 3}
    for rank in range(4):  # a rank's firings do not overlap and follow the plan's order
        mine = sorted((e for e in slices if e["pid"] == rank and e["args"]["step"] == 0), key=lambda e: e["ts"])
        assert [e["name"] for e in mine] == [fmt(Task(t["chunk"], t["phase"], t["mb"], t["part"]))
                                             for t in plan["pipeline"]["order"][rank]]
        assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-3 for a, b in zip(mine, mine[1:]))


def test_a_plan_with_an_edited_order_fails_before_it_can_hang(pp4_plan, tmp_path):
    plan = json.loads(pp4_plan.read_text())
    order = plan["pipeline"]["order"]
    first = [{"chunk": 0, "phase": "fwd", "mb": 0, "part": 0}, {"chunk": 0, "phase": "bwd", "mb": 0, "part": 0}]
    order[0] = first + [t for t in order[0] if t not in first]  # stage 0: a backward right after one forward
    order[1] = sorted(order[1], key=lambda t: ["pre", "fwd", "bwd", "opt"].index(t["phase"]))  # stage 1: GPipe
    del plan["digest"]  # run the edited plan on purpose: the runtime's own replay must catch it
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(plan))
    r = sbpc("run", str(bad), "--steps", "1", "--timeout", "30")
    assert r.returncode == 2
    assert re.fullmatch(r"sbpc: error: pipeline deadlock: stage 0 waits in B0\.0 for B1\.0 on stage 1; "
                        r"stage 1 waits in F1\.1 for F0\.1 on stage 0; hint: this order would hang; .*\n", r.stderr)


def misbehave(payload):
    """A 4-stage pipeline in which one rank dies or hangs in its first backward."""
    from sbpc.runtime.backend import make_backend
    from sbpc.runtime.dist import init_distributed
    from sbpc.runtime.plan import load_plan
    from sbpc.runtime.runner import BatchSource, make_runner

    plan = load_plan(payload["plan"])
    comm = init_distributed(plan, timeout=payload["timeout"])
    runner = make_runner(plan, make_backend("cpu", comm, comm.topology), seed=0)
    if comm.rank == payload["victim"]:
        program = runner.programs[(comm.rank, "bwd", 0)]

        def die(values):
            if payload["mode"] == "exit":
                os._exit(1)
            time.sleep(120)

        program.run = die
    runner.step(BatchSource(plan, 0)(0))
    return comm.rank


@pytest.mark.parametrize("mode", ["exit", "hang"])
def test_a_dead_or_stuck_stage_ends_every_rank_naming_it(pp4_plan, mode):
    start = time.monotonic()
    want = (r"^rank 2 exited with code 1 without reporting an error" if mode == "exit" else
            r"^rank 2 hung: ranks 0, 1, 3 gave up waiting for it after 3s \((recv|send) of %\S+ (for|from) [FB]\d\.\d "
            r"on stage \d with ranks \(\d, \d\) failed on rank \d: no answer from rank \d within 3s")
    with pytest.raises(RuntimeFailure, match=want):
        launch(4, "test_pipeline:misbehave", {"plan": str(pp4_plan), "victim": 2, "mode": mode, "timeout": 3},
               timeout=3)
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("fresh", [False, True], ids=["shared", "owned"])
def test_accumulate_adds_in_place(fresh):
    """The runner's gradient sum over micro-batches, bit for bit the out-of-place sum. A first
    result that may share storage (``fresh`` False) is never written: the second is added out
    of place into a new tensor, the later ones into that one in place. One that only the sum
    reads (``TaskGraph.owned``) is the sum itself: every later result is added into it."""
    from sbpc.runtime.pipeline import _accumulate

    gen = torch.Generator().manual_seed(0)
    parts = [torch.randn(64, 48, generator=gen) for _ in range(5)]
    expected = parts[0]
    for t in parts[1:]:
        expected = expected + t
    first = parts[0].clone()
    acc: dict = {}
    owned: set = set()
    _accumulate(acc, owned, "g", parts[0], fresh)
    assert acc["g"] is parts[0]
    _accumulate(acc, owned, "g", parts[1], fresh)
    summed = acc["g"]
    assert (summed is parts[0]) == fresh
    for t in parts[2:]:
        _accumulate(acc, owned, "g", t, fresh)
        assert acc["g"] is summed  # no new tensor a micro-batch
    assert torch.equal(acc["g"], expected)
    if not fresh:
        assert torch.equal(parts[0], first)


def test_owned_accumulated_values():
    """Only a value made as new storage and read by nothing but its accumulation is summed in
    place over its first result: not a view, not one another op reads, not an in-place result."""
    from sbpc.runtime.pipeline_tasks import ACCUMULATE, Item, TaskGraph

    items = [Item(0, "aten.mm.default", ("g",), ("x", "y"), "bwd", 0),
             Item(1, "aten.t.default", ("v",), ("g2",), "bwd", 0),
             Item(2, "aten.mm.default", ("g2",), ("x", "y"), "bwd", 0),
             Item(3, "aten.mm.default", ("g3",), ("x", "y"), "bwd", 0),
             Item(4, "aten.neg.default", ("n",), ("g3",), "bwd", 0),
             Item(5, "aten.add_.Tensor", ("g4",), ("x", "y"), "bwd", 0),
             *(Item(6 + k, ACCUMULATE, (f"{v}_acc",), (v,), "opt", 0) for k, v in enumerate(["g", "v", "g3", "g4", "n"]))]
    graph = TaskGraph(items, ["g_acc", "v_acc", "g3_acc", "g4_acc", "n_acc"], 4)
    assert graph.owned == {"g", "n"}


def test_update_parts_keep_a_running_sum_over_stages_scalar():
    """A sum over every stage's gradients (fp16's non-finite count) passes from chunk to chunk in
    the update. Each chunk's own terms (its pass over its gradients) run in the first part, so
    the chain carries scalars only; a value only a later part reads (an update's denominator)
    still moves into that part rather than being held across the parts."""
    from sbpc.runtime.pipeline_tasks import TRANSFER, Item, _feeds_send, _opt_parts, _readers

    def op(i, name, outs, uses, chunk):
        return Item(i, name, outs, uses, "opt", chunk)

    items = [
        op(0, "aten.mul.Tensor", ("u0",), ("g0", "inv"), 0), op(1, "aten.sum.default", ("c0",), ("u0",), 0),
        Item(2, TRANSFER, ("r1",), ("c0",), "opt", 1, src=0),
        op(3, "aten.mul.Tensor", ("u1",), ("g1", "inv"), 1), op(4, "aten.sum.default", ("c1",), ("u1",), 1),
        op(5, "aten.add.Tensor", ("s1",), ("r1", "c1"), 1),
        Item(6, TRANSFER, ("r2",), ("s1",), "opt", 2, src=1),
        op(7, "aten.mul.Tensor", ("u2",), ("g2", "inv"), 2), op(8, "aten.sum.default", ("c2",), ("u2",), 2),
        op(9, "aten.add.Tensor", ("s2",), ("r2", "c2"), 2), op(10, "aten.gt.Scalar", ("skip",), ("s2",), 2),
        Item(11, TRANSFER, ("k0",), ("skip",), "opt", 0, src=2), Item(12, TRANSFER, ("k1",), ("skip",), "opt", 1, src=2),
        op(13, "aten.sqrt.default", ("d1",), ("v1",), 1),  # the denominator: read by the update alone
        op(14, "aten.where.self", ("p0n",), ("k0", "p0", "u0"), 0),
        op(15, "aten.where.self", ("p1n",), ("k1", "p1", "u1", "d1"), 1),
        op(16, "aten.where.self", ("p2n",), ("skip", "p2", "u2"), 2),
    ]
    part = dict(zip((it.outs[0] for it in items), _opt_parts(items, _feeds_send(items, _readers(items)), _readers(items))))
    assert [part[v] for v in ("u0", "c0", "u1", "c1", "u2", "c2")] == [0] * 6  # each stage's own pass, at once
    assert (part["r1"], part["s1"], part["r2"], part["s2"], part["k1"]) == (1, 1, 2, 2, 3)  # the chain: scalars
    assert part["d1"] == part["p1n"] == 3  # made where it is read, not held from part 0
