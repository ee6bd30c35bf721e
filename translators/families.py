"""Per-family model tables: MindFormers `model.model_config` (+ `model.arch`) -> a Hugging Face config dict.

`detect_family` names the architecture a YAML describes; `hf_config` turns its `model_config` into the keyword
arguments of `transformers.AutoConfig.for_model(**d)`; `model_shape` extracts what the rest of the translator needs
(layer count, dtypes, pipeline layout, fused-kernel switches) for every family, with or without an HF architecture.

One table per MindFormers config class (LlamaConfig, DeepseekV2/V3Config, ChatGLM2Config, GPT2Config, the mcore
`use_legacy: False` configs) says, key by key, what each `model_config` key becomes:
  "hf_name" / Map   an HF config key (the value typed by `_TYPES`, the key's MindFormers type)
  Feeds             an input of a derived HF value (intermediate_size from multiple_of, rope_parameters from
                    theta/extend_method/scaling_factor, ...); noted with what it fed, or why it went unused
  Expect            a value the HF architecture hard-codes: fine when the YAML agrees, a `differs` note when not
  Differs           carried (or not) with behaviour that differs from MindFormers (a warning)
  Drop              understood and not carried: inference-only, Ascend performance, weight layout, generation,
                    inert leftovers
  Shape             read by `model_shape` into the Plan (pipeline layout, fused kernels, losses), noted there
  Runtime           read by the mf_ds runtime from the YAML section as it is (mcore MoE router settings)
  Ident             names the family (config class, arch class, model_type)
A key in no table gets an `unknown` note: MindFormers' legacy configs keep unknown keys (PretrainedConfig **kwargs)
and never read them. `hf_config` and `model_shape` together account for every key under `model.model_config` and
`model.arch`; of the top-level `moe_config` only the keys that feed the HF config are accounted here. mcore YAMLs keep
their MoE router settings in model_config: MCORE_MOE_NAMES gives the legacy moe_config name of each.

Sources (keys.md): LC = mindformers/models/llama/llama_config.py r1.5.0, DS3 = research/deepseek3/deepseek3_config.py,
DS2 = research/deepseek2/deepseek2_config.py, GLM = mindformers/models/glm2/glm2_config.py, GPT2 =
mindformers/models/gpt2/gpt2_config.py, MAP = COMMON_CONFIG_MAPPING in parallel_core/transformer_config_utils.py
(master), MoE = MoEConfig in mindformers/modules/transformer/moe.py r1.5.0 (moe.md §1).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from translators.errors import ConfigError, did_you_mean, join, show
from translators.notes import Ledger

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
    Family("telechat3", None, "mcore", True,
           "TeleChat3 has no transformers architecture (it ships as trust_remote_code)"),
)
_FAMILY = {(f.name, f.mcore): f for f in FAMILIES}


# ---------------------------------------------------------------------------------------------------------------
# Value types. PyYAML reads `1e-5` (no dot) and `None` as strings; MindFormers YAMLs are full of both.

Conv = Callable[[Any, str], Any]
_NUMBER_TEXT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def _is_null(value: Any) -> bool:
    return value is None or value == "None"


def _int(minimum: int) -> Conv:
    expected = "a positive int" if minimum == 1 else f"an int >= {minimum}"

    def conv(value: Any, path: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError(path, f"expected {expected}, got {show(value)}")
        return value
    return conv


def _number(value: Any, path: str) -> float:
    if isinstance(value, str) and _NUMBER_TEXT.fullmatch(value.strip()):
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
        raise ConfigError(path, f"expected a number, got {show(value)}")
    return float(value)


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond the float range (10**400)
        return False


def _positive(value: Any, path: str) -> float:
    number = _number(value, path)
    if number <= 0:
        raise ConfigError(path, f"expected a positive number, got {show(value)}")
    return number


def _fraction(value: Any, path: str) -> float:
    number = _number(value, path)
    if not 0 <= number <= 1:
        raise ConfigError(path, f"expected a probability in [0, 1], got {show(value)}")
    return number


def _count(value: Any, path: str) -> float:
    """A non-negative count that MindFormers also accepts as a float (`shared_expert_num: 8.0`)."""
    number = _number(value, path)
    if number < 0 or number != int(number):
        raise ConfigError(path, f"expected a whole number >= 0, got {show(value)}")
    return int(number)


def _flag(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(path, f"expected true or false, got {show(value)}")
    return value


def _optional(conv: Conv) -> Conv:
    return lambda value, path: None if _is_null(value) else conv(value, path)


def _choice(*choices: str) -> Conv:
    def conv(value: Any, path: str) -> str:
        if value not in choices:
            raise ConfigError(path, f"expected one of {', '.join(choices)}; got {show(value)}",
                              did_you_mean(value, choices))
        return value
    return conv


def _dtype(value: Any, path: str) -> str:
    return _choice(*DTYPES)(value, path)


def _token(value: Any, path: str) -> int | list[int] | None:
    """A token id, a list of them (eos_token_id), or null."""
    if _is_null(value):
        return None
    items = value if isinstance(value, list) else [value]
    if not items or any(isinstance(i, bool) or not isinstance(i, int) for i in items):
        raise ConfigError(path, f"expected a token id or a list of them, got {show(value)}")
    return value


def _first_k(value: Any, path: str) -> int:
    # MoEConfig's default is True, and `layer_id < True` makes it 1 (moe.md §1).
    return int(value) if isinstance(value, bool) else _int(0)(value, path)


def _offset(value: Any, path: str) -> object:
    """int, [pp] or [vpp][pp] (recompute.md §2); the layout module checks the sums."""
    rows = value if isinstance(value, list) else [value]
    cells = [c for row in rows for c in (row if isinstance(row, list) else [row])]
    if any(isinstance(c, bool) or not isinstance(c, int) for c in cells):
        raise ConfigError(path, f"expected an int, a list of ints or a list of lists of ints, got {show(value)}")
    return value


# MindFormers extend_method names (SeqExtendMethod in llama_layer.py) and the mcore position_embedding_type ones.
_EXTEND_METHODS = {"None": "None", "PI": "PI", "NTK": "NTK", "YARN": "YARN", "LLAMA3": "LLAMA3",
                   "DYNAMIC_NTK": "DYNAMIC_NTK", "linear": "linear", "rope": "None", "yarn": "YARN", "llama3": "LLAMA3"}


def _extend(value: Any, path: str) -> str:
    if value is None:
        return "None"
    if not isinstance(value, str) or value not in _EXTEND_METHODS:
        raise ConfigError(path, f"expected one of {', '.join(_EXTEND_METHODS)}; got {show(value)}",
                          did_you_mean(value, _EXTEND_METHODS))
    return _EXTEND_METHODS[value]


def _scaling(value: Any, path: str) -> float | dict | None:
    """A float factor (PI, NTK) or a dict {factor, beta_fast, ...} (YARN, LLAMA3, linear)."""
    if _is_null(value):
        return None
    if isinstance(value, dict):
        return {key: _number(item, join(path, key)) for key, item in value.items()}
    return _positive(value, path)


# The router's score function: legacy use_gating_sigmoid (bool), mcore scoring_func / moe_router_score_function.
def _sigmoid(value: Any, path: str) -> bool:
    names = {"sigmoid": True, "softmax": False}
    return _flag(value, path) if isinstance(value, bool) else names[_choice(*names)(value, path)]


# Activation names: MindSpore nn.GELU defaults to approximate=True (tanh, HF gelu_new); FastGeLU is
# x * sigmoid(1.702 x) (HF quick_gelu); the SwiGLU spellings of mcore are silu with a gated MLP.
_ACTIVATIONS = {"gelu": "gelu_new", "fast_gelu": "quick_gelu", "relu": "relu", "silu": "silu", "swish": "silu",
                "swiglu": "silu", "fusedswiglu": "silu", "tanh": "tanh", "sigmoid": "sigmoid"}


def _activation(value: Any, path: str) -> str:
    return _ACTIVATIONS[_choice(*_ACTIVATIONS)(value, path)]


_POS, _NONNEG = _int(1), _int(0)

# The type of each model_config / moe_config key, by canonical (legacy) name.
_TYPES: dict[str, Conv] = {
    "num_layers": _POS, "hidden_size": _POS, "num_heads": _POS, "n_kv_heads": _optional(_POS), "vocab_size": _POS,
    "seq_length": _POS, "intermediate_size": _optional(_POS), "multiple_of": _POS,
    "ffn_dim_multiplier": _optional(_positive), "max_position_embedding": _optional(_POS),
    "max_position_embeddings": _optional(_POS), "head_dim": _POS, "rms_norm_eps": _positive, "theta": _positive,
    "extend_method": _extend, "scaling_factor": _scaling, "init_method_std": _positive,
    "bos_token_id": _token, "eos_token_id": _token, "pad_token_id": _token, "ignore_token_id": _int(-2 ** 31),
    "compute_dtype": _dtype, "param_init_type": _dtype, "layernorm_compute_type": _dtype,
    "layernorm_compute_dtype": _dtype, "softmax_compute_dtype": _dtype, "rotary_dtype": _dtype,
    "router_dense_type": _dtype, "residual_dtype": _optional(_dtype), "embedding_init_type": _optional(_dtype),
    "qkv_has_bias": _flag, "attn_proj_has_bias": _flag, "add_bias_linear": _flag, "add_qkv_bias": _flag,
    "tie_word_embeddings": _flag, "untie_embeddings_and_output_weights": _flag, "use_past": _flag,
    "calculate_per_token_loss": _flag, "gated_linear_unit": _flag, "qk_layernorm": _flag,
    "multi_latent_attention": _flag, "fp32_residual_connection": _flag, "attention_softmax_in_fp32": _flag,
    "offset": _offset, "pp_interleave_num": _POS, "use_fused_rope": _flag, "use_fused_swiglu": _flag,
    "input_sliced_sig": _flag, "mtp_depth": _NONNEG, "mtp_loss_factor": _number, "return_extra_loss": _flag,
    "kv_lora_rank": _POS, "q_lora_rank": _optional(_POS), "qk_rope_head_dim": _POS, "qk_nope_head_dim": _POS,
    "v_head_dim": _POS, "hidden_act": _activation, "hidden_dropout": _fraction, "attention_dropout": _fraction,
    "beta_fast": _number, "beta_slow": _number, "mscale": _number, "mscale_all_dim": _number,
    # GLM (ChatGLM2Config)
    "rope_ratio": _positive, "multi_query_attention": _flag, "multi_query_group_num": _POS, "rmsnorm": _flag,
    "apply_residual_connection_post_layernorm": _flag, "post_layer_norm": _flag, "quantization_bit": _NONNEG,
    "pre_seq_len": _optional(_POS), "prefix_projection": _flag,
    # GPT2Config
    "expand_ratio": _POS, "embedding_dropout_prob": _fraction, "hidden_dropout_rate": _fraction,
    "attention_dropout_rate": _fraction, "post_layernorm_residual": _flag,
    # MoE (moe_config, or mcore model_config)
    "expert_num": _POS, "num_experts_chosen": _POS, "shared_expert_num": _count, "moe_intermediate_size": _POS,
    "first_k_dense_replace": _first_k, "routed_scaling_factor": _positive, "norm_topk_prob": _flag,
    "topk_method": _choice("greedy", "group_limited_greedy", "noaux_tc"), "n_group": _optional(_NONNEG),
    "topk_group": _optional(_NONNEG), "use_gating_sigmoid": _sigmoid,
}


# ---------------------------------------------------------------------------------------------------------------
# Rules: how one key is accounted. `account` handles a key the YAML holds (`key` as spelled, `name` canonical);
# `absent` writes the config class's default for a key it does not hold. `conv` None: the key's type in _TYPES.

@dataclass(frozen=True)
class Map:
    """The value becomes HF config key `hf`."""

    hf: str
    conv: Conv | None = None

    def account(self, s: _Values, key: str, name: str, ctx: _Ctx) -> None:
        ctx.out[self.hf] = s.get(name)
        ctx.note(s, key, "mapped", f"hf {self.hf} = {_short(s.get(name))}")

    def absent(self, s: _Values, name: str, ctx: _Ctx) -> None:
        if s.get(name) is not None:
            ctx.out[self.hf] = s.get(name)


@dataclass(frozen=True)
class Feeds:
    """An input of derived HF values, noted with what it fed; `unused` says why nothing read it (None: noted by
    model_shape)."""

    unused: str | None = None
    conv: Conv | None = None

    def account(self, s: _Values, key: str, name: str, ctx: _Ctx) -> None:
        fed = ctx.fed.get((s.base, name))
        if fed:
            ctx.note(s, key, "mapped", "feeds hf " + ", ".join(f"{k} = {_short(v)}" for k, v in fed.items()))
        elif self.unused:
            ctx.note(s, key, "dropped", self.unused)

    def absent(self, s: _Values, name: str, ctx: _Ctx) -> None:
        return None


@dataclass(frozen=True)
class Expect:
    """HF hard-codes `expected` here: `ok` when the YAML agrees, a `differs` note when not; carried to `hf` if set."""

    expected: Any
    ok: str
    otherwise: str
    hf: str | None = None
    conv: Conv | None = None

    def account(self, s: _Values, key: str, name: str, ctx: _Ctx) -> None:
        value = s.get(name)
        carried = ""
        if self.hf:
            ctx.out[self.hf] = value
            carried = f"hf {self.hf} = {_short(value)}: "
        if value == self.expected:
            ctx.note(s, key, "mapped" if self.hf else "dropped", carried + self.ok)
        else:
            ctx.note(s, key, "differs", carried + self.otherwise)

    def absent(self, s: _Values, name: str, ctx: _Ctx) -> None:
        if self.hf and s.get(name) is not None:
            ctx.out[self.hf] = s.get(name)


@dataclass(frozen=True)
class Differs:
    """Behaviour here differs from MindFormers' (a warning); carried to `hf` when set."""

    why: str
    hf: str | None = None
    conv: Conv | None = None

    def account(self, s: _Values, key: str, name: str, ctx: _Ctx) -> None:
        carried = ""
        if self.hf:
            ctx.out[self.hf] = s.get(name)
            carried = f"hf {self.hf} = {_short(s.get(name))}; "
        ctx.note(s, key, "differs", carried + self.why)

    def absent(self, s: _Values, name: str, ctx: _Ctx) -> None:
        if self.hf and s.get(name) is not None:
            ctx.out[self.hf] = s.get(name)


