"""The compile driver: model file -> capture -> passes -> physical plan."""
from __future__ import annotations

import io
import time
from dataclasses import dataclass, field, replace

from sbpc.compiler.frontend.buffer_updates import BufferWritesOverMicrobatches
from sbpc.compiler.frontend.capture import capture
from sbpc.compiler.gc_pause import no_cycle_collection
from sbpc.compiler.frontend.hints import ParallelConfig
from sbpc.compiler.ir.types import Graph
from sbpc.compiler.lower import NEEDS as LOWER_NEEDS, lower
from sbpc.compiler.ir.mesh import Mesh
from sbpc.compiler.frontend.model_loader import ModelSource
from sbpc.compiler.frontend.optim import OptimizerConfig
from sbpc.compiler.memory_options import MemoryOptions
from sbpc.compiler.pass_manager import CompileContext, PassManager
from sbpc.compiler.passes import PipelineOptions, default_pipeline
from sbpc.compiler.pipelining.whole_batch import WholeBatchOverMicrobatches
from sbpc.compiler.memory.estimate import fits
from sbpc.compiler.sbp.cost_model import MEMORY_PRICES
from sbpc.errors import CompileError
from sbpc.runtime.kinds import Precision, Recompute
from sbpc.runtime.plan import LossScaling, ModelRef, Plan, PrecisionSpec


@dataclass
class CompileResult:
    plan: Plan
    graph: Graph  # the IR after the last pass
    timings: dict[str, float] = field(default_factory=dict)


def compile_model(source: ModelSource, mesh: Mesh, *, batch_size: int, optimizer: OptimizerConfig,
                  ctx: CompileContext | None = None, passes=None, config: ParallelConfig | None = None,
                  pipeline: PipelineOptions = PipelineOptions(), memory: MemoryOptions = MemoryOptions(),
                  enforce_budget: bool = True) -> CompileResult:
    """``enforce_budget``: refuse a plan that does not fit ``memory.device_memory`` (`sbpc
    memory` turns it off to print the table)."""
    ctx = ctx or CompileContext()
    # a broken pass list fails before the capture (auto's mode is chosen after it; any mode has the same contracts)
    _manager(passes, ctx, pipeline,
             replace(memory, recompute=Recompute.NONE) if memory.recompute == Recompute.AUTO else memory,
             clip_grad=optimizer.clip_grad)
    t0 = time.perf_counter()
    with no_cycle_collection(collect_after=not ctx.process_exits):  # one pause: capture and passes nest in it
        graph, mesh, pipeline = _capture_fitting_microbatches(source, mesh, batch_size, optimizer, config, memory,
                                                              pipeline, ctx, passes)
        result, pipeline = _compile_or_one_microbatch(graph, source, batch_size, optimizer, config, memory, pipeline,
                                                      ctx, passes)
        result.timings["capture"] = time.perf_counter() - t0 - result.timings["total"]
        result.timings["total"] += result.timings["capture"]
    if enforce_budget and memory.device_memory is not None:
        _refuse_over_budget(result.plan.estimates.roles, graph, source, mesh, batch_size=batch_size,
                            optimizer=optimizer, config=config, pipeline=pipeline, memory=memory)
    return result


def _capture_fitting_microbatches(source: ModelSource, mesh: Mesh, batch_size: int, optimizer: OptimizerConfig,
                                  config: ParallelConfig | None, memory: MemoryOptions, pipeline: PipelineOptions,
                                  ctx: CompileContext, passes) -> tuple[Graph, Mesh, PipelineOptions]:
    """The capture on ``mesh`` with the pipeline's micro-batches. A forward that updates buffers
    (BatchNorm's running statistics) cannot be split into micro-batches: their statistics, and
    so the gradients, would differ from the whole batch's. Where the count was only the default
    (pp), such a model runs one micro-batch a step, with a note; a count the user asked for is
    refused (``BufferWritesOverMicrobatches``, with the hint)."""
    precision = precision_spec(memory.precision)
    try:
        return capture(source, mesh.with_microbatches(pipeline.microbatches), batch_size, optimizer, config,
                       precision), mesh.with_microbatches(pipeline.microbatches), pipeline
    except BufferWritesOverMicrobatches as err:
        if not pipeline.microbatches_default or passes is not None:
            raise
        print(f"sbpc: note: {err.message.split(',')[0]}: running 1 micro-batch a step instead of the default "
              f"{pipeline.microbatches} (its statistics are the whole batch's, as on one device)", file=ctx.log)
    pipeline = replace(pipeline, microbatches=1, microbatches_default=False)
    mesh = mesh.with_microbatches(1)
    return capture(source, mesh, batch_size, optimizer, config, precision), mesh, pipeline


