"""Pipeline parallelism: parity with the single device (the acceptance meshes, on in-process
ranks; one mesh on real gloo processes), and what a pipelined plan sends between stages.

Each check runs 3 steps with sbpc check's defaults (AdamW, max relative deviation 1e-5) and
compares the loss, every gradient and every update with eager PyTorch on the whole batch.
"""
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
from sbpc.compiler.passes import PipelineOptions

OPT = ["--steps", "3"]  # sbpc check's defaults otherwise: AdamW, tolerance 1e-5
GPT = ["examples/gpt.py", "--config", "examples/gpt.megatron.toml"]


def _check(*args: str, ranks: str = "threads") -> str:
    r = sbpc_check(*args, *OPT, ranks=ranks, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"largest deviation .*: PASS", r.stdout), r.stdout
    assert len(re.findall(r"^\s+\d\s", r.stdout, re.M)) == 3  # three steps compared
    return r.stdout


# 1x2x2 runs a wider model: its activations are large enough for the cost model to send them
# cut along tp and gather them after receipt (the scatter/gather path is checked too)
WIDE = ["--set", "hidden=512", "--set", "heads=8", "--set", "vocab=2048", "--set", "seq=64", "--batch-size", "16"]


@pytest.mark.parametrize("mesh,m,extra", [("1x1x2", 4, []), ("1x1x4", 4, []), ("1x1x4", 8, []), ("2x1x2", 4, []),
                                          ("1x2x2", 4, WIDE), ("2x2x2", 4, []), ("2x1x2", 4, ["--schedule", "gpipe"])])
def test_gpt_pipeline_parity(mesh, m, extra):
    _check(*GPT, "--mesh", mesh, "--microbatches", str(m), "--batch-size", "8", *extra)


def test_gpt_pipeline_parity_on_real_gloo_processes():
    """The pipeline's send/recv over real gloo: one process per stage."""
    _check(*GPT, "--mesh", "1x1x2", "--microbatches", "4", "--batch-size", "8", ranks="processes")


def test_gpt_interleaved_pipeline_parity():
    _check(*GPT, "--mesh", "1x1x4", "--microbatches", "4", "--schedule", "interleaved", "--virtual-stages", "2")


def test_hf_gpt2_pipeline_parity_with_tied_weights():
    """GPT-2 ties wte and lm_head: the weight lives on the first and the last stage, its
    gradient contributions meet at the owner, and the other copy receives the update."""
    for mesh in ("1x1x2", "2x2x2"):
        out = _check("examples/hf_gpt2.py", "--config", "examples/hf_gpt2.megatron.toml", "--mesh", mesh,
                     "--microbatches", "4")
        assert "model.transformer" in out


def _plan(mesh: str, m: int, config: str | None = "examples/gpt.megatron.toml", **sets):
    opt = OptimizerConfig(kind="sgd", lr=0.1, momentum=0.9)
    sets = {"hidden": 256, "heads": 4, "vocab": 1024, "seq": 64, "layers": 4, **sets}
    return compile_model(load_model("examples/gpt.py", sets), parse_mesh(mesh), batch_size=8, optimizer=opt,
                         config=load_config(config) if config else None,
                         pipeline=PipelineOptions(microbatches=m)).plan


def test_stages_exchange_one_activation_and_one_gradient_per_boundary():
    plan = _plan("1x1x4", 4, config=None)
    cs = [c for c in collectives(plan) if c.kind == "transfer"]
    per_mb = Counter(c.role for c in cs)
    assert per_mb["fwd"] == 3 and per_mb["bwd"] == 3, cs  # the residual stream, p-1 boundaries each way
    hidden = 8 // 4 * 64 * 256 * 4  # one micro-batch of the residual stream, fp32
    assert all(c.nbytes == hidden for c in cs if c.role in ("fwd", "bwd")), cs
    # weights are not shared between stages here: nothing else crosses but shared optimizer scalars
    assert all(c.nbytes <= 8 for c in cs if c.role == "opt"), cs


