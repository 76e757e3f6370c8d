"""Hugging Face ConvNeXt for image classification (a patchify convolution, depthwise 7x7
convolutions, channels-last LayerNorms, an inverted MLP with layer scale, downsampling between
stages, global average pooling), built from a tiny config with random weights (no download). The
model is unmodified; this file adapts it to the sbpc model contract. Its constructor reads the
drop-path rates out of a ``torch.linspace`` (``.tolist()``), which capture evaluates for real
(``init_record.py``). Drop path is off (rate 0) so that parity with eager is exact."""
import torch
from transformers import ConvNextConfig, ConvNextForImageClassification


def _config(widths=(16, 32), depths=(1, 1), labels=10):
    return ConvNextConfig(num_channels=3, hidden_sizes=list(widths), depths=list(depths), num_stages=len(widths),
                          patch_size=2, num_labels=labels, drop_path_rate=0.0)


class WithLoss(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.model = ConvNextForImageClassification(cfg)

    def forward(self, pixel_values, labels):
        return self.model(pixel_values=pixel_values, labels=labels).loss


def build_model(**kw):
    return WithLoss(_config(**kw))


def example_batch(batch_size, image=16, **kw):
    return torch.randn(batch_size, 3, image, image), torch.randint(0, _config(**kw).num_labels, (batch_size,))
