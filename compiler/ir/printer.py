"""Print a ``Graph`` as text IR; ``sbpc.compiler.ir.parser`` reads it back to an equal Graph.

The format, one line per input, node and output (the grammar is ``ir_specs/ir.lark``)::

    graph @gpt mesh<dp=2, tp=2> {
      input param %w : f32[256, 64] "wte.weight" {sbp=[B, S(0)]}
      %y = aten.mm.default(%x, %w) : f32[4, 64] {role=fwd, stage=0, sbp=[[S(0), B]], loc="h.0" @ "gpt.py":48}
      %a, %b = aten.max.dim(%y, 1) : (f32[4], i64[4]) {role=fwd}
      %g = sbpc.to_host(%d) : f32[64] {role=opt, stage=0, mem=host, sbp=[[B, B]], sbp_in=[[B, B]]}
      output loss %l "loss"
    }
    init {
      aten.normal_.default(%i0, 0.0, 0.02) {role=init}
      output init %i0 "wte.weight"
    }

Arguments are ints, floats (``repr``, or ``inf``/``-inf``/``nan``), complex numbers
(``complex(re, im)``, each part a float), ``True``/``False``/``None``,
JSON strings, lists, ``%value`` refs, bare dtype names (``f32``) and ``#symbols``. A python
tuple inside the arguments prints as a list and so parses back as a list: the IR builder
only makes lists, and the text has one spelling per value. Strings use JSON escaping.
"""
from __future__ import annotations

import json
import math
from typing import Any

from sbpc.compiler.ir.types import DType, Graph, GraphInput, GraphOutput, Node, Ref, Sym
from sbpc.runtime.kinds import MemoryKind
from sbpc.runtime.sbp import NdSbp, format_nd_sbp
from sbpc.errors import IRError


def print_graph(graph: Graph) -> str:
    axes = ", ".join(f"{n}={s}" for n, s in graph.mesh.axes)
    rowwise = " rowwise<" + ", ".join(json.dumps(m) for m in graph.rowwise) + ">" if graph.rowwise else ""
    lines = [f"graph @{graph.name} mesh<{axes}>{rowwise} {{"]
    lines += [f"  {format_input(i)}" for i in graph.inputs]
    lines += [f"  {format_node(n)}" for n in graph.nodes]
    lines += [f"  {format_output(o)}" for o in graph.outputs]
    lines.append("}")
    if graph.init or graph.init_outputs:
        lines.append("init {")
        lines += [f"  {format_node(n)}" for n in graph.init]
        lines += [f"  {format_output(o)}" for o in graph.init_outputs]
        lines.append("}")
    if graph.schedule is not None:
        lines.append(f"schedule {json.dumps(graph.schedule.model_dump_json())}")
    return "\n".join(lines) + "\n"


def format_input(i: GraphInput) -> str:
    text = f"input {i.kind.value} %{i.value} : {i.type} {json.dumps(i.name)}"
    attrs = [] if i.sbp is None else [f"sbp={format_nd_sbp(i.sbp)}"]
    if i.memory != MemoryKind.DEVICE:
        attrs.append(f"mem={i.memory.value}")
    return f"{text} {{{', '.join(attrs)}}}" if attrs else text


def format_output(o: GraphOutput) -> str:
    return f"output {o.kind.value} %{o.value} {json.dumps(o.name)}"


def format_node(n: Node) -> str:
    args = [format_arg(a) for a in n.args]
    args += [f"{k}={format_arg(v)}" for k, v in n.kwargs.items()]
    text = f"{n.op}({', '.join(args)})"
    if n.outputs:
        text = f"{', '.join('%' + o for o in n.outputs)} = {text}"
    if len(n.types) == 1:
        text += f" : {n.types[0]}"
    elif n.types:
        text += f" : ({', '.join(map(str, n.types))})"
    return f"{text} {{{format_attrs(n)}}}"


def format_attrs(n: Node) -> str:
    attrs = [f"role={n.role.value}"]
    if n.stage is not None:
        attrs.append(f"stage={n.stage}")
    if n.memory != MemoryKind.DEVICE:  # the default placement's memory is not printed
        attrs.append(f"mem={n.memory.value}")
    if n.sbp is not None:
        attrs.append(f"sbp={_sbp_list(n.sbp)}")
    if n.sbp_in is not None:
        attrs.append(f"sbp_in={_sbp_list(n.sbp_in)}")
    if n.loc is not None:
        attrs.append(f"loc={json.dumps(n.loc.module)} @ {json.dumps(n.loc.file)}:{n.loc.line}")
    return ", ".join(attrs)


def _sbp_list(sbps: list[NdSbp]) -> str:
    return "[" + ", ".join(format_nd_sbp(nd) for nd in sbps) + "]"


def format_arg(a: Any) -> str:
    # bool before int: True is an int to isinstance.
    if a is None or a is True or a is False:
        return str(a)
    if isinstance(a, int):
        return int.__repr__(a)  # not str(): an IntEnum would print its name
    if isinstance(a, float):
        if math.isnan(a):
            return "nan"
        if math.isinf(a):
            return "inf" if a > 0 else "-inf"
        return float.__repr__(a)  # shortest text that reads back bit-exactly
    if isinstance(a, complex):
        return f"complex({format_arg(a.real)}, {format_arg(a.imag)})"
    if isinstance(a, str):
        return json.dumps(a)
    if isinstance(a, (list, tuple)):
        return "[" + ", ".join(format_arg(x) for x in a) + "]"
    if isinstance(a, (Ref, DType, Sym)):
        return repr(a)
    raise IRError(
        f"cannot print argument {a!r} of type {type(a).__name__}",
        hint="node arguments are int, float, complex, bool, None, str, list, Ref, DType or Sym",
    )
