"""Raise a physical plan back to the logical IR, so `sbpc inspect` can print it as text IR.

Lowering keeps every type, SBP, stage and source location in the plan, so nothing is lost:
raising the plan of a compile gives the graph that compile lowered.
"""
from __future__ import annotations


from sbpc.compiler.ir.types import DTYPE_BY_TORCH_NAME, DType, Graph, GraphInput, GraphOutput, InputKind, Node, \
    OutputKind, Ref, Role, SourceLoc, Sym, TensorType
from sbpc.compiler.ir.mesh import Mesh
from sbpc.runtime.sbp import parse_sbp
from sbpc.runtime import plan as P
from sbpc.runtime.model_file import model_name


def raise_plan(plan: P.Plan) -> Graph:
    mesh = Mesh(tuple((a.name, a.size) for a in plan.mesh))
    inputs = [_input(InputKind.PARAM, s) for s in plan.params] + [_input(InputKind.BUFFER, s) for s in plan.buffers]
    inputs += [_input(InputKind.STATE, s) for s in plan.states] + [_input(InputKind.BATCH, s) for s in plan.batch]
    inputs += [_input(InputKind.HYPER, s) for s in plan.hyper]
    nodes = [_node(i) for st in plan.stages for i in st.instructions]
    outputs = [GraphOutput(OutputKind.LOSS, plan.stages[0].loss, "loss")]
    outputs += [GraphOutput(OutputKind.GRAD, p.grad, p.name) for p in plan.params]
    outputs += [GraphOutput(OutputKind.UPDATE, s.update, s.name) for s in [*plan.params, *plan.written_buffers, *plan.states]]
    outputs += [GraphOutput(OutputKind.METRIC, v, name) for name, v in plan.metrics.items()]
    return Graph(name=model_name(plan.model.path), mesh=mesh, inputs=inputs, nodes=nodes, outputs=outputs,
                 init=[_node(i) for i in plan.init.instructions],
                 init_outputs=[GraphOutput(OutputKind.INIT, v, k) for k, v in plan.init.outputs.items()],
                 schedule=plan.pipeline)


def _input(kind: InputKind, s: P.TensorSpec) -> GraphInput:
    sbp = tuple(parse_sbp(x) for x in s.sbp) if s.sbp else None
    return GraphInput(kind, s.value, TensorType(tuple(s.shape), DTYPE_BY_TORCH_NAME[s.dtype]), s.name, sbp, s.why,
                      memory=s.memory)


def _node(i: P.Instruction) -> Node:
    has_sbp = any(t.sbp for t in i.types)
    return Node(
        outputs=list(i.outs), op=i.op, args=tuple(decode_arg(a) for a in i.args),
        kwargs={k: decode_arg(v) for k, v in i.kwargs.items()},
        types=[TensorType(tuple(t.shape), t.dtype) for t in i.types], role=Role(i.role),
        loc=SourceLoc(i.loc.module, i.loc.file, i.loc.line) if i.loc else None, stage=i.stage,
        sbp=[tuple(parse_sbp(x) for x in t.sbp) for t in i.types] if has_sbp else None,
        sbp_in=[tuple(parse_sbp(x) for x in nd) for nd in i.sbp_in] if i.sbp_in is not None else None, why=i.why,
        memory=i.memory,
    )


def decode_arg(a):
    if isinstance(a, P.RefArg):
        return Ref(a.ref)
    if isinstance(a, P.DTypeArg):
        return DType(DTYPE_BY_TORCH_NAME[a.dtype])
    if isinstance(a, P.SymArg):
        return Sym(a.sym)
    if isinstance(a, P.FloatArg):
        return float(a.float)
    if isinstance(a, P.ComplexArg):
        return P.complex_value(a)
    if isinstance(a, list):
        return [decode_arg(x) for x in a]
    return a
