"""What the translator reads from a model_config for the rest of the translator, and the class / model_type names
that tell the families apart (the families themselves: translators/families/registry.py)."""

from __future__ import annotations

from dataclasses import dataclass

from translators.families.record import FamilyRecord

MODEL_CONFIG = "model.model_config"
ARCH = "model.arch"
MOE_CONFIG = "moe_config"
DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class ModelShape:
    """What the rest of the translator needs from `model.model_config`, whatever the family."""

    num_layers: int  # decoder layers (num_layers / num_hidden_layers)
    mtp_depth: int  # DeepSeek multi-token-prediction layers, counted in the pipeline layout (0 elsewhere)
    hidden_size: int
    num_heads: int
    vocab_size: int
    seq_length: int  # training sequence length
    compute_dtype: str  # bfloat16 | float16 | float32 (the config class's default when absent)
    param_init_type: str  # parameter storage dtype (float32: fp32 master weights)
    use_fused_rope: bool  # use_fused_rope (mcore apply_rope_fusion): the fused RoPE kernel; default False
    use_fused_swiglu: bool  # use_fused_swiglu (mcore bias_swiglu_fusion): the fused SwiGLU kernel; default False
    pp_interleave_num: int  # virtual-pipeline chunks per stage; default 1
    offset: object  # per-stage layer offset as written: int, [pp] or [vpp][pp]; default 0
    input_sliced_sig: bool = False  # True: dataset rows are seq_length tokens with labels; False: seq_length+1 tokens
    mtp_loss_factor: float = 0.3  # MTP loss weight: loss += mtp_loss_factor / mtp_depth * mtp_loss (DS3 default)
    return_extra_loss: bool = False  # MoE aux losses join the LM loss (DeepSeek, mcore MoE: True; Llama MoE: no)


NO_MODEL = FamilyRecord("none", None, "other", False, "no model section")

# Which family a class or model_type names ("llama*" / "glm*": told apart by their keys, see _VARIANTS).
_LLAMA_LIKE, _GLM_LIKE = "llama*", "glm*"
_CONFIG_FAMILY = {
    "LlamaConfig": _LLAMA_LIKE, "DeepseekV3Config": "deepseek_v3", "DeepseekV2Config": "deepseek_v2",
    "TelechatConfig": "telechat", "ChatGLM2Config": _GLM_LIKE, "ChatGLM3Config": _GLM_LIKE,
    "ChatGLM4Config": _GLM_LIKE, "GPT2Config": "gpt2", "YiZhaoConfig": "yizhao",
}
_ARCH_FAMILY = {
    "LlamaForCausalLM": _LLAMA_LIKE, "DeepseekV3ForCausalLM": "deepseek_v3", "DeepseekV2ForCausalLM": "deepseek_v2",
    "TelechatForCausalLM": "telechat", "ChatGLM2ForConditionalGeneration": _GLM_LIKE,
    "ChatGLM3ForConditionalGeneration": _GLM_LIKE, "ChatGLM4ForConditionalGeneration": _GLM_LIKE,
    "GPT2LMHeadModel": "gpt2", "Baichuan7BV2ForCausalLM": "baichuan2", "Baichuan13BV2ForCausalLM": "baichuan2",
    "YiZhaoForCausalLM": "yizhao",
}
_CONFIG_CLASSES, _ARCH_CLASSES = tuple(_CONFIG_FAMILY), tuple(_ARCH_FAMILY)
