"""Random ops on a mesh: each device keeps its shard of eager's draw, so dropout splits like
any elementwise op and the plan still matches eager bit for bit (runtime/rng.py)."""
from __future__ import annotations

import pytest
import torch

from sbpc.compiler.ir.types import DType
from sbpc.compiler.sbp.rules import RuleBook
from sbpc.compiler.sbp.rules.validate import validate
from sbpc.runtime.kinds import Collective
from conftest import sbpc_check
from test_sbp_rules import synth

RANDOM = "sbpc.random_shard"


def _random_instances():
    x = torch.empty(6, 4, 6)
    return [synth("aten.bernoulli.p", x, 0.5), synth("aten.rand_like.default", x),
            synth("aten.uniform.default", x, -1.0, 2.0), synth("aten.randint_like.default", x, 7),
            synth("aten.rand.default", [6, 4], dtype=DType("f32")), synth("aten.randn.default", [6, 4], dtype=DType("f32"))]


def test_random_ops_split_on_every_dim():
    """Every dim splits (odd k included), each shard equal to its block of the logical draw."""
    book = RuleBook.load()
    report = validate(book, _random_instances(), sizes=(2, 3))
    assert not report.failures, "\n".join(map(str, report.failures[:10]))
    for op, (_, offered, held) in report.coverage().items():
        assert offered >= 2 and held == offered, op  # splits were offered and all held


def test_drawing_a_local_tensor_fails_validation():
    """The naive rule (each device draws its own block from the shared seed) repeats one block
    on every device; the validator must catch it."""
    wrong = RuleBook.from_text("aten.bernoulli.p = elementwise(self)")
    report = validate(wrong, _random_instances()[:1], sizes=(2,))
    assert report.failures and all("deviates" in (o.error or "") for o in report.failures)


def _plan(mesh: str, dropout: float):
    from sbpc.compiler.driver import compile_model
    from sbpc.compiler.frontend.model_loader import load_model
    from sbpc.compiler.frontend.optim import OptimizerConfig
    from sbpc.compiler.ir.mesh import parse_mesh

    return compile_model(load_model("examples/gpt.py", {"dropout": dropout}), parse_mesh(mesh), batch_size=4,
                         optimizer=OptimizerConfig()).plan


def _forward_collectives(plan) -> int:
    return sum(1 for p in plan.stages for i in p.instructions
               if (c := Collective.of(i.op)) is not None and c.moves_data and i.role == "fwd")


def test_dropout_adds_no_collective_on_dp():
    """Before, bernoulli was B only and the solver gathered the activations before each dropout
    (8 forward all-gathers per step on 2x1 against 6 without dropout)."""
    with_dropout, without = _plan("2x1", 0.1), _plan("2x1", 0.0)
    draws = [i for p in with_dropout.stages for i in p.instructions if i.op == RANDOM]
    assert len(draws) == 3 and all(i.kwargs["sbp"][0] == "S(0)" for i in draws)
    assert _forward_collectives(with_dropout) == _forward_collectives(without)


def test_dropout_at_one_half_matches_eager():
    """p=0.5, bernoulli_'s default, which the trace leaves out (EfficientNet's classifier dropout)."""
    r = sbpc_check("examples/gpt.py", "--set", "dropout=0.5", "--mesh", "2x1", "--steps", "1")
    assert r.returncode == 0 and "PASS" in r.stdout, r.stdout + r.stderr


def test_dropout_split_on_dp_and_tp_matches_eager():
    """Megatron with sequence parallelism on 2x2: masks split on dp (batch) and tp (sequence,
    heads); in-process ranks keep each rank's generator, so the check is exact."""
    r = sbpc_check("examples/gpt.py", "--set", "dropout=0.1", "--set", "sp=True", "--config",
                   "examples/gpt.megatron.toml", "--mesh", "2x2", "--steps", "2")
    assert r.returncode == 0 and "PASS" in r.stdout, r.stdout + r.stderr


def _bernoulli(shape: list[int], draw: int, sbp: list[str], axes: list[str]):
    from sbpc.runtime.plan import Instruction, RefArg, ValueType

    kwargs = {"op": "aten.bernoulli.p", "shape": shape, "sbp": sbp, "axes": axes, "draw": draw}
    return Instruction(op=RANDOM, args=[RefArg(ref="x"), 0.7], kwargs=kwargs, outs=[f"m{draw}"],
                       types=[ValueType(shape=shape, dtype="f32")], role="fwd")


