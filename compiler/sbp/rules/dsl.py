"""Parse the SBP rule DSL (``ir_specs/sbp_rules.lark``) into ``Rule`` values.

The text is one rule per line; see ``docs/sbp_rules.md``. Parsing only builds the rules and
reports syntax errors as ``file:line:col``; ``RuleBook.load`` then checks the meaning (known
family, known parameter names) against each op's schema.
"""
from __future__ import annotations

import functools
import importlib.resources
from dataclasses import dataclass

from lark import Lark, Token, Tree
from lark.exceptions import UnexpectedCharacters, UnexpectedInput

from sbpc.errors import IRError

LITERALS = {"none": None, "true": True, "false": False}


@dataclass(frozen=True)
class Arg:
    kind: str  # "name", "str" or "int"
    value: str | int
    line: int
    col: int

    def __str__(self) -> str:
        return f'"{self.value}"' if self.kind == "str" else str(self.value)


@dataclass(frozen=True)
class Modifier:
    name: str
    groups: tuple[tuple[Arg, ...], ...]
    line: int
    col: int


@dataclass(frozen=True)
class Rule:
    op: str
    params: tuple[str, ...] | None  # declared parameter names; None: take them from torch's schema
    family: str
    args: tuple[Arg, ...]
    modifiers: tuple[Modifier, ...]
    source: str
    line: int
    col: int
    fpos: tuple[int, int] = (0, 0)  # line, col of the family name

    def modifier(self, name: str) -> Modifier | None:
        return next((m for m in self.modifiers if m.name == name), None)

    def __str__(self) -> str:
        def grp(g):
            return "+".join(map(str, g))
        text = f"{self.op} = {self.family}" + (f"({', '.join(map(str, self.args))})" if self.args else "")
        for m in self.modifiers:
            text += f" {m.name}({' | '.join(grp(g) for g in m.groups)})"
        return text


@functools.lru_cache(maxsize=None)
def _parser() -> Lark:
    grammar = importlib.resources.files("sbpc.ir_specs").joinpath("sbp_rules.lark").read_text()
    return Lark(grammar, parser="lalr")


def rules_error(source: str, line: int, col: int, what: str, hint: str | None = None, text: str = "") -> IRError:
    src_line = text.split("\n")[line - 1] if text and 0 < line <= text.count("\n") + 1 else ""
    return IRError(f"{source}:{line}:{col}: {what}", hint=hint or "the rule DSL is described in docs/sbp_rules.md",
                   detail=f"    {src_line}\n    {' ' * (col - 1)}^" if src_line else None)


def parse_rules(text: str, source: str = "<rules>") -> list[Rule]:
    try:
        tree = _parser().parse(text + "\n")
    except UnexpectedInput as e:
        if isinstance(e, UnexpectedCharacters):
            what = f"unexpected character {text[e.pos_in_stream]!r}" if e.pos_in_stream < len(text) else "unexpected end"
        else:
            tok = getattr(e, "token", None)
            what = "unexpected end of input" if tok is None or tok.type == "$END" else f"unexpected {str(tok)!r}"
            ip = getattr(e, "interactive_parser", None)
            expected = sorted(ip.accepts() - {"$END"}) if ip else sorted(getattr(e, "expected", ()))
            if expected:
                what += ", expected " + " or ".join(_TERMINALS.get(x, x) for x in expected)
        raise rules_error(source, e.line, e.column, what, text=text) from None
    return [_rule(r, source) for r in tree.children if isinstance(r, Tree)]


_TERMINALS = {"COMMA": "','", "RPAR": "')'", "LPAR": "'('", "EQUAL": "'='", "PLUS": "'+'", "VBAR": "'|'",
              "NAME": "a name", "OPNAME": "an op name such as aten.mm.default", "STRING": "a string",
              "SIGNED_INT": "an integer", "_NL": "end of line"}


def _arg(t: Tree) -> Arg:
    tok: Token = t.children[0]
    if t.data == "string":
        return Arg("str", str(tok)[1:-1], tok.line, tok.column)
    if t.data == "int":
        return Arg("int", int(tok), tok.line, tok.column)
    return Arg("name", str(tok), tok.line, tok.column)


def _rule(t: Tree, source: str) -> Rule:
    op_tok, *rest = t.children
    params = None
    if rest and isinstance(rest[0], Tree) and rest[0].data == "params":
        params = tuple(str(x) for x in rest.pop(0).children if x is not None)
    fam, *mods = rest
    name_tok = fam.children[0]
    args = tuple(_arg(a) for a in fam.children[1:] if a is not None)
    modifiers = []
    for m in mods:
        mname = m.children[0]
        groups = tuple(tuple(_arg(a) for a in g.children) for g in m.children[1:] if g is not None)
        modifiers.append(Modifier(str(mname), groups, mname.line, mname.column))
    return Rule(str(op_tok), params, str(name_tok), args, tuple(modifiers), source, op_tok.line, op_tok.column,
                (name_tok.line, name_tok.column))
