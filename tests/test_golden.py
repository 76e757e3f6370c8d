"""Golden text-IR tests, one file per pass under tests/golden/ (xDSL / LLVM lit style).

Each file starts with ``// RUN: pass[,pass...]``, holds an input graph, and ``// CHECK`` lines
about the IR printed after those passes. A pass may take options as text,
``recompute(mode=full)``. The IR verifies before and after every pass.
"""
import re
from pathlib import Path

import pytest

from filecheck import filecheck
from sbpc.compiler.ir.parser import parse_graph
from sbpc.compiler.ir.printer import print_graph
from sbpc.compiler.ir.verify import verify
from sbpc.compiler.pass_manager import CompileContext
from sbpc.compiler.passes import REGISTRY

GOLDEN = sorted((Path(__file__).parent / "golden").glob("*.sbpir"))


def run_file(path: Path) -> str:
    text = path.read_text()
    run = text.splitlines()[0]
    assert run.startswith("// RUN: "), f"{path.name} must start with // RUN: passes"
    graph = parse_graph(text, source=path.name)
    verify(graph, after="parse")
    ctx = CompileContext()
    for name, options in run_passes(run):
        graph = REGISTRY[name](**options).apply(graph, ctx)
        verify(graph, after=name)
    return print_graph(graph)


def run_passes(run: str) -> list[tuple[str, dict[str, str]]]:
    """``// RUN: a,b(k=v; k2=v2)`` -> [("a", {}), ("b", {"k": "v", "k2": "v2"})]."""
    out = []
    for name, opts in re.findall(r"([\w-]+)(?:\(([^)]*)\))?", run.removeprefix("// RUN: ")):
        out.append((name, dict(kv.strip().split("=", 1) for kv in opts.split(";") if kv.strip())))
    return out


@pytest.mark.parametrize("path", GOLDEN, ids=[p.stem for p in GOLDEN])
def test_golden(path):
    filecheck(run_file(path), path.read_text())


def test_every_pass_has_a_golden_file():
    covered = {name for p in GOLDEN for name, _ in run_passes(p.read_text().splitlines()[0])}
    missing = set(REGISTRY) - covered - {"memory-plan"}  # memory-plan changes no IR; tested in test_passes.py
    assert not missing, f"passes without a golden test: {sorted(missing)}"
