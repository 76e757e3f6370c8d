"""A tiny FileCheck (after LLVM's) for golden-text tests.

``filecheck(text, checks)`` runs the directives in ``checks`` over ``text``:

    CHECK: pat          pat occurs after the previous match
    CHECK-NEXT: pat     pat occurs on the line right after the previous match's line
    CHECK-SAME: pat     pat occurs on the previous match's line, after it
    CHECK-NOT: pat      pat does not occur between the previous match and the next one
                        (or the end of the text when no positive directive follows)
    CHECK-COUNT-n: pat  pat occurs n times, one after the other (n CHECKs)

A pattern is a literal substring, except that ``{{regex}}`` spans are Python regexes (in
which ``^`` and ``$`` match at line starts and ends).
Leading and trailing blanks of a pattern are dropped; a literal never matches across a line
end (a regex such as ``\\s`` can, so keep regexes to one line). Lines of
``checks`` without a directive are ignored. On failure it raises AssertionError naming the
directive and showing the region of text it searched.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

_DIRECTIVE = re.compile(r"\b(CHECK(?:-NEXT|-SAME|-NOT|-COUNT-(\d+))?):(.*)$")
_SHOWN_LINES = 12  # a failing CHECK over a long text shows this much of the region


@dataclass
class _Directive:
    kind: str  # CHECK, CHECK-NEXT, CHECK-SAME, CHECK-NOT
    regex: re.Pattern
    source: str  # the directive as written, and where, for the failure message


def filecheck(text: str, checks: str) -> None:
    directives = _parse(checks)
    pos = 0  # end of the previous match
    matched = False  # whether there is a previous match for NEXT/SAME to refer to
    nots: list[_Directive] = []
    for d in directives:
        if d.kind == "CHECK-NOT":
            nots.append(d)
            continue
        if d.kind in ("CHECK-NEXT", "CHECK-SAME") and not matched:
            raise ValueError(f"{d.source}: {d.kind} needs a match before it")
        if d.kind == "CHECK":
            start, end = pos, len(text)
        elif d.kind == "CHECK-SAME":
            start, end = pos, _line_end(text, pos)
        else:
            newline = text.find("\n", pos)
            if newline < 0:
                _fail(d, "there is no next line", text, pos, pos)
            start, end = newline + 1, _line_end(text, newline + 1)
        m = d.regex.search(text, start, end)
        if m is None:
            _fail(d, "no match", text, start, end)
        _check_nots(nots, text, pos, m.start())
        nots = []
        pos, matched = m.end(), True
    _check_nots(nots, text, pos, len(text))


def _parse(checks: str) -> list[_Directive]:
    out = []
    for number, line in enumerate(checks.splitlines(), 1):
        m = _DIRECTIVE.search(line)
        if m is None:
            continue
        kind, count, pattern = m.group(1), m.group(2), m.group(3).strip()
        source = f"checks line {number}: {line.strip()}"
        if not pattern:
            raise ValueError(f"{source}: empty pattern")
        regex = _compile(pattern, source)
        if count is not None:
            if int(count) < 1:
                raise ValueError(f"{source}: CHECK-COUNT needs a count of at least 1")
            out += [_Directive("CHECK", regex, source) for _ in range(int(count))]
        else:
            out.append(_Directive(kind, regex, source))
    if not out:
        raise ValueError("no CHECK directives in checks")
    return out


def _compile(pattern: str, source: str) -> re.Pattern:
    parts = re.split(r"\{\{(.*?)\}\}", pattern)  # odd parts are the regex spans
    text = "".join(p if i % 2 else re.escape(p) for i, p in enumerate(parts))
    try:
        return re.compile(text, re.MULTILINE)  # so ^ and $ mean a line's start and end
    except re.error as e:
        raise ValueError(f"{source}: bad regex: {e}") from None


def _line_end(text: str, pos: int) -> int:
    end = text.find("\n", pos)
    return len(text) if end < 0 else end


def _check_nots(nots: list[_Directive], text: str, start: int, end: int) -> None:
    for d in nots:
        m = d.regex.search(text, start, end)
        if m is not None:
            line = text.count("\n", 0, m.start()) + 1
            _fail(d, f"found {m.group(0)!r} on line {line}", text, start, end)


def _fail(d: _Directive, why: str, text: str, start: int, end: int) -> None:
    # Show whole lines, so the reader sees the context the search began in the middle of.
    first = text.count("\n", 0, start) + 1
    column = start - (text.rfind("\n", 0, start) + 1) + 1
    lines = text[text.rfind("\n", 0, start) + 1:_line_end(text, end)].split("\n")
    shown = [f"{first + i:>5} | {line}" for i, line in enumerate(lines[:_SHOWN_LINES])]
    if len(lines) > _SHOWN_LINES:
        shown.append(f"      ... {len(lines) - _SHOWN_LINES} more lines")
    raise AssertionError(f"{d.source}\n  {why}; searched from line {first}, column {column}:\n" + "\n".join(shown))
