"""Parallel hints: what the user says about SBP, in code or in a parallel config (TOML).

In code, ``sbpc.shard(tensor, tp="S(0)")`` names the SBP of a parameter (recorded during
capture) or of an activation (it becomes an ``sbpc.hint`` op in the graph). It is a no-op
under plain PyTorch. A parallel config maps parameter-name globs and module-path globs to
SBP per mesh axis::

    [params]
    "h.*.attn.c_attn.weight" = { tp = "S(0)" }
    [modules]                       # the module's output (its first tensor)
    "h.*" = { tp = "S(1)" }
    [stages]                        # module-path globs -> pipeline chunk (docs/pipeline.md)
    "h.0-5" = 0
    [pipeline]
    microbatches = 8

In code, ``with sbpc.stage(1):`` puts the forward ops traced inside on pipeline chunk 1.
Everything else is left to propagation and partitioning. Hints name axes, never ranks.
"""
from __future__ import annotations

import contextvars
import re
import os
import tomllib
from dataclasses import dataclass, field

from sbpc.compiler.ir.mesh import KNOWN_AXES, MICROBATCH
from sbpc.compiler.memory_options import MEMORY_FLAGS
from sbpc.errors import UsageError
from sbpc.runtime.kinds import ScheduleName
from sbpc.runtime.sbp import Sbp, parse_sbp

STAGE_KEY = "sbpc_stage"  # fx node meta ("custom") key of the chunk a `sbpc.stage` scope names
_TABLES = ("params", "modules", "stages", "pipeline", "memory")

_RANGE = re.compile(r"(\d+)-(\d+)")

AxisSbp = dict[str, Sbp]  # axis name -> SBP on that axis; axes not named are left to propagation
_SBP_AXES = tuple(a for a in KNOWN_AXES if a not in ("pp", "mb"))  # mb (micro-batches) is internal
_AXES_HINT = f"SBP axes are {', '.join(_SBP_AXES)} (pp is placement, not SBP)"


@dataclass(frozen=True)
class Hint:
    """What the user said about one tensor: its SBP on some mesh axes. An ``sbpc.hint`` op
    carries it as text (a torch custom op takes strings): ``spec()`` writes it, ``parse`` reads
    it back, and nothing else splits it."""
    axes: tuple[tuple[str, Sbp], ...]
    source: str  # where the user wrote it: "gpt.megatron.toml:4" or "gpt.py:51"

    def as_dict(self) -> AxisSbp:
        return dict(self.axes)

    def spec(self) -> str:
        """The text form: ``"tp=S(1);dp=B"``."""
        return ";".join(f"{a}={s!r}" for a, s in self.axes)

    @classmethod
    def parse(cls, spec: str, source: str) -> Hint:
        pairs = {}
        for part in filter(None, (p.strip() for p in spec.split(";"))):
            axis, _, sbp = part.partition("=")
            pairs[axis.strip()] = sbp.strip()
        # the compiler's own hints (ZeRO's, compiler/passes/zero.py) may name the micro-batch axis
        return cls(parse_axes(pairs, source, _SBP_AXES + (MICROBATCH,)), source)


def parse_axes(spec: dict, where: str, known: tuple[str, ...] = _SBP_AXES) -> tuple[tuple[str, Sbp], ...]:
    out = []
    for axis, text in spec.items():
        if axis not in known:
            raise UsageError(f"unknown mesh axis {axis!r} in a hint", location=where, hint=_AXES_HINT)
        if not isinstance(text, str):
            raise UsageError(f"the SBP for axis {axis} must be a string such as \"S(0)\", not {text!r}", location=where,
                             hint="quote it: S(dim) splits a tensor dim, B replicates, P is a partial sum")
        try:
            out.append((axis, parse_sbp(text)))
        except UsageError as err:
            raise UsageError(err.message, location=where, hint=err.hint) from None
    return tuple(out)


@dataclass(frozen=True)
class StageHint:
    chunk: int  # pipeline chunk (virtual stage) index, in [0, pp * virtual_stages)
    source: str  # "gpt.pp.toml:5"


@dataclass(frozen=True)
class PipelineConfig:
    """The ``[pipeline]`` table; None: not given (a command-line flag or the default decides)."""

    microbatches: int | None = None
    schedule: ScheduleName | None = None
    virtual_stages: int | None = None
    source: str = ""


