"""The mcore (`use_legacy: False`) configs: Qwen3, Qwen3-MoE, DeepSeek-V3, TeleChat3, and their spellings."""

from __future__ import annotations

from translators import memory, names
from translators.families import parts, registry
from translators.families.deepseek import (
    DEEPSEEK,
    DEEPSEEK_MOE,
    DEEPSEEK_V3_MEMORY,
    DEEPSEEK_V3_MOE,
    DEEPSEEK_V3_RUNTIME,
)
from translators.families.derive import (
    _kv_heads,
    _mcore_groups,
    _mcore_rope,
    _mla_kv_heads,
    _qwen3_dense_layers,
    _shared_width,
    _untied,
)
from translators.families.glm import GLM
from translators.families.llama import LLAMA
from translators.families.parts import MODELS
from translators.families.record import FamilyRecord, PatchTargets, Weights
from translators.families.rules import (
    _GENERATION_KEYS,
    _SHAPE_KEYS,
    ATTENTION,
    CHECKPOINT,
    DROP,
    FLASH,
    FP32_SOFTMAX,
    GENERATION,
    IGNORE_100,
    INFERENCE,
    LAYOUT,
    NORM_FP32,
    PREDICT_BATCH,
    ROTARY_FP32,
    Expect,
    Feeds,
    Ident,
    Rule,
    Runtime,
    Shape,
    _each,
)
from translators.families.spec import Derive, _Spec
from translators.moe import MCORE_MOE

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

# mcore MoE router settings that no HF config key holds (their spellings and legacy names: translators/moe.py
# MCORE_MOE), and what each becomes (parallel_core/transformer_config_utils.py COMMON_CONFIG_MAPPING and the training
# graph, 1.7.0): translators/moe.py reads the first group and notes what each became; the others are not read.
_MOE_READ = "MoE setting (moe_config.{legacy}); read by translators/moe.py into the Plan's moe (see its notes)"
_NOT_IN_TRAINING_GRAPH = "not read by MindFormers' mcore training graph"
_PERFORMANCE = "Ascend dispatch / overlap setting (performance only; the mcore path is dropless)"
MCORE_MOE_RULES: dict[str, Rule | str] = {
    **{key: Runtime(_MOE_READ.format(legacy=MCORE_MOE[key].name)) for key in (
        "moe_router_dtype", "router_dense_type", "moe_router_enable_expert_bias", "balance_via_topk_bias",
        "moe_router_bias_update_rate", "topk_bias_update_rate", "moe_grouped_gemm", "use_gmm", "use_pad_tokens",
        "enable_gmm_safe_tokens", "moe_permute_fusion", "use_fused_ops_permute", "moe_router_load_balancing_type",
        "moe_aux_loss_coeff", "moe_z_loss_coeff", "z_loss_factor", "use_shared_expert_gating",
        "callback_moe_droprate")},
    **_each(("moe_expert_capacity_factor", "capacity_factor"),
            DROP("accepted and unused: MindFormers' mcore training graph has no capacity code (dropless, as here)")),
    **_each(("moe_token_drop_policy", "enable_sdrop"), DROP("unused: the mcore training graph drops no tokens")),
    **_each(("aux_loss_types", "aux_loss_factors"),
            DROP("not an mcore key (COMMON_CONFIG_MAPPING has no such spelling): moe_router_load_balancing_type and "
                 "moe_aux_loss_coeff set the aux loss")),
    "topk_method": DROP("mcore routes by moe_router_num_groups / moe_router_group_topk, not topk_method"),
    **_each(("moe_router_pre_softmax", "moe_token_dispatcher_type"), DROP(_NOT_IN_TRAINING_GRAPH)),
    **_each(("use_fused_ops_topkrouter", "npu_nums_per_device", "moe_shared_expert_overlap", "group_wise_a2a",
             "comp_comm_parallel", "comp_comm_parallel_degree"), DROP(_PERFORMANCE)),
    "moe_router_force_expert_balance": Expect(False, "off: the router's own probabilities", "MindFormers replaces "
                                              "the router probabilities by a uniform balanced load (a load test); "
                                              "mf_ds routes with the router's"),
}
assert set(MCORE_MOE_RULES) <= set(MCORE_MOE), set(MCORE_MOE_RULES) - set(MCORE_MOE)

