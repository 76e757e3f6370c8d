"""The physical plan: what the compiler writes and the runtime executes.

Pydantic models, serialised to JSON, with a ``schema_version``. A plan holds one SPMD program
per pipeline stage; all ranks of a stage run the same program, parameterised by their mesh
coordinates. The rank map is derived from the mesh axes (``rank_order``), so the plan's size
never grows with the number of devices.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Literal, Union

from typing_extensions import TypeAliasType

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sbpc.errors import PlanError
from sbpc.runtime.files import write_atomic
from sbpc.runtime.kinds import MemoryKind, Precision, ScheduleName

SCHEMA_VERSION = 3
LR = "lr"  # the name of the learning rate input (``Plan.hyper``)
GRAD_NORM = "grad_norm"  # the global gradient norm (``Plan.metrics``; computed under --clip-grad)

DTYPES = {
    "f64": "float64", "f32": "float32", "f16": "float16", "bf16": "bfloat16",
    "i64": "int64", "i32": "int32", "i16": "int16", "i8": "int8", "u8": "uint8", "bool": "bool",
    "c64": "complex64",
    "none": "none",  # an absent optional result of an op (e.g. an unneeded gradient)
    "work": "work",  # a collective in flight: what sbpc.issue returns and sbpc.wait consumes
}


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RefArg(_Model):
    ref: str


class DTypeArg(_Model):
    dtype: str


class SymArg(_Model):
    sym: str  # "device" (the runtime's device), a layout or a memory format


class FloatArg(_Model):
    float: Literal["inf", "-inf", "nan"]  # JSON has no spelling for these


class ComplexArg(_Model):
    complex: tuple[str, str]  # the real and imaginary parts, each as Python's repr: exact, and inf/nan too


def complex_value(a: ComplexArg) -> complex:
    return complex(float(a.complex[0]), float(a.complex[1]))


Arg = TypeAliasType("Arg", Union[RefArg, DTypeArg, SymArg, FloatArg, ComplexArg, bool, int, float, str, None,
                                 list["Arg"]])


class ValueType(_Model):
    shape: list[int]
    dtype: str  # short IR name, e.g. "f32"
    sbp: list[str] = Field(default_factory=list)  # one entry per non-pp mesh axis, e.g. ["S(0)", "B"]


class SourceLoc(_Model):
    module: str
    file: str
    line: int

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}"
        return f"{self.module} @ {where}" if self.module else where


class Instruction(_Model):
    op: str
    args: list[Arg] = Field(default_factory=list)
    kwargs: dict[str, Arg] = Field(default_factory=dict)
    outs: list[str] = Field(default_factory=list)
    types: list[ValueType] = Field(default_factory=list)  # one per out
    free: list[str] = Field(default_factory=list)  # values whose last use is this instruction
    role: Literal["pre", "fwd", "bwd", "opt", "init"]
    stage: int | None = None
    loc: SourceLoc | None = None  # the user's module and line, for error messages
    sbp_in: list[list[str]] | None = None  # the nd-SBP it receives of each tensor input
    why: str | None = None  # how the compiler chose its SBP (`sbpc explain`)
    memory: MemoryKind = MemoryKind.DEVICE  # where its results live (host: the offloaded optimizer)


class TensorSpec(_Model):
    name: str  # param/buffer FQN, "exp_avg:<param>", "step", "batch.<i>" or "lr"
    value: str  # the program value it binds to
    shape: list[int]
    dtype: str  # torch dtype name, e.g. "float32"
    sbp: list[str] = Field(default_factory=list)  # one entry per non-pp mesh axis
    why: str | None = None  # where its SBP came from (`sbpc explain`)
    microbatch: str | None = None  # batch inputs of a pipelined plan: how micro-batches split it ("S(0)")
    memory: MemoryKind = MemoryKind.DEVICE  # where the runtime holds it between steps


class ParamSpec(TensorSpec):
    grad: str  # the value holding its gradient
    update: str  # the value holding its new value after the optimizer


class BufferSpec(TensorSpec):
    # the value holding its new value after the step's forward (BatchNorm's running statistics),
    # kept as the buffer for the next step; None: the step never writes it
    update: str | None = None


class StateSpec(TensorSpec):
    update: str
    init: Literal["zeros", "loss_scale", "param"] = "zeros"  # loss_scale: filled with precision.loss_scaling.init_scale
    copies: str | None = None  # init "param": the parameter whose value it starts as (an offloaded master copy)
    # ZeRO on a dp that divides none of its parameter's dims (compiler/passes/zero.py): the state
    # is its parameter's tensor zero-padded to ``shape``; this is the parameter's shape, what the
    # runtime hands out (``logical_states``) and an init "param" copy is padded from. None: ``shape``
    unpadded: list[int] | None = None


class StageProgram(_Model):
    stage: int
    instructions: list[Instruction]
    loss: str


class TaskRef(_Model):
    """One firing of a pipeline actor: a chunk's phase for one micro-batch (None: once a step)."""
    chunk: int
    phase: Literal["pre", "fwd", "bwd", "opt"]
    mb: int | None = None
    part: int = 0  # of the once-a-step phase (see runtime.pipeline_tasks)


