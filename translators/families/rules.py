"""The rule classes of the family tables (how one model_config key is accounted), the value types of MindFormers' keys,
and the reasons the tables share."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from translators.errors import ConfigError, did_you_mean, join, show
from translators.families.base import _ARCH_CLASSES, DTYPES

if TYPE_CHECKING:
    from translators.families.engine import _Ctx, _Values


# ---------------------------------------------------------------------------------------------------------------
# Value types. PyYAML reads `1e-5` (no dot) and `None` as strings; MindFormers YAMLs are full of both.

Conv = Callable[[Any, str], Any]
_NUMBER_TEXT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def _is_null(value: Any) -> bool:
    return value is None or value == "None"


def _int(minimum: int, maximum: int | None = None, why: str = "") -> Conv:
    expected = "a positive int" if minimum == 1 else f"an int >= {minimum}"
    if maximum is not None:
        expected += f" of at most {maximum:,} ({why})"

    def conv(value: Any, path: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum or \
                (maximum is not None and value > maximum):
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
    # convert_mstype (models/utils.py) lower-cases the name first: 'BFloat16' is bfloat16 there too
    return _choice(*DTYPES)(value.lower() if isinstance(value, str) else value, path)


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
# 2^24: 64 times the largest vocabulary in use (262,144; the corpus' largest is Qwen's 151,936), so a typo is
# refused here rather than as a failed allocation of the embedding when the model is built.
_VOCAB = _int(1, 2**24, "64 times the largest vocabulary in use")

# The type of each model_config / moe_config key, by canonical (legacy) name.
_TYPES: dict[str, Conv] = {
    "num_layers": _POS, "hidden_size": _POS, "num_heads": _POS, "n_kv_heads": _optional(_POS), "vocab_size": _VOCAB,
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
class Attention:
    """Decides the attention mask or positions MindFormers' model builds; read by translators/attention.py, which
    notes what it did (run.pad_attention_mask, run.data.reset_attention_mask / reset_position_ids)."""

    untyped = True

    def account(self, s: _Values, key: str, name: str, ctx: _Ctx) -> None:
        ctx.note(s, key, "runtime", "read by translators/attention.py: which keys MindFormers' model masks "
                                    "(run.pad_attention_mask, run.data.reset_attention_mask)")

    def absent(self, s: _Values, name: str, ctx: _Ctx) -> None:
        return None


ATTENTION = Attention()


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
    """Names the family: a config class, arch class or model_type among `known` (or what `known()` returns, for
    names the family records hold: translators/families/registry.py)."""

    known: tuple[str, ...] | Callable[[], Iterable[str]]
    untyped = True

    def account(self, s: _Values, key: str, name: str, ctx: _Ctx) -> None:
        value = s.raw[key]
        known = self.known() if callable(self.known) else self.known
        if any(v in known for v in (value if isinstance(value, list) else [value]) if isinstance(v, str)):
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
LAYOUT = "fused weight layout of MindFormers checkpoints (run.checkpoint_layout, for loading them); no numeric effect"
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

ARCH_RULES: dict[str, Rule | str] = {"type": Ident(_ARCH_CLASSES), "auto_register": DROP(REGISTER)}

_GENERATION_KEYS = ("repetition_penalty", "max_decode_length", "top_k", "top_p", "do_sample", "temperature")
_SHAPE_KEYS = ("offset", "pp_interleave_num", "use_fused_rope", "use_fused_swiglu", "input_sliced_sig")


def _each(keys: tuple[str, ...], rule: Rule) -> dict[str, Rule]:
    return dict.fromkeys(keys, rule)
