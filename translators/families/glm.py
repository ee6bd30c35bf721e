"""ChatGLM2Config (GLM): ChatGLM2/3, GLM-4-9B; YiZhaoConfig shares its names."""

from __future__ import annotations

from translators import memory, names
from translators.families import parts
from translators.families.base import _CONFIG_CLASSES
from translators.families.derive import _glm_kv_heads, _glm_rope, _seq_positions
from translators.families.llama import LLAMA
from translators.families.parts import MODELS
from translators.families.record import FamilyRecord, PatchTargets, Weights
from translators.families.rules import (
    _GENERATION_KEYS,
    _SHAPE_KEYS,
    ASCEND,
    CHECKPOINT,
    DROP,
    FLASH,
    FP32_SOFTMAX,
    GENERATION,
    INFERENCE,
    LAYOUT,
    NO_CACHE,
    NORM_FP32,
    PAGED,
    PREDICT_BATCH,
    REGISTER,
    ROTARY_FP32,
    Expect,
    Feeds,
    Ident,
    Rule,
    Shape,
    _each,
)
from translators.families.spec import _Spec

# ---------------------------------------------------------------------------------------------------------------
# ChatGLM2Config (GLM): ChatGLM2/3, GLM-4-9B; YiZhaoConfig shares its names.

GLM: dict[str, Rule | str] = {
    "type": Ident(_CONFIG_CLASSES),
    "auto_register": DROP(REGISTER),
    "batch_size": DROP(PREDICT_BATCH),
    "num_layers": "num_hidden_layers",
    "padded_vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "ffn_hidden_size": "intermediate_size",
    "kv_channels": "head_dim",
    "num_attention_heads": "num_attention_heads",
    "seq_length": Feeds(),
    "hidden_dropout": Expect(0.0, "no hidden dropout, as in HF Glm", "HF Glm has no hidden dropout"),
    "attention_dropout": "attention_dropout",
    "layernorm_epsilon": "rms_norm_eps",
    "rope_ratio": Feeds(),
    "rmsnorm": Expect(True, "RMSNorm, as in HF Glm", "HF Glm has RMSNorm only"),
    "apply_residual_connection_post_layernorm": Expect(False, "residual from the block input, as in HF Glm",
                                                       "HF Glm takes the residual before the norm"),
    "post_layer_norm": Expect(True, "final norm, as in HF Glm", "HF Glm always applies a final norm"),
    "add_bias_linear": Expect(False, "no dense/MLP bias, as in HF Glm", "HF Glm has no dense/MLP biases"),
    "add_qkv_bias": "attention_bias",
    "bias_dropout_fusion": DROP(ASCEND),
    "multi_query_attention": Feeds(),
    "multi_query_group_num": Feeds(unused="ignored: multi_query_attention is false"),
    "apply_query_key_layer_scaling": DROP("fp16 overflow guard: scores are divided by the layer number and "
                                          "multiplied back before a float32 softmax; no numeric effect"),
    "attention_softmax_in_fp32": Expect(True, *FP32_SOFTMAX),
    "fp32_residual_connection": Expect(False, "residual in the activation dtype, as in HF",
                                       "HF keeps the residual stream in the activation dtype"),
    "quantization_bit": Expect(0, "no quantisation", "inference quantisation; not applied in training"),
    "pre_seq_len": Expect(None, "no P-tuning prefix", "P-tuning v2 prefixes are not supported here"),
    "prefix_projection": Expect(False, "no P-tuning prefix projection", "P-tuning v2 is not supported here"),
    "param_init_type": LLAMA["param_init_type"],
    "compute_dtype": "dtype",
    "layernorm_compute_type": Expect(*NORM_FP32),
    "rotary_dtype": Expect(*ROTARY_FP32),
    "use_past": Expect(*NO_CACHE),
    "use_flash_attention": DROP(FLASH),
    "block_size": DROP(PAGED),
    "num_blocks": DROP(PAGED),
    "is_dynamic": DROP(INFERENCE),
    "eos_token_id": "eos_token_id",
    "pad_token_id": "pad_token_id",
    "bos_token_id": "bos_token_id",
    "gmask_token_id": DROP("GLM prompt token; the tokenizer and data pipeline write it"),
    "checkpoint_name_or_path": DROP(CHECKPOINT),
    **_each(_GENERATION_KEYS, DROP(GENERATION)),
    "qkv_concat": DROP(LAYOUT),
    "mlp_concat": DROP(LAYOUT),
    "no_recompute_layers": DROP("ignored by ChatGLM2Config (r1.5.0; only YiZhaoConfig reads it): these layers are "
                                "recomputed like the others"),
    **_each(_SHAPE_KEYS, Shape()),
}
GLM_ALIASES = {"padded_vocab_size": "vocab_size", "num_attention_heads": "num_heads", "ffn_hidden_size":
               "intermediate_size", "kv_channels": "head_dim", "layernorm_epsilon": "rms_norm_eps"}