def _compile_or_one_microbatch(graph: Graph, source: ModelSource, batch_size: int, optimizer: OptimizerConfig,
                               config: ParallelConfig | None, memory: MemoryOptions, pipeline: PipelineOptions,
                               ctx: CompileContext, passes) -> tuple[CompileResult, PipelineOptions]:
    """The passes over ``graph``. A step that reads the whole batch at once (a contrastive loss; a
    mixture of experts sorting the batch's tokens by expert) cannot be split into micro-batches:
    where the count was only the default, it runs one micro-batch a step, with a note, like a
    model that updates buffers; a count the user asked for is refused (the schedule pass's
    ``WholeBatchOverMicrobatches``, with its hint). The first try's warnings are held back, so
    the retry prints each once."""
    if not pipeline.microbatches_default or passes is not None or pipeline.microbatches == 1:
        return compile_captured(graph, source, batch_size=batch_size, optimizer=optimizer, ctx=ctx,
                                passes=passes, pipeline=pipeline, memory=memory), pipeline
    held = io.StringIO()
    try:
        return compile_captured(graph, source, batch_size=batch_size, optimizer=optimizer,
                                ctx=replace(ctx, log=held), pipeline=pipeline, memory=memory), pipeline
    except WholeBatchOverMicrobatches as err:
        held = None
        where = f" (at {err.location})" if err.location else ""
        print(f"sbpc: note: {err.message.split(', so ')[0]}: running 1 micro-batch a step instead of the default "
              f"{pipeline.microbatches}, so the pipeline's stages do not overlap{where}", file=ctx.log)
    finally:
        if held is not None:  # the try's warnings are the user's, unless it is tried again
            ctx.log.write(held.getvalue())
    ctx.estimates.clear()
    pipeline = replace(pipeline, microbatches=1, microbatches_default=False)
    graph = capture(source, graph.mesh.with_microbatches(1), batch_size, optimizer, config,
                    precision_spec(memory.precision))
    return compile_captured(graph, source, batch_size=batch_size, optimizer=optimizer, ctx=ctx, pipeline=pipeline,
                            memory=memory), pipeline