@dataclass(frozen=True)
class Drop:
    """Understood and deliberately not carried; the value is not checked."""

    why: str
    untyped = True

    def account(self, s: _Values, key: str, name: str, ctx: _Ctx) -> None:
        ctx.note(s, key, "dropped", self.why)

    def absent(self, s: _Values, name: str, ctx: _Ctx) -> None:
        return None


@dataclass(frozen=True)
class Shape:
    """Read by `model_shape` into the Plan, which notes it; not an HF config key."""

    conv: Conv | None = None

    def account(self, s: _Values, key: str, name: str, ctx: _Ctx) -> None:
        return None

    def absent(self, s: _Values, name: str, ctx: _Ctx) -> None:
        return None


@dataclass(frozen=True)
class Runtime:
    """Read by the mf_ds runtime from the YAML as written (the mcore MoE router settings)."""

    why: str
    untyped = True

    def account(self, s: _Values, key: str, name: str, ctx: _Ctx) -> None:
        ctx.note(s, key, "runtime", self.why)

    def absent(self, s: _Values, name: str, ctx: _Ctx) -> None:
        return None


@dataclass(frozen=True)
class Ident:
    """Names the family: a config class, arch class or model_type among `known`."""

    known: tuple[str, ...]
    untyped = True

    def account(self, s: _Values, key: str, name: str, ctx: _Ctx) -> None:
        value = s.raw[key]
        if any(v in self.known for v in (value if isinstance(value, list) else [value]) if isinstance(v, str)):
            ctx.note(s, key, "mapped", f"family {ctx.family.name} (hf model_type {ctx.family.hf_model_type})")
        else:
            ctx.note(s, key, "unknown", f"not a class this translator knows; the family is {ctx.family.name}")

    def absent(self, s: _Values, name: str, ctx: _Ctx) -> None:
        return None


Rule = Map | Feeds | Expect | Differs | Drop | Shape | Runtime | Ident


DROP = Drop  # the table keyword of STYLE.md: "use_past": DROP("inference-only cache switch")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# ---------------------------------------------------------------------------------------------------------------
# Reasons shared by the tables.

GENERATION = "generation parameter (inference only)"
PAGED = "paged-attention setting (inference only)"
INFERENCE = "inference-only switch"
ASCEND = "Ascend performance switch; no numeric effect"
LAYOUT = "fused weight layout of MindFormers checkpoints; no numeric effect"
PREDICT_BATCH = "prediction-time shape; the training batch is runner_config.batch_size"
FLASH = "Ascend FlashAttention; transformers' attention (SDPA) computes the same softmax attention"
CHECKPOINT = "MindFormers weights to load by name or path; not read here (HF checkpoints load through the runtime)"
REGISTER = "imports a research-folder class in MindFormers; here the family picks the transformers class"
PARALLEL_OPT = "lets MindFormers' optimizer parallel shard these weights; ZeRO (parallel.enable_parallel_optimizer) " \
               "decides here"
FFN_GIVEN = "ignored: intermediate_size is set (llama_layer.py:312-319 derives the width only when it is None)"
NO_EXTEND = "ignored: extend_method is 'None' (FreqsMgr reads scaling_factor only for PI/NTK/YARN/LLAMA3)"
SOFTMAX = "softmax dtype of MindFormers' non-flash attention; transformers' attention keeps the softmax in float32"
INERT = "not a {cls} argument: stored through **kwargs and never read"
FP32_MASTER = "fp32 parameters cast to compute_dtype in each layer: DeepSpeed mixed precision's fp32 master weights"
LOW_MASTER = "parameters stored in this dtype; DeepSpeed mixed precision keeps fp32 master weights instead"
NORM_FP32 = ("float32", "HF RMSNorm computes in float32 too", "HF RMSNorm always computes in float32")
ROTARY_FP32 = ("float32", "HF builds the RoPE tables in float32 too",
               "HF builds the RoPE tables in float32, then casts them to the activation dtype")
FP32_SOFTMAX = ("float32 softmax, as in HF", "HF attention keeps the softmax in float32")
NO_CACHE = (False, "inference KV-cache switch, off", "inference KV cache; ignored in training")
IGNORE_100 = (-100, "label value the loss ignores; HF ignores -100 too",
              "HF's loss ignores only label -100: the data pipeline must write -100 for ignored labels")
MOE_RUNTIME = "MoE router setting (moe_config.{legacy}); read by the MoE runtime from model_config"

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
_MCORE_TYPES = {"qwen3": "qwen3", "qwen3_moe": "qwen3_moe", "deepseek_v3": "deepseek_v3", "telechat3": "telechat3"}
_MCORE_ARCHS = {"Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe",
                "DeepseekV3ForCausalLM": "deepseek_v3", "TeleChat3ForCausalLM": "telechat3"}
