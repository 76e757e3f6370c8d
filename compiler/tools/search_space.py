"""The policy half of `sbpc search`: which strategies exist for a transformer on N devices, and
a first-order estimate of each one's step time and memory to rank them before any compile.

A strategy (``Candidate``) is a mesh dp x tp x pp, a micro-batch count, a pipeline schedule, a
ZeRO stage and a recompute mode. ``enumerate_candidates`` lists every one the model and the
devices allow: tp divides the heads (and so the hidden size) and stays inside a node (the rank
map puts tp innermost), pp divides the layers, dp x micro-batch size divides the global batch.

``estimate`` prices one from the model's shape alone (``Shape``, no compile): the GEMM FLOPs of
a layer (Narayanan et al.'s 24bsh^2 + 4bs^2h forward, twice that backward, the recomputed
forward on top), a memory-bound term for the elementwise ops, a launch overhead per kernel,
tp's all-reduces and dp's gradient reduction priced by the cluster's own cost model
(``ClusterCost``: the link the group really uses), the pipeline's bubble and transfers; memory
is Korthikanti et al.'s activations per layer plus the model state of the first stage. It is
coarse on purpose: it only has to keep the fast ones in the short list the compiler and the
simulator then judge (``compiler/tools/search.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from sbpc.compiler.memory_options import ZERO_STAGES
from sbpc.compiler.sbp.cost_model import ClusterCost
from sbpc.compiler.tools.cluster import Cluster
from sbpc.runtime.kinds import Collective, Precision, Recompute, ScheduleName

RECOMPUTES = (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)
_KERNELS_PER_LAYER = 40  # forward kernels of one transformer layer, unfused (the backward launches twice as many)


@dataclass(frozen=True)
class Shape:
    """A GPT-like model as the estimate sees it, and the step's global batch."""
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    batch: int
    precision: Precision

    @property
    def act_bytes(self) -> int:
        return 4 if self.precision == Precision.FP32 else 2

    def layer_params(self) -> int:
        return 12 * self.hidden ** 2 + 13 * self.hidden


@dataclass(frozen=True, order=True)
class Candidate:
    dp: int
    tp: int
    pp: int
    microbatches: int
    schedule: ScheduleName = ScheduleName.ONE_F_ONE_B
    virtual_stages: int = 1
    zero: int = 0
    recompute: Recompute = Recompute.NONE

    @property
    def mesh(self) -> str:
        return f"{self.dp}x{self.tp}x{self.pp}"

    def micro_batch_size(self, batch: int) -> int:
        return batch // (self.dp * self.microbatches)


@dataclass(frozen=True)
class Estimate:
    seconds: float
    memory_bytes: float  # the fullest stage's peak, per device


def parse_meshes(text: str, devices: int) -> list[tuple[int, int, int]]:
    """``8x1x1,2x4x1`` -> [(dp, tp, pp), ...]; every one must use ``devices`` devices."""
    from sbpc.errors import UsageError

    out = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) >= 1 for p in parts):
            raise UsageError(f"--meshes: {item.strip()!r} is not a mesh DPxTPxPP",
                             hint="write each candidate as three positive sizes, e.g. --meshes 8x1x1,2x4x1")
        dp, tp, pp = map(int, parts)
        if dp * tp * pp != devices:
            raise UsageError(f"--meshes: {item.strip()} uses {dp * tp * pp} devices, not --devices {devices}",
                             hint=f"each candidate's dp x tp x pp must be {devices}")
        out.append((dp, tp, pp))
    return out


