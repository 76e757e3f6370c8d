"""Training steps/s of an sbpc data-parallel plan (mesh 2x1) vs torch DDP: 2 ranks over gloo.

Same model (examples/gpt.py), same global batch, same seeded weights and batches, same AdamW
(lr 1e-3, betas 0.9/0.999, eps 1e-8, wd 0.01, single-tensor algorithm) and 1 torch thread per
rank on both sides. The plan is compiled once in this process (``compile_model``, mesh ``2x1``,
``--batch-size`` = the global batch) and saved to a temporary file; then each side runs as its
own ``sbpc.runtime.launch.launch(2, ...)`` of two fresh processes joined over gloo:

  plan  Runner(plan, make_backend("cpu", comm, comm.topology), seed=0); a step is
        runner.step(batch): forward, backward, the gradient all-reduces, AdamW, and the loss
        (the global mean) returned as a float. The runner cuts its half of the global batch.
  ddp   torch.manual_seed(0); DistributedDataParallel(build_model()); AdamW(foreach=False)
        (= OptimizerConfig().torch_optimizer, torch's CPU default; with --ddp-fused
        AdamW(fused=True), the kernel the plan's update runs since the fuse-adamw pass). A step is opt.zero_grad(set_to_none=True); loss = ddp(idx, targets) on this
        rank's half of the global batch (batch/2 rows); loss.backward(); opt.step(); then one
        scalar all-reduce of the detached loss and float() of it, so that DDP too ends the
        step holding the global mean loss as a float, as runner.step does.

Batches are the plan's ``BatchSource(plan, 0)`` (``example_batch`` of the global batch),
generated before timing. Each rank runs ``--warmup`` untimed steps, ``comm.barrier()``, the
``--steps`` timed steps, ``barrier()`` again; a run's time is the slowest rank's. Sides
alternate over ``--rounds`` launches (plan first, then DDP first, ...) and the median run of
each side is reported, with the ratio plan steps/s / DDP steps/s (above 1: the plan is
faster). The step-0 losses of both sides are printed as a check that they train the same
thing (they agree to ~1e-6).

With no --set, two configs run: gpt.py tiny (batch 8) and mid (--set hidden=128 --set
layers=2 --set seq=64, batch 16).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

GPT = os.path.relpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "gpt.py"))
MID = ["preset=tiny", "hidden=128", "layers=2", "seq=64"]
DEFAULT_CONFIGS = [("tiny", ["preset=tiny"], 8), ("mid", MID, 16)]  # name, --set values, global batch
TIMEOUT = 300.0


# --- shared by tp_vs_dtensor.py -------------------------------------------------------------

def compile_plan(model: str, sets: list[str], mesh: str, batch_size: int, tmpdir: str, config: str | None = None) -> str:
    """Compile ``model`` for ``mesh`` (AdamW defaults) and save the plan; returns its path."""
    from sbpc.compiler.driver import compile_model
    from sbpc.compiler.frontend.hints import load_config
    from sbpc.compiler.ir.mesh import parse_mesh
    from sbpc.compiler.frontend.model_loader import load_model, parse_sets
    from sbpc.compiler.frontend.optim import OptimizerConfig
    from sbpc.runtime.plan import save_plan

    start = time.perf_counter()
    plan = compile_model(load_model(model, parse_sets(sets)), parse_mesh(mesh), batch_size=batch_size,
                         optimizer=OptimizerConfig(), config=load_config(config) if config else None).plan
    path = os.path.join(tmpdir, f"plan-{mesh}-{len(os.listdir(tmpdir))}.json")
    save_plan(plan, path)
    print(f"compiled mesh {mesh}{' with ' + config if config else ''} in {time.perf_counter() - start:.1f}s", flush=True)
    return path


def time_steps(step, batches: list, warmup: int, barrier) -> tuple[float, list[float]]:
    """``warmup`` untimed steps, barrier, the rest timed, barrier. Returns (seconds, losses)."""
    losses = [step(b) for b in batches[:warmup]]
    barrier()
    start = time.perf_counter()
    losses += [step(b) for b in batches[warmup:]]
    barrier()
    return time.perf_counter() - start, losses


def plan_worker(payload: dict) -> dict:
    """Launch target: one rank of the sbpc plan (pipelined or not)."""
    from sbpc.runtime.backend import make_backend
    from sbpc.runtime.dist import init_distributed
    from sbpc.runtime.plan import load_plan
    from sbpc.runtime.runner import BatchSource, make_runner

    plan = load_plan(payload["plan"])
    comm = init_distributed(plan, timeout=payload["timeout"])
    runner = make_runner(plan, make_backend("cpu", comm, comm.topology), seed=0)
    make = BatchSource(plan, 0)
    batches = [make(i) for i in range(payload["warmup"] + payload["steps"])]
    seconds, losses = time_steps(lambda b: runner.step(b).loss, batches, payload["warmup"], comm.barrier)
    return {"seconds": seconds, "losses": losses}


def run_side(target: str, payload: dict, world: int = 2) -> dict:
    """Launch ``world`` ranks (1 thread each) on ``target``; the run's time is its slowest rank's."""
    from sbpc.runtime.launch import launch

    results = launch(world, target, payload, timeout=payload["timeout"], threads=1)
    return {"seconds": max(r["seconds"] for r in results), "losses": results[0]["losses"]}


def bench_sides(sides: dict[str, tuple[str, dict]], rounds: int, steps: int, world: int = 2) -> dict[str, dict]:
    """Launch each side ``rounds`` times on ``world`` ranks, alternating the order; per side the
    median s/step, the best s/step, rank 0's losses of the first run and every run's s/step."""
    runs = {name: [] for name in sides}
    order = list(sides)
    for r in range(rounds):
        for name in order:
            target, payload = sides[name]
            res = run_side(target, payload, world)
            runs[name].append(res)
            print(f"  round {r + 1} {name:>8}: {steps / res['seconds']:7.3f} steps/s "
                  f"({res['seconds'] / steps * 1e3:.2f} ms/step), load {os.getloadavg()[0]:.2f}", flush=True)
        order.reverse()
    return {name: {"median": statistics.median(x["seconds"] for x in rs) / steps,
                   "best": min(x["seconds"] for x in rs) / steps,
                   "losses": rs[0]["losses"],
                   "runs_s_per_step": [x["seconds"] / steps for x in rs]} for name, rs in runs.items()}


def print_table(rows: list[tuple], peer: str) -> None:
    """rows: (config, batch, side, median s/step, best s/step, ratio vs peer of the medians, of the bests)."""
    print(f"\n{'config':>6} {'batch':>5} {'side':>8} {'ms/step':>9} {'steps/s':>8} {'best steps/s':>12} "
          f"{'plan/' + peer + ' steps/s':>18}")
    for name, batch, side, med, best, ratio, best_ratio in rows:
        r = f"{ratio:.2f} (best {best_ratio:.2f})" if side == "plan" else ""
        print(f"{name:>6} {batch:>5} {side:>8} {med * 1e3:9.2f} {1 / med:8.2f} {1 / best:12.2f} {r:>18}")


def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=GPT, help="model file (default: the repo's examples/gpt.py)")
    p.add_argument("--set", dest="sets", action="append", metavar="KEY=VALUE",
                   help="model setting (repeatable); when given, only this config runs")
    p.add_argument("--batch-size", type=int, help="global batch size (default 8 for tiny, 16 for mid)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per run (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before them (default 3)")
    p.add_argument("--rounds", type=int, default=2, help="launches per side, order alternating (default 2)")
    p.add_argument("--timeout", type=float, default=TIMEOUT, help="rendezvous/collective timeout in seconds")


def check_args_and_announce(p: argparse.ArgumentParser, args) -> None:
    """Refuse nonsensical counts, then print what the run is (the load matters on a shared box)."""
    if args.steps < 1 or args.warmup < 1 or args.rounds < 1:
        p.error("--steps, --warmup and --rounds must be at least 1")
    import torch

    print(f"torch {torch.__version__}, {os.cpu_count()} cpus, load average {os.getloadavg()[0]:.2f} at start; "
          f"2 ranks x 1 thread, {args.warmup} warm-up + {args.steps} timed steps, {args.rounds} rounds", flush=True)


def compare_sides(name: str, batch: int, res: dict, peer: str) -> list[tuple]:
    """Print both sides' first and last losses (they train the same model), and the table rows."""
    print(f"  step-0 loss: plan {res['plan']['losses'][0]:.6f}, {peer} {res[peer]['losses'][0]:.6f}; "
          f"last: plan {res['plan']['losses'][-1]:.6f}, {peer} {res[peer]['losses'][-1]:.6f}", flush=True)
    return [(name, batch, side, res[side]["median"], res[side]["best"],
             res[peer]["median"] / res["plan"]["median"], res[peer]["best"] / res["plan"]["best"])
            for side in ("plan", peer)]


