"""The families this translator knows, what it reads from a model_config for the rest of the translator, and the
class / model_type names that tell them apart."""

from __future__ import annotations

from dataclasses import dataclass

MODEL_CONFIG = "model.model_config"
ARCH = "model.arch"
MOE_CONFIG = "moe_config"
DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class Family:
    """A model architecture as this translator knows it."""

    name: str  # e.g. "llama", "qwen2_moe", "deepseek_v3", "glm4", "telechat"
    hf_model_type: str | None  # transformers model_type; None when transformers has no architecture for it
    # how MindFormers names ops in a decoder layer: llama|deepseek|mcore|gpt2|glm|other (recompute.STYLES; Telechat
    # names its ops as Llama does)
    layer_style: str
    mcore: bool  # the YAML uses the mcore model_config (use_legacy: False)
    reason: str = ""  # why hf_model_type is None


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


NO_MODEL = Family("none", None, "other", False, "no model section")

# Families with a module of their own (one record each); imported here, once Family exists.
from translators.families import glm4_moe, telechat3  # noqa: E402

FAMILIES = (
    Family("llama", "llama", "llama", False),
    Family("qwen2", "qwen2", "llama", False),
    Family("mixtral", "mixtral", "llama", False),
    Family("qwen2_moe", "qwen2_moe", "llama", False),
    Family("deepseek_v2", "deepseek_v2", "deepseek", False),
    Family("deepseek_v3", "deepseek_v3", "deepseek", False),
    # ChatGLM2/3 and GLM-4-9B share one architecture (ChatGLM2Config): transformers' `glm` (THUDM/glm-4-9b-hf).
    # Its `glm4` is GLM-4-0414, which adds post-attention and post-MLP norms that these models do not have.
    Family("glm4", "glm", "glm", False),
    Family("chatglm", "glm", "glm", False),
    Family("gpt2", "gpt2", "gpt2", False),
    Family("telechat", None, "llama", False,
           "Telechat has no transformers architecture (it ships as trust_remote_code)"),
    Family("baichuan2", None, "llama", False,
           "Baichuan2 has no transformers architecture (trust_remote_code: NormHead, and ALiBi in the 13B)"),
    Family("yizhao", None, "glm", False,
           "YiZhao has no transformers architecture (a MindFormers research model)"),
    Family("qwen3", "qwen3", "mcore", True),
    Family("qwen3_moe", "qwen3_moe", "mcore", True),
    Family("deepseek_v3", "deepseek_v3", "mcore", True),
)
FAMILIES += telechat3.FAMILIES + glm4_moe.FAMILIES
_FAMILY = {(f.name, f.mcore): f for f in FAMILIES}

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
_MCORE_TYPES = {"qwen3": "qwen3", "qwen3_moe": "qwen3_moe", "deepseek_v3": "deepseek_v3", **telechat3.MODEL_TYPES,
                **glm4_moe.MODEL_TYPES}
_MCORE_ARCHS = {"Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe",
                "DeepseekV3ForCausalLM": "deepseek_v3", **telechat3.ARCHS, **glm4_moe.ARCHS}
_CONFIG_CLASSES, _ARCH_CLASSES = tuple(_CONFIG_FAMILY), tuple(_ARCH_FAMILY)
