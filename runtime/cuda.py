"""The cuda backend: the plan's ATen ops as torch CUDA kernels; across ranks, NCCL through CuPy
(``runtime.nccl``). One process per GPU; ``LOCAL_RANK`` picks the device.

UNVERIFIED ON A GPU: written against torch's and CuPy's documented APIs and never run on one
(docs/runtime.md#the-cuda-backend). What runs without a GPU is the refusal
(``require_cuda``: one line, exit 2) and the pure parts of ``runtime.nccl``.

The init program runs on the CPU (``host_backend``) and its tensors move to the GPU: so the
weights are those of ``torch.manual_seed(seed); build_model()`` bit for bit, as on cpu (a CUDA
generator draws other numbers). Attention is torch's flash kernel in fp16/bf16 without a mask,
else the memory-efficient one (any float dtype, fp32 included); it takes no dropout here,
because the plan's attention passes no philox seed from the forward to the backward.
"""
from __future__ import annotations

import os
from functools import partial

import torch

from sbpc.errors import PlanError, UsageError
from sbpc.runtime import collectives
from sbpc.runtime.backend import Backend, Communicator
from sbpc.runtime.cpu import shard_op_kernels
from sbpc.runtime.rng import RANDOM_SHARD, random_shard
from sbpc.runtime.topology import Topology

aten = torch.ops.aten
INSTALL_HINT = ("run on a machine with an NVIDIA GPU and a CUDA build of torch "
                "(pip install -e '.[cuda]' adds CuPy, for NCCL), or use --backend cpu")


def require_cuda(ranks: int = 1) -> None:
    """Refuse ``--backend cuda`` before anything starts when this machine cannot run it: no GPU
    visible to torch, fewer GPUs than local ranks, or (on more than one rank) no CuPy/NCCL."""
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise UsageError(f"--backend cuda needs an NVIDIA GPU, and torch {torch.__version__} ({build}) sees none",
                         hint=INSTALL_HINT)
    if ranks > 1:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", ranks))
        if torch.cuda.device_count() < local:
            raise UsageError(f"--backend cuda runs one rank per GPU: {local} local ranks, "
                             f"{torch.cuda.device_count()} GPUs visible",
                             hint="set CUDA_VISIBLE_DEVICES, or compile the plan for as many devices as there are GPUs")
        from sbpc.runtime.nccl import load_nccl

        load_nccl()


def require_fifo_transfers(plan) -> None:
    """NCCL matches a pair's sends and receives in issue order (it has no tags): refuse a
    pipelined plan whose stages would receive a pair's transfers in another order than sent."""
    if plan.pipeline is None or plan.world_size == 1:
        return
    from sbpc.runtime.pipeline import fifo_mismatch

    why = fifo_mismatch(plan)
    if why is not None:
        raise PlanError(f"this pipeline's transfers are not first-in first-out, which NCCL needs: {why}",
                        hint="run it on --backend cpu (gloo matches transfers by tag), or recompile with another schedule")


_DROPOUT_AT = {"sbpc.attention": 3, "sbpc.attention_backward": 6}  # op -> position of dropout_p


def require_cuda_kernels(plan) -> None:
    """What the cuda kernels would refuse at the first step, refused before any rank starts
    (not after every rank has set up NCCL and made its weights): attention with dropout, and
    random ops in a pipelined plan."""
    for prog in plan.stages:
        for ins in prog.instructions:
            at = _DROPOUT_AT.get(ins.op)
            p = ins.args[at] if at is not None and len(ins.args) > at else ins.kwargs.get("dropout_p", 0.0)
            try:
                if at is not None and isinstance(p, (int, float)) and p:
                    _no_dropout(p)
                if ins.op == RANDOM_SHARD and ins.kwargs.get("draw") is not None:
                    _random_shard(None, draw=ins.kwargs["draw"])
            except PlanError as err:
                err.location = str(ins.loc) if ins.loc else None
                raise


def local_device() -> torch.device:
    """This rank's GPU: ``cuda:LOCAL_RANK`` (0 when no launcher set it)."""
    require_cuda()
    index = int(os.environ.get("LOCAL_RANK", "0") or 0)
    if index >= torch.cuda.device_count():
        raise UsageError(f"LOCAL_RANK={index} but only {torch.cuda.device_count()} GPUs are visible",
                         hint="start one rank per GPU (torchrun --nproc-per-node <GPUs>)")
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)
    return device


BIAS_ALIGNMENT = 8  # elements: the memory-efficient kernel's bias rows start at multiples of 8


