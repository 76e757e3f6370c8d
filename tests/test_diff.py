"""`sbpc diff`: golden diffs of two compiles (tests/golden/diff-*.check), JSON, bad input.

A ``.check`` file names its two compiles in ``// RUN-A:`` and ``// RUN-B:`` lines (the
arguments of ``sbpc compile``) and holds FileCheck lines about ``sbpc diff A B``'s text.
"""
import contextlib
import io
import json
import shlex
from pathlib import Path

import pytest

from conftest import ROOT
from filecheck import filecheck
from sbpc.cli import main
from sbpc.runtime.plan import SCHEMA_VERSION

CHECKS = sorted((Path(__file__).parent / "golden").glob("diff-*.check"))
_plans: dict[str, str] = {}


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def compiled(args: str, tmp: Path) -> str:
    """The plan of ``sbpc compile ARGS``, compiled once per session."""
    if args not in _plans:
        path = str(tmp / f"plan{len(_plans)}.json")
        code, _, err = run("compile", *shlex.split(args), "-o", path)
        assert code == 0, err
        _plans[args] = path
    return _plans[args]


def runs(path: Path) -> tuple[str, str]:
    lines = path.read_text().splitlines()
    return lines[0].removeprefix("// RUN-A: "), lines[1].removeprefix("// RUN-B: ")


@pytest.fixture(scope="module")
def plan_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("diff")


@pytest.mark.parametrize("path", CHECKS, ids=[p.stem for p in CHECKS])
def test_golden_diff(path, plan_dir):
    a, b = (compiled(x, plan_dir) for x in runs(path))
    code, out, err = run("diff", a, b)
    assert code == 0, err
    filecheck(out, path.read_text())


def test_json_has_every_change_and_the_deltas(plan_dir):
    a, b = (compiled(x, plan_dir) for x in runs(ROOT / "tests/golden/diff-zero1-zero3.check"))
    code, out, _ = run("diff", a, b, "--json")
    d = json.loads(out)
    assert code == 0
    params = [c for c in d["changes"] if c["what"] == "param"]
    assert len(params) == 29 and {"name": "wte.weight", "a": ["B", "B"], "b": ["S(0)", "B"]}.items() <= params[0].items()
    assert d["bytes_moved"]["delta"] == d["bytes_moved"]["b"] - d["bytes_moved"]["a"] > 0
    assert d["peak_memory"]["delta"] < 0 and d["step_time_s"]["a"] > 0
    kinds = {(r["kind"], r["axis"], r["role"]): r["calls"] for r in d["collectives"]}
    assert kinds[("reduce_scatter", "dp", "bwd")] == {"a": 0, "b": 1, "delta": 1}


def test_cluster_takes_the_step_times_from_sbpc_simulate(plan_dir):
    from sbpc.compiler.tools.cluster import load_cluster
    from sbpc.compiler.tools.simulate import simulate
    from sbpc.runtime.plan import load_plan

    a, b = (compiled(x, plan_dir) for x in runs(ROOT / "tests/golden/diff-dp-tp.check"))
    code, out, _ = run("diff", a, b, "--json", "--cluster", "dgx-h100")
    d = json.loads(out)
    assert code == 0 and d["step_time_source"] == "sbpc simulate on cluster dgx-h100"
    cluster = load_cluster("dgx-h100")
    assert d["step_time_s"]["a"] == simulate(load_plan(a), cluster).step_time_s
    assert d["step_time_s"]["b"] == simulate(load_plan(b), cluster).step_time_s
    code, _, err = run("diff", a, b, "--cluster", "nope")
    assert code == 2 and "no cluster 'nope'" in err


def test_a_plan_against_itself_changes_nothing(plan_dir):
    a = compiled(runs(CHECKS[0])[0], plan_dir)
    code, out, _ = run("diff", a, a)
    assert code == 0
    filecheck(out, """
        CHECK: parameters: 0 of 29 changed
        CHECK-NOT: ->
        CHECK: values (matched by phase, op and source line): 0 of {{\\d+}} changed
        CHECK: collectives per step
        CHECK: total {{.*}} +0
        CHECK: predicted step time: {{.*}}, 0.000 ms (+0%)
    """)


@pytest.mark.parametrize("content,pattern", [
    (None, r"plan file '.*missing\.json' does not exist"),
    ("not json", r"is not valid JSON"),
    ('{"schema_version": %d}' % SCHEMA_VERSION, r"is malformed at sbpc_version"),
])
def test_bad_plan_is_one_line_exit_2(tmp_path, plan_dir, content, pattern):
    import re

    bad = tmp_path / "missing.json"
    if content is not None:
        bad.write_text(content)
    code, out, err = run("diff", compiled(runs(CHECKS[0])[0], plan_dir), str(bad))
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and re.search(pattern, lines[0]) and "hint:" in lines[0], err