def test_a_microbatch_draws_its_slice_of_the_step_draw():
    """After replaying the step's draws, micro-batch j of a draw, run in any order and after
    other draws, is slice j of eager's draw at that op's stream position."""
    from types import SimpleNamespace

    from sbpc.runtime.rng import draws, random_shard, replay
    from sbpc.runtime.topology import Topology

    shapes = [[6, 5], [8, 3], [4, 4]]
    torch.manual_seed(11)
    eager = [torch.empty(s).bernoulli_(0.7) for s in shapes]
    plan = [_bernoulli(s, k, ["S(0)", "B"], ["mb", "dp"]) for k, s in reversed(list(enumerate(shapes)))]
    torch.manual_seed(11)
    backend = SimpleNamespace(topology=Topology((("dp", 1),)), microbatches=2, microbatch=0, rng_states=replay(draws(plan)))
    torch.manual_seed(99)  # whatever ran in between: each draw restores its own state
    for k in (2, 0, 1):
        parts = []
        for j in (1, 0):  # micro-batches out of order, as a pipeline interleaves them
            backend.microbatch = j
            parts.insert(0, random_shard(backend, torch.empty(1), 0.7, **{a: b for a, b in plan[2 - k].kwargs.items()}))
        assert torch.equal(torch.cat(parts), eager[k]), k


def test_pipelined_dropout_matches_eager():
    """Stages skip each other's draws and micro-batches interleave; each draw restores eager's
    stream position (before: dp loss off by 7e-5 and gradients by 0.44 on 1x1x2, and a compile
    error with micro-batches)."""
    r = sbpc_check("examples/gpt.py", "--set", "dropout=0.1", "--mesh", "1x2x2", "--microbatches", "4", "--steps", "2")
    assert r.returncode == 0 and "PASS" in r.stdout, r.stdout + r.stderr


def test_a_value_reading_random_op_in_a_pipeline_is_named():
    from sbpc.compiler.driver import compile_model
    from sbpc.compiler.frontend.model_loader import load_model
    from sbpc.compiler.frontend.optim import OptimizerConfig
    from sbpc.compiler.ir.mesh import parse_mesh
    from sbpc.errors import CompileError

    with pytest.raises(CompileError) as err:
        compile_model(load_model("tests/models/random_probs.py", {}), parse_mesh("1x1x2"), batch_size=4,
                      optimizer=OptimizerConfig())
    assert err.value.message.startswith("aten.bernoulli.default draws random numbers from its inputs' values")
    assert "tests/models/random_probs.py:14" in str(err.value.location)


def test_a_value_reading_random_op_is_named_in_a_warning(capsys):
    from sbpc.cli import main

    assert main(["compile", "tests/models/random_probs.py", "--mesh", "2", "-o", "/dev/null"]) == 0
    err = capsys.readouterr().err
    assert "warning: aten.bernoulli.default (first at tests/models/random_probs.py:14) draws random numbers" in err


def test_a_fused_attention_with_dropout_in_a_pipeline_is_named():
    """CPU capture decomposes sdpa with dropout (bmm, softmax, bernoulli.p mask), so this only
    arises from a hand-written graph; the fused kernel draws inside, which no replay can redo."""
    from sbpc.compiler.ir.parser import parse_graph
    from sbpc.compiler.passes import RandomDraws
    from sbpc.errors import CompileError

    g = parse_graph("""graph @a mesh<pp=2, mb=2> {
  input batch %q : f32[2, 2, 4, 8] "batch.0" {sbp=[B]}
  %o, %lse = sbpc.attention(%q, %q, %q, 0.1, False, attn_mask=None, scale=None) : (f32[2, 2, 4, 8], f32[2, 2, 4]) {role=fwd, loc="attn" @ "m.py":7}
  %l = aten.sum.default(%o) : f32[] {role=fwd}
  output loss %l "loss"
}""")
    with pytest.raises(CompileError) as err:
        RandomDraws().apply(g, None)
    assert err.value.message.startswith("sbpc.attention draws random numbers") and "m.py:7" in str(err.value.location)



