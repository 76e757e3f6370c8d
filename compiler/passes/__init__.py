"""The passes, one per file, and the registry that names them."""
from dataclasses import dataclass

from sbpc.runtime.kinds import Recompute as RecomputeMode, ScheduleName

from sbpc.compiler.passes.boxing import Boxing
from sbpc.compiler.sbp.cost_model import AlphaBeta, CostModel
from sbpc.compiler.passes.coalesce import Coalesce
from sbpc.compiler.passes.clip_grad import ClipGrad
from sbpc.compiler.passes.cse import CommonSubexpressionElimination
from sbpc.compiler.passes.dce import DeadCodeElimination
from sbpc.compiler.passes.decompose import Decompose
from sbpc.compiler.passes.fuse_adamw import FuseAdamW
from sbpc.compiler.passes.fuse_log_softmax import FuseLogSoftmax
from sbpc.compiler.passes.inplace import InPlace
from sbpc.compiler.passes.localize import Localize
from sbpc.compiler.passes.memory_plan import MemoryPlan
from sbpc.compiler.passes.normalize import Normalize
from sbpc.compiler.passes.offload import Offload
from sbpc.compiler.passes.overlap import Overlap
from sbpc.compiler.passes.recompute import Recompute
from sbpc.compiler.passes.random_draws import RandomDraws
from sbpc.compiler.passes.schedule import Schedule
from sbpc.compiler.passes.sbp_propagate import SbpPropagate
from sbpc.compiler.passes.stage_partition import StagePartition
from sbpc.compiler.passes.zero import Zero

REGISTRY = {p.name: p for p in (Normalize, Decompose, CommonSubexpressionElimination, DeadCodeElimination, StagePartition,
                                SbpPropagate, Boxing, FuseLogSoftmax, Coalesce, Recompute, Localize, RandomDraws, Schedule, FuseAdamW, InPlace, MemoryPlan,
                                Zero, Overlap, Offload, ClipGrad)}


@dataclass(frozen=True)
class PipelineOptions:
    """How a pipelined mesh runs: the schedule and the chunks per device stage. (The
    micro-batch count is the mesh's ``mb`` axis.)"""
    schedule: ScheduleName = ScheduleName.ONE_F_ONE_B
    virtual_stages: int = 1
    microbatches: int = 1
    # the count is the default (pp), not asked for: a model whose forward updates buffers
    # (BatchNorm's running statistics) then runs one micro-batch a step instead of being refused
    microbatches_default: bool = False


def default_pipeline(pipeline: PipelineOptions = PipelineOptions(), recompute: RecomputeMode = RecomputeMode.NONE,
                     zero: int = 0, offload: str = "none", memory_price: float = 0.0, clip_grad: float | None = None,
                     cost_model: CostModel | None = None):
    """The passes `sbpc compile` runs, in order. ZeRO (hints on the dp axis) runs before the
    stage partition places its hints, and after offload, so the master copies it adds are split
    like the rest of the optimizer state. ``memory_price``: the propagation's price of a byte kept
    for the backward, in link-moves of it (``AlphaBeta.priced``; the driver raises it under a
    budget). Recompute runs on the boxed graph (its clones
    copy SBPs and collectives) before localize and schedule (which treat clones as any op). The
    memory plan comes last: the estimate is of the program that runs, its collectives' buffers
    held from issue to wait. ``clip_grad`` (--clip-grad): clip-grad runs on the propagated graph,
    in the layouts the update reads, so clipping changes no other choice. fuse-log-softmax runs on
    the boxed graph: a log-softmax whose class dim propagation left whole goes back to the fused
    kernel decompose had split it out of. ``cost_model``: what propagation and the schedule's
    transfer choice price with (None: ``AlphaBeta``; ``sbpc compile --cluster``: ``ClusterCost``)."""
    v = pipeline.virtual_stages
    cost = cost_model or AlphaBeta()
    return [Normalize(), Decompose(), CommonSubexpressionElimination(), DeadCodeElimination(), Offload(what=offload), Zero(stage=zero),
            StagePartition(virtual_stages=v, microbatches=pipeline.microbatches),
            SbpPropagate(cost_model=cost.priced(memory_price), schedule=pipeline.schedule, virtual_stages=v,
                         param_layouts=cost_model is not None),
            ClipGrad(max_norm=clip_grad), Boxing(), FuseLogSoftmax(), Coalesce(),
            Recompute(mode=recompute), Localize(), RandomDraws(), Schedule(schedule=pipeline.schedule, virtual_stages=v, cost_model=cost),
            FuseAdamW(), InPlace(), Overlap(), MemoryPlan()]
