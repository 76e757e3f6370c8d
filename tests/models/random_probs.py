"""A model that draws a mask from tensor-valued probabilities (torch.bernoulli(probs)):
a random op that reads values, so a pipeline cannot replay its draw from shapes alone."""
import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        keep = torch.bernoulli(torch.sigmoid(h).detach())
        return self.b(h * keep).pow(2).mean()


def build_model():
    return Net()


def example_batch(batch_size):
    return (torch.randn(batch_size, 8),)
