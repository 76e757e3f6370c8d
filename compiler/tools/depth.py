"""Compiling a model with fewer copies of its repeated layer, and reading the full depth off them.

A plan compiled with K copies of its layer (``--set layers=K``) has the structure of the real
model's plan -- the same layouts, collectives, stages and schedule -- when every pipeline chunk
keeps the same number of copies. `sbpc simulate --layers N` counts its layer's instructions
N/K times (docs/cost_model.md). Memory does not scale that way (a peak is not a sum):
``extrapolate_memory`` adds to each role what its missing layers hold -- their share of the
role's parameters, gradients and optimizer state, read off the plan's own parameters, and the
activations a layer keeps for the backward times the micro-batches the role holds at its peak
(the caller's per-layer figure); when the peak is in the optimizer update, its buffers and
temporaries are per-parameter values and grow with the parameters instead. The peak stays
where the compiled plan has it: a deeper model whose peak moves to another phase is estimated
at the compiled one's. Used by `sbpc search` and bench/calibration.py.
"""
from __future__ import annotations

import io
import math

from sbpc.compiler.frontend.hints import ParallelConfig
from sbpc.compiler.frontend.optim import OptimizerConfig
from sbpc.compiler.memory_options import MemoryOptions
from sbpc.compiler.passes import PipelineOptions
from sbpc.runtime.pipeline import instruction_uses
from sbpc.runtime.plan import Plan, RoleMemory
from sbpc.runtime.sbp import local_shape, parse_nd_sbp

_STATE = ("params", "grads", "optimizer")  # terms that grow with the parameters a role holds


def compile_layers(path: str, sets: dict, layers: int, mesh: str, *, batch_size: int, pipeline: PipelineOptions,
                   memory: MemoryOptions, config: ParallelConfig | None, optimizer: OptimizerConfig = OptimizerConfig(),
                   quiet: bool = False) -> Plan:
    """The plan of model file ``path`` (its ``--set`` values ``sets``) with ``layers`` copies of
    its layer. ``quiet``: without printing the compiler's notes (a probe's, not the user's);
    the IR verifier runs between passes as in ``sbpc compile`` (about 3% of the 18.4B search's
    CPU time), so what the search ranks is what ``sbpc compile`` accepts."""
    from sbpc.compiler.driver import compile_model
    from sbpc.compiler.frontend.model_loader import load_model
    from sbpc.compiler.ir.mesh import parse_mesh
    from sbpc.compiler.pass_manager import CompileContext

    ctx = CompileContext(log=io.StringIO()) if quiet else CompileContext()
    source = load_model(path, {**sets, "layers": layers})
    return compile_model(source, parse_mesh(mesh), batch_size=batch_size, optimizer=optimizer, ctx=ctx, config=config,
                         pipeline=pipeline, memory=memory, enforce_budget=False).plan


def stage_layers(plan: Plan, layer_list: str) -> dict[int, tuple[int, float]]:
    """Per pp stage, (the copies of ``layer_list``'s layer it runs, their share of the local
    elements of the parameters it reads)."""
    sizes = tuple(a.size for a in plan.mesh if a.name != "pp")
    p = plan.pipeline.stages if plan.pipeline is not None else 1
    spec = {s.value: s for s in plan.params}
    read: dict[int, set[str]] = {}
    for prog in plan.stages:
        names = read.setdefault(prog.stage % p, set())
        for ins in prog.instructions:
            names.update(v for v in instruction_uses(ins) if v in spec)
    out = {}
    for stage, values in read.items():
        local = {v: math.prod(local_shape(spec[v].shape, parse_nd_sbp(spec[v].sbp), sizes)) if spec[v].sbp
                 else math.prod(spec[v].shape) for v in values}
        prefix = layer_list + "."
        layers = {spec[v].name[len(prefix):].split(".")[0] for v in values if spec[v].name.startswith(prefix)}
        in_layers = sum(n for v, n in local.items() if spec[v].name.startswith(prefix))
        out[stage] = (len(layers), in_layers / max(sum(local.values()), 1))
    return out


def extrapolate_memory(plan: Plan, layers: int, layer_list: str, activations_per_layer: float) -> list[RoleMemory]:
    """The plan's roles with ``layers`` copies of its layer, spread evenly over the stages
    (module docstring). ``activations_per_layer``: bytes one layer keeps for one micro-batch."""
    p = plan.pipeline.stages if plan.pipeline is not None else 1
    held = stage_layers(plan, layer_list)
    out = []
    for role in plan.estimates.roles:
        copies, share = held.get(role.stage, (0, 0.0))
        if copies == 0:
            out.append(role)
            continue
        grow = layers / p / copies  # how many times the role's layers multiply
        state = 1 - share + share * grow  # how many times its parameters do
        if role.peak_at.startswith("U"):  # the peak is in the update: its values are per parameter
            terms = {t: round(getattr(role, t) * state) for t in (*_STATE, "buffers", "temporaries")}
            terms["activations"] = role.activations
        else:  # in a forward or backward: one layer's working set, and the stash of every layer in flight
            terms = {t: round(getattr(role, t) * state) for t in _STATE}
            terms["activations"] = round(role.activations + activations_per_layer * role.in_flight * (layers / p - copies))
            terms |= {"buffers": role.buffers, "temporaries": role.temporaries}
        out.append(role.model_copy(update={**terms, "total": sum(terms.values())}))
    return out
