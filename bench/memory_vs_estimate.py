"""Measured peak memory of each rank of a real run vs the compiler's estimate per rank role.

For each model and mesh: compile (the estimate is the plan's ``estimates.roles``), run one
training step on in-process ranks (``runtime/thread_launch.py``) and measure, on every rank,
the peak of the bytes of live tensor storages during that step. The plan's tensors only, not
the process RSS: a ``TorchDispatchMode`` on each rank thread registers the storage of every
tensor an op returns (views share it), the rank's parameters, buffers and optimizer state are
registered when the step starts, and a storage leaves the count when torch frees it (a
weakref finalizer on the storage). Sends and receives are counted as over gloo: a
send keeps its tensor until the step waits for it, a receive fills a new buffer on the receiver.
Temporaries inside one kernel (a matmul's workspace) are not tensors and are not measured.

Prints one row per (model, mesh, role): estimate, measured (the largest rank of the role),
ratio; ends with ``ratio=<value>``: measured / estimated of the worst role (furthest from 1).

    .venv/bin/python bench/memory_vs_estimate.py            # tiny and small presets, several meshes
    .venv/bin/python bench/memory_vs_estimate.py --quick    # tiny only
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves

from sbpc.compiler.driver import compile_model
from sbpc.compiler.frontend.hints import load_config
from sbpc.compiler.frontend.model_loader import load_model, parse_sets
from sbpc.compiler.frontend.optim import OptimizerConfig
from sbpc.compiler.ir.mesh import parse_mesh
from sbpc.compiler.memory_options import MemoryOptions, Recompute
from sbpc.compiler.passes import PipelineOptions

GPT = os.path.relpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "gpt.py"))
SMALL = ["preset=small"]  # GPT-2 small: 12 layers, hidden 768, vocab 50304, seq 1024
MEGATRON = os.path.join(os.path.dirname(GPT), "gpt.megatron.toml")
Z1, Z2, Z3 = (MemoryOptions(zero=z) for z in (1, 2, 3))
SELECTIVE, FULL = MemoryOptions(recompute=Recompute.SELECTIVE), MemoryOptions(recompute=Recompute.FULL)
CASES = [  # name, --set values, mesh, batch size, micro-batches, parallel config[, memory options]
    ("tiny", ["preset=tiny"], "1", 8, 1, None),
    ("tiny", ["preset=tiny"], "2x1x1", 8, 1, None),
    ("tiny", ["preset=tiny"], "1x2x1", 8, 1, MEGATRON),
    ("tiny", ["preset=tiny", "sp=True"], "1x2x1", 8, 1, MEGATRON),
    ("tiny", ["preset=tiny"], "1x1x2", 8, 4, None),
    ("tiny", ["preset=tiny"], "1x1x4", 16, 8, None),
    ("tiny", ["preset=tiny"], "1x1x4", 256, 8, None),  # activations dominate: the peak is in the pipeline
    ("tiny", ["preset=tiny"], "2x2x2", 8, 2, MEGATRON),
    ("tiny", ["preset=tiny"], "2x1x1", 8, 1, None, Z1),
    ("tiny", ["preset=tiny"], "2x1x1", 8, 1, None, Z2),
    ("tiny", ["preset=tiny"], "2x1x1", 8, 1, None, Z3),
    ("tiny", ["preset=tiny"], "2x2x1", 8, 1, MEGATRON, Z1),
    ("tiny", ["preset=tiny"], "2x2x1", 8, 1, MEGATRON, Z3),
    ("tiny", ["preset=tiny", "seq=128"], "2x2x1", 8, 1, MEGATRON, SELECTIVE),
    ("tiny", ["preset=tiny", "seq=128"], "2x2x1", 8, 1, MEGATRON, FULL),
    ("tiny", ["preset=tiny"], "2x2x2", 8, 2, MEGATRON, Z2),
    ("tiny", ["preset=tiny", "seq=128"], "2x2x2", 8, 2, MEGATRON, FULL),
    ("small", SMALL, "1", 1, 1, None),
    ("small", SMALL, "1x2x1", 1, 1, MEGATRON),
    ("small", SMALL, "1x1x2", 2, 2, None),
]


class _Ledger:
    """Live storage bytes per rank, and each rank's peak."""

    def __init__(self, world: int):
        self.lock = threading.Lock()
        self.owner: dict[int, tuple[int, int]] = {}  # id(storage) -> (rank, bytes)
        self.live = [0] * world
        self.peak = [0] * world
        self.armed = [False] * world
        self.outside: set[int] = set()  # data pointers of storages that are not the ranks'

    def hold(self, rank: int, t: torch.Tensor) -> None:
        s = t.untyped_storage()
        key = id(s)
        with self.lock:
            if key in self.owner or s.data_ptr() in self.outside:
                return
            self.owner[key] = (rank, s.nbytes())
            self._move(rank, s.nbytes())
        weakref.finalize(s, self._free, key)

    def _free(self, key: int) -> None:
        with self.lock:
            rank, nbytes = self.owner.pop(key)
            self._move(rank, -nbytes)

    def _move(self, rank: int, delta: int) -> None:
        self.live[rank] += delta
        if self.armed[rank]:
            self.peak[rank] = max(self.peak[rank], self.live[rank])


