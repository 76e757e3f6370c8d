"""The compile flags every model command shares (compile, memory, check, train) and their
resolution into one compile: flags win over the config's tables, which win over the defaults."""
from __future__ import annotations

import argparse
import math
import sys

from sbpc.errors import UsageError
from sbpc.runtime.kinds import Precision, Recompute, ScheduleName


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model file defining build_model(**kw) and example_batch(batch_size, **kw)")
    p.add_argument("--mesh", default="1", help="device mesh: 4x8x4 (dp x tp x pp) or dp=2,tp=2 (default 1)")
    p.add_argument("--set", dest="sets", action="append", metavar="KEY=VALUE",
                   help="keyword argument for build_model and example_batch (repeatable)")
    p.add_argument("--batch-size", type=int, help="global batch size (default 4, or dp x micro-batches when 4 "
                                                    "does not divide over them)")
    p.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.0, help="SGD momentum")
    p.add_argument("--clip-grad", type=float, metavar="MAX_NORM",
                   help="clip the gradients by their global norm over all shards and stages to MAX_NORM "
                        "(torch.nn.utils.clip_grad_norm_); the step reports the norm (default: no clipping)")
    p.add_argument("--print-after", action="append", default=[], metavar="PASS", help="print the IR after PASS")
    p.add_argument("--print-after-all", action="append_const", const=True, help="print the IR after every pass")
    p.add_argument("--dump-dir", help="write the IR after every pass into this directory")
    p.add_argument("--time-passes", action="store_true",
                   help="print the seconds of capture, each pass, the IR verifier and lowering (stderr)")
    p.add_argument("--allow-replicated", action="store_true",
                   help="accept a mesh axis on which no tensor is split (its devices all do the same work)")
    p.add_argument("--config", help="parallel config (TOML): parameter and module globs -> SBP per mesh axis")
    p.add_argument("--cluster", metavar="NAME|FILE",
                   help="plan with this cluster's cost model (FLOPs and bytes per op, its links; a preset: "
                        "dgx-a100-80g, dgx-h100, h200, or a cluster TOML file) instead of the default "
                        "bytes-touched AlphaBeta model (docs/cost_model.md)")
    p.add_argument("--microbatches", type=int, help="micro-batches per step (default: pp, or the config's)")
    p.add_argument("--schedule", choices=[s.value for s in ScheduleName], help="pipeline schedule (default 1f1b)")
    p.add_argument("--virtual-stages", type=int, help="chunks per pp stage for the interleaved schedule (default 1, "
                                                      "2 with --schedule interleaved)")
    m = p.add_argument_group("memory (flags win over the config's [memory] table)")
    m.add_argument("--zero", type=int, choices=[0, 1, 2, 3], help="ZeRO stage on dp: 1 optimizer state, 2 also "
                                                                  "gradients, 3 also parameters sharded (default 0)")
    m.add_argument("--recompute", choices=[r.value for r in Recompute], help="activation recompute (default none)")
    m.add_argument("--precision", choices=[x.value for x in Precision], help="compute precision; master weights and "
                                                                            "optimizer state stay fp32 (default fp32)")
    m.add_argument("--offload", choices=["none", "optimizer"], help="optimizer state and update on the host")
    m.add_argument("--device-memory", metavar="BYTES", help="memory per device, e.g. 80GB: a plan that does not fit "
                                                            "is refused")


def check_outputs(args: argparse.Namespace) -> None:
    """Refuse paths that cannot be written before the compile, not after it."""
    from sbpc.runtime.files import check_output_dir, check_output_path

    for flag, what in (("output", "plan"), ("trace", "simulated trace")):
        if getattr(args, flag, None) is not None:
            check_output_path(getattr(args, flag), f"{what} (--{flag})")
    if args.dump_dir:
        check_output_dir(args.dump_dir, "IR dumps (--dump-dir)")


def compile_from_args(args: argparse.Namespace, enforce_budget: bool = True):
    from sbpc.compiler.driver import compile_model
    from sbpc.compiler.frontend.hints import load_config
    from sbpc.compiler.ir.mesh import parse_mesh
    from sbpc.compiler.frontend.model_loader import load_model, parse_sets
    from sbpc.compiler.frontend.optim import OptimizerConfig
    from sbpc.compiler.pass_manager import CompileContext

    check_outputs(args)
    mesh = parse_mesh(args.mesh)
    source = load_model(args.model, parse_sets(args.sets))
    if args.clip_grad is not None and not args.clip_grad > 0:
        raise UsageError(f"--clip-grad {args.clip_grad} must be a norm > 0", hint="e.g. --clip-grad 1.0, Megatron's default")
    check_optimizer_flags(args)
    optimizer = OptimizerConfig(kind=args.optimizer, lr=args.lr, weight_decay=args.weight_decay, momentum=args.momentum,
                                clip_grad=args.clip_grad)
    ctx = CompileContext(print_after=set(args.print_after), print_after_all=bool(args.print_after_all),
                         dump_dir=args.dump_dir, allow_replicated=args.allow_replicated,
                         process_exits=getattr(args, "process_exits", False), cost_model=_cluster_cost(args, mesh))
    config = load_config(args.config) if args.config else None
    pipeline = pipeline_options(args, mesh, config)
    if args.batch_size is None:
        rows = mesh.size("dp") * pipeline.microbatches
        args.batch_size = 4 if 4 % rows == 0 else rows
    if args.batch_size < 1:
        raise UsageError(f"--batch-size {args.batch_size} must be at least 1",
                         hint="the global batch size, a multiple of dp x micro-batches")
    result = compile_model(source, mesh, batch_size=args.batch_size, optimizer=optimizer, ctx=ctx, config=config,
                           pipeline=pipeline, memory=memory_options_of(args, config), enforce_budget=enforce_budget)
    if getattr(args, "time_passes", False):
        print(pass_time_table(result.timings, ctx.pass_seconds), file=sys.stderr)
    return result, source, optimizer


