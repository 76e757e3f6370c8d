"""Hugging Face SegFormer for semantic segmentation, built from a tiny config with random weights
(no download), used as it is: a dict batch and the loss of its output. Stochastic depth draws its
mask with ``torch.rand(..., dtype=x.dtype)`` and the classifier has dropout: `sbpc check`'s float64
twin must draw float32's numbers to stand in (``check_dropout.Float32Draws``), or the gradients of
the biases under BatchNorm (exactly zero, rounding noise in float32) are judged without it."""
import torch
from transformers import SegformerConfig, SegformerForSemanticSegmentation


def _config():
    return SegformerConfig(num_channels=3, num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
                           patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2],
                           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.1,
                           drop_path_rate=0.1, decoder_hidden_size=32, num_labels=5, semantic_loss_ignore_index=255)


def build_model():
    return SegformerForSemanticSegmentation(_config())


def example_batch(batch_size):
    return {"pixel_values": torch.randn(batch_size, 3, 32, 32), "labels": torch.randint(0, 5, (batch_size, 32, 32))}
