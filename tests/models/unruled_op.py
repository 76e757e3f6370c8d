"""Two layers around an op with no SBP rule (``Tensor.unfold``): it runs on the whole batch."""
import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(4, 4)

    def forward(self, x):
        windows = self.a(x).unfold(1, 4, 4)  # [batch, 2, 4]
        return self.b(windows).square().mean()


def build_model():
    return Net()


def example_batch(batch_size):
    return (torch.randn(batch_size, 8),)
