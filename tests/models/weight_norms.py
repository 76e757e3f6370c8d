"""Weight and spectral normalization, as in WaveNet, HiFi-GAN and GAN discriminators: torch's
parametrizations (``weight_norm`` over dim 0, the last dim and the whole tensor, whose
magnitude is a 0-d parameter; ``spectral_norm``) and
the old hook-based ``nn.utils.weight_norm`` / ``spectral_norm``. Spectral normalization's power
iteration writes its ``u`` and ``v`` buffers in training (``F.normalize(..., out=u)``), which
capture refused (``aten.div.out``); ``_weight_norm_interface`` and ``vdot`` had no rule."""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrizations


class Discriminator(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.pre = parametrizations.weight_norm(nn.Conv1d(2, channels, 3, padding=1))
        self.mid = nn.utils.weight_norm(nn.Conv1d(channels, channels, 3, padding=2, dilation=2))
        self.last = parametrizations.weight_norm(nn.Conv1d(channels, channels, 1), dim=2)
        self.whole = parametrizations.weight_norm(nn.Linear(8, 8), dim=None)
        self.sn = parametrizations.spectral_norm(nn.Conv1d(channels, channels, 3, padding=1))
        self.sn_old = nn.utils.spectral_norm(nn.Linear(channels * 8, 16))
        self.out = parametrizations.spectral_norm(nn.Linear(16, 1))

    def forward(self, wave, real):
        h = F.leaky_relu(self.pre(wave), 0.1)
        h = F.leaky_relu(self.mid(h), 0.1) + h
        h = F.leaky_relu(self.sn(self.whole(self.last(h))), 0.1)
        score = self.out(F.leaky_relu(self.sn_old(h.flatten(1)), 0.1)).squeeze(1)
        return F.binary_cross_entropy_with_logits(score, real)


def build_model(channels: int = 6):
    return Discriminator(channels)


def example_batch(batch_size, channels: int = 6):
    return torch.randn(batch_size, 2, 8), (torch.rand(batch_size) > 0.5).float()
