"""Hugging Face's calling conventions without Hugging Face: ``example_batch`` returns a dict whose
order is not forward()'s (``forward(**batch)`` binds by name), and forward returns a tuple that
starts with the loss (``return_dict=False``'s ``(loss, logits)``)."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class KeywordBatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, features, labels=None, sample_weight=None):
        logits = self.head(F.silu(self.body(features)))
        loss = (F.cross_entropy(logits, labels, reduction="none") * sample_weight).mean()
        return loss, logits


def build_model():
    return KeywordBatch()


def example_batch(batch_size):
    return {"sample_weight": torch.rand(batch_size) + 0.5, "labels": torch.randint(0, 3, (batch_size,)),
            "features": torch.randn(batch_size, 8)}
