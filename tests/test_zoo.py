"""The zoo: real models, unmodified, each built from a tiny config (random weights, no download),
compiled with no config file (the cost model chooses every layout) and checked against eager
PyTorch on every acceptance mesh. Each check prints its largest deviation.

Models: Hugging Face GPT-2, Llama (GQA), Mistral (GQA, sliding window; unwrapped: a dict batch, its
ModelOutput's loss), GPT-J, OPT, BERT (masked LM; and fine-tuned for token classification on padded
rows, its pooler unused), T5 (encoder-decoder; its decoder input is filled in place), Bloom (ALiBi),
a decoder made of PyTorch's own ``nn.TransformerEncoderLayer``, a recurrent model of ``nn.LSTM`` and
``nn.GRU``, and the image classifiers ViT (truncated-normal init), ConvNeXt (drop-path rates read
from a tensor while building) and Swin (shifted windows; an ``as_strided`` pooler). Llama also runs
with its shipped Megatron config (examples/hf_llama.megatron.toml), whose collectives are counted.
Mixtral and GPT-OSS (mixtures of experts) have their experts split as row-wise regions on dp and
micro-batches (their own tests).
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import replace

import pytest

from sbpc.compiler.driver import compile_captured, compile_model
from sbpc.compiler.frontend.capture import capture
from sbpc.compiler.frontend.hints import load_config
from sbpc.compiler.frontend.model_loader import load_model
from sbpc.compiler.frontend.optim import OptimizerConfig
from sbpc.compiler.ir.mesh import parse_mesh
from sbpc.compiler.passes import PipelineOptions
from sbpc.compiler.tools.check import check_on_ranks
from sbpc.compiler.tools.comm_report import collectives

ZOO = {
    "gpt2": "tests/zoo/gpt2.py",
    "llama": "examples/hf_llama.py",
    "mistral": "tests/zoo/mistral.py",
    "gptj": "tests/zoo/gptj.py",
    "opt": "tests/zoo/opt.py",
    "bert": "tests/zoo/bert.py",
    "bert_padded": "tests/zoo/bert_padded.py",
    "torch_decoder": "tests/zoo/torch_decoder.py",
    "t5": "tests/zoo/t5.py",
    "rnn": "tests/zoo/rnn.py",
    "bloom": "tests/zoo/bloom.py",
    "vit": "tests/zoo/vit.py",
    "convnext": "tests/zoo/convnext.py",
    "swin": "tests/zoo/swin.py",
    "mixtral": "tests/zoo/mixtral.py",
}
COMPILE_MESHES = ["2x2", "2x2x2"]
BATCH = 4
# `sbpc check`'s defaults: AdamW (lr 1e-3, weight decay 0.01), 3 steps, tolerance 1e-5
CHECK_OPT = OptimizerConfig()
CHECK_STEPS = 3
CHECK_TOL = 1e-5

_sources: dict = {}
_captured: dict = {}  # one capture per model serves every mesh (no stage hints, one batch size)
_plans: dict = {}  # one plan per (model, mesh, micro-batches): the check on 2x2 reuses the compile test's


def _source(model: str):
    if model not in _sources:
        _sources[model] = load_model(ZOO[model], {})
    return _sources[model]


def _compile(model: str, mesh: str, microbatches: int | None = None):
    """The plan `sbpc compile` makes with no config (micro-batches: pp unless given)."""
    m = parse_mesh(mesh)
    key = (model, mesh, microbatches or m.size("pp"))
    if key not in _plans:
        if model not in _captured:
            _captured[model] = capture(_source(model), parse_mesh("1"), BATCH, CHECK_OPT, None)
        graph = replace(_captured[model], mesh=m.with_microbatches(key[2]))
        _plans[key] = compile_captured(graph, _source(model), batch_size=BATCH, optimizer=CHECK_OPT,
                                       pipeline=PipelineOptions(microbatches=key[2])).plan
    return _plans[key]


def _cases(meshes):
    return [(model, mesh) for model in ZOO for mesh in meshes]


@pytest.mark.parametrize("model,mesh", _cases(COMPILE_MESHES))
def test_zoo_compiles(model, mesh):
    plan = _compile(model, mesh)
    assert plan.world_size == parse_mesh(mesh).world_size
    assert len(plan.stages) == parse_mesh(mesh).size("pp")
    # data parallelism splits the work: every op that reads a batch input takes it as dp split
    # it, and nothing gathers or re-splits it (Bloom's alibi once made dp re-split it by sequence)
    dp = [a.name for a in plan.mesh if a.name != "pp"].index("dp")
    batch = {b.value for b in plan.batch}
    readers = [(i.op, i.sbp_in[p][dp]) for s in plan.stages for i in s.instructions
               for p, a in enumerate(a for a in i.args if hasattr(a, "ref")) if a.ref in batch]
    assert readers and all(sbp == "S(0)" for _, sbp in readers), readers
    assert not [c for c in collectives(plan) if c.value in batch and c.moves_data]


# ----- parity with eager PyTorch, every rank a thread of this process (runtime/threads.py)

CHECK_MESHES = {"2x1": 1, "1x2": 1, "2x2": 1, "1x2x2": 4}  # mesh -> micro-batches


@pytest.mark.parametrize("model,mesh", _cases(CHECK_MESHES))
def test_zoo_matches_eager(model, mesh):
    plan = _compile(model, mesh, CHECK_MESHES[mesh])
    report = check_on_ranks(plan, CHECK_OPT, steps=CHECK_STEPS, seed=0, tolerance=CHECK_TOL, ranks="threads")
    value, where = report.worst
    print(f"\nzoo {model} on {mesh}: largest deviation {value:.2e} ({where})")
    assert len(report.rows) == 1 + CHECK_STEPS, report.table()  # the init, then every step
    assert report.passed, report.table()


# ----- Llama with its Megatron config (examples/hf_llama.megatron.toml)

LLAMA_MEGATRON = "examples/hf_llama.megatron.toml"
# Realistic proportions for counting (tokens >> hidden, vocab >> hidden), as in test_parallel.py
LLAMA_MID = dict(hidden=1024, heads=8, kv_heads=2, ffn=2816, vocab=8192, seq=128)


def test_llama_megatron_matches_eager_on_2x2x2():

    # batch 8: one row per device of dp=2 in each of the 4 micro-batches (what `sbpc check` picks)
    plan = compile_model(_source("llama"), parse_mesh("2x2x2"), batch_size=8, optimizer=CHECK_OPT,
                         config=load_config(LLAMA_MEGATRON), pipeline=PipelineOptions(microbatches=4)).plan
    spec = {p.name: p.sbp for p in plan.params}
    assert spec["model.model.layers.0.self_attn.k_proj.weight"][-1] == "S(0)"  # on tp: the config applies
    report = check_on_ranks(plan, CHECK_OPT, steps=CHECK_STEPS, seed=0, tolerance=CHECK_TOL, ranks="threads")
    value, where = report.worst
    print(f"\nzoo llama megatron on 2x2x2: largest deviation {value:.2e} ({where})")
    assert report.passed, report.table()


def test_llama_megatron_tensor_parallel_counts():
    """Megatron's collectives exactly: per layer two all-reduces forward and two backward, and
    none for an RMSNorm weight's gradient (its backward runs on the whole gradient)."""
    plan = compile_model(load_model(ZOO["llama"], LLAMA_MID), parse_mesh("1x2"), batch_size=BATCH,
                         optimizer=OptimizerConfig(), config=load_config(LLAMA_MEGATRON)).plan
    layers = 2  # examples/hf_llama.py's default
    cs = [c for c in collectives(plan) if c.moves_data]
    assert {(c.kind, c.axis) for c in cs} == {("all_reduce", "tp")}, cs  # nothing is ever gathered
    activation = BATCH * LLAMA_MID["seq"] * LLAMA_MID["hidden"] * 4  # the residual stream, whole
    big = [c for c in cs if c.nbytes == activation]
    layer = lambda c: m.group(1) if (m := re.match(r"model\.model\.layers\.(\d+)\.", c.module)) else None
    fwd = Counter(layer(c) for c in big if c.role == "fwd")
    # forward: one all-reduce after each row-parallel projection (o_proj, down_proj), and one of
    # the vocab-parallel embedding's masked lookup
    assert fwd == {**{str(i): 2 for i in range(layers)}, None: 1}, fwd
    # backward: one per column-parallel input (q/k/v share one, gate/up another), before the norm's
    # backward, and one at the vocab-parallel head. Each layer's two are of the sums autograd
    # makes of the q/k/v (gate/up) input gradients, which carry no layer's name (module
    # `model`): counted in total
    bwd = [c for c in big if c.role == "bwd"]
    assert len(bwd) == 2 * layers + 1, bwd


