"""Where the step time of a plan goes on 2 gloo ranks: cProfile of rank 0's timed steps.

    .venv/bin/python bench/profile_step.py out/plan.json [--steps 30]

Each rank runs ``--warmup`` steps, then ``--steps`` steps under cProfile (rank 0's profile is
printed: the top functions by own time, and the split into compute kernels (torch's C++
operators), communication (gloo's calls: issue and wait, which includes waiting for
the peer) and the rest, the Python of the runner and the generated program).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time


def worker(payload: dict) -> dict:
    from sbpc.runtime.backend import make_backend
    from sbpc.runtime.dist import init_distributed
    from sbpc.runtime.plan import load_plan
    from sbpc.runtime.runner import BatchSource, make_runner

    plan = load_plan(payload["plan"])
    comm = init_distributed(plan, timeout=300)
    runner = make_runner(plan, make_backend("cpu", comm, comm.topology), seed=0)
    make = BatchSource(plan, 0)
    batches = [make(i) for i in range(payload["warmup"] + payload["steps"])]
    for b in batches[:payload["warmup"]]:
        runner.step(b)
    comm.barrier()
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    for b in batches[payload["warmup"]:]:
        runner.step(b)
    prof.disable()
    seconds = time.perf_counter() - start
    comm.barrier()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(25)
    # kernels: the time inside torch's C++ operators and tensor methods (own time of the builtins);
    # communication: gloo's own calls (issue and wait), which include waiting for the peer
    comm = kern = 0.0
    for (file, _, name), (_, _, tt, _, _) in stats.stats.items():
        if "_distributed_c10d" in name:
            comm += tt
        elif file == "~" and ("torch._ops." in name or "torch._C.TensorBase" in name or "built-in method torch." in name):
            kern += tt  # the C++ operators (the executor calls them directly) and tensor methods
    total = stats.total_tt
    buckets = {"communication (gloo)": comm, "kernels (torch C++ ops)": kern, "python (runner, program)": total - comm - kern}
    return {"seconds": seconds, "text": out.getvalue(), "buckets": buckets}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("plan")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    from sbpc.runtime.launch import launch
    from sbpc.runtime.plan import load_plan

    world = load_plan(args.plan).world_size
    res = launch(world, "profile_step:worker", {"plan": args.plan, "steps": args.steps, "warmup": args.warmup},
                 timeout=300, threads=1)
    r0 = res[0]
    print(r0["text"])
    ms = r0["seconds"] / args.steps * 1e3
    print(f"{ms:.2f} ms/step (profiled; rank 0)")
    total = sum(r0["buckets"].values())
    for k, v in r0["buckets"].items():
        print(f"  {k:>24}: {v / args.steps * 1e3:7.2f} ms/step ({v / total:5.1%})")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