_CONFIG_CLASSES, _ARCH_CLASSES = tuple(_CONFIG_FAMILY), tuple(_ARCH_FAMILY)

ARCH_RULES: dict[str, Rule | str] = {"type": Ident(_ARCH_CLASSES), "auto_register": DROP(REGISTER)}

_GENERATION_KEYS = ("repetition_penalty", "max_decode_length", "top_k", "top_p", "do_sample", "temperature")
_SHAPE_KEYS = ("offset", "pp_interleave_num", "use_fused_rope", "use_fused_swiglu", "input_sliced_sig")


def _each(keys: tuple[str, ...], rule: Rule) -> dict[str, Rule]:
    return dict.fromkeys(keys, rule)


# ---------------------------------------------------------------------------------------------------------------
# LlamaConfig (LC): Llama 2/3, Qwen1.5/2/2.5, DeepSeek-LLM/Coder, Mixtral, Qwen2-MoE, Baichuan2, Telechat shapes.

LLAMA: dict[str, Rule | str] = {
    "type": Ident(_CONFIG_CLASSES),
    "auto_register": DROP(REGISTER),
    "batch_size": DROP(PREDICT_BATCH),
    "seq_length": Feeds(),  # the RoPE table length when max_position_embedding is unset; model_shape carries it
    "hidden_size": "hidden_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "n_kv_heads": Feeds(),
    "max_position_embedding": Feeds(),
    "intermediate_size": Feeds(),
    "multiple_of": Feeds(unused=FFN_GIVEN),
    "ffn_dim_multiplier": Feeds(unused=FFN_GIVEN),
    "vocab_size": "vocab_size",
    "rms_norm_eps": "rms_norm_eps",
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
    "pad_token_id": Map("pad_token_id"),  # and run.loss_mask_pad_id: the runtime masks input pads (plan.py)
    "ignore_token_id": Expect(*IGNORE_100),
    "theta": Feeds(),
    "extend_method": Feeds(),
    "scaling_factor": Feeds(unused=NO_EXTEND),
    "compute_dtype": "dtype",
    "param_init_type": Expect("float32", FP32_MASTER, LOW_MASTER),
    "embedding_init_type": Differs("the embedding is stored in its own dtype in MindFormers; HF keeps one dtype "
                                   "for every parameter"),
    "residual_dtype": Differs("HF keeps the residual stream in the activation dtype"),
    "layernorm_compute_type": Expect(*NORM_FP32),
    "softmax_compute_type": DROP(SOFTMAX),
    "rotary_dtype": Expect(*ROTARY_FP32),
    "qkv_has_bias": "attention_bias",
    "attn_proj_has_bias": Expect(False, "no o_proj bias, as in HF", "HF has no o_proj-only bias switch"),
    "qkv_concat": DROP(LAYOUT),
    "use_past": Expect(*NO_CACHE),
    "is_dynamic": DROP(INFERENCE),
    "use_rope_slice": DROP(ASCEND),
    "use_flash_attention": DROP(FLASH),
    "use_ring_attention": DROP("ring attention implements parallel_config.context_parallel; that key decides here"),
    "use_attn_mask_compression": DROP(ASCEND),
    "parallel_optimizer": DROP(PARALLEL_OPT),
    "fine_grain_interleave": DROP(ASCEND),
    "init_method_std": "initializer_range",
    "checkpoint_name_or_path": DROP(CHECKPOINT),
    **_each(_GENERATION_KEYS, DROP(GENERATION)),
    "block_size": DROP(PAGED),
    "num_blocks": DROP(PAGED),
    "quant": DROP("inference quantisation"),
    "quant_config": DROP("inference quantisation"),
    "tie_word_embeddings": "tie_word_embeddings",
    "llm_backend": DROP(INFERENCE),
    "fused_rms_norm": DROP(ASCEND),
    "rmsnorm_compute_2d": DROP(ASCEND),
    "chunk_prefill": DROP(INFERENCE),
    "pipeline_stage": DROP("inference-time stage split (start_stage/stage_num); training uses parallel_config"),
    "calculate_per_token_loss": Expect(False, "loss averaged per micro-batch, as in HF",
                                       "per-token loss across micro-batches; the HF loss averages per micro-batch"),
    "mtp_depth": Expect(0, "no MTP layers", "MTP layers exist only in the DeepSeek-V3 family"),
    **_each(_SHAPE_KEYS, Shape()),
    # Leftovers seen in corpus LlamaConfig YAMLs (keys.md): MindFormers keeps and ignores them.
    "initializer_range": Differs(INERT.format(cls="LlamaConfig") + "; MindFormers initialises with init_method_std "
                                 "(default 0.01), and so does hf initializer_range"),
    "emb_dropout_prob": DROP(INERT.format(cls="LlamaConfig") + " (copied from the old Qwen config)"),
    "rotary_pct": DROP(INERT.format(cls="LlamaConfig") + " (full rotary)"),
    "rotary_emb_base": DROP(INERT.format(cls="LlamaConfig") + "; the RoPE base is theta"),
    "compute_in_2d": DROP(INERT.format(cls="LlamaConfig") + " (a DeepseekV2Config key)"),
    "kv_channels": DROP(INERT.format(cls="LlamaConfig") + "; head_dim = hidden_size / num_heads"),
    "pretrain_seqlen": DROP(INERT.format(cls="LlamaConfig") + " (a deprecated DeepseekV2Config key)"),
    "use_past_shard": DROP(INFERENCE),
    "num_block": DROP(INERT.format(cls="LlamaConfig") + " (misspelling of num_blocks, itself inference-only)"),
}

# HF Qwen2 always has q/k/v biases (and no o_proj bias): qkv_has_bias is what makes a LlamaConfig YAML Qwen2.
QWEN2 = {**LLAMA,
         "qkv_has_bias": Expect(True, "HF Qwen2 always has q/k/v biases", "HF Qwen2 always has q/k/v biases")}
MIXTRAL = {**LLAMA,
           "qkv_has_bias": Expect(False, "no q/k/v bias, as in HF Mixtral", "HF Mixtral has no attention bias")}
QWEN2_MOE = {**LLAMA, "qkv_has_bias": "qkv_bias"}

# LlamaConfig.__init__ defaults (LC); TelechatConfig and the Baichuan2 YAMLs (LlamaConfig) share them.
LLAMA_DEFAULTS = {
    "seq_length": 2048, "hidden_size": 4096, "num_layers": 32, "num_heads": 32, "vocab_size": 32000,
    "multiple_of": 256, "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    "ignore_token_id": -100, "theta": 10000.0, "compute_dtype": "float16", "param_init_type": "float16",
    "extend_method": "None", "scaling_factor": 1.0, "init_method_std": 0.01, "qkv_has_bias": False,
    "tie_word_embeddings": False, "pp_interleave_num": 1, "offset": 0, "mtp_depth": 0,
}

# MoEConfig defaults (moe.md §1).
MOE_DEFAULTS = {
    "expert_num": 1, "num_experts_chosen": 1, "shared_expert_num": 0, "moe_intermediate_size": 1407,
    "first_k_dense_replace": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": True, "topk_method": "greedy",
    "use_gating_sigmoid": False,
}


# ---------------------------------------------------------------------------------------------------------------
# Derived HF values, each with its formula. A derivation reads canonical names from `m` (model_config) and `moe`
# (moe_config for legacy MoE families; model_config itself for mcore).