def test_llama_megatron_reduces_no_norm_weight_gradient():
    plan = compile_model(load_model(ZOO["llama"], LLAMA_MID), parse_mesh("1x2"), batch_size=BATCH,
                         optimizer=OptimizerConfig(), config=load_config(LLAMA_MEGATRON)).plan
    cs = [c for c in collectives(plan) if c.moves_data]
    activation = BATCH * LLAMA_MID["seq"] * LLAMA_MID["hidden"] * 4  # the residual stream, whole
    # vocab-parallel cross-entropy: the logits stay split; max and sum forward, one sum backward,
    # and the loss (each rank's share of the target logits) reduced in the step, as one scalar
    # riding in the backward's first all-reduce on tp (coalesce); and nothing else (no norm
    # weight's gradient of hidden floats)
    loss = plan.stages[0].loss.removesuffix("_all_reduce")
    assert [(c.kind, c.role, c.nbytes) for c in cs if c.value == loss] == [("all_reduce", "bwd", 4)], cs
    small = Counter((c.role, c.nbytes) for c in cs if c.nbytes != activation and c.value != loss)
    tokens = BATCH * LLAMA_MID["seq"]
    assert small == {("fwd", tokens * 4): 2, ("bwd", tokens * 4): 1}, small


def test_pipeline_names_the_op_that_needs_the_whole_batch():
    """An op without a rule runs on the whole batch, which micro-batches never are: the error
    names that op and the user's line, not the collective the solver placed upstream of it."""
    from sbpc.compiler.sbp.rules import RuleBook
    from sbpc.errors import CompileError

    assert not RuleBook.load().has_rule("aten.renorm.default")  # else pick another op for this test
    with pytest.raises(CompileError) as err:
        compile_model(load_model("tests/models/unruled_op.py", {}), parse_mesh("1x1x2"), batch_size=4,
                      optimizer=OptimizerConfig(), pipeline=PipelineOptions(microbatches=2))
    assert err.value.message.startswith("aten.renorm.default has no SBP rule"), err.value.message
    assert "tests/models/unruled_op.py:12" in str(err.value.location), err.value.location


