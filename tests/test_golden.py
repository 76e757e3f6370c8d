"""Golden text-IR tests, one file per pass under tests/golden/ (xDSL / LLVM lit style).

Each file starts with ``// RUN: pass[,pass...]``, holds an input graph, and ``// CHECK`` lines
about the IR printed after those passes. The IR verifies before and after every pass.
"""
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
    for name in run.removeprefix("// RUN: ").split(","):
        graph = REGISTRY[name.strip()]().apply(graph, ctx)
        verify(graph, after=name)
    return print_graph(graph)


@pytest.mark.parametrize("path", GOLDEN, ids=[p.stem for p in GOLDEN])
def test_golden(path):
    filecheck(run_file(path), path.read_text())


def test_every_pass_has_a_golden_file():
    covered = {name.strip() for p in GOLDEN for name in p.read_text().splitlines()[0].removeprefix("// RUN: ").split(",")}
    missing = set(REGISTRY) - covered - {"memory-plan"}  # memory-plan changes no IR; tested in test_passes.py
    assert not missing, f"passes without a golden test: {sorted(missing)}"
