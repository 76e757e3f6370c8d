"""Hugging Face T5 (encoder-decoder, relative position buckets, RMS-style layer norm, tied
embeddings), built from a tiny config with random weights (no download). The model is
unmodified; this file adapts it to the sbpc model contract. T5 makes the decoder's input by
filling a fresh tensor in place (``_shift_right``: ``new_zeros``, a write into a slice, one into
a column, ``masked_fill_``), which capture's functionalization turns into out-of-place ops. Some
labels are -100 (ignored by the loss, and replaced by padding in the decoder's input). Dropout
is off so that parity with eager is exact."""
import torch
from transformers import T5Config, T5ForConditionalGeneration


def _config(layers=2, d_model=64, d_kv=16, heads=4, d_ff=128, vocab=256):
    return T5Config(num_layers=layers, num_decoder_layers=layers, d_model=d_model, d_kv=d_kv, num_heads=heads,
                    d_ff=d_ff, vocab_size=vocab, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
                    bos_token_id=0, eos_token_id=1)


class WithLoss(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.model = T5ForConditionalGeneration(cfg)

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels, use_cache=False).loss


def build_model(**kw):
    return WithLoss(_config(**kw))


def example_batch(batch_size, seq=16, **kw):
    cfg = _config(**kw)
    ids = torch.randint(2, cfg.vocab_size, (batch_size, seq))
    labels = torch.flip(ids, dims=[1])
    labels[:, -3:] = -100  # the tail is ignored: every row keeps most of its tokens
    return ids, labels
