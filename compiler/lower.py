"""lower: turn the verified logical IR into the physical plan (pydantic, JSON).

Each stage's nodes become that stage's SPMD program; every instruction lists the values that
die after it, so the runtime frees memory as it goes.
"""
from __future__ import annotations

import math

from sbpc import __version__
from sbpc.compiler.ir.types import DTYPES, DType, Graph, InputKind, Node, OutputKind, Ref, Sym
from sbpc.compiler.optim import OptimizerConfig
from sbpc.compiler.passes.memory_plan import last_uses
from sbpc.runtime import plan as P


def lower(graph: Graph, model: P.ModelRef, optimizer: OptimizerConfig, estimates: dict[str, int]) -> P.Plan:
    dies = last_uses(graph)
    stages = sorted({n.stage for n in graph.nodes})
    programs = [P.StageProgram(stage=s, loss=graph.outputs_of(OutputKind.LOSS)[0].value,
                               instructions=[_instr(n, dies.get(i, [])) for i, n in enumerate(graph.nodes) if n.stage == s])
                for s in stages]
    grad = {o.name: o.value for o in graph.outputs_of(OutputKind.GRAD)}
    update = {o.name: o.value for o in graph.outputs_of(OutputKind.UPDATE)}
    spec = lambda i: dict(name=i.name, value=i.value, shape=list(i.type.shape), dtype=DTYPES[i.type.dtype],
                          sbp=[repr(s) for s in (i.sbp or ())], why=i.why)
    return P.Plan(
        sbpc_version=__version__,
        model=model,
        mesh=[P.MeshAxis(name=n, size=s) for n, s in graph.mesh.axes],
        stages=programs,
        params=[P.ParamSpec(**spec(i), grad=grad[i.name], update=update[i.name]) for i in graph.inputs_of(InputKind.PARAM)],
        buffers=[P.TensorSpec(**spec(i)) for i in graph.inputs_of(InputKind.BUFFER)],
        states=[P.StateSpec(**spec(i), update=update[i.name]) for i in graph.inputs_of(InputKind.STATE)],
        batch=[P.TensorSpec(**spec(i)) for i in graph.inputs_of(InputKind.BATCH)],
        init=P.InitProgram(instructions=[_instr(n, []) for n in graph.init],
                           outputs={o.name: o.value for o in graph.init_outputs}),
        optimizer=P.OptimizerSpec(kind=optimizer.kind, lr=optimizer.lr, betas=optimizer.betas, eps=optimizer.eps,
                                  weight_decay=optimizer.weight_decay, momentum=optimizer.momentum),
        estimates=P.Estimates(**estimates),
    )


def _instr(n: Node, free: list[str]) -> P.Instruction:
    sbps = n.sbp or [()] * len(n.outputs)
    types = [P.ValueType(shape=list(t.shape), dtype=t.dtype, sbp=[repr(s) for s in nd]) for t, nd in zip(n.types, sbps)]
    loc = P.SourceLoc(module=n.loc.module, file=n.loc.file, line=n.loc.line) if n.loc else None
    return P.Instruction(op=n.op, args=[encode_arg(a) for a in n.args],
                         kwargs={k: encode_arg(v) for k, v in n.kwargs.items()},
                         outs=list(n.outputs), types=types, free=free, role=n.role.value, stage=n.stage, loc=loc,
                         sbp_in=[[repr(s) for s in nd] for nd in n.sbp_in] if n.sbp_in is not None else None,
                         why=n.why)


def encode_arg(a):
    if isinstance(a, Ref):
        return P.RefArg(ref=a.name)
    if isinstance(a, DType):
        return P.DTypeArg(dtype=DTYPES[a.name])
    if isinstance(a, Sym):
        return P.SymArg(sym=a.name)
    if isinstance(a, float) and not math.isfinite(a):
        return P.FloatArg(float=str(a))
    if isinstance(a, (list, tuple)):
        return [encode_arg(x) for x in a]
    return a