class ReplicaUpdate(_Model):
    """A parameter a chunk uses but does not own (a tied weight): its new value arrives by a
    transfer from the owner's optimizer."""
    chunk: int
    name: str  # the parameter's FQN
    value: str  # the transferred new value on this chunk


class PipelineSpec(_Model):
    """How the stage programs run as a pipeline: micro-batches, the per-device firing order
    (derived and proved deadlock-free by the compiler), and the activation regst counts."""
    schedule: ScheduleName
    microbatches: int
    stages: int  # pp: device stages; chunk c runs on stage c % stages
    virtual_stages: int  # chunks per device stage
    in_flight: list[int]  # per device stage: micro-batches whose activations wait for backward
    order: list[list[TaskRef]]  # per device stage, the order its actors fire in
    replicas: list[ReplicaUpdate] = Field(default_factory=list)
    bubble: float = 0.0  # idle fraction of the step in the compiler's simulation


class InitProgram(_Model):
    instructions: list[Instruction]
    outputs: dict[str, str]  # param/buffer FQN -> value


class MeshAxis(_Model):
    name: str
    size: int


class ModelRef(_Model):
    path: str
    sets: dict[str, Union[bool, int, float, str, None, list]] = Field(default_factory=dict)
    batch_size: int
    # the keyword names forward() takes the batch inputs by (example_batch returned a mapping);
    # empty: positional (runtime/model_file.batch_tuple)
    batch_keys: list[str] = Field(default_factory=list)


class OptimizerSpec(_Model):
    kind: Literal["adamw", "sgd"]
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    momentum: float
    clip_grad: float | None = None  # the gradients are clipped by their global norm to this
    # the update is torch's fused AdamW kernel (compiler pass fuse-adamw): `sbpc check` compares it
    # with AdamW(fused=True), which runs the same kernel, not with the single-tensor algorithm
    fused: bool = False


class RoleMemory(_Model):
    """The memory of one rank role (a pp stage: its dp x tp ranks hold equal shards), in bytes
    per device at the role's peak moment of a step. The columns add up to ``total``."""
    role: str  # "stage 0"
    stage: int
    ranks: int  # devices that play this role
    params: int  # parameters and model buffers (always live), and the new parameters the update wrote
    grads: int  # gradients live at the peak (accumulators, buckets, reduced gradients)
    optimizer: int  # optimizer state (always live), and new state the update wrote
    activations: int  # forward values (and batch shards) live at the peak, all micro-batches in flight
    buffers: int  # results of collectives and transfers live inside the running task
    temporaries: int  # everything else live at the peak: backward intermediates, the update's own
    total: int  # on the device; the columns above add up to it
    host: int = 0  # host memory at the step's peak there (--offload optimizer: state, master copy, update)
    peak_at: str  # the task whose run holds the peak ("F0.3", "B1.0", "U0", "step")
    in_flight: int  # micro-batches whose values are held at the peak
    param_bytes: int  # the step's whole model state of this role: parameters,
    grad_bytes: int  # gradients (as the optimizer reads them),
    optimizer_bytes: int  # and optimizer state


class LossScaling(_Model):
    """fp16's dynamic loss scaling, with torch.amp.GradScaler's defaults: the loss is multiplied
    by the scale before the backward, the gradients unscaled; a step whose gradients hold an inf
    or nan is skipped and the scale multiplied by ``backoff_factor``; after ``growth_interval``
    steps without one it is multiplied by ``growth_factor``."""
    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000


class PrecisionSpec(_Model):
    """The compute precision; parameters (master weights) and optimizer state are always fp32."""
    compute: Precision = Precision.FP32
    loss_scaling: LossScaling | None = None  # fp16 only