def _refuse_over_budget(roles, captured: Graph, source: ModelSource, mesh: Mesh, *, memory: MemoryOptions,
                        batch_size: int, optimizer: OptimizerConfig, config: ParallelConfig | None,
                        pipeline: PipelineOptions) -> None:
    """A plan that does not fit is refused, naming the role, its biggest term and the cheapest
    change that fits (each change re-estimated by running the passes under it on the same
    capture; compiler/memory/advice.py)."""
    from sbpc.compiler.memory import advice
    from sbpc.errors import SbpcError

    budget = memory.device_memory
    over = [r for r in roles if r.total > budget]
    if not over:
        return
    worst = max(over, key=lambda r: r.total)
    term, nbytes = advice.biggest_term(worst)

    # Stage hints are chunk numbers of one mesh's pp: a hinted capture is redone for another mesh.
    hinted = any(n.stage is not None for n in captured.nodes)
    prefixes: dict = {}  # the passes before recompute, run once per (mesh, zero, offload): recompute candidates share them
    base = (captured.mesh, memory.zero, memory.offload)

    def estimate(change: advice.Change):
        quiet = CompileContext(verify=False, log=io.StringIO())  # a probe: its warnings are not the user's
        try:
            option = change.memory
            if option.recompute == Recompute.AUTO:  # auto needs the budget to choose: a whole compile
                return compile_model(source, change.mesh, memory=option, enforce_budget=False, ctx=quiet,
                                     batch_size=batch_size, optimizer=optimizer, config=config,
                                     pipeline=pipeline).plan.estimates.roles
            # its time-optimal plan, memory unpriced (not the price ladder): a change named fits
            # without the propagation's help
            target = change.mesh.with_microbatches(pipeline.microbatches)
            if target == captured.mesh:
                graph = captured
            elif hinted:
                graph = capture(source, target, batch_size, optimizer, config, precision_spec(change.memory.precision))
            else:  # a capture without stage hints serves every mesh of its batch size
                graph = replace(captured, mesh=target)
            passes = default_pipeline(pipeline, option.recompute, option.zero, option.offload,
                                      clip_grad=optimizer.clip_grad)
            cut = next(i for i, p in enumerate(passes) if p.name == "recompute")
            key = (target, option.zero, option.offload)
            if key not in prefixes:
                for k in [k for k in prefixes if k != base]:  # besides the user's, one boxed graph at a time
                    del prefixes[k]
                prefix = PassManager(passes[:cut], quiet)
                prefixes[key] = (prefix.run(graph), prefix.facts)
            boxed, facts = prefixes[key]
            PassManager(passes[cut:], quiet, given=facts).run(boxed)
            return quiet.estimates["roles"]  # memory-plan's estimate_memory, as the plan would carry it
        except SbpcError:  # the model or batch cannot take this change (heads over tp, batch over dp)
            return None

    fit = advice.first_fit(advice.candidates(mesh, memory), estimate, budget)
    devices = f"{worst.ranks} device{'s' if worst.ranks > 1 else ''}"
    message = (f"{worst.role} ({devices}) needs {advice.gb(worst.total)} per device at its peak ({worst.peak_at}), "
               f"over --device-memory {advice.gb(budget)}; its biggest term is {term} ({advice.gb(nbytes)})")
    if fit is None:
        hint = "no single change sbpc can make fits (tried: " + ", ".join(
            c.label for c in advice.candidates(mesh, memory)) + "); see `sbpc memory` for every role"
    else:
        change, fitted = fit
        top = max(fitted, key=lambda r: r.total)
        hint = f"the cheapest change that fits: {change.label} ({advice.gb(top.total)} on its fullest role, {top.role})"
    raise CompileError(message, hint=hint)


def compile_captured(graph: Graph, source: ModelSource, *, batch_size: int, optimizer: OptimizerConfig,
                     ctx: CompileContext | None = None, passes=None,
                     pipeline: PipelineOptions = PipelineOptions(),
                     memory: MemoryOptions = MemoryOptions()) -> CompileResult:
    """The passes and lowering of a captured graph. A graph captured without stage hints
    serves every mesh of one batch size (``replace(graph, mesh=...)``): the fuzz test
    captures once and compiles on many meshes. ``memory.precision`` is the one it was captured in."""
    ctx = ctx or CompileContext()
    t0 = time.perf_counter()
    with no_cycle_collection():
        if memory.recompute == Recompute.AUTO:
            memory = _least_recompute(graph, passes, ctx, pipeline, memory, optimizer.clip_grad)
        graph = _priced_run(graph, passes, ctx, pipeline, memory, optimizer.clip_grad)
        timings = {"passes": time.perf_counter() - t0}
        model = ModelRef(path=source.path, sets=source.sets, batch_size=batch_size,
                         batch_keys=list(source.batch_keys(batch_size)))
        plan = lower(graph, model, optimizer, ctx.estimates, precision_spec(memory.precision))
    timings["total"] = time.perf_counter() - t0
    return CompileResult(plan=plan, graph=graph, timings=timings)


