"""Stage policies: where the forward program is cut into pipeline chunks, and what a chunk costs.

The stage-partition pass fixes what hints and data flow dictate; a policy only chooses the
cuts. It sees the forward ops as *units*: runs of ops of one layer (the module path up to its
first numbered component, ``h.3`` or ``model.transformer.h.3``) or of one other module. A cut
therefore falls between transformer blocks or next to the embedding and the head, never
inside a block, unless there are more (virtual) chunks than units. (More pp stages than units
is an error, raised by the pass.)

``CostBalanced`` (the default) balances time first and memory second. A chunk's time is

    its compute (forward + backward + optimizer ops, each the larger of bytes touched over
    memory bandwidth and flops over peak; see ``RooflineCost``)
  + the transfers at its cuts (the activations crossing a cut forward, their gradients back);

its memory is the activations it saves for backward times the micro-batches it keeps in
flight (1F1B: chunk c of C keeps min(C - c, m)), plus its parameters, gradients and optimizer
state. It minimises the slowest chunk's time, then, within ``time_slack`` of that, the fullest
chunk's memory. (Memory is no weighted term of one cost: 1F1B's first stage keeps p micro-
batches in flight, and a sum priced that way gave the first stages one block each and the last
a fifth of the model.)
"""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from sbpc.compiler.ir.aten import returns_alias
from sbpc.compiler.sbp.cost_model import AlphaBeta, CostModel
from sbpc.compiler.ir.types import Graph, InputKind, Node, OutputKind, Ref, Role, TensorType
from sbpc.errors import CompileError

_NUMBERED = re.compile(r"\d+")


@dataclass(frozen=True)
class RooflineCost:
    """Seconds an op takes: its memory traffic priced by ``memory`` (any ``CostModel``) or its
    flops at ``flops_per_s``, whichever is larger; and seconds to move bytes between stages."""

    memory: CostModel = field(default_factory=AlphaBeta)
    flops_per_s: float = 100e12
    link_bytes_per_s: float = 10e9

    def op(self, node: Node, types: dict[str, TensorType]) -> float:
        return self.seconds(flops(node, types), touched_bytes(node, types))

    def seconds(self, flop_count: float, nbytes: int) -> float:
        """A kernel of ``flop_count`` flops touching ``nbytes``: the roofline's larger term."""
        return max(self.memory.compute(nbytes), flop_count / self.flops_per_s)

    def transfer(self, nbytes: int) -> float:
        return nbytes / self.link_bytes_per_s


def flops(node: Node, types: dict[str, TensorType]) -> int:
    """Multiply-adds x 2 of the matmul-like ops; 0 for the rest (they are memory-bound)."""
    shape = lambda i: types[node.args[i].name].shape if isinstance(node.args[i], Ref) else (1, 1)
    out = node.types[0].numel if node.types else 0
    op = node.op
    if op in ("aten.mm.default", "aten.bmm.default"):
        return 2 * out * shape(0)[-1]
    if op in ("aten.addmm.default", "aten.baddbmm.default"):
        return 2 * out * shape(1)[-1]
    if op == "sbpc.attention":  # q @ k^T and p @ v
        return 4 * types[node.args[0].name].numel * shape(1)[-2]
    if op == "sbpc.attention_backward":  # args: grad_out, q, k, v, ...; about twice the forward
        return 8 * types[node.args[1].name].numel * shape(2)[-2]
    return 0


def touched_bytes(node: Node, types: dict[str, TensorType]) -> int:
    if returns_alias(node.op):
        return 0  # a view moves no data
    reads = sum(types[u].nbytes for u in node.uses() if u in types)
    return reads + sum(t.nbytes for t in node.types)


def layer_key(module: str) -> str:
    """``model.h.3.attn.c_proj`` -> ``model.h.3``; a path without a number is its own key."""
    parts = module.split(".")
    for i, p in enumerate(parts):
        if _NUMBERED.fullmatch(p):
            return ".".join(parts[:i + 1])
    return module


def in_flight(chunk: int, num_chunks: int, microbatches: int) -> int:
    """Micro-batches whose activations chunk ``chunk`` holds at once under 1F1B (interleaved
    chunks are treated as a pipeline of num_chunks stages)."""
    return min(num_chunks - chunk, microbatches)


@dataclass
class PartitionProblem:
    """What a policy chooses from: units of forward ops, in program order."""

    graph: Graph
    num_chunks: int
    microbatches: int
    units: list[list[int]]  # indices into graph.nodes
    lo: list[int]  # per unit: the chunks hints and data flow allow; both non-decreasing
    hi: list[int]
    group: list[int | None]  # per node: the unit whose cost it counts in (None: bwd/opt, attributed)
    facts: GraphFacts | None = None  # the graph's structure, when the pass found it already