class Estimates(_Model):
    param_count: int
    param_bytes: int
    grad_bytes: int
    optimizer_state_bytes: int
    peak_activation_bytes: int  # live values of one step, from the program's liveness
    instructions: int
    roles: list[RoleMemory] = Field(default_factory=list)  # per rank role, with the pipeline's in-flight micro-batches


class Plan(_Model):
    schema_version: int = SCHEMA_VERSION
    sbpc_version: str
    model: ModelRef
    mesh: list[MeshAxis]  # rank order: outermost axis first
    stages: list[StageProgram]
    params: list[ParamSpec]
    buffers: list[BufferSpec]
    states: list[StateSpec]
    batch: list[TensorSpec]
    # per-step scalar inputs the runtime fills each step: "lr", the learning rate (f64[], B);
    # ``Runner.step(lr=)`` gives it, ``optimizer.lr`` when not
    hyper: list[TensorSpec] = Field(default_factory=list)
    # numbers of the step the runtime reports, name -> value: "grad_norm", the global norm of the
    # gradients before clipping (``StepResult.grad_norm``)
    metrics: dict[str, str] = Field(default_factory=dict)
    init: InitProgram
    optimizer: OptimizerSpec
    estimates: Estimates
    pipeline: PipelineSpec | None = None  # None: one stage, one micro-batch
    precision: PrecisionSpec = Field(default_factory=PrecisionSpec)
    # sha256 of the rest of the plan, set by save_plan and checked by load_plan: the compiler
    # verified what it wrote, and a hand edit (a mesh size, a shape) could run and compute
    # something else without any error. None: unsigned, run as it is (delete the field to run
    # an edited plan on purpose). The last field: save_plan appends it to the serialized rest.
    digest: str | None = None

    def content_digest(self) -> str:
        return _sha256(self.model_dump_json(exclude={"digest"}))

    @property
    def written_buffers(self) -> list[BufferSpec]:
        """The buffers the step's forward writes (BatchNorm's running statistics)."""
        return [b for b in self.buffers if b.update is not None]

    @property
    def world_size(self) -> int:
        return math.prod(a.size for a in self.mesh)

    def coords(self, rank: int) -> dict[str, int]:
        return mesh_coords([(a.name, a.size) for a in self.mesh], rank)


def mesh_coords(axes: list[tuple[str, int]], rank: int) -> dict[str, int]:
    """Mesh coordinates of ``rank``; ``axes`` in rank order, outermost first (row-major)."""
    out: dict[str, int] = {}
    for name, size in reversed(axes):
        out[name] = rank % size
        rank //= size
    return {name: out[name] for name, _ in axes}


def save_plan(plan: Plan, path: str) -> None:
    """Writes ``plan`` signed with its digest. The plan is serialized once (a 1T plan's JSON is
    21 MB, 0.25 s a dump): ``digest`` is the model's last field, so the signed text is the
    unsigned one with it appended."""
    body = plan.model_dump_json(exclude={"digest"})  # what content_digest hashes
    write_atomic(path, f'{body[:-1]},"digest":{json.dumps(_sha256(body))}}}')


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def load_plan(path: str) -> Plan:
    if not os.path.isfile(path):
        raise PlanError(f"plan file {path!r} does not exist", hint="compile one with: sbpc compile MODEL -o plan.json")
    with open(path) as f:
        text = f.read()
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as err:
        raise PlanError(f"plan {path} is not valid JSON: {err.msg}", location=f"{path}:{err.lineno}:{err.colno}",
                        hint="the file is corrupt or truncated; recompile it with sbpc compile") from err
    version = raw.get("schema_version") if isinstance(raw, dict) else None
    if version != SCHEMA_VERSION:
        raise PlanError(f"plan {path} has schema_version {version!r}, this sbpc reads version {SCHEMA_VERSION}",
                        hint="recompile the plan with this version of sbpc")
    try:
        plan = Plan.model_validate(raw)
    except ValidationError as err:
        raise PlanError(f"plan {path} is malformed at {first_problem(err)}",
                        hint="the file was edited or corrupted; recompile it with sbpc compile") from err
    if plan.digest is not None and plan.digest != plan.content_digest():
        raise PlanError(f"plan {path} was changed after sbpc wrote it: its content does not match its digest",
                        hint="recompile it with sbpc compile (to run an edited plan anyway, delete its \"digest\" field)")
    return plan


def first_problem(err: ValidationError) -> str:
    """Where a JSON file fails its pydantic model and why, for a one-line error: "a.b.0: msg"."""
    first = err.errors()[0]
    return ".".join(str(p) for p in first["loc"]) + f": {first['msg']}"
