"""Megatron's transformer layer as Korthikanti et al. 2022 count its activations: explicit
softmax attention with dropout on the probabilities, dropout after the attention projection
and after the MLP, GELU, pre-layer norms; module names as in examples/gpt.py, so
tests/models/megatron_layer.toml gives it Megatron's tensor parallelism (``sp=True``: sequence
parallelism, the residual stream pinned to S(1) on tp)."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

try:
    from sbpc import shard
except ImportError:
    def shard(tensor, **axes):
        return tensor


class Attention(nn.Module):
    def __init__(self, hidden, heads, seq, dropout):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.c_attn = nn.Linear(hidden, 3 * hidden)
        self.c_proj = nn.Linear(hidden, hidden)
        self.register_buffer("mask", torch.tril(torch.ones(seq, seq, dtype=torch.bool)).view(1, 1, seq, seq))

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in self.c_attn(x).split(h, dim=2))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(h // self.heads))
        att = F.softmax(att.masked_fill(~self.mask[:, :, :s, :s], float("-inf")), dim=-1)
        att = F.dropout(att, self.dropout, self.training)
        y = (att @ v).transpose(1, 2).contiguous().view(b, s, h)
        return F.dropout(self.c_proj(y), self.dropout, self.training)


class MLP(nn.Module):
    def __init__(self, hidden, dropout):
        super().__init__()
        self.dropout = dropout
        self.c_fc = nn.Linear(hidden, 4 * hidden)
        self.c_proj = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return F.dropout(self.c_proj(F.gelu(self.c_fc(x))), self.dropout, self.training)


class Block(nn.Module):
    def __init__(self, hidden, heads, seq, dropout, sp):
        super().__init__()
        self.sp = sp
        self.ln_1, self.ln_2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads, seq, dropout)
        self.mlp = MLP(hidden, dropout)

    def forward(self, x):
        x = self.residual(x)
        x = self.residual(x + self.attn(self.ln_1(x)))
        return self.residual(x + self.mlp(self.ln_2(x)))

    def residual(self, x):
        return shard(x, tp="S(1)") if self.sp else x


class Net(nn.Module):
    def __init__(self, layers, hidden, heads, seq, dropout, sp):
        super().__init__()
        # an input projection, so the first layer norm's input needs a gradient like every other's
        self.inp = nn.Linear(hidden, hidden)
        self.h = nn.ModuleList(Block(hidden, heads, seq, dropout, sp) for _ in range(layers))

    def forward(self, x):
        x = self.inp(x)
        for block in self.h:
            x = block(x)
        return x.pow(2).mean()


def build_model(layers=3, hidden=64, heads=4, seq=32, dropout=0.1, sp=False):
    return Net(layers, hidden, heads, seq, dropout, sp)


def example_batch(batch_size, hidden=64, seq=32, **_):
    return (torch.randn(batch_size, seq, hidden),)
