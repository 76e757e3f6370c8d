"""Hugging Face Llama (GQA: 4 query heads sharing 2 key/value heads; RoPE, RMSNorm, SwiGLU),
built from a small config with random weights (no download).

The model is unmodified; this file only adapts it to the sbpc model contract. Attention is
whatever Hugging Face picks by default (sdpa). ``examples/hf_llama.megatron.toml`` is its
Megatron tensor parallelism.
"""
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def _config(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256, seq=16):
    return LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, intermediate_size=ffn, vocab_size=vocab,
                       max_position_embeddings=seq, pad_token_id=0, bos_token_id=0, eos_token_id=0)


class LlamaWithLoss(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.model = LlamaForCausalLM(cfg)

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels, use_cache=False).loss


def build_model(**kw):
    return LlamaWithLoss(_config(**kw))


def example_batch(batch_size, **kw):
    cfg = _config(**kw)
    ids = torch.randint(0, cfg.vocab_size, (batch_size, cfg.max_position_embeddings))
    return ids, ids.clone()
