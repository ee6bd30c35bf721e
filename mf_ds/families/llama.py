"""The Llama family's runtime code (translators/families/llama.py names it, PatchTargets.hooks; so do mcore.py's
Qwen3 records, whose transformers RoPE is Llama's): the fused RoPE adapter of HF's `apply_rotary_pos_emb`.

Qwen2/3, Mixtral, Qwen2/3-MoE and DeepSeek-V3 without rope_interleave carry the same function ("Copied from
transformers.models.llama.modeling_llama.apply_rotary_pos_emb"), so their families' ROPES reuse `rope_split_half`.
An adapter keeps HF's signature with mf_ds.ops.rope inside; mf_ds/patch/kernels.py rebinds the modeling module's
function to it after a probe against the original.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from mf_ds.ops.rope import fused_rope


def out_dtype(q, cos, sin) -> torch.dtype:
    """The dtype HF's `q * cos + rotate_half(q) * sin` has: q's, promoted by the tables (fp32 under autocast)."""
    return torch.promote_types(torch.promote_types(q.dtype, cos.dtype), sin.dtype)


def rope_split_half(q, k, cos, sin, unsqueeze_dim=1):
    """HF `apply_rotary_pos_emb` (Llama, Qwen2/3, Mixtral, Qwen2/3-MoE, DeepSeek-V3 without rope_interleave)."""
    return fused_rope(q, k, cos, sin, unsqueeze_dim, "split_half", out_dtype(q, cos, sin))


def fixed(name: str, adapter: Callable) -> Callable[[nn.Module], tuple[str, Callable]]:
    """A family whose RoPE function does not depend on the model's config."""
    return lambda model: (name, adapter)


# PatchTargets.rope -> model -> (the function's name in the modeling module, its adapter)
ROPES: dict[str, Callable[[nn.Module], tuple[str, Callable]]] = {
    "split_half": fixed("apply_rotary_pos_emb", rope_split_half),
}