# ----- BEiT: Hugging Face keeps its relative position index in a process-wide lru_cache

def test_beit_cache_keeps_no_traced_tensor():
    """Capture traces with torch.compiler.is_compiling() true, as torch.export does, so Hugging
    Face's ``compile_compatible_method_lru_cache`` computes BEiT's index afresh instead of keeping
    the trace's fake tensor: eager in the same process (``sbpc check``'s reference) computes a
    real loss, and a second capture traces the same graph (it found the first one's fake tensor,
    a constant it cannot embed)."""
    import torch
    from sbpc.compiler.ir.printer import print_graph
    from sbpc.runtime.model_file import call_forward, loss_of

    source = load_model("tests/zoo/beit.py", {})
    first = capture(source, parse_mesh("1"), BATCH, CHECK_OPT, None)
    loss = loss_of(call_forward(source.build(), source.batch(BATCH), source.keys))
    assert type(loss) is torch.Tensor and torch.isfinite(loss), type(loss)
    assert print_graph(capture(source, parse_mesh("1"), BATCH, CHECK_OPT, None)) == print_graph(first)


def test_beit_matches_eager_on_2x1x2():
    plan = compile_model(load_model("tests/zoo/beit.py", {}), parse_mesh("2x1x2"), batch_size=BATCH,
                         optimizer=CHECK_OPT, pipeline=PipelineOptions(microbatches=2)).plan
    report = check_on_ranks(plan, CHECK_OPT, steps=CHECK_STEPS, seed=0, tolerance=CHECK_TOL, ranks="threads")
    value, where = report.worst
    print(f"\nzoo beit on 2x1x2: largest deviation {value:.2e} ({where})")
    assert report.passed, report.table()


def test_pipeline_names_the_op_that_relates_rows_of_the_batch():
    """Every op has a rule, but a contrastive loss's similarity pairs each micro-batch's rows with
    every row of the batch: the error names that op and its line, not the value the solver chose
    to gather upstream (the batch itself here; CLIP's last vision layer), and dp still runs it."""
    from sbpc.errors import CompileError

    with pytest.raises(CompileError) as err:
        compile_model(load_model("tests/models/contrastive.py", {}), parse_mesh("1x1x2"), batch_size=4,
                      optimizer=OptimizerConfig(), pipeline=PipelineOptions(microbatches=2))
    assert err.value.message.startswith("aten.mm.default reads the whole batch with one micro-batch's rows"), \
        err.value.message
    assert "tests/models/contrastive.py:14" in str(err.value.location), err.value.location
    plan = compile_model(load_model("tests/models/contrastive.py", {}), parse_mesh("2"), batch_size=4,
                         optimizer=CHECK_OPT).plan
    assert check_on_ranks(plan, CHECK_OPT, steps=CHECK_STEPS, seed=0, tolerance=CHECK_TOL, ranks="threads").passed