@dataclass(frozen=True)
class GraphFacts:
    """What partitioning reads of a graph's structure. The pass and its policy's ``profile``
    both need it, and each walk of a 1T graph's ~26k ops costs: found once, read by both."""
    producer: dict[str, int]
    preds: list[list[int]]  # dependences()
    readers: list[list[int]]
    types: dict[str, TensorType]
    owners: dict[int, set[str]]  # optimizer_owners(); read only

    @classmethod
    def of(cls, graph: Graph) -> GraphFacts:
        producer = graph.producers()
        preds, readers = dependences(graph, producer)
        return cls(producer, preds, readers, graph.value_types(), optimizer_owners(graph))


class StagePolicy(Protocol):
    def __call__(self, problem: PartitionProblem) -> list[int]:
        """One chunk per unit, non-decreasing, unit u in [problem.lo[u], problem.hi[u]]."""


def single_stage(problem: PartitionProblem) -> list[int]:
    if problem.num_chunks != 1:
        raise CompileError(f"the single_stage policy cannot fill {problem.num_chunks} pipeline chunks",
                           hint="use the default CostBalanced policy")
    return [0] * len(problem.units)


@dataclass(frozen=True)
class CostBalanced:
    """Throughput first, then memory: the slowest chunk sets the step time, so the cuts first
    minimise the most expensive chunk's time (compute + transfers at its cuts); then, among
    the partitions whose every chunk takes at most ``time_slack`` more than that, they
    minimise the fullest chunk's memory (the activations it keeps for its in-flight
    micro-batches plus its model state); ties go to the evenest times. On a uniform stack of
    blocks this is Megatron's layers / pp per stage, the embedding on the first and the head on
    the last; a larger ``time_slack`` lets memory push blocks off the early stages."""

    cost: RooflineCost = field(default_factory=RooflineCost)
    time_slack: float = 0.05  # how much slower than the fastest partition memory may make a chunk

    def __call__(self, problem: PartitionProblem) -> list[int]:
        n, chunks = len(problem.units), problem.num_chunks
        prof = profile(problem.graph, problem.group, n, self.cost, problem.facts)
        T, S, W = (np.concatenate([[0.0], np.cumsum(x, dtype=float)]) for x in (prof.compute, prof.saved, prof.static))
        t_tot = max(T[-1], 1e-30)
        comm = np.array([2 * self.cost.transfer(x) / t_tot for x in prof.crossing])  # activations on, gradients back
        # the profile's activations are the whole batch's: a micro-batch keeps 1/m of them
        B = np.concatenate([[0], np.cumsum([o[1] for o in prof.ops])])  # backward ops per unit, summed
        per_mb = 1 / max(problem.microbatches, 1)
        m_tot = max(S[-1] * per_mb + W[-1], 1.0)  # memory as a fraction of one micro-batch's model (below _EMPTY)

        def time(k, j, e):
            # a chunk without backward work (a lone view, cut between ops) only where nothing else fits
            return (T[e] - T[j]) / t_tot + comm[j] + comm[e] + np.where(B[e] - B[j] > 0, 0.0, _EMPTY / 2)

        def memory(k, j, e):
            return (in_flight(k, chunks, problem.microbatches) * per_mb * (S[e] - S[j]) + W[e] - W[j]) / m_tot

        fastest, _ = _min_max_cuts(problem, time, time)
        limit = fastest * (1 + self.time_slack)
        # a chunk over the time limit is infeasible; the fastest partition itself always fits
        bounded = lambda k, j, e: np.where(time(k, j, e) <= limit * (1 + 1e-9), memory(k, j, e), np.inf)
        _, out = _min_max_cuts(problem, bounded, time)
        return out


