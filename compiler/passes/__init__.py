"""The passes, one per file, and the registry that names them."""
from sbpc.compiler.passes.boxing import Boxing
from sbpc.compiler.passes.coalesce import Coalesce
from sbpc.compiler.passes.cse import CommonSubexpressionElimination
from sbpc.compiler.passes.dce import DeadCodeElimination
from sbpc.compiler.passes.decompose import Decompose
from sbpc.compiler.passes.localize import Localize
from sbpc.compiler.passes.memory_plan import MemoryPlan
from sbpc.compiler.passes.normalize import Normalize
from sbpc.compiler.passes.sbp_propagate import SbpPropagate
from sbpc.compiler.passes.stage_partition import StagePartition

REGISTRY = {p.name: p for p in (Normalize, Decompose, CommonSubexpressionElimination, DeadCodeElimination, StagePartition,
                                SbpPropagate, Boxing, Coalesce, Localize, MemoryPlan)}


def default_pipeline():
    """The passes `sbpc compile` runs, in order."""
    return [Normalize(), Decompose(), CommonSubexpressionElimination(), DeadCodeElimination(), StagePartition(),
            SbpPropagate(), Boxing(), Coalesce(), Localize(), MemoryPlan()]