def test_a_default_micro_batch_count_runs_a_whole_batch_step_as_one_micro_batch(capsys):
    """`sbpc check` of the contrastive model on 1x1x2 with no flags: the default count (pp)
    cannot split its step, so the pipeline runs one micro-batch a step and says why, naming the
    op and the user's line; the propagation's warnings are printed once, not once per try. A
    count the user asks for is refused as above."""
    from sbpc.cli import main

    args = ["check", "tests/models/contrastive.py", "--mesh", "1x1x2", "--batch-size", "4", "--ranks", "threads"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert ("sbpc: note: aten.mm.default reads the whole batch with one micro-batch's rows: running 1 micro-batch "
            "a step instead of the default 2") in err, err
    assert "tests/models/contrastive.py:14" in err, err
    assert len(set(err.splitlines())) == len(err.splitlines()), err
    assert main(args + ["--microbatches", "2"]) == 2
    assert "reads the whole batch with one micro-batch's rows" in capsys.readouterr().err


def test_pipeline_names_the_op_that_reads_the_batch_whole_downstream_of_the_gather():
    """Every op reads the batch split but ``topk`` over the per-sample losses: the batch is
    followed through the signatures that keep it split, and the error names topk and its line.
    Before, it named the first linear layer, where the solver gathered the batch."""
    from sbpc.errors import CompileError

    with pytest.raises(CompileError) as err:
        compile_model(load_model("tests/models/hardest_examples.py", {}), parse_mesh("1x1x2"), batch_size=4,
                      optimizer=OptimizerConfig(), pipeline=PipelineOptions(microbatches=2))
    assert err.value.message.startswith("aten.topk.default reads the whole batch at once"), err.value.message
    assert "tests/models/hardest_examples.py:13" in str(err.value.location), err.value.location


# ----- Mixtral: a sparse mixture of experts (Hugging Face's grouped experts on CPU)

def test_mixtral_experts_split_as_a_row_wise_region_on_dp_and_micro_batches():
    """Hugging Face sorts every token it is given by expert, which no per-op rule splits: dp
    gathered the tokens and ran every expert on the whole batch, and a pipeline refused to
    split it into micro-batches. The experts module is a function of each token alone, so its
    ops are split as one row-wise region (compiler/sbp/rowwise.py): on dp the plan moves what
    data parallelism must and nothing more, one all-reduce per gradient and the loss's (the
    experts' weight gradients are partial sums now), plus the loss's token count gathered; and
    a pipeline runs it in micro-batches (the zoo's 1x2x2 check runs 4)."""
    source = load_model("tests/zoo/mixtral.py", {})
    result = compile_model(source, parse_mesh("2"), batch_size=BATCH, optimizer=CHECK_OPT)
    assert result.graph.rowwise == ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts")
    moved = Counter((c.kind, c.axis) for c in collectives(result.plan) if c.moves_data)
    params = len(result.plan.params)
    gathered = [c for c in collectives(result.plan) if c.kind == "all_gather"]
    assert moved[("all_reduce", "dp")] == params + 1, moved
    assert len(gathered) == 1 and gathered[0].nbytes == BATCH * 16 // 2, gathered  # the loss's mask, bool
    plan = compile_model(source, parse_mesh("2x1x2"), batch_size=BATCH, optimizer=CHECK_OPT,
                         pipeline=PipelineOptions(microbatches=2)).plan
    assert plan.pipeline.microbatches == 2


def test_gpt_oss_experts_with_biases_split_as_a_row_wise_region():
    """GPT-OSS's experts add a bias per expert (gathered by the sorted expert ids; its gradient
    is accumulated into a tensor of the experts' shape: a partial sum), and autograd sums the
    gradient of its gate-and-up output at the loss's line, outside the module: those sums join
    the region. On 2x1x2 its two micro-batches each sort their own tokens."""
    plan = compile_model(load_model("tests/zoo/gpt_oss.py", {}), parse_mesh("2x1x2"), batch_size=BATCH,
                         optimizer=CHECK_OPT, pipeline=PipelineOptions(microbatches=2)).plan
    report = check_on_ranks(plan, CHECK_OPT, steps=CHECK_STEPS, seed=0, tolerance=CHECK_TOL, ranks="threads")
    print(f"\nzoo gpt_oss on 2x1x2: largest deviation {report.worst[0]:.2e} ({report.worst[1]})")
    assert report.passed, report.table()


def test_mixtral_in_bf16_is_judged_against_a_float64_reference():
    """The experts' grouped matmul has no float64 CPU kernel, so the check had no measure of
    eager's own bf16 error and judged every gradient on the float32 floor: a correct plan on
    2x1x2, whose experts sum in another order than eager's, read 3.7e-5 and FAILed."""
    from sbpc.compiler.memory_options import MemoryOptions
    from sbpc.runtime.kinds import Precision

    plan = compile_model(load_model("tests/zoo/mixtral.py", {}), parse_mesh("2x1x2"), batch_size=BATCH,
                         optimizer=CHECK_OPT, pipeline=PipelineOptions(microbatches=2),
                         memory=MemoryOptions(precision=Precision.BF16)).plan
    report = check_on_ranks(plan, CHECK_OPT, steps=CHECK_STEPS, seed=0, tolerance=CHECK_TOL, ranks="threads")
    assert not [n for n in report.notes if "no float64 reference" in n], report.notes
    assert report.passed, report.table()
