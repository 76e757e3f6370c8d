"""``nn.EmbeddingBag`` over a ``[B, L]`` batch of ids (bags of equal length: the module makes its
offsets, ``arange(0, B*L, L)``), under a classifier head; ``mode`` is ``mean``, ``sum`` or ``max``."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class M(nn.Module):
    def __init__(self, mode="mean", vocab=64, dim=16, classes=4):
        super().__init__()
        self.bag = nn.EmbeddingBag(vocab, dim, mode=mode)
        self.head = nn.Linear(dim, classes)

    def forward(self, ids, y):
        return F.cross_entropy(self.head(torch.tanh(self.bag(ids))), y)


def build_model(mode="mean"):
    return M(mode)


def example_batch(batch_size, mode="mean"):
    return torch.randint(0, 64, (batch_size, 6)), torch.randint(0, 4, (batch_size,))