def test_tensor_parallel_counts_hold_per_micro_batch_in_a_pipeline():
    plan = _plan("1x2x2", 4)
    cs = [c for c in collectives(plan) if c.moves_data and c.kind != "transfer"]
    layer = lambda c: (re.match(r"h\.(\d+)\.", c.module) or [None, None])[1]
    per_layer = Counter((layer(c), c.kind, c.role) for c in cs if layer(c) is not None)
    for i in ("0", "1", "2", "3"):
        assert per_layer[(i, "all_reduce", "fwd")] == 2, per_layer
        assert per_layer[(i, "all_reduce", "bwd")] == 2, per_layer
    # weight gradients are accumulated over the micro-batches on the device: no mb collective
    assert not [c for c in cs if c.axis == "mb"]
    ops = Counter(i.op for st in plan.stages for i in st.instructions)
    assert ops["sbpc.mb_accumulate"] >= len(plan.params)


def test_data_parallel_gradients_are_reduced_once_per_step_not_per_micro_batch():
    plan = _plan("2x1x2", 4, config=None, hidden=512, vocab=4096, seq=128)
    instrs = [i for st in plan.stages for i in st.instructions]
    partial = {i.args[0].ref for i in instrs if i.op == "sbpc.mb_accumulate"}  # a micro-batch's weight gradient
    assert len(partial) >= len(plan.params) - 1
    op = lambda i: f"sbpc.{i.kwargs['kind']}" if i.op == "sbpc.issue" else i.op  # issued collectives (overlap)
    dp = [i for i in instrs if op(i) in ("sbpc.all_reduce", "sbpc.all_reduce_coalesced") and i.kwargs.get("axis") == "dp"]
    refs = lambda i: [a.ref for a in (i.args[0] if isinstance(i.args[0], list) else [i.args[0]])]
    # no micro-batch's weight gradient is all-reduced: only their sum, in the once-a-step phase
    assert not [i for i in dp if set(refs(i)) & partial]
    assert [i for i in dp if i.role == "opt"]


def test_the_cost_model_decides_whether_an_activation_crosses_whole_or_cut_along_tp():
    def transfers(**sets):
        plan = _plan("1x2x2", 2, **sets)
        return [(c.kind, c.axis, c.role, c.nbytes) for c in collectives(plan)
                if c.kind == "transfer" and c.role == "fwd" or c.value.endswith(("_from0", "_from1"))]

    rows = 8 // 2  # one micro-batch
    small = transfers(hidden=64, heads=4, vocab=256, seq=32)  # 32 KB: one message beats two
    assert small == [("transfer", "pp", "fwd", rows * 32 * 64 * 4)], small
    big = transfers(hidden=512, heads=8, vocab=2048, seq=64)  # 512 KB: send half, gather on tp
    half = rows * 64 * 512 * 4 // 2
    assert ("transfer", "pp", "fwd", half) in big and ("all_gather", "tp", "fwd", half) in big, big


@pytest.mark.parametrize("mode,mesh", [("mean", "1x1x2"), ("sum", "2x2x2")])
def test_embedding_bag_pipeline_parity(mode, mesh):
    """nn.EmbeddingBag's offsets index the whole batch; decompose makes equal bags a lookup and
    a sum over each row, which split with the micro-batches."""
    _check("tests/models/embedding_bag.py", "--set", f"mode={mode}", "--mesh", mesh)


def test_embedding_bag_max_on_a_pipeline_is_refused_naming_the_op():
    from sbpc.errors import CompileError

    with pytest.raises(CompileError) as err:
        compile_model(load_model("tests/models/embedding_bag.py", {"mode": "max"}), parse_mesh("1x1x2"), batch_size=4,
                      optimizer=OptimizerConfig(), pipeline=PipelineOptions(microbatches=2))
    assert err.value.message.startswith("aten._embedding_bag.default has no SBP rule"), err.value.message
    assert "tests/models/embedding_bag.py:15" in str(err.value.location), err.value.location