def check_optimizer_flags(args: argparse.Namespace) -> None:
    """The hyperparameters torch.optim would refuse (its ValueError would surface as an internal
    error after the compile), and --momentum given to AdamW, which has none and would drop it."""
    for flag, value, hint in (("--lr", args.lr, "e.g. --lr 1e-3 (the default)"),
                              ("--weight-decay", args.weight_decay, "e.g. --weight-decay 0.01 (the default), or 0"),
                              ("--momentum", args.momentum, "e.g. --momentum 0.9, or 0 (the default)")):
        if not (math.isfinite(value) and value >= 0):
            raise UsageError(f"{flag} {value} must be a finite number >= 0", hint=hint)
    if args.momentum and args.optimizer != "sgd":
        raise UsageError(f"--momentum {args.momentum} is SGD's; --optimizer {args.optimizer} has no momentum",
                         hint="add --optimizer sgd, or drop --momentum (AdamW keeps its own first moment, beta1 0.9)")


def _cluster_cost(args: argparse.Namespace, mesh):
    """``--cluster``: the cluster's cost model for ``mesh`` (None without the flag)."""
    if getattr(args, "cluster", None) is None:
        return None
    from sbpc.compiler.sbp.cost_model import ClusterCost
    from sbpc.compiler.tools.cluster import load_cluster

    return ClusterCost(load_cluster(args.cluster), mesh.device_axes)


def pass_time_table(timings: dict[str, float], pass_seconds: dict[str, float]) -> str:
    """``--time-passes``: capture, each pass (in pipeline order), the verifier and lowering, with
    their share of the compile, as LLVM's ``-time-passes`` prints them."""
    total = timings["total"]
    passes = [(name, sec) for name, sec in pass_seconds.items() if name != "verify"]
    rows = [("capture", timings["capture"]), *passes, ("verify (after each)", pass_seconds.get("verify", 0.0)),
            ("lowering", timings["total"] - timings["capture"] - timings["passes"])]
    lines = ["compile time (wall seconds; a pass that ran more than once is summed):"]
    lines += [f"  {name:<22} {sec:8.3f}  {sec / total:6.1%}" for name, sec in rows]
    lines.append(f"  {'total':<22} {total:8.3f}")
    return "\n".join(lines)


def memory_options_of(args, config):
    """Flags win over the config's ``[memory]`` table, which wins over the defaults."""
    from sbpc.compiler.memory_options import MEMORY_FLAGS, memory_options

    table = config.memory if config is not None else {}
    given = {key: getattr(args, key) if getattr(args, key) is not None else table.get(key) for key in MEMORY_FLAGS}
    where = config.memory_source if config is not None and any(getattr(args, k) is None and k in table
                                                               for k in MEMORY_FLAGS) else ""
    return memory_options(**given, where=where)


def pipeline_options(args, mesh, config):
    """Flags win over the config's ``[pipeline]`` table, which wins over the defaults."""
    from sbpc.compiler.passes import PipelineOptions

    table = config.pipeline if config is not None else None
    pick = lambda flag, key: flag if flag is not None else getattr(table, key, None)
    schedule = ScheduleName(pick(args.schedule, "schedule") or ScheduleName.ONE_F_ONE_B)
    virtual = pick(args.virtual_stages, "virtual_stages")
    virtual = virtual if virtual is not None else (2 if schedule == ScheduleName.INTERLEAVED else 1)
    pp = mesh.size("pp")
    m = pick(args.microbatches, "microbatches")
    default = m is None
    m = m if m is not None else pp
    if m < 1:
        raise UsageError(f"--microbatches {m} must be at least 1", hint=f"use --microbatches {max(pp, 1)} or more")
    if virtual < 1:
        raise UsageError(f"--virtual-stages {virtual} must be at least 1", hint="1 (no interleaving) or more")
    if virtual > 1 and schedule != ScheduleName.INTERLEAVED:
        raise UsageError(f"--virtual-stages {virtual} needs --schedule interleaved",
                         hint="virtual stages are chunks of the interleaved 1F1B schedule")
    if virtual > 1 and pp == 1:  # chunks of no pipeline: the plan would have stages and no schedule to run them
        raise UsageError(f"--schedule interleaved ({virtual} virtual stages) needs a pipeline, but mesh {args.mesh} "
                         "has pp=1", hint="add a pp axis (e.g. --mesh 1x1x2), or drop --schedule interleaved")
    if schedule == ScheduleName.INTERLEAVED and m % pp:
        raise UsageError(f"the interleaved schedule needs micro-batches in groups of pp: {m} is not a multiple of {pp}",
                         hint=f"use --microbatches {pp * max(1, m // pp)}")
    return PipelineOptions(schedule=schedule, virtual_stages=virtual, microbatches=m,
                           microbatches_default=default and m > 1 and schedule != ScheduleName.INTERLEAVED)