DROPOUT_CALLS = {
    "F.dropout": lambda t: torch.nn.functional.dropout(t, 0.1),
    "F.dropout kwargs": lambda t: torch.nn.functional.dropout(t, p=0.3, training=True),
    "torch.dropout": lambda t: torch.dropout(t, 0.2, True),
    "nn.Dropout": lambda t: torch.nn.Dropout(0.25)(t),
    "in place": lambda t: torch.nn.functional.dropout(t * 1.0, 0.4, True, True),
    "torch.dropout_": lambda t: torch.dropout_(t * 1.0, 0.4, True),
    "p=1": lambda t: torch.nn.functional.dropout(t, 1.0),
    "eval": lambda t: torch.nn.functional.dropout(t, 0.5, training=False),
    "attention": lambda t: torch.nn.functional.scaled_dot_product_attention(
        t.view(2, 2, 16, 33), t.view(2, 2, 16, 33), t.view(2, 2, 16, 33), dropout_p=0.2, is_causal=True),
}


@pytest.mark.parametrize("name", list(DROPOUT_CALLS))
def test_checks_eager_dropout_on_a_gpu_is_cpu_eagers_bit_for_bit(name):
    """On a GPU `sbpc check` runs eager's dropout in the composite form the plan captured
    (compiler/tools/check_dropout.py) instead of torch's fused kernels, which draw other masks
    from the same seed. On the CPU the same modes must change nothing: the same outputs and
    gradients to the bit from the same seed (SDPA with dropout in its math form included)."""
    from sbpc.compiler.tools.check_dropout import CompositeDropout, PlanDropout

    call = DROPOUT_CALLS[name]
    x = torch.randn(64, 33, requires_grad=True)
    torch.manual_seed(3)
    want = call(x)
    (g_want,) = torch.autograd.grad(want.sum() * 1.7, x)
    with PlanDropout(), CompositeDropout():
        torch.manual_seed(3)
        got = call(x)
        (g_got,) = torch.autograd.grad(got.sum() * 1.7, x)
    assert torch.equal(got, want) and torch.equal(g_got, g_want)


def test_native_dropout_is_drawn_as_the_composite_form():
    """What a GPU's ``at::dropout`` calls (``aten.native_dropout``, also from SDPA's math form
    in C++) is drawn as the composite form under PlanDropout: the CPU's F.dropout output to the
    bit from the same seed, its mask, and the gradient within an ulp (torch's backward of
    native_dropout multiplies by the mask and 1 / (1 - p) in two steps)."""
    from sbpc.compiler.tools.check_dropout import PlanDropout

    x = torch.randn(64, 33, requires_grad=True)
    torch.manual_seed(5)
    want = torch.nn.functional.dropout(x, 0.3)
    (g_want,) = torch.autograd.grad(want.sum() * 1.7, x)
    with PlanDropout():
        torch.manual_seed(5)
        got, mask = torch.native_dropout(x, 0.3, True)
        (g_got,) = torch.autograd.grad(got.sum() * 1.7, x)
    assert torch.equal(got, want) and torch.equal(mask, want != 0) and mask.dtype == torch.bool
    torch.testing.assert_close(g_got, g_want, rtol=1e-6, atol=0)
    assert (g_got == 0).sum() > 0 and torch.equal(g_got == 0, ~mask)


def test_checks_eager_dropout_takes_the_composite_path_and_only_on_a_gpu():
    """Within CompositeDropout a dropout never reaches torch's dropout (whose CUDA form is the
    fused kernel): it is bernoulli_, div_ and mul, as the plan captured it. On the CPU the check
    adds no mode at all."""
    from torch.overrides import TorchFunctionMode

    from sbpc.compiler.tools.check_dropout import CompositeDropout, plan_dropout

    seen = []

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    x = torch.randn(8, 8)
    with Record(), CompositeDropout():
        torch.nn.functional.dropout(x, 0.5)
        torch.dropout(x, 0.5, True)
    assert "dropout" not in seen and "bernoulli_" in seen, seen
    seen.clear()
    with Record():
        torch.nn.functional.dropout(x, 0.5)
    assert seen == ["dropout"]  # without it torch's own dropout runs
    from torch.overrides import _get_current_function_mode_stack

    with plan_dropout(torch.device("cpu")):
        assert not _get_current_function_mode_stack()
    with plan_dropout(torch.device("meta")):  # any device but the CPU
        assert any(isinstance(m, CompositeDropout) for m in _get_current_function_mode_stack())
    assert not _get_current_function_mode_stack()


