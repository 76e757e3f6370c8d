"""A model with a computed (non-random) buffer: the init replay must rebuild it."""
import torch


class Net(torch.nn.Module):
    def __init__(self, seq=8, dim=16):
        super().__init__()
        self.register_buffer("mask", torch.tril(torch.ones(seq, seq)).bool(), persistent=False)
        self.register_buffer("scale", torch.arange(1, dim + 1, dtype=torch.float32) / dim)
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x, y):
        scores = (self.proj(x) * self.scale) @ x.transpose(1, 2)
        scores = scores.masked_fill(~self.mask, float("-inf")).softmax(-1)
        return torch.nn.functional.mse_loss(scores @ x, y)


def build_model(seq=8, dim=16):
    return Net(seq, dim)


def example_batch(batch_size, seq=8, dim=16):
    return torch.randn(batch_size, seq, dim), torch.randn(batch_size, seq, dim)
