"""Pass manager, verifier and memory-plan tests (the IR-changing passes have golden files)."""
import io
import re
from dataclasses import replace

import pytest

from conftest import compile_example
from sbpc.compiler.driver import compile_model
from sbpc.compiler.ir.mesh import parse_mesh
from sbpc.compiler.ir.parser import parse_graph
from sbpc.compiler.ir.verify import verify
from sbpc.compiler.pass_manager import CompileContext, Fact, PassManager
from sbpc.compiler.passes import REGISTRY, Boxing, Localize, MemoryPlan, SbpPropagate, default_pipeline
from sbpc.errors import CompileError, IRError, PassBug, UsageError

BASE = """graph @g mesh<dp=1> {{
  input param %w : f32[4, 4] "w"
  input batch %x : f32[2, 4] "batch.0"
{body}
}}
"""
OK_BODY = """  %y = aten.mm.default(%x, %w) : f32[2, 4] {role=fwd}
  %l = aten.sum.default(%y) : f32[] {role=fwd}
  output loss %l "loss\""""


def graph(body: str):
    return parse_graph(BASE.format(body=body))


def test_valid_graph_verifies():
    verify(graph(OK_BODY))


@pytest.mark.parametrize("body,message", [
    ("""  %l = aten.sum.default(%nope) : f32[] {role=fwd}
  output loss %l "loss\"""", r"aten\.sum\.default uses %nope before it is defined"),
    ("""  %l = aten.sum.default(%x) : f32[] {role=fwd}
  %l = aten.sum.default(%w) : f32[] {role=fwd}
  output loss %l "loss\"""", r"value %l is defined twice"),
    ("""  %l = aten.sum.default(%x) : f32[] {role=fwd}
  %x = aten.sum.default(%w) : f32[] {role=fwd, loc="blk" @ "m.py":9}
  output loss %l "loss\"""", r"value %x is defined twice.*\(at blk @ m\.py:9\)"),
    ("""  %y = aten.add_.Tensor(%x, %x) : f32[2, 4] {role=fwd, loc="blk" @ "m.py":7}
  %l = aten.sum.default(%y) : f32[] {role=fwd}
  output loss %l "loss\"""", r"aten\.add_\.Tensor mutates a tensor in place.*\(at blk @ m\.py:7\)"),
    ("""  %l = aten.sum.default(%x) : f32[] {role=fwd}
  %w2 = aten.mul_.Tensor(%w, 0.5) : f32[4, 4] {role=opt}
  %u = aten.sum.default(%w) : f32[] {role=opt}
  output loss %l "loss\"""", r"aten\.mul_\.Tensor overwrites %w, which is read later"),
    ("""  %l = aten.sum.default(%x) : f32[] {role=fwd}
  %x2 = aten.mul_.Tensor(%x, 0.5) : f32[2, 4] {role=opt}
  output loss %l "loss\"""", r"aten\.mul_\.Tensor mutates a tensor in place"),
    ("""  %l = aten.sum.default(%x) : f32[] {role=fwd}""", r"graph has 0 loss outputs, expected exactly one"),
    (OK_BODY + """
  output grad %l "x\"""", r"gradient output names 'x', which is not a parameter"),
    (OK_BODY + """
  output update %l "nothing\"""", r"update output names 'nothing', which is not a parameter, buffer or optimizer state"),
    (OK_BODY.replace("output loss %l", "output loss %zz"), r"graph output loss 'loss' uses undefined value %zz"),
    ("""  %y = aten.mm.default(%x, %w) : f32[2, 4] {role=fwd, stage=0}
  %l = aten.sum.default(%y) : f32[] {role=fwd}
  %g = aten.ones_like.default(%l) : f32[] {role=bwd, stage=0}
  output loss %l "loss\"""", r"aten\.sum\.default has no stage while other ops do"),
    ("""  %y = aten.mm.default(%x, %w) : f32[2, 4] {role=fwd, sbp=[[S(2)]]}
  %l = aten.sum.default(%y) : f32[] {role=fwd}
  output loss %l "loss\"""", r"splits dim 2 of a rank-2 tensor"),
    ("""  %y = aten.mm.default(%x, %w) : f32[2, 4] {role=fwd, sbp=[[B, B]]}
  %l = aten.sum.default(%y) : f32[] {role=fwd}
  output loss %l "loss\"""", r"nd-SBP of 2 entries on a mesh with 1 SBP axes"),
])
def test_verifier_errors(body, message):
    with pytest.raises(IRError, match=message):
        verify(graph(body), after="test")


def test_verifier_names_the_pass_that_broke_the_ir():
    class Breaker:
        name = "breaker"

        def apply(self, g, ctx):
            g.nodes = g.nodes[1:]  # drops the producer of %y
            return g

    # a pass's bug, not the user's input: not an SbpcError, so the CLI says "internal error", exit 3
    with pytest.raises(PassBug, match=r"pass 'breaker' broke the IR: .* uses %y before it is defined after pass 'breaker'"):
        PassManager([Breaker()], CompileContext(log=io.StringIO())).run(graph(OK_BODY))


