"""Longformer's overlapping chunks: ``as_strided`` over a transposed view. The strides are
those of the view's storage (batch*heads of stride D, the sequence of stride B*H*D), so they
read the right elements only where the tensor has that layout; a gathered or copied tensor
is contiguous. Weights large enough that reading other elements changes the loss."""
import torch
import torch.nn as nn
import torch.nn.functional as F


def chunks(h: torch.Tensor, w: int) -> torch.Tensor:
    """[BH, T, D] -> [BH, T/(w/2) - 1, w, D], windows of w overlapping by half (a view)."""
    st = h.stride()
    size = [h.size(0), h.size(1) // (w // 2) - 1, w, h.size(2)]
    return h.as_strided(size, [st[0], st[1] * (w // 2), st[1], st[2]])


class ChunkAttention(nn.Module):
    def __init__(self, vocab=64, d=16, heads=2, window=4):
        super().__init__()
        self.heads, self.window = heads, window
        self.emb = nn.Embedding(vocab, d)
        self.q, self.k = nn.Linear(d, d), nn.Linear(d, d)
        self.head = nn.Linear(d, vocab)

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        t, b, d = x.shape  # sequence first, as Longformer: the reshape below stays a view
        return x.view(t, b, self.heads, d // self.heads).transpose(0, 1).transpose(1, 2).reshape(
            b * self.heads, t, d // self.heads)

    def forward(self, ids, labels):
        x = self.emb(ids).transpose(0, 1)
        q, k = chunks(self.split_heads(self.q(x)), self.window), chunks(self.split_heads(self.k(x)), self.window)
        score = torch.einsum("bcxd,bcyd->bcxy", q, k).softmax(-1)
        mixed = torch.einsum("bcxy,bcyd->bcxd", score, k).mean((1, 2))  # [BH, D]
        h = mixed.view(ids.shape[0], -1)
        return F.cross_entropy(self.head(h), labels)


def build_model(**kw):
    model = ChunkAttention()
    for p in (model.q.weight, model.k.weight):
        nn.init.normal_(p, std=1.0)
    return model


def example_batch(batch_size, **kw):
    return torch.randint(0, 64, (batch_size, 16)), torch.randint(0, 64, (batch_size,))