def _min_max_cuts(problem: PartitionProblem, cost, spread) -> tuple[float, list[int]]:
    """Exact: a dynamic program over (chunk, units covered) minimising the largest ``cost`` of
    a chunk, then the sum of squared ``spread`` (so the other chunks are even too). ``cost(k,
    j, e)`` and ``spread`` price chunk k holding units [j, e), elementwise over arrays of j and e.

    Each chunk's step prices every (e, j) at once, row e holding the chunks that end at e (j > e:
    none): the same float operations on the same values as one row at a time, without a
    numpy call per row (64 chunks x ~260 units at 1T)."""
    n, chunks = len(problem.units), problem.num_chunks
    lo, hi = np.array(problem.lo), np.array(problem.hi)
    e, j = np.arange(n + 1)[:, None], np.arange(n + 1)[None, :]
    after = j > e
    diagonal = np.eye(n + 1, dtype=bool)
    # the bounds are monotone: the first unit has the least hi, the last the most lo
    lo_last = np.concatenate([[-1], lo])[:, None]  # lo of unit e - 1 (row 0 holds no unit)
    hi_j = np.concatenate([hi, [chunks]])[None, :]
    # best[e]: the smallest max chunk cost covering units [0, e) with the chunks so far
    best, sq = np.full(n + 1, np.inf), np.full(n + 1, np.inf)
    best[0] = sq[0] = 0.0
    choice = np.zeros((chunks, n + 1), dtype=int)
    for k in range(chunks):
        c = np.array(np.broadcast_to(cost(k, j, e), (n + 1, n + 1)), dtype=float)
        s = np.array(np.broadcast_to(spread(k, j, e), (n + 1, n + 1)), dtype=float)
        c[(j < e) & ((hi_j < k) | (lo_last > k))] = np.inf
        c[diagonal] = s[diagonal] = _EMPTY  # an empty chunk, only where nothing else fits
        c[after] = np.inf
        worst = np.maximum(best[None, :], c)
        least = worst.min(axis=1)
        ties = worst <= (least * (1 + 1e-9))[:, None]
        pick = np.argmin(np.where(ties, sq[None, :] + s ** 2, np.inf), axis=1)
        rows = np.arange(n + 1)
        feasible = np.isfinite(least)
        best = np.where(feasible, worst[rows, pick], np.inf)
        sq = np.where(feasible, sq[pick] + s[rows, pick] ** 2, np.inf)
        choice[k] = np.where(feasible, pick, 0)
    if not np.isfinite(best[n]):
        raise CompileError("no partition satisfies the stage hints")  # unreachable: the bounds are monotone
    out, e = [0] * n, n
    for k in reversed(range(chunks)):
        j = choice[k, e]
        out[j:e] = [k] * (e - j)
        e = j
    return float(best[n]), out


_EMPTY = 1e6  # cost of a chunk without units: far above any real one (costs are fractions of the total)


@dataclass
class Profile:
    compute: list[float]  # s per group: its forward, backward and optimizer ops
    saved: list[int]  # bytes of its forward results that backward reads (one micro-batch)
    static: list[int]  # bytes of the parameters, gradients and optimizer state it owns
    crossing: list[int]  # [b]: bytes made by forward ops before group b and read at or after it
    ops: list[list[int]]  # forward, backward, optimizer op counts


def profile(graph: Graph, group: list[int | None], n: int, cost: RooflineCost,
            facts: GraphFacts | None = None) -> Profile:
    """Costs per group of a node -> group map. Backward ops without a group count where the
    pass places them (``place_backward``); optimizer ops with their parameter's first reader.
    ``facts``: the graph's structure, if the caller has it (else found here)."""
    facts = facts or GraphFacts.of(graph)
    nodes, types = graph.nodes, facts.types
    group = list(group)
    preds, readers = facts.preds, facts.readers
    # the pass's own rule, so each backward op is costed in the group it will run in
    place_backward(nodes, preds, readers, group, n - 1)
    first = first_readers(graph, group)
    for i, owned in facts.owners.items():
        if group[i] is None and owned:
            group[i] = min(first.get(p, 0) for p in owned)
    prof = Profile([0.0] * n, [0] * n, [0] * n, [0] * (n + 1), [[0, 0, 0] for _ in range(n)])
    kind = {Role.FORWARD: 0, Role.BACKWARD: 1, Role.OPTIMIZER: 2}
    made_in: dict[str, int] = {}
    last_read: dict[str, int] = {}
    read_by_bwd: set[str] = set()
    for i, nd in enumerate(nodes):
        g = group[i]
        for u in nd.uses():
            if nd.role == Role.BACKWARD:
                read_by_bwd.add(u)
            elif nd.role == Role.FORWARD and g is not None and u in made_in:
                last_read[u] = max(last_read.get(u, g), g)
        if g is None:
            continue
        prof.compute[g] += cost.op(nd, types)
        prof.ops[g][kind.get(nd.role, 2)] += 1
        if nd.role == Role.FORWARD:
            made_in.update((o, g) for o in nd.outputs)
    for v, g in made_in.items():
        if v in read_by_bwd:
            prof.saved[g] += types[v].nbytes
        if last_read.get(v, g) > g:  # crosses every cut between its maker and its last reader
            prof.crossing[g + 1] += types[v].nbytes
            if last_read[v] + 1 <= n:
                prof.crossing[last_read[v] + 1] -= types[v].nbytes
    for b in range(1, n + 1):
        prof.crossing[b] += prof.crossing[b - 1]
    prof.crossing[n] = 0
    states: dict[str | None, int] = defaultdict(int)  # param name -> bytes of its optimizer state
    for i in graph.inputs_of(InputKind.STATE):
        states[i.state_of] += i.type.nbytes
    for p in graph.inputs_of(InputKind.PARAM):
        if p.value in first:
            prof.static[first[p.value]] += 2 * p.type.nbytes + states.get(p.name, 0)
    return prof


