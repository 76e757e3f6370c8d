"""`sbpc-run` (and `sbpc run`): execute a compiled plan. Needs torch and pydantic only."""
from __future__ import annotations

import argparse
import os
import sys
import time

from sbpc.errors import SbpcError, UsageError, guarded_main


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line with a hint and exit code 2, like every sbpc error."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message}; hint: see {self.prog} --help", file=sys.stderr)
        sys.exit(2)


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", help="plan JSON written by `sbpc compile`")
    p.add_argument("--steps", type=int, default=10, help="training steps to run (default 10)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weight init and the synthetic batches")
    p.add_argument("--backend", default="cpu", help="cpu (torch CPU + gloo, the default) or cuda (torch CUDA + NCCL "
                                                    "through CuPy, one process per GPU; pip install -e '.[cuda]')")
    p.add_argument("--weights", help="start from this state_dict (.pt) or .safetensors file instead of the seeded init")
    p.add_argument("--save", help="write the final weights here (.pt or .safetensors), atomically")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: the cores divided among the ranks)")
    p.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                   help="a rank waiting longer than this for its peers (rendezvous or a collective) fails, "
                        "and the run ends naming the rank it waited for (default 300)")
    p.add_argument("--trace", metavar="FILE", help="write the run's timeline (Chrome/Perfetto JSON): a track per rank, "
                                                   "a slice per actor firing")


_PAYLOAD_KEYS = ("plan", "steps", "seed", "backend", "weights", "save", "threads", "timeout", "debug", "trace")


def run_command(args: argparse.Namespace, out=None) -> int:
    """Run a plan: in this process for a one-device plan, as this rank of an existing group
    under torchrun (RANK and WORLD_SIZE set), else by spawning one local process per rank."""
    from sbpc.runtime import dist
    from sbpc.runtime.plan import load_plan

    out = out or sys.stdout
    if args.steps < 0:
        raise UsageError(f"--steps {args.steps} is negative", hint="pass --steps 1 or more")
    if getattr(args, "timeout", 300.0) <= 0:
        raise UsageError(f"--timeout {args.timeout:g} must be positive", hint="pass the seconds a rank may wait, e.g. --timeout 300")
    from sbpc.runtime.files import check_output_path

    for flag, what in (("save", "weights (--save)"), ("trace", "trace (--trace)")):
        if getattr(args, flag, None):
            check_output_path(getattr(args, flag), what)
    plan = load_plan(args.plan)
    check_backend(getattr(args, "backend", "cpu"), plan.world_size, plan)
    if plan.pipeline is not None:
        from sbpc.runtime.pipeline import check_order

        check_order(plan)
    if args.weights:
        from sbpc.runtime.weights import check_weights_path

        check_weights_path(args.weights)
    if dist.under_torchrun():
        world = dist.env_world_size()
        if world != plan.world_size:
            raise dist.world_size_mismatch(plan.world_size, world)
        if world > 1:
            return _join_group(args, plan, out)
    elif plan.world_size > 1:
        return _spawn(args, plan, out)
    train(args, plan, None, out)
    return 0


def check_backend(name: str, ranks: int, plan=None) -> None:
    """Refuse an unknown backend, or cuda on a machine that cannot run it (or a plan it would
    run wrong), before any rank starts."""
    from sbpc.runtime.backend import check_backend_name

    check_backend_name(name)
    if name == "cuda":
        from sbpc.runtime.cuda import require_cuda, require_fifo_transfers

        require_cuda(ranks)
        if plan is not None:
            require_fifo_transfers(plan)


