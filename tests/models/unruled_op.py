"""Two layers around an op with no SBP rule (``Tensor.renorm``): it runs on the whole batch."""
import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(4, 4)

    def forward(self, x):
        rows = self.a(x).renorm(2, 0, 1.0).view(-1, 2, 4)  # each row's norm at most 1: [batch, 2, 4]
        return self.b(rows).square().mean()


def build_model():
    return Net()


def example_batch(batch_size):
    return (torch.randn(batch_size, 8),)
