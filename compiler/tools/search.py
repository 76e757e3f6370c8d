"""`sbpc search`: the fastest strategy for a model on N devices of a described cluster.

Three separable steps: ``search_space`` enumerates the strategies (mesh, micro-batches,
schedule, ZeRO, recompute) and ranks them with a first-order estimate (the policy); the
``top`` fastest that fit the device memory by that estimate are then compiled and simulated
(the mechanism, the same as `sbpc compile` and `sbpc simulate`; one the compiler refuses is
listed and the next one compiled instead); the table is ranked by the simulated step time. The cluster is a parameter of both the estimate and the simulation.

Each short-listed strategy is compiled with few copies of the model's layer (``depth.py``): one
per pipeline chunk (two without pp, as bench/calibration.py), pinned to the chunks evenly by
``[stages]`` hints, simulated with ``layers`` set to the real count; its memory is the
compiled plan's with what the missing layers hold added (``depth.extrapolate_memory``). A
model with no more layers than that is compiled whole.
"""
from __future__ import annotations

import json
import time
import tomllib
from dataclasses import dataclass, replace

from pydantic import BaseModel, ConfigDict

from sbpc.compiler.frontend.hints import ParallelConfig, StageHint
from sbpc.compiler.memory_options import MemoryOptions
from sbpc.compiler.passes import PipelineOptions
from sbpc.compiler.tools import search_space
from sbpc.compiler.tools.cluster import Cluster
from sbpc.compiler.tools.depth import compile_layers, extrapolate_memory
from sbpc.compiler.tools.memory_report import size_text
from sbpc.compiler.tools.search_space import Candidate, Shape
from sbpc.compiler.tools.simulate import simulate
from sbpc.errors import SbpcError, UsageError
from sbpc.runtime.kinds import Precision
from sbpc.runtime.plan import Plan

_SHAPE_KEYS = ("layers", "hidden", "heads", "vocab", "seq")


@dataclass(frozen=True)
class SearchOptions:
    model: str  # the model file
    sets: dict  # its --set values (the real depth among them, or its default)
    devices: int
    cluster: Cluster
    batch_size: int
    precision: Precision = Precision.FP32
    device_memory: float | None = None  # bytes; None: the cluster's
    config_path: str | None = None  # the sharding hints ([params], [modules]) every candidate compiles with
    meshes: list[tuple[int, int, int]] | None = None  # None: every mesh the model allows
    top: int = 4
    attention: str = "flash"
    attention_dropout: float | None = None

    def budget(self) -> float:
        """Bytes a strategy must fit on a device: ``--device-memory``, else the cluster's."""
        return self.device_memory if self.device_memory is not None else self.cluster.device.memory


class Row(BaseModel):
    """One compiled and simulated strategy."""
    model_config = ConfigDict(extra="forbid")
    rank: int
    mesh: str  # dp x tp x pp
    micro_batch: int  # samples per micro-batch on a device
    microbatches: int
    schedule: str
    virtual_stages: int
    zero: int
    recompute: str
    estimate_s: float  # the first-order estimate that short-listed it
    step_time_s: float | None  # simulated; None when it did not compile
    tflops_per_device: float | None
    mfu: float | None
    peak_memory_bytes: int | None  # the fullest role at the real depth
    fits: bool
    compiled_layers: int  # the layer copies it was compiled with (and simulated as the real count)
    error: str | None = None


class SearchResult(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cluster: str
    devices: int
    layers: int
    enumerated: int  # strategies the model and devices allow
    estimated_fit: int  # of them, those that fit by the estimate
    rows: list[Row]
    seconds: float  # wall time of the search


@dataclass
class Outcome:
    result: SearchResult
    winner: Candidate | None = None
    plan: Plan | None = None  # the winner's simulated plan (compiled with ``result.rows[0].compiled_layers`` layers)
    layer_list: str | None = None  # the module path of the model's repeated layer ("h")


def model_shape(opts: SearchOptions) -> Shape:
    """The model's shape from its file's ``config(**sets)`` (examples/gpt.py has one)."""
    from sbpc.compiler.frontend.model_loader import call_user, load_model

    module = load_model(opts.model, opts.sets).module
    fn = getattr(module, "config", None)
    cfg = call_user(fn, opts.model, **opts.sets) if callable(fn) else None
    if not isinstance(cfg, dict) or any(not isinstance(cfg.get(k), int) for k in _SHAPE_KEYS):
        raise UsageError(f"sbpc search needs {opts.model} to define config(**kw) returning the ints "
                         + ", ".join(_SHAPE_KEYS), hint="examples/gpt.py's config() is the form; "
                                                       "its layer count is what --set layers= changes")
    return Shape(*(cfg[k] for k in _SHAPE_KEYS), batch=opts.batch_size, precision=opts.precision)


def _config(path: str | None) -> ParallelConfig | None:
    if path is None:
        return None
    from sbpc.compiler.frontend.hints import load_config

    cfg = load_config(path)
    if cfg.stages:
        raise UsageError(f"--config {path}: its [stages] table fixes a pipeline cut; the search chooses pp itself",
                         hint="pass a config with [params] and [modules] only (e.g. examples/gpt.megatron.toml)")
    return cfg


def layer_list(opts: SearchOptions, layers: int) -> str | None:
    """The module path of the model's repeated layer: its ``nn.ModuleList`` of ``layers`` items
    (built on the meta device: no memory)."""
    import torch

    from sbpc.compiler.frontend.model_loader import load_model

    with torch.device("meta"):
        model = load_model(opts.model, opts.sets).build()
    return next((name for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) == layers),
                None)