def _ffn_width(m: _Values) -> int:
    """LlamaFeedForward width (llama_layer.py:312-319): 4h, x(ffn_dim_multiplier + 0.01) if set, x2/3 (int), rounded
    up to a multiple of multiple_of. Llama-2-70B: 4*8192*1.31 -> 42926 -> 28617 -> 28672."""
    given = m.get("intermediate_size")
    if given is not None:
        return given
    width = 4 * m.get("hidden_size")
    multiplier = m.get("ffn_dim_multiplier")
    if multiplier is not None:
        width = int((multiplier + 0.01) * width)
    width = int(2 * width / 3)
    multiple_of = m.get("multiple_of")
    return multiple_of * ((width + multiple_of - 1) // multiple_of)


def _ffn(m: _Values, moe: _Values) -> dict:
    return {"intermediate_size": _ffn_width(m)}


def _kv_heads(m: _Values, moe: _Values) -> dict:
    """n_kv_heads None means multi-head attention (LC)."""
    heads = m.get("num_heads")
    kv_heads = m.get("n_kv_heads") or heads
    if kv_heads > heads or heads % kv_heads:
        raise ConfigError(m.path("n_kv_heads"), f"num_heads {heads} is not a multiple of n_kv_heads {kv_heads}")
    return {"num_key_value_heads": kv_heads}


def _llama_positions(m: _Values, moe: _Values) -> dict:
    """FreqsMgr (llama_layer.py) builds the RoPE table for max(max_position_embedding or seq_length, seq_length)."""
    seq_length = m.get("seq_length")
    return {"max_position_embeddings": max(m.get("max_position_embedding") or seq_length, seq_length)}


def _deepseek_positions(m: _Values, moe: _Values) -> dict:
    """DS2/DS3: max_position_embeddings if set, else seq_length."""
    return {"max_position_embeddings": m.get("max_position_embeddings") or m.get("seq_length")}


def _factor(m: _Values) -> float:
    scaling = m.get("scaling_factor")
    factor = scaling.get("factor") if isinstance(scaling, dict) else scaling
    if factor is None:
        raise ConfigError(m.path("scaling_factor"), f"extend_method {m.get('extend_method')} needs a scaling factor")
    return factor


def _rope_dict(m: _Values, rope_type: str, keys: tuple[str, ...]) -> dict:
    """A dict scaling_factor (YARN, LLAMA3) in HF's names, which are MindFormers' names (FreqsMgr)."""
    scaling = m.get("scaling_factor")
    if not isinstance(scaling, dict):
        raise ConfigError(m.path("scaling_factor"), f"extend_method {m.get('extend_method')} needs a dict "
                                                    f"{{{', '.join(keys)}}}, got {show(scaling)}")
    extra = sorted(set(scaling) - set(keys))
    if extra:
        raise ConfigError(join(m.path("scaling_factor"), extra[0]),
                          f"not a {rope_type} key; expected {', '.join(keys)}", did_you_mean(extra[0], keys))
    integral = {"original_max_position_embeddings"}
    return {"rope_type": rope_type, **{k: int(v) if k in integral else v for k, v in scaling.items()}}


_YARN_KEYS = ("factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "original_max_position_embeddings")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _mcore_yarn(m: _Values) -> dict:
    """mcore spells YaRN as flat model_config keys (MAP: rotary_scaling_factor, beta_fast, ..., and
    max_position_embeddings doubling as original_max_position_embeddings)."""
    flat = {"factor": m.get("scaling_factor"), "beta_fast": m.get("beta_fast"), "beta_slow": m.get("beta_slow"),
            "mscale": m.get("mscale"), "mscale_all_dim": m.get("mscale_all_dim"),
            "original_max_position_embeddings": m.get("max_position_embeddings")}
    return {"rope_type": "yarn", **{k: v for k, v in flat.items() if v is not None}}


# extend_method -> HF rope_parameters, as FreqsMgr (llama_layer.py r1.5.0) computes the frequencies:
#   PI / linear   positions divided by the factor                    == HF "linear"
#   NTK           theta *= scaling_factor, a static rescale of the base == HF "default" with that theta
#   DYNAMIC_NTK   == HF "dynamic";  YARN / LLAMA3: dicts with HF's own key names
_ROPE: dict[str, Callable[[_Values], dict]] = {
    "None": lambda m: {"rope_type": "default"},
    "PI": lambda m: {"rope_type": "linear", "factor": _factor(m)},
    "linear": lambda m: {"rope_type": "linear", "factor": _factor(m)},
    "NTK": lambda m: {"rope_type": "default", "rope_theta": m.get("theta") * _factor(m)},
    "DYNAMIC_NTK": lambda m: {"rope_type": "dynamic", "factor": _factor(m)},
    "YARN": lambda m: _rope_dict(m, "yarn", _YARN_KEYS),
    "LLAMA3": lambda m: _rope_dict(m, "llama3", _LLAMA3_KEYS),
}
_MCORE_ROPE = {**_ROPE, "YARN": _mcore_yarn}


def _rope(m: _Values, moe: _Values) -> dict:
    return {"rope_parameters": {"rope_theta": m.get("theta"), **_ROPE[m.get("extend_method")](m)}}


def _mcore_rope(m: _Values, moe: _Values) -> dict:
    method = m.get("extend_method")
    if method not in _MCORE_ROPE:
        raise ConfigError(m.path("extend_method"), f"position embedding {method!r} is not supported for mcore models")
    return {"rope_parameters": {"rope_theta": m.get("theta"), **_MCORE_ROPE[method](m)}}


def _glm_rope(m: _Values, moe: _Values) -> dict:
    """ChatGLM rotates half of each head (RotaryEmbedding(kv_channels // 2)) with base 10000 * rope_ratio."""
    return {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0 * m.get("rope_ratio"),
                                "partial_rotary_factor": 0.5}}


def _seq_positions(m: _Values, moe: _Values) -> dict:
    """The RoPE cache (GLM) covers seq_length positions."""
    return {"max_position_embeddings": m.get("seq_length")}


def _glm_kv_heads(m: _Values, moe: _Values) -> dict:
    """n_kv_heads = multi_query_group_num if multi_query_attention else heads (GLM)."""
    heads = m.get("num_heads")
    groups = m.get("multi_query_group_num") if m.get("multi_query_attention") else heads
    if heads % groups:
        raise ConfigError(m.path("multi_query_group_num"),
                          f"num_attention_heads {heads} is not a multiple of multi_query_group_num {groups}")
    return {"num_key_value_heads": groups}


def _gpt2_ffn(m: _Values, moe: _Values) -> dict:
    """FFN width = hidden_size * expand_ratio (gpt2.py)."""
    return {"n_inner": m.get("hidden_size") * m.get("expand_ratio")}


def _gpt2_positions(m: _Values, moe: _Values) -> dict:
    """The learned position table has max_position_embeddings rows, else seq_length (gpt2.py)."""
    return {"n_positions": m.get("max_position_embeddings") or m.get("seq_length")}


def _qwen2_moe_widths(m: _Values, moe: _Values) -> dict:
    """Llama-path MoE: every routed expert is a LlamaFeedForward of intermediate_size, and the shared FFN is
    intermediate_size x shared_expert_num wide (moe.md §1-2)."""
    width = _ffn_width(m)
    return {"moe_intermediate_size": width, "shared_expert_intermediate_size": width * moe.get("shared_expert_num")}


def _deepseek_v3_groups(m: _Values, moe: _Values) -> dict:
    """HF DeepseekV3 always keeps the best topk_group of n_group expert groups; MindFormers limits groups only for
    topk_method group_limited_greedy / noaux_tc, and the DeepSeek-V3 YAMLs leave it 'greedy' (moe.md §7): one group."""
    if moe.get("topk_method") == "greedy":
        return {"n_group": 1, "topk_group": 1}
    return _groups(moe)


def _mcore_groups(m: _Values, moe: _Values) -> dict:
    """mcore moe_router_num_groups 0 or null means no group limit: one group in HF's terms."""
    return {"n_group": moe.get("n_group") or 1, "topk_group": moe.get("topk_group") or 1}


def _groups(moe: _Values) -> dict:
    groups, top = moe.get("n_group"), moe.get("topk_group")
    if not groups or not top:
        raise ConfigError(moe.path("n_group"), f"topk_method {moe.get('topk_method')} needs n_group and topk_group")
    experts = moe.get("expert_num")
    if experts % groups or top > groups:
        raise ConfigError(moe.path("n_group"), f"{experts} experts do not split into {groups} groups of which "
                                               f"{top} are kept")
    return {"n_group": groups, "topk_group": top}


def _qwen3_dense_layers(m: _Values, moe: _Values) -> dict:
    """first_k_dense_replace k: layers 0..k-1 keep a dense MLP, HF Qwen3-MoE's mlp_only_layers."""
    return {"mlp_only_layers": list(range(moe.get("first_k_dense_replace") or 0))}


def _mcore_tie(m: _Values, moe: _Values) -> dict:
    """untie_embeddings_and_output_weights is the inverse of tie_word_embeddings (MF)."""
    if not m.given("untie_embeddings_and_output_weights"):
        return {}
    tie = not m.get("untie_embeddings_and_output_weights")
    if m.given("tie_word_embeddings") and m.get("tie_word_embeddings") != tie:
        raise ConfigError(m.path("untie_embeddings_and_output_weights"), "contradicts tie_word_embeddings")
    return {"tie_word_embeddings": tie}


# ---------------------------------------------------------------------------------------------------------------
# DeepSeek-V2/V3 legacy configs (DS2, DS3): LlamaConfig-like names plus MLA; MoE from the top-level moe_config.

_DEEPSEEK_SHARED = ("type", "auto_register", "batch_size", "seq_length", "hidden_size", "num_layers", "num_heads",
                    "n_kv_heads", "intermediate_size", "multiple_of", "ffn_dim_multiplier", "vocab_size",
                    "rms_norm_eps", "bos_token_id", "eos_token_id", "pad_token_id", "ignore_token_id", "theta",
                    "extend_method", "scaling_factor", "compute_dtype", "param_init_type", "embedding_init_type",
                    "layernorm_compute_type", "softmax_compute_type", "rotary_dtype", "qkv_concat", "use_past",
                    "is_dynamic", "use_rope_slice", "use_flash_attention", "fine_grain_interleave",
                    "checkpoint_name_or_path", *_GENERATION_KEYS, "block_size", "num_blocks", *_SHAPE_KEYS)

DEEPSEEK: dict[str, Rule | str] = {
    **{key: LLAMA[key] for key in _DEEPSEEK_SHARED},
    "max_position_embeddings": Feeds(),
    "kv_lora_rank": "kv_lora_rank",
    "q_lora_rank": "q_lora_rank",
    "qk_rope_head_dim": "qk_rope_head_dim",
    "qk_nope_head_dim": "qk_nope_head_dim",
    "v_head_dim": "v_head_dim",
    "qkv_has_bias": Expect(False, "no q/k/v bias, as in HF MLA", "HF DeepSeek attention has no q/k/v bias"),
    "router_dense_type": Expect("float32", "router in float32, as HF computes it",
                                "HF DeepSeek computes the router in float32"),
    "return_extra_loss": Shape(),
    "mtp_loss_factor": Shape(),
}
DEEPSEEK_V3 = {
    **DEEPSEEK,
    "init_method_std": "initializer_range",
    "mtp_depth": Expect(0, "no MTP layers", "transformers builds no MTP module from it: MindFormers' MTP layers and "
                                            "their loss are absent unless the runtime adds them",
                        hf="num_nextn_predict_layers"),
}
DEEPSEEK_V2 = {
    **DEEPSEEK,
    **_each(("pretrain_seqlen", "compute_in_2d", "use_past_shard"), DROP("deprecated DeepseekV2Config argument")),
    **_each(("use_kvcache_op", "is_flexible_shape", "use_paged_attention", "use_prompt_flash_attention",
             "use_incre_flash_attention"), DROP(INFERENCE)),
}

DEEPSEEK_MOE: dict[str, Rule | str] = {
    "expert_num": "n_routed_experts",
    "num_experts_chosen": "num_experts_per_tok",
    "shared_expert_num": "n_shared_experts",
    "moe_intermediate_size": "moe_intermediate_size",
    "first_k_dense_replace": "first_k_dense_replace",
    "routed_scaling_factor": "routed_scaling_factor",
    "norm_topk_prob": "norm_topk_prob",
}
DEEPSEEK_V3_MOE = {
    **DEEPSEEK_MOE,
    "topk_method": Feeds(),
    "n_group": Feeds(unused="ignored: topk_method is 'greedy' (moe.md §7); hf n_group = 1"),
    "topk_group": Feeds(unused="ignored: topk_method is 'greedy' (moe.md §7); hf topk_group = 1"),
    "use_gating_sigmoid": Expect(True, "sigmoid scores, as HF DeepseekV3 always computes them",
                                 "HF DeepseekV3 always scores experts with a sigmoid"),
}
DEEPSEEK_V2_MOE = {
    **DEEPSEEK_MOE,
    "topk_method": Map("topk_method", _choice("greedy", "group_limited_greedy")),
    "n_group": "n_group",
    "topk_group": "topk_group",
    "use_gating_sigmoid": Expect(False, "softmax scores, as HF DeepseekV2 computes them",
                                 "HF DeepseekV2 always scores experts with a softmax"),
}

DS3_DEFAULTS = {
    "seq_length": 2048, "hidden_size": 4096, "num_layers": 32, "num_heads": 32, "max_position_embeddings": 32768,
    "intermediate_size": 18432, "multiple_of": 256, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "vocab_size": 129280, "rms_norm_eps": 1e-6,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "ignore_token_id": -100, "theta": 10000.0,
    "compute_dtype": "bfloat16", "param_init_type": "bfloat16", "init_method_std": 0.006, "extend_method": "YARN",
    "mtp_depth": 0, "mtp_loss_factor": 0.3, "return_extra_loss": True, "pp_interleave_num": 1, "offset": 0,
}
DS2_DEFAULTS = {
    **DS3_DEFAULTS, "num_layers": 30, "n_kv_heads": 32, "max_position_embeddings": 4096, "intermediate_size": 12288,
    "vocab_size": 102400, "compute_dtype": "float16", "param_init_type": "float16",
}


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


# ---------------------------------------------------------------------------------------------------------------
# GPT2Config (GPT2). MindFormers ties the LM head to the word embedding (GPTHead multiplies by its table, gpt2.py).

GPT2: dict[str, Rule | str] = {
    "type": Ident(_CONFIG_CLASSES),
    "batch_size": DROP(PREDICT_BATCH),
    "eos_token_id": "eos_token_id",
    "pad_token_id": "pad_token_id",
    "bos_token_id": "bos_token_id",
    "unk_token_id": DROP("tokenizer setting"),
    "seq_length": Feeds(),
    "max_position_embeddings": Feeds(),
    "vocab_size": "vocab_size",
    "hidden_size": "n_embd",
    "num_layers": "n_layer",
    "num_heads": "n_head",
    "num_labels": DROP("size of the sequence-classification head; the causal-LM head has vocab_size outputs"),
    "expand_ratio": Feeds(),
    "embedding_dropout_prob": "embd_pdrop",
    "hidden_dropout_rate": "resid_pdrop",
    "attention_dropout_rate": "attn_pdrop",
    "param_init_type": LLAMA["param_init_type"],
    "layernorm_compute_type": DROP("LayerNorm compute dtype; torch's layer_norm accumulates in float32 whatever "
                                   "the model dtype"),
    "softmax_compute_type": DROP(SOFTMAX),
    "compute_dtype": "dtype",
    "hidden_act": "activation_function",
    "use_past": Expect(*NO_CACHE),
    "post_layernorm_residual": Expect(False, "pre-norm residual, as in HF GPT-2", "HF GPT-2 is pre-norm only"),
    "checkpoint_name_or_path": DROP(CHECKPOINT),
    **_each(_GENERATION_KEYS, DROP(GENERATION)),
    "use_flash_attention": DROP(FLASH),
    "use_prompt_flash_attention": DROP(INFERENCE),
    **_each(_SHAPE_KEYS, Shape()),
}
GPT2_DEFAULTS = {
    "eos_token_id": 50256, "pad_token_id": 50256, "bos_token_id": 50256, "seq_length": 1024, "vocab_size": 50257,
    "hidden_size": 768, "num_layers": 12, "num_heads": 12, "expand_ratio": 4, "embedding_dropout_prob": 0.1,
    "hidden_dropout_rate": 0.1, "attention_dropout_rate": 0.1, "param_init_type": "float32",
    "compute_dtype": "float16", "hidden_act": "gelu_new", "pp_interleave_num": 1, "offset": 0,
}


# ---------------------------------------------------------------------------------------------------------------
# mcore configs (use_legacy: False). MindFormers accepts every spelling in COMMON_CONFIG_MAPPING (MAP) for one
# setting and rejects two spellings of the same one; here each setting has a canonical (legacy) name.

MCORE_SPELLINGS: dict[str, tuple[str, ...]] = {
    "num_layers": ("num_layers", "num_hidden_layers", "n_layer"),
    "num_heads": ("num_heads", "num_attention_heads", "n_head"),
    "n_kv_heads": ("n_kv_heads", "num_key_value_heads", "num_query_groups"),
    "intermediate_size": ("intermediate_size", "ffn_hidden_size"),
    "head_dim": ("head_dim", "kv_channels"),
    "rms_norm_eps": ("rms_norm_eps", "layernorm_epsilon", "layer_norm_epsilon"),
    "qkv_has_bias": ("qkv_has_bias", "attention_bias", "add_qkv_bias"),
    "mtp_depth": ("mtp_depth", "num_nextn_predict_layers", "mtp_num_layers"),
    "mtp_loss_factor": ("mtp_loss_factor", "mtp_loss_scaling_factor"),
    "param_init_type": ("param_init_type", "params_dtype"),
    "theta": ("theta", "rope_theta", "rotary_base"),
    "scaling_factor": ("scaling_factor", "factor", "rotary_scaling_factor"),
    "max_position_embeddings": ("max_position_embeddings", "original_max_position_embeddings"),
    "extend_method": ("extend_method", "position_embedding_type"),
    "init_method_std": ("init_method_std", "initializer_range"),
    "use_fused_rope": ("use_fused_rope", "apply_rope_fusion"),
    "use_fused_swiglu": ("use_fused_swiglu", "bias_swiglu_fusion"),
    "qk_layernorm": ("qk_layernorm", "use_qk_norm"),
    "expert_num": ("expert_num", "n_routed_experts", "num_experts", "num_moe_experts"),
    "num_experts_chosen": ("num_experts_chosen", "num_experts_per_tok", "moe_router_topk"),
    "moe_intermediate_size": ("moe_intermediate_size", "moe_ffn_hidden_size"),
    "n_group": ("n_group", "moe_router_num_groups"),
    "topk_group": ("topk_group", "moe_router_group_topk"),
    "routed_scaling_factor": ("routed_scaling_factor", "moe_router_topk_scaling_factor"),
    "use_gating_sigmoid": ("use_gating_sigmoid", "scoring_func", "moe_router_score_function"),
    "shared_expert_num": ("shared_expert_num", "n_shared_experts"),
}

# mcore MoE router settings that no HF config key holds: mcore spelling -> legacy moe_config key (MAP).
MCORE_MOE_NAMES: dict[str, str] = {
    "moe_router_dtype": "router_dense_type", "router_dense_type": "router_dense_type",
    "moe_router_enable_expert_bias": "balance_via_topk_bias", "balance_via_topk_bias": "balance_via_topk_bias",
    "moe_router_bias_update_rate": "topk_bias_update_rate", "topk_bias_update_rate": "topk_bias_update_rate",
    "moe_grouped_gemm": "use_gmm", "use_gmm": "use_gmm",
    "moe_z_loss_coeff": "z_loss_factor", "z_loss_factor": "z_loss_factor",
    "moe_expert_capacity_factor": "capacity_factor", "capacity_factor": "capacity_factor",
    "moe_token_drop_policy": "enable_sdrop", "enable_sdrop": "enable_sdrop",
    "use_pad_tokens": "enable_gmm_safe_tokens", "enable_gmm_safe_tokens": "enable_gmm_safe_tokens",
    "moe_router_load_balancing_type": "aux_loss_types", "aux_loss_types": "aux_loss_types",
    "moe_aux_loss_coeff": "aux_loss_factors", "aux_loss_factors": "aux_loss_factors",
    "moe_permute_fusion": "use_fused_ops_permute", "use_fused_ops_permute": "use_fused_ops_permute",
    "moe_router_pre_softmax": "moe_router_pre_softmax", "moe_token_dispatcher_type": "moe_token_dispatcher_type",
    "moe_router_force_expert_balance": "moe_router_force_expert_balance",
    "use_fused_ops_topkrouter": "use_fused_ops_topkrouter", "npu_nums_per_device": "npu_nums_per_device",
    "callback_moe_droprate": "callback_moe_droprate", "moe_shared_expert_overlap": "moe_shared_expert_overlap",
    "group_wise_a2a": "group_wise_a2a", "comp_comm_parallel": "comp_comm_parallel",
    "comp_comm_parallel_degree": "comp_comm_parallel_degree", "use_shared_expert_gating": "use_shared_expert_gating",
    "topk_method": "topk_method",
}

MCORE: dict[str, Rule | str] = {
    "model_type": Ident(tuple(_MCORE_TYPES)),
    "architectures": Ident(tuple(_MCORE_ARCHS)),
    "batch_size": DROP(PREDICT_BATCH),
    "seq_length": Shape(),
    "num_layers": "num_hidden_layers",
    "hidden_size": "hidden_size",
    "num_heads": "num_attention_heads",
    "n_kv_heads": Feeds(),
    "intermediate_size": "intermediate_size",
    "vocab_size": "vocab_size",
    "max_position_embeddings": "max_position_embeddings",
    "rms_norm_eps": "rms_norm_eps",
    "hidden_act": "hidden_act",
    "gated_linear_unit": Expect(True, "gated (SwiGLU) MLP, as in HF", "HF's MLP for this family is always gated"),
    "add_bias_linear": Expect(False, "no bias on the other linears, as in HF",
                              "HF has no bias on o_proj and the MLP (the mcore default is True)"),
    "tie_word_embeddings": "tie_word_embeddings",
    "untie_embeddings_and_output_weights": Feeds(),
    "theta": Feeds(),
    "extend_method": Feeds(),
    **_each(("scaling_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"),
            Feeds(unused="ignored: position_embedding_type is rope (these are YaRN settings)")),
    "init_method_std": "initializer_range",
    "hidden_dropout": Expect(0.0, "no hidden dropout, as in HF", "HF has no hidden dropout"),
    "attention_dropout": "attention_dropout",
    "compute_dtype": "dtype",
    "param_init_type": LLAMA["param_init_type"],
    "layernorm_compute_dtype": Expect(*NORM_FP32),
    "softmax_compute_dtype": Expect("float32", *FP32_SOFTMAX),
    "attention_softmax_in_fp32": Expect(True, *FP32_SOFTMAX),
    "rotary_dtype": Expect(*ROTARY_FP32),
    "fp32_residual_connection": GLM["fp32_residual_connection"],
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
    "pad_token_id": "pad_token_id",
    "ignore_token_id": Expect(*IGNORE_100),
    "use_flash_attention": DROP(FLASH),
    "use_attn_mask_compression": DROP(ASCEND),
    "use_cache": DROP(INFERENCE),
    "is_dynamic": DROP(INFERENCE),
    "qkv_concat": DROP(LAYOUT),
    "use_contiguous_weight_layout_attention": DROP(LAYOUT),
    "use_interleaved_weight_layout_mlp": DROP(LAYOUT),
    "mla_qkv_concat": DROP(LAYOUT),
    "checkpoint_name_or_path": DROP(CHECKPOINT),
    **_each(_GENERATION_KEYS, DROP(GENERATION)),
    "mtp_loss_factor": Shape(),
    "return_extra_loss": Shape(),
    **_each(_SHAPE_KEYS, Shape()),
    **{key: Runtime(MOE_RUNTIME.format(legacy=legacy)) for key, legacy in MCORE_MOE_NAMES.items()},
}

QWEN3: dict[str, Rule | str] = {
    **MCORE,
    "head_dim": "head_dim",
    "qkv_has_bias": Expect(False, "no attention bias, as in HF Qwen3",
                           "HF Qwen3's attention_bias would also bias o_proj", hf="attention_bias"),
    "qk_layernorm": Expect(True, "q/k RMSNorm, as HF Qwen3 always has", "HF Qwen3 always normalises q and k"),
    "mtp_depth": LLAMA["mtp_depth"],
}
QWEN3_MOE: dict[str, Rule | str] = {
    **QWEN3,
    "expert_num": "num_experts",
    "num_experts_chosen": "num_experts_per_tok",
    "moe_intermediate_size": "moe_intermediate_size",
    "norm_topk_prob": "norm_topk_prob",
    "first_k_dense_replace": Feeds(),
    "routed_scaling_factor": Expect(1.0, "gates not scaled, as in HF Qwen3-MoE",
                                    "HF Qwen3-MoE does not scale the gates; MindFormers multiplies them by this "
                                    "factor (moe_router_topk_scaling_factor)"),
    "use_gating_sigmoid": Expect(False, "softmax router, as in HF Qwen3-MoE", "HF Qwen3-MoE routes with a softmax"),
    "router_aux_loss_coef": DROP("HF name that MindFormers' mcore Qwen3MoeConfig ignores (NotSupportedInfo.useless); "
                                 "moe_aux_loss_coeff sets the aux loss"),
}
DEEPSEEK_MCORE: dict[str, Rule | str] = {
    **MCORE,
    **{key: DEEPSEEK[key] for key in ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                                      "v_head_dim")},
    **{key: DEEPSEEK_MOE[key] for key in DEEPSEEK_MOE},
    "n_group": Feeds(),
    "topk_group": Feeds(),
    "use_gating_sigmoid": DEEPSEEK_V3_MOE["use_gating_sigmoid"],
    "qkv_has_bias": DEEPSEEK["qkv_has_bias"],
    "qk_layernorm": Expect(True, "norms on the compressed q and kv, as HF DeepseekV3 (q_a_layernorm, kv_a_layernorm)",
                           "HF DeepseekV3 always normalises the compressed q and kv"),
    "multi_latent_attention": Expect(True, "MLA, as HF DeepseekV3", "HF DeepseekV3 always uses MLA"),
    "mtp_depth": DEEPSEEK_V3["mtp_depth"],
}

