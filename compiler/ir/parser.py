"""Read text IR (as printed by ``sbpc.compiler.ir.printer``) back into a ``Graph``.

The grammar is ``ir_specs/ir.lark``. The parser is LALR with the transformer run inline, so
the graph is built while parsing and no parse tree is ever kept. Parsing checks syntax and
the spelling of dtypes, roles, kinds, SBPs and the mesh; whether a used value is defined is
the verifier's business, not the parser's.
"""
from __future__ import annotations

import functools
import importlib.resources
import json
import math

from lark import Lark, Token, Transformer, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedInput

from pydantic import ValidationError

from sbpc.runtime.kinds import MemoryKind
from sbpc.runtime.plan import PipelineSpec
from sbpc.compiler.ir.types import (
    DTYPES, DType, Graph, GraphInput, GraphOutput, InputKind, Node, OutputKind, Ref, Role,
    SourceLoc, Sym, TensorType,
)
from sbpc.compiler.ir.mesh import Mesh
from sbpc.runtime.sbp import parse_sbp
from sbpc.errors import IRError, UsageError

_FORMAT_HINT = "the text IR format is described in sbpc/compiler/ir/printer.py"


def parse_graph(text: str, source: str = "<ir>") -> Graph:
    try:
        return _parser().parse(text)
    except _Reject as e:
        raise _error(text, source, e.token.line, e.token.column, e.message, e.hint) from None
    except UnexpectedInput as e:
        raise _syntax_error(text, source, e) from None


@functools.lru_cache(maxsize=None)
def _parser() -> Lark:
    grammar = importlib.resources.files("sbpc.ir_specs").joinpath("ir.lark").read_text()
    return Lark(grammar, parser="lalr", transformer=_Build(), maybe_placeholders=True)


class _Reject(Exception):
    """A well-formed token with a bad meaning (unknown dtype, ...); parse_graph locates it."""

    def __init__(self, token: Token, message: str, hint: str):
        super().__init__(message)
        self.token, self.message, self.hint = token, message, hint


class _Kwarg:
    __slots__ = ("key", "value")

    def __init__(self, key: str, value: object):
        self.key, self.value = key, value


def _sbp(token: Token):
    try:
        return parse_sbp("".join(token.split()))  # the token may hold blanks: "S( 0 )"
    except UsageError as e:
        raise _Reject(token, f"bad SBP {str(token)!r}", e.hint or "") from None


def _type(token: Token) -> TensorType:
    dtype, _, dims = token.partition("[")
    return TensorType(tuple(int(d) for d in dims[:-1].split(",") if d.strip()), _dtype(token, dtype.rstrip()))


def _dtype(token: Token, name: str) -> str:
    if name not in DTYPES:
        raise _Reject(token, f"unknown dtype {name!r}", "dtypes: " + ", ".join(DTYPES))
    return name


def _enum(cls, token: Token, what: str):
    try:
        return cls(str(token))
    except ValueError:
        allowed = ", ".join(m.value for m in cls)
        raise _Reject(token, f"unknown {what} {str(token)!r}", f"{what} is one of {allowed}") from None


def _memory(token: Token | None) -> MemoryKind:
    return MemoryKind.DEVICE if token is None else _enum(MemoryKind, token, "memory kind")


