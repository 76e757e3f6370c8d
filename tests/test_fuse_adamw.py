"""fuse-adamw (compiler/passes/fuse_adamw.py): the whole AdamW update as one call of torch's fused
kernel, bit for bit what AdamW(fused=True) computes, and left alone where it would not be sound."""
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import compile_example
from sbpc.compiler.driver import compile_model
from sbpc.compiler.frontend.model_loader import load_model
from sbpc.compiler.frontend.optim import OptimizerConfig
from sbpc.compiler.ir.mesh import parse_mesh
from sbpc.compiler.memory_options import MemoryOptions
from sbpc.compiler.tools.check import run_check
from sbpc.runtime.backend import FUSED_ADAMW, make_backend
from sbpc.runtime.plan import RefArg
from sbpc.runtime.runner import Runner

TOL = 1e-5


class _CountOps(TorchDispatchMode):
    """Counts the ATen calls made under it, by overload name."""

    def __init__(self):
        super().__init__()
        self.count = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _update_ops(plan):
    return [i.op for prog in plan.stages for i in prog.instructions if i.role == "opt"]


def test_the_update_of_every_parameter_is_one_fused_kernel_call():
    plan = compile_example("gpt.py")[0].plan
    assert _update_ops(plan) == ["aten.add_.Tensor", FUSED_ADAMW]  # the step counter, then all 29 parameters
    (fused,) = [i for i in plan.stages[0].instructions if i.op == FUSED_ADAMW]
    assert len(fused.outs) == 3 * len(plan.params) == 3 * 29
    # the learning rate is the step's input, the other hyperparameters the compiled constants
    assert fused.kwargs == dict(lr=RefArg(ref="lr"), beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8,
                                amsgrad=False, maximize=False)
    assert [(h.name, h.value, h.dtype, h.shape) for h in plan.hyper] == [("lr", "lr", "float64", [])]
    assert plan.optimizer.fused and plan.optimizer.lr == 1e-3
    # the memory estimate counts the results as the storages they overwrite (no old + new at the peak)
    (role,) = plan.estimates.roles
    assert role.params == role.param_bytes and role.optimizer == role.optimizer_bytes


@pytest.mark.parametrize("reference_fused", [True, False])
def test_fused_update_is_eager_fused_adamw_bit_for_bit(reference_fused):
    """Against AdamW(fused=True), the check's reference for such a plan: 0. Against the
    single-tensor algorithm the traced update reproduces: a few last bits of some entries (the
    kernel rounds exp_avg_sq's update and the step size its own way), well inside the tolerance."""
    result, source, optimizer = compile_example("gpt.py")
    plan = result.plan
    plan = plan.model_copy(update={"optimizer": plan.optimizer.model_copy(update={"fused": reference_fused})})
    report = run_check(plan, source, Runner(plan, make_backend("cpu"), seed=0), optimizer, steps=2, seed=0,
                       tolerance=TOL)
    worst = max(r.update.value for r in report.rows)
    assert report.passed
    if reference_fused:
        assert worst == 0.0
    else:
        assert 0.0 < worst < TOL / 2, worst


def test_a_strided_gradient_is_read_in_its_logical_order():
    # the CPU kernel walks storage order; the backend hands it a contiguous copy of a transposed tensor
    kernel = make_backend("cpu").kernel(FUSED_ADAMW)
    torch.manual_seed(0)
    g = torch.randn(6, 4).t()
    step = torch.tensor(1.0, dtype=torch.float64)
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)
    results = []
    for grad in (g, g.contiguous()):
        p, m, v = torch.ones(4, 6), torch.zeros(4, 6), torch.zeros(4, 6)
        out = kernel([p], [grad], [m], [v], [], [step], **kw)
        assert out[0] is p and out[1] is m and out[2] is v
        results.append(out)
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert not torch.equal(results[0][0], torch.ones(4, 6))


def test_not_fused_where_no_one_kernel_is_the_update():
    # SGD is not AdamW; a ZeRO-1 plan gathers its updated shards inside the step; a pipeline's
    # tasks run in the schedule's order
    sgd = compile_example("mlp.py", optimizer=OptimizerConfig(kind="sgd", weight_decay=0.0))[0].plan
    assert FUSED_ADAMW not in _update_ops(sgd) and not sgd.optimizer.fused
    source = load_model("examples/gpt.py", {})
    zero = compile_model(source, parse_mesh("2x1"), batch_size=8, optimizer=OptimizerConfig(),
                         memory=MemoryOptions(zero=1)).plan
    assert FUSED_ADAMW not in _update_ops(zero) and not zero.optimizer.fused
    dp = compile_model(source, parse_mesh("2x1"), batch_size=8, optimizer=OptimizerConfig()).plan
    assert FUSED_ADAMW in _update_ops(dp) and dp.optimizer.fused  # plain data parallel: fused


