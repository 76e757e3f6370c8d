"""lower: turn the verified logical IR into the physical plan (pydantic, JSON).

Each stage's nodes become that stage's SPMD program; every instruction lists the values that
die after it, so the runtime frees memory as it goes.
"""
from __future__ import annotations

import math

from sbpc import __version__
from sbpc.compiler.ir.types import DTYPES, DType, Graph, InputKind, Node, OutputKind, Ref, StateName, Sym
from sbpc.compiler.passes.offload import MASTER
from sbpc.compiler.ir.mesh import MICROBATCH
from sbpc.runtime.precision import LOSS_SCALE
from sbpc.compiler.frontend.optim import OptimizerConfig
from sbpc.compiler.pass_manager import Fact
from sbpc.compiler.passes.memory_plan import last_uses
from sbpc.runtime import plan as P
from sbpc.runtime.backend import FUSED_ADAMW
from sbpc.runtime.sbp import local_shape

NEEDS = (Fact.ESTIMATES,)  # what the passes before lowering must provide (pass_manager)


def lower(graph: Graph, model: P.ModelRef, optimizer: OptimizerConfig, estimates: dict[str, int],
          precision: P.PrecisionSpec = P.PrecisionSpec()) -> P.Plan:
    dies = last_uses(graph)
    spell = _Spelling(graph.mesh)
    dev, mb = spell.sbp, spell.mb
    by_stage: dict[int | None, list[P.Instruction]] = {}  # one walk of the program, not one per stage
    for i, n in enumerate(graph.nodes):
        by_stage.setdefault(n.stage, []).append(_instr(n, dies.get(i, []), spell))
    loss = graph.outputs_of(OutputKind.LOSS)[0].value
    programs = [P.StageProgram(stage=s, loss=loss, instructions=by_stage[s]) for s in sorted(by_stage)]
    grad = {o.name: o.value for o in graph.outputs_of(OutputKind.GRAD)}
    update = {o.name: o.value for o in graph.outputs_of(OutputKind.UPDATE)}
    spec = lambda i: dict(name=i.name, value=i.value, shape=list(i.type.shape), dtype=DTYPES[i.type.dtype],
                          sbp=dev(i.sbp or ()), why=i.why, memory=i.memory)
    split = lambda i: repr(i.sbp[mb]) if mb is not None and i.sbp else None
    param_shape = {i.name: list(i.type.shape) for i in graph.inputs_of(InputKind.PARAM)}
    # a state of its parameter's rank but another shape is ZeRO-padded (compiler/passes/zero.py)
    unpadded = lambda i: {"unpadded": param_shape[i.state_of]} if i.state_of in param_shape and \
        len(param_shape[i.state_of]) == len(i.type.shape) and param_shape[i.state_of] != list(i.type.shape) else {}
    return P.Plan(
        sbpc_version=__version__,
        model=model,
        mesh=[P.MeshAxis(name=n, size=s) for n, s in graph.mesh.device_axes],
        stages=programs,
        params=[P.ParamSpec(**spec(i), grad=grad[i.name], update=update[i.name]) for i in graph.inputs_of(InputKind.PARAM)],
        buffers=[P.BufferSpec(**spec(i), update=update.get(i.name)) for i in graph.inputs_of(InputKind.BUFFER)],
        states=[P.StateSpec(**spec(i), update=update[i.name], **_state_init(i), **unpadded(i))
                for i in graph.inputs_of(InputKind.STATE)],
        batch=[P.TensorSpec(**spec(i), microbatch=split(i)) for i in graph.inputs_of(InputKind.BATCH)],
        hyper=[P.TensorSpec(**spec(i)) for i in graph.inputs_of(InputKind.HYPER)],
        metrics={o.name: o.value for o in graph.outputs_of(OutputKind.METRIC)},
        init=P.InitProgram(instructions=[_instr(n, [], spell) for n in graph.init],
                           outputs={o.name: o.value for o in graph.init_outputs}),
        optimizer=P.OptimizerSpec(kind=optimizer.kind, lr=optimizer.lr, betas=optimizer.betas, eps=optimizer.eps,
                                  weight_decay=optimizer.weight_decay, momentum=optimizer.momentum,
                                  clip_grad=optimizer.clip_grad,
                                  fused=any(n.op == FUSED_ADAMW for n in graph.nodes)),
        estimates=P.Estimates(**estimates),
        pipeline=graph.schedule,
        precision=precision,
    )


