"""The instances that prove the rules of ops the example graphs do not use
(tests/test_sbp_rules.py): synthetic calls on given values, and ATen calls recorded by tracing
torch functions (their backwards by autograd): convolution, pooling, resampling, padding, the
losses, grid sampling, cdist, unfold and the rest. A rule added to ir_specs/aten.sbp that the
examples never call gets its case here."""
from __future__ import annotations

import torch

from sbpc.compiler.ir.types import DTYPE_BY_TORCH_NAME, DType, Node, Ref, Role, TensorType
from sbpc.compiler.sbp.rules.sweep import trace
from sbpc.compiler.sbp.rules.validate import Instance, run_node


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


def synthetic() -> list[Instance]:
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
        # histc: values outside [min, max] dropped; expert ids (a mixture of experts' group
        # sizes); min == max takes the range from the data, so nothing splits
        synth("aten.histc.default", x(8, 12), 5, -1.0, 1.0), synth("aten.histc.default", ids(4, 16).float(), 4, 0, 3),
        synth("aten.histc.default", x(8, 12), 5, 0, 0),
        # a library's input check: the loss passes through, the elements checked are read anywhere
        synth("sbpc.check_input.default", torch.tensor(1.5), x(8, 12) < -100, "var has negative entry/entries"),
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


def traced() -> list[Instance]:
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
