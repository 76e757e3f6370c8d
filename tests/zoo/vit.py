"""Hugging Face ViT for image classification (patch embedding by a strided convolution, a class
token, learned position embeddings, pre-LayerNorm encoder), built from a tiny config with random
weights (no download). The model is used as it is: a dict batch and the loss of its output.
Its class token and position embeddings are drawn by ``nn.init.trunc_normal_``, whose rejection
loop the init program runs as one op (``runtime/init_ops.py``). Dropout is off so that parity
with eager is exact."""
import torch
from transformers import ViTConfig, ViTForImageClassification


def _config(layers=2, hidden=64, heads=4, ffn=128, image=16, patch=4, labels=10):
    return ViTConfig(image_size=image, patch_size=patch, num_channels=3, hidden_size=hidden, num_hidden_layers=layers,
                     num_attention_heads=heads, intermediate_size=ffn, num_labels=labels,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def build_model(**kw):
    return ViTForImageClassification(_config(**kw))


def example_batch(batch_size, **kw):
    cfg = _config(**kw)
    return {"pixel_values": torch.randn(batch_size, 3, cfg.image_size, cfg.image_size),
            "labels": torch.randint(0, cfg.num_labels, (batch_size,))}
