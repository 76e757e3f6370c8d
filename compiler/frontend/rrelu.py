"""Randomized leaky ReLU without training is a leaky ReLU: ``rrelu_with_noise`` as ``leaky_relu``.

``F.rrelu`` (``nn.RReLU``) calls ``rrelu_with_noise(x, noise, lower, upper, training)`` on a
scratch ``noise = empty_like(x)``, which it declares written (``Tensor(b!)``) though without
training torch's kernel never touches it: it returns ``leaky_relu(x, (lower + upper) / 2)``,
and its backward ``leaky_relu_backward`` with that slope (``Activation.cpp``). A plan cannot
hold the declared write, so both become those ops (the same kernels, and pointwise rules that
split anywhere); the scratch tensor, read by nothing then, is dead code. In training the
kernel draws each slope into the noise tensor, which a plan cannot express: refused with the
user's line.
"""
from __future__ import annotations

from dataclasses import replace

from sbpc.compiler.ir.types import Node
from sbpc.compiler.sbp.rules.book import bind, op_params
from sbpc.errors import ModelError

RRELU = "aten.rrelu_with_noise.default"
RRELU_BACKWARD = "aten.rrelu_with_noise_backward.default"


def rrelu_as_leaky_relu(nodes: list[Node]) -> list[Node]:
    return [_rewrite(n) if n.op in (RRELU, RRELU_BACKWARD) else n for n in nodes]


def _rewrite(n: Node) -> Node:
    a, _ = bind(n, op_params(n.op))
    if a["training"]:
        raise ModelError(f"F.rrelu in training draws each negative slope into a noise tensor in place ({n.op}), "
                         "which a plan cannot express", location=str(n.loc) if n.loc else None,
                         hint="the model is traced in training mode; call F.rrelu(x, lower, upper, training=False) "
                              "(a leaky ReLU of slope (lower + upper) / 2) or use nn.LeakyReLU")
    slope = (float(a["lower"]) + float(a["upper"])) / 2  # in double, as the kernel computes it
    if n.op == RRELU:
        return replace(n, op="aten.leaky_relu.default", args=(a["self"], slope), kwargs={})
    return replace(n, op="aten.leaky_relu_backward.default", args=(a["grad_output"], a["self"], slope, a["self_is_result"]),
                   kwargs={})
