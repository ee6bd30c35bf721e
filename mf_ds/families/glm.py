"""GLM's runtime code (translators/families/glm.py names it, PatchTargets.hooks): the fused RoPE adapter of
transformers' GLM `apply_rotary_pos_emb`, which rotates interleaved pairs of the first cos.shape[-1] columns of each
head (partial_rotary_factor) and passes the rest through (mf_ds/patch/kernels.py rebinds it after a probe).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from mf_ds.families.llama import fixed, out_dtype
from mf_ds.ops.rope import fused_rope


def rope_glm(q, k, cos, sin, unsqueeze_dim=1):
    """GLM's `apply_rotary_pos_emb`: interleaved pairs over the first cos.shape[-1] columns, the rest passed through."""
    return fused_rope(q, k, cos, sin, unsqueeze_dim, "interleaved", out_dtype(q, cos, sin))


def rope_probe(adapter: Callable) -> tuple[int, bool]:
    """The probe's tables (mf_ds/patch/kernels.py _probe): GLM rotates part of the head (partial_rotary_factor)."""
    return 4, False


# PatchTargets.rope -> model -> (the function's name in the modeling module, its adapter)
ROPES: dict[str, Callable[[nn.Module], tuple[str, Callable]]] = {
    "glm": fixed("apply_rotary_pos_emb", rope_glm),
}