MCORE: dict[str, Rule | str] = {
    "model_type": Ident(registry.mcore_model_types),
    "architectures": Ident(registry.mcore_architectures),
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
    "untie_embeddings_and_output_weights": Feeds(unused="read by no MindFormers mcore model (TransformerConfig keeps "
                                                 "it): Qwen3 and Qwen3-MoE tie by tie_word_embeddings, the others "
                                                 "never tie (derive._untied)"),
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
    "use_attn_mask_compression": ATTENTION,
    "use_eod_attn_mask_compression": ATTENTION,
    "use_eod_reset": ATTENTION,
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
    **MCORE_MOE_RULES,
}

# DeepSeek-V3, DeepSeek-V4, TeleChat3: MindFormers' GPTModel never ties them (derive._untied)
UNTIED = Expect(False, "untied, as MindFormers builds this family", "MindFormers builds this family's GPTModel "
                "without share_embeddings_and_output_weights: its output layer is never the embedding; untied here too")

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
    "tie_word_embeddings": UNTIED,
    "mtp_depth": Shape(),  # built by mf_ds/mtp.py (graph mode) or noted differs (PyNative): translators/mtp.py
    "n_kv_heads": Feeds(unused="not read by MLA: every head has its own k and v (hf num_key_value_heads = "
                               "num_attention_heads)"),
    "moe_shared_expert_intermediate_size": Feeds(),  # must be n_shared_experts x moe_intermediate_size (HF's width)
}

# What a YAML leaves out takes its config class's default in the run's MindFormers version (translators/mf_defaults,
# generated by MindFormers' own code); below them, the settings a class may not hold, with the default of the
# TransformerConfig it converts to (parallel_core/transformer_config.py, 1.7.0 to 2.1.0): dtypes, sequence length,
# no rope scaling, no MTP unless the class says, the pipeline layout.
MCORE_DEFAULTS = {"seq_length": 4096, "compute_dtype": "bfloat16", "param_init_type": "float32",
                  "extend_method": "None", "pp_interleave_num": 1, "offset": 0, "mtp_depth": 0, "mtp_loss_factor": 0.3}
QWEN3_DEFAULTS = MCORE_DEFAULTS
QWEN3_MOE_DEFAULTS = {**MCORE_DEFAULTS, "return_extra_loss": True}
DEEPSEEK_MCORE_DEFAULTS = {**MCORE_DEFAULTS, "return_extra_loss": True}

# Every mcore MoE spelling is accounted: the router settings by MCORE_MOE_RULES, the shape ones by a MoE model table.
_ACCOUNTED = {s for table in (QWEN3_MOE, DEEPSEEK_MCORE) for key in table for s in MCORE_SPELLINGS.get(key, (key,))}
assert set(MCORE_MOE) <= _ACCOUNTED, set(MCORE_MOE) - _ACCOUNTED

