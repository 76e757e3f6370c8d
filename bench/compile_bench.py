"""Compile wall time, peak RSS and plan size of examples/gpt.py presets (mesh 1).

Each compile runs as `sbpc compile` in a fresh process; the parent waits for it with
os.wait4, so the peak RSS is that child's own ru_maxrss. Wall time includes interpreter
start and `import torch` (4-6 s here); `sbpc total` is the compiler's own timer
(capture + passes + lowering), read from the command's output.

    .venv/bin/python bench/compile_bench.py            # tiny 1.3b 1t
    .venv/bin/python bench/compile_bench.py small 175b
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
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sbpc_command() -> str:
    """The `sbpc` console script of this interpreter's environment."""
    here = os.path.join(os.path.dirname(sys.executable), "sbpc")
    found = here if os.path.exists(here) else shutil.which("sbpc")
    if not found:
        sys.exit("compile_bench: no `sbpc` console script next to this python or on PATH")
    return found


def compile_once(preset: str, model: str, mesh: str, outdir: str) -> dict:
    """Run one compile in a fresh process; return its wall time, peak RSS and plan figures."""
    plan_path = os.path.join(outdir, f"{preset}.json")
    cmd = [sbpc_command(), "compile", model, "--set", f"preset={preset}", "--mesh", mesh, "-o", plan_path]
    with tempfile.TemporaryFile("w+") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)  # Popen must not wait again
        log.seek(0)
        output = log.read()
    if proc.returncode != 0:
        sys.exit(f"compile_bench: `{' '.join(cmd)}` failed (exit {proc.returncode}):\n{output}")
    with open(plan_path) as f:
        estimates = json.load(f)["estimates"]
    total = re.search(r"total ([0-9.]+)s", output)
    return {
        "preset": preset,
        "wall_s": wall,
        "sbpc_total_s": float(total.group(1)) if total else float("nan"),
        "peak_rss_mb": usage.ru_maxrss / 1024,  # Linux reports KiB
        "plan_mb": os.path.getsize(plan_path) / 1e6,
        "instructions": estimates["instructions"],
        "params": estimates["param_count"],
    }


def print_table(rows: list[dict]) -> None:
    print(f"{'preset':>8} {'wall s':>8} {'sbpc total s':>13} {'peak RSS MB':>12} {'plan MB':>8} "
          f"{'instructions':>13} {'parameters':>19}")
    for r in rows:
        print(f"{r['preset']:>8} {r['wall_s']:8.1f} {r['sbpc_total_s']:13.1f} {r['peak_rss_mb']:12.0f} "
              f"{r['plan_mb']:8.2f} {r['instructions']:13,} {r['params']:19,}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("presets", nargs="*", default=["tiny", "1.3b", "1t"], help="gpt.py presets (default: tiny 1.3b 1t)")
    p.add_argument("--model", default="examples/gpt.py", help="model file, relative to the repo root")
    p.add_argument("--mesh", default="1")
    p.add_argument("--json", help="also write the rows to this JSON file")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="sbpc-compile-bench-") as outdir:
        for preset in args.presets:
            rows.append(compile_once(preset, args.model, args.mesh, outdir))
            print(f"compiled {preset}: {rows[-1]['wall_s']:.1f}s", file=sys.stderr, flush=True)
    print(f"sbpc compile {args.model} --mesh {args.mesh} (one fresh process per preset)")
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