def compiled_depth(c: Candidate, layers: int) -> int:
    """The layer count a strategy is compiled with (module docstring)."""
    k = c.pp * c.virtual_stages if c.pp > 1 else 2
    return min(k, layers)


def with_stages(config: ParallelConfig | None, c: Candidate, layer_list: str | None, layers: int) -> ParallelConfig | None:
    """``config`` with the layers pinned evenly to the pipeline chunks (``[stages]``)."""
    chunks = c.pp * c.virtual_stages
    if chunks == 1 or layer_list is None:
        return config
    per = layers // chunks
    stages = [(f"{layer_list}.{i * per}-{(i + 1) * per - 1}", StageHint(i, "sbpc search")) for i in range(chunks)]
    return replace(config or ParallelConfig(), stages=stages)


def run_search(opts: SearchOptions, progress=lambda line: None) -> Outcome:
    t0 = time.perf_counter()
    shape = model_shape(opts)
    config = _config(opts.config_path)
    budget = opts.budget()
    mesh_list = opts.meshes if opts.meshes is not None else search_space.meshes(shape, opts.devices, opts.cluster.node.devices)
    if opts.meshes is not None:
        bad = [m for m in mesh_list if shape.heads % m[1] or shape.layers % m[2] or shape.batch % m[0]]
        if bad:
            dp, tp, pp = bad[0]
            raise UsageError(f"--meshes: {dp}x{tp}x{pp} does not fit the model: tp must divide the {shape.heads} heads, "
                             f"pp the {shape.layers} layers, dp the batch of {shape.batch}",
                             hint="drop it or pick sizes that divide them")
    candidates = search_space.enumerate_candidates(shape, mesh_list)
    if not candidates:
        raise UsageError(f"no strategy splits {shape.heads} heads, {shape.layers} layers and a batch of {shape.batch} "
                         f"over {opts.devices} devices", hint="try another --devices or --batch-size")
    scored = [(c, search_space.estimate(c, shape, opts.cluster, opts.attention)) for c in candidates]
    fitting = sum(e.memory_bytes <= budget for _, e in scored)
    order = search_space.shortlist(scored, budget)
    progress(f"{len(candidates)} strategies, {fitting} fit by the estimate; compiling the {opts.top} fastest")
    layers_of = layer_list(opts, shape.layers)
    compiled, done = [], 0
    for c, est in order:  # until ``top`` have compiled: one the compiler refuses is listed, and the next one tried
        if done == opts.top:
            break
        compiled.append((c, est, *_compile_and_simulate(c, est, shape, opts, config, layers_of, budget, progress)))
        done += compiled[-1][2].step_time_s is not None
    compiled.sort(key=lambda x: (x[2].step_time_s is None, not x[2].fits, x[2].step_time_s or 0.0))
    outcome = Outcome(result=SearchResult(cluster=opts.cluster.name, devices=opts.devices, layers=shape.layers,
                                          enumerated=len(candidates), estimated_fit=fitting, rows=[], seconds=0.0))
    outcome.layer_list = layers_of
    for rank, (c, _, row, plan) in enumerate(compiled, 1):
        outcome.result.rows.append(row.model_copy(update={"rank": rank}))
        if outcome.winner is None and row.fits and row.step_time_s is not None:
            outcome.winner, outcome.plan = c, plan
    outcome.result.seconds = time.perf_counter() - t0
    return outcome