# --- the weight names (translators/names.py applies them) -------------------------------------------------------------
# mindformers/models/qwen3_moe/utils.py weight_mapping, MindFormers side first (the table there reads HF -> mcore).
MCORE_NAMES = (
    ("embedding.word_embeddings.", "model.embed_tokens."),
    ("decoder.final_layernorm.", "model.norm."),
    ("output_layer.", "lm_head."),
    ("decoder.layers.", "model.layers."),
    (".self_attention.linear_proj.", ".self_attn.o_proj."),
    (".self_attention.q_layernorm.", ".self_attn.q_norm."),
    (".self_attention.k_layernorm.", ".self_attn.k_norm."),
    (".mlp.router.expert_bias", ".mlp.gate.e_score_correction_bias"),  # moe_router_enable_expert_bias
    (".router.weight", ".gate.weight"),
    (".linear_fc2.", ".down_proj."),
    (".pre_mlp_layernorm.", ".post_attention_layernorm."),
)
# mcore DeepSeek-V3 (TrainingDeepseekV3ForCausalLM, 1.7.0 to 2.1.0: GPTModel with multi-latent attention and MoE):
# deepseek3/utils.py weight_mapping (HF -> mcore, MindFormers side first here) for the names it shares with the
# network, and the network's own names where its training layers fuse (checked against the network built on CPU:
# tests/fixtures/deepseek3_mcore). mla_qkv_concat False (the wheels' graph-mode YAMLs) names the MLA projections apart;
# the rope rows of q_b_proj and kv_a_proj_with_mqa are in halves (evens, then odds): MindFormers rotates halves
# (rotary_interleaved False) where HF DeepSeek-V3 de-interleaves pairs (rope_interleave), as DEEPSEEK_NAMES.
MCORE_MLA_NAMES = (
    ("embedding.word_embeddings.", "model.embed_tokens."),
    ("decoder.final_layernorm.", "model.norm."),
    ("output_layer.", "lm_head."),
    ("decoder.layers.", "model.layers."),
    (".self_attention.linear_q_down_proj.", ".self_attn.q_a_proj."),
    (".self_attention.q_layernorm.", ".self_attn.q_a_layernorm."),
    (".self_attention.linear_q_up_proj.", ".self_attn.q_b_proj."),
    (".self_attention.linear_kv_down_proj.", ".self_attn.kv_a_proj_with_mqa."),
    (".self_attention.kv_layernorm.", ".self_attn.kv_a_layernorm."),
    (".self_attention.linear_kv_up_proj.", ".self_attn.kv_b_proj."),
    (".self_attention.linear_proj.", ".self_attn.o_proj."),
    (".mlp.router.expert_bias", ".mlp.gate.e_score_correction_bias"),  # moe_router_enable_expert_bias
    (".mlp.router.weight", ".mlp.gate.weight"),
    (".linear_fc2.", ".down_proj."),
    (".pre_mlp_layernorm.", ".post_attention_layernorm."),
)
# mla_qkv_concat True (TransformerConfig's default; the 2.1.0 PyNative YAML) names them otherwise (gpt_layer_specs.py
# `linear_qb`, `linear_kvb`, `k_layernorm`), and fuses the two down projections in `linear_qkv` (MCORE_MLA_FUSED):
# (name apart, name with mla_qkv_concat).
MCORE_MLA_CONCAT = ((".self_attention.linear_q_up_proj.", ".self_attention.linear_qb."),
                    (".self_attention.linear_kv_up_proj.", ".self_attention.linear_kvb."),
                    (".self_attention.kv_layernorm.", ".self_attention.k_layernorm."))
# The HF tensors whose rope rows MindFormers keeps in halves: HF part -> its rows (q_b: per head nope then rope;
# kv_a: the latent rows then the shared k rope rows).
MCORE_MLA_ROPE = {".self_attn.q_b_proj.": "q_b", ".self_attn.kv_a_proj_with_mqa.": "kv_a"}
# multi_latent_attention.py: linear_qkv = concat(linear_q_down_proj, linear_kv_down_proj), split back into
# [q_lora_rank, kv_lora_rank, qk_rope_head_dim] rows
MCORE_MLA_FUSED = {".self_attention.linear_qkv.": ("mla_qkv", (".self_attn.q_a_proj.",
                                                               ".self_attn.kv_a_proj_with_mqa.")),
                   ".mlp.linear_fc1.": ("gate_up", (".mlp.gate_proj.", ".mlp.up_proj.")),
                   ".mlp.shared_experts.linear_fc1.": ("gate_up", (".mlp.shared_experts.gate_proj.",
                                                                   ".mlp.shared_experts.up_proj."))}
# Stacked experts: weight1 [E*H, 2I], weight2 [E*I, H] (concat_expert_weight; translators/names.py's docstring).
MCORE_EXPERTS = {
    ".mlp.experts.weight1": ("weight1", (".mlp.experts.{e}.gate_proj.weight", ".mlp.experts.{e}.up_proj.weight")),
    ".mlp.experts.weight2": ("weight2", (".mlp.experts.{e}.down_proj.weight",)),
}

