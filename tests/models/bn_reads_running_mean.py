import torch
import torch.nn as nn


class Net(nn.Module):
    """Forward reads BatchNorm's running mean (the value before this step's update) before the BatchNorm runs."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 16)
        self.bn = nn.BatchNorm1d(16)
        self.fc3 = nn.Linear(16, 1)

    def forward(self, x, y):
        h = self.fc1(x) + self.bn.running_mean
        h = torch.relu(self.bn(self.fc2(torch.relu(h))))
        return (self.fc3(h).squeeze(1) - y).pow(2).mean()


def build_model():
    return Net()


def example_batch(batch_size):
    return torch.randn(batch_size, 8), torch.randn(batch_size)
