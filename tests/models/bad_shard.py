"""A model whose in-code hint has a malformed SBP."""
import torch

import sbpc


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = sbpc.shard(self.lin(x), tp="Q")
        return y.sum()


def build_model():
    return Net()


def example_batch(batch_size):
    return (torch.randn(batch_size, 8),)
