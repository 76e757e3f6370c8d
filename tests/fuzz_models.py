"""Random small models for the fuzz test, one per seed: plain PyTorch, a valid sbpc model file.

``build_model(seed)`` and ``example_batch(batch_size, seed)`` draw the same architecture from
``seed`` (``describe(seed)``), so any fuzz case is reproducible from the command line:

    sbpc compile tests/fuzz_models.py --set seed=17 --mesh 2x2

The blocks are those of current decoders and encoders: token embeddings (tied to the head or
not) or an input projection, learned positions or RoPE (``rotate_half`` with ``cat``), LayerNorm
or RMSNorm (``nn.RMSNorm`` or written out with ``rsqrt``), multi-head attention through
``scaled_dot_product_attention`` or an explicit softmax with a ``masked_fill`` causal mask,
grouped-query attention (``repeat_interleave`` or ``expand``), GELU/SiLU MLPs and SwiGLU,
dropout, residuals, and a cross-entropy, mean or sum loss; some models carry ``sbpc.shard``
hints (the residual stream on the sequence, the MLP's hidden units, a weight's rows), which may
not divide on the mesh they meet. Sizes are small and often odd (3 heads, hidden 6, vocab 7,
seq 5) to catch uneven splits.
"""
from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

try:
    from sbpc import shard
except ImportError:  # plain PyTorch: hints are no-ops
    def shard(tensor, **axes):
        return tensor


@dataclass(frozen=True)
class Spec:
    kind: str  # "lm": tokens -> logits -> cross-entropy; "regress": floats -> loss; "mlp": no attention
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    seq: int
    ffn: int
    features: int  # input width of "regress" and "mlp" models
    norm: str  # layernorm | rmsnorm | rmsnorm_manual | none
    attention: str  # sdpa | softmax
    gqa: str  # repeat_interleave | expand (used when kv_heads < heads)
    fused_qkv: bool
    positions: str  # learned | rope | none
    mlp: str  # gelu | silu | swiglu
    bias: bool
    tied: bool
    dropout: float
    loss: str  # cross_entropy | mean | sum | mse
    hint: str  # none | residual (S(1) on tp) | ffn (the MLP's hidden, S(2) on tp) | weight (up.weight S(0) on tp)

    @property
    def hidden(self) -> int:
        return self.heads * self.head_dim

    def short(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in asdict(self).items())


def describe(seed: int) -> Spec:
    """The architecture that ``seed`` stands for."""
    r = random.Random(seed)
    kind = r.choice(["lm", "lm", "lm", "regress", "mlp"])
    heads = r.choice([1, 2, 3, 4])
    kv_heads = r.choice([k for k in (1, 2, 3, 4) if heads % k == 0])
    head_dim = r.choice([2, 3, 4]) if kind != "mlp" else r.choice([2, 3, 4, 5])
    positions = r.choice(["learned", "rope", "none"]) if kind == "lm" else r.choice(["rope", "none"])
    if positions == "rope" and head_dim % 2:
        head_dim += 1  # rotate_half pairs the two halves of a head
    return Spec(
        kind=kind, layers=r.choice([1, 1, 1, 1, 1, 2]), heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        vocab=r.choice([7, 8, 11, 16]), seq=r.choice([3, 4, 5, 8]), ffn=r.choice([4, 6, 8, 12]),
        features=r.choice([3, 4, 6, 8]),
        norm=r.choice(["layernorm", "rmsnorm", "rmsnorm_manual", "none"]),
        attention=r.choice(["sdpa", "softmax"]), gqa=r.choice(["repeat_interleave", "expand"]),
        fused_qkv=r.random() < 0.5, positions=positions, mlp=r.choice(["gelu", "silu", "swiglu"]),
        bias=r.random() < 0.5, tied=kind == "lm" and r.random() < 0.4,
        dropout=r.choice([0.0, 0.0, 0.1]),
        loss="cross_entropy" if kind == "lm" else r.choice(["mean", "sum", "mse"]),
        hint=r.choice(["none", "none", "none", "residual", "ffn", "weight"]),
    )


class ManualRMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def make_norm(kind: str, dim: int) -> nn.Module:
    if kind == "layernorm":
        return nn.LayerNorm(dim)
    if kind == "rmsnorm":
        return nn.RMSNorm(dim, eps=1e-6)
    if kind == "rmsnorm_manual":
        return ManualRMSNorm(dim)
    return nn.Identity()


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Rope(nn.Module):
    def __init__(self, head_dim: int, seq: int):
        super().__init__()
        inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
        emb = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, x):  # x: [b, h, t, d]
        t = x.shape[-2]
        return x * self.cos[:t] + rotate_half(x) * self.sin[:t]