def test_the_verifier_after_a_pass_checks_its_new_nodes_and_the_order_of_all():
    """Nodes the pass kept had their nd-SBPs checked before; a new one is checked, and so is the
    order of every node (a kept node whose producer moved after it)."""
    from sbpc.runtime.sbp import Split

    class BadSbp:
        name = "bad-sbp"

        def apply(self, g, ctx):
            return replace(g, nodes=[replace(g.nodes[0], sbp=[(Split(2),)])] + g.nodes[1:])

    class Swap:
        name = "swap"

        def apply(self, g, ctx):
            return replace(g, nodes=g.nodes[::-1])

    with pytest.raises(PassBug, match=r"pass 'bad-sbp' broke the IR: .* splits dim 2 of a rank-2 tensor"):
        PassManager([BadSbp()], CompileContext(log=io.StringIO())).run(graph(OK_BODY))
    with pytest.raises(PassBug, match=r"pass 'swap' broke the IR: aten\.sum\.default uses %y before it is defined"):
        PassManager([Swap()], CompileContext(log=io.StringIO())).run(graph(OK_BODY))


def test_a_new_node_with_a_kept_nodes_sbp_is_checked_against_its_own_types():
    """A node remade from a checked one (``dataclasses.replace``, which keeps its ``sbp`` list)
    is a new node to the verifier: new types under the same ``sbp`` are checked (a split dim
    past the new rank), as are more results than nd-SBPs, whatever a faster check skips."""
    from sbpc.compiler.ir.types import TensorType
    from sbpc.runtime.sbp import Split

    body = OK_BODY.replace("{role=fwd}", "{role=fwd, sbp=[[S(1)]]}", 1)

    def remake(**change):
        class Remake:
            name = "remake"

            def apply(self, g, ctx):
                return replace(g, nodes=[replace(g.nodes[0], **change)] + g.nodes[1:])
        return Remake()

    verify(graph(body))
    PassManager([remake(why="restaged")], CompileContext(log=io.StringIO())).run(graph(body))
    with pytest.raises(PassBug, match=r"pass 'remake' broke the IR: .* splits dim 1 of a rank-1 tensor"):
        PassManager([remake(types=[TensorType((8,), "f32")])], CompileContext(log=io.StringIO())).run(graph(body))
    with pytest.raises(PassBug, match=r"pass 'remake' broke the IR: .* has 1 nd-SBPs for 2 results"):
        PassManager([remake(outputs=["y", "y2"], types=[TensorType((2, 4), "f32")] * 2)],
                    CompileContext(log=io.StringIO())).run(graph(body))
    assert graph(body).nodes[0].sbp == [(Split(1),)]


def test_a_pass_that_returns_its_input_is_not_verified_again(monkeypatch):
    import sbpc.compiler.pass_manager as pm

    class Idle:
        name = "idle"

        def apply(self, g, ctx):
            return g

    class Renamer:  # a new graph with the same nodes: verified
        name = "renamer"

        def apply(self, g, ctx):
            return replace(g, name="renamed")

    checks = []
    monkeypatch.setattr(pm, "verify", lambda g, after="", checked=None: checks.append(after))
    PassManager([Idle(), Renamer(), Idle()], CompileContext(log=io.StringIO())).run(graph(OK_BODY))
    assert checks == ["capture", "renamer"]


def test_the_verifier_is_handed_the_graph_it_verified_last(monkeypatch):
    """The verifier skips the nd-SBP checks of the nodes the graph it verified last holds: the
    pass manager must hand it that graph (a copy of its fields as they were then), after every
    pass but the first check."""
    import sbpc.compiler.pass_manager as pm

    class Renamer:
        name = "renamer"

        def apply(self, g, ctx):
            return replace(g, name=g.name + "'")

    calls = []
    monkeypatch.setattr(pm, "verify", lambda g, after="", checked=None: calls.append((g, checked)))
    captured = graph(OK_BODY)
    PassManager([Renamer(), Renamer()], CompileContext(log=io.StringIO())).run(captured)
    (g0, c0), (g1, c1), (g2, c2) = calls
    assert g0 is captured and c0 is None
    assert c1 is not None and c1.name == g0.name and c1.nodes is g0.nodes
    assert c2 is not None and c2.name == g1.name and c2.nodes is g1.nodes


def test_print_after_and_dump_dir(tmp_path):
    log = io.StringIO()
    ctx = CompileContext(print_after={"dce"}, dump_dir=str(tmp_path), log=log)
    PassManager(default_pipeline(), ctx).run(graph(OK_BODY))
    assert re.findall(r"// ----- IR after (\S+) -----", log.getvalue()) == ["dce"]
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["00-capture.sbpir", "01-normalize.sbpir", "02-decompose.sbpir", "03-cse.sbpir", "04-dce.sbpir",
                     "05-offload.sbpir", "06-zero.sbpir", "07-stage-partition.sbpir", "08-sbp-propagate.sbpir",
                     "09-clip-grad.sbpir", "10-boxing.sbpir", "11-fuse-log-softmax.sbpir", "12-coalesce.sbpir",
                     "13-recompute.sbpir", "14-localize.sbpir", "15-random-draws.sbpir", "16-schedule.sbpir",
                     "17-fuse-adamw.sbpir", "18-inplace.sbpir", "19-overlap.sbpir", "20-memory-plan.sbpir"]
    assert "stage=0" in (tmp_path / "07-stage-partition.sbpir").read_text()