# MindFormers' mcore config classes are copies of the HF ones (mindformers/models/qwen3_moe/
# configuration_qwen3_moe.py), so their defaults are HF's; MFModelConfig adds seq_length and the dtypes.
MCORE_DEFAULTS = {"seq_length": 4096, "compute_dtype": "bfloat16", "param_init_type": "float32",
                  "extend_method": "None", "theta": 10000.0, "pp_interleave_num": 1, "offset": 0, "mtp_depth": 0,
                  "mtp_loss_factor": 0.3}
QWEN3_DEFAULTS = {**MCORE_DEFAULTS, "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
                  "num_layers": 32, "num_heads": 32, "n_kv_heads": 32, "max_position_embeddings": 32768,
                  "rms_norm_eps": 1e-6, "head_dim": 128}
QWEN3_MOE_DEFAULTS = {**QWEN3_DEFAULTS, "hidden_size": 2048, "intermediate_size": 6144, "num_layers": 24,
                      "n_kv_heads": 4, "expert_num": 128, "num_experts_chosen": 8, "moe_intermediate_size": 768,
                      "norm_topk_prob": False, "return_extra_loss": True}
DEEPSEEK_MCORE_DEFAULTS = {**MCORE_DEFAULTS, "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
                           "num_layers": 61, "num_heads": 128, "n_kv_heads": 128, "max_position_embeddings": 4096,
                           "rms_norm_eps": 1e-6, "return_extra_loss": True}


