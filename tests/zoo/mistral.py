"""Hugging Face Mistral (GQA: 4 query heads, 2 key/value heads; RoPE, RMSNorm, SwiGLU; a sliding
window shorter than the sequence), built from a tiny config with random weights (no download).
The model is used as a user has it, with no wrapper: ``build_model`` returns
``MistralForCausalLM``, ``example_batch`` a dict of its keyword arguments (``forward(**batch)``),
and sbpc takes the loss from the ``CausalLMOutputWithPast`` it returns. Attention is whatever
Hugging Face picks by default (sdpa)."""
import torch
from transformers import MistralConfig, MistralForCausalLM


def _config(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256, seq=16, window=8):
    return MistralConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, intermediate_size=ffn, vocab_size=vocab,
                         max_position_embeddings=seq, sliding_window=window, pad_token_id=0,
                         bos_token_id=0, eos_token_id=0, use_cache=False)


def build_model(**kw):
    return MistralForCausalLM(_config(**kw))


def example_batch(batch_size, **kw):
    cfg = _config(**kw)
    ids = torch.randint(0, cfg.vocab_size, (batch_size, cfg.max_position_embeddings))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
