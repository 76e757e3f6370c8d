"""`sbpc-run` (and `sbpc run`): execute a compiled plan. Needs torch and pydantic only."""
from __future__ import annotations

import argparse
import os
import sys

from sbpc.errors import SbpcError, UsageError, guarded_main
from sbpc.runtime.lr_schedule import DecayStyle, LrSchedule


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line with a hint and exit code 2, like every sbpc error."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message}; hint: see {self.prog} --help", file=sys.stderr)
        sys.exit(2)


def seed_arg(text: str) -> int:
    """``--seed``: an integer of magnitude below 2**32, where every seed derived from it
    (``step_seed``: about 2e6 times it) stays a 64-bit torch seed; a larger one overflowed in
    torch.manual_seed (an internal error)."""
    try:
        n = int(text)
    except ValueError:
        n = 2**32
    if not -(2**32) < n < 2**32:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer seed between -2**32 and 2**32 (e.g. 0, the default)")
    return n


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", help="plan JSON written by `sbpc compile`")
    p.add_argument("--lr", type=float, help="peak learning rate (default: the plan's compiled one)")
    add_train_arguments(p)


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of a training run, shared by `sbpc run` and `sbpc train` (docs/training.md)."""
    p.add_argument("--steps", type=int, default=10, help="training steps to run (default 10)")
    p.add_argument("--seed", type=seed_arg, default=0, help="seed of the weight init, the data order and the synthetic batches")
    p.add_argument("--backend", default="cpu", help="cpu (torch CPU + gloo, the default) or cuda (torch CUDA + NCCL "
                                                    "through CuPy, one process per GPU; pip install -e '.[cuda]')")
    p.add_argument("--ranks", choices=["processes", "threads"], default="processes",
                   help="run the ranks of a multi-device plan as processes (default) or as threads of this process")
    p.add_argument("--weights", help="start from this state_dict (.pt) or .safetensors file instead of the seeded init")
    p.add_argument("--save", metavar="PATH",
                   help="a directory: write resumable checkpoints into it (every rank its shards, one index; "
                        "docs/checkpoints.md), at the end and every --save-every steps; a .pt or .safetensors "
                        "file: write the final logical weights there")
    p.add_argument("--save-every", type=int, metavar="N", help="also checkpoint after every N steps (with --save DIR)")
    p.add_argument("--keep", type=int, default=0, metavar="K",
                   help="keep only the K newest checkpoints in --save DIR (default 0: keep all)")
    p.add_argument("--resume", metavar="DIR",
                   help="start from this checkpoint (a --save directory: its newest complete checkpoint) on any "
                        "mesh or layout, and run on to --steps steps in all")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: the cores divided among the ranks)")
    p.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                   help="a rank waiting longer than this for its peers (rendezvous or a collective) fails, "
                        "and the run ends naming the rank it waited for (default 300)")
    p.add_argument("--trace", metavar="FILE", help="write the run's timeline (Chrome/Perfetto JSON): a track per rank, "
                                                   "a slice per actor firing")
    d = p.add_argument_group("data (default: synthetic batches from the model file's example_batch)")
    d.add_argument("--data", metavar="PATH", help="token file (.npy, or .bin with --data-dtype or a .bin.json sidecar), "
                                                  "UTF-8 text (byte-level tokens), or `stdlib` (the offline corpus)")
    d.add_argument("--data-dtype", choices=["uint16", "uint32"], help="token dtype of a raw .bin file")
    d.add_argument("--tokenizer", metavar="FILE", help="tokenize a text --data file with this Hugging Face "
                                                      "tokenizers JSON file (needs the tokenizers package)")
    s = p.add_argument_group("learning rate schedule (Megatron-LM's: linear warmup, then decay to --min-lr)")
    s.add_argument("--min-lr", type=float, default=0.0, help="the rate at the end of the decay (default 0)")
    s.add_argument("--lr-warmup-steps", type=int, default=0, help="steps of linear warmup to the peak (default 0)")
    s.add_argument("--lr-decay-steps", type=int, default=0,
                   help="step at which the decay reaches --min-lr, counted from 0 (default 0: no decay)")
    s.add_argument("--lr-decay-style", choices=[x.value for x in DecayStyle], default="cosine")
    g = p.add_argument_group("logs (rank 0)")
    g.add_argument("--log-interval", type=int, default=1, help="log every N steps (default 1)")
    g.add_argument("--metrics", metavar="FILE", help="write each logged step's keys as a JSON line here")
    g.add_argument("--log-dir", metavar="DIR", help="write metrics.jsonl into this directory")
    g.add_argument("--tensorboard", metavar="DIR", help="write TensorBoard scalars here (needs the tensorboard package)")
    g.add_argument("--progress", action=argparse.BooleanOptionalAction,
                   help="a progress bar with ETA (default: when stdout is a terminal)")


_PAYLOAD_KEYS = ("plan", "steps", "seed", "backend", "weights", "save", "save_every", "keep", "resume", "threads",
                 "timeout", "debug", "trace", "lr",
                 "data", "data_dtype", "tokenizer", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style",
                 "log_interval", "metrics", "tensorboard", "progress")


def run_command(args: argparse.Namespace, out=None) -> int:
    """Run a plan: in this process for a one-device plan, as this rank of an existing group
    under torchrun (RANK and WORLD_SIZE set), else by spawning one local process (or thread,
    ``--ranks threads``) per rank. Flags, files and data are checked here, before any rank starts."""
    from sbpc.runtime import dist
    from sbpc.runtime.plan import load_plan

    out = out or sys.stdout
    if args.steps < 0:
        raise UsageError(f"--steps {args.steps} is negative", hint="pass --steps 1 or more")
    if getattr(args, "timeout", 300.0) <= 0:
        raise UsageError(f"--timeout {args.timeout:g} must be positive", hint="pass the seconds a rank may wait, e.g. --timeout 300")
    from sbpc.runtime.files import check_output_path

    check_checkpoint_arguments(args)
    if getattr(args, "trace", None):
        check_output_path(args.trace, "trace (--trace)")
    plan = load_plan(args.plan)
    check_backend(getattr(args, "backend", "cpu"), plan.world_size, plan)
    if plan.pipeline is not None:
        from sbpc.runtime.pipeline import check_order

        check_order(plan)
    if args.weights:
        from sbpc.runtime.weights import check_weights_path

        check_weights_path(args.weights)
    _prepare_training(args, plan, out)
    if getattr(args, "resume", None):
        _check_resume(args, plan)
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


def _prepare_training(args: argparse.Namespace, plan, out) -> None:
    """Resolve ``--data stdlib`` (built once into the cache), check the data against the plan,
    the schedule's and the log's flags: bad input is exit 2 before a rank starts."""
    from sbpc.runtime.corpus import resolve_data
    from sbpc.runtime.data import check_data
    from sbpc.runtime.train_log import wants_progress

    schedule_of(args, plan.optimizer.lr)
    check_training_flags(args)
    if getattr(args, "data", None):
        args.data = resolve_data(args.data)
    check_data(plan, data_options(args))
    log_dir = getattr(args, "log_dir", None)
    if log_dir and not getattr(args, "metrics", None):
        from sbpc.runtime.files import check_output_dir

        check_output_dir(log_dir, "logs (--log-dir)")
        os.makedirs(log_dir, exist_ok=True)  # only once the rest is known good: a refused run leaves nothing
        args.metrics = os.path.join(log_dir, "metrics.jsonl")
    if getattr(args, "progress", None) is None:  # the launcher's terminal decides, not a rank's pipe
        args.progress = wants_progress(out)


def check_training_flags(args: argparse.Namespace) -> None:
    """What needs no plan: the log flags, that --data names something, the checkpoint flags and
    that --resume names a complete, intact checkpoint (`sbpc train` checks this before its
    compile, the rest after it)."""
    from sbpc.runtime.corpus import STDLIB
    from sbpc.runtime.data import missing_data
    from sbpc.runtime.train_log import check_log_options

    check_log_options(log_options(args))
    data = getattr(args, "data", None)
    if data and data != STDLIB and not os.path.exists(data):
        raise missing_data(data)
    check_checkpoint_arguments(args)
    if getattr(args, "resume", None):  # missing, incomplete or corrupt: before the compile too
        from sbpc.runtime.checkpoint import open_checkpoint

        open_checkpoint(args.resume)


def saves_weights_file(path: str | None) -> bool:
    """--save names a weights file (the final logical weights), not a checkpoint directory."""
    return bool(path) and path.endswith((".pt", ".safetensors"))


def check_checkpoint_arguments(args: argparse.Namespace) -> None:
    """--save, --save-every, --keep and --resume, checked before any work."""
    from sbpc.runtime.files import check_output_dir, check_output_path

    save, every, keep = getattr(args, "save", None), getattr(args, "save_every", None), getattr(args, "keep", 0) or 0
    if saves_weights_file(save):
        check_output_path(save, "weights (--save)")
    elif save:
        check_output_dir(save, "checkpoints (--save)")
    if every is not None and every < 1:
        raise UsageError(f"--save-every {every} must be 1 or more", hint="pass the steps between checkpoints, e.g. --save-every 100")
    if keep < 0:
        raise UsageError(f"--keep {keep} is negative", hint="pass how many checkpoints to keep, or 0 to keep all")
    if (every is not None or keep) and (not save or saves_weights_file(save)):
        raise UsageError("--save-every and --keep need --save DIR (a checkpoint directory)",
                         hint="add --save ckpt/ (a .pt or .safetensors --save writes only the final weights)")
    if getattr(args, "resume", None) and getattr(args, "weights", None):
        raise UsageError("--resume and --weights both give the starting weights",
                         hint="pass one: --resume DIR restores weights, optimizer state and step")


def _check_resume(args: argparse.Namespace, plan) -> None:
    """The checkpoint is complete, intact and of the plan's model: one line before any rank
    starts. A schedule other than the checkpoint's is the run's to choose, but said."""
    from sbpc.runtime.checkpoint import open_checkpoint

    directory, index = open_checkpoint(args.resume, plan)
    saved, mine = index.train.schedule, schedule_state(schedule_of(args, plan.optimizer.lr))
    changed = [k for k in mine if saved is not None and saved.get(k) != mine[k]]
    if changed:
        print(f"sbpc: warning: resuming {directory} with another learning rate schedule: "
              + ", ".join(f"{k} {mine[k]} (the checkpoint's: {saved.get(k)})" for k in changed), file=sys.stderr)


def schedule_state(schedule: LrSchedule) -> dict:
    """The schedule as a checkpoint stores it: its configuration (the rate is a function of the step)."""
    return {"lr": schedule.lr, "min_lr": schedule.min_lr, "warmup_steps": schedule.warmup_steps,
            "decay_steps": schedule.decay_steps, "style": schedule.style.value}


def data_options(args: argparse.Namespace):
    from sbpc.runtime.data import DataOptions

    return DataOptions(path=getattr(args, "data", None), dtype=getattr(args, "data_dtype", None),
                       tokenizer=getattr(args, "tokenizer", None))


def schedule_of(args: argparse.Namespace, compiled_lr: float) -> LrSchedule:
    """The run's schedule; the peak is --lr, else the plan's compiled rate."""
    lr = getattr(args, "lr", None)
    return LrSchedule(lr=lr if lr is not None else compiled_lr, min_lr=getattr(args, "min_lr", 0.0),
                      warmup_steps=getattr(args, "lr_warmup_steps", 0), decay_steps=getattr(args, "lr_decay_steps", 0),
                      style=DecayStyle(getattr(args, "lr_decay_style", "cosine")))


def log_options(args: argparse.Namespace):
    from sbpc.runtime.train_log import LogOptions

    return LogOptions(interval=getattr(args, "log_interval", 1), metrics=getattr(args, "metrics", None),
                      tensorboard=getattr(args, "tensorboard", None), progress=getattr(args, "progress", None))


def check_backend(name: str, ranks: int, plan=None) -> None:
    """Refuse an unknown backend, or cuda on a machine that cannot run it (or a plan it would
    run wrong), before any rank starts."""
    from sbpc.runtime.backend import check_backend_name

    check_backend_name(name)
    if name == "cuda":
        from sbpc.runtime.cuda import require_cuda, require_cuda_kernels, require_fifo_transfers

        require_cuda(ranks)
        if plan is not None:
            require_cuda_kernels(plan)
            require_fifo_transfers(plan)


def train(args: argparse.Namespace, plan, communicator, out) -> dict:
    """The training run of one rank (the only one when ``communicator`` is None). Logs to
    ``out`` unless it is None; every rank must call it (gathers are collectives)."""
    import torch

    from sbpc.runtime.backend import make_backend
    from sbpc.runtime.checkpoint import Checkpointer, load_into
    from sbpc.runtime.data import LoaderState, make_batches
    from sbpc.runtime.precision import LOSS_SCALE, SKIPPED_STEPS
    from sbpc.runtime.runner import make_runner
    from sbpc.runtime.training import TrainOptions, train_loop
    from sbpc.runtime.weights import load_weights, save_weights

    if args.threads:
        torch.set_num_threads(args.threads)
    topology = communicator.topology if communicator is not None else None
    backend = make_backend(args.backend, communicator, topology)
    weights = load_weights(args.weights, plan) if args.weights else None
    runner = make_runner(plan, backend, seed=args.seed, weights=weights, timeline=bool(getattr(args, "trace", None)))
    weights = None
    seed, first, position = args.seed, 0, None
    if getattr(args, "resume", None):
        resumed = load_into(runner, args.resume)
        # the data order, batches and dropout of the steps to come are the saved run's
        seed, first, position = resumed.seed, resumed.step, resumed.data
        if out is not None:
            print(f"resumed from {args.resume} after step {first} (seed {seed})", file=out, flush=True)
    batches = make_batches(plan, data_options(args), seed, cut=runner.batch_part)
    if position is not None:
        batches.restore(LoaderState.model_validate(position))
    saves = Checkpointer(args.save, getattr(args, "save_every", None), getattr(args, "keep", 0) or 0) \
        if args.save and not saves_weights_file(args.save) else None
    schedule = schedule_of(args, plan.optimizer.lr)
    options = TrainOptions(steps=args.steps, seed=seed, schedule=schedule, log=log_options(args), start=first,
                           saves=saves, schedule_state=schedule_state(schedule))
    result = train_loop(runner, batches, options, out)
    skipped = None
    if plan.precision.loss_scaling is not None:  # fp16: the scaler's states, whole on every rank
        states = runner.logical_states()  # a collective: every rank takes part
        skipped = int(states[SKIPPED_STEPS])
        if out is not None:
            print(f"fp16 loss scaling: {skipped} of {runner.steps} steps skipped (gradients overflowed); "
                  f"loss scale {float(states[LOSS_SCALE]):g}", file=out, flush=True)
    if getattr(args, "trace", None):
        _write_trace(args.trace, runner, backend, out)
    if saves_weights_file(args.save):
        state = runner.logical_weights()  # every rank takes part in the gathers
        if backend.communicator.rank == 0:
            save_weights({k: v.detach().cpu() for k, v in state.items()}, args.save)
            if out is not None:
                print(f"saved weights to {args.save}", file=out, flush=True)
    return {"losses": result.losses, "seconds": result.seconds, "skipped_steps": skipped,
            "metrics": [log.record() for log in result.logs]}


def _write_trace(path: str, runner, backend, out) -> None:
    """Rank 0 writes every rank's firings (a gather: every rank calls this)."""
    from sbpc.runtime.trace import Span, write_trace

    mine = [Span(backend.communicator.rank, f.task, f.start, f.end, f.step, f.stream) for f in runner.timeline.firings]
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
    from sbpc.runtime.train_log import ProgressRelay

    payload = {k: getattr(args, k, None) for k in _PAYLOAD_KEYS}
    payload["timeout"] = getattr(args, "timeout", 300.0)
    relay = ProgressRelay(out)

    def show(rank: int, line: str) -> None:
        if rank == 0:
            relay.line(line)
        else:
            sys.stderr.write(f"[rank {rank}] {line}")
            sys.stderr.flush()

    try:
        launch(plan.world_size, "sbpc.runtime.cli:run_rank", payload, timeout=payload["timeout"], on_output=show,
               echo_stderr=bool(getattr(args, "debug", False)), threads=args.threads,
               ranks=getattr(args, "ranks", "processes"))
    finally:
        relay.close()
    return 0


def _join_group(args: argparse.Namespace, plan, out) -> int:
    """Under torchrun: this process is one rank; join the group instead of spawning."""
    from sbpc.runtime import dist

    rank = int(os.environ["RANK"])
    dist.leave_hard_at_exit()
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
    return leave(guarded_main(lambda: run_command(args), args.debug, prog="sbpc-run"))


def leave(code: int) -> int:
    """``code``, or the process ends here if it ran as a torchrun rank (``dist.exit_code``)."""
    joined = sys.modules.get("sbpc.runtime.dist")  # not imported: not a torchrun rank
    return joined.exit_code(code) if joined is not None else code


if __name__ == "__main__":
    sys.exit(main())
