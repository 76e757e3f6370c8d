"""The compile driver: model file -> capture -> passes -> physical plan."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from sbpc.compiler.frontend.capture import capture
from sbpc.compiler.frontend.hints import ParallelConfig
from sbpc.compiler.ir.types import Graph
from sbpc.compiler.lower import NEEDS as LOWER_NEEDS, lower
from sbpc.compiler.ir.mesh import Mesh
from sbpc.compiler.frontend.model_loader import ModelSource
from sbpc.compiler.frontend.optim import OptimizerConfig
from sbpc.compiler.memory_options import MemoryOptions
from sbpc.compiler.pass_manager import CompileContext, PassManager
from sbpc.compiler.passes import PipelineOptions, default_pipeline
from sbpc.errors import UsageError
from sbpc.runtime.kinds import Recompute
from sbpc.runtime.plan import ModelRef, Plan


@dataclass
class CompileResult:
    plan: Plan
    graph: Graph  # the IR after the last pass
    timings: dict[str, float] = field(default_factory=dict)


def compile_model(source: ModelSource, mesh: Mesh, *, batch_size: int, optimizer: OptimizerConfig,
                  ctx: CompileContext | None = None, passes=None, config: ParallelConfig | None = None,
                  pipeline: PipelineOptions = PipelineOptions(), memory: MemoryOptions = MemoryOptions()) -> CompileResult:
    _refuse_unbuilt(memory)
    mesh = mesh.with_microbatches(pipeline.microbatches)
    _manager(passes, ctx or CompileContext(), pipeline, memory)  # a broken pass list fails before the capture
    t0 = time.perf_counter()
    graph = capture(source, mesh, batch_size, optimizer, config)
    result = compile_captured(graph, source, batch_size=batch_size, optimizer=optimizer, ctx=ctx, passes=passes,
                              pipeline=pipeline, memory=memory)
    result.timings["capture"] = time.perf_counter() - t0 - result.timings["total"]
    result.timings["total"] += result.timings["capture"]
    return result


def compile_captured(graph: Graph, source: ModelSource, *, batch_size: int, optimizer: OptimizerConfig,
                     ctx: CompileContext | None = None, passes=None,
                     pipeline: PipelineOptions = PipelineOptions(),
                     memory: MemoryOptions = MemoryOptions()) -> CompileResult:
    """The passes and lowering of a captured graph. A graph captured without stage hints
    serves every mesh of one batch size (``replace(graph, mesh=...)``): the fuzz test
    captures once and compiles on many meshes."""
    ctx = ctx or CompileContext()
    t0 = time.perf_counter()
    graph = _manager(passes, ctx, pipeline, memory).run(graph)
    timings = {"passes": time.perf_counter() - t0}
    model = ModelRef(path=source.path, sets=source.sets, batch_size=batch_size)
    plan = lower(graph, model, optimizer, ctx.estimates)
    timings["total"] = time.perf_counter() - t0
    return CompileResult(plan=plan, graph=graph, timings=timings)


def _manager(passes, ctx: CompileContext, pipeline: PipelineOptions, memory: MemoryOptions) -> PassManager:
    """The pass manager of ``passes`` (default: the whole pipeline), its contracts checked,
    lowering's included."""
    manager = PassManager(passes if passes is not None else default_pipeline(pipeline, memory.recompute), ctx)
    manager.require("lower", LOWER_NEEDS)
    return manager


def _refuse_unbuilt(memory: MemoryOptions) -> None:
    """The memory options whose passes are not built yet are refused, never ignored."""
    default = MemoryOptions()
    for key, flag in (("zero", "--zero"), ("recompute", "--recompute"), ("precision", "--precision"),
                      ("offload", "--offload"), ("device_memory", "--device-memory")):
        value = getattr(memory, key)
        if key == "recompute" and value != Recompute.AUTO:
            continue  # none, selective, full: the recompute pass
        if value != getattr(default, key):
            raise UsageError(f"{flag} {value} is not implemented yet", hint="see the open memory issue (ZeRO, recompute, "
                             "mixed precision, offload, memory budget)")
