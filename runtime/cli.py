"""`sbpc-run` (and `sbpc run`): execute a compiled plan. Needs torch and pydantic only."""
from __future__ import annotations

import argparse
import sys
import time

from sbpc.errors import UsageError, guarded_main


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line with a hint and exit code 2, like every sbpc error."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message}; hint: see {self.prog} --help", file=sys.stderr)
        sys.exit(2)


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", help="plan JSON written by `sbpc compile`")
    p.add_argument("--steps", type=int, default=10, help="training steps to run (default 10)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weight init and the synthetic batches")
    p.add_argument("--backend", default="cpu", help="kernel + communication backend (default cpu)")
    p.add_argument("--weights", help="start from this state_dict (.pt) or .safetensors file instead of the seeded init")
    p.add_argument("--save", help="write the final weights here (.pt or .safetensors), atomically")
    p.add_argument("--threads", type=int, help="torch intra-op threads")


def run_command(args: argparse.Namespace, out=sys.stdout) -> int:
    import torch

    from sbpc.runtime.backend import make_backend
    from sbpc.runtime.plan import load_plan
    from sbpc.runtime.runner import BatchSource, Runner, step_seed
    from sbpc.runtime.weights import load_weights, save_weights

    if args.steps < 0:
        raise UsageError(f"--steps {args.steps} is negative", hint="pass --steps 1 or more")
    if args.threads:
        torch.set_num_threads(args.threads)
    plan = load_plan(args.plan)
    backend = make_backend(args.backend)
    weights = load_weights(args.weights, plan) if args.weights else None
    runner = Runner(plan, backend, seed=args.seed, weights=weights)
    batches = BatchSource(plan, args.seed)
    start = time.perf_counter()
    for step in range(args.steps):
        result = runner.step(batches(step), rng_seed=step_seed(args.seed, step))
        print(f"step {step}: loss {result.loss:.6f}", file=out)
    elapsed = time.perf_counter() - start
    if args.steps:
        print(f"{args.steps} steps in {elapsed:.2f}s ({args.steps / elapsed:.2f} steps/s)", file=out)
    if args.save:
        save_weights(runner.weights(), args.save)
        print(f"saved weights to {args.save}", file=out)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="sbpc-run", description="Run a compiled sbpc plan.")
    add_run_arguments(p)
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    args = p.parse_args(argv)
    return guarded_main(lambda: run_command(args), args.debug, prog="sbpc-run")


if __name__ == "__main__":
    sys.exit(main())
