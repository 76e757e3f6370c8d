"""The sbpc commands end to end, as a user runs them."""
import json
import re

from conftest import sbpc
from filecheck import filecheck


def test_compile_is_deterministic(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert sbpc("compile", "examples/gpt.py", "-o", str(a)).returncode == 0
    assert sbpc("compile", "examples/gpt.py", "-o", str(b)).returncode == 0
    assert a.read_bytes() == b.read_bytes()


def test_time_passes_lists_every_pass_and_adds_up(tmp_path):
    """`--time-passes`: capture, every pass of the pipeline in its order, the verifier and
    lowering, their seconds summing to the total (each rounded to the millisecond)."""
    from sbpc.compiler.passes import PipelineOptions, default_pipeline

    r = sbpc("compile", "examples/gpt.py", "--mesh", "2x1x2", "--time-passes", "-o", str(tmp_path / "p.json"))
    assert r.returncode == 0, r.stderr
    rows = re.findall(r"^  (\S+(?: \(after each\))?) +([\d.]+)(?: +[\d.]+%)?$", r.stderr, re.M)
    names = [name for name, _ in rows]
    passes = [p.name for p in default_pipeline(PipelineOptions(microbatches=2))]
    assert names == ["capture", *passes, "verify (after each)", "lowering", "total"], r.stderr
    seconds = [float(sec) for _, sec in rows]
    assert abs(sum(seconds[:-1]) - seconds[-1]) <= 0.001 * len(seconds), r.stderr


def test_compile_run_inspect(tmp_path):
    plan = tmp_path / "plan.json"
    out = sbpc("compile", "examples/mlp.py", "--set", "layers=3", "--batch-size", "8", "-o", str(plan))
    assert out.returncode == 0, out.stderr
    assert re.search(r"compiled examples/mlp\.py for mesh 1: \d+ instructions, 10,952 parameters", out.stdout)
    run = sbpc("run", str(plan), "--steps", "3", "--save", str(tmp_path / "w.pt"))
    assert run.returncode == 0, run.stderr
    assert re.findall(r"^ iteration +(\d)/ +3 \|", run.stdout, re.M) == ["1", "2", "3"]
    assert (tmp_path / "w.pt").exists()
    text = sbpc("inspect", str(plan)).stdout
    filecheck(text, """
        CHECK: graph @mlp mesh<dp=1> {
        CHECK: input batch %batch_0 : f32[8, 32] "batch.0" {sbp=[S(0)]}
        CHECK: aten.addmm.default{{.*}}{role=fwd, stage=0, sbp=[[B]], loc="layers.0" @ "examples/mlp.py":
        CHECK: role=bwd
        CHECK: role=opt
        CHECK: output loss
        CHECK-NOT: init {
        CHECK: // {{\\d+}} instructions; params
    """)
    assert "init {" in sbpc("inspect", str(plan), "--init").stdout
    assert sbpc("inspect", str(plan), "--ranks").stdout.strip() == "rank 0: dp=0"


def test_check_command_prints_the_table():
    proc = sbpc("check", "examples/mlp.py", "--steps", "2", "--optimizer", "sgd", "--lr", "0.1")
    assert proc.returncode == 0, proc.stderr
    filecheck(proc.stdout, """
        CHECK: sbpc check examples/mlp.py on mesh 1: 2 steps, sgd, seed 0
        CHECK-NEXT: step    loss (plan)   loss (eager)
        CHECK-NEXT: init
        CHECK-NEXT: 0
        CHECK-NEXT: 1
        CHECK-NEXT: largest deviation {{.*}}; tolerance 1e-05: PASS
    """)


def test_html_report(tmp_path):
    plan, html, alias = tmp_path / "plan.json", tmp_path / "plan.html", tmp_path / "alias.html"
    assert sbpc("compile", "examples/mlp.py", "-o", str(plan)).returncode == 0
    out = sbpc("report", str(plan), "-o", str(html))
    assert out.returncode == 0 and out.stdout == f"wrote {html}\n", out.stderr
    text = html.read_text()
    assert '<h2 class="inline">Stage 0 program' in text and "aten.addmm.default" in text and "layers.0.weight" in text
    assert sbpc("inspect", str(plan), "--html", str(alias)).returncode == 0  # the same page
    assert alias.read_text() == text


def test_schema_is_json_schema_of_the_plan():
    schema = json.loads(sbpc("schema").stdout)
    assert schema["title"] == "Plan"
    assert {"schema_version", "stages", "params", "init", "mesh"} <= set(schema["properties"])


def test_opt_runs_passes_over_text_ir():
    proc = sbpc("opt", "tests/golden/dce.sbpir", "-p", "dce,stage-partition")
    assert proc.returncode == 0, proc.stderr
    assert "%unused" not in proc.stdout and "{role=fwd, stage=0}" in proc.stdout


def test_opt_reports_parse_errors_on_one_line(tmp_path):
    bad = tmp_path / "bad.sbpir"
    bad.write_text('graph @x mesh<dp=1> {\n  %a = aten.mm.default(%b : f32[2]\n}\n')
    proc = sbpc("opt", str(bad))
    assert proc.returncode == 2
    assert re.fullmatch(r"sbpc: error: .*bad\.sbpir:2:27: unexpected ':', expected '\)' or ',' "
                        r"\(at line 2: %a = aten\.mm\.default\(%b : f32\[2\]\); hint: .*\n", proc.stderr)


def test_multi_device_compile_inspect_explain(tmp_path):
    plan = tmp_path / "tp.json"
    out = sbpc("compile", "examples/gpt.py", "--mesh", "1x2", "--config", "examples/gpt.megatron.toml",
               "--set", "hidden=1024", "--set", "heads=8", "--set", "vocab=8192", "--set", "seq=128", "-o", str(plan))
    assert out.returncode == 0, out.stderr
    coll = sbpc("inspect", str(plan), "--collectives").stdout
    # 2 tp all-reduces forward and 2 backward per layer, the vocab-parallel embedding's and
    # cross-entropy's reductions, and the loss's 4-byte all-reduce in the step (boxing), which
    # rides in the backward's first tp all-reduce (coalesce): 14 tensors in 13 calls
    filecheck(coll, """
        CHECK: phase  collective       axis
        CHECK: fwd    all_reduce       tp {{.*}} h.0.attn.c_proj @ examples/gpt.py:
        CHECK: fwd    all_reduce       tp {{.*}} h.0.mlp.c_proj @ examples/gpt.py:
        CHECK: bwd    all_reduce       tp {{.*}} h.0.attn.c_attn @ examples/gpt.py:
        CHECK: // 13 collective calls per step (14 tensors)
    """)
    ir = sbpc("inspect", str(plan)).stdout
    # issued after the matmul, waited for at its first reader (passes/overlap.py); the matmul's
    # output dies at the issue, so the all-reduce reduces into it (overwrite)
    assert re.search(r'= sbpc\.issue\(%addmm_1, kind="all_reduce", axis="tp", reduce="sum", overwrite=True\) : work\[\] \{role=fwd, stage=0, '
                     r'sbp=\[\[B, B\]\], sbp_in=\[\[B, P\]\], loc="h\.0\.attn\.c_proj"', ir), ir[:3000]
    why = sbpc("explain", str(plan), "h.0.attn.c_attn.weight").stdout
    filecheck(why, """
        CHECK: h.0.attn.c_attn.weight (%h_0_attn_c_attn_weight) : float32[3072, 1024] sbp=[B, S(0:3)]
        CHECK-NEXT: because: hint tp=S(0) at examples/gpt.megatron.toml:
    """)
    why = sbpc("explain", str(plan), "%addmm_1").stdout
    filecheck(why, """
        CHECK: %addmm_1 : f32[512, 1024] sbp=[B, P]
        CHECK-NEXT: made by aten.addmm.default at h.0.attn.c_proj @ examples/gpt.py:
        CHECK-NEXT: because: aten.addmm.default by rule [tp: {{.*}}]
        CHECK: boxed by sbpc.all_reduce(axis=tp)
    """)
    bad = sbpc("explain", str(plan), "nope")
    assert bad.returncode == 2 and re.search(r"no value or parameter named 'nope' in the plan; hint: name a parameter",
                                             bad.stderr), bad.stderr


def test_quick_exit_flushes_everything(tmp_path, capsys):
    """compile and inspect end with os._exit (cli.console_main): the whole output is out first,
    and the exit code is the command's."""
    from sbpc.cli import main

    plan = tmp_path / "p.json"
    out = sbpc("compile", "examples/gpt.py", "--mesh", "2x2", "-o", str(plan))
    assert out.returncode == 0 and "compiled examples/gpt.py for mesh 2x2" in out.stdout
    text = sbpc("inspect", str(plan)).stdout
    assert main(["inspect", str(plan)]) == 0
    assert text == capsys.readouterr().out and len(text) > 10_000
    bad = sbpc("inspect", str(tmp_path / "missing.json"))
    assert bad.returncode == 2 and bad.stderr.startswith("sbpc: ")
