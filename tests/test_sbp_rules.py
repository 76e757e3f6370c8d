"""SBP rules: the DSL, the engine, and the proof of every rule by execution.

Every op instance of the example joint graphs (plus synthetic instances of rule-file ops the
examples do not use) runs with real values; each signature the rule book offers on a 1-D
axis of 2 and of 4 devices is then simulated rank by rank and must reproduce the logical
outputs (compiler/sbp/rules/validate.py).
"""
from __future__ import annotations

import re

import pytest
import torch

from conftest import compile_example
from sbp_rule_instances import synth, synthetic, traced
from sbpc.compiler.ir.types import InputKind, Node, Ref, Role, TensorType
from sbpc.compiler.sbp.rules.validate import AXIS, Instance, instances, record, run_node, validate
from sbpc.compiler.sbp.rules import RuleBook, Signature
from sbpc.errors import IRError
from sbpc.runtime.backend import make_backend
from sbpc.runtime.sbp import Broadcast, Partial, Split, divides, local_shape
from sbpc.runtime.sharding import combine, local_shard
from sbpc.runtime.topology import Topology
from sbpc.runtime.weights import init_weights

B, P, PMAX = Broadcast(), Partial(), Partial("max")
SIZES = (2, 4)
EXAMPLES = [("gpt.py", {}), ("mlp.py", {}), ("hf_gpt2.py", {}), ("hf_gpt2.py", {"sets": {"attn": "sdpa"}})]


@pytest.fixture(scope="module")
def book():
    return RuleBook.load()


def _graph_values(graph, plan, source):
    weights = init_weights(plan, make_backend("cpu"), 0)
    torch.manual_seed(0)
    batch = source.batch(plan.model.batch_size)
    values = {}
    for i in graph.inputs:
        if i.kind in (InputKind.PARAM, InputKind.BUFFER):
            values[i.value] = weights[i.name]
        elif i.kind == InputKind.BATCH:
            values[i.value] = batch[int(i.name.split(".")[1])]
        else:  # optimizer state: positive values (exp_avg_sq feeds a sqrt), the step count
            dtype = getattr(torch, {"f32": "float32", "f64": "float64", "bf16": "bfloat16"}[i.type.dtype])
            values[i.value] = torch.rand(i.type.shape, dtype=dtype) + 0.5
    return record(graph.nodes, values)


@pytest.fixture(scope="module")
def graph_instances(book):
    out, seen = [], set()
    for name, kw in EXAMPLES:
        result, source, _ = compile_example(name, **kw)
        env = _graph_values(result.graph, result.plan, source)
        origin = name + "".join(f" {k}={v}" for k, v in kw.get("sets", {}).items())
        out += instances(result.graph.nodes, result.graph.value_types(), env, origin, book=book, sizes=SIZES, seen=seen)
    return out


@pytest.fixture(scope="module")
def report(book, graph_instances):
    return validate(book, graph_instances + synthetic() + traced(), sizes=SIZES)


def test_every_signature_computes_the_logical_result(report):
    failures = report.failures
    if failures:  # pytest.fail, not assert: the report holds tensors that assertion rewriting would print
        pytest.fail(f"{len(failures)} of {len(report.outcomes)} signatures fail:\n" + "\n".join(map(str, failures[:20])))


def test_every_rule_is_exercised(book, report):
    cov = report.coverage()
    missing = [op for op in book.ops() if op not in cov]
    assert not missing, f"rules no instance exercises: {missing}"
    never = [op for op, (_, offered, held) in cov.items() if offered and not held]
    assert not never, f"rules whose non-B signatures never held: {never}"
    # the families that make parallelism possible offer real splits on these instances
    for op in ("aten.mm.default", "aten.embedding.default", "aten.amax.default", "aten.split.Tensor",
               "aten.cat.default", "sbpc.attention", "aten.nll_loss_forward.default"):
        assert cov[op][1] > 0, op


def _ops(insts, op):
    return [i for i in insts if i.node.op == op]


