"""Ops of vision and metric-learning models that had no SBP rule (a pipeline refused them;
dp ran them on the gathered batch): PReLU, unfold/fold (im2col/col2im) patches, a spatial
transformer's grid_sample, cdist to class prototypes, bucketize, and Tensor.unfold's windows."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class VisionOps(nn.Module):
    def __init__(self, classes: int):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.act = nn.PReLU(8)
        self.theta = nn.Linear(8 * 16, 6)  # a spatial transformer's affine parameters
        self.patch = nn.Linear(8 * 4, 16)  # 2x2 patches of 8 channels -> 16 features
        self.prototypes = nn.Parameter(torch.randn(classes, 16))
        self.register_buffer("edges", torch.tensor([-1.0, 0.0, 1.0]))

    def forward(self, img, label):
        h = self.act(self.conv(img))  # [N, 8, 4, 4]
        n = h.shape[0]
        theta = torch.tanh(self.theta(h.flatten(1))).view(n, 2, 3)
        grid = F.affine_grid(theta, [n, 8, 4, 4], align_corners=False)
        h = F.grid_sample(h, grid, align_corners=False) + h
        cols = F.unfold(h, 2, stride=2)  # [N, 32, 4]
        h = h + F.fold(cols, (4, 4), 2, stride=2) * 0.5
        feats = self.patch(F.unfold(h, 2, stride=2).transpose(1, 2)).mean(1)  # [N, 16]
        feats = feats * (1 + 0.1 * torch.bucketize(feats.detach(), self.edges).float())
        feats = feats + 0.1 * feats.unfold(1, 4, 4).mean(-1).repeat_interleave(4, 1)  # windows of 4 features
        logits = -torch.cdist(feats[:, None], self.prototypes[None].expand(n, -1, -1)).squeeze(1)
        return F.cross_entropy(logits, label)


def build_model(classes: int = 5):
    return VisionOps(classes)


def example_batch(batch_size, classes: int = 5):
    return torch.randn(batch_size, 3, 4, 4), torch.randint(0, classes, (batch_size,))
