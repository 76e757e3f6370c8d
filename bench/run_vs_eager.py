"""Training steps/s of an sbpc plan vs eager PyTorch: same model, batches, AdamW and threads.

One process. Both sides start from the same seeded weights and step through the same
pre-generated batches (made with BatchSource outside the timed region). A timed block is a
run of training steps of one side and nothing else (`--steps`, or as many as fill
`--block-seconds` after warm-up):

  plan   runner.step(batch)        (forward, backward, AdamW update; returns the loss as float)
  eager  loss = model(*batch); loss.backward(); opt.step(); opt.zero_grad(set_to_none=True);
         float(loss)               (float(loss) mirrors the plan returning its loss)

Eager's gradients are dropped at the end of its step, as the plan's are (the runner returns
them and lets them go), not at the start of the next: the work is the same, but gradients kept
between steps stay where eager's backward put them, among the freed activations, while the
other sides step, and in one process a side that steps in between finds the heap cut up by
them and grows it, faulting fresh pages every step (about 400 a step on the plan in mid, none
once no side keeps memory between its steps).

Blocks are interleaved over `--rounds` rounds, alternating which side goes first, and the
median block of each side is reported. The ratio is plan step time / eager step time
(1.00 = parity, above 1 = the plan is slower). The last line, ``ratio=<value>``, is the other way
round as issue 11 asks: plan steps/s / eager-with-fused-AdamW steps/s of the worst config
(at least 1.0 = the plan is at least as fast everywhere). The ratio of the
fastest blocks is printed too: on a shared box it is less disturbed by other processes.

Eager optimizers: `single` is AdamW(foreach=False), the path the plan reproduces bit for bit
and also torch's default on CPU (torch only defaults to foreach on cuda/xpu); `foreach` and
`fused` are AdamW(foreach=True) and AdamW(fused=True), torch's faster CPU paths.

With no --set, two configs run: gpt.py tiny (batch 4) and a mid-sized GPT (4 layers, hidden
256, seq 128, batch 8) where kernels dominate per-op overhead.
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from sbpc.compiler.driver import compile_model
from sbpc.compiler.ir.mesh import parse_mesh
from sbpc.compiler.frontend.model_loader import load_model, parse_sets
from sbpc.compiler.frontend.optim import OptimizerConfig
from sbpc.compiler.passes import default_pipeline
from sbpc.runtime.backend import make_backend
from sbpc.runtime.runner import BatchSource, Runner

GPT = os.path.relpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "gpt.py"))
MID = ["preset=tiny", "layers=4", "hidden=256", "heads=8", "seq=128"]
DEFAULT_CONFIGS = [("tiny", [], 4), ("mid", MID, 8)]  # name, --set values, batch size
EAGER_OPTIMIZERS = {"single": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}
MIN_STEPS, MAX_STEPS = 1, 50  # bounds of the steps per block that --block-seconds picks


def plan_stepper(source, batch_size: int, opt: OptimizerConfig, functional: bool = False):
    """``functional``: the plan without the inplace pass (its update allocates every new value
    and runs one op per parameter), to see that pass's effect side by side."""
    passes = [p for p in default_pipeline() if p.name != "inplace"] if functional else None
    plan = compile_model(source, parse_mesh("1"), batch_size=batch_size, optimizer=opt, passes=passes).plan
    runner = Runner(plan, make_backend("cpu"), seed=0)
    return plan, runner.step


def eager_stepper(source, opt: OptimizerConfig, variant: str):
    torch.manual_seed(0)
    model = source.build().train()
    params = [p for p in model.parameters() if p.requires_grad]
    if variant == "single":
        optimizer = opt.torch_optimizer(params)  # foreach=False: the path the plan matches
    else:
        optimizer = torch.optim.AdamW(params, lr=opt.lr, betas=opt.betas, eps=opt.eps,
                                      weight_decay=opt.weight_decay, **EAGER_OPTIMIZERS[variant])

    def step(batch):
        loss = model(*batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)  # here, not first: nothing of the step outlives it (module doc)
        return float(loss.detach())

    return step


@dataclass(frozen=True)
class Block:
    """One timed block, per step: wall seconds, CPU seconds of the process (the load disturbs it
    less) and minor page faults (memory the allocator had handed back, touched again)."""
    wall: float
    cpu: float
    faults: float


def time_block(step, batches) -> Block:
    """One block of steps; only the steps are inside the timers."""
    faults, cpu, start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.process_time(), time.perf_counter()
    for batch in batches:
        step(batch)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return Block(wall / len(batches), cpu / len(batches), faults / len(batches))


def measure(sides: dict, warm: list, batches: list, args) -> tuple[dict, dict, dict, int, float]:
    """Warm every side up, then interleave timed blocks.

    Returns the median and the best block's s/step of each side, each side's median block
    (``Block``: wall, CPU, faults), the steps per block and the slowest warm-up s/step."""
    for step in sides.values():
        time_block(step, warm)
    slowest = max(time_block(step, warm[-1:]).wall for step in sides.values())  # one warm step each, to size blocks
    steps = args.steps or min(max(MIN_STEPS, round(args.block_seconds / slowest)), MAX_STEPS)
    blocks = {side: [] for side in sides}
    order = list(sides)
    for _ in range(args.rounds):
        for side in order:
            blocks[side].append(time_block(sides[side], batches[:steps]))
        order.reverse()
    med = {side: statistics.median(b.wall for b in bs) for side, bs in blocks.items()}
    usage = {side: Block(med[side], statistics.median(b.cpu for b in bs), statistics.median(b.faults for b in bs))
             for side, bs in blocks.items()}
    return med, {side: min(b.wall for b in bs) for side, bs in blocks.items()}, usage, steps, slowest


