"""The planning commands of `sbpc`: they read a plan (or a model and a cluster), price or
compare it, and print: report, diff, explain, simulate, search. `cli.py` holds the parser and
the commands that compile, check and run."""
from __future__ import annotations

import sys

from sbpc.errors import UsageError
from sbpc.runtime.kinds import Precision


def write_report_file(plan_path: str, out: str, flag: str, cluster: str | None = None) -> int:
    from sbpc.compiler.tools.report import write_report
    from sbpc.runtime.files import check_output_path
    from sbpc.runtime.plan import load_plan

    check_output_path(out, f"HTML report ({flag})")
    if cluster is not None:
        from sbpc.compiler.tools.cluster import load_cluster

        cluster = load_cluster(cluster)
    write_report(load_plan(plan_path), out, cluster)
    print(f"wrote {out}")
    return 0


def cmd_report(args) -> int:
    return write_report_file(args.plan, args.output, "-o", args.cluster)


def cmd_diff(args) -> int:
    from sbpc.compiler.tools.diff import diff_plans, diff_text
    from sbpc.runtime.plan import load_plan

    cluster = None
    if args.cluster is not None:
        from sbpc.compiler.tools.cluster import load_cluster

        cluster = load_cluster(args.cluster)
    d = diff_plans(load_plan(args.a), load_plan(args.b), args.a, args.b, cluster)
    print(d.model_dump_json(indent=1) if args.json else diff_text(d, show_all=args.all))
    return 0


def cmd_explain(args) -> int:
    from sbpc.compiler.tools.comm_report import explain
    from sbpc.runtime.plan import load_plan

    print(explain(load_plan(args.plan), args.tensor))
    return 0


def cmd_simulate(args) -> int:
    from sbpc.compiler.tools.cluster import load_cluster
    from sbpc.compiler.tools.simulate import result_text, simulate, write_sim_trace
    from sbpc.runtime.plan import load_plan

    if args.trace:
        from sbpc.runtime.files import check_output_path

        check_output_path(args.trace, "simulated trace (--trace)")
    if args.layers is not None and args.layers < 1:
        raise UsageError(f"--layers {args.layers} must be at least 1", hint="the layer count to extrapolate to, e.g. --layers 96")
    if args.attention_dropout is not None and not 0 <= args.attention_dropout < 1:
        raise UsageError(f"--attention-dropout {args.attention_dropout} must be in [0, 1)",
                         hint="a dropout probability, e.g. --attention-dropout 0.1")
    cluster = load_cluster(args.cluster)
    plan = load_plan(args.plan)
    if args.trace:
        result = write_sim_trace(plan, cluster, args.trace, attention=args.attention, layers=args.layers,
                                 attention_dropout=args.attention_dropout)
    else:
        result = simulate(plan, cluster, attention=args.attention, layers=args.layers,
                          attention_dropout=args.attention_dropout)
    print(result.model_dump_json(indent=1) if args.json else result_text(result))
    if args.trace and not args.json:
        print(f"wrote the simulated timeline to {args.trace}")
    return 0


def cmd_search(args) -> int:
    from sbpc.compiler.frontend.model_loader import parse_sets
    from sbpc.compiler.memory_options import parse_bytes
    from sbpc.compiler.tools.cluster import load_cluster
    from sbpc.compiler.tools.search import SearchOptions, compile_command, config_toml, run_search, table_text
    from sbpc.compiler.tools.memory_report import size_text
    from sbpc.compiler.tools.search_space import parse_meshes
    from sbpc.errors import CompileError
    from sbpc.runtime.files import check_output_path, write_atomic

    for flag, what in (("output", "plan (-o)"), ("config_out", "parallel config (--config-out)")):
        if getattr(args, flag) is not None:
            check_output_path(getattr(args, flag), what)
    if args.devices < 1:
        raise UsageError(f"--devices {args.devices} must be at least 1", hint="the device count to plan for, e.g. --devices 256")
    if args.batch_size is None:
        args.batch_size = args.devices
    if args.batch_size < 1:
        raise UsageError(f"--batch-size {args.batch_size} must be at least 1", hint="the global batch, e.g. --batch-size 1024")
    if args.top < 1:
        raise UsageError(f"--top {args.top} must be at least 1", hint="the strategies to compile and simulate, e.g. --top 4")
    if args.attention_dropout is not None and not 0 <= args.attention_dropout < 1:
        raise UsageError(f"--attention-dropout {args.attention_dropout} must be in [0, 1)",
                         hint="a dropout probability, e.g. --attention-dropout 0.1")
    opts = SearchOptions(model=args.model, sets=parse_sets(args.sets), devices=args.devices, cluster=load_cluster(args.cluster),
                         batch_size=args.batch_size, precision=Precision(args.precision),
                         device_memory=parse_bytes(args.device_memory) if args.device_memory else None,
                         config_path=args.config, meshes=parse_meshes(args.meshes, args.devices) if args.meshes else None,
                         top=args.top, attention=args.attention, attention_dropout=args.attention_dropout)
    outcome = run_search(opts, progress=(lambda line: None) if args.json else (lambda line: print(line, flush=True)))
    print(outcome.result.model_dump_json(indent=1) if args.json else table_text(outcome.result))
    if outcome.winner is None:
        sized = [r for r in outcome.result.rows if r.peak_memory_bytes is not None]
        least = min(sized, key=lambda r: r.peak_memory_bytes) if sized else None
        smallest = f" (the smallest: {size_text(least.peak_memory_bytes)} on {least.mesh})" if least else ""
        raise CompileError(f"no compiled strategy fits {size_text(opts.budget())} a device{smallest}; nothing written",
                           hint="a larger --device-memory, more --devices, a smaller --batch-size, or --top to "
                                "compile more strategies")
    if args.output is not None:
        from sbpc.runtime.plan import save_plan

        save_plan(outcome.plan, args.output)
        layers = outcome.result.rows[0].compiled_layers
        note = "" if layers == outcome.result.layers else \
            f" (compiled with {layers} of the {outcome.result.layers} layers: simulate it with --layers {outcome.result.layers})"
        print(f"wrote the winner's plan to {args.output}{note}", file=sys.stderr if args.json else sys.stdout)
    if args.config_out is not None:
        command = compile_command(outcome.winner, opts, args.config_out)
        write_atomic(args.config_out, config_toml(outcome.winner, opts, command, outcome.layer_list, outcome.result.layers))
        print(f"wrote the winner's parallel config to {args.config_out}; reproduce: {command}",
              file=sys.stderr if args.json else sys.stdout)
    return 0