def test_the_kernel_gets_float32_step_counts_as_torch_optim_passes():
    """torch's CUDA kernel reads each step tensor's memory as a C float: the plan's float64
    counter must reach it as float32 (as ``AdamW(fused=True)`` keeps ``step``), one conversion
    for the counter every parameter shares; the CPU kernel's result is the same either way."""
    from functools import partial

    from sbpc.runtime.backend import _fused_adamw

    seen = []
    step = torch.tensor(3.0, dtype=torch.float64)
    params = [torch.ones(2, 3), torch.ones(4)]
    tensors = lambda: ([p.clone() for p in params], [torch.full_like(p, 0.5) for p in params],  # noqa: E731
                       [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params])
    kw = dict(lr=torch.tensor(1e-3, dtype=torch.float64), beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8,
              amsgrad=False, maximize=False)
    with _CountOps() as ops:  # the kernel stands in for 5 parameters' update: it reads only the steps
        _fused_adamw(lambda *a, **k: seen.append(a[5]), *tensors(), [], [step] * 5, **kw)
    (steps,) = seen
    assert [s.dtype for s in steps] == [torch.float32] * 5 and steps[0] is steps[4] and float(steps[0]) == 3.0
    assert ops.count["aten._to_copy.default"] == 1  # once a step, not once per parameter (53 on bench mid)
    assert step.dtype == torch.float64  # the plan's own counter is left as it is
    cpu = partial(_fused_adamw, torch.ops.aten._fused_adamw_.default._op)
    got = cpu(*tensors(), [], [step, step], **kw)
    want = cpu(*tensors(), [], [step.float(), step.float()], **kw)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and not torch.equal(got[0], params[0])


def test_every_list_reaches_the_kernel_with_its_parameters_strides():
    """torch's CUDA kernel refuses a gradient or state whose strides differ from its
    parameter's; two contiguous (1, 4) tensors can (``(4, 1)`` and ``(1, 1)``): such a one goes
    in as a row-major copy, and the result is written back to the plan's tensor."""
    from sbpc.runtime.backend import _fused_adamw

    seen = []

    def kernel(params, grads, exp_avgs, exp_avg_sqs, *a, **k):
        seen.append([[t.stride() for t in ts] for ts in (params, grads, exp_avgs, exp_avg_sqs)])
        for p in params:
            p.add_(1.0)

    p, grad = torch.zeros(1, 4), torch.ones(4, 1).t()
    assert grad.is_contiguous() and grad.stride() != p.stride()
    m, v = torch.zeros(1, 4), torch.zeros(4, 1).t()
    out = _fused_adamw(kernel, [p], [grad], [m], [v], [], [torch.tensor(1.0)], lr=1e-3)
    assert seen == [[[(4, 1)]] * 4] and out[0] is p and out[2] is v and torch.equal(p, torch.ones(1, 4))


def test_a_zero_dim_parameter_is_fused_with_the_others():
    """A 0-d parameter's update casts its float64 scalars to its dtype (optim._as_param_scalar:
    0-d f32 times 0-d f64 is f64 in torch); fuse-adamw reads through the casts, so the whole
    update is still one kernel call, eager's fused AdamW bit for bit."""
    source, optimizer = load_model("tests/models/weight_norms.py"), OptimizerConfig()
    plan = compile_model(source, parse_mesh("1"), batch_size=4, optimizer=optimizer).plan
    assert any(p.shape == [] for p in plan.params)  # weight_norm(dim=None)'s magnitude
    assert _update_ops(plan) == ["aten.add_.Tensor", FUSED_ADAMW]
    report = run_check(plan, source, Runner(plan, make_backend("cpu"), seed=0), optimizer, steps=2, seed=0,
                       tolerance=TOL)
    assert report.passed and max(r.update.value for r in report.rows) == 0.0, report.table()


@pytest.mark.parametrize("t", [torch.zeros(3, 4), torch.zeros(4, 3).t(), torch.zeros(1, 4), torch.zeros(4, 1).t(),
                               torch.zeros(4, 1), torch.zeros(1, 4).t(), torch.zeros(()), torch.zeros(0, 3),
                               torch.zeros(3, 0).t(), torch.zeros(2, 6)[:, ::2], torch.zeros(5)[1:],
                               torch.zeros(2, 1, 3), torch.zeros(3, 1, 2).permute(2, 1, 0), torch.zeros(6).expand(2, 6)],
                         ids=lambda t: f"{list(t.shape)}{t.stride()}")
def test_row_major_is_the_stride_test_it_names(t):
    """The update's per-tensor layout test answers from torch's contiguity where no dim has
    size 1 or 0 (the common case, in C) and from the strides otherwise: the same answers."""
    from sbpc.runtime.backend import _row_major

    expected, step = [], 1
    for size in reversed(t.shape):
        expected.append(step)
        step *= max(size, 1)
    assert _row_major(t) == (t.stride() == tuple(reversed(expected)))