def test_a_wrong_rule_fails_validation(graph_instances):
    wrong = RuleBook.from_text('aten.mm.default = einsum("mk,kn->mk")')  # says a split k gives S, not P
    rep = validate(wrong, _ops(graph_instances, "aten.mm.default")[:2], sizes=(2,))
    assert any("deviates" in str(o) or "shape" in str(o) for o in rep.failures)
    wrong = RuleBook.from_text("aten.mul.Tensor = elementwise(self, other) partial(self+other)")  # P * P is not P
    rep = validate(wrong, [synth("aten.mul.Tensor", torch.randn(4, 4), torch.randn(4, 4))], sizes=(2,))
    assert [str(o.signature) for o in rep.failures] == ["(P, P) -> (P)"]
    wrong = RuleBook.from_text("aten.exp.default = elementwise(self) partial(self)")  # exp is not linear
    assert validate(wrong, [synth("aten.exp.default", torch.randn(4, 4))], sizes=(2,)).failures


def test_signatures_all_b_first_and_divisible(book):
    t = TensorType
    n = Node(["o"], "aten.mm.default", (Ref("a"), Ref("b")), {}, [t((6, 4), "f32")], Role.FORWARD)
    sigs = book.signatures(n, [t((6, 8), "f32"), t((8, 4), "f32")], 4)
    assert sigs[0] == Signature((B, B), (B,), "all B")
    assert (Split(1), Split(0)) in [s.ins for s in sigs]  # k: 8 divides by 4
    assert not any(s.outs == (Split(0),) for s in sigs)  # m: 6 does not
    assert ((P, B), (P,)) in [(s.ins, s.outs) for s in sigs]
    unknown = Node(["o"], "aten.fancy.default", (Ref("a"),), {}, [t((4,), "f32")], Role.FORWARD)
    assert book.signatures(unknown, [t((4,), "f32")], 2) == [Signature((B,), (B,), "all B")]
    assert not book.has_rule("aten.fancy.default") and book.has_rule("aten.mm.default")


def test_histc_counts_add_only_over_a_fixed_range(book):
    """A split input's counts add (P) when min and max fix the bins; with min == max torch
    takes the range from the data, each block's own, so only all-B is offered."""
    t = TensorType
    sigs = lambda lo, hi: {(s.ins, s.outs) for s in book.signatures(
        Node(["o"], "aten.histc.default", (Ref("x"), 4, lo, hi), {}, [t((4,), "f32")], Role.FORWARD),
        [t((8, 6), "f32")], 2)}
    assert ((Split(0),), (P,)) in sigs(0, 3) and ((Split(1),), (P,)) in sigs(0, 3)
    assert sigs(0, 0) == sigs(2.0, 2.0) == {((B,), (B,))}


def test_addmm_bias_is_partial_when_k_splits(book):
    t = TensorType
    n = Node(["o"], "aten.addmm.default", (Ref("b"), Ref("x"), Ref("w")), {}, [t((8, 4), "f32")], Role.FORWARD)
    sigs = {(s.ins, s.outs) for s in book.signatures(n, [t((4,), "f32"), t((8, 6), "f32"), t((6, 4), "f32")], 2)}
    assert ((P, Split(1), Split(0)), (P,)) in sigs
    assert ((B, Split(1), Split(0)), (P,)) not in sigs


def test_strided_split_through_qkv(book):
    t = TensorType
    split = Node(["q", "k", "v"], "aten.split.Tensor", (Ref("x"), 64, 2), {}, [t((4, 32, 64), "f32")] * 3, Role.FORWARD)
    sigs = [(s.ins, s.outs) for s in book.signatures(split, [t((4, 32, 192), "f32")], 2)]
    assert ((Split(2, 3),), (Split(2),) * 3) in sigs
    cat = Node(["c"], "aten.cat.default", ([Ref("a"), Ref("b"), Ref("c")], 2), {}, [t((4, 32, 192), "f32")], Role.FORWARD)
    sigs = [(s.ins, s.outs) for s in book.signatures(cat, [t((4, 32, 64), "f32")] * 3, 2)]
    assert ((Split(2),) * 3, (Split(2, 3),)) in sigs
    [local] = book.localize(split, [(Split(2, 3),)], [(Split(2),)] * 3, (2,), ("tp",))
    assert local.args == (Ref("x"), 32, 2) and local.types == split.types and local.sbp == [(Split(2),)] * 3


def _view_cases() -> list[Instance]:
    g = torch.Generator().manual_seed(2)
    x = lambda *s: torch.randn(*s, generator=g)
    return [synth("aten.view.default", x(4, 6, 8), [24, 8]), synth("aten.view.default", x(24, 8), [4, 6, 8]),
            synth("aten.reshape.default", x(3, 4, 6), [12, 6]), synth("aten.view.default", x(12), [3, 4]),
            synth("aten.view.default", x(2, 6), [3, 4]), synth("aten.view.default", x(5, 6, 8), [30, 8]),
            synth("aten.unflatten.int", x(24, 6), 0, [6, 4]), synth("aten.flatten.using_ints", x(4, 6, 8), 0, 1)]