def attention_bias(mask, q, k):
    """An attention mask as the bias the memory-efficient kernel takes; eager SDPA prepares it
    the same way before calling that kernel (a direct call must do it itself): additive, in the
    query's dtype (a bool mask: 0 where kept, -inf elsewhere), every stride but the last a
    multiple of ``BIAS_ALIGNMENT`` (else copied into a padded buffer and sliced back), and
    expanded to 4-D (batch, heads, queries, keys): the kernel reads a 2-D or 3-D mask's strides
    as if it were 4-D, or refuses it."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    else:
        bias = mask.to(q.dtype)
    if bias.stride(-1) != 1 or any(st % BIAS_ALIGNMENT for st in bias.stride()[:-1]):
        keys = bias.shape[-1]
        padded = torch.zeros((*bias.shape[:-1], -(-keys // BIAS_ALIGNMENT) * BIAS_ALIGNMENT), dtype=bias.dtype,
                             device=bias.device)
        bias = padded[..., :keys].copy_(bias)
    return bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def _no_dropout(dropout_p: float) -> None:
    if dropout_p:
        raise PlanError(f"attention dropout (p={dropout_p:g}) on the cuda backend",
                        hint="the plan's attention carries no philox seed from forward to backward; set the model's "
                             "attention dropout to 0 or run on --backend cpu")


def _flash(q, attn_mask) -> bool:
    """Whether the flash kernel takes this attention (half precision, no mask, a head dim it
    supports, Ampere or newer); forward and backward decide alike from the same inputs."""
    return (q.dtype in (torch.float16, torch.bfloat16) and attn_mask is None and q.shape[-1] % 8 == 0
            and q.shape[-1] <= 256 and torch.cuda.get_device_capability(q.device) >= (8, 0))


def _last_dim_dense(*ts):
    """The tensors with a unit stride along the last dim, which both kernels require (eager
    SDPA falls back to its math kernel otherwise); a copy only where a tensor lacks it."""
    return [t if t.stride(-1) == 1 else t.contiguous() for t in ts]


def attention(q, k, v, dropout_p, is_causal, attn_mask=None, scale=None):
    """``sbpc.attention`` -> (output, logsumexp); the logsumexp only feeds the backward. Flash
    where it applies (as eager SDPA picks it), else the memory-efficient kernel."""
    _no_dropout(dropout_p)
    q, k, v = _last_dim_dense(q, k, v)
    if _flash(q, attn_mask):
        out, lse, *_ = aten._scaled_dot_product_flash_attention.default(q, k, v, 0.0, is_causal, False, scale=scale)
        return out, lse
    out, lse, _, _ = aten._scaled_dot_product_efficient_attention.default(
        q, k, v, attention_bias(attn_mask, q, k), True, 0.0, is_causal, scale=scale)
    return out, lse


def attention_backward(grad, q, k, v, out, lse, dropout_p, is_causal, attn_mask=None, scale=None):
    """``sbpc.attention_backward`` -> (grad q, grad k, grad v)."""
    _no_dropout(dropout_p)
    grad, q, k, v, out = _last_dim_dense(grad, q, k, v, out)
    seed = offset = torch.zeros((), dtype=torch.int64, device=q.device)  # unused without dropout
    if _flash(q, attn_mask):  # not variable-length: no cumulative lengths, the max lengths are the shapes
        return aten._scaled_dot_product_flash_attention_backward.default(
            grad, q, k, v, out, lse, None, None, q.shape[-2], k.shape[-2], 0.0, is_causal, seed, offset, scale=scale)
    gq, gk, gv, _ = aten._scaled_dot_product_efficient_attention_backward.default(
        grad, q, k, v, attention_bias(attn_mask, q, k), out, lse, seed, offset, 0.0, [True, True, True, False], is_causal,
        scale=scale)
    return gq, gk, gv


def _random_shard(backend, *args, draw=None, **kwargs):
    if draw is not None:  # a pipelined plan replays the CPU generator's states (runtime/rng.py)
        raise PlanError("a random op in a pipelined plan on the cuda backend",
                        hint="the replay of random draws records the CPU generator only; run pipelined plans with "
                             "random ops on --backend cpu, or drop the dropout")
    return random_shard(backend, *args, **kwargs)


class CudaBackend(Backend):
    name = "cuda"

    def __init__(self, communicator: Communicator, topology: Topology | None = None, device: torch.device | None = None):
        self.device = device if device is not None else getattr(communicator, "device", None) or local_device()
        super().__init__(communicator, topology)

    def kernels(self):
        table = {
            "sbpc.attention": attention,
            "sbpc.attention_backward": attention_backward,
            "sbpc.constant": partial(constant, device=self.device),
        }
        table.update({op: partial(fn, self) for op, fn in shard_op_kernels().items()})
        table[RANDOM_SHARD] = partial(_random_shard, self)
        table.update({op: partial(fn, self) for op, fn in collectives.KERNELS.items()})
        return table

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """Into pinned (page-locked) host memory, which the GPU's copy engine reads and writes
        directly at the link's speed (pageable memory is staged through a bounce buffer)."""
        return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True).copy_(t)

    def host_backend(self) -> Backend:
        """Where the init program runs: the CPU, so the weights are eager's bit for bit."""
        from sbpc.runtime.backend import LocalCommunicator
        from sbpc.runtime.cpu import CpuBackend

        return CpuBackend(LocalCommunicator())


def constant(values, shape, dtype, *, device):
    return torch.tensor(values, dtype=dtype, device=device).reshape(shape)
