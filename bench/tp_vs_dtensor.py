"""Training steps/s of an sbpc tensor-parallel plan (mesh 1x2) vs torch DTensor TP: 2 ranks over gloo.

Same model (examples/gpt.py), same batch (each rank of a TP group sees the whole batch), same
seeded weights and batches, same AdamW (lr 1e-3, wd 0.01, single-tensor: foreach=False) and
1 torch thread per rank on both sides. Each side is one ``sbpc.runtime.launch.launch(2, ...)``
of two fresh processes joined over gloo; the timing is that of dp_vs_ddp.py (``--warmup``
untimed steps, barrier, ``--steps`` timed steps, barrier; sides alternate over ``--rounds``).

  plan     compiled here with ``--config bench/gpt.tp-layers.toml`` (default): Megatron hints
           for the blocks only -- c_attn and mlp.c_fc column parallel, attn.c_proj and
           mlp.c_proj row parallel -- the same layers the DTensor side shards; embeddings, layer
           norms and lm_head are unhinted (the bench prints the layouts sbp-propagate chose and
           the plan's collectives). ``--config examples/gpt.megatron.toml`` adds the
           vocab-parallel embedding and head, which the DTensor side does not have.
           A step is runner.step(batch) (the loss comes back as a float).
  dtensor  torch.manual_seed(0); build_model(); then for every block h.i
           ``parallelize_module`` on ``init_device_mesh("cpu", (2,))`` with
           attn.c_attn / mlp.c_fc -> ColwiseParallel(), attn.c_proj / mlp.c_proj ->
           RowwiseParallel() (inputs and outputs are plain replicated tensors, torch's
           defaults); wte, wpe, layer norms and lm_head stay plain replicated tensors on
           both ranks. A step is opt.zero_grad(set_to_none=True); loss = model(idx, targets);
           loss.backward(); opt.step(); float(loss) (the loss is replicated: no collective).

Two adjustments make gpt.py's attention work with a column-sharded fused qkv on the DTensor
side; both keep the math of the single-device model (the step-0 losses printed agree with
the plan's):

1. ColwiseParallel splits c_attn's 3C output rows contiguously, so rank 0 would get all of q
   and half of k. Before parallelizing, the rows of c_attn.weight/bias are permuted from
   [q; k; v] to [q_0; k_0; v_0; q_1; k_1; v_1] (q_r = the heads of rank r), so that each
   rank's contiguous shard is its own heads' q, k and v -- the per-head split the sbpc plan
   makes (its S(0:3) layout of c_attn).
2. gpt.py's forward splits the qkv output at ``c = x.shape[-1]`` (the full hidden size, x is
   replicated) and views ``(b, t, heads, c // heads)``; the rank's local qkv has 3C/2
   features. So each attention module's ``heads`` becomes heads // 2 and its forward is
   replaced by ``tp_attention_forward`` below: the same ops, with the split and views taken
   from the local sizes (as torchtitan's Llama does with ``n_heads // tp``).

With no --set, two configs run: gpt.py tiny (batch 8) and mid (--set hidden=128 --set
layers=2 --set seq=64, batch 16).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from collections import Counter

BENCH = os.path.dirname(os.path.abspath(__file__))
TP_LAYERS = os.path.relpath(os.path.join(BENCH, "gpt.tp-layers.toml"))
TP = 2


def tp_attention_forward(self, x):
    """gpt.py's CausalSelfAttention.forward on a rank holding ``self.heads`` of the heads:
    c_attn's local output is [q_r, k_r, v_r] (see the module docstring), c_proj is row
    parallel and returns the replicated full-width output."""
    import torch.nn.functional as F

    b, t, _ = x.shape
    q, k, v = self.c_attn(x).chunk(3, dim=2)  # each (b, t, C / tp)
    q = q.view(b, t, self.heads, -1).transpose(1, 2)
    k = k.view(b, t, self.heads, -1).transpose(1, 2)
    v = v.view(b, t, self.heads, -1).transpose(1, 2)
    p = self.dropout if self.training else 0.0
    y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
    y = y.transpose(1, 2).contiguous().view(b, t, -1)
    return self.c_proj(y)


def _per_rank_qkv(t, tp: int):
    """[q; k; v] along dim 0 -> [q_0; k_0; v_0; q_1; ...]: each of q, k, v split into tp row blocks."""
    three_c = t.shape[0]
    return t.reshape(3, tp, three_c // (3 * tp), *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def dtensor_worker(payload: dict) -> dict:
    """Launch target: one rank of the DTensor tensor-parallel model."""
    import types

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from dp_vs_ddp import time_steps
    from sbpc.compiler.frontend.optim import OptimizerConfig
    from sbpc.runtime.model_file import import_model_file
    from sbpc.runtime.plan import load_plan
    from sbpc.runtime.runner import BatchSource

    plan = load_plan(payload["plan"])  # for the model file, its --set values and the batches only
    tp = dist.get_world_size()
    mesh = init_device_mesh("cpu", (tp,))
    module = import_model_file(plan.model.path, "_bench_dtensor_")
    torch.manual_seed(0)
    model = module.build_model(**plan.model.sets).train()
    layout = {}
    for i, block in enumerate(model.h):
        attn = block.attn
        with torch.no_grad():
            attn.c_attn.weight.copy_(_per_rank_qkv(attn.c_attn.weight, tp))
            if attn.c_attn.bias is not None:
                attn.c_attn.bias.copy_(_per_rank_qkv(attn.c_attn.bias, tp))
        if attn.heads % tp:
            raise ValueError(f"heads={attn.heads} is not divisible by tp={tp}")
        attn.heads //= tp
        attn.forward = types.MethodType(tp_attention_forward, attn)
        layout.update({f"h.{i}.attn.c_attn": ColwiseParallel(), f"h.{i}.attn.c_proj": RowwiseParallel(),
                       f"h.{i}.mlp.c_fc": ColwiseParallel(), f"h.{i}.mlp.c_proj": RowwiseParallel()})
    parallelize_module(model, mesh, layout)
    opt = OptimizerConfig().torch_optimizer([p for p in model.parameters() if p.requires_grad])  # AdamW foreach=False
    make = BatchSource(plan, 0)
    batches = [make(i) for i in range(payload["warmup"] + payload["steps"])]

    def step(batch) -> float:
        opt.zero_grad(set_to_none=True)
        loss = model(*batch)
        loss.backward()
        opt.step()
        return float(loss.detach())

    seconds, losses = time_steps(step, batches, payload["warmup"], dist.barrier)
    return {"seconds": seconds, "losses": losses}


def describe_plan(path: str) -> None:
    """The parameter layouts sbp-propagate chose and the plan's collectives per step."""
    from sbpc.compiler.tools.comm_report import collectives
    from sbpc.runtime.plan import load_plan

    plan = load_plan(path)
    sharded = [f"{p.name}={p.sbp[-1]}" for p in plan.params if p.sbp and p.sbp[-1] != "B"]
    if not any(n.startswith(("wte", "wpe", "lm_head")) for n in sharded):
        print("  plan: embeddings and lm_head replicated, as on the DTensor side", flush=True)
    first = [n for n in sharded if not re.match(r"h\.[1-9]", n)]  # block 0 stands for every block
    print(f"  plan: tp-sharded params: {', '.join(first)}{' (the same in every block)' if len(first) < len(sharded) else ''}",
          flush=True)
    counts = Counter((c.kind, c.role) for c in collectives(plan) if c.moves_data)
    print("  plan: collectives per step: " + ", ".join(f"{n} {k} {r}" for (k, r), n in sorted(counts.items())), flush=True)


