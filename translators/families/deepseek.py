"""DeepSeek-V2/V3 legacy configs (DS2, DS3): LlamaConfig-like names plus MLA; MoE from the top-level moe_config."""

from __future__ import annotations

from translators import names
from translators.families import parts
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
# DeepSeek-V4's MTP (2.1.0 pynative/transformers/multi_token_prediction.py with hyper-connection streams) is not
# built: transformers builds nothing from mtp_depth, mf_ds/mtp.py builds DeepSeek-V3's variants only.
MTP_ABSENT = Expect(0, "no MTP layers", "not built: mf-ds builds no DeepSeek-V4 MTP layer (MindFormers' PyNative "
                                        "multi_token_prediction.py with its hyper-connection streams), so its "
                                        "gradient is not trained and its weights are skipped",
                    hf="num_nextn_predict_layers")
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

# --- the family records (translators/families/record.py) ------------------------------------------------------------
DEEPSEEK_V2_RUNTIME = PatchTargets(f"{MODELS}.deepseek_v2.modeling_deepseek_v2", rope="deepseek_v2",
                                   mlps=("DeepseekV2MLP",), experts="DeepseekV2Experts", moe_block="DeepseekV2Moe",
                                   shared="shared_experts")
# layers < first_k_dense_replace stay dense (HF builds them so); gate.e_score_correction_bias is the selection bias
# TopkBiasBalanceCallback moves
DEEPSEEK_V3_RUNTIME = PatchTargets(f"{MODELS}.deepseek_v3.modeling_deepseek_v3", rope="deepseek_v3",
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
                 weights=Weights(names.DEEPSEEK, split=names.DEEPSEEK_SPLIT, experts=names.DEEPSEEK_EXPERTS,
                                 bmm_names=names.DEEPSEEK_BMM),
                 tp=parts.MLA + parts.MLP, memory_defaults=DEEPSEEK_V3_MEMORY, runtime=DEEPSEEK_V3_RUNTIME),
)