# ---------------------------------------------------------------------------------------------------------------
# The spec of each family: its table, the config class's defaults, its derivations.

Derive = Callable[["_Values", "_Values"], dict]


@dataclass(frozen=True)
class _Spec:
    config_class: str
    rules: dict[str, Rule | str]  # YAML spelling -> rule ("hf_name" is Map("hf_name"))
    defaults: dict[str, Any]  # canonical name -> the config class's default
    derive: tuple[Derive, ...] = ()
    aliases: dict[str, str] = field(default_factory=dict)  # YAML spelling -> canonical name
    moe_rules: dict[str, Rule | str] = field(default_factory=dict)  # top-level moe_config keys feeding the HF config
    fixed: dict[str, Any] = field(default_factory=dict)  # HF values the family implies
    head_dim_derived: bool = True  # head_dim = hidden_size / num_heads, which must then divide

    def __post_init__(self) -> None:
        for name in ("rules", "moe_rules"):
            table = {k: Map(r) if isinstance(r, str) else r for k, r in getattr(self, name).items()}
            object.__setattr__(self, name, table)


def _mcore_spec(config_class: str, rules: dict[str, Rule | str], defaults: dict, derive: tuple[Derive, ...] = ()):
    """A spec whose rules answer to every mcore spelling of a setting (MCORE_SPELLINGS)."""
    spelled = {s: rule for name, rule in rules.items() for s in MCORE_SPELLINGS.get(name, (name,))}
    aliases = {s: name for name, spellings in MCORE_SPELLINGS.items() for s in spellings}
    return _Spec(config_class, spelled, defaults, derive, aliases=aliases, head_dim_derived=False)


_LLAMA_DERIVE = (_kv_heads, _ffn, _llama_positions, _rope)
_GLM_DERIVE = (_glm_kv_heads, _glm_rope, _seq_positions)
_SILU = {"hidden_act": "silu"}  # hard-coded in LlamaFeedForward and the DeepSeek FFNs

