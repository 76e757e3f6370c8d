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
from sbpc.compiler.ir.types import DTYPE_BY_TORCH_NAME, DType, InputKind, Node, Ref, Role, TensorType
from sbpc.compiler.sbp.rules.sweep import trace
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


def _ttype(t: torch.Tensor) -> TensorType:
    return TensorType(tuple(t.shape), DTYPE_BY_TORCH_NAME[str(t.dtype).removeprefix("torch.")])


def synth(op: str, *args, **kwargs) -> Instance:
    """An instance of ``op`` on the given values (tensors in args become the node's inputs)."""
    values: dict[str, torch.Tensor] = {}

    def ref(a):
        if isinstance(a, torch.Tensor):
            name = f"x{len(values)}"
            values[name] = a
            return Ref(name)
        if isinstance(a, (list, tuple)):
            return type(a)(ref(x) for x in a)
        return a

    node = Node([], op, ref(args), {k: ref(v) for k, v in kwargs.items()}, [], Role.FORWARD)
    env = dict(values)
    node.outputs = [f"out{i}" for i in range(8)]
    run_node(node, env)
    outs = [env[o] for o in node.outputs if o in env]
    node.outputs = node.outputs[:len(outs)]
    node.types = [_ttype(t) if t is not None and t.numel() >= 0 else TensorType((), "none") for t in outs]
    uses = list(node.uses())
    return Instance(node, [_ttype(values[u]) for u in uses], [values[u] for u in uses], outs, "synthetic")