class Attention(nn.Module):
    def __init__(self, s: Spec):
        super().__init__()
        self.s = s
        kv = s.kv_heads * s.head_dim
        if s.fused_qkv:
            self.qkv = nn.Linear(s.hidden, s.hidden + 2 * kv, bias=s.bias)
        else:
            self.q = nn.Linear(s.hidden, s.hidden, bias=s.bias)
            self.k = nn.Linear(s.hidden, kv, bias=s.bias)
            self.v = nn.Linear(s.hidden, kv, bias=s.bias)
        self.o = nn.Linear(s.hidden, s.hidden, bias=s.bias)
        self.rope = Rope(s.head_dim, s.seq) if s.positions == "rope" else None
        if s.attention == "softmax":
            self.register_buffer("mask", torch.tril(torch.ones(s.seq, s.seq, dtype=torch.bool)), persistent=False)
        self.drop = nn.Dropout(s.dropout)

    def forward(self, x):
        s = self.s
        b, t, _ = x.shape
        if s.fused_qkv:
            q, k, v = self.qkv(x).split([s.hidden, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], dim=-1)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        q = q.view(b, t, s.heads, s.head_dim).transpose(1, 2)
        k = k.view(b, t, s.kv_heads, s.head_dim).transpose(1, 2)
        v = v.view(b, t, s.kv_heads, s.head_dim).transpose(1, 2)
        if self.rope is not None:
            q, k = self.rope(q), self.rope(k)
        k, v = self.repeat_kv(k), self.repeat_kv(v)
        if s.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=s.dropout if self.training else 0.0, is_causal=True)
        else:
            scores = q @ k.transpose(-2, -1) / math.sqrt(s.head_dim)
            scores = scores.masked_fill(~self.mask[:t, :t], float("-inf"))
            y = self.drop(scores.softmax(dim=-1)) @ v
        return self.o(y.transpose(1, 2).reshape(b, t, s.hidden))

    def repeat_kv(self, x):
        n = self.s.heads // self.s.kv_heads
        if n == 1:
            return x
        if self.s.gqa == "repeat_interleave":
            return x.repeat_interleave(n, dim=1)
        b, h, t, d = x.shape
        return x[:, :, None].expand(b, h, n, t, d).reshape(b, h * n, t, d)


class MLP(nn.Module):
    def __init__(self, s: Spec, dim: int):
        super().__init__()
        self.kind, self.hint = s.mlp, s.hint
        self.up = nn.Linear(dim, s.ffn, bias=s.bias)
        if s.hint == "weight":
            shard(self.up.weight, tp="S(0)")
        if s.mlp == "swiglu":
            self.gate = nn.Linear(dim, s.ffn, bias=False)
        self.down = nn.Linear(s.ffn, dim, bias=s.bias)
        self.drop = nn.Dropout(s.dropout)

    def forward(self, x):
        if self.kind == "swiglu":
            h = F.silu(self.gate(x)) * self.up(x)
        else:
            h = F.gelu(self.up(x)) if self.kind == "gelu" else F.silu(self.up(x))
        if self.hint == "ffn":
            h = shard(h, tp="S(2)")
        return self.drop(self.down(h))


class Block(nn.Module):
    def __init__(self, s: Spec, dim: int):
        super().__init__()
        self.attn = Attention(s) if s.kind != "mlp" else None
        self.norm1 = make_norm(s.norm, dim) if self.attn is not None else None
        self.norm2 = make_norm(s.norm, dim)
        self.mlp = MLP(s, dim)
        self.hint = s.hint

    def forward(self, x):
        if self.hint == "residual":
            x = shard(x, tp="S(1)")
        if self.attn is not None:
            x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class FuzzModel(nn.Module):
    def __init__(self, s: Spec):
        super().__init__()
        self.s = s
        dim = s.hidden
        if s.kind == "lm":
            self.embed = nn.Embedding(s.vocab, dim)
            self.pos = nn.Embedding(s.seq, dim) if s.positions == "learned" else None
        else:
            self.embed = nn.Linear(s.features, dim, bias=s.bias)
            self.pos = None
        self.drop = nn.Dropout(s.dropout)
        self.blocks = nn.ModuleList(Block(s, dim) for _ in range(s.layers))
        self.norm = make_norm(s.norm, dim)
        out = s.vocab if s.kind == "lm" else s.features
        self.head = nn.Linear(dim, out, bias=s.bias and not s.tied)
        if s.tied:
            self.head.weight = self.embed.weight

    def forward(self, x, target):
        h = self.embed(x)
        if self.pos is not None:
            h = h + self.pos(torch.arange(x.shape[1], device=x.device))
        h = self.drop(h)
        for block in self.blocks:
            h = block(h)
        y = self.head(self.norm(h))
        if self.s.loss == "cross_entropy":
            return F.cross_entropy(y.reshape(-1, y.shape[-1]), target.reshape(-1))
        if self.s.loss == "mse":
            return F.mse_loss(y, target)
        err = (y - target) ** 2
        return err.mean() if self.s.loss == "mean" else err.sum()


def build_model(seed: int = 0, dropout: float | None = None):
    s = describe(seed)
    if dropout is not None:
        s = Spec(**{**asdict(s), "dropout": dropout})
    return FuzzModel(s)


def example_batch(batch_size: int, seed: int = 0, dropout: float | None = None):
    s = describe(seed)
    g = torch.Generator().manual_seed(seed)
    if s.kind == "lm":
        idx = torch.randint(0, s.vocab, (batch_size, s.seq), generator=g)
        return idx, torch.randint(0, s.vocab, (batch_size, s.seq), generator=g)
    x = torch.randn(batch_size, s.seq, s.features, generator=g)
    return x, torch.randn(batch_size, s.seq, s.features, generator=g)
