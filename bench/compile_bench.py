"""Compile wall time, peak RSS and plan size of examples/gpt.py presets.

Each compile runs as `sbpc compile` in a fresh process; the parent waits for it with
os.wait4, so the peak RSS is that child's own ru_maxrss. Wall time includes interpreter
start and `import torch` (4-6 s here); `sbpc total` is the compiler's own timer
(capture + passes + lowering), read from the command's output.

A run is ``preset`` (on ``--mesh``, default 1) or ``preset@mesh``. The default runs end with
the 1T model on 6x8x64 (dp 6, tp 8, pp 64, so 64 micro-batches and a batch of 384): 128
layers, ~27k ops to place on three SBP axes. It must stay within the limits in ``LIMITS``
(wall s, peak RSS MB, plan MB), which the table checks.

    .venv/bin/python bench/compile_bench.py            # tiny 1.3b 1t 1t@6x8x64, then 1.3b at 24 and 48 layers
    .venv/bin/python bench/compile_bench.py small 175b@2x8 --depth small@1x2

It ends with ``ratio=`` the compiler time of the ``--depth`` preset at twice its layers over
its time at its own layer count: 1.0 would be a compile that does not grow with depth.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_RUNS = ["tiny", "1.3b", "1t", "1t@6x8x64"]
# run -> (wall s, peak RSS MB, plan MB) it must stay within on a 2-core machine
LIMITS = {("1t", "6x8x64"): (120.0, 6000.0, 50.0)}


def sbpc_command() -> str:
    """The `sbpc` console script of this interpreter's environment."""
    here = os.path.join(os.path.dirname(sys.executable), "sbpc")
    found = here if os.path.exists(here) else shutil.which("sbpc")
    if not found:
        sys.exit("compile_bench: no `sbpc` console script next to this python or on PATH")
    return found


def compile_once(preset: str, model: str, mesh: str, outdir: str, timeout: float = 1800, layers: int | None = None) -> dict:
    """Run one compile in a fresh process; return its wall time, peak RSS and plan figures.
    A compile still running after ``timeout`` seconds is killed, and the bench fails."""
    plan_path = os.path.join(outdir, f"{preset}-{layers}-{mesh}.json")
    cmd = [sbpc_command(), "compile", model, "--set", f"preset={preset}", "--mesh", mesh, "-o", plan_path]
    if layers is not None:
        cmd += ["--set", f"layers={layers}"]
    with tempfile.TemporaryFile("w+") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)  # Popen must not wait again
        log.seek(0)
        output = log.read()
    if proc.returncode != 0:
        why = f"killed after {timeout:.0f}s" if wall >= timeout else f"exit {proc.returncode}"
        sys.exit(f"compile_bench: `{' '.join(cmd)}` failed ({why}):\n{output}")
    with open(plan_path) as f:
        estimates = json.load(f)["estimates"]
    total = re.search(r"total ([0-9.]+)s", output)
    return {
        "preset": preset if layers is None else f"{preset}/L{layers}",
        "mesh": mesh,
        "wall_s": wall,
        "sbpc_total_s": float(total.group(1)) if total else float("nan"),
        "peak_rss_mb": usage.ru_maxrss / 1024,  # Linux reports KiB
        "plan_mb": os.path.getsize(plan_path) / 1e6,
        "instructions": estimates["instructions"],
        "params": estimates["param_count"],
    }


def within_limits(row: dict) -> str:
    """"ok", "OVER (...)" or "" (no limits for this run)."""
    limits = LIMITS.get((row["preset"], row["mesh"]))
    if limits is None:
        return ""
    over = [f"{name} {row[key]:.1f} > {lim:g}" for name, key, lim in
            zip(("wall s", "RSS MB", "plan MB"), ("wall_s", "peak_rss_mb", "plan_mb"), limits) if row[key] > lim]
    return "OVER (" + ", ".join(over) + ")" if over else "ok"


def print_table(rows: list[dict]) -> None:
    print(f"{'preset':>8} {'mesh':>8} {'wall s':>8} {'sbpc total s':>13} {'peak RSS MB':>12} {'plan MB':>8} "
          f"{'instructions':>13} {'parameters':>19}  limits")
    for r in rows:
        print(f"{r['preset']:>8} {r['mesh']:>8} {r['wall_s']:8.1f} {r['sbpc_total_s']:13.1f} {r['peak_rss_mb']:12.0f} "
              f"{r['plan_mb']:8.2f} {r['instructions']:13,} {r['params']:19,}  {within_limits(r)}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="*", default=DEFAULT_RUNS,
                   help="gpt.py presets, each optionally @mesh (default: " + " ".join(DEFAULT_RUNS) + ")")
    p.add_argument("--model", default="examples/gpt.py", help="model file, relative to the repo root")
    p.add_argument("--mesh", default="1", help="the mesh of a run that names none")
    p.add_argument("--json", help="also write the rows to this JSON file")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one compile may take (default 1800)")
    p.add_argument("--depth", default="1.3b@1", metavar="PRESET@MESH",
                   help="the depth check: this preset compiled with its layers and with twice as many "
                        "(default 1.3b@1); ratio= is the second's compiler time over the first's")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="sbpc-compile-bench-") as outdir:
        for run in args.runs:
            preset, _, mesh = run.partition("@")
            rows.append(compile_once(preset, args.model, mesh or args.mesh, outdir, args.timeout))
            print(f"compiled {run}: {rows[-1]['wall_s']:.1f}s", file=sys.stderr, flush=True)
        preset, _, mesh = args.depth.partition("@")
        layers = preset_layers(args.model, preset)
        depth = [compile_once(preset, args.model, mesh or args.mesh, outdir, args.timeout, layers=n)
                 for n in (layers, 2 * layers)]
    print(f"sbpc compile {args.model} --set preset=P --mesh M (one fresh process per run)")
    print_table(rows + depth)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows + depth, f, indent=2)
    # Compile time should not grow with the number of identical layers (issue 12 asks < 1.2 for 2x the depth).
    print(f"depth: {preset} with {layers} layers {depth[0]['sbpc_total_s']:.1f}s, with {2 * layers} "
          f"{depth[1]['sbpc_total_s']:.1f}s of compiler time")
    print(f"ratio={depth[1]['sbpc_total_s'] / depth[0]['sbpc_total_s']:.2f}")
    return 0


def preset_layers(model: str, preset: str) -> int:
    """The layer count of a gpt.py preset (its PRESETS table)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_model", os.path.join(REPO, model))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.PRESETS[preset]["layers"]


if __name__ == "__main__":
    sys.exit(main())
