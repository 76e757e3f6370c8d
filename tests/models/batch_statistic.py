"""A statistic of the whole batch added back into every sample: the mean of
nn.MultiheadAttention's attention weights over all samples. Its gradient is a sum over the
whole batch that every sample's backward needs, so no micro-batch can finish its backward
before all have: a pipeline refuses it (one micro-batch runs it)."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(8, 32)
        self.mha = nn.MultiheadAttention(32, 4, batch_first=True)
        self.head = nn.Linear(32, 10)

    def forward(self, x, y):
        h = self.emb(x)
        o, w = self.mha(h, h, h)
        o = o + w.mean()
        return F.cross_entropy(self.head(o.mean(1)), y)


def build_model():
    return M()


def example_batch(batch_size, **kw):
    return torch.randn(batch_size, 6, 8), torch.randint(0, 10, (batch_size,))
