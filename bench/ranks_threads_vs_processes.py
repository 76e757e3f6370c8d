"""`sbpc check` on spawned gloo processes vs in-process ranks (threads): seconds per check, the
compile left out (both modes compile the same plan; the tests pay it either way).

For each case the plan is compiled once here, then ``check_on_ranks`` runs it with
``ranks="processes"`` and with ``ranks="threads"`` (alternating which goes first over
``--rounds``); the median of each is printed with the ratio, and whether the two reports
agree bit for bit (they must on meshes whose axes have at most two devices).

    .venv/bin/python bench/ranks_threads_vs_processes.py              # 2x1 2x2 1x4 1x1x2/4 2x2x2/4
    .venv/bin/python bench/ranks_threads_vs_processes.py 2x2 --rounds 3
"""
from __future__ import annotations

import argparse
import statistics
import time

from sbpc.compiler.tools.compile_flags import pipeline_options
from sbpc.compiler.driver import compile_model
from sbpc.compiler.frontend.hints import load_config
from sbpc.compiler.frontend.model_loader import load_model
from sbpc.compiler.frontend.optim import OptimizerConfig
from sbpc.compiler.ir.mesh import parse_mesh
from sbpc.compiler.tools.check import check_on_ranks

CASES = ["2x1", "2x2", "1x4", "1x1x2/4", "2x2x2/4"]  # MESH or MESH/MICROBATCHES


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("cases", nargs="*", default=CASES)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args()
    optimizer = OptimizerConfig()
    print(f"{'case':>10}  {'compile s':>9}  {'processes s':>11}  {'threads s':>9}  {'ratio':>5}  same report")
    ratios = []
    for case in args.cases:
        mesh_text, _, m = case.partition("/")
        mesh = parse_mesh(mesh_text)
        config = load_config("examples/gpt.megatron.toml")
        ns = argparse.Namespace(microbatches=int(m) if m else None, schedule=None, virtual_stages=None)
        start = time.perf_counter()
        plan = compile_model(load_model("examples/gpt.py", {}), mesh, batch_size=8, optimizer=optimizer, config=config,
                             pipeline=pipeline_options(ns, mesh, config)).plan
        compile_s = time.perf_counter() - start
        times: dict[str, list[float]] = {"processes": [], "threads": []}
        tables: dict[str, str] = {}
        for r in range(args.rounds):
            for ranks in (("processes", "threads") if r % 2 == 0 else ("threads", "processes")):
                start = time.perf_counter()
                report = check_on_ranks(plan, optimizer, steps=args.steps, seed=0, tolerance=1e-5, ranks=ranks)
                times[ranks].append(time.perf_counter() - start)
                tables[ranks] = report.table()
        proc, thr = statistics.median(times["processes"]), statistics.median(times["threads"])
        ratios.append(proc / thr)
        print(f"{case:>10}  {compile_s:9.1f}  {proc:11.1f}  {thr:9.1f}  {proc / thr:5.1f}  "
              f"{'yes' if tables['processes'] == tables['threads'] else 'no'}", flush=True)
    print(f"ratio={min(ratios):.2f}")  # processes / threads wall time, the case threads gain least on


if __name__ == "__main__":
    main()
