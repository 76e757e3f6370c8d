"""Data, tensor and sequence parallelism: parity with the single device (on in-process ranks,
and on real gloo processes for one dp and one tp mesh), and the collectives each strategy must
emit (counted per kind, axis, phase and layer)."""
from __future__ import annotations

import re
from collections import Counter

import pytest

from conftest import sbpc_check
from sbpc.compiler.tools.comm_report import collectives
from sbpc.compiler.driver import compile_model
from sbpc.compiler.frontend.hints import load_config
from sbpc.compiler.ir.mesh import parse_mesh
from sbpc.compiler.frontend.model_loader import load_model
from sbpc.compiler.frontend.optim import OptimizerConfig

# The checks run with sbpc check's defaults (AdamW, tolerance 1e-5): each step is verified as a
# function of its inputs (docs/check.md), so a correct plan passes under any optimizer.
# Realistic proportions for counting (tokens >> hidden, vocab >> hidden): on the tiny preset the
# cost model rightly finds gathering 128-token activations cheaper than reducing weight gradients.
MID = dict(hidden=1024, heads=8, vocab=8192, seq=128)
BATCH = 4
GPT = ["examples/gpt.py", "--config", "examples/gpt.megatron.toml"]
HF = ["examples/hf_gpt2.py", "--config", "examples/hf_gpt2.megatron.toml"]
# Parity runs on in-process ranks (threads, runtime/threads.py): the same plan, the same
# collectives and, on two-way axes, gloo's bits, without an interpreter per rank. Every mesh of
# one and two axes up to four devices runs; a few run on real gloo processes (marked below).
MESHES = ["2x1", "4x1", "1x2", "1x4", "2x2"]
ODD = ["3x1"]  # three-way data parallel: batch 3, sums over three ranks (tp=3 divides no head count here)
# Real multi-process gloo runs, one per strategy: data parallel and tensor parallel (pipeline:
# test_pipeline_parity.py)
GLOO = [("2x1", "processes"), ("1x2", "processes")]


def _check(*args: str, ranks: str = "threads"):
    r = sbpc_check(*args, "--steps", "2", ranks=ranks, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"largest deviation .*: PASS", r.stdout), r.stdout
    return r.stdout


@pytest.mark.parametrize("mesh,ranks", [(m, "threads") for m in MESHES + ODD] + GLOO)
def test_gpt_megatron_parity(mesh, ranks):
    _check(*GPT, "--mesh", mesh, ranks=ranks)


@pytest.mark.parametrize("mesh", MESHES)
def test_hf_gpt2_parity(mesh):
    _check(*HF, "--mesh", mesh)


def test_gpt_sequence_parallel_parity():
    _check(*GPT, "--mesh", "2x2", "--set", "sp=True")


def test_hf_gpt2_sequence_parallel_parity():
    _check("examples/hf_gpt2.py", "--config", "examples/hf_gpt2.megatron-sp.toml", "--mesh", "2x2")


# ----- collective counts (compile only)

def _plan(model: str, mesh: str, config: str | None = None, batch: int = BATCH, passes=None, **sets):
    cfg = load_config(config) if config else None
    return compile_model(load_model(model, {**MID, **sets}), parse_mesh(mesh), batch_size=batch, optimizer=OptimizerConfig(),
                         config=cfg, passes=passes).plan


def _layer(module: str) -> str | None:
    m = re.match(r"(?:model\.transformer\.)?h\.(\d+)(\.|$)", module)
    return m.group(1) if m else None


def _moving(plan):
    return [c for c in collectives(plan) if c.moves_data]


