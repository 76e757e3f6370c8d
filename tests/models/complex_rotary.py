"""Rotary embeddings the way Meta's reference Llama writes them: pairs of features viewed as
complex numbers (``view_as_complex``), multiplied by ``torch.polar`` phases, viewed back
(``view_as_real``); the backward multiplies by the conjugate (``_conj``)."""
import torch
import torch.nn as nn
import torch.nn.functional as F


def phases(dim: int, end: int) -> torch.Tensor:
    freqs = 1.0 / (10000.0 ** (torch.arange(0, dim, 2).float() / dim))
    angles = torch.outer(torch.arange(end).float(), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def rotate(x: torch.Tensor, ph: torch.Tensor) -> torch.Tensor:
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * ph.view(1, xc.shape[1], 1, xc.shape[-1])).flatten(3).type_as(x)


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.SiLU(), nn.Linear(2 * d, d))

    def forward(self, x, ph):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        q, k = rotate(q, ph), rotate(k, ph)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.out(o.transpose(1, 2).reshape(b, t, d))
        return x + self.ff(x)


class ComplexRotaryLM(nn.Module):
    def __init__(self, vocab=256, d=32, heads=4, layers=2, seq=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.head = nn.Linear(d, vocab, bias=False)
        self.register_buffer("ph", phases(d // heads, seq), persistent=False)

    def forward(self, ids, labels):
        x = self.emb(ids)
        ph = self.ph[: ids.shape[1]]
        for blk in self.blocks:
            x = blk(x, ph)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def build_model(**kw):
    return ComplexRotaryLM()


def example_batch(batch_size, seq=16, **kw):
    ids = torch.randint(0, 256, (batch_size, int(seq)))
    return ids, ids.roll(-1, 1)
