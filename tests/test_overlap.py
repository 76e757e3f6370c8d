"""The overlap pass: gradient buckets issued during the backward and waited for by the
optimizer, the order checked in the compiler and again by the runtime (a broken order is a
one-line deadlock error, never a hang). Parity of overlapped plans: tests/test_parallel.py."""
from __future__ import annotations

import re

import pytest

from sbpc.compiler.driver import compile_model
from sbpc.compiler.frontend.model_loader import load_model
from sbpc.compiler.frontend.optim import OptimizerConfig
from sbpc.compiler.ir.mesh import parse_mesh
from sbpc.compiler.ir.parser import parse_graph
from sbpc.compiler.ir.printer import print_graph
from sbpc.runtime.backend import make_backend
from sbpc.runtime.kinds import ISSUE, WAIT
from sbpc.runtime.overlap import OrderError, check_plan
from sbpc.runtime.runner import Runner

MID = {"preset": "tiny", "hidden": 128, "layers": 2, "seq": 64}  # 1.9 MB of gradients: two buckets


@pytest.fixture(scope="module")
def compiled():
    return compile_model(load_model("examples/gpt.py", MID), parse_mesh("2x1"), batch_size=16, optimizer=OptimizerConfig())


@pytest.fixture(scope="module")
def plan(compiled):
    return compiled.plan


def test_issue_and_wait_print_and_parse_back(compiled):
    text = print_graph(compiled.graph)
    assert re.search(r'= sbpc\.issue\(\[%\w+, .*kind="all_reduce_coalesced", axis="dp".*\) : work\[\] \{role=bwd', text)
    assert re.search(r"= sbpc\.wait\(%\w+_work\) : \(f32\[", text)
    assert print_graph(parse_graph(text)) == text


def _program(plan):
    return plan.stages[0].instructions


def test_the_first_gradient_bucket_is_reduced_while_the_backward_goes_on(plan):
    ins = _program(plan)
    buckets = [k for k, i in enumerate(ins) if i.op == ISSUE and i.kwargs["kind"] == "all_reduce_coalesced"]
    assert len(buckets) == 2, [i.kwargs for i in ins if i.op == ISSUE]
    made = {o: k for k, i in enumerate(ins) for o in i.outs}
    first, second = buckets
    # the last layers' bucket flies while the backward makes the gradients of the second one
    assert first < max(made[a.ref] for a in _refs(ins[second].args)) < second
    waits = {i.args[0].ref: k for k, i in enumerate(ins) if i.op == WAIT}
    for k in buckets:
        # waited for where the optimizer first reads a reduced gradient, not at once
        w = waits[ins[k].outs[0]]
        readers = [j for j, i in enumerate(ins) if set(ins[w].outs) & {a.ref for a in _refs(i.args)}]
        assert w > k + 1 and readers and w == min(readers) - 1


def _refs(args):
    for a in args:
        if isinstance(a, list):
            yield from _refs(a)
        elif hasattr(a, "ref"):
            yield a


def test_a_wait_moved_before_its_issue_is_a_deadlock_error_at_load(plan):
    ins = list(_program(plan))
    k = next(k for k, i in enumerate(ins) if i.op == ISSUE and i.kwargs["kind"] == "all_reduce_coalesced")
    w = next(j for j, i in enumerate(ins) if i.op == WAIT and i.args[0].ref == ins[k].outs[0])
    ins.insert(k, ins.pop(w))  # the wait now comes first
    broken = plan.model_copy(update={"stages": [plan.stages[0].model_copy(update={"instructions": ins})]})
    check_plan(plan)  # the compiled order is fine
    with pytest.raises(OrderError, match=rf"deadlock: instruction {k} waits for %{ins[k + 1].outs[0]} before it is issued"):
        Runner(broken, make_backend("cpu"))


def test_an_in_place_write_over_what_a_collective_sends_is_refused_at_load(plan):
    """gloo reads an issued collective's input until the wait: an edited plan that overwrites it
    in between fails before any rank runs (the overlap pass waits before such a write)."""
    ins = list(_program(plan))
    k = next(k for k, i in enumerate(ins) if i.op == ISSUE and i.kwargs["kind"] == "all_reduce_coalesced")
    x = next(_refs(ins[k].args))
    ins.insert(k + 1, ins[k].model_copy(update={"op": "aten.mul_.Tensor", "args": [x, 2.0], "kwargs": {},
                                                "outs": [f"{x.ref}_x2"], "role": "bwd"}))
    broken = plan.model_copy(update={"stages": [plan.stages[0].model_copy(update={"instructions": ins})]})
    with pytest.raises(OrderError, match=rf"instruction {k + 1} \(aten.mul_.Tensor\) overwrites %{x.ref}, which "
                                         rf"%{ins[k].outs[0]} sends while it is in flight"):
        check_plan(broken)


