"""Attention with ALiBi built as Hugging Face Bloom builds it: per-head slopes made of constants,
repeated over the batch into ``[batch*heads, 1, seq]`` and added by ``baddbmm`` to the scores of
the batch and heads folded into one dim; a causal mask expanded over the batch. A repeat's output
dim splits two ways (its copies, here the batch; or each copy, the heads), and the batch must
split over dp and micro-batches (tests/test_parallel.py)."""
import math

import torch
import torch.nn.functional as F


class Net(torch.nn.Module):
    def __init__(self, heads=4, dim=16, vocab=32):
        super().__init__()
        self.heads, self.vocab = heads, vocab
        self.emb = torch.nn.Embedding(vocab, dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, ids, labels):
        b, t = ids.shape
        h = self.heads
        x = self.emb(ids)
        d = x.shape[-1] // h
        slopes = torch.pow(torch.tensor(0.5), torch.arange(1, h + 1))
        alibi = (slopes[:, None, None] * torch.arange(t)).repeat(b, 1, 1)  # [b*h, 1, t]
        q, k, v = (z.transpose(1, 2).reshape(b * h, t, d) for z in self.qkv(x).view(b, t, h, 3, d).unbind(3))
        scores = torch.baddbmm(alibi, q, k.transpose(1, 2), alpha=1 / math.sqrt(d)).view(b, h, t, t)
        causal = torch.arange(t)[None, :] <= torch.arange(t)[:, None]
        scores = torch.where(causal[None, None].expand(b, 1, t, t), scores, torch.finfo(scores.dtype).min)
        y = torch.bmm(scores.softmax(-1).view(b * h, t, t), v).view(b, h, t, d).transpose(1, 2).reshape(b, t, h * d)
        return F.cross_entropy(self.head(x + y).view(b * t, -1), labels.view(-1))


def build_model(heads=4, dim=16, vocab=32):
    return Net(heads, dim, vocab)


def example_batch(batch_size, seq=8, vocab=32, **kw):
    ids = torch.randint(0, vocab, (batch_size, seq))
    return ids, ids.clone()