GLM_DEFAULTS = {
    "num_layers": 28, "vocab_size": 65024, "hidden_size": 4096, "intermediate_size": 13696, "head_dim": 128,
    "num_heads": 32, "seq_length": 2048, "hidden_dropout": 0.0, "attention_dropout": 0.0, "rms_norm_eps": 1e-5,
    "rope_ratio": 1.0, "add_qkv_bias": True, "multi_query_attention": True, "multi_query_group_num": 2,
    "compute_dtype": "float16", "param_init_type": "float16", "eos_token_id": 2, "pad_token_id": 0,
    "pp_interleave_num": 1, "offset": 0,
}

# --- the weight names (translators/names.py applies them) -------------------------------------------------------------
# mindformers/models/glm2/convert_weight.py + convert_reversed.py (1.7.0) and ChatGLM2ForConditionalGeneration's
# own names, to transformers' `glm` (THUDM/glm-4-9b-hf): the same weights, renamed; both fuse gate/up, gate first.
GLM_NAMES = (
    ("transformer.embedding.embedding_weight", "model.embed_tokens.weight"),
    ("transformer.encoder.final_layernorm.", "model.norm."),
    ("transformer.output_layer.", "lm_head."),
    ("transformer.encoder.layers.", "model.layers."),
    (".self_attention.dense.", ".self_attn.o_proj."),
    (".self_attention.wq.", ".self_attn.q_proj."),
    (".self_attention.wk.", ".self_attn.k_proj."),
    (".self_attention.wv.", ".self_attn.v_proj."),
    (".mlp.dense_h_to_4h.", ".mlp.gate_up_proj."),
    (".mlp.dense_4h_to_h.", ".mlp.down_proj."),
)
# GLM with mlp_concat False: dense_left (gate) and dense_right (up) are the halves of gate_up_proj (mlp_split).
GLM_SPLIT = {".mlp.gate_up_proj.": ("halves", (".mlp.dense_left.", ".mlp.dense_right."))}
# glm2/convert_weight.py attn_split: query_key_value is q, k, v one after the other (np.split on axis 0)
GLM_FUSED = {".self_attention.query_key_value.": ("qkv_cat", names.QKV)}
GLM_PREFIXES = ("transformer.",)  # the first part of a weight's name

# --- the family records (translators/families/record.py) ------------------------------------------------------------
# ChatGLM2/3 and GLM-4-9B share one architecture (ChatGLM2Config): transformers' `glm` (THUDM/glm-4-9b-hf). Its
# `glm4` is GLM-4-0414, which adds post-attention and post-MLP norms that these models do not have.
_GLM_WEIGHTS = Weights(GLM_NAMES, split=GLM_SPLIT, style="glm", fused=GLM_FUSED, prefixes=GLM_PREFIXES)
_GLM_RUNTIME = PatchTargets(f"{MODELS}.glm.modeling_glm", rope="glm", hooks="glm", mlps=("GlmMLP",))
RECORDS = (
    FamilyRecord("glm4", "glm", "glm", False, weights=_GLM_WEIGHTS, tp=parts.ATTENTION + parts.GLM_MLP,
                 runtime=_GLM_RUNTIME),
    FamilyRecord("chatglm", "glm", "glm", False, weights=_GLM_WEIGHTS, tp=parts.ATTENTION + parts.GLM_MLP,
                 runtime=_GLM_RUNTIME),
    FamilyRecord("yizhao", None, "glm", False,
                 reason="YiZhao has no transformers architecture (a MindFormers research model)"),
)


def specs() -> dict[tuple[str, bool], _Spec]:
    """ChatGLM2Config's families and YiZhaoConfig: table, defaults, derivations."""
    derive = (_glm_kv_heads, _glm_rope, _seq_positions)
    return {
        ("glm4", False): _Spec("ChatGLM2Config", GLM, GLM_DEFAULTS, derive, aliases=GLM_ALIASES,
                               head_dim_derived=False),
        ("chatglm", False): _Spec("ChatGLM2Config", GLM, GLM_DEFAULTS, derive, aliases=GLM_ALIASES,
                                  head_dim_derived=False),
        ("yizhao", False): _Spec("YiZhaoConfig", GLM, GLM_DEFAULTS, aliases=GLM_ALIASES, head_dim_derived=False),
    }


# --- memory hooks (translators/memory.py: this family's parameter and activation counts) ------------------------------

def memory_attention(hf: dict, h: int, a: int, k: int, d: int) -> list:
    """GLM's q/k/v carry a bias unless attention_bias says otherwise (add_qkv_bias); o_proj none."""
    return memory.dense_attention(h, a, k, d, hf.get("attention_bias", True))
