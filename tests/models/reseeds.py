"""A forward that reseeds the global generator before drawing (Reformer reseeds its LSH hashing
and dropout so that its backward draws them again): refused with the line that reseeds."""
import torch


class Noisy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        torch.manual_seed(1234)
        return (self.lin(x) * torch.rand(8)).square().mean()


def build_model():
    return Noisy()


def example_batch(batch_size):
    return torch.randn(batch_size, 8)