def test_what_the_cuda_kernels_refuse_is_refused_before_a_rank_starts():
    """A pipelined plan with dropout (the replay of draws records the CPU generator) is refused
    for cuda from the plan alone, naming the user's line, not at the first step on every rank;
    the same model unpipelined, or without dropout, passes."""
    from sbpc.compiler.driver import compile_model
    from sbpc.compiler.frontend.model_loader import load_model
    from sbpc.compiler.frontend.optim import OptimizerConfig
    from sbpc.compiler.ir.mesh import parse_mesh
    from sbpc.compiler.passes import PipelineOptions
    from sbpc.runtime.cuda import require_cuda_kernels

    def plan(mesh, dropout, m=1):
        return compile_model(load_model("examples/gpt.py", {"dropout": dropout}), parse_mesh(mesh), batch_size=4,
                             optimizer=OptimizerConfig(), pipeline=PipelineOptions(microbatches=m)).plan

    from sbpc.errors import PlanError

    with pytest.raises(PlanError, match="a random op in a pipelined plan on the cuda backend") as err:
        require_cuda_kernels(plan("1x1x2", 0.1, 2))
    assert err.value.location and "gpt.py:" in err.value.location
    require_cuda_kernels(plan("1", 0.1))
    require_cuda_kernels(plan("1x1x2", 0.0, 2))


@pytest.mark.parametrize("mesh", ["1", "2", "1x1x2", "2x1x2"])
def test_dropout_on_a_channels_last_activation_matches_eager(mesh):
    """Eager draws the mask of a channels-last activation in its memory order (``empty_like``
    keeps the strides); the plan draws it in that order and permutes it back (before: a
    deviation of 0.59 in a gradient, on one device too)."""
    r = sbpc_check("tests/models/channels_last_dropout.py", "--mesh", mesh, "--steps", "2")
    assert r.returncode == 0 and "PASS" in r.stdout, r.stdout + r.stderr


def test_a_draw_in_memory_order_is_permuted_back():
    """The empty carrier takes the physical (memory-order) shape, the draw keeps it, and a
    permute gives the logical dims: N, H, W, C drawn, N, C, H, W read."""
    from sbpc.compiler.driver import compile_model
    from sbpc.compiler.frontend.model_loader import load_model
    from sbpc.compiler.frontend.optim import OptimizerConfig
    from sbpc.compiler.ir.mesh import parse_mesh

    plan = compile_model(load_model("tests/models/channels_last_dropout.py", {}), parse_mesh("1"), batch_size=4,
                         optimizer=OptimizerConfig()).plan
    ins = [i for s in plan.stages for i in s.instructions]
    draw = next(i for i in ins if i.op == "aten.bernoulli.p")
    back = next(i for i in ins if i.op == "aten.permute.default" and i.args[0].ref == draw.outs[0])
    assert list(draw.types[0].shape) == [4, 6, 6, 8] and back.args[1] == [0, 3, 1, 2]


def test_the_float64_twin_draws_float32s_numbers():
    """sbpc check's float64 twin under Float32Draws: ``torch.rand(dtype=float64)`` (stochastic
    depth's mask) and an in-place ``uniform_`` give float32's numbers, widened, and leave the
    generator where float32 left it; without it float64 draws other numbers."""
    from sbpc.compiler.tools.check_dropout import Float32Draws

    torch.manual_seed(0)
    ref = torch.rand(6), torch.empty(3).uniform_(-1, 1), torch.randn(2)
    torch.manual_seed(0)
    with Float32Draws():
        got = torch.rand(6, dtype=torch.float64), torch.empty(3, dtype=torch.float64).uniform_(-1, 1), \
            torch.randn(2, dtype=torch.float64)
    assert all(g.dtype == torch.float64 and torch.equal(g, r.double()) for g, r in zip(got, ref))
    torch.manual_seed(0)
    assert not torch.equal(torch.rand(6, dtype=torch.float64), ref[0].double())


def test_stochastic_depth_keeps_the_float64_reference():
    """SegFormer (tests/zoo/segformer.py: drop-path and classifier dropout) on 2x2: without
    float32's draws the twin computed another function, the biases under BatchNorm (exact
    gradient 0) were judged on the floor alone, and a correct plan read 8.2e-5 (FAIL)."""
    r = sbpc_check("tests/zoo/segformer.py", "--mesh", "2x2")
    assert r.returncode == 0 and r.stdout.strip().endswith("PASS"), r.stdout + r.stderr
    assert "no float64 reference" not in r.stdout, r.stdout
