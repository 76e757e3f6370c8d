"""Layers whose ops a pipeline refused or capture could not hold: ``torch.polar`` on
activations (its backward multiplies by the complex scalar 1j, which a plan could not hold),
``F.rrelu`` without training (``rrelu_with_noise`` declares a write to its scratch noise),
``nn.Bilinear`` (``_trilinear``), ``diag_embed``, and the pixel and channel shuffles of
super-resolution and ShuffleNet blocks (no rules: they ran on the gathered batch)."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class LayerOps(nn.Module):
    def __init__(self, classes: int):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.bil = nn.Bilinear(32, 32, 16)
        self.conv = nn.Conv2d(4, 8, 3, padding=1)
        self.out = nn.Linear(16 + 8 + 32 + 64 + 64, classes)

    def forward(self, x, label):
        h = torch.tanh(self.inp(x))  # [N, 32]
        rotated = torch.view_as_real(torch.polar(h.abs() + 1, h))[..., 0]  # |h|+1 at angle h, real part
        gated = F.rrelu(h, 0.1, 0.3, training=False)
        pair = self.bil(h, gated)  # [N, 16]
        diag = torch.diag_embed(h[:, :8]).sum(1)  # [N, 8]
        img = self.conv(h.view(-1, 4, 2, 4))  # [N, 8, 2, 4]
        up = F.pixel_shuffle(img, 2)  # [N, 2, 4, 8]
        down = F.pixel_unshuffle(up, 2)  # [N, 8, 2, 4]
        mixed = F.channel_shuffle(down, 2) + img
        feats = torch.cat([pair, diag, rotated, mixed.flatten(1), up.flatten(1)], 1)
        return F.cross_entropy(self.out(feats), label)


def build_model(classes: int = 5):
    return LayerOps(classes)


def example_batch(batch_size, classes: int = 5):
    return torch.randn(batch_size, 16), torch.randint(0, classes, (batch_size,))