class _Spelling:
    """The plan's spelling of an nd-SBP, a value's type and a source location, memoized: the 1T
    program has ~100k results and ~45k instructions but a few hundred distinct types, and
    building (validating) a pydantic model per occurrence was most of the lowering. Plan models
    are frozen, so one instance stands wherever its value recurs."""

    def __init__(self, mesh):
        # the micro-batch axis is the compiler's: plan SBPs name device axes only, and a batch
        # input says separately how micro-batches split it
        axes = mesh.sbp_axes
        self.mb = axes.index(MICROBATCH) if MICROBATCH in axes else None
        self.microbatches = mesh.microbatches
        self._sbp: dict[tuple, tuple[str, ...]] = {}
        self._types: dict[tuple, P.ValueType] = {}
        self._locs: dict[object, P.SourceLoc] = {}

    def sbp(self, nd) -> list[str]:
        """One ``repr`` per device axis (a new list each call: a caller may keep it)."""
        key = tuple(nd)
        spelled = self._sbp.get(key)
        if spelled is None:
            spelled = self._sbp[key] = tuple(repr(s) for a, s in enumerate(key) if a != self.mb)
        return list(spelled)

    def value_type(self, t, nd) -> P.ValueType:
        key = (t, tuple(nd))
        vt = self._types.get(key)
        if vt is None:
            # the runtime only sees one micro-batch at a time: plan shapes are a micro-batch's
            shape = local_shape(t.shape, (nd[self.mb],), (self.microbatches,)) if self.mb is not None and nd else t.shape
            vt = self._types[key] = P.ValueType(shape=list(shape), dtype=t.dtype, sbp=self.sbp(nd))
        return vt

    def loc(self, loc) -> P.SourceLoc | None:
        if loc is None:
            return None
        spelled = self._locs.get(loc)
        if spelled is None:
            spelled = self._locs[loc] = P.SourceLoc(module=loc.module, file=loc.file, line=loc.line)
        return spelled


def _state_init(i) -> dict:
    """How the runtime fills an optimizer state before the first step."""
    if i.name == LOSS_SCALE:
        return {"init": "loss_scale"}
    name = StateName.parse(i.name)
    if name.state == MASTER:  # the offloaded optimizer's copy of its parameter
        return {"init": "param", "copies": name.param}
    return {"init": "zeros"}


def _instr(n: Node, free: list[str], spell: _Spelling) -> P.Instruction:
    """Built without pydantic's validation (``model_construct``): every field is already of its
    type here (the verified IR, ``encode_arg``, ``_Spelling``'s models), validating ~43k
    instructions was half the 1T lowering, and ``load_plan`` validates the whole file. The
    plan -> JSON -> plan round trip of every example checks it (``tests/test_roundtrip.py``)."""
    sbps = n.sbp or [()] * len(n.outputs)
    return P.Instruction.model_construct(op=n.op, args=[encode_arg(a) for a in n.args],
                                         kwargs={k: encode_arg(v) for k, v in n.kwargs.items()},
                                         outs=list(n.outputs),
                                         types=[spell.value_type(t, nd) for t, nd in zip(n.types, sbps)],
                                         free=free, role=n.role.value, stage=n.stage, loc=spell.loc(n.loc),
                                         sbp_in=[spell.sbp(nd) for nd in n.sbp_in] if n.sbp_in is not None else None,
                                         why=n.why, memory=n.memory)


def encode_arg(a):
    if isinstance(a, Ref):
        return P.RefArg(ref=a.name)
    if isinstance(a, DType):
        return P.DTypeArg(dtype=DTYPES[a.name])
    if isinstance(a, Sym):
        return P.SymArg(sym=a.name)
    if isinstance(a, float) and not math.isfinite(a):
        return P.FloatArg(float=str(a))
    if isinstance(a, complex):
        return P.ComplexArg(complex=(repr(a.real), repr(a.imag)))
    if isinstance(a, (list, tuple)):
        return [encode_arg(x) for x in a]
    return a
