"""Parallel hints: what the user says about SBP, in code or in a parallel config (TOML).

In code, ``sbpc.shard(tensor, tp="S(0)")`` names the SBP of a parameter (recorded during
capture) or of an activation (it becomes an ``sbpc.hint`` op in the graph). It is a no-op
under plain PyTorch. A parallel config maps parameter-name globs and module-path globs to
SBP per mesh axis::

    [params]
    "h.*.attn.c_attn.weight" = { tp = "S(0)" }
    [modules]                       # the module's output (its first tensor)
    "h.*" = { tp = "S(1)" }

Everything else is left to propagation. Hints name axes, never ranks.
"""
from __future__ import annotations

import contextvars
import re
import os
import tomllib
from dataclasses import dataclass, field

from sbpc.compiler.mesh import KNOWN_AXES
from sbpc.errors import UsageError
from sbpc.runtime.sbp import Sbp, parse_sbp

AxisSbp = dict[str, Sbp]  # axis name -> SBP on that axis; axes not named are left to propagation
_SBP_AXES = tuple(a for a in KNOWN_AXES if a != "pp")
_AXES_HINT = f"SBP axes are {', '.join(_SBP_AXES)} (pp is placement, not SBP)"


@dataclass(frozen=True)
class Hint:
    axes: tuple[tuple[str, Sbp], ...]
    source: str  # where the user wrote it: "gpt.megatron.toml:4" or "gpt.py:51"

    def as_dict(self) -> AxisSbp:
        return dict(self.axes)

    def spec(self) -> str:
        return ",".join(f"{a}={s!r}" for a, s in self.axes)


def parse_axes(spec: dict, where: str) -> tuple[tuple[str, Sbp], ...]:
    out = []
    for axis, text in spec.items():
        if axis not in _SBP_AXES:
            raise UsageError(f"unknown mesh axis {axis!r} in a hint", location=where, hint=_AXES_HINT)
        if not isinstance(text, str):
            raise UsageError(f"the SBP for axis {axis} must be a string such as \"S(0)\", not {text!r}", location=where)
        try:
            out.append((axis, parse_sbp(text)))
        except UsageError as err:
            raise UsageError(err.message, location=where, hint=err.hint) from None
    return tuple(out)


def parse_spec_string(text: str, where: str) -> tuple[tuple[str, Sbp], ...]:
    """``"tp=S(1),dp=B"`` (the form an ``sbpc.hint`` op carries) -> axis/SBP pairs."""
    pairs = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        axis, _, sbp = part.partition("=")
        pairs[axis.strip()] = sbp.strip()
    return parse_axes(pairs, where)


def format_spec(axes: tuple[tuple[str, Sbp], ...]) -> str:
    return ";".join(f"{a}={s!r}" for a, s in axes)


@dataclass
class ParallelConfig:
    """A parsed parallel config: globs not yet matched against a model."""

    path: str = ""
    params: list[tuple[str, Hint]] = field(default_factory=list)
    modules: list[tuple[str, Hint]] = field(default_factory=list)

    def module_hint(self, module_path: str) -> Hint | None:
        for glob, hint in self.modules:
            if glob_match(module_path, glob):
                return hint
        return None

    def param_hints(self, names: list[str]) -> dict[str, Hint]:
        """Parameter name -> hint; the first matching glob wins. A glob matching nothing is an error."""
        out: dict[str, Hint] = {}
        for glob, hint in self.params:
            hits = [n for n in names if glob_match(n, glob)]
            if not hits:
                close = sorted(names, key=lambda n: -_common_prefix(n, glob))[:2]
                raise UsageError(f"parameter glob {glob!r} matches no parameter of the model", location=hint.source,
                                 hint=f"parameters are named by module path, e.g. {', '.join(close)}")
            for n in hits:
                out.setdefault(n, hint)
        return out

    def check_modules(self, paths: list[str]) -> None:
        for glob, hint in self.modules:
            if not any(glob_match(p, glob) for p in paths):
                raise UsageError(f"module glob {glob!r} matches no module of the model", location=hint.source,
                                 hint="modules are named by path, e.g. " + ", ".join(p for p in paths[1:3] if p))


def glob_match(name: str, glob: str) -> bool:
    """Module-path globs: ``*`` matches one path component, ``**`` any number of them."""
    pattern = "".join(".*" if tok == "**" else "[^.]*" if tok == "*" else "[^.]" if tok == "?" else re.escape(tok)
                      for tok in re.split(r"(\*\*|\*|\?)", glob) if tok)
    return re.fullmatch(pattern, name) is not None


def _common_prefix(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))


def load_config(path: str) -> ParallelConfig:
    if not os.path.isfile(path):
        raise UsageError(f"parallel config {path!r} does not exist", hint="pass a TOML file with [params] and [modules] tables")
    with open(path, "rb") as f:
        raw_bytes = f.read()
    try:
        raw = tomllib.loads(raw_bytes.decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise UsageError(f"parallel config {path} is not valid TOML: {err}", location=path,
                         hint="see docs/parallel.md for the format") from None
    lines = raw_bytes.decode(errors="replace").splitlines()
    unknown = set(raw) - {"params", "modules"}
    if unknown:
        raise UsageError(f"parallel config {path} has unknown table [{sorted(unknown)[0]}]", location=path,
                         hint="tables: [params] (parameter globs) and [modules] (module-output globs)")
    cfg = ParallelConfig(path=path)
    for table, dest in (("params", cfg.params), ("modules", cfg.modules)):
        for glob, spec in raw.get(table, {}).items():
            where = f"{path}:{_line_of(lines, glob)}"
            if not isinstance(spec, dict):
                raise UsageError(f"[{table}] {glob!r} must map axes to SBP, e.g. {{ tp = \"S(0)\" }}", location=where)
            dest.append((glob, Hint(parse_axes(spec, where), where)))
    return cfg


def _line_of(lines: list[str], key: str) -> int:
    for i, line in enumerate(lines, 1):
        if line.lstrip().startswith((f'"{key}"', f"'{key}'", f"{key} ")):
            return i
    return 1


# The hints `sbpc.shard` records while a capture runs. A context variable, not a global: it is
# set only inside capture(), for that capture.
ACTIVE: contextvars.ContextVar["HintRecorder | None"] = contextvars.ContextVar("sbpc_hints", default=None)


@dataclass
class HintRecorder:
    params: dict[int, Hint] = field(default_factory=dict)  # id(parameter) -> hint

    def shard(self, tensor, axes: dict, where: str):
        import torch

        from sbpc.compiler.hint_op import hint_op

        hint = Hint(parse_axes(axes, where), where)
        if isinstance(tensor, torch.nn.Parameter):
            self.params[id(tensor)] = hint
            return tensor
        return hint_op(tensor, format_spec(hint.axes), where)