def configs_of(args) -> list[tuple[str, list[str], int]]:
    if args.sets:
        return [("custom", args.sets, args.batch_size or 8)]
    return [(n, s, args.batch_size or b) for n, s, b in DEFAULT_CONFIGS]


# --- DDP ----------------------------------------------------------------------------------

def ddp_worker(payload: dict) -> dict:
    """Launch target: one rank of torch DDP on the same model, batches and AdamW."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from sbpc.compiler.frontend.optim import OptimizerConfig
    from sbpc.runtime.model_file import import_model_file
    from sbpc.runtime.plan import load_plan
    from sbpc.runtime.runner import BatchSource

    plan = load_plan(payload["plan"])  # for the model file, its --set values and the batches only
    rank, world = dist.get_rank(), dist.get_world_size()
    module = import_model_file(plan.model.path, "_bench_ddp_")
    torch.manual_seed(0)
    model = module.build_model(**plan.model.sets).train()
    ddp = DistributedDataParallel(model, bucket_cap_mb=payload.get("bucket_mb", 25.0))
    # AdamW foreach=False (single-tensor), or with --ddp-fused torch's fused kernel, the one the plan's update runs
    opt = OptimizerConfig().torch_optimizer([p for p in ddp.parameters() if p.requires_grad],
                                            fused=payload.get("ddp_fused", False))
    make = BatchSource(plan, 0)
    per_rank = plan.model.batch_size // world
    batches = [tuple(t[rank * per_rank:(rank + 1) * per_rank].contiguous() for t in make(i))
               for i in range(payload["warmup"] + payload["steps"])]

    def step(batch) -> float:
        opt.zero_grad(set_to_none=True)
        loss = ddp(*batch)
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)  # the global mean loss, as runner.step returns it
        return float(total) / world

    seconds, losses = time_steps(step, batches, payload["warmup"], dist.barrier)
    return {"seconds": seconds, "losses": losses}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p)
    p.add_argument("--ddp-bucket-mb", type=float, default=25.0,
                   help="DDP's bucket_cap_mb (default 25, torch's default: the models here fit one or two buckets; "
                        "a tiny value such as 0.0001 gives one all-reduce per gradient, as the plan does)")
    p.add_argument("--ddp-fused", action="store_true",
                   help="DDP steps with AdamW(fused=True), the kernel the plan's update is (fuse-adamw pass), "
                        "instead of the single-tensor AdamW")
    args = p.parse_args(argv)
    check_args_and_announce(p, args)
    rows = []
    with tempfile.TemporaryDirectory(prefix="sbpc-bench-") as tmp:
        for name, sets, batch in configs_of(args):
            if batch % 2:
                p.error(f"--batch-size {batch} must be even (DDP gives each of 2 ranks half)")
            print(f"== {name}: {args.model} {' '.join('--set ' + s for s in sets)} --batch-size {batch} (global)", flush=True)
            plan = compile_plan(args.model, sets, "2x1", batch, tmp)
            payload = {"plan": plan, "steps": args.steps, "warmup": args.warmup, "timeout": args.timeout,
                       "bucket_mb": args.ddp_bucket_mb, "ddp_fused": args.ddp_fused}
            res = bench_sides({"plan": ("dp_vs_ddp:plan_worker", payload), "ddp": ("dp_vs_ddp:ddp_worker", payload)},
                              args.rounds, args.steps)
            rows += compare_sides(name, batch, res, "ddp")
    print_table(rows, "ddp")
    print(f"load average {os.getloadavg()[0]:.2f} at end")
    print(f"ratio={min(r[5] for r in rows if r[2] == 'plan'):.2f}")  # plan/DDP steps/s, the worst config
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the ranks import this file as dp_vs_ddp
    sys.exit(main())
