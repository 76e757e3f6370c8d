"""A nanoGPT-style GPT: fused qkv, causal attention, GELU MLP, cross-entropy loss.

Plain PyTorch: this file runs without sbpc installed. sbpc reads two functions:

    build_model(**kw) -> nn.Module   # forward(idx, targets) returns the scalar loss
    example_batch(batch_size, **kw)  # -> (idx, targets)

Sizes come from ``preset`` (``--set preset=1t``); single keys such as ``--set layers=4``
override the preset. ``--set sp=True`` pins the residual stream to ``S(1)`` (the sequence)
on the tp axis with ``sbpc.shard``: sequence parallelism, when compiled with the Megatron
hints of ``gpt.megatron.toml``. Under plain PyTorch ``shard`` does nothing.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

try:
    from sbpc import shard
except ImportError:  # plain PyTorch: hints are no-ops
    def shard(tensor, **axes):
        return tensor

PRESETS = {
    # name: layers, hidden, heads, vocab, seq
    "tiny": dict(layers=2, hidden=64, heads=4, vocab=256, seq=32),
    "small": dict(layers=12, hidden=768, heads=12, vocab=50304, seq=1024),
    "1.3b": dict(layers=24, hidden=2048, heads=16, vocab=51200, seq=2048),
    "175b": dict(layers=96, hidden=12288, heads=96, vocab=51200, seq=2048),
    "1t": dict(layers=128, hidden=25600, heads=160, vocab=51200, seq=2048),
}


def config(preset="tiny", **overrides):
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    cfg = dict(PRESETS[preset], dropout=0.0, bias=True, sp=False)
    unknown = set(overrides) - set(cfg)
    if unknown:
        raise ValueError(f"unknown GPT settings {sorted(unknown)}; known: {sorted(cfg)}")
    cfg.update(overrides)
    return cfg


class CausalSelfAttention(nn.Module):
    def __init__(self, hidden, heads, dropout, bias):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(hidden, 3 * hidden, bias=bias)  # fused q, k, v
        self.c_proj = nn.Linear(hidden, hidden, bias=bias)
        self.dropout = dropout

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q = q.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        k = k.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        v = v.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, hidden, bias):
        super().__init__()
        self.c_fc = nn.Linear(hidden, 4 * hidden, bias=bias)
        self.c_proj = nn.Linear(4 * hidden, hidden, bias=bias)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, hidden, heads, dropout, bias, sp=False):
        super().__init__()
        self.sp = sp
        self.ln_1 = nn.LayerNorm(hidden)
        self.attn = CausalSelfAttention(hidden, heads, dropout, bias)
        self.ln_2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden, bias)

    def forward(self, x):
        x = self.residual(x)
        x = self.residual(x + self.attn(self.ln_1(x)))
        return self.residual(x + self.mlp(self.ln_2(x)))

    def residual(self, x):
        # sequence parallel: the residual stream (and the layer norms on it) split along the sequence
        return shard(x, tp="S(1)") if self.sp else x


class GPT(nn.Module):
    def __init__(self, layers, hidden, heads, vocab, seq, dropout, bias, sp=False):
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden={hidden} is not divisible by heads={heads}")
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(seq, hidden)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(Block(hidden, heads, dropout, bias, sp) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2 scaled init of residual projections
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * layers))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx, targets):
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def build_model(**kw):
    return GPT(**config(**kw))


def example_batch(batch_size, **kw):
    cfg = config(**kw)
    idx = torch.randint(0, cfg["vocab"], (batch_size, cfg["seq"]))
    targets = torch.randint(0, cfg["vocab"], (batch_size, cfg["seq"]))
    return idx, targets