def _synthetic() -> list[Instance]:
    g = torch.Generator().manual_seed(0)
    x = lambda *s: torch.randn(*s, generator=g)
    pos = lambda *s: torch.rand(*s, generator=g) + 0.5
    ids = lambda hi, *s: torch.randint(0, hi, s, generator=g)
    logp = x(8, 12).log_softmax(-1)
    tgt = ids(12, 8)
    tgt[3] = -100
    cw = pos(12)
    q, k, v = x(4, 4, 8, 8), x(4, 4, 8, 8), x(4, 4, 8, 8)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v, 0.0, False)
    emb_ids = ids(16, 4, 8)
    emb_ids[0, 0] = 3
    return [
        synth("aten.amax.default", x(8, 12), [1], True), synth("aten.amax.default", x(8, 12), [0]),
        synth("aten.amax.default", x(8, 12)),
        synth("aten.exp.default", x(8, 12)), synth("aten.log.default", pos(8, 12)),
        synth("aten.sum.default", x(8, 12)),
        synth("aten.mean.dim", x(8, 12), [1]), synth("aten.mean.dim", x(8, 12), [0, 1], True),
        synth("aten._safe_softmax.default", x(4, 8, 8), -1),
        synth("aten.div.Scalar", x(8, 12), 3.0), synth("aten.rsub.Scalar", x(8, 12), 1.0),
        synth("aten.reciprocal.default", pos(8, 12)), synth("aten.pow.Scalar", 2.0, x(8, 12)),
        synth("aten.tril.default", x(4, 8, 8)),
        synth("aten.bernoulli.p", pos(8, 8), 0.5), synth("aten.rand.default", [8, 4], dtype=DType("f32")),
        synth("aten.randn.default", [8, 4], dtype=DType("f32")), synth("aten.randint.default", 9, [8, 4]),
        synth("aten.randint.low", 2, 9, [8, 4]), synth("aten.normal.float_float", 1.0, 2.0, [8, 4]),
        synth("aten.chunk.default", x(4, 12), 3, 1),
        synth("aten.split_with_sizes.default", x(8, 12), [4, 8], 1),
        synth("aten.split_with_sizes.default", x(8, 12), [6, 6], 1),
        synth("aten.empty_like.default", x(8, 12)), synth("aten.zeros_like.default", x(8, 12)),
        synth("aten.zeros.default", [8, 4], dtype=DType("f32")), synth("aten.ones.default", [8, 4], dtype=DType("f32")),
        synth("aten.full.default", [8, 4], 2.5, dtype=DType("f32")), synth("aten.new_ones.default", x(2, 2), [8, 4]),
        synth("aten.arange.default", 8), synth("aten.scalar_tensor.default", 2.0, dtype=DType("f32")),
        synth("aten.gather.default", x(8, 12), 1, ids(12, 8, 5)), synth("aten.gather.default", x(8, 12), 0, ids(8, 4, 12)),
        synth("aten.gather.default", x(8, 12), 1, ids(12, 4, 4)),
        synth("aten.permute.default", x(4, 8, 12), [2, 0, 1]), synth("aten.select.int", x(4, 8, 12), 1, 3),
        synth("aten.squeeze.dim", x(4, 1, 8), 1), synth("aten.reshape.default", x(4, 8, 12), [32, 12]),
        synth("sbpc.constant", [1.0, 2.0, 3.0, 4.0], [2, 2], DType("f32")),
        synth("aten.nll_loss_forward.default", logp, tgt, cw, 2, -100),
        synth("aten.nll_loss_forward.default", logp, tgt, None, 0, -100),
        synth("aten.nll_loss_forward.default", logp, tgt, cw, 1, -100),
        synth("aten.nll_loss_backward.default", x(8), logp, tgt, cw, 0, -100, torch.tensor(0.0)),
        synth("aten.nll_loss_backward.default", torch.tensor(1.5), logp, tgt, cw, 1, -100, cw[tgt.clamp(0)].sum()),
        synth("aten.mse_loss.default", x(8, 12), x(8, 12), 2), synth("aten.mse_loss.default", x(8, 12), x(8, 12), 0),
        synth("aten.mse_loss_backward.default", x(8, 12), x(8, 12), x(8, 12), 0),
        synth("aten.binary_cross_entropy_with_logits.default", x(8, 12), pos(8, 12) - 0.5, pos(12), pos(12), 1),
        synth("aten.binary_cross_entropy_with_logits.default", x(8, 12), pos(8, 12) - 0.5, None, None, 2),
        synth("aten.binary_cross_entropy_with_logits.default", x(8, 12), pos(8, 12) - 0.5, pos(8, 1), None, 0),
        synth("aten.view_as_complex.default", x(4, 6, 2)), synth("aten.view_as_real.default", torch.complex(x(4, 6), x(4, 6))),
        synth("aten._conj.default", torch.complex(x(4, 6), x(4, 6))), synth("aten.polar.default", pos(4, 6), x(4, 6)),
        synth("aten.embedding.default", x(16, 8), ids(16, 8)),
        synth("aten.embedding_dense_backward.default", x(4, 8, 8), emb_ids, 16, 3, True),
        synth("aten.embedding_dense_backward.default", x(4, 8, 8), emb_ids, 16, 3, False),
        synth("aten.addbmm.default", x(6, 8), x(4, 6, 4), x(4, 4, 8)), synth("aten.addmv.default", x(8), x(8, 6), x(6)),
        synth("aten.addr.default", x(8, 6), x(8), x(6)), synth("aten.baddbmm.default", x(4, 6, 8), x(4, 6, 4), x(4, 4, 8)),
        synth("aten.dot.default", x(12), x(12)), synth("aten.mv.default", x(8, 6), x(6)),
        synth("aten.arange.start", 2, 14), synth("aten.arange.start_step", 1.0, 13.0, 0.5, dtype=DType("f32")),
        synth("aten.empty.memory_format", [8, 4], dtype=DType("f32")), synth("aten.flatten.using_ints", x(4, 6, 8), 1, 2),
        synth("aten.flip.default", x(4, 6, 8), [1]), synth("aten.full_like.default", x(8, 6), 2.0),
        synth("aten.index_add.default", x(8, 6), 0, ids(8, 12), x(12, 6)),
        synth("aten.index_put.default", x(8, 6), [ids(8, 4)], x(4, 6), True),
        # accumulating a batch's rows (Whisper's positions ``weight[position_ids]``, backward):
        # the positions split with the values, a partial sum; two index tensors broadcast
        synth("aten.index_put.default", x(16, 6), [ids(16, 4, 8)], x(4, 8, 6), True),
        synth("aten.index_put.default", x(8, 6, 5), [ids(8, 4, 1), ids(6, 4, 8)], x(4, 8, 5), True),
        synth("aten.index_put.default", x(8, 6), [ids(8, 4)], x(6), False),
        synth("aten.index_select.default", x(8, 6), 0, ids(8, 12)), synth("aten.narrow.default", x(8, 12), 1, 2, 6),
        synth("aten.new_empty.default", x(2, 2), [8, 4]), synth("aten.new_full.default", x(2, 2), [8, 4], 3.0),
        synth("aten.new_zeros.default", x(2, 2), [8, 4]), synth("aten.repeat.default", x(4, 1, 6), [2, 4, 1]),
        synth("aten.repeat.default", x(4, 6), [3, 2]), synth("aten.roll.default", x(4, 6, 8), [1], [2]),
        synth("aten.roll.default", x(4, 6), [3], []), synth("aten.scatter.src", x(8, 6), 1, ids(6, 8, 4), x(8, 4)),
        synth("aten.scatter.value", x(8, 6), 1, ids(6, 8, 4), 2.0),
        synth("aten.scatter_add.default", x(8, 6), 0, ids(8, 4, 6), x(4, 6)),
        synth("aten.select_backward.default", x(4, 8), [4, 6, 8], 1, 2),
        synth("aten.slice_backward.default", x(4, 3, 8), [4, 6, 8], 1, 2, 5, 1),
        synth("aten.squeeze.default", x(4, 1, 8)), synth("aten.squeeze.dims", x(4, 1, 8, 1), [1, 3]),
        synth("aten.stack.default", [x(4, 6), x(4, 6)], 1), synth("aten.triu.default", x(4, 8, 8)),
        synth("aten.unbind.int", x(4, 3, 6), 1), synth("aten.unflatten.int", x(4, 24), 1, [4, 6]),
        # dims: negative, on 0-d tensors (dim 0 names no dim), and cat's legacy 1-D empty inputs
        synth("aten.cat.default", [x(4, 6), torch.empty(0), x(4, 6)], -1),
        synth("aten.cumsum.default", torch.tensor(2.0), -1), synth("aten.amax.default", torch.tensor(2.0), [0]),
        synth("aten.gather.default", torch.tensor(2.0), 0, torch.tensor(0)),
        synth("aten.view_copy.default", x(4, 6, 8), [24, 8]), synth("aten.permute_copy.default", x(4, 6, 8), [2, 0, 1]),
        synth("aten.transpose_copy.int", x(4, 6, 8), 0, 2), synth("aten.t_copy.default", x(4, 6)),
        synth("aten.unsqueeze_copy.default", x(4, 6), 1), synth("aten.squeeze_copy.dim", x(4, 1, 6), 1),
        synth("aten.squeeze_copy.dims", x(4, 1, 6), [1]), synth("aten.squeeze_copy.default", x(4, 1, 6)),
        synth("aten.expand_copy.default", x(4, 1, 6), [4, 8, 6]), synth("aten.narrow_copy.default", x(8, 12), 1, 2, 6),
        synth("aten.unbind_copy.int", x(4, 3, 6), 1), synth("aten.split_with_sizes_copy.default", x(8, 12), [4, 8], 1),
        synth("aten.unsafe_split.Tensor", x(8, 12), 4, 1), synth("aten.diagonal.default", x(4, 6, 6), 0, 1, 2),
        synth("aten.diagonal_copy.default", x(6, 6, 4), 1, 0, 1),
        synth("aten.scatter_reduce.two", x(8, 6), 1, ids(6, 8, 4), x(8, 4), "amax"),
        synth("aten.index_copy.default", x(8, 6), 0, torch.randperm(8, generator=g)[:4], x(4, 6)),
        synth("aten.index_fill.int_Scalar", x(8, 6), 1, ids(6, 3), 2.0),
        synth("aten.index_fill.int_Tensor", x(8, 6), 1, ids(6, 3), torch.tensor(2.0)),
        synth("aten.select_scatter.default", x(4, 6, 8), x(4, 8), 1, 2),
        synth("aten.slice_scatter.default", x(4, 6, 8), x(4, 2, 8), 1, 2, 4),
        synth("aten.glu.default", x(4, 12), -1), synth("aten.glu_backward.default", x(4, 6), x(4, 12), -1),
        synth("aten._fused_rms_norm.default", x(4, 6, 8), [8], pos(8), 1e-6),
        synth("aten.native_batch_norm.default", x(4, 6, 5), pos(6), x(6), x(6), pos(6), True, 0.1, 1e-5),
        synth("aten.native_batch_norm.default", x(4, 6, 5), pos(6), x(6), x(6), pos(6), False, 0.1, 1e-5),
        synth("aten._native_batch_norm_legit_functional.default", x(4, 6, 5), pos(6), x(6), x(6), pos(6), True, 0.1, 1e-5),
        synth("aten._native_batch_norm_legit_no_training.default", x(4, 6, 5), pos(6), x(6), x(6), pos(6), 0.1, 1e-5),
        synth("aten.native_batch_norm_backward.default", x(4, 6, 5), x(4, 6, 5), pos(6), x(6), pos(6), x(6), pos(6),
              True, 1e-5, [True, True, True]),
        synth("aten.native_batch_norm_backward.default", x(4, 6, 5), x(4, 6, 5), pos(6), x(6), pos(6), None, None,
              False, 1e-5, [True, True, True]),
        synth("aten.native_group_norm.default", x(4, 6, 5, 3), pos(6), x(6), 4, 6, 15, 3, 1e-5),
        synth("aten.native_group_norm_backward.default", x(4, 6, 5), x(4, 6, 5), x(4, 2), pos(4, 2), pos(6),
              4, 6, 5, 2, [True, True, True]),
        synth("sbpc.attention", q, k, v, 0.0, False),
        synth("sbpc.attention_backward", x(4, 4, 8, 8), q, k, v, out, lse, 0.0, False),
    ]


