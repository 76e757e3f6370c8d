"""A sum of torch's losses that had no SBP rule (a pipeline refused them; dp ran them on the
gathered batch): smooth L1, Huber, soft margin, binary cross-entropy on probabilities with
class weights, multi-class margin with class weights, multi-label margin (two outputs, one
scaled), multi-label soft margin (log-sigmoid), in mean, sum and none reductions."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class ManyLosses(nn.Module):
    def __init__(self, classes: int):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh())
        self.head = nn.Linear(32, classes)
        self.reg = nn.Linear(32, classes)
        self.register_buffer("class_weight", torch.linspace(0.5, 1.5, classes))

    def forward(self, x, label, value, labels):
        h = self.body(x)
        logits, pred = self.head(h), self.reg(h)
        sign = torch.where(value > 0, 1.0, -1.0)
        picked = torch.where(labels, torch.arange(labels.shape[1]), -1).sort(1, descending=True).values
        return (F.smooth_l1_loss(pred, value, beta=0.5)
                + F.huber_loss(pred, value, delta=0.7, reduction="sum") / x.shape[0]
                + F.soft_margin_loss(logits, sign)
                + F.binary_cross_entropy(torch.sigmoid(logits), labels.float(), weight=self.class_weight)
                + F.multi_margin_loss(logits, label, margin=0.5, weight=self.class_weight)
                + (F.multilabel_margin_loss(logits, picked, reduction="none") * torch.linspace(1, 2, x.shape[0])).mean()
                + F.multilabel_soft_margin_loss(logits, labels.float()))


def build_model(classes: int = 6):
    return ManyLosses(classes)


def example_batch(batch_size, classes: int = 6):
    return (torch.randn(batch_size, 16), torch.randint(0, classes, (batch_size,)), torch.randn(batch_size, classes),
            torch.rand(batch_size, classes) > 0.5)
