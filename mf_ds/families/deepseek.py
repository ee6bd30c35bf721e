"""DeepSeek-V2 and V3's runtime code (translators/families/deepseek.py names it, PatchTargets.hooks; mcore.py's
DeepSeek-V3 reuses that record): the fused RoPE adapters of transformers' DeepSeek functions (mf_ds/patch/kernels.py
rebinds them after a probe).

DeepSeek-V2 rotates with a complex `freqs_cis` (`apply_rotary_emb`); DeepSeek-V3's attention picks
`apply_rotary_pos_emb_interleave` (interleaved pairs in, split halves out) or Llama's `apply_rotary_pos_emb` by
config.rope_interleave.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from mf_ds.families.llama import fixed, out_dtype, rope_split_half
from mf_ds.ops.rope import fused_rope


def rope_deepseek_v3_interleave(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """DeepSeek-V3's `apply_rotary_pos_emb_interleave`: interleaved pairs in, split halves out."""
    if position_ids is not None:  # HF's function takes it and never reads it; a caller passing one expects an effect
        raise ValueError("fused RoPE: apply_rotary_pos_emb_interleave ignores position_ids; pass None (cos and sin "
                         "already hold the positions)")
    return fused_rope(q, k, cos, sin, unsqueeze_dim, "interleaved_to_split", out_dtype(q, cos, sin))


def rope_deepseek_v2(xq, xk, freqs_cis):
    """DeepSeek-V2's `apply_rotary_emb`: complex `freqs_cis [B, S, D/2]` on interleaved pairs, fp32 math, q's dtype."""
    if not freqs_cis.is_complex() or freqs_cis.dim() != 3:
        raise ValueError(f"fused RoPE: apply_rotary_emb expects complex freqs_cis [B, S, D/2], got "
                         f"{tuple(freqs_cis.shape)} {freqs_cis.dtype}")
    cos, sin = freqs_cis.real, freqs_cis.imag
    cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)  # HF's table layout; B S D, tiny
    return fused_rope(xq, xk, cos, sin, 1, "interleaved", xq.dtype)


def _deepseek_v3_rope(model: nn.Module) -> tuple[str, Callable]:
    # DeepseekV3Attention.forward picks the function by config.rope_interleave (default True)
    if model.config.rope_interleave:
        return "apply_rotary_pos_emb_interleave", rope_deepseek_v3_interleave
    return "apply_rotary_pos_emb", rope_split_half


def rope_probe(adapter: Callable) -> tuple[int, bool]:
    """The probe's tables (mf_ds/patch/kernels.py _probe): DeepSeek-V2's function takes one complex freqs_cis."""
    return 8, adapter is rope_deepseek_v2


# PatchTargets.rope -> model -> (the function's name in the modeling module, its adapter)
ROPES: dict[str, Callable[[nn.Module], tuple[str, Callable]]] = {
    "deepseek_v2": fixed("apply_rotary_emb", rope_deepseek_v2),
    "deepseek_v3": _deepseek_v3_rope,
}
