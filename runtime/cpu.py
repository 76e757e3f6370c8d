"""The cpu backend: torch CPU kernels (and gloo, once meshes span processes)."""
from __future__ import annotations

import torch

from sbpc.runtime.backend import Backend

aten = torch.ops.aten


def _attention(q, k, v, dropout_p, is_causal, attn_mask=None, scale=None):
    return aten._scaled_dot_product_flash_attention_for_cpu.default(
        q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)


def _attention_backward(grad, q, k, v, out, lse, dropout_p, is_causal, attn_mask=None, scale=None):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
        grad, q, k, v, out, lse, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)


def constant(values, shape, dtype):
    return torch.tensor(values, dtype=dtype).reshape(shape)


class CpuBackend(Backend):
    name = "cpu"
    device = torch.device("cpu")

    def kernels(self):
        return {
            "sbpc.attention": _attention,
            "sbpc.attention_backward": _attention_backward,
            "sbpc.constant": constant,
        }