def main(argv: list[str] | None = None) -> int:
    from dp_vs_ddp import (add_common_args, bench_sides, check_args_and_announce, compare_sides, compile_plan, configs_of,
                           print_table)

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p)
    p.add_argument("--config", default=TP_LAYERS,
                   help=f"the plan's parallel config (default {TP_LAYERS}; examples/gpt.megatron.toml also "
                        "shards the vocabulary, which the DTensor side does not)")
    args = p.parse_args(argv)
    check_args_and_announce(p, args)
    rows = []
    with tempfile.TemporaryDirectory(prefix="sbpc-bench-") as tmp:
        for name, sets, batch in configs_of(args):
            print(f"== {name}: {args.model} {' '.join('--set ' + s for s in sets)} --batch-size {batch}", flush=True)
            plan = compile_plan(args.model, sets, f"1x{TP}", batch, tmp, config=args.config)
            describe_plan(plan)
            payload = {"plan": plan, "steps": args.steps, "warmup": args.warmup, "timeout": args.timeout}
            res = bench_sides({"plan": ("dp_vs_ddp:plan_worker", payload),
                               "dtensor": ("tp_vs_dtensor:dtensor_worker", payload)}, args.rounds, args.steps)
            rows += compare_sides(name, batch, res, "dtensor")
    print_table(rows, "dtensor")
    print(f"load average {os.getloadavg()[0]:.2f} at end")
    print(f"ratio={min(r[5] for r in rows if r[2] == 'plan'):.2f}")  # plan/DTensor steps/s, the worst config
    return 0


if __name__ == "__main__":
    sys.path.insert(0, BENCH)  # the ranks import dp_vs_ddp and this file by name
    sys.exit(main())
