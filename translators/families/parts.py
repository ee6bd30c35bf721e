"""Pieces several family records share (translators/families/record.py): AutoTP partition specs and HF defaults.

AutoTP partition specs are DeepSpeed's `tensor_parallel.partition_config.layer_specs` entries, for the families whose
HF tp_plan DeepSpeed cannot convert (translators/parallel.py says when a record's `tp` is used).
"""

from __future__ import annotations

from typing import Any


def spec(patterns: list[str], kind: str, **extra: Any) -> dict:
    return {"patterns": patterns, "partition_type": kind, **extra}


ATTENTION = (
    spec([r".*\.self_attn\.(q|k|v)_proj\.weight$"], "column"),
    spec([r".*\.self_attn\.o_proj\.weight$"], "row"),
)
# Qwen3's per-head norms see only this rank's heads: replicated, gradients summed over TP (HF's
# `replicated_with_grad_allreduce`, DeepSpeed's grad_allreduce hook).
QK_NORM = (spec([r".*\.self_attn\.(q|k)_norm\.weight$"], "skip", grad_allreduce=True),)
# Dense MLPs (first_k_dense layers) and shared experts; `mlp.gate.weight` (the router) matches none of these.
MLP = (
    spec([r".*\.mlp\.(shared_experts?\.)?(gate|up)_proj\.weight$"], "column"),
    spec([r".*\.mlp\.(shared_experts?\.)?down_proj\.weight$"], "row"),
)
# DeepSeek MLA: the low-rank down projections (q_a_proj, kv_a_proj_with_mqa) and their norms stay whole; the up
# projections split by head, o_proj by its input.
MLA = (
    spec([r".*\.self_attn\.(q_proj|q_b_proj|kv_b_proj)\.weight$"], "column"),
    spec([r".*\.self_attn\.o_proj\.weight$"], "row"),
)
# GLM: packed [gate; up] rows, each half split (shape [2, -1] on dim 0).
GLM_MLP = (
    spec([r".*\.mlp\.gate_up_proj\.weight$"], "column", shape=[2, -1], partition_dim=0),
    spec([r".*\.mlp\.down_proj\.weight$"], "row"),
)

# HF's config defaults (transformers 5.23) for the keys the memory formulas read that a translated hf_config may
# leave out.
MLA_DEFAULTS = {"qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "q_lora_rank": 1536,
                "kv_lora_rank": 512}

MODELS = "transformers.models"
