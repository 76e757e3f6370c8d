"""Hugging Face Swin Transformer for image classification (attention within shifted windows, a
relative position bias table, patch merging between stages), built from a tiny config with random
weights (no download). The model is used as it is: a dict batch and the loss of its output.
Its pooler is ``AdaptiveAvgPool1d(1)`` of a transposed sequence, which PyTorch computes as a mean
restrided in place (``as_strided_``) and differentiates through an ``as_strided`` write: capture
turns both into views (``as_strided.py``). Dropout and drop path are off so that parity with
eager is exact."""
import torch
from transformers import SwinConfig, SwinForImageClassification


def _config(dim=16, depths=(1, 1), heads=(2, 4), image=16, window=4, labels=10):
    return SwinConfig(image_size=image, patch_size=2, num_channels=3, embed_dim=dim, depths=list(depths),
                      num_heads=list(heads), window_size=window, mlp_ratio=2.0, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0, drop_path_rate=0.0, num_labels=labels)


def build_model(**kw):
    return SwinForImageClassification(_config(**kw))


def example_batch(batch_size, **kw):
    cfg = _config(**kw)
    return {"pixel_values": torch.randn(batch_size, 3, cfg.image_size, cfg.image_size),
            "labels": torch.randint(0, cfg.num_labels, (batch_size,))}
