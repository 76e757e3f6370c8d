"""torch's own ``nn.Transformer`` (encoder-decoder, seq-first) with the causal mask built in
forward, as the PyTorch tutorials write it, and a padding mask over the source.

``nn.TransformerEncoder``/``Decoder`` compare a given mask with a causal one
(``bool((mask == causal).all())``) to pick their kernel: a read of a tensor's value, which the
trace answers because the mask is made from constants alone (``constant_reads.py``).
"""
import torch
import torch.nn.functional as F


class Seq2Seq(torch.nn.Module):
    def __init__(self, vocab=96, d=32, layers=1):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d, padding_idx=0)
        self.tf = torch.nn.Transformer(d_model=d, nhead=4, num_encoder_layers=layers, num_decoder_layers=layers,
                                       dim_feedforward=64, dropout=0.0)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, src, tgt, labels):
        causal = torch.nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        h = self.tf(self.emb(src).transpose(0, 1), self.emb(tgt).transpose(0, 1), tgt_mask=causal,
                    src_key_padding_mask=src == 0)
        logits = self.head(h.transpose(0, 1))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def build_model(layers=1):
    return Seq2Seq(layers=layers)


def example_batch(batch_size, layers=1):
    src = torch.randint(1, 96, (batch_size, 12))
    src[:, -2:] = 0  # padding
    tgt = torch.randint(1, 96, (batch_size, 10))
    labels = torch.randint(0, 96, (batch_size, 10))
    labels[:, -1] = -100
    return src, tgt, labels