def _compile_and_simulate(c: Candidate, est: search_space.Estimate, shape: Shape, opts: SearchOptions,
                          config: ParallelConfig | None, layers_of: str | None, budget: float, progress):
    pipeline = PipelineOptions(schedule=c.schedule, virtual_stages=c.virtual_stages, microbatches=c.microbatches)
    memory = MemoryOptions(zero=c.zero, recompute=c.recompute, precision=opts.precision)
    k = compiled_depth(c, shape.layers)
    base = dict(rank=0, mesh=c.mesh, micro_batch=c.micro_batch_size(shape.batch), microbatches=c.microbatches,
                schedule=c.schedule.value, virtual_stages=c.virtual_stages, zero=c.zero, recompute=c.recompute.value,
                estimate_s=est.seconds, compiled_layers=k)
    t = time.perf_counter()
    try:
        plan = compile_layers(opts.model, opts.sets, k, c.mesh, batch_size=shape.batch, pipeline=pipeline, memory=memory,
                              config=with_stages(config, c, layers_of, k), quiet=True)
        sim = simulate(plan, opts.cluster, attention=opts.attention, attention_dropout=opts.attention_dropout,
                       layers=shape.layers if k != shape.layers else None)
    except SbpcError as err:  # the model cannot take this strategy after all; the table says why
        progress(f"  {_label(c)}: did not compile: {err.message}")
        return Row(**base, step_time_s=None, tflops_per_device=None, mfu=None, peak_memory_bytes=None, fits=False,
                   error=err.message), None
    roles = plan.estimates.roles if k == shape.layers or layers_of is None else \
        extrapolate_memory(plan, shape.layers, layers_of, search_space.layer_activation_bytes(c, shape))
    peak = max(r.total for r in roles)
    progress(f"  {_label(c)}: {_time(sim.step_time_s)} simulated, {size_text(peak)} ({time.perf_counter() - t:.1f} s)")
    return Row(**base, step_time_s=sim.step_time_s, tflops_per_device=sim.tflops_per_device, mfu=sim.mfu,
               peak_memory_bytes=peak, fits=peak <= budget), plan


def _label(c: Candidate) -> str:
    return f"{c.mesh} m={c.microbatches} {c.schedule.value} zero={c.zero} recompute={c.recompute.value}"


def table_text(r: SearchResult) -> str:
    head = (f"{'rank':>4} {'mesh dxtxp':>10} {'mb size':>7} {'mbs':>4} {'schedule':>11} {'zero':>4} {'recompute':>9} "
            f"{'step s':>8} {'TFLOP/s':>7} {'MFU':>6} {'peak mem':>9} {'fits':>4}")
    lines = [head]
    for row in r.rows:
        sched = row.schedule + (f"/{row.virtual_stages}" if row.virtual_stages > 1 else "")
        if row.step_time_s is None:
            tail = f"did not compile: {row.error}"
        else:
            tail = (f"{_time(row.step_time_s):>8} {row.tflops_per_device:>7.1f} {row.mfu:>6.1%} "
                    f"{size_text(row.peak_memory_bytes):>9} {'yes' if row.fits else 'NO':>4}")
        lines.append(f"{row.rank:>4} {row.mesh:>10} {row.micro_batch:>7} {row.microbatches:>4} {sched:>11} {row.zero:>4} "
                     f"{row.recompute:>9} {tail}")
    simulated = sum(row.step_time_s is not None for row in r.rows)
    lines.append(f"{r.enumerated} strategies enumerated, {r.estimated_fit} fit by the estimate, {len(r.rows)} compiled, "
                 f"{simulated} simulated on {r.cluster} for {r.layers} layers in {r.seconds:.1f} s")
    return "\n".join(lines)


def _time(seconds: float) -> str:
    return f"{seconds:.3f} s" if seconds >= 1 else f"{seconds * 1e3:.2f} ms"


def config_toml(c: Candidate, opts: SearchOptions, command: str, layer_list: str | None, layers: int) -> str:
    """The winner as a parallel config `sbpc compile --config` reads: the base config's
    [params] and [modules] hints, the even cut of the ``layers`` layers into pipeline chunks
    that was simulated ([stages]), the [pipeline] and [memory] tables. The mesh and the batch
    size are flags (``command``, in the header)."""
    raw = {}
    if opts.config_path is not None:
        with open(opts.config_path, "rb") as f:
            raw = tomllib.load(f)
    lines = [f"# sbpc search's choice for {opts.model} on {opts.devices} devices of {opts.cluster.name}.",
             f"# Reproduce: {command}", ""]
    for table in ("params", "modules"):
        if raw.get(table):
            lines.append(f"[{table}]")
            lines += [f"{json.dumps(glob)} = {{ " + ", ".join(f"{axis} = {json.dumps(sbp)}" for axis, sbp in axes.items())
                      + " }" for glob, axes in raw[table].items()]
            lines.append("")
    staged = with_stages(None, c, layer_list, layers)
    if staged is not None:
        lines += ["[stages]", *(f'"{glob}" = {hint.chunk}' for glob, hint in staged.stages), ""]
    lines += ["[pipeline]", f"microbatches = {c.microbatches}", f'schedule = "{c.schedule.value}"']
    if c.virtual_stages > 1:
        lines.append(f"virtual_stages = {c.virtual_stages}")
    lines += ["", "[memory]", f"zero = {c.zero}", f'recompute = "{c.recompute.value}"',
              f'precision = "{opts.precision.value}"', ""]
    return "\n".join(lines)


def compile_command(c: Candidate, opts: SearchOptions, config_out: str) -> str:
    sets = "".join(f" --set {k}={v}" for k, v in opts.sets.items())
    return f"sbpc compile {opts.model}{sets} --mesh {c.mesh} --batch-size {opts.batch_size} --config {config_out}"