class _Track(TorchDispatchMode):
    def __init__(self, ledger: _Ledger, rank: int):
        super().__init__()
        self.ledger, self.rank = ledger, rank

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.ledger.hold(self.rank, t)
        return out


_LEDGER: _Ledger | None = None  # the run's ledger: rank threads share this process


def _rank(payload: dict) -> int:
    from sbpc.runtime.backend import make_backend
    from sbpc.runtime.dist import init_distributed
    from sbpc.runtime.plan import Plan
    from sbpc.runtime.runner import BatchSource, make_runner, step_seed

    global _LEDGER
    plan = Plan.model_validate_json(payload["plan"])
    comm = init_distributed(plan, timeout=600)
    rank = comm.topology.rank
    if _LEDGER is None:  # a rank process: its own ledger
        _LEDGER = _Ledger(plan.world_size)
    ledger = _LEDGER
    send, recv = comm.send, comm.recv
    pending: list[torch.Tensor] = []

    # as over gloo: a send keeps its tensor until the step waits for it; a receive fills a new
    # buffer of the receiver (the thread communicator's copy on the sender's thread is not counted)
    def tracked_send(t, *a, **kw):
        pending.append(t)
        with _disable_current_modes():
            return send(t, *a, **kw)

    def tracked_recv(*a, **kw):
        with _disable_current_modes():
            got = recv(*a, **kw)
        return got.clone()

    comm.send = tracked_send
    comm.recv = tracked_recv
    runner = make_runner(plan, make_backend("cpu", comm), seed=0)
    batch = BatchSource(plan, 0)(0)
    # the logical batch is the caller's (host memory under a device backend): the rank's are the
    # shards it cuts, though a chunk of it is a view that names its storage
    ledger.outside.update(t.untyped_storage().data_ptr() for t in batch)
    with _Track(ledger, rank):
        for group in (runner.params, runner.buffers, runner.states):
            for t in group.values():
                ledger.hold(rank, t)
        ledger.armed[rank] = True
        ledger.peak[rank] = ledger.live[rank]
        runner.step(batch, rng_seed=step_seed(0, 0))
        pending.clear()
        ledger.armed[rank] = False
    return ledger.peak[rank]


def measure(plan, ranks: str = "processes") -> list[int]:
    """Peak bytes of live tensors during one step, per rank: rank processes over gloo (the
    runtime's communicator), or rank threads (``runtime/threads.py``; its collectives copy
    each contribution, so a rank's collectives stage more than over gloo)."""
    global _LEDGER
    from sbpc.runtime.launch import launch

    payload = {"plan": plan.model_dump_json()}
    if ranks == "threads" or plan.world_size == 1:
        _LEDGER = _Ledger(plan.world_size)
        from sbpc.runtime.thread_launch import launch_threads

        return launch_threads(plan.world_size, _rank, payload, timeout=600)
    here = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    return launch(plan.world_size, "memory_vs_estimate:_rank", payload, timeout=600)


def _mib(n: int) -> str:
    return f"{n / 2**20:9.2f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny preset only")
    ap.add_argument("--ranks", choices=["processes", "threads"], default="processes",
                    help="ranks as gloo processes (default: the runtime as deployed) or threads of this process")
    args = ap.parse_args(argv)
    cases = [c for c in CASES if not args.quick or c[0] == "tiny"]
    print(f"{'model':30} {'mesh':7} {'mb':>2} {'role':8} {'peak at':8} {'est MiB':>9} {'meas MiB':>9} {'ratio':>6}   "
          f"estimate terms (MiB): params grads optimizer activations buffers temporaries")
    worst = 1.0
    for name, sets, mesh_text, batch, m, config, *options in cases:
        memory = options[0] if options else MemoryOptions()
        mesh = parse_mesh(mesh_text)
        source = load_model(GPT, parse_sets(sets))
        plan = compile_model(source, mesh, batch_size=batch, optimizer=OptimizerConfig(),
                             config=load_config(config) if config else None,
                             pipeline=PipelineOptions(microbatches=m), memory=memory).plan
        name += "".join(f" {s}" for s in sets[1:])
        name += f" b{batch}" + (f" z{memory.zero}" if memory.zero else "")
        name += f" rc-{memory.recompute.value}" if memory.recompute != Recompute.NONE else ""
        peaks = measure(plan, args.ranks)
        for role in plan.estimates.roles:
            ranks = [r for r in range(plan.world_size) if plan.coords(r).get("pp", 0) == role.stage]
            measured = max(peaks[r] for r in ranks)
            ratio = measured / role.total
            if abs(ratio - 1) > abs(worst - 1):
                worst = ratio
            terms = " ".join(_mib(x).strip() for x in (role.params, role.grads, role.optimizer, role.activations,
                                                       role.buffers, role.temporaries))
            print(f"{name:30} {mesh_text:7} {m:>2} {role.role:8} {role.peak_at:8} {_mib(role.total)} {_mib(measured)} "
                  f"{ratio:6.3f}   {terms}", flush=True)
    print(f"ratio={worst:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
