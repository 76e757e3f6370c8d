"""``sbpc.hint``: the graph op an activation hint becomes.

An identity op registered with torch.library, so make_fx records it with its hint as text
(``Hint.spec()``: ``"tp=S(1)"``) and the source line of the ``sbpc.shard`` call; ``hint_of``
reads the typed ``Hint`` back from the node. Its gradient is the identity,
pinned by the same hint. Propagation pins the SBP of its result; the boxing pass then removes it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sbpc.compiler.frontend.hints import Hint
    from sbpc.compiler.ir.types import Node

OP = "sbpc.hint.default"


@torch.library.custom_op("sbpc::hint", mutates_args=())
def _hint(x: torch.Tensor, spec: str, where: str) -> torch.Tensor:
    return x.clone()


@_hint.register_fake
def _(x, spec, where):
    return torch.empty_like(x)


def _setup(ctx, inputs, output):
    ctx.spec, ctx.where = inputs[1], inputs[2]


def _backward(ctx, grad):
    # the gradient of a pinned value is pinned the same way: a sequence-parallel residual
    # stream has a sequence-parallel gradient, as in Megatron-LM
    return _hint(grad, ctx.spec, ctx.where), None, None


_hint.register_autograd(_backward, setup_context=_setup)


def hint_op(x: torch.Tensor, hint: Hint) -> torch.Tensor:
    return _hint(x, hint.spec(), hint.source)


def hint_of(n: Node) -> Hint:
    """The hint an ``sbpc.hint`` node carries: its args are (value, spec, source)."""
    from sbpc.compiler.frontend.hints import Hint

    return Hint.parse(n.args[1], n.args[2])


def hint_inputs(inputs, hints) -> list:
    """``sbpc.hint`` nodes for hinted parameters; the hinted value replaces the input in every use.

    Returns the nodes to put first in the graph; the caller renames the input's uses to them.
    """
    from sbpc.compiler.ir.types import Node, Ref, Role, SourceLoc

    nodes = []
    for i in inputs:
        hint = hints.get(i.name)
        if hint is None:
            continue
        file, _, line = hint.source.rpartition(":")
        loc = SourceLoc(module="", file=file, line=int(line)) if line.isdigit() else None
        nodes.append(Node([f"{i.value}_hint"], OP, (Ref(i.value), hint.spec(), hint.source), {},
                          [i.type], Role.FORWARD, loc=loc))
    return nodes