def test_data_parallel_reduces_each_gradient_once():
    # Data parallelism pays when a step's tokens outnumber the hidden size, so that activations
    # outweigh weights (2048 tokens, hidden 256, vocab 256). With weights larger than the
    # activations the cost model rightly gathers activations instead of reducing gradients.
    plan = _plan("examples/gpt.py", "2x1", batch=16, hidden=256, heads=4, vocab=256)
    cs = _moving(plan)
    loss = [c for c in cs if c.value == plan.stages[0].loss.removesuffix("_all_reduce")]
    # one all-reduce per parameter gradient (possibly of its transpose: same bytes) ...
    grad_reductions = [c for c in cs if c.role in ("bwd", "opt") and c not in loss]
    assert {(c.axis, c.kind) for c in grad_reductions} == {("dp", "all_reduce")}
    param_bytes = Counter(4 * _numel(p.shape) for p in plan.params)
    assert Counter(c.nbytes for c in grad_reductions) == param_bytes
    # ... and one collective for the token count, which makes the mean loss exact (cross-entropy
    # divides by the tokens of the whole batch, not of each shard). The count is taken from the
    # targets, so it is either the 0-dim count all-reduced or the 1-byte-per-token mask of kept
    # targets all-gathered: one call each, and with 2048 tokens the gather saves a ring step.
    # The loss itself (this shard's sum over the global count) is reduced once, in the step:
    # the one 4-byte all-reduce of the loss value, a member of the first gradient bucket.
    others = [c for c in cs if c.role == "fwd"]
    count = [c for c in others if c not in loss]
    assert [(c.kind, c.nbytes, c.axis) for c in loss] == [("all_reduce", 4, "dp")], others
    assert len(count) == 1 and count[0].axis == "dp", others
    assert (count[0].kind, count[0].nbytes) in {("all_reduce", 4), ("all_gather", 16 * 128 // 2)}, others


def test_gradient_accumulation_reduces_once_a_step():
    """With micro-batches, the forward and backward run once per micro-batch and the gradient
    reductions once a step (after the accumulation), and the cost model weighs them so: few
    tokens per micro-batch and weights larger than the activations, yet 16 micro-batches make
    DDP's plan (accumulate, then reduce each gradient once) the cheapest. Priced once per
    micro-batch, the backward all-gathered activations over dp in every micro-batch instead
    (148 collective calls a step against 21)."""
    from sbpc.compiler.passes import PipelineOptions

    cfg = load_model("examples/gpt.py", dict(hidden=512, heads=8, vocab=256, seq=16))
    plan = compile_model(cfg, parse_mesh("2x1"), batch_size=32, optimizer=OptimizerConfig(),
                         pipeline=PipelineOptions(microbatches=16)).plan
    cs = _moving(plan)
    assert not [c for c in cs if c.role == "bwd"], cs  # nothing crosses dp per micro-batch in the backward
    assert all(c.nbytes == 4 for c in cs if c.role in ("pre", "fwd")), cs  # the token count, the loss
    grads = [c for c in cs if c.role == "opt" and c.kind in ("all_reduce", "reduce_scatter")]
    assert sum(c.nbytes for c in grads) >= sum(4 * _numel(p.shape) for p in plan.params)  # each gradient once
    # the token count is summed over the micro-batches, then over dp, before any forward (the
    # schedule's pre phase), and the mean loss is exact
    _check("examples/gpt.py", "--mesh", "2x1", "--microbatches", "16", "--batch-size", "32",
           "--set", "hidden=512", "--set", "heads=8", "--set", "vocab=256", "--set", "seq=16")


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def test_megatron_tensor_parallel_counts():
    plan = _plan("examples/gpt.py", "1x2", "examples/gpt.megatron.toml")
    cs = _moving(plan)
    per_layer = Counter((_layer(c.module), c.kind, c.role) for c in cs if _layer(c.module) is not None)
    for layer in ("0", "1"):
        assert per_layer[(layer, "all_reduce", "fwd")] == 2, per_layer
        assert per_layer[(layer, "all_reduce", "bwd")] == 2, per_layer
    layer_kinds = {(k, r) for (l, k, r) in per_layer if l is not None}
    assert layer_kinds <= {("all_reduce", "fwd"), ("all_reduce", "bwd")}, per_layer
    # vocab-parallel embedding and cross-entropy: the logits are never gathered
    assert not [c for c in cs if c.kind == "all_gather"], [c for c in cs if c.kind == "all_gather"]
    logits_bytes = BATCH * 128 * 8192 * 4 // 2  # a tp shard of the logits
    assert all(c.nbytes < logits_bytes for c in cs)
    # the fused qkv is sharded per head: its weight is a strided split, no collective in attention
    spec = {p.name: p.sbp for p in plan.params}
    assert spec["h.0.attn.c_attn.weight"] == ["B", "S(0:3)"]


def test_megatron_small_hidden_counts():
    # bench/tp_vs_dtensor.py's mid config (hidden 128, 1024 tokens): the search used to stop with
    # attn.c_proj computed whole (its input and weight gathered, the backward's heads
    # all-to-all'd back), though Megatron's all-reduce after it costs less under the same model
    # (docs/parallel.md, the joint move's flood). Per layer: Megatron's 2 + 2 all-reduces only.
    plan = _plan("examples/gpt.py", "1x2", "examples/gpt.megatron.toml", batch=16, hidden=128, heads=4, vocab=256,
                 seq=64, layers=2)
    per_layer = Counter((_layer(c.module), c.kind, c.role) for c in _moving(plan) if _layer(c.module) is not None)
    assert per_layer == Counter({(l, "all_reduce", r): 2 for l in ("0", "1") for r in ("fwd", "bwd")}), per_layer


@pytest.mark.parametrize("priced", [False, True])
def test_sequence_parallel_counts(priced):
    from sbpc.compiler.passes import default_pipeline
    from sbpc.compiler.sbp.cost_model import MEMORY_PRICES

    # priced: memory at the top of the ladder --device-memory climbs (docs/memory.md)
    passes = default_pipeline(memory_price=MEMORY_PRICES[-1]) if priced else None
    plan = _plan("examples/gpt.py", "1x2", "examples/gpt.megatron.toml", sp=True, passes=passes)
    cs = _moving(plan)
    shard = BATCH * 128 * 1024 * 4 // 2  # a tp shard of the residual stream
    for layer in ("0", "1"):
        big = Counter((c.kind, c.role) for c in cs if _layer(c.module) == layer and c.nbytes >= shard)
        # forward: each of the two TP all-reduces is one reduce-scatter + one all-gather
        assert big[("reduce_scatter", "fwd")] == 2 and big[("all_gather", "fwd")] == 2, big
        assert big[("all_reduce", "fwd")] == 0, big
        # backward: the gradient is reduce-scattered where it becomes partial, never all-reduced
        assert big[("all_reduce", "bwd")] == 0 and big[("reduce_scatter", "bwd")] == 2, big
        if not priced:  # Megatron's optimum: the mirror of the forward
            assert big[("all_gather", "bwd")] == 2, big
        else:  # Megatron's implementation: the layer norms' outputs kept S(seq), gathered again
            # for the weight gradients (2 all-gathers more), the gradients reduce-scattered
            assert big[("all_gather", "bwd")] == 4 and big[("reduce_scatter", "bwd")] == 2, big


def test_propagation_is_deterministic():
    a = _plan("examples/gpt.py", "2x2", "examples/gpt.megatron.toml")
    b = _plan("examples/gpt.py", "2x2", "examples/gpt.megatron.toml")
    assert a.model_dump_json() == b.model_dump_json()


@pytest.mark.parametrize("mesh,microbatches", [("2x1", 1), ("1", 2), ("2x1x2", 2)])
def test_alibi_batch_splits_over_dp_and_micro_batches(mesh, microbatches):
    """Bloom's ALiBi (tests/models/alibi_attention.py): per-head slopes of constants repeated
    over the batch into ``[b*h, 1, t]`` meet the scores of the batch and heads folded into one
    dim. The repeat's output dim splits two ways (its copies: the batch, plainly; each copy: the
    heads, strided), and its strided block count was fixed on the whole class of dims joined to
    the batch, so no op could take the batch as dp split it: dp re-split it by sequence (an
    all-to-all of the input, the attention whole) and micro-batches were refused (a gather of
    the batch). Now the plan is plain data parallelism in space and in time."""
    from sbpc.compiler.passes import PipelineOptions

    plan = compile_model(load_model("tests/models/alibi_attention.py", {}), parse_mesh(mesh), batch_size=4,
                         optimizer=OptimizerConfig(), pipeline=PipelineOptions(microbatches=microbatches)).plan
    dp = [a.name for a in plan.mesh if a.name != "pp"].index("dp")
    split = "S(0)" if parse_mesh(mesh).size("dp") > 1 else "B"
    batch = {b.value for b in plan.batch}
    assert all(b.sbp[dp] == split and b.microbatch == ("S(0)" if microbatches > 1 else None) for b in plan.batch)
    ins = [i for s in plan.stages for i in s.instructions]
    # every reader of a batch input takes it as it arrives, and nothing converts it
    readers = [(i.op, i.sbp_in[p]) for i in ins for p, a in enumerate(a for a in i.args if hasattr(a, "ref"))
               if a.ref in batch]
    assert readers and all(sbp[dp] == split for _, sbp in readers), readers
    assert not [c for c in _moving(plan) if c.value in batch], _moving(plan)
    # the attention runs on the batch's shard: the alibi's repeat and the scores split by batch
    for op in ("aten.repeat.default", "aten.baddbmm.default"):
        [sbp] = {tuple(i.types[0].sbp) for i in ins if i.op == op and i.role == "fwd"}
        assert sbp[dp] == split, (op, sbp)
    # plain data parallelism: nothing crosses dp in the backward (stages send their gradients)
    assert not [c for c in _moving(plan) if c.role == "bwd" and c.axis != "pp"], _moving(plan)
    _check("tests/models/alibi_attention.py", "--mesh", mesh, "--microbatches", str(microbatches))