_SPECS: dict[tuple[str, bool], _Spec] = {
    ("llama", False): _Spec("LlamaConfig", LLAMA, LLAMA_DEFAULTS, _LLAMA_DERIVE, fixed=_SILU),
    ("qwen2", False): _Spec("LlamaConfig", QWEN2, LLAMA_DEFAULTS, _LLAMA_DERIVE, fixed=_SILU),
    ("mixtral", False): _Spec("LlamaConfig", MIXTRAL, LLAMA_DEFAULTS, _LLAMA_DERIVE, fixed=_SILU,
                              moe_rules={"expert_num": "num_local_experts",
                                         "num_experts_chosen": "num_experts_per_tok"}),
    ("qwen2_moe", False): _Spec("LlamaConfig", QWEN2_MOE, LLAMA_DEFAULTS, (*_LLAMA_DERIVE, _qwen2_moe_widths),
                                fixed=_SILU,
                                moe_rules={"expert_num": "num_experts", "num_experts_chosen": "num_experts_per_tok",
                                           "norm_topk_prob": "norm_topk_prob", "shared_expert_num": Feeds()}),
    ("baichuan2", False): _Spec("LlamaConfig", LLAMA, LLAMA_DEFAULTS),
    ("telechat", False): _Spec("TelechatConfig", LLAMA, LLAMA_DEFAULTS),
    ("deepseek_v2", False): _Spec("DeepseekV2Config", DEEPSEEK_V2, DS2_DEFAULTS,
                                  (_kv_heads, _ffn, _deepseek_positions, _rope), moe_rules=DEEPSEEK_V2_MOE,
                                  fixed=_SILU, head_dim_derived=False),
    ("deepseek_v3", False): _Spec("DeepseekV3Config", DEEPSEEK_V3, DS3_DEFAULTS,
                                  (_kv_heads, _ffn, _deepseek_positions, _rope, _deepseek_v3_groups),
                                  moe_rules=DEEPSEEK_V3_MOE, fixed=_SILU, head_dim_derived=False),
    ("glm4", False): _Spec("ChatGLM2Config", GLM, GLM_DEFAULTS, _GLM_DERIVE, aliases=GLM_ALIASES,
                           head_dim_derived=False),
    ("chatglm", False): _Spec("ChatGLM2Config", GLM, GLM_DEFAULTS, _GLM_DERIVE, aliases=GLM_ALIASES,
                              head_dim_derived=False),
    ("yizhao", False): _Spec("YiZhaoConfig", GLM, GLM_DEFAULTS, aliases=GLM_ALIASES, head_dim_derived=False),
    ("gpt2", False): _Spec("GPT2Config", GPT2, GPT2_DEFAULTS, (_gpt2_ffn, _gpt2_positions),
                           fixed={"tie_word_embeddings": True}),
    ("qwen3", True): _mcore_spec("Qwen3Config", QWEN3, QWEN3_DEFAULTS, (_kv_heads, _mcore_rope, _mcore_tie)),
    ("qwen3_moe", True): _mcore_spec("Qwen3MoeConfig", QWEN3_MOE, QWEN3_MOE_DEFAULTS,
                                     (_kv_heads, _mcore_rope, _mcore_tie, _qwen3_dense_layers)),
    ("deepseek_v3", True): _mcore_spec("DeepseekV3Config", DEEPSEEK_MCORE, DEEPSEEK_MCORE_DEFAULTS,
                                       (_kv_heads, _mcore_rope, _mcore_tie, _mcore_groups)),
    ("telechat3", True): _mcore_spec("TeleChat3Config", MCORE, MCORE_DEFAULTS),
}
ARCH_SPEC = _Spec("model.arch", ARCH_RULES, {})


# ---------------------------------------------------------------------------------------------------------------
# The engine: one pass over a section's keys with its table, then the derivations, then the notes on their inputs.

class _Values:
    """One YAML section by canonical name: typed by its rules, the config class's defaults behind. Records the names
    a derivation reads, so that the keys it consumed can be noted with what they fed."""

    def __init__(self, spec: _Spec, rules: dict[str, Rule], defaults: dict, base: str, section: dict,
                 seed: dict | None = None, seed_path: str = ""):
        self.base, self.rules, self.aliases, self.defaults = base, rules, spec.aliases, defaults
        self.raw: dict[str, Any] = {}  # YAML spelling -> value as written
        self.typed: dict[str, Any] = {}  # canonical -> typed value (config.json seed below the YAML)
        self.spelling: dict[str, str] = {}  # canonical -> YAML spelling
        self.read: set[str] = set()
        for key, value in (seed or {}).items():
            if key in rules:
                self.typed[self.name(key)] = self._convert(key, value, f"{seed_path}: {key}")
        for key, value in section.items():
            name = self.name(key)
            if name in self.spelling:  # MindFormers: "Multiple configurations provided for the same setting"
                raise ConfigError(join(base, key), f"sets the same thing as {join(base, self.spelling[name])}; "
                                                   "give only one of them")
            self.spelling[name], self.raw[key] = key, value
            if key in rules:
                self.typed[name] = self._convert(key, value, join(base, key))

    def _convert(self, key: str, value: Any, path: str) -> Any:
        rule = self.rules[key]
        if getattr(rule, "untyped", False):
            return value
        conv = rule.conv or _TYPES.get(self.name(key))
        return conv(value, path) if conv else value

    def name(self, key: str) -> str:
        return self.aliases.get(key, key)

    def get(self, name: str) -> Any:
        self.read.add(name)
        return self.typed[name] if name in self.typed else self.defaults.get(name)

    def given(self, name: str) -> bool:
        return name in self.typed

    def path(self, name: str) -> str:
        return join(self.base, self.spelling.get(name, name))

    def need(self, name: str) -> Any:
        value = self.get(name)
        if value is None:
            raise ConfigError(self.path(name), "required (the config class has no default for it)")
        return value


@dataclass
class _Ctx:
    family: Family
    ledger: Ledger
    out: dict
    fed: dict[tuple[str, str], dict] = field(default_factory=dict)  # (section, name) -> the HF values it fed

    def note(self, s: _Values, key: str, kind: str, message: str) -> None:
        raw, typed = s.raw.get(key), s.typed.get(s.name(key))
        if isinstance(raw, str) and not isinstance(typed, str) and s.name(key) in s.typed:
            message += f" (the YAML string {raw!r}, read as {typed!r})"
        self.ledger.add(join(s.base, key), kind, message)


def _account(s: _Values, spec_name: str, mcore: bool, ctx: _Ctx) -> None:
    """Account every key the section holds, and write the defaults of the ones it does not."""
    for key in s.raw:
        rule = s.rules.get(key)
        if rule is None:
            who = "MindFormers' mcore conversion rejects it" if mcore else "MindFormers keeps it and never reads it"
            hint = did_you_mean(key, s.rules)
            ctx.note(s, key, "unknown", f"not a {spec_name} key ({who}); ignored" + (f"; {hint}" if hint else ""))
        elif not isinstance(rule, Feeds):
            rule.account(s, key, s.name(key), ctx)
    done = set(s.spelling)
    for key, rule in s.rules.items():
        if s.name(key) not in done:
            done.add(s.name(key))
            rule.absent(s, s.name(key), ctx)


def _derive(spec: _Spec, m: _Values, moe: _Values, ctx: _Ctx) -> None:
    """Run the derivations, then note each Feeds key with the HF values it fed (or why it fed none)."""
    sections = tuple(dict.fromkeys((m, moe)))  # one section under mcore, where moe is model_config
    for derive in spec.derive:
        for s in sections:
            s.read.clear()
        produced = derive(m, moe)
        ctx.out.update(produced)
        for s in sections:
            for name in s.read:
                ctx.fed.setdefault((s.base, name), {}).update(produced)
    for s in sections:
        for key in s.raw:
            if isinstance(s.rules.get(key), Feeds):
                s.rules[key].account(s, key, s.name(key), ctx)


def _model_section(tree: dict) -> dict:
    model = tree["model"]
    if not isinstance(model, dict):
        raise ConfigError("model", f"expected a mapping with model_config, got {show(model)}")
    config = model.get("model_config")
    if not isinstance(config, dict):
        raise ConfigError(MODEL_CONFIG, f"expected a mapping of model settings, got {show(config)}")
    if not isinstance(model.get("arch", {}), dict):
        raise ConfigError(ARCH, f"expected a mapping with the model class (type), got {show(model['arch'])}")
    return config


