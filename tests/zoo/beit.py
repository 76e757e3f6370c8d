"""Hugging Face BEiT for image classification (a relative position bias per layer, read through
an index that Hugging Face builds once per window size and keeps in a process-wide
``lru_cache``; layer scale; mean pooling), built from a tiny config with random weights (no
download). The model is used as it is: a dict batch and the loss of its output. Drop path
and dropout are off so that parity with eager is exact."""
import torch
from transformers import BeitConfig, BeitForImageClassification


def _config(layers=2, hidden=64, heads=4, ffn=128, image=16, patch=4, labels=10):
    return BeitConfig(image_size=image, patch_size=patch, num_channels=3, hidden_size=hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, intermediate_size=ffn, num_labels=labels,
                      use_relative_position_bias=True, layer_scale_init_value=0.1, drop_path_rate=0.0,
                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def build_model(**kw):
    return BeitForImageClassification(_config(**kw))


def example_batch(batch_size, **kw):
    cfg = _config(**kw)
    return {"pixel_values": torch.randn(batch_size, 3, cfg.image_size, cfg.image_size),
            "labels": torch.randint(0, cfg.num_labels, (batch_size,))}