def test_print_after_unknown_pass():
    with pytest.raises(UsageError, match=r"--print-after names unknown pass 'nope'.*passes: capture, normalize"):
        PassManager(default_pipeline(), CompileContext(print_after={"nope"}))


def test_every_pass_declares_its_contract_and_the_default_pipeline_keeps_them():
    for p in REGISTRY.values():
        assert all(isinstance(f, Fact) for f in (*p.needs, *p.provides)), p.name
    PassManager(default_pipeline(), CompileContext()).require("lower", (Fact.ESTIMATES,))


# each fact some pass needs: dropping every pass that provides it breaks the pipeline there
NEEDED = sorted({f for p in REGISTRY.values() for f in p.needs}, key=lambda f: f.name)


@pytest.mark.parametrize("fact", NEEDED, ids=[f.name for f in NEEDED])
def test_a_missing_prerequisite_names_the_pass_and_what_it_lacks(fact):
    kept = [p for p in default_pipeline() if fact not in p.provides]
    first = next(p for p in kept if fact in p.needs)
    makers = " or ".join(name for name, p in REGISTRY.items() if fact in p.provides)
    with pytest.raises(CompileError, match=rf"^{first.name} needs {re.escape(fact.value)}, which no pass before "
                                           rf"it provides; hint: run {makers} before {first.name}$"):
        PassManager(kept, CompileContext())


def test_compile_model_checks_the_pass_list_before_capturing(monkeypatch):
    from sbpc.compiler import driver
    from sbpc.compiler.frontend.model_loader import load_model
    from sbpc.compiler.frontend.optim import OptimizerConfig
    from sbpc.compiler.ir.mesh import parse_mesh

    monkeypatch.setattr(driver, "capture", lambda *a: pytest.fail("captured a model its passes cannot compile"))
    source = load_model("examples/mlp.py", {})
    compile_ = lambda passes: driver.compile_model(source, parse_mesh("1"), batch_size=4, optimizer=OptimizerConfig(),
                                                   passes=passes)
    with pytest.raises(CompileError, match=r"^localize needs the collectives .*; hint: run boxing before localize$"):
        compile_([SbpPropagate(), Localize(), MemoryPlan()])
    with pytest.raises(CompileError, match=r"^lower needs the memory estimates, .*; hint: run memory-plan before lower$"):
        compile_([SbpPropagate(), Boxing()])
    # given facts: IR read back after boxing may go on from there
    PassManager([Localize()], CompileContext(), given=[Fact.BOXED])


def test_memory_plan_estimates_match_the_model():
    result, source, _ = compile_example("mlp.py")
    est = result.plan.estimates
    # mlp defaults: 32 -> 64 -> 64 -> 8, weights and biases
    params = 32 * 64 + 64 + 64 * 64 + 64 + 64 * 8 + 8
    assert est.param_count == params
    assert est.param_bytes == est.grad_bytes == 4 * params
    assert est.optimizer_state_bytes == 2 * 4 * params + 8  # exp_avg, exp_avg_sq, and the f64 step
    assert 0 < est.peak_activation_bytes < 10 * 2**20
    assert est.instructions == len(result.plan.stages[0].instructions)


def test_cse_shares_the_optimizer_bias_correction():
    # without fuse-adamw, whose one kernel call computes the bias corrections itself
    _, source, optimizer = compile_example("gpt.py")
    passes = [p for p in default_pipeline() if p.name != "fuse-adamw"]
    result = compile_model(source, parse_mesh("1"), batch_size=4, optimizer=optimizer, passes=passes)
    ops = [i.op for i in result.plan.stages[0].instructions]
    assert ops.count("aten.pow.Scalar") == 2  # beta1**t and beta2**t, once for all 29 parameters
    assert len(result.plan.params) == 29


def test_normalize_makes_new_factories_plain():
    """``x.new_zeros(size)`` reads nothing of ``x`` but its dtype: as a plain factory its layout
    is free (a batch ``x`` is not gathered over micro-batches for it)."""
    from sbpc.compiler.ir.printer import format_node
    from sbpc.compiler.passes.normalize import Normalize

    g = graph("""  %z = aten.new_zeros.default(%x, [3, 4], pin_memory=False) : f32[3, 4] {role=fwd}
  %f = aten.new_full.default(%x, [2], 7, dtype=i64) : i64[2] {role=fwd}
  %l = aten.sum.default(%z) : f32[] {role=fwd}
  output loss %l "loss\"""")
    z, f = [format_node(n) for n in Normalize().apply(g, None).nodes[:2]]
    assert z.startswith("%z = aten.zeros.default([3, 4], pin_memory=False, dtype=f32, device=#device)"), z
    assert f.startswith("%f = aten.full.default([2], 7, dtype=i64, device=#device)"), f