@v_args(inline=True)
class _Build(Transformer):
    """Builds the IR bottom-up; stateless, so the cached parser can share one instance."""

    def start(self, graph, init, schedule):
        if init is not None:
            graph.init, graph.init_outputs = init
        graph.schedule = schedule
        return graph

    def schedule(self, text):
        try:
            return PipelineSpec.model_validate_json(json.loads(text))
        except ValidationError as e:
            raise _Reject(text, f"bad pipeline schedule: {e.errors()[0]['msg']}", "print it with sbpc; do not edit it") from None

    def graph(self, name, mesh, rowwise, *items):
        g = Graph(str(name), mesh, rowwise=rowwise or ())
        for item in items:  # the grammar already put inputs first, then nodes, then outputs
            if isinstance(item, GraphInput):
                g.inputs.append(item)
            elif isinstance(item, Node):
                g.nodes.append(item)
            else:
                g.outputs.append(item)
        return g

    def init_region(self, *items):
        return [i for i in items if isinstance(i, Node)], [i for i in items if isinstance(i, GraphOutput)]

    def mesh(self, *axes):
        try:
            return Mesh(tuple((str(n), int(s)) for n, s in axes))
        except UsageError as e:
            raise _Reject(axes[0][0], e.message, e.hint or "") from None

    def rowwise(self, *modules):
        return tuple(json.loads(m) for m in modules)

    def mesh_axis(self, name, size):
        return name, size

    def input(self, kind, value, type_, name, attrs):
        sbp, mem = attrs or (None, None)
        return GraphInput(_enum(InputKind, kind, "input kind"), value[1:], _type(type_), json.loads(name), sbp,
                          memory=_memory(mem))

    def input_attrs(self, sbp, mem):
        return sbp, mem

    def input_mem(self, mem):
        return None, mem

    def output(self, kind, value, name):
        return GraphOutput(_enum(OutputKind, kind, "output kind"), value[1:], json.loads(name))

    def node(self, results, op, args, types, attrs):
        outputs = results or []
        types = types or []
        if len(types) != len(outputs):
            raise _Reject(op, f"{op} has {len(outputs)} results but {len(types)} types",
                          "write one type per result: ': T' for one, ': (T1, T2)' for more")
        pos, kw = [], {}
        for a in args or ():
            if isinstance(a, _Kwarg):
                kw[a.key] = a.value
            elif kw:
                raise _Reject(op, f"{op} has a positional argument after a keyword one",
                              "put positional arguments first")
            else:
                pos.append(a)
        role, stage, mem, sbp, sbp_in, loc = attrs
        return Node(outputs, str(op), tuple(pos), kw, types, role, loc, stage, sbp, sbp_in, memory=_memory(mem))

    def results(self, *values):
        return [v[1:] for v in values]

    def types(self, *types):
        return [_type(t) for t in types]

    def attrs(self, role, stage, mem, sbp, sbp_in, loc):
        return _enum(Role, role, "role"), None if stage is None else int(stage), mem, sbp, sbp_in, loc

    def sbp_list(self, *nds):
        return list(nds)

    def nd_sbp(self, *sbps):
        return tuple(_sbp(t) for t in sbps)

    def loc(self, module, file, line):
        return SourceLoc(json.loads(module), json.loads(file), int(line))

    def args(self, *args):
        return args

    def kwarg(self, key, value):
        return _Kwarg(str(key), value)

    def int_(self, t):
        return int(t)

    def float_(self, t):
        return float(t)

    def inf(self):
        return math.inf

    def ninf(self):
        return -math.inf

    def nan(self):
        return math.nan

    def complex_(self, re, im):
        return complex(re, im)

    def true(self):
        return True

    def false(self):
        return False

    def none(self):
        return None

    def string(self, t):
        return json.loads(t)

    def ref(self, t):
        return Ref(t[1:])

    def sym(self, t):
        return Sym(t[1:])

    def dtype(self, t):
        return DType(_dtype(t, str(t)))

    def list(self, *items):
        return list(items)


def _syntax_error(text: str, source: str, e: UnexpectedInput) -> IRError:
    if isinstance(e, UnexpectedCharacters):
        char = text[e.pos_in_stream]
        hint = "a string may be unterminated" if char == '"' else _FORMAT_HINT
        return _error(text, source, e.line, e.column, f"unexpected character {char!r}", hint)
    # LALR's expected set can hold tokens only valid after a reduction that this input
    # cannot make; the interactive parser replays the state and names just the real ones.
    ip = getattr(e, "interactive_parser", None)
    expected = ip.accepts() if ip else set(getattr(e, "expected", ()))
    wanted = "expected " + " or ".join(sorted(map(_describe, expected - {"$END"})) or ["end of input"])
    hint = _HINTS.get(frozenset(expected), _FORMAT_HINT)
    token = getattr(e, "token", None)
    if token is None or token.type == "$END":
        body = text.rstrip()  # point just past the last token, not at trailing blank lines
        line, col = body.count("\n") + 1, len(body) - body.rfind("\n")
        hint = "a '}' or ']' may be missing" if expected & {"RBRACE", "RSQB"} else hint
        return _error(text, source, line, col, f"unexpected end of input, {wanted}", hint)
    return _error(text, source, e.line, e.column, f"unexpected {str(token)!r}, {wanted}", hint)


_HINTS = {frozenset({"COMMA", "RSQB"}): "a list may be missing its closing ']'",
          frozenset({"OPNAME"}): "op names are dotted, like aten.mm.default"}
_TERMINALS = {"NAME": "a name", "OPNAME": "an op name", "VALUE": "a %value", "SYM": "a #symbol",
              "INT": "an integer", "FLOAT": "a float", "STRING": "a string",
              "TYPE": "a type such as f32[4, 64]", "SBP": "an SBP such as S(0)"}


def _describe(terminal: str) -> str:
    pattern = _parser().get_terminal(terminal).pattern
    return repr(pattern.value) if pattern.type == "str" else _TERMINALS.get(terminal, terminal)


def _error(text: str, source: str, line: int, col: int, what: str, hint: str) -> IRError:
    src_line = text.split("\n")[line - 1] if 0 < line <= text.count("\n") + 1 else ""
    excerpt = src_line.strip()
    excerpt = excerpt if len(excerpt) <= 80 else excerpt[:77] + "..."
    return IRError(f"{source}:{line}:{col}: {what}", hint=hint, detail=f"    {src_line}\n    {' ' * (col - 1)}^",
                   location=f"line {line}: {excerpt}")