@pytest.mark.parametrize("mesh", ["1x1x2", "2x2x2"])
def test_row_pick_by_arange_pipeline_parity(mesh):
    """x[arange(B), j] picks a value per row (a pooled token, a label's log-probability):
    decompose makes it a gather along dim 1 and its backward a scatter_add, which split with
    the micro-batches (as an index the rows needed the whole batch)."""
    _check("tests/models/row_pick.py", "--mesh", mesh)


@pytest.mark.parametrize("mesh", ["2x2", "2x2x2"])
def test_torch_transformer_with_a_causal_mask_made_in_forward(mesh):
    """nn.Transformer reads the value of the mask it is given (is it causal?); the mask is made
    in forward from constants, so the trace evaluates the read instead of refusing it."""
    _check("tests/models/torch_transformer.py", "--mesh", mesh, "--set", "layers=2")


@pytest.mark.parametrize("mesh", ["1x1x2", "2x2x2"])
def test_scan_written_into_slices_pipeline_parity(mesh):
    """out[:, t] = state in a loop: autograd's backward makes each gradient buffer with
    new_empty_strided, which normalize makes a plain factory that splits with the micro-batches."""
    _check("tests/models/scan_writes.py", "--mesh", mesh)


@pytest.mark.parametrize("mesh", ["1x1x2", "2x2x2"])
def test_loss_offset_by_a_constant_and_bce_with_logits_pipeline_parity(mesh):
    """``offset + cross_entropy + bce_with_logits``: the constant makes the loss whole on the
    micro-batch axis, a once-a-step value; the backward's seed ``ones_like(loss)`` reads only its
    shape and becomes a constant (else the runtime looked for a loss no micro-batch made), and
    BCE-with-logits splits with the micro-batches by its own rule (else the pipeline refused it)."""
    _check("tests/models/loss_plus_const.py", "--mesh", mesh)


@pytest.mark.parametrize("mesh", ["2x1x2", "1x1x4", "2x2"])
def test_losses_without_a_batch_split_before_parity(mesh):
    """Smooth L1, Huber, soft margin, binary cross-entropy, multi-class and multi-label margin
    and log-sigmoid split with the batch and the micro-batches by the ``pointwise_loss`` and
    ``row_loss`` rules (without them a pipeline refused the model and dp gathered the batch)."""
    _check("tests/models/many_losses.py", "--mesh", mesh)


@pytest.mark.parametrize("mesh", ["2x1x2", "1x1x4", "2x2"])
def test_vision_ops_without_a_batch_split_before_parity(mesh):
    """PReLU, unfold/fold, affine_grid + grid_sample, cdist and Tensor.unfold split with the batch and the
    micro-batches by their rules (without them a pipeline refused the model)."""
    _check("tests/models/vision_ops.py", "--mesh", mesh)


def test_a_batch_statistic_fed_back_into_each_sample_is_refused_by_name():
    """It was an internal-sounding "runs once a step ... report this plan"; now the user's line
    and a hint that is true: one micro-batch runs it on the same mesh. With no --microbatches
    the pipeline runs one micro-batch a step by itself, and says why."""
    from conftest import sbpc

    r = sbpc("check", "tests/models/batch_statistic.py", "--mesh", "1x1x2", "--ranks", "threads")
    assert r.returncode == 0, r.stdout + r.stderr
    assert ("sbpc: note: a sum over the whole batch is needed by every micro-batch's backward" in r.stderr
            and "running 1 micro-batch a step instead of the default 2" in r.stderr), r.stderr
    r = sbpc("check", "tests/models/batch_statistic.py", "--mesh", "1x1x2", "--microbatches", "2", "--ranks", "threads")
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    line = r.stderr.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in line, line
    assert "a sum over the whole batch is needed by every micro-batch's backward" in line, line
    assert "(at tests/models/batch_statistic.py:20)" in line and "--microbatches 1" in line, line
    _check("tests/models/batch_statistic.py", "--mesh", "1x1x2", "--microbatches", "1")