def test_an_issue_never_waited_for_is_refused(plan):
    ins = [i for i in _program(plan) if not (i.op == WAIT and i.args[0].ref.endswith("_kept_all_gather_work"))]
    assert len(ins) == len(_program(plan)) - 1  # the token mask's gather
    broken = plan.model_copy(update={"stages": [plan.stages[0].model_copy(update={"instructions": ins})]})
    with pytest.raises(OrderError, match="is never waited for"):
        check_plan(broken)


def test_the_token_count_is_gathered_while_the_forward_runs(plan):
    # the global-mean loss needs every rank's target mask: computed from the batch alone, so its
    # gather is issued before the first layer and waited for only where the loss divides by it
    ins = _program(plan)
    k = next(k for k, i in enumerate(ins) if i.op == ISSUE and i.kwargs["kind"] == "all_gather")
    w = next(j for j, i in enumerate(ins) if i.op == WAIT and i.args[0].ref == ins[k].outs[0])
    matmuls = [j for j, i in enumerate(ins) if i.role == "fwd" and i.op in ("aten.addmm.default", "aten.mm.default")]
    assert k < 3 and all(ins[j].op != "aten.embedding.default" for j in range(k)), [i.op for i in ins[:k + 1]]
    assert len(matmuls) > 8 and max(matmuls) < w


def test_the_loss_is_reduced_in_the_first_gradient_bucket(plan):
    # the dp loss leaves the step reduced, but not by a call of its own (nor by a blocking
    # all-reduce in the runner after the update): only the step's output reads it, so it rides
    # in the first gradient bucket, issued in the backward and waited for before the update
    ins = _program(plan)
    loss = plan.stages[0].loss
    w = next(j for j, i in enumerate(ins) if loss in i.outs)
    assert ins[w].op == WAIT and len(ins[w].outs) > 1
    k = next(k for k, i in enumerate(ins) if i.op == ISSUE and i.outs[0] == ins[w].args[0].ref)
    buckets = [j for j, i in enumerate(ins) if i.op == ISSUE and i.kwargs["kind"] == "all_reduce_coalesced"]
    first_bwd = next(j for j, i in enumerate(ins) if i.role == "bwd")
    assert k == buckets[0] and k > first_bwd
    assert not [i for i in ins if i.op == ISSUE and i.kwargs["kind"] == "all_reduce"]  # no loss call of its own
    update = next(j for j, i in enumerate(ins) if i.op == "aten._fused_adamw_.default")
    assert w < update
    # only the step's output reads the reduced loss: the backward starts from the partial one
    assert not any(loss in {a.ref for a in _refs(i.args)} for i in ins)
    t = ins[w].types[ins[w].outs.index(loss)]
    assert t.shape == [] and t.sbp and not any("P" in s for s in t.sbp), t


def test_only_what_serves_one_gradient_is_priced_as_a_bucket_member():
    """The propagation prices a reduction as a bucket member (its bytes, no call of its own) only
    for the values that serve one parameter's gradient: a reduction of anything upstream holds up
    the backward of every layer below, so it is a blocking call, never bucketed."""
    from sbpc.compiler.frontend.capture import capture
    from sbpc.compiler.ir.types import OutputKind, Role
    from sbpc.compiler.sbp.graph_index import gradient_tail

    graph = capture(load_model("examples/gpt.py", MID), parse_mesh("1"), 16, OptimizerConfig(), None)
    tail = gradient_tail(graph, graph.users())
    grads = {o.value for o in graph.outputs_of(OutputKind.GRAD)}
    assert grads <= tail
    # the loss's gradient, the first value of the backward, is what every weight gradient comes from
    first = next(n for n in graph.nodes if n.role == Role.BACKWARD)
    assert first.outputs[0] not in tail
    # and so is every activation gradient: most of the backward is not in the tail
    backward = [o for n in graph.nodes if n.role == Role.BACKWARD for o in n.outputs]
    assert len(tail) < len(backward) / 2, (len(tail), len(backward))