def _seed(tree: dict) -> tuple[dict, str]:
    """mcore models start from pretrained_model_dir/config.json, overridden by model_config (keys.md); returns that
    config ({} when absent) and its path ('' when no directory is set)."""
    directory = tree.get("pretrained_model_dir")
    if not isinstance(directory, str) or not directory:
        return {}, ""
    path = os.path.join(directory, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            seed = json.load(f)
    except (FileNotFoundError, NotADirectoryError):
        return {}, path
    except (OSError, ValueError) as exc:
        raise ConfigError(path, f"cannot read the Hugging Face config: {exc}") from None
    if not isinstance(seed, dict):
        raise ConfigError(path, f"expected a JSON object, got {type(seed).__name__}")
    return seed, path


def _load(tree: dict, family: Family) -> tuple[_Spec, _Values, _Values]:
    """The family's spec, its model_config values, and the MoE values (moe_config, or model_config under mcore)."""
    if family is NO_MODEL:
        raise ConfigError("model", "no model section: a run config needs model.model_config")
    spec = _SPECS[(family.name, family.mcore)]
    seed, seed_path = _seed(tree) if family.mcore else ({}, "")
    m = _Values(spec, spec.rules, spec.defaults, MODEL_CONFIG, _model_section(tree), seed, seed_path)
    if family.mcore:
        return spec, m, m
    moe_section = tree.get(MOE_CONFIG) or {}
    if not isinstance(moe_section, dict):
        raise ConfigError(MOE_CONFIG, f"expected a mapping, got {show(moe_section)}")
    only_ours = {key: value for key, value in moe_section.items() if key in spec.moe_rules}
    return spec, m, _Values(spec, spec.moe_rules, MOE_DEFAULTS, MOE_CONFIG, only_ours)


def _check_heads(spec: _Spec, m: _Values) -> None:
    hidden, heads = m.need("hidden_size"), m.need("num_heads")
    if spec.head_dim_derived and hidden % heads:
        raise ConfigError(m.path("num_heads"), f"hidden_size {hidden} is not divisible by num_heads {heads} "
                                               "(head_dim = hidden_size / num_heads)")


# ---------------------------------------------------------------------------------------------------------------
# Which family: model.arch.type, then model_config.type, then trainer.model_name (legacy); model_type,
# architectures, then telltale keys (mcore). LlamaConfig and ChatGLM2Config host several architectures, told
# apart by their keys.

_NAME_FAMILY = (("deepseekv3", "deepseek_v3"), ("deepseek3", "deepseek_v3"), ("deepseekv2", "deepseek_v2"),
                ("deepseek2", "deepseek_v2"), ("deepseek", _LLAMA_LIKE), ("llama", _LLAMA_LIKE),
                ("qwen", _LLAMA_LIKE), ("mixtral", _LLAMA_LIKE), ("yizhao", "yizhao"), ("glm", _GLM_LIKE),
                ("gpt2", "gpt2"), ("telechat", "telechat"), ("baichuan", "baichuan2"))


def _experts(moe: dict) -> int:
    return _TYPES["expert_num"](moe.get("expert_num", 1), join(MOE_CONFIG, "expert_num"))


def _shared(moe: dict) -> int:
    return _TYPES["shared_expert_num"](moe.get("shared_expert_num", 0), join(MOE_CONFIG, "shared_expert_num"))


_VARIANTS: dict[str, tuple[tuple[str, Callable[[dict, dict, str], bool]], ...]] = {
    # first match wins: (family, test(model_config, moe_config, trainer.model_name))
    _LLAMA_LIKE: (("qwen2_moe", lambda c, moe, name: _experts(moe) > 1 and _shared(moe) > 0),
                  ("mixtral", lambda c, moe, name: _experts(moe) > 1),
                  ("qwen2", lambda c, moe, name: c.get("qkv_has_bias") is True),
                  ("llama", lambda c, moe, name: True)),
    _GLM_LIKE: (("glm4", lambda c, moe, name: c.get("padded_vocab_size") == 151552 or name.startswith("glm4")),
                ("chatglm", lambda c, moe, name: True)),
    "mcore": (("deepseek_v3", lambda c, moe, name: name.startswith("deepseek") or any(
                   k in c for k in ("n_routed_experts", "kv_lora_rank", "q_lora_rank", "multi_latent_attention"))),
              ("qwen3_moe", lambda c, moe, name: any(k in c for k in ("num_experts", "num_moe_experts"))),
              ("qwen3", lambda c, moe, name: name.startswith("qwen3"))),
}


def _model_name(tree: dict) -> str:
    """trainer.model_name, lower case without '_' and '-' ('deepseekV3' -> 'deepseekv3', 'qwen2_05b' -> 'qwen205b')."""
    trainer = tree.get("trainer")
    name = trainer.get("model_name") if isinstance(trainer, dict) else None
    return re.sub(r"[_\-]", "", name.lower()) if isinstance(name, str) else ""


def _variant(kind: str, config: dict, tree: dict) -> str | None:
    moe = tree.get(MOE_CONFIG) if isinstance(tree.get(MOE_CONFIG), dict) else {}
    return next((name for name, test in _VARIANTS[kind] if test(config, moe, _model_name(tree))), None)


def _lookup(table: dict, value: Any) -> str | None:
    return table.get(value) if isinstance(value, str) else None


def _detect_legacy(tree: dict, config: dict) -> Family:
    arch = tree["model"].get("arch") or {}
    name = _model_name(tree)
    kind = (_lookup(_ARCH_FAMILY, arch.get("type")) or _lookup(_CONFIG_FAMILY, config.get("type"))
            or next((family for prefix, family in _NAME_FAMILY if name.startswith(prefix)), None))
    if kind is None:
        raise ConfigError("model", f"cannot tell the model family: model.arch.type {show(arch.get('type'))}, "
                                   f"model.model_config.type {show(config.get('type'))} and trainer.model_name "
                                   f"{show((tree.get('trainer') or {}).get('model_name'))} are none this "
                                   "translator knows",
                          f"known config classes: {', '.join(_CONFIG_CLASSES)}")
    return _FAMILY[(_variant(kind, config, tree) if kind in _VARIANTS else kind, False)]


def _detect_mcore(tree: dict, config: dict) -> Family:
    seed, seed_path = _seed(tree)
    merged = {**seed, **config}
    model_type = merged.get("model_type")
    if model_type is not None:
        if _lookup(_MCORE_TYPES, model_type) is None:
            where = join(MODEL_CONFIG, "model_type") if "model_type" in config else f"{seed_path}: model_type"
            raise ConfigError(where, f"not an mcore model this translator knows: {show(model_type)}",
                              f"known: {', '.join(_MCORE_TYPES)}")
        return _FAMILY[(_MCORE_TYPES[model_type], True)]
    archs = merged.get("architectures")
    for arch in archs if isinstance(archs, list) else [archs]:
        if _lookup(_MCORE_ARCHS, arch):
            return _FAMILY[(_MCORE_ARCHS[arch], True)]
    variant = _variant("mcore", merged, tree)
    if variant is None:
        raise ConfigError("model", "cannot tell which mcore model this is (use_legacy: False)",
                          f"set model.model_config.model_type to one of {', '.join(_MCORE_TYPES)}")
    return _FAMILY[(variant, True)]


# ---------------------------------------------------------------------------------------------------------------
# Public API.

def detect_family(tree: dict) -> Family:
    """The architecture a MindFormers YAML describes; NO_MODEL (hf_model_type None) when it has no model section."""
    if tree.get("model") is None:
        return NO_MODEL
    config = _model_section(tree)
    return _detect_mcore(tree, config) if tree.get("use_legacy") is False else _detect_legacy(tree, config)


def model_shape(tree: dict, family: Family, ledger: Ledger) -> ModelShape:
    """The model numbers the rest of the translator needs; notes the keys carried into the Plan as `runtime`."""
    spec, m, _ = _load(tree, family)
    _check_heads(spec, m)
    shape = ModelShape(
        num_layers=m.need("num_layers"), mtp_depth=m.get("mtp_depth") or 0, hidden_size=m.need("hidden_size"),
        num_heads=m.need("num_heads"), vocab_size=m.need("vocab_size"), seq_length=m.need("seq_length"),
        compute_dtype=m.need("compute_dtype"), param_init_type=m.need("param_init_type"),
        use_fused_rope=bool(m.get("use_fused_rope")), use_fused_swiglu=bool(m.get("use_fused_swiglu")),
        pp_interleave_num=m.get("pp_interleave_num") or 1,
        offset=m.get("offset") if m.get("offset") is not None else 0,
        input_sliced_sig=bool(m.get("input_sliced_sig")),
        mtp_loss_factor=m.get("mtp_loss_factor") if m.get("mtp_loss_factor") is not None else 0.3,
        return_extra_loss=bool(m.get("return_extra_loss")),
    )
    for name, message in _SHAPE_NOTES.items():
        if name in m.spelling:
            ledger.runtime(m.path(name), message(getattr(shape, name)))
    return shape


_SHAPE_NOTES: dict[str, Callable[[Any], str]] = {
    "seq_length": lambda v: f"training sequence length {v} (ModelShape.seq_length)",
    "offset": lambda v: "pipeline layer layout (ModelShape.offset)",
    "pp_interleave_num": lambda v: "virtual-pipeline chunks of the layer layout (ModelShape.pp_interleave_num)",
    "use_fused_rope": lambda v: "the fused RoPE kernel" if v else "plain RoPE (no fused kernel)",
    "use_fused_swiglu": lambda v: "the fused SwiGLU kernel" if v else "plain SwiGLU (no fused kernel)",
    "input_sliced_sig": lambda v: "dataset rows hold seq_length tokens and their labels" if v
    else "dataset rows hold seq_length + 1 tokens, shifted into inputs and labels",
    "mtp_loss_factor": lambda v: f"MTP loss weight: loss += {v} / mtp_depth * MTP loss (ModelShape.mtp_loss_factor)",
    "return_extra_loss": lambda v: "MoE aux losses added to the LM loss" if v else "MoE aux losses not added",
}


def hf_config(tree: dict, family: Family, ledger: Ledger) -> dict | None:
    """`AutoConfig.for_model(**d)` keyword arguments for the YAML's model, or None (with a note on `model`) when
    transformers has no architecture for the family. Every key under model.model_config and model.arch is noted."""
    if family.hf_model_type is None:
        ledger.dropped("model", f"family {family.name}: {family.reason}; no Hugging Face config")
        return None
    spec, m, moe = _load(tree, family)
    _check_heads(spec, m)
    ctx = _Ctx(family, ledger, {"model_type": family.hf_model_type, **spec.fixed})
    _account(m, spec.config_class, family.mcore, ctx)
    if not family.mcore:
        _account(moe, MOE_CONFIG, False, ctx)
    arch = tree["model"].get("arch") or {}
    _account(_Values(ARCH_SPEC, ARCH_SPEC.rules, {}, ARCH, arch), ARCH, False, ctx)
    _derive(spec, m, moe, ctx)
    if family.mcore:
        _note_seed(tree, spec, ledger)
    return ctx.out


def _note_seed(tree: dict, spec: _Spec, ledger: Ledger) -> None:
    seed, path = _seed(tree)
    if seed:
        ledger.mapped("pretrained_model_dir", f"{path} seeds model.model_config (model_config keys win)")
    elif path:
        ledger.differs("pretrained_model_dir", f"{path} does not exist: model_config keys it would supply take "
                                               f"the {spec.config_class} defaults")
