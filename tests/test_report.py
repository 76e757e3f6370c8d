"""`sbpc report`: the HTML page's sections, that it is self-contained, and that it renders in a
real headless browser (Debian's chromium over the DevTools protocol, tests/browser.py) with no
console message, no exception and no request beyond its own file. Where no chromium can be
had, the browser tests skip and say why."""
import contextlib
import io
import re
import struct

import pytest

import browser
from conftest import compile_example
from filecheck import filecheck
from sbpc.cli import main
from sbpc.compiler.tools.report import render_report

PIPELINED = ["examples/gpt.py", "--mesh", "1x2x2", "--microbatches", "4", "--config", "examples/gpt.megatron.toml"]


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory):
    """The report of a tp=2 x pp=2 tiny GPT, 4 micro-batches (one in-process compile)."""
    d = tmp_path_factory.mktemp("report")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["compile", *PIPELINED, "-o", str(d / "plan.json")]) == 0
        assert main(["report", str(d / "plan.json"), "-o", str(d / "report.html")]) == 0
    return d / "report.html"


@pytest.fixture(scope="module")
def chromium():
    path, why = browser.chromium()
    if path is None:
        pytest.skip(f"no headless browser: {why}")
    return path


def test_sections_of_a_pipelined_plan(pipelined):
    filecheck(pipelined.read_text(), r"""
        CHECK: <h1>sbpc plan</h1>
        CHECK: Predicted step time <b>{{[\d.]+}} ms</b>, pipeline bubble
        CHECK: <h2>Mesh and rank map</h2>
        CHECK: <th>pp=0 dp \ tp</th><th>tp=0</th><th>tp=1</th></tr>
        CHECK-NEXT: <tr><th>dp=0</th><td>0</td><td>1</td></tr>
        CHECK: <th>pp=1 dp \ tp</th>
        CHECK-NEXT: <tr><th>dp=0</th><td>2</td><td>3</td></tr>
        CHECK: <h2>Stages</h2>
        CHECK: <tr><td class="num">0</td><td class="num">0</td><td>wte, wpe,
        CHECK: <tr><td class="num">1</td><td class="num">1</td><td>{{.*}}lm_head</td>
        CHECK-NEXT: <td class="num">{{[\d,]+}}</td><td class="num">{{[\d.,]+}} MFLOP</td>
        CHECK: <h2>Pipeline timeline</h2>
        CHECK: Schedule 1f1b: 2 stages &times; 1 chunk(s),
        CHECK-NEXT: 4 micro-batches;
        CHECK: <svg
        CHECK: <title>F0.0 on stage 0: 0.000-
        CHECK: <title>B1.3 on stage 1:
        CHECK: </svg>
        CHECK: <h2>Memory per rank role</h2>
        CHECK: <title>stage 0 params:
        CHECK: <title>stage 1 params:
        CHECK: <h2>Communication per step</h2>
        CHECK: <td>all_reduce</td><td>tp</td><td>fwd</td><td class="num">16</td><td class="num">4</td>
        CHECK: <td>transfer</td><td>pp</td><td>fwd</td>
        CHECK: <h2>Most expensive boxings</h2>
        CHECK: <td>all_reduce</td><td>tp</td>
        CHECK-SAME: <code>h.{{\d}}.{{(attn|mlp)}}.c_{{\w+}} @ examples/gpt.py:{{\d+}}</code>
        CHECK: <h2 class="inline">Stage 0 program
        CHECK: <h2 class="inline">Stage 1 program
    """)


def test_page_is_self_contained(pipelined):
    text = pipelined.read_text()
    assert "<script" not in text and "<link" not in text and "@import" not in text
    assert not re.search(r"\b(src|href)\s*=", text), "the page must load nothing"
    assert not re.search(r"https?://|url\(", text), "the page must name no other resource"


def test_one_program_plan_shows_its_phases():
    result, _, _ = compile_example("mlp.py")
    text = render_report(result.plan)
    filecheck(text, r"""
        CHECK: Predicted step time <b>
        CHECK-NOT: pipeline bubble
        CHECK: <h2>Pipeline timeline</h2>
        CHECK-NEXT: One program, one micro-batch
        CHECK: <title>fwd on stage 0:
        CHECK: <title>bwd on stage 0:
        CHECK: <title>opt on stage 0:
        CHECK: <h2>Communication per step</h2>
        CHECK-NEXT: <p>No collectives
    """)


def test_cluster_adds_the_simulated_step():
    from sbpc.compiler.tools.cluster import load_cluster
    from sbpc.compiler.tools.simulate import simulate

    result, _, _ = compile_example("mlp.py")
    cluster = load_cluster("dgx-h100")
    step = simulate(result.plan, cluster).step_time_s
    filecheck(render_report(result.plan, cluster), f"""
        CHECK: <h2>Simulated on dgx-h100</h2>
        CHECK: <tr><th>step time</th><td class="num">{step * 1e3:,.3f} ms</td></tr>
        CHECK: <td>stage 0</td>
        CHECK: <h2>Mesh and rank map</h2>
    """)
    assert "Simulated on" not in render_report(result.plan)


def test_report_renders_in_a_browser_without_errors(pipelined, chromium, tmp_path):
    run = browser.load(chromium, pipelined)
    assert run.problems == [], run.problems
    png = run.screenshot
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])  # the IHDR chunk
    assert (width, height) == run.size and width >= 1000 and height >= 1500, (width, height)


def test_the_browser_check_sees_errors_and_requests(chromium, tmp_path):
    """The check above can fail: a console error, an uncaught exception and a fetch are seen."""
    page = tmp_path / "bad.html"
    page.write_text('<!doctype html><p>x</p><img src="https://example.invalid/a.png">'
                    '<script>console.error("seen"); missing();</script>')
    problems = browser.load(chromium, page).problems
    assert "error: seen" in problems
    assert any("missing is not defined" in p for p in problems)
    assert "network request: https://example.invalid/a.png" in problems


def test_rank_grids_follow_the_rank_order():
    from sbpc.compiler.tools.report import rank_grids
    from sbpc.runtime.plan import MeshAxis

    result, _, _ = compile_example("mlp.py")
    plan = result.plan.model_copy(update={"mesh": [MeshAxis(name="pp", size=10), MeshAxis(name="dp", size=3),
                                                   MeshAxis(name="tp", size=2)]})
    grids = rank_grids(plan)
    assert [(g.stage, g.first, g.last) for g in grids[:2]] == [(0, 0, 5), (1, 6, 11)] and grids[-1].last == 59
    assert grids[1].cols == ["tp=0", "tp=1"] and grids[1].rows == [[6, 7], [8, 9], [10, 11]]
    assert all(plan.coords(r) == {"pp": 1, "dp": i, "tp": j} for i, row in enumerate(grids[1].rows) for j, r in enumerate(row))