@dataclass
class ParallelConfig:
    """A parsed parallel config: globs not yet matched against a model."""

    path: str = ""
    params: list[tuple[str, Hint]] = field(default_factory=list)
    modules: list[tuple[str, Hint]] = field(default_factory=list)
    stages: list[tuple[str, StageHint]] = field(default_factory=list)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    memory: dict[str, object] = field(default_factory=dict)  # the [memory] table's keys (MEMORY_FLAGS), as written
    memory_source: str = ""  # where the [memory] table is: "gpt.toml:12"

    def module_hint(self, module_path: str) -> Hint | None:
        for glob, hint in self.modules:
            if glob_match(module_path, glob):
                return hint
        return None

    def stage_hint(self, module_path: str) -> StageHint | None:
        """The chunk of an op run by module ``module_path``: the innermost enclosing module a
        ``[stages]`` glob names decides (``h.0.attn.c_attn`` falls back to ``h.0``); within
        one module the first matching glob wins."""
        parts = module_path.split(".") if module_path else []
        for depth in range(len(parts), 0, -1):
            prefix = ".".join(parts[:depth])
            for glob, hint in self.stages:
                if glob_match(prefix, glob):
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
        for glob, hint in [*self.modules, *self.stages]:
            if not any(glob_match(p, glob) for p in paths):
                raise UsageError(f"module glob {glob!r} matches no module of the model", location=hint.source,
                                 hint="modules are named by path, e.g. " + ", ".join(p for p in paths[1:3] if p))


def glob_match(name: str, glob: str) -> bool:
    """Module-path globs: ``*`` matches one path component, ``**`` any number of them, and a
    component ``a-b`` any number from a to b inclusive (``h.0-5`` is h.0 ... h.5)."""
    pattern, ranges = [], []
    for part in glob.split("."):
        m = _RANGE.fullmatch(part)
        if m:
            ranges.append((int(m.group(1)), int(m.group(2))))
            pattern.append(r"(\d+)")
            continue
        pattern.append("".join(".*" if tok == "**" else "[^.]*" if tok == "*" else "[^.]" if tok == "?" else re.escape(tok)
                               for tok in re.split(r"(\*\*|\*|\?)", part) if tok))
    m = re.fullmatch(r"\.".join(pattern), name)
    return m is not None and all(lo <= int(v) <= hi for v, (lo, hi) in zip(m.groups(), ranges))


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
    unknown = set(raw) - set(_TABLES)
    if unknown:
        raise UsageError(f"parallel config {path} has unknown table [{sorted(unknown)[0]}]", location=path,
                         hint="tables: [params] (parameter globs), [modules] (module-output globs), "
                              "[stages] (module globs -> pipeline chunk), [pipeline] (micro-batches, schedule), "
                              "[memory] (zero, recompute, precision, offload, device_memory)")
    for table in _TABLES:
        if not isinstance(raw.get(table, {}), dict):
            raise UsageError(f"[{table}] must be a table", location=f"{path}:{_line_of(lines, table)}",
                             hint=f"write it as a [{table}] section; see docs/parallel.md")
    cfg = ParallelConfig(path=path)
    for table, dest in (("params", cfg.params), ("modules", cfg.modules)):
        for glob, spec in raw.get(table, {}).items():
            where = f"{path}:{_line_of(lines, glob, table)}"
            _check_glob(glob, table, where)
            if not isinstance(spec, dict):
                raise UsageError(f"[{table}] {glob!r} must map axes to SBP, e.g. {{ tp = \"S(0)\" }}", location=where,
                                 hint="one SBP per mesh axis (dp, cp, tp), in an inline table")
            dest.append((glob, Hint(parse_axes(spec, where), where)))
    for glob, chunk in raw.get("stages", {}).items():
        where = f"{path}:{_line_of(lines, glob, 'stages')}"
        _check_glob(glob, "stages", where)
        if not _is_int(chunk, 0):
            raise UsageError(f"[stages] {glob!r} must be a chunk index (an integer >= 0), not {chunk!r}", location=where,
                             hint="chunks count from 0; with virtual stages there are pp * virtual_stages of them")
        cfg.stages.append((glob, StageHint(chunk, where)))
    cfg.pipeline = _pipeline(raw.get("pipeline", {}), path, lines)
    cfg.memory, cfg.memory_source = raw.get("memory", {}), f"{path}:{_line_of(lines, 'memory')}"
    unknown = set(cfg.memory) - set(MEMORY_FLAGS)
    if unknown:
        key = sorted(unknown)[0]
        raise UsageError(f"[memory] has unknown key {key!r}", location=f"{path}:{_line_of(lines, key, 'memory')}",
                         hint="keys: " + ", ".join(MEMORY_FLAGS))
    return cfg


