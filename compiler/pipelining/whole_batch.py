"""Why a step cannot be split into micro-batches, named at the user's op.

The schedule pass finds an all-gather over the micro-batch axis (``mb``): some op needs the
whole batch at once. The solver may have gathered anywhere upstream of that op, so the error
follows the gathered values down to the op that makes the gather needed, and names it and
its line. A default micro-batch count then runs as one micro-batch (the driver catches
``WholeBatchOverMicrobatches``); a count the user asked for is refused with the hint.
"""
from __future__ import annotations

from collections.abc import Callable

from sbpc.compiler.ir.mesh import MICROBATCH
from sbpc.compiler.ir.types import Graph, Node
from sbpc.errors import CompileError
from sbpc.runtime.kinds import Collective
from sbpc.runtime.sbp import Broadcast, NdSbp, Split


class WholeBatchOverMicrobatches(CompileError):
    """An op must see the whole batch at once (a contrastive loss, a mixture of experts sorting the
    batch's tokens), so the step cannot be split into micro-batches. The driver then runs a
    default micro-batch count as one micro-batch; a count the user asked for is refused."""


def whole_batch_error(graph: Graph, nodes: list[Node], at: int, per_mb: Callable[[str], bool], sbp: dict[str, NdSbp],
                      mb: int) -> WholeBatchOverMicrobatches:
    """The error for a collective over micro-batches, naming the op that makes it needed: the
    solver may gather anywhere upstream of an op that must see the whole batch, so the first
    op among the whole-batch values downstream that has no SBP rule, or that reads them with
    a micro-batch's values (CLIP's similarity of every text with every image), is the
    culprit. ``per_mb``: whether a value differs per micro-batch; ``sbp[v][mb]``: its layout
    on the micro-batch axis."""
    from sbpc.compiler.sbp.rules import RuleBook

    n = nodes[at]
    rules, seen, culprit, pairs = RuleBook.load(), set(n.outputs), None, None
    for j in range(at + 1, len(nodes)):
        m = nodes[j]
        if not any(u in seen for u in m.uses()):
            continue
        if m.op.startswith("aten.") and not rules.has_rule(m.op):
            culprit = m
            break
        if any(u not in seen and per_mb(u) for u in m.uses()):
            pairs = m
            break
        seen.update(o for o in m.outputs if not per_mb(o))
    what = f"{n.args[0]} would be gathered over micro-batches ({n.op})"
    reader = _batch_reader(graph, nodes, at, rules, per_mb, sbp, mb) if culprit is None and pairs is None else None
    if reader is not None:
        at_op, message = reader, f"{reader.op} reads the whole batch at once, so {what}"
        hint = ("its rule keeps no split of the batch for it (it relates rows of the batch to each other: a "
                "top-k, sort or flip over the batch, one sample against the others), so a pipeline cannot split "
                "it into micro-batches; use --microbatches 1 (dp still splits the batch)")
    elif pairs is not None:
        at_op, message = pairs, f"{pairs.op} reads the whole batch with one micro-batch's rows, so {what}"
        hint = ("this op relates rows of the batch to each other (a contrastive loss; a mixture of experts "
                "sorting the batch's tokens by expert), so a pipeline cannot split it into micro-batches; use "
                "--microbatches 1 (dp still splits the batch)")
    elif culprit is None:
        at_op, message = n, f"{what}: an op reads the whole batch at once"
        hint = ("every op downstream has a rule, but none offers a signature that keeps the batch split for "
                "these shapes (docs/sbp_rules.md); use --microbatches 1")
    else:
        at_op, message = culprit, f"{culprit.op} has no SBP rule, so it runs on the whole batch and {what}"
        hint = (f"a pipeline needs every op that reads the batch to split it; use --microbatches 1 or add a rule "
                f"for {culprit.op} (docs/sbp_rules.md)")
    return WholeBatchOverMicrobatches(message, location=str(at_op.loc) if at_op.loc else None, hint=hint)

def _batch_reader(graph: Graph, nodes: list[Node], at: int, rules, per_mb: Callable[[str], bool],
                  sbp: dict[str, NdSbp], mb: int) -> Node | None:
    """The first op downstream of the gather ``nodes[at]`` none of whose signatures on the
    micro-batch axis keeps the gathered batch dims split: the batch followed op by op (from
    every gather over micro-batches: the labels are gathered too) through the signatures
    that keep it (a linear layer's, a per-sample loss's), up to the op that needs all of it
    (``topk`` over per-sample losses). None where the batch dim is lost on the way (a sum
    over it) before such an op."""
    dims: dict[str, int] = {}  # a whole-batch value -> its batch dim
    downstream = {nodes[at].outputs[0]}
    types = {i.value: i.type for i in graph.inputs} | {o: t for m in nodes for o, t in zip(m.outputs, m.types)}
    for m in nodes:
        uses = m.uses()
        if m.op == Collective.ALL_GATHER.op and m.kwargs.get("axis") == MICROBATCH:
            dims[m.outputs[0]] = m.kwargs["dim"]
            continue
        if not any(u in dims for u in uses):
            continue
        below = any(u in downstream for u in uses)
        if below:
            downstream.update(m.outputs)
        if not m.op.startswith("aten."):  # boxing on another axis (a shard_slice over tp) keeps the dims
            dims.update((o, next(dims[u] for u in uses if u in dims)) for o in m.outputs)
            continue
        want = tuple(Split(dims[u]) if u in dims else sbp[u][mb] if per_mb(u) else Broadcast()
                     for u in uses)
        keeps = [s for s in rules.signatures(m, [types[u] for u in uses], graph.mesh.microbatches) if s.ins == want]
        if not keeps and below:
            return m
        if keeps:
            dims.update((o, s.dim) for o, s in zip(m.outputs, keeps[0].outs) if isinstance(s, Split))
    return None


def gradient_of_a_batch_value_error(n: Node) -> WholeBatchOverMicrobatches:
    """A micro-batch's op that must wait for a sum over every micro-batch made after the forward:
    the gradient of a statistic of the whole batch (a mean over the batch dim added back into
    each sample), which every micro-batch's backward needs before it can go on. Named at the op:
    a backward op carries its forward op's line, the statistic's."""
    return WholeBatchOverMicrobatches(f"a sum over the whole batch is needed by every micro-batch's backward ({n.op}), "
                                      "so no micro-batch can finish before all have: a pipeline cannot split this step",
                                      location=str(n.loc) if n.loc else None,
                                      hint="a statistic over the batch dim (a mean or max over samples) whose gradient "
                                           "flows back into each sample: compute it per sample, or run with "
                                           "--microbatches 1")