def train(args: argparse.Namespace, plan, communicator, out) -> dict:
    """The training loop of one rank (the only one when ``communicator`` is None). Prints to
    ``out`` unless it is None; every rank must call it (gathers are collectives)."""
    import torch

    from sbpc.runtime.backend import make_backend
    from sbpc.runtime.precision import LOSS_SCALE, SKIPPED_STEPS
    from sbpc.runtime.runner import BatchSource, make_runner, step_seed
    from sbpc.runtime.weights import load_weights, save_weights

    if args.threads:
        torch.set_num_threads(args.threads)
    topology = communicator.topology if communicator is not None else None
    backend = make_backend(args.backend, communicator, topology)
    weights = load_weights(args.weights, plan) if args.weights else None
    runner = make_runner(plan, backend, seed=args.seed, weights=weights)
    weights = None
    batches = BatchSource(plan, args.seed)
    losses = []
    start = time.perf_counter()
    for step in range(args.steps):
        result = runner.step(batches(step), rng_seed=step_seed(args.seed, step))
        losses.append(result.loss)
        if out is not None:
            print(f"step {step}: loss {result.loss:.6f}", file=out, flush=True)
    elapsed = time.perf_counter() - start
    if args.steps and out is not None:
        print(f"{args.steps} steps in {elapsed:.2f}s ({args.steps / elapsed:.2f} steps/s)", file=out, flush=True)
    skipped = None
    if plan.precision.loss_scaling is not None:  # fp16: the scaler's states, whole on every rank
        states = runner.logical_states()  # a collective: every rank takes part
        skipped = int(states[SKIPPED_STEPS])
        if out is not None:
            print(f"fp16 loss scaling: {skipped} of {runner.steps} steps skipped (gradients overflowed); "
                  f"loss scale {float(states[LOSS_SCALE]):g}", file=out, flush=True)
    if getattr(args, "trace", None):
        _write_trace(args.trace, runner, backend, out)
    if args.save:
        state = runner.logical_weights()  # every rank takes part in the gathers
        if backend.communicator.rank == 0:
            save_weights({k: v.detach().cpu() for k, v in state.items()}, args.save)
            if out is not None:
                print(f"saved weights to {args.save}", file=out, flush=True)
    return {"losses": losses, "seconds": elapsed, "skipped_steps": skipped}


def _write_trace(path: str, runner, backend, out) -> None:
    """Rank 0 writes every rank's firings (a gather: every rank calls this)."""
    from sbpc.runtime.trace import Span, write_trace

    mine = [Span(backend.communicator.rank, f.task, f.start, f.end, f.step, f.stream) for f in runner.firings]
    parts = backend.communicator.gather_objects(mine, 0)
    if parts is None:
        return
    origin = min((s.start for part in parts for s in part), default=0.0)
    spans = [Span(s.track, s.name, s.start - origin, s.end - origin, s.step, s.stream) for part in parts for s in part]
    coords = lambda r: ", ".join(f"{k}={v}" for k, v in runner.plan.coords(r).items())
    write_trace(path, spans, {r: f"rank {r} ({coords(r)})" for r in range(runner.plan.world_size)})
    if out is not None:
        print(f"wrote the timeline of {len(spans)} actor firings to {path}", file=out, flush=True)


def run_rank(payload: dict) -> dict:
    """Launch target of ``sbpc run``'s spawned ranks: join the mesh and train; rank 0 prints."""
    from sbpc.runtime import dist
    from sbpc.runtime.plan import load_plan

    args = argparse.Namespace(**payload)
    plan = load_plan(args.plan)
    comm = dist.init_distributed(plan, timeout=args.timeout, backend=args.backend)
    return train(args, plan, comm, sys.stdout if comm.rank == 0 else None)


def _spawn(args: argparse.Namespace, plan, out) -> int:
    from sbpc.runtime.launch import launch

    payload = {k: getattr(args, k, None) for k in _PAYLOAD_KEYS}
    payload["timeout"] = getattr(args, "timeout", 300.0)

    def show(rank: int, line: str) -> None:
        (out if rank == 0 else sys.stderr).write(line if rank == 0 else f"[rank {rank}] {line}")
        (out if rank == 0 else sys.stderr).flush()

    launch(plan.world_size, "sbpc.runtime.cli:run_rank", payload, timeout=payload["timeout"], on_output=show,
           echo_stderr=bool(getattr(args, "debug", False)), threads=args.threads)
    return 0


def _join_group(args: argparse.Namespace, plan, out) -> int:
    """Under torchrun: this process is one rank; join the group instead of spawning."""
    from sbpc.runtime import dist

    rank = int(os.environ["RANK"])
    try:
        comm = dist.init_distributed(plan, timeout=getattr(args, "timeout", 300.0), backend=args.backend)
        train(args, plan, comm, out if comm.rank == 0 else None)
    except BaseException as err:
        dist.report_failure(rank, err)
        if isinstance(err, SbpcError) and not getattr(err, "secondary", False):
            err.message = f"rank {rank}: {err.message}"  # torchrun interleaves the ranks' stderr
        raise
    dist.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="sbpc-run", description="Run a compiled sbpc plan.")
    add_run_arguments(p)
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    args = p.parse_args(argv)
    return guarded_main(lambda: run_command(args), args.debug, prog="sbpc-run")


if __name__ == "__main__":
    sys.exit(main())