def _pipeline(table: dict, path: str, lines: list[str]) -> PipelineConfig:
    where = lambda key: f"{path}:{_line_of(lines, key, 'pipeline')}"
    unknown = set(table) - {"microbatches", "schedule", "virtual_stages"}
    if unknown:
        key = sorted(unknown)[0]
        raise UsageError(f"[pipeline] has unknown key {key!r}", location=where(key),
                         hint="keys: microbatches, schedule, virtual_stages")
    for key in ("microbatches", "virtual_stages"):
        if key in table and not _is_int(table[key], 1):
            raise UsageError(f"[pipeline] {key} must be an integer >= 1, not {table[key]!r}", location=where(key),
                             hint=f"write {key} = 1 or more, unquoted")
    schedule = table.get("schedule")
    if schedule is not None:
        try:
            schedule = ScheduleName(schedule)
        except ValueError:
            raise UsageError(f"[pipeline] schedule must be one of {ScheduleName.names()}, not {schedule!r}",
                             location=where("schedule"), hint="1f1b keeps the fewest micro-batches in flight") from None
    v = table.get("virtual_stages")
    if schedule is not None and v is not None and (schedule == ScheduleName.INTERLEAVED) != (v > 1):
        raise UsageError(f"[pipeline] schedule = {schedule.value!r} does not go with virtual_stages = {v}",
                         location=where("virtual_stages"),
                         hint="virtual stages (> 1 chunk per device) need schedule = \"interleaved\", and it needs them")
    return PipelineConfig(table.get("microbatches"), schedule, v, source=path)


def _is_int(value, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _check_glob(glob: str, table: str, where: str) -> None:
    for part in glob.split("."):
        m = _RANGE.fullmatch(part)
        if m and int(m.group(1)) > int(m.group(2)):
            raise UsageError(f"[{table}] {glob!r} has an empty range {part!r}", location=where,
                             hint=f"write the smaller index first: {m.group(2)}-{m.group(1)}")


def _line_of(lines: list[str], key: str, table: str | None = None) -> int:
    """The line of ``key`` (of ``[table]``, when given) or of the table header itself."""
    start = 0
    if table is not None:
        start = next((i for i, line in enumerate(lines) if line.strip().startswith(f"[{table}]")), 0)
    for i, line in enumerate(lines[start:], start + 1):
        stripped = line.lstrip()
        if stripped.startswith((f'"{key}"', f"'{key}'", f"{key} ", f"{key}=", f"[{key}]")):
            return i
    return 1


# The hints `sbpc.shard` records while a capture runs. A context variable, not a global: it is
# set only inside capture(), for that capture.
ACTIVE: contextvars.ContextVar["HintRecorder | None"] = contextvars.ContextVar("sbpc_hints", default=None)


@dataclass
class HintRecorder:
    params: dict[int, Hint] = field(default_factory=dict)  # id(parameter) -> hint

    def stage(self, index, where: str):
        """The scope of ``sbpc.stage(index)``: ops traced inside carry the chunk in their fx
        node meta (as module paths do), which capture turns into ``Node.stage``."""
        import torch.fx.traceback as fx_traceback

        if not _is_int(index, 0):
            raise UsageError(f"sbpc.stage() takes a chunk index (an integer >= 0), not {index!r}", location=where,
                             hint="chunks count from 0; with virtual stages there are pp * virtual_stages of them")
        return fx_traceback.annotate({STAGE_KEY: index})

    def shard(self, tensor, axes: dict, where: str):
        import torch

        from sbpc.compiler.frontend.hint_op import hint_op

        hint = Hint(parse_axes(axes, where), where)
        if isinstance(tensor, torch.nn.Parameter):
            self.params[id(tensor)] = hint
            return tensor
        return hint_op(tensor, hint)
