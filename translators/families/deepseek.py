"""DeepSeek-V2/V3 legacy configs (DS2, DS3): LlamaConfig-like names plus MLA; MoE from the top-level moe_config."""

from __future__ import annotations

from translators import memory
from translators.families import parts
from translators.families.derive import (
    _deepseek_experts,
    _deepseek_positions,
    _deepseek_v3_groups,
    _ffn,
    _kv_heads,
    _rope,
)
from translators.families.llama import LLAMA
from translators.families.parts import MODELS
from translators.families.record import FamilyRecord, PatchTargets, Weights
from translators.families.rules import (
    _GENERATION_KEYS,
    _SHAPE_KEYS,
    DROP,
    INFERENCE,
    Expect,
    Feeds,
    Map,
    Rule,
    Shape,
    _choice,
    _each,
)
from translators.families.spec import SILU, _Spec

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
    "mtp_depth": Shape(),  # the research variant's MTP layers are built by mf_ds/mtp.py (translators/mtp.py notes it)
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
# research DeepSeek: expert_num 1 (MoEConfig's default) builds dense layers throughout (derive._deepseek_experts)
_LEGACY_SWITCH = {"expert_num": Feeds(), "first_k_dense_replace": Feeds()}
DEEPSEEK_V3_MOE = {
    **DEEPSEEK_MOE,
    **_LEGACY_SWITCH,
    "topk_method": Feeds(),
    "n_group": Feeds(unused="ignored: topk_method is 'greedy' (moe.md §7); hf n_group = 1"),
    "topk_group": Feeds(unused="ignored: topk_method is 'greedy' (moe.md §7); hf topk_group = 1"),
    "use_gating_sigmoid": Expect(True, "sigmoid scores, as HF DeepseekV3 always computes them",
                                 "HF DeepseekV3 always scores experts with a sigmoid"),
}
DEEPSEEK_V2_MOE = {
    **DEEPSEEK_MOE,
    **_LEGACY_SWITCH,
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

# --- the weight names (translators/names.py applies them) -------------------------------------------------------------
# research/deepseek3/convert_weight.py (1.7.0): plain_name_replace, mla_name_replace, mlp_name_replace with
# use_grouped_gemm (its default; DEEPSEEK_BMM below for the other).
DEEPSEEK_NAMES = (
    ("model.tok_embeddings.embedding_weight", "model.embed_tokens.weight"),
    ("model.norm_out.", "model.norm."),
    (".attention.q2l_proj.", ".self_attn.q_a_proj."),
    (".attention.lq_norm.", ".self_attn.q_a_layernorm."),
    (".attention.lkv_norm.", ".self_attn.kv_a_layernorm."),
    (".attention.wo.", ".self_attn.o_proj."),
    (".attention_norm.", ".input_layernorm."),
    (".ffn_norm.", ".post_attention_layernorm."),
    (".feed_forward.shared_experts.w1.", ".mlp.shared_experts.gate_proj."),
    (".feed_forward.shared_experts.w2.", ".mlp.shared_experts.down_proj."),
    (".feed_forward.shared_experts.w3.", ".mlp.shared_experts.up_proj."),
    (".feed_forward.w1.", ".mlp.gate_proj."),
    (".feed_forward.w2.", ".mlp.down_proj."),
    (".feed_forward.w3.", ".mlp.up_proj."),
    (".feed_forward.routed_experts.router_dense.weight", ".mlp.gate.weight"),
    (".feed_forward.routed_experts.topk_bias", ".mlp.gate.e_score_correction_bias"),
)
# Without use_grouped_gemm the router has other names (mlp_name_replace's bmm_key): (gmm name, bmm name).
DEEPSEEK_BMM = (
    (".feed_forward.routed_experts.router_dense.weight", ".feed_forward.routed_experts.router.dense.weight"),
    (".feed_forward.routed_experts.topk_bias", ".feed_forward.routed_experts.router.router.topk_bias"),
)
# One HF tensor that MindFormers keeps in two (research/deepseek3/convert_weight.py _mla_pt_to_ms): HF part, kind,
# MindFormers parts. The rope rows of q_b_proj and kv_a_proj_with_mqa are reordered from HF's interleaved pairs
# to halves (evens, then odds), as MindFormers' rotary embedding rotates halves.
DEEPSEEK_SPLIT = {
    ".self_attn.q_b_proj.": ("q_b", (".attention.l2q_nope_proj.", ".attention.l2q_pe_proj.")),
    ".self_attn.kv_a_proj_with_mqa.": ("kv_a", (".attention.kv2l_latent_kv.", ".attention.kv2l_k_pe.")),
    ".self_attn.kv_b_proj.": ("kv_b", (".attention.lkv2kv_k_nope.", ".attention.lkv2kv_v.")),
}
# use_grouped_gemm: w1 [E, H, 2I] = [gate^T | up^T], w2 [E, I, H] = down^T (no `.weight`); else stacked as is.
DEEPSEEK_EXPERTS = {
    ".feed_forward.routed_experts.ffn.w1": ("gmm_w1", (".mlp.experts.{e}.gate_proj.weight",
                                                       ".mlp.experts.{e}.up_proj.weight")),
    ".feed_forward.routed_experts.ffn.w2": ("gmm_w2", (".mlp.experts.{e}.down_proj.weight",)),
    ".feed_forward.routed_experts.ffn.w1.weight": ("stack_bmm", (".mlp.experts.{e}.gate_proj.weight",)),
    ".feed_forward.routed_experts.ffn.w2.weight": ("stack_bmm", (".mlp.experts.{e}.down_proj.weight",)),
    ".feed_forward.routed_experts.ffn.w3.weight": ("stack_bmm", (".mlp.experts.{e}.up_proj.weight",)),
}

# --- the family records (translators/families/record.py) ------------------------------------------------------------
DEEPSEEK_V2_RUNTIME = PatchTargets(f"{MODELS}.deepseek_v2.modeling_deepseek_v2", rope="deepseek_v2", hooks="deepseek",
                                   mlps=("DeepseekV2MLP",), experts="DeepseekV2Experts", moe_block="DeepseekV2Moe",
                                   shared="shared_experts")
# layers < first_k_dense_replace stay dense (HF builds them so); gate.e_score_correction_bias is the selection bias
# TopkBiasBalanceCallback moves
DEEPSEEK_V3_RUNTIME = PatchTargets(f"{MODELS}.deepseek_v3.modeling_deepseek_v3", rope="deepseek_v3", hooks="deepseek",
                                   mlps=("DeepseekV3MLP",), experts="DeepseekV3Experts", moe_block="DeepseekV3MoE",
                                   shared="shared_experts")
DEEPSEEK_V3_MEMORY = {**parts.MLA_DEFAULTS, "n_shared_experts": 1, "num_experts_per_tok": 8,
                      "first_k_dense_replace": 3, "n_routed_experts": 256, "moe_intermediate_size": 2048}
RECORDS = (
    FamilyRecord("deepseek_v2", "deepseek_v2", "deepseek", False, tp=parts.MLA + parts.MLP,
                 memory_defaults={**parts.MLA_DEFAULTS, "n_shared_experts": 2, "num_experts_per_tok": 6,
                                  "first_k_dense_replace": 0, "n_routed_experts": 64, "moe_intermediate_size": 1407},
                 runtime=DEEPSEEK_V2_RUNTIME),
    FamilyRecord("deepseek_v3", "deepseek_v3", "deepseek", False,
                 weights=Weights(DEEPSEEK_NAMES, split=DEEPSEEK_SPLIT, experts=DEEPSEEK_EXPERTS,
                                 bmm_names=DEEPSEEK_BMM, mtp="research"),
                 tp=parts.MLA + parts.MLP, memory_defaults=DEEPSEEK_V3_MEMORY, runtime=DEEPSEEK_V3_RUNTIME),
)


def specs() -> dict[tuple[str, bool], _Spec]:
    """DeepseekV2Config / DeepseekV3Config (research/deepseek2, deepseek3): table, defaults, derivations."""
    return {
        ("deepseek_v2", False): _Spec("DeepseekV2Config", DEEPSEEK_V2, DS2_DEFAULTS,
                                      (_kv_heads, _ffn, _deepseek_positions, _rope, _deepseek_experts),
                                      moe_rules=DEEPSEEK_V2_MOE,
                                      fixed=SILU, head_dim_derived=False),
        ("deepseek_v3", False): _Spec("DeepseekV3Config", DEEPSEEK_V3, DS3_DEFAULTS,
                                      (_kv_heads, _ffn, _deepseek_positions, _rope, _deepseek_v3_groups,
                                       _deepseek_experts),
                                      moe_rules=DEEPSEEK_V3_MOE, fixed=SILU, head_dim_derived=False),
    }


# --- memory hooks (translators/memory.py: this family's parameter and activation counts) ------------------------------

def memory_attention(hf: dict, h: int, a: int, k: int, d: int) -> list:
    """Multi-latent attention: the low-rank kv (and q, with q_lora_rank) projections and their norms."""
    Weights = memory.Weights
    nope, rope, v, ql, kvl = memory._mla(hf)
    bias = 1 if hf.get("attention_bias") else 0
    w = [Weights("kv_a_proj_with_mqa", (h + bias) * (kvl + rope), 1, "whole"),
         Weights("kv_a_layernorm", kvl, 1, "whole"), Weights("kv_b_proj", kvl * a * (nope + v), 1, "tp"),
         Weights("o_proj", a * v * h + bias * h, 1, "tp")]
    if ql:
        w += [Weights("q_a_proj", (h + bias) * ql, 1, "whole"), Weights("q_a_layernorm", ql, 1, "whole"),
              Weights("q_b_proj", ql * a * (nope + rope), 1, "tp")]
    else:
        w.append(Weights("q_proj", h * a * (nope + rope), 1, "tp"))
    return w


def memory_attention_bytes(hf: dict, e: int, tp: int, h: int, a: int) -> float:
    nope, rope, v, ql, kvl = memory._mla(hf)
    ql = ql or 0
    return (e * 2 * h                              # q_a / kv_a input, the MLP input
            + (4 + 2 * e) * ql                     # q_a_layernorm (fp32 x, normalised), q_b_proj input
            + (4 + 2 * e) * kvl + e * rope         # kv_a_layernorm, kv_b_proj input, k_pe
            + e * a * (2 * (nope + rope) + 2 * v) / tp + 4 * a / tp)  # q, k, v, SDPA out (o_proj input), lse


def memory_moe_layers(hf: dict) -> list[int]:
    """Layers from first_k_dense_replace on, every moe_layer_freq-th (none without routed experts)."""
    L = hf.get("num_hidden_layers")
    if not hf.get("n_routed_experts"):
        return []
    first, freq = hf.get("first_k_dense_replace", 0), hf.get("moe_layer_freq", 1)
    return [i for i in range(L) if i >= first and i % freq == 0]


def memory_shared_experts(hf: dict, h: int, width: int) -> list:
    return memory._mlp(hf, h, width * hf["n_shared_experts"], "shared_experts") if hf.get("n_shared_experts") else []


def memory_shared_width(hf: dict, width: int) -> int:
    return width * hf.get("n_shared_experts", 0)