def bench_config(name: str, sets: list[str], batch_size: int, args) -> list[tuple]:
    opt = OptimizerConfig()
    source = load_model(args.model, parse_sets(sets))
    plan, plan_step = plan_stepper(source, batch_size, opt)
    make = BatchSource(plan, 0)
    warm = [make(i) for i in range(args.warmup)]
    batches = [make(args.warmup + i) for i in range(args.steps or MAX_STEPS)]
    sides = {"plan": plan_step, **({"plan functional": plan_stepper(source, batch_size, opt, functional=True)[1]}
                                   if args.functional else {}),
             **{f"eager {v}": eager_stepper(source, opt, v) for v in args.eager}}
    rows, first = [], None
    for threads in args.threads:
        torch.set_num_threads(threads)
        med, best, usage, steps, slowest = measure(sides, warm, batches, args)
        first = first or (threads, slowest)
        if threads > first[0] and slowest > 1.5 * first[1]:
            print(f"warning: warm-up at {threads} threads is {slowest / first[1]:.0f}x slower than at {first[0]}; "
                  "other processes hold the cores, so these figures are mostly scheduling noise", flush=True)
        rows += [(name, batch_size, threads, steps, side, med[side], med["plan"] / med[side], usage[side]) for side in sides]
        print_ratios(f"{name}, {threads} thread(s), {args.rounds} x {steps} steps", med, best, args.eager)
    return rows


def print_ratios(label: str, med: dict, best: dict, variants: list[str]) -> None:
    if "plan functional" in med:
        print(f"[{label}] plan/plan-functional step-time ratio = {med['plan'] / med['plan functional']:.2f} "
              f"(best blocks {best['plan'] / best['plan functional']:.2f}), the inplace pass's effect", flush=True)
    for v in variants:
        side = f"eager {v}"
        note = " = the path the plan matches" if v == "single" else ""
        print(f"[{label}] plan/eager step-time ratio = {med['plan'] / med[side]:.2f} "
              f"(best blocks {best['plan'] / best[side]:.2f}), eager AdamW {v}{note}", flush=True)


def print_table(rows) -> None:
    print(f"\n{'config':>6} {'batch':>5} {'threads':>7} {'steps':>5} {'side':>14} {'ms/step':>9} {'steps/s':>8} "
          f"{'plan/this':>9} {'cpu ms':>8} {'faults':>7}")
    for name, batch, threads, steps, side, sec, ratio, use in rows:
        print(f"{name:>6} {batch:>5} {threads:>7} {steps:>5} {side:>14} {sec * 1e3:9.2f} {1 / sec:8.1f} {ratio:9.2f} "
              f"{use.cpu * 1e3:8.2f} {use.faults:7.0f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=GPT, help="model file (default: the repo's examples/gpt.py)")
    p.add_argument("--set", dest="sets", action="append", metavar="KEY=VALUE",
                   help="model setting (repeatable); when given, only this config runs")
    p.add_argument("--batch-size", type=int, help="batch size (default 4 for tiny, 8 for mid)")
    p.add_argument("--steps", type=int, help="timed steps per block (default: as many as fit --block-seconds, "
                                             f"{MIN_STEPS} to {MAX_STEPS})")
    p.add_argument("--block-seconds", type=float, default=0.5, help="target length of a timed block (default 0.5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per side and thread count (default 2)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds of blocks (default 5)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch thread counts (default 1 2)")
    p.add_argument("--functional", action="store_true",
                   help="also time the plan compiled without the inplace pass (before/after in one run)")
    p.add_argument("--eager", nargs="+", choices=list(EAGER_OPTIMIZERS), default=list(EAGER_OPTIMIZERS),
                   help="eager AdamW variants (default: single foreach fused)")
    args = p.parse_args(argv)
    if args.warmup < 1 or args.rounds < 1 or (args.steps is not None and args.steps < 1):
        p.error("--warmup, --rounds and --steps must be at least 1")
    if "single" not in args.eager:
        args.eager.insert(0, "single")
    configs = [("custom", args.sets, args.batch_size or 4)] if args.sets else \
        [(n, s, args.batch_size or b) for n, s, b in DEFAULT_CONFIGS]
    print(f"torch {torch.__version__}, {os.cpu_count()} cpus, load average {os.getloadavg()[0]:.2f} at start")
    rows = []
    for name, sets, batch_size in configs:
        print(f"== {name}: {args.model} {' '.join('--set ' + s for s in sets)} --batch-size {batch_size}", flush=True)
        rows += bench_config(name, sets, batch_size, args)
    print_table(rows)
    print(f"load average {os.getloadavg()[0]:.2f} at end (a busy box distorts the 2-thread figures most)")
    # the acceptance figure: steps/s of the plan over eager's with fused AdamW (the fastest eager
    # optimizer, else the last one asked for), the worst config and thread count
    ref = "eager fused" if "fused" in args.eager else f"eager {args.eager[-1]}"
    print(f"ratio={min(1 / r[6] for r in rows if r[4] == ref):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