def dependences(graph: Graph, producer: dict[str, int] | None = None) -> tuple[list[list[int]], list[list[int]]]:
    """Per node: the nodes making what it reads (sorted), and the nodes reading what it makes.
    ``producer``: ``graph.producers()``, if the caller has it."""
    producer = graph.producers() if producer is None else producer
    preds = [sorted({producer[u] for u in n.uses() if u in producer}) for n in graph.nodes]
    readers: list[list[int]] = [[] for _ in graph.nodes]
    for i, ps in enumerate(preds):
        for p in ps:
            readers[p].append(i)
    return preds, readers


def place_backward(nodes: list[Node], preds: list[list[int]], readers: list[list[int]], where: list[int | None],
                   last: int) -> None:
    """Fill ``where`` (a chunk or group per node, forward ops given) for the backward ops: the
    least of the forward ops' on their source line and of the backward ops they read (gradients
    flow to the same or an earlier chunk); ops with neither go with their backward readers,
    else their inputs, else ``last``. The source line alone is not enough: autograd's sums of
    a residual stream's gradient carry the loss's line, and would all land on the last chunk."""
    by_loc: dict = {}
    for i, n in enumerate(nodes):
        if n.role == Role.FORWARD and where[i] is not None and n.loc is not None:
            by_loc[n.loc] = max(by_loc.get(n.loc, 0), where[i])
    bwd = [n.role == Role.BACKWARD for n in nodes]
    for i, n in enumerate(nodes):
        if bwd[i] and where[i] is None:
            cands = [where[p] for p in preds[i] if bwd[p] and where[p] is not None]
            if n.loc in by_loc:
                cands.append(by_loc[n.loc])
            where[i] = min(cands, default=None)
    for i in reversed(range(len(nodes))):
        if bwd[i] and where[i] is None:
            later = [where[r] for r in readers[i] if bwd[r] and where[r] is not None]
            inputs = [where[p] for p in preds[i] if where[p] is not None]
            where[i] = max(later) if later else max(inputs, default=last)


def first_readers(graph: Graph, group: list[int | None]) -> dict[str, int]:
    """Param value -> group of its first forward reader (else first backward reader)."""
    params = {i.value for i in graph.inputs_of(InputKind.PARAM)}
    out: dict[str, int] = {}
    for role in (Role.FORWARD, Role.BACKWARD):
        for i, nd in enumerate(graph.nodes):
            if nd.role == role and group[i] is not None:
                for u in nd.uses():
                    if u in params:
                        out.setdefault(u, group[i])
    return out


def optimizer_owners(graph: Graph) -> dict[int, set[str]]:
    """Optimizer node index -> the param values whose update it computes: it reads the param,
    its gradient or its state, or an optimizer result that does. Empty: shared (the step)."""
    param_of = {i.name: i.value for i in graph.inputs_of(InputKind.PARAM)}
    direct = {i.value: i.value for i in graph.inputs_of(InputKind.PARAM)}
    for i in graph.inputs_of(InputKind.STATE):
        if i.state_of in param_of:
            direct[i.value] = param_of[i.state_of]
    for o in graph.outputs_of(OutputKind.GRAD):
        if o.name in param_of:
            direct[o.value] = param_of[o.name]
    owned_value: dict[str, set[str]] = {}
    out: dict[int, set[str]] = {}
    for i, nd in enumerate(graph.nodes):
        if nd.role != Role.OPTIMIZER:
            continue
        owned: set[str] = set()
        for u in nd.uses():
            if u in direct:
                owned.add(direct[u])
            owned |= owned_value.get(u, set())
        out[i] = owned
        # a value of several parameters (fp16's overflow count over all gradients) is like the
        # step counter to its readers: it does not pull their updates onto its chunk
        owned_value.update((o, owned if len(owned) <= 1 else set()) for o in nd.outputs)
    return out