@pytest.mark.parametrize("mesh,extra", [("2x1x2", []), ("1x1x4", []), ("2x2", []),
                                        ("2x2", ["--config", "tests/models/weight_norms.toml"])])
def test_weight_and_spectral_norm_parity(mesh, extra):
    """Weight normalization (parametrized and hook-based, over dim 0, the last dim and the whole
    tensor) and spectral normalization, whose power iteration writes its u and v buffers with
    ``out=`` (capture refused ``aten.div.out``; a pipeline stage did not hold the u it only
    writes; a pipeline's AdamW stepped the whole tensor's 0-d magnitude in float64)."""
    _check("tests/models/weight_norms.py", "--mesh", mesh, *extra)


def test_weight_norm_splits_with_its_weight_on_tp():
    """Output channels split on tp (weight_norm's dim 0): ``_weight_norm_interface`` and its
    backward run on each rank's channels, without gathering the weight."""
    plan = compile_model(load_model("tests/models/weight_norms.py", {}), parse_mesh("1x2"), batch_size=4,
                         optimizer=OptimizerConfig(), config=load_config("tests/models/weight_norms.toml")).plan
    norms = [i for prog in plan.stages for i in prog.instructions if i.op.startswith("aten._weight_norm_interface")
             and i.loc.module.startswith("pre")]
    assert len(norms) == 2 and all(t.sbp == ["B", "S(0)"] for i in norms for t in i.types), norms


@pytest.mark.parametrize("mesh", ["2x1x2", "1x1x4", "2x2"])
def test_layer_ops_without_a_batch_split_before_parity(mesh):
    """torch.polar on activations (a complex scalar in its backward), F.rrelu without training,
    nn.Bilinear, diag_embed, pixel (un)shuffle and channel shuffle split with the batch and the
    micro-batches (capture refused the first two; a pipeline refused the others)."""
    _check("tests/models/layer_ops.py", "--mesh", mesh)


def test_layer_ops_split_with_the_batch_on_dp_without_a_gather():
    """On dp every op of ``layer_ops`` runs on its rank's rows: the forward moves no activation
    (only cross-entropy's 0-d count of targets, as every dp plan of it)."""
    plan = compile_model(load_model("tests/models/layer_ops.py", {}), parse_mesh("2x1"), batch_size=8,
                         optimizer=OptimizerConfig()).plan
    moved = [c for c in collectives(plan) if c.moves_data and c.nbytes > 4]
    assert not [c for c in moved if c.role == "fwd"], moved
    assert {c.kind for c in moved} == {"all_reduce"}, moved


def test_losses_split_with_the_batch_on_dp_without_a_gather():
    """On dp the losses run on each rank's rows: the forward moves no data (it gathered the
    batch before their rules), the backward all-reduces the gradients and nothing else."""
    source = load_model("tests/models/many_losses.py", {})
    plan = compile_model(source, parse_mesh("2x1"), batch_size=8, optimizer=OptimizerConfig()).plan
    moved = [c for c in collectives(plan) if c.moves_data]
    assert not [c for c in moved if c.role == "fwd"], moved
    assert {c.kind for c in moved} == {"all_reduce"}, moved
    params = sum(1 for _ in source.build().parameters())
    assert len([c for c in moved if c.nbytes > 4]) == params, moved  # one per gradient, then the loss


@pytest.mark.parametrize("mesh", ["2x2x2", "1x4"])
def test_complex_rotary_embeddings_parity(mesh):
    """Meta's Llama rotary embeddings (view_as_complex, polar, view_as_real, _conj) split with
    the batch and the heads (without rules they ran replicated and a pipeline refused them)."""
    _check("tests/models/complex_rotary.py", "--mesh", mesh)