def test_view_splits_an_inner_dim_of_a_folded_group(book):
    """A split inside a folded group maps to the strided split of the folded dim that cuts as
    many flat blocks, and back; every offered signature holds on 2 and 3 devices."""
    sigs = lambda inst, k: {(s.ins, s.outs) for s in book.signatures(inst.node, inst.in_types, k)}
    fold, unfold, odd3, flat, mixed, odd5, unflat, _ = cases = _view_cases()
    assert ((Split(1),), (Split(0, 4),)) in sigs(fold, 2)  # [L, B, E] S(1) -> [L*B, E] S(0:L)
    assert ((Split(1),), (Split(0, 4),)) in sigs(fold, 3)
    assert ((Split(1, 3),), (Split(0, 12),)) in sigs(fold, 2)  # nested: S(1:q) -> S(0:L*q)
    assert ((Split(0, 4),), (Split(1),)) in sigs(unfold, 2) and ((Split(0, 4),), (Split(1),)) in sigs(unfold, 3)
    assert ((Split(0, 3),), (Split(1),)) in sigs(flat, 2)  # [12] S(0:3) -> [3, 4] S(1)
    assert ((Split(1, 3),), (Split(1, 2),)) in sigs(mixed, 2)  # [2, 6] -> [3, 4]: 6 flat blocks each
    assert ((Split(1),), (Split(0, 5),)) in sigs(odd5, 2) and ((Split(0, 6),), (Split(1),)) in sigs(unflat, 2)
    # indivisible: refused, never a wrong layout
    assert not any(Split(0) in s[0] for s in sigs(odd5, 2))  # 5 rows over 2
    assert not any(isinstance(x, Split) for s in sigs(mixed, 3) for x in s[0])  # 2 blocks of 3 over 3: straddle
    assert not any(s[0] == (Split(1),) for s in sigs(odd3, 3))  # the 4 of [3, 4, 6] over 3
    rep = validate(book, cases, sizes=(2, 3))
    assert not rep.failures, "\n".join(map(str, rep.failures))
    assert sum(any(isinstance(x, Split) and x.parts > 1 for x in o.signature.outs + o.signature.ins)
               for o in rep.outcomes) >= 20


def _run_nd(book, inst, ins, outs, sizes) -> torch.Tensor:
    """The logical output of a one-input op (a view, a repeat) run on a 2-D mesh with these nd-SBPs (rank order: the last axis inner)."""
    [local] = book.localize(inst.node, [ins], [outs], sizes, ("dp", "tp"))
    shards = []
    for c0 in range(sizes[0]):
        row = []
        for c1 in range(sizes[1]):
            env = {next(iter(inst.node.uses())): local_shard(inst.ins[0], ins, (c0, c1), sizes)}
            run_node(local, env)
            row.append(env[inst.node.outputs[0]])
        shards.append(combine(row, outs[1]))
    return combine(shards, outs[0])


def test_view_nd_signatures_nest_exactly(book):
    """Axes apply in order, each on the shard the earlier left: a later axis' strided split
    counts the blocks of that shard. The nd check keeps exactly the combinations that compute
    the logical result; (S(0), S(1)) of [L, B, E] is not (S(0), S(0:L)) of [L*B, E]."""
    import itertools

    sizes = (2, 2)
    fold = synth("aten.view.default", torch.randn(4, 4, 8), [16, 8])
    refused = []
    for inst in _view_cases()[:2] + _view_cases()[6:] + [fold]:
        one = [s for s in book.signatures(inst.node, inst.in_types, 2) if all(isinstance(x, Split) for x in s.ins + s.outs)]
        kept = 0
        for a, b in itertools.product(one, repeat=2):
            ins, outs = (a.ins[0], b.ins[0]), (a.outs[0], b.outs[0])
            shapes = [inst.in_types[0].shape, inst.node.types[0].shape]
            if not all(divides(sh, nd, sizes) for sh, nd in zip(shapes, (ins, outs))):
                continue
            exact = book.nd_exact(inst.node, shapes[:1], (ins,), (outs,), sizes)
            same = torch.equal(_run_nd(book, inst, ins, outs, sizes), inst.outs[0])
            assert exact <= same, f"{inst.node.op} {ins} -> {outs} is kept but wrong"
            kept += exact
            refused += [] if exact else [(inst, ins, outs, same)]
        assert kept >= 4, (inst.node.op, kept)
    bad = [(ins, outs, same) for inst, ins, outs, same in refused if inst is fold]
    assert ((Split(0), Split(1)), (Split(0), Split(0, 4)), False) in bad
    assert not all(same for *_, same in refused)