def _traced() -> list[Instance]:
    """Instances of the convolution, pooling, resampling and padding ops (and their backwards,
    by autograd), recorded as ATen calls on real values."""
    F = torch.nn.functional
    g = torch.Generator().manual_seed(1)
    x = lambda *s: torch.randn(*s, generator=g).requires_grad_()
    cases = [(F.conv2d, x(4, 6, 8, 8), x(4, 6, 3, 3), x(4)), (F.conv_transpose1d, x(4, 6, 8), x(6, 4, 3)),
             (lambda a: F.interpolate(a, scale_factor=2, mode="bilinear", antialias=True), x(4, 6, 4, 4)),
             (lambda a: F.interpolate(a, scale_factor=2, mode="bicubic", antialias=True), x(4, 6, 4, 4))]
    for d, size in ((1, (4, 6, 8)), (2, (4, 6, 8, 8)), (3, (4, 6, 4, 4, 4))):
        cases += [(lambda a, d=d: getattr(F, f"avg_pool{d}d")(a, 2), x(*size)),
                  (lambda a, d=d: getattr(F, f"max_pool{d}d")(a, 2), x(*size)),
                  (lambda a, d=d: getattr(F, f"adaptive_avg_pool{d}d")(a, 3), x(*size)),
                  (lambda a, d=d: getattr(F, f"adaptive_max_pool{d}d")(a, 3), x(*size)),
                  (lambda a: F.interpolate(a, scale_factor=2, mode="nearest"), x(*size)),
                  (lambda a: F.interpolate(a, scale_factor=2, mode="nearest-exact"), x(*size)),
                  (lambda a, d=d: F.interpolate(a, scale_factor=2, mode=("linear", "bicubic", "trilinear")[d - 1]), x(*size)),
                  (lambda a, d=d: F.pad(a, (1, 2) * d, mode="reflect"), x(*size)),
                  (lambda a, d=d: F.pad(a, (1, 2) * d, mode="replicate"), x(*size))]
    cases.append((lambda a: F.interpolate(a, scale_factor=2, mode="bilinear"), x(4, 6, 4, 4)))
    # the losses of the pointwise_loss and row_loss families, each reduction
    target, weight, probs = torch.randn(4, 6, generator=g), torch.rand(6, generator=g) + 0.5, torch.rand(4, 6, generator=g)
    labels = torch.randint(0, 6, (4,), generator=g)
    multilabel = torch.tensor([[3, 0, -1, 1, 2, 5], [1, -1, 0, 0, 0, 0], [5, 4, 3, 2, 1, 0], [-1, 0, 0, 0, 0, 0]])
    for r in ("mean", "sum", "none"):
        cases += [(lambda a, r=r: F.smooth_l1_loss(a, target, reduction=r, beta=0.5), x(4, 6)),
                  (lambda a, r=r: F.huber_loss(a, target, reduction=r, delta=0.5), x(4, 6)),
                  (lambda a, r=r: F.soft_margin_loss(a, target.sign(), reduction=r), x(4, 6)),
                  (lambda a, r=r: F.binary_cross_entropy(a.sigmoid(), probs, weight=weight, reduction=r), x(4, 6)),
                  (lambda a, r=r: F.multi_margin_loss(a, labels, p=2, margin=0.5, weight=weight, reduction=r), x(4, 6)),
                  (lambda a, r=r: F.multilabel_margin_loss(a, multilabel, reduction=r), x(4, 6))]
    cases.append((F.logsigmoid, x(4, 6)))
    # PReLU, grid sampling, cdist, unfold/fold, bucketize
    grid2, grid3 = torch.rand(4, 2, 6, 2, generator=g) * 2 - 1, torch.rand(4, 2, 2, 4, 3, generator=g) * 2 - 1
    cases += [(F.prelu, x(4, 6, 3, 3), x(6)), (F.prelu, x(4, 6), x(1)),
              (lambda a, b: F.grid_sample(a, b, align_corners=False), x(4, 6, 5, 5), grid2.requires_grad_()),
              (lambda a: F.grid_sample(a, grid2, mode="nearest", padding_mode="border", align_corners=False), x(4, 6, 5, 5)),
              (lambda a, b: F.grid_sample(a, b, align_corners=True), x(4, 6, 3, 3, 3), grid3.requires_grad_()),
              (torch.cdist, x(4, 6, 3), x(4, 2, 3)), (torch.cdist, x(6, 3), x(4, 3)),
              (torch.cdist, x(2, 4, 6, 3), x(4, 2, 3)),  # broadcast batch dims: only the rows split
              (lambda a: F.fold(F.unfold(a, 2, stride=2), (4, 4), 2, stride=2), x(4, 6, 4, 4)),
              (lambda a: torch.bucketize(a, torch.linspace(-1, 1, 5)), x(4, 6)),
              (lambda a: a.unfold(2, 3, 2), x(4, 6, 7)), (lambda a: a.unfold(0, 2, 2), x(8, 6)),
              (lambda t: F.affine_grid(t, [4, 6, 3, 5], align_corners=False), x(4, 2, 3)),
              (lambda t: F.affine_grid(t, [4, 6, 2, 3, 5], align_corners=True), x(4, 3, 4))]
    # nn.Bilinear (batch dims before the features too), diag_embed, pixel and channel shuffles
    cases += [(F.bilinear, x(4, 5), x(4, 6), x(8, 5, 6), x(8)), (F.bilinear, x(2, 4, 5), x(2, 4, 6), x(8, 5, 6)),
              (torch.diag_embed, x(4, 6)), (lambda a: torch.diag_embed(a, 1, 0, 2), x(4, 2, 6)),
              (lambda a: F.pixel_shuffle(a, 2), x(4, 8, 3, 3)), (lambda a: F.pixel_unshuffle(a, 2), x(4, 6, 4, 4)),
              (lambda a: F.channel_shuffle(a, 2), x(4, 6, 3, 3)),
              (lambda a: torch.ops.aten.native_channel_shuffle(a.detach(), 3), x(4, 6, 3, 3))]
    # weight normalization over dim 0 and the last dim; spectral normalization's vdot
    cases += [(lambda v, w: torch._weight_norm(v, w, 0), x(6, 4, 3), x(6, 1, 1)),
              (lambda v, w: torch._weight_norm(v, w, 2), x(6, 4, 4), x(1, 1, 4)), (torch.vdot, x(8), x(8))]
    return [i for j, (fn, *args) in enumerate(cases) for i in trace(fn, tuple(args), {}, f"traced {j}")]


@pytest.fixture(scope="module")
def report(book, graph_instances):
    return validate(book, graph_instances + _synthetic() + _traced(), sizes=SIZES)


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
