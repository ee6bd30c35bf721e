"""MindFormers parameter names <-> Hugging Face names, one table per family (pure data; mf_ds/ckpt.py applies it).

Checked against MindFormers 1.7.0's own converters, which map with the same substring replacements:
mindformers/models/llama/convert_weight.py and convert_reversed.py (`name_replace`), research/qwen2_5/
convert_reversed.py (`name_replace`), and against the names MindFormers' legacy LlamaForCausalLM really has
(tests/fixtures/mindformers/*/golden.json). Qwen2 / Qwen2.5 run on the same legacy LlamaForCausalLM (LlamaConfig
with qkv_has_bias), so they share the table. No weight is permuted: MindFormers' RoPE rotates halves like HF's.

Fused layouts (`qkv_concat: True`): `attention.w_qkv` is q, k, v interleaved per KV group and
`feed_forward.w_gate_hidden` is gate and up interleaved per row (mindformers/utils/convert_utils.py
qkv_concat_hf2mg / ffn_concat_hf2mg); mf_ds/ckpt.py splits them back.

Names outside the model (optimizer moments `adam_m.*` / `adam_v.*`, `global_step`, `epoch_num`, `step_num`,
`loss_scale`, `scale_sense`, `learning_rate`, ...) are not weights: `mf_to_hf` returns None for them.
"""

from __future__ import annotations

# (MindFormers substring, HF substring), applied in order, as MindFormers' name_replace does.
LLAMA = (
    ("model.tok_embeddings.embedding_weight", "model.embed_tokens.weight"),
    ("model.norm_out.", "model.norm."),
    (".attention.wq.", ".self_attn.q_proj."),
    (".attention.wk.", ".self_attn.k_proj."),
    (".attention.wv.", ".self_attn.v_proj."),
    (".attention.wo.", ".self_attn.o_proj."),
    (".feed_forward.w1.", ".mlp.gate_proj."),
    (".feed_forward.w2.", ".mlp.down_proj."),
    (".feed_forward.w3.", ".mlp.up_proj."),
    (".attention_norm.", ".input_layernorm."),
    (".ffn_norm.", ".post_attention_layernorm."),
)
FUSED = {".attention.w_qkv.": "qkv", ".feed_forward.w_gate_hidden.": "gate_up"}
NAME_MAPS = {"llama": LLAMA, "qwen2": LLAMA}
MODEL_PREFIXES = ("model.", "lm_head.")


def name_map(family: str) -> tuple[tuple[str, str], ...]:
    if family not in NAME_MAPS:
        raise KeyError(f"no MindFormers -> HF parameter name map for family {family!r} (have: "
                       f"{', '.join(sorted(NAME_MAPS))})")
    return NAME_MAPS[family]


def is_weight(name: str) -> bool:
    """True for a model parameter; False for optimizer state and counters saved beside it."""
    return name.startswith(MODEL_PREFIXES)


def fused_kind(name: str) -> str | None:
    """'qkv' or 'gate_up' for a fused MindFormers weight, else None."""
    return next((kind for part, kind in FUSED.items() if part in name), None)


def mf_to_hf(name: str, family: str) -> str | None:
    """The HF name of MindFormers parameter `name`; None when it is not a model weight."""
    if not is_weight(name):
        return None
    for mf, hf in name_map(family):
        name = name.replace(mf, hf)
    return name


def hf_to_mf(name: str, family: str) -> str:
    """The MindFormers name of HF parameter `name` (the table backwards)."""
    for mf, hf in reversed(name_map(family)):
        name = name.replace(hf, mf)
    return name
