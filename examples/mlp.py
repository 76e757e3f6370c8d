"""A small MLP regressor. Plain PyTorch; runs without sbpc installed."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, dim_in, hidden, dim_out, layers):
        super().__init__()
        dims = [dim_in] + [hidden] * layers + [dim_out]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))

    def forward(self, x, y):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.relu(x)
        return F.mse_loss(x, y)


def build_model(dim_in=32, hidden=64, dim_out=8, layers=2):
    return MLP(dim_in, hidden, dim_out, layers)


def example_batch(batch_size, dim_in=32, hidden=64, dim_out=8, layers=2):
    return torch.randn(batch_size, dim_in), torch.randn(batch_size, dim_out)