@pytest.mark.parametrize("mesh", ["2x1", "2x2"])
def test_as_strided_over_a_transposed_view_parity(mesh):
    """Longformer's overlapping chunks read a transposed view through its storage's strides;
    capture restrides them onto a contiguous copy, so a gathered or sharded input (contiguous)
    reads the same elements (before, 2x1 computed other windows: a deviation of 1.3). A pipeline
    refuses it, naming the op: ``as_strided`` has no SBP rule, so it needs the whole batch."""
    _check("tests/models/strided_chunks.py", "--mesh", mesh)


SEG = "tests/models/seg_ce.py"


@pytest.mark.parametrize("mesh,extra", [
    ("2x1", []), ("1x1x2", []), ("2x1x2", []),  # mean, some targets ignore_index, unevenly per sample
    ("2x1x2", ["--set", "reduction=sum"]),
    ("2x1x2", ["--set", "reduction=none"]),  # the per-pixel loss weighted by a map, then averaged
    ("2x1", ["--set", "weighted=True"]),
    ("2x1x2", ["--set", "weighted=True", "--set", "reduction=none"]),
    ("2x1x2", ["--set", "dims=1"]),  # [N, C, L]: torch views it as [N, C, 1, L]
    ("2x1x2", ["--set", "dims=3", "--set", "weighted=True"]),  # [N, C, D, H, W]
    # a class-parallel head on tp; the cost model cuts the pixel rows there (not the classes)
    ("1x2", ["--config", "tests/models/seg_ce.toml", "--set", "width=128", "--set", "classes=2048"]),
])
def test_per_pixel_cross_entropy_parity(mesh, extra):
    """``cross_entropy(logits[N, C, *S], target[N, *S])`` (``nll_loss2d``): decompose makes it
    the 1-D NLL of one row per pixel, which splits with the batch (without it dp gathered the
    log-probabilities and a pipeline refused ``nll_loss2d_forward``)."""
    _check(SEG, "--mesh", mesh, *extra)


def test_per_pixel_cross_entropy_moves_no_logits_on_dp():
    """On dp the forward and backward move only the kept-target mask for the mean's count (one
    byte a pixel), never the log-probabilities or the targets (before: both gathered)."""
    plan = compile_model(load_model(SEG, {}), parse_mesh("2x1"), batch_size=4, optimizer=OptimizerConfig()).plan
    pixels = 4 * 6 * 6
    moved = [c for c in collectives(plan) if c.role in ("fwd", "bwd") and c.moves_data]
    assert all(c.nbytes <= pixels for c in moved), moved


@pytest.mark.parametrize("batch,cluster", [(16384, None), (8, "dgx-h100")])
def test_per_pixel_mean_count_is_a_partial_sum_when_the_cost_model_says(batch, cluster):
    """The mean's count of kept pixels, ``sum(target != ignore)``, is a partial sum of a split
    mask: the rules let each rank count its pixels and all-reduce the 0-d count. Which of that
    and gathering the mask (one byte a pixel) a plan does is the cost model's: a ring all-reduce
    costs two steps a device where a gather costs one, so small masks are gathered (seg_ce's
    default, 72 pixels a rank). Counted here where the all-reduce is cheaper: a mask of 295 KB a
    rank on the default model, and dp=8 on a DGX H100, whose all-reduce of 4 bytes is a tree
    (3 steps each way, where gathering takes 7). Forward and backward move the count alone (the
    loss rides in the first gradient bucket)."""
    from sbpc.compiler.pass_manager import CompileContext
    from sbpc.compiler.sbp.cost_model import ClusterCost
    from sbpc.compiler.tools.cluster import load_cluster

    m = parse_mesh("2x1" if cluster is None else "8x1")
    ctx = CompileContext(cost_model=ClusterCost(load_cluster(cluster), m.device_axes) if cluster else None)
    plan = compile_model(load_model(SEG, {}), m, batch_size=batch, optimizer=OptimizerConfig(), ctx=ctx).plan
    moved = [(c.kind, c.nbytes) for c in collectives(plan) if c.role in ("fwd", "bwd") and c.moves_data]
    assert moved == [("all_reduce", 4)], moved