def _priced_run(graph: Graph, passes, ctx: CompileContext, pipeline: PipelineOptions, memory: MemoryOptions,
                clip_grad: float | None = None) -> Graph:
    """The passes, with memory priced as the budget needs: the time-optimal plan (price 0) when
    it fits ``--device-memory`` or there is none; else the first of the dearer prices
    (``MEMORY_PRICES``) whose plan fits, tried without printing, then compiled as usual. When
    none fits, the time-optimal plan, which the budget check then refuses with its advice.
    Given passes are run as they are (their cost model is the caller's)."""
    out = _manager(passes, ctx, pipeline, memory, clip_grad=clip_grad).run(graph)
    if passes is not None or fits(ctx.estimates.get("roles", []), memory.device_memory):
        return out
    if all(k == 1 for axis, k in graph.mesh.device_axes if axis != "pp"):
        return out  # one device per stage: no layout to choose, nothing to price
    quiet = replace(ctx, print_after=set(), print_after_all=False, dump_dir=None, estimates={})
    for price in MEMORY_PRICES[1:]:
        trial = replace(quiet, estimates={})
        priced = _manager(passes, trial, pipeline, memory, price, clip_grad).run(graph)
        if fits(trial.estimates["roles"], memory.device_memory):
            print(f"sbpc: --device-memory: the time-optimal plan does not fit; memory priced at {price:g} link-moves "
                  "per byte kept for the backward, it does", file=ctx.log)
            ctx.estimates.clear()
            if ctx.print_after or ctx.print_after_all or ctx.dump_dir:  # what the user asked to see, of this plan
                return _manager(passes, ctx, pipeline, memory, price, clip_grad).run(graph)
            ctx.estimates.update(trial.estimates)
            return priced
    return out


def _manager(passes, ctx: CompileContext, pipeline: PipelineOptions, memory: MemoryOptions,
             memory_price: float = 0.0, clip_grad: float | None = None) -> PassManager:
    """The pass manager of ``passes`` (default: the whole pipeline, the propagation pricing
    memory at ``memory_price``), its contracts checked, lowering's included."""
    passes = passes if passes is not None else default_pipeline(pipeline, memory.recompute, memory.zero, memory.offload,
                                                                memory_price, clip_grad, ctx.cost_model)
    manager = PassManager(passes, ctx)
    manager.require("lower", LOWER_NEEDS)
    return manager


_RECOMPUTE_ORDER = (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)  # least recompute first


def _least_recompute(graph: Graph, passes, ctx: CompileContext, pipeline: PipelineOptions,
                     memory: MemoryOptions, clip_grad: float | None = None) -> MemoryOptions:
    """``--recompute auto``: the first of none, selective, full whose estimate
    (``estimate_memory``: every pp stage's peak) fits ``--device-memory``. Candidates are
    compiled without printing; the caller compiles the chosen one as usual."""
    quiet = replace(ctx, print_after=set(), print_after_all=False, dump_dir=None, estimates={})
    roles = []
    for mode in _RECOMPUTE_ORDER:
        chosen = replace(memory, recompute=mode)
        trial = replace(quiet, estimates={})
        _manager(passes, trial, pipeline, chosen, clip_grad=clip_grad).run(graph)  # time-optimal layouts (memory unpriced)
        roles = trial.estimates["roles"]  # memory-plan's estimate_memory
        if fits(roles, memory.device_memory):
            print(f"sbpc: --recompute auto chose {mode.value}: the largest rank role needs "
                  f"{max(r.total for r in roles) / 2**20:,.1f} MiB of {memory.device_memory / 2**20:,.1f} MiB",
                  file=ctx.log)
            return chosen
    worst = max(roles, key=lambda r: r.total)
    raise CompileError(f"no --recompute mode fits --device-memory {memory.device_memory / 2**20:,.1f} MiB: with full "
                       f"recompute {worst.role} needs {worst.total / 2**20:,.1f} MiB",
                       hint="a ZeRO stage, more tp or pp, or a smaller batch")


def precision_spec(precision: Precision) -> PrecisionSpec:
    """The plan's precision: fp16 scales the loss dynamically (torch.amp.GradScaler's defaults)."""
    return PrecisionSpec(compute=precision, loss_scaling=LossScaling() if precision == Precision.FP16 else None)