def test_repeat_nd_signatures_hold_exactly(book):
    """A repeated dim splits two ways: its copies (the input whole, each device repeating r/k
    times: a batch folded in front of Bloom's alibi heads) or each copy (the input split: the
    heads). The layout analysis offers either block count on that dim, so every count is tried
    here on a 2x2 mesh with the input whole or split, and the nd check keeps exactly the
    combinations that compute the logical result: ``B -> S(0:4)`` of a 4-fold repeat over 2
    devices is refused (each block is one copy, not whole copies per device)."""
    import itertools

    sizes = (2, 2)
    g = torch.Generator().manual_seed(3)
    cases = [synth("aten.repeat.default", torch.randn(4, 1, 6, generator=g), [4, 1, 1]),
             synth("aten.repeat.default", torch.randn(4, 6, generator=g), [4, 1, 1]),
             synth("aten.repeat.default", torch.randn(2, 6, generator=g), [2, 4])]
    refused = []
    for inst in cases:
        out = inst.node.types[0].shape
        one = [(s.ins[0], s.outs[0]) for s in book.signatures(inst.node, inst.in_types, 2)
               if not any(isinstance(x, Partial) for x in s.ins + s.outs)]
        one += [(B, Split(d, c)) for d in range(len(out)) for c in (1, 2, 4) if out[d] % (2 * c) == 0]
        kept = 0
        for (i0, o0), (i1, o1) in itertools.product(dict.fromkeys(one), repeat=2):
            ins, outs = (i0, i1), (o0, o1)
            shapes = [inst.in_types[0].shape, out]
            if not all(divides(sh, nd, sizes) for sh, nd in zip(shapes, (ins, outs))):
                continue
            exact = book.nd_exact(inst.node, shapes[:1], (ins,), (outs,), sizes)
            same = torch.equal(_run_nd(book, inst, ins, outs, sizes), inst.outs[0])
            assert exact <= same, f"{inst.node.types} {ins} -> {outs} is kept but wrong"
            kept += exact
            refused += [] if exact else [(inst, ins, outs, same)]
        assert kept >= 6, (inst.node.types, kept)
    alibi = [(ins, outs, same) for inst, ins, outs, same in refused if inst is cases[0]]
    assert ((B, B), (Split(0, 4), B), False) in alibi
    assert book.nd_exact(cases[0].node, [(4, 1, 6)], ((B, B),), ((Split(0), B),), sizes)  # the batch's split
    assert book.nd_exact(cases[0].node, [(4, 1, 6)], ((Split(0), B),), ((Split(0, 4), B),), sizes)  # the heads'
    assert not all(same for *_, same in refused)


def test_localize_rewrites_shapes_kernels_and_scales(book):
    t = TensorType
    view = Node(["o"], "aten.view.default", (Ref("x"), [-1, 64]), {}, [t((128, 64), "f32")], Role.FORWARD)
    [lv] = book.localize(view, [(Split(0), B)], [(Split(0), B)], (2, 4), ("dp", "tp"))
    assert lv.args == (Ref("x"), [64, 64]) and view.args == (Ref("x"), [-1, 64])
    emb = Node(["e"], "aten.embedding.default", (Ref("w"), Ref("i")), {}, [t((4, 8, 16), "f32")], Role.FORWARD)
    [le] = book.localize(emb, [(B, Split(0)), (Split(0), B)], [(Split(0), P)], (2, 4), ("dp", "tp"))
    assert le.op == "sbpc.embedding_masked" and le.kwargs == {"axis": "tp"}
    mean = Node(["m"], "aten.mean.dim", (Ref("x"), [1]), {}, [t((8,), "f32")], Role.FORWARD)
    main, scale = book.localize(mean, [(Split(1), Split(1))], [(P, P)], (2, 4), ("dp", "tp"))
    assert main.outputs == ["m__unscaled"] and scale.outputs == ["m"]
    assert scale.op == "aten.mul.Tensor" and scale.args == (Ref("m__unscaled"), 1 / 8) and scale.sbp == [(P, P)]
    assert scale.sbp_in == [(P, P)] and main.sbp == [(P, P)]
    assert book.localize(mean, [(Split(0), B)], [(Split(0), B)], (2, 4), ("dp", "tp"))[0].outputs == ["m"]


