"""Derived HF values (intermediate_size, kv heads, rope_parameters, MoE widths, ...), each with its formula."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from translators.errors import ConfigError, did_you_mean, join, show

if TYPE_CHECKING:
    from translators.families.engine import _Values


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


def _mla_kv_heads(m: _Values, moe: _Values) -> dict:
    """MLA gives every head its own k and v (MindFormers' MLA never reads num_key_value_heads, whose
    DeepseekV3Config default stays 128 whatever num_attention_heads is); HF DeepseekV3 repeats k/v by
    num_attention_heads // num_key_value_heads, so they must be equal."""
    return {"num_key_value_heads": m.get("num_heads")}


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


def _deepseek_experts(m: _Values, moe: _Values) -> dict:
    """Which layers are MoE, as MindFormers' research DeepSeek decoder layer decides (research/deepseek3/
    deepseek2_model.py DeepSeekV2DecodeLayer, 1.5.0 to 1.7.0; research/deepseek2 alike): a layer below
    first_k_dense_replace is a dense LlamaFeedForward of intermediate_size, and so is every other layer when
    expert_num is 1 (`self.feed_forward = ffn`), MoEConfig's default, so also without a moe_config; else MoE. HF
    DeepseekV2/V3 make every layer from first_k_dense_replace on MoE, so a one-expert model is dense throughout:
    first_k_dense_replace covers every layer, the MTP layers (numbered after them) too."""
    experts, first = moe.get("expert_num"), int(moe.get("first_k_dense_replace") or 0)
    if experts != 1:
        return {"n_routed_experts": experts, "first_k_dense_replace": first}
    layers = m.get("num_layers") + (m.get("mtp_depth") or 0)
    shared = moe.get("shared_expert_num") or 0
    if shared and first < layers:
        raise ConfigError(moe.path("expert_num"), f"1 with shared_expert_num {shared}: MindFormers' DeepSeek decoder "
                          "layer then builds no feed-forward for the layers from first_k_dense_replace on "
                          "(feed_forward None: research/deepseek3/deepseek2_model.py) and cannot run; give expert_num "
                          "> 1 for MoE layers, or shared_expert_num 0 for a dense model")
    return {"n_routed_experts": 1, "first_k_dense_replace": layers}


def _deepseek_v3_groups(m: _Values, moe: _Values) -> dict:
    """HF DeepseekV3 always keeps the best topk_group of n_group expert groups; MindFormers limits groups only for
    topk_method group_limited_greedy / noaux_tc, and the DeepSeek-V3 YAMLs leave it 'greedy' (moe.md §7): one group."""
    if moe.get("topk_method") == "greedy":
        return {"n_group": 1, "topk_group": 1}
    return _groups(moe)


def _shared_width(m: _Values, moe: _Values) -> dict:
    """HF DeepseekV3's shared experts are one MLP of n_shared_experts x moe_intermediate_size; mcore may set the
    width itself (moe_shared_expert_intermediate_size), which must then be that product."""
    width = m.get("moe_intermediate_size") * (m.get("shared_expert_num") or 0)
    given = m.get("moe_shared_expert_intermediate_size")
    if given is not None and given != width:
        raise ConfigError(m.path("moe_shared_expert_intermediate_size"), f"{given} is not n_shared_experts x "
                          f"moe_intermediate_size = {width}: HF DeepseekV3 has no other shared-expert width")
    return {"moe_intermediate_size": m.get("moe_intermediate_size")}


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


def _untied(m: _Values, moe: _Values) -> dict:
    """MindFormers' GPTModel of DeepSeek-V3, DeepSeek-V4 and TeleChat3 is built without
    share_embeddings_and_output_weights (default False; modeling_deepseek_v3_train.py 1.7.0 to 2.1.0, the 2.x
    PyNative models, modeling_telechat3_train.py): the output layer is never the embedding, whatever
    tie_word_embeddings or untie_embeddings_and_output_weights say (mcore.UNTIED notes a tie asked for). Qwen3 and
    Qwen3-MoE tie by tie_word_embeddings alone (share_embeddings_and_output_weights=config.tie_word_embeddings), a
    plain mapping; no mcore model reads untie_embeddings_and_output_weights."""
    return {"tie_word_embeddings": False}