# --- the family records (translators/families/record.py) ------------------------------------------------------------
RECORDS = (
    # Qwen3's transformers RoPE is Llama's ("Copied from"): its runtime module (PatchTargets.hooks) is Llama's
    FamilyRecord("qwen3", "qwen3", "mcore", True, model_types=("qwen3",), architectures=("Qwen3ForCausalLM",),
                 weights=Weights(MCORE_NAMES), tp="hf_tp_plan",
                 runtime=PatchTargets(f"{MODELS}.qwen3.modeling_qwen3", rope="split_half", hooks="llama",
                                      mlps=("Qwen3MLP",))),
    FamilyRecord("qwen3_moe", "qwen3_moe", "mcore", True, model_types=("qwen3_moe",),
                 architectures=("Qwen3MoeForCausalLM",), weights=Weights(MCORE_NAMES, experts=MCORE_EXPERTS),
                 tp=parts.ATTENTION + parts.QK_NORM + parts.MLP,
                 runtime=PatchTargets(f"{MODELS}.qwen3_moe.modeling_qwen3_moe", rope="split_half", hooks="llama",
                                      mlps=("Qwen3MoeMLP",), experts="Qwen3MoeExperts",
                                      moe_block="Qwen3MoeSparseMoeBlock")),
    FamilyRecord("deepseek_v3", "deepseek_v3", "mcore", True, model_types=("deepseek_v3",),
                 architectures=("DeepseekV3ForCausalLM",), tp=parts.MLA + parts.MLP,
                 weights=Weights(MCORE_MLA_NAMES, experts=MCORE_EXPERTS, style="mcore_mla", fused=MCORE_MLA_FUSED,
                                 prefixes=(*names.MCORE_PREFIXES, "mtp."), concat_names=MCORE_MLA_CONCAT, mtp="gpt"),
                 memory_defaults=DEEPSEEK_V3_MEMORY, runtime=DEEPSEEK_V3_RUNTIME),
)


def mcore_spec(config_class: str, rules: dict[str, Rule | str], defaults: dict, derive: tuple[Derive, ...] = (),
               spellings: dict[str, tuple[str, ...]] | None = None) -> _Spec:
    """A spec whose rules answer to every mcore spelling of a setting (MCORE_SPELLINGS, with the family's own
    `spellings` over them)."""
    table = {**MCORE_SPELLINGS, **(spellings or {})}
    spelled = {s: rule for name, rule in rules.items() for s in table.get(name, (name,))}
    aliases = {s: name for name, names in table.items() for s in names}
    return _Spec(config_class, spelled, defaults, derive, aliases=aliases, head_dim_derived=False)


def specs() -> dict[tuple[str, bool], _Spec]:
    """Qwen3Config, Qwen3MoeConfig, the mcore DeepseekV3Config: table, defaults, derivations."""
    return {
        ("qwen3", True): mcore_spec("Qwen3Config", QWEN3, QWEN3_DEFAULTS, (_kv_heads, _mcore_rope)),
        ("qwen3_moe", True): mcore_spec("Qwen3MoeConfig", QWEN3_MOE, QWEN3_MOE_DEFAULTS,
                                        (_kv_heads, _mcore_rope, _qwen3_dense_layers)),
        ("deepseek_v3", True): mcore_spec("DeepseekV3Config", DEEPSEEK_MCORE, DEEPSEEK_MCORE_DEFAULTS,
                                          (_mla_kv_heads, _mcore_rope, _untied, _mcore_groups, _shared_width)),
    }


# --- memory hooks (translators/memory.py: this family's parameter and activation counts) ------------------------------

def memory_attention(hf: dict, h: int, a: int, k: int, d: int) -> list:
    """Qwen3's and Qwen3-MoE's: all four projections follow attention_bias, q/k norms on each head."""
    bias = bool(hf.get("attention_bias"))
    return memory.dense_attention(h, a, k, d, bias, bias, qk_norm=True)


def memory_attention_bytes(hf: dict, e: int, tp: int, h: int, a: int) -> float:
    k = hf.get("num_key_value_heads") or a
    d = hf.get("head_dim") or h // a
    return memory.dense_attention_bytes(hf, e, tp, h, a) + (4 + e) * (a + k) * d / tp  # q_norm / k_norm on each head


def memory_moe_layers(hf: dict) -> list[int]:
    return memory.sparse_step_layers(hf) if hf["model_type"] == "qwen3_moe" else []