def test_masked_embedding_on_two_axes():
    """Vocab split over dp and tp at once: each rank's block offset folds both coordinates."""
    book = RuleBook.load()
    w, ids = torch.randn(16, 4), torch.randint(0, 16, (2, 8))
    node = Node(["e"], "aten.embedding.default", (Ref("w"), Ref("i")), {}, [TensorType((2, 8, 4), "f32")], Role.FORWARD)
    sizes, axes = (2, 2), ("dp", "tp")
    [local] = book.localize(node, [(Split(0), Split(0)), (B, B)], [(P, P)], sizes, axes)
    assert local.kwargs["axis"] == ["dp", "tp"]
    outs = []
    for rank in range(4):
        topo = Topology((("dp", 2), ("tp", 2)), rank)
        env = {"w": local_shard(w, (Split(0), Split(0)), topo.sbp_coords(), sizes), "i": ids}
        run_node(local, env, topo)
        outs.append(env["e"])
    rows = [combine(outs[2 * d:2 * d + 2], P) for d in range(2)]
    assert torch.allclose(combine(rows, P), torch.nn.functional.embedding(ids, w))


def test_local_shapes_match(book, graph_instances):
    """Localized shape arguments give the local shape the signature promises (spot check)."""
    for inst in _ops(graph_instances, "aten.view.default")[:3]:
        for sig in book.signatures(inst.node, inst.in_types, 2)[1:]:
            [local] = book.localize(inst.node, [(s,) for s in sig.ins], [(s,) for s in sig.outs], (2,), (AXIS,))
            if "size" in str(local.args) or isinstance(local.args[1], list):
                assert tuple(local.args[1]) == local_shape(inst.node.types[0].shape, sig.outs, (2,))


@pytest.mark.parametrize("text, where, what", [
    ('aten.mm.default = einsum("mk,kn->mn"', r"<t>:1:37", r"unexpected end|expected"),
    ("aten.mm.default = einsum(\"mk\")\n\naten.bmm.default = @", r"<t>:3:20", r"unexpected character '@'"),
    ("aten.mm.default = nosuch(self)", r"<t>:1:19", r"unknown family 'nosuch'"),
    ("aten.mm.default = elementwise(self, mat3)", r"<t>:1:37", r"no parameter 'mat3'"),
    ("\n# c\naten.mm.default = elementwise(self) partial(self)\naten.mm.default = broadcast_only", r"<t>:4:1",
     r"second rule for aten.mm.default"),
    ("aten.nosuch.default = broadcast_only", r"<t>:1:1", r"unknown op"),
    ("aten.mm.default = elementwise(self) sometimes(self)", r"<t>:1:37", r"unknown modifier"),
    ("aten.mm.default = reduce(self)", r"<t>:1:19", r"family reduce takes"),
])
def test_parse_errors_name_file_line_col(text, where, what):
    with pytest.raises(IRError) as e:
        RuleBook.from_text(text, "<t>")
    assert re.search(re.escape(where) if ":" in where else where, str(e.value)), str(e.value)
    assert re.search(what, str(e.value)), str(e.value)


def test_load_reads_a_path(tmp_path):
    p = tmp_path / "r.sbp"
    p.write_text("aten.mm.default = einsum(\"mk,kn->mn\")\naten.mm.default = x(\n")
    with pytest.raises(IRError, match=re.escape(str(p)) + r":2:\d+"):
        RuleBook.load(p)


def test_layer_norm_backward_without_an_input_gradient_compiles_on_tp():
    """native_layer_norm_backward with output_mask [False, True, True] (a LayerNorm on the batch
    input) has an empty first output: its rule must not index it (was an IndexError on 1x2)."""
    from sbpc.compiler.driver import compile_model
    from sbpc.compiler.frontend.model_loader import load_model
    from sbpc.compiler.frontend.optim import OptimizerConfig
    from sbpc.compiler.ir.mesh import parse_mesh
    from sbpc.compiler.pass_manager import CompileContext
    plan = compile_model(load_model("tests/models/layernorm_on_input.py"), parse_mesh("1x2"), batch_size=4,
                         optimizer=OptimizerConfig(), ctx=CompileContext(allow_replicated=True)).plan
    assert any(i.op == "aten.native_layer_norm_backward.default" for s in plan.stages for i in s.instructions)
