"""A model whose fp16 gradients overflow at GradScaler's first scale (2**16) and not at half of
it: the loss is the sum of a linear layer's outputs times ``gain``, so the gradient reaching the
fp16 matmul is ``gain * scale`` per entry, past fp16's largest finite 65504 when gain * 2**16 is."""
import torch


class Net(torch.nn.Module):
    def __init__(self, gain):
        super().__init__()
        self.gain = gain
        self.fc = torch.nn.Linear(8, 4)
        self.out = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.out(torch.relu(self.fc(x))).float().sum() * self.gain / x.shape[0]


def build_model(gain=1.0):
    return Net(gain)


def example_batch(batch_size, gain=1.0):
    return (torch.rand(batch_size, 8) * 0.1,)