def meshes(shape: Shape, devices: int, per_node: int) -> list[tuple[int, int, int]]:
    """Every (dp, tp, pp) with dp x tp x pp = devices the model allows (module docstring)."""
    out = []
    for tp in _divisors(devices):
        if shape.heads % tp or tp > per_node:
            continue
        for pp in _divisors(devices // tp):
            if shape.layers % pp == 0 and shape.batch % (devices // (tp * pp)) == 0:
                out.append((devices // (tp * pp), tp, pp))
    return out


def enumerate_candidates(shape: Shape, mesh_list: list[tuple[int, int, int]]) -> list[Candidate]:
    """Micro-batch counts, schedules, ZeRO stages and recompute modes of each mesh."""
    out = []
    for dp, tp, pp in mesh_list:
        if shape.batch % dp:
            continue
        for m in _divisors(shape.batch // dp):
            if pp > 1 and m < pp:  # fewer micro-batches than stages leaves stages idle all step
                continue
            schedules = [(ScheduleName.ONE_F_ONE_B, 1)]
            if pp > 1 and m % pp == 0 and shape.layers % (2 * pp) == 0:
                schedules.append((ScheduleName.INTERLEAVED, 2))
            for schedule, v in schedules:
                for zero in ZERO_STAGES if dp > 1 else (0,):
                    for rec in RECOMPUTES:
                        out.append(Candidate(dp, tp, pp, m, schedule, v, zero, rec))
    return out


def estimate(c: Candidate, shape: Shape, cluster: Cluster, attention: str = "flash") -> Estimate:
    """Step seconds and peak bytes per device of ``c`` (module docstring)."""
    s, h, a, v, L = shape.seq, shape.hidden, shape.heads, shape.vocab, shape.layers
    b = c.micro_batch_size(shape.batch)
    t, ab = c.tp, shape.act_bytes
    cost = ClusterCost(cluster, (("pp", c.pp), ("dp", c.dp), ("tp", c.tp)))
    dtype = {Precision.BF16: "bf16", Precision.FP16: "f16"}.get(shape.precision, "f32")
    gemm = cluster.peak(dtype) * cluster.efficiency.gemm
    bw = cluster.device.memory_bandwidth * cluster.efficiency.memory
    materialized = attention == "materialized"
    # one layer's forward on one micro-batch, on one device
    dense = 24 * b * s * h * h / t / gemm
    scores = 4 * b * s * s * h / t / (gemm if materialized else 2 * cluster.peak(dtype) * cluster.efficiency.attention)
    elementwise = b * s * h * ab * (16 + 26 / t) / bw + (7 * b * a * s * s * ab / t / bw if materialized else 0.0)
    launches = _KERNELS_PER_LAYER * cluster.device.kernel_overhead
    fwd = dense + scores + elementwise + launches
    redo = {Recompute.NONE: 0.0, Recompute.SELECTIVE: scores + elementwise / 2, Recompute.FULL: fwd}[c.recompute]
    tp_ar = cost.on_axis(Collective.ALL_REDUCE, b * s * h * ab, "tp")
    layer = 3 * fwd + redo + tp_ar * (4 + (2 if c.recompute == Recompute.FULL else 0))
    if c.zero == 3:  # the layer's weights gathered for the forward and again for the backward
        layer += 2 * cost.on_axis(Collective.ALL_GATHER, shape.layer_params() / t / c.dp * ab, "dp")
    head = 3 * (2 * b * s * h * v / t / gemm) + 3 * b * s * v / t * 4 / bw
    per_mb = layer * L / c.pp + head / c.pp  # the head's time spread: the partitioner balances the stages
    transfer = 2 * cost.point_to_point(b * s * h * ab) if c.pp > 1 else 0.0
    bubble = (c.pp - 1) / c.virtual_stages
    pipeline = (c.microbatches + bubble) * (per_mb + transfer)
    # the model state of the first stage (its layers and the embeddings), and its update
    embeddings = (v + s) * h if c.pp > 1 else (2 * v + s) * h  # the head's weight is on the last stage with pp
    stage_params = (L / c.pp * shape.layer_params() + embeddings) / t
    grads = cost.on_axis(Collective.ALL_REDUCE, stage_params * 4, "dp")
    update = stage_params / (c.dp if c.zero else 1) * 28 / bw
    seconds = pipeline + grads + update
    return Estimate(seconds, _memory(c, shape, stage_params, b))


def layer_activation_bytes(c: Candidate, shape: Shape) -> float:
    """What one layer keeps for the backward of one micro-batch on a device, in sbh units of
    fp16 bytes: Korthikanti et al. 2022 count 10 + 24/t without sequence parallelism and
    without the s x s probabilities (sbpc's attention op keeps its inputs, output and log-sum-exp,
    so selective recompute keeps the same); sbpc's plans of examples/gpt.py keep about 3 more
    replicated (13 + 24/t, measured against full-depth compiles at s = 2048), and with full
    recompute 4 (the layer's input, and its fp32 copy in half precision)."""
    unit = shape.seq * c.micro_batch_size(shape.batch) * shape.hidden * shape.act_bytes / 2
    return 4 * unit if c.recompute == Recompute.FULL else unit * (13 + 24 / c.tp)


def _memory(c: Candidate, shape: Shape, stage_params: float, b: int) -> float:
    ab = shape.act_bytes
    weights = stage_params * (4 + (ab if ab < 4 else 0)) / (c.dp if c.zero >= 3 else 1)
    grads = stage_params * 4 / (c.dp if c.zero >= 2 else 1)
    state = stage_params * 8 / (c.dp if c.zero >= 1 else 1)
    in_flight = min(c.microbatches, c.pp + (c.pp - 1) // c.virtual_stages if c.virtual_stages > 1 else c.pp)
    acts = layer_activation_bytes(c, shape) * shape.layers / c.pp * in_flight
    if c.recompute == Recompute.FULL:  # the recomputed layer's activations, during its backward
        acts += layer_activation_bytes(replace(c, recompute=Recompute.NONE), shape)
    logits = b * shape.seq * shape.vocab / c.tp * (ab + 8)  # the logits, their fp32 softmax and its gradient
    return weights + grads + state + acts + logits


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def shortlist(scored: list[tuple[Candidate, Estimate]], budget: float) -> list[tuple[Candidate, Estimate]]:
    """The order to compile in: the estimates that fit ``budget``, fastest first, the fastest of
    each mesh before any second one (the estimate is coarse: a spread of meshes hedges it); when
    none fits, all of them, smallest first."""
    fitting = sorted((x for x in scored if x[1].memory_bytes <= budget), key=lambda x: (x[1].seconds, x[0]))
    if not fitting:
        return sorted(scored, key=lambda x: (x[1].memory_bytes, x[0]))
    seen, first, rest = set(), [], []
    for x in fitting:
        (rest if x[0].mesh in seen else first).append(x)
        seen.add(x[0].mesh)
    return first + rest
