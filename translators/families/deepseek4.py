"""DeepSeek-V4 (MindFormers 2.1.0: models/deepseek4, PyNativeDeepseekV4ForCausalLM) onto transformers'
`DeepseekV4ForCausalLM` (5.23).

MindFormers builds DeepSeek-V4 as its PyNative GPTModel (pynative/base_models/gpt) with the `dsv4_hybrid` attention
(pynative/transformers/experimental_attention_variant/deepseek_v4_hybrid_attention.py, csa.py, compressor.py,
indexer.py), mHC hyper-connections (pynative/transformers/hyper_connection.py) and its PyNative MoE (moe/router.py,
experts.py). Compared from source, piece by piece, with transformers' modeling_deepseek_v4.py:
  attention  q: q_a (q_lora_rank) -> RMSNorm -> q_b (heads x v_head_dim) -> per-head RMSNorm without weight
             (MindFormers' `q_rms_gamma` is a frozen ones vector); one shared KV head (kv_proj -> RMSNorm), k = v;
             interleaved RoPE on the trailing qk_rope_head_dim lanes, undone on the output; a learnable sink per head;
             scale v_head_dim^-0.5; grouped low-rank output (o_groups x o_lora_rank, then o_proj). HF's head_dim is
             MindFormers' v_head_dim (its q heads are v_head_dim wide: qk_nope + qk_rope).
             compress_ratios per layer: 0 sliding window only, 4 compressed sparse attention (compressor with
             overlap + the lightning indexer's top-k), 128 heavily compressed attention: HF's layer_types. The
             sliding branch's RoPE is plain (rope_theta), the compressed layers' is YaRN with compress_rope_theta,
             mscale 1 (MindFormers passes 1.0; HF forces attention_factor 1.0) and MLATransformerConfig's
             original_max_position_embeddings 4096 (the YAML cannot set it: COMMON_CONFIG_MAPPING sends that
             spelling to max_position_embeddings).
  mHC        hc_mult streams; RMSNorm without weight (MindFormers' `rms_weight` is frozen ones) over the flattened
             streams in float32, one projection to pre / post / comb, sigmoid + 1e-6, 2 sigmoid, softmax + 1e-6 then
             Sinkhorn (one column step, then iterations - 1 row/column steps, eps 1e-6): HF's hc_eps is that eps.
  MoE        every layer is MoE (one shared expert plus routed experts of moe_intermediate_size); scores
             sqrt(softplus(logits)) in float32, top-k of scores + expert bias, gates renormalised and times
             routed_scaling_factor; the first num_hash_layers layers select their experts from the frozen tid2eid
             table (hash_moe). SwiGLU clamped only when hidden_act is `fusedswiglu` (get_activation ignores
             activation_func_clamp_value for every other activation, and the YAMLs say `silu`): HF's swiglu_limit
             is then +inf.
What differs in training only (stated on the keys): the indexer's KL loss (dsa_indexer_loss_coeff: HF has none, so
the indexer's weights get no gradient here), the sequence aux loss, the hash layers' router dtype under bf16. MTP
(num_nextn_predict_layers; HF builds none) is built beside the model by mf_ds/mtp_v4.py: its layer's attention
kind is the compress_ratios entry after the decoder layers' (hf_config MTP_LAYER_TYPES), its MoE never hash-routed.
mf-ds' MoE layer replaces the decoder layers' top-k blocks (plan_moe: MindFormers' router, its expert-bias update);
the hash-routed ones and the MTP layer's stay transformers'. A fresh model
starts its hash table and mHC as MindFormers does (mf_ds/families/deepseek4.py init: transformers' _init_weights
leaves tid2eid at zeros, one expert for every token); its other initial values are transformers'
(normal(initializer_range) weights, zero sinks and position biases).
A shared expert narrower (or wider) than the routed ones (Pro: moe_shared_expert_intermediate_size 2048 beside 3072;
MindFormers builds it so, moe/shared_experts.py) is one HF config attribute more, SHARED_WIDTH, written only when the
widths differ: transformers' DeepseekV4MLP reads one width for both (`intermediate_size`, which its attribute_map sends
to moe_intermediate_size), so mf-ds builds each layer's shared expert that wide before any weight is loaded
(mf_ds/families/deepseek4.py shared_experts); the state-dict names stay transformers'.
"""

from __future__ import annotations

import math

from translators import memory, names
from translators.families.deepseek import DEEPSEEK
from translators.families.derive import _untied
from translators.families.mcore import MCORE, MCORE_DEFAULTS, MCORE_MOE_RULES, UNTIED, mcore_spec
from translators.families.parts import MODELS
from translators.families.record import FamilyRecord, PatchTargets, Weights
from translators.families.rules import (
    CHECKPOINT,
    DROP,
    GENERATION,
    INFERENCE,
    Differs,
    Drop,
    Expect,
    Feeds,
    Map,
    Runtime,
    Shape,
    _choice,
    _each,
    _flag,
    _int,
    _optional,
    _positive,
)

# The HF config attribute for a shared expert whose width is not moe_intermediate_size (mf_ds/families/deepseek4.py).
SHARED_WIDTH = "mf_shared_expert_intermediate_size"
# The HF config attribute for the MTP layers' attention kinds (HF layer_types names; mf_ds/mtp_v4.py builds them).
MTP_LAYER_TYPES = "mf_mtp_layer_types"

_CSA, _HCA, _SLIDING = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
LAYER_TYPES = {0: _SLIDING, 4: _CSA, 128: _HCA}  # HF's _COMPRESS_RATIO_TO_LAYER_TYPE (its default compress_rates)
YARN_ORIGINAL = 4096  # MLATransformerConfig.original_max_position_embeddings (parallel_core/transformer_config.py)
SINKHORN_EPS = 1e-6  # SinkhornKnopp._EPS (pynative/transformers/hyper_connection.py)

# DeepseekV4Config's own names and DeepseekV4ConfigConverter's (config_converter_deepseek_v4.py) for one setting
# (canonical first; the engine refuses two spellings of one setting, as MindFormers' converter does).
SPELLINGS: dict[str, tuple[str, ...]] = {
    "hc_mult": ("hc_mult", "num_residual_streams"),
    "hc_sinkhorn_iters": ("hc_sinkhorn_iters", "mhc_sinkhorn_iterations"),
    "hc_eps": ("hc_eps", "mhc_layernorm_epsilon"),
    "sliding_window": ("sliding_window", "csa_window_size"),
    "compress_ratios": ("compress_ratios", "csa_compress_ratios"),
    "compress_rope_theta": ("compress_rope_theta", "csa_compress_rotary_base"),
    "swiglu_limit": ("swiglu_limit", "activation_func_clamp_value"),
    "num_hash_layers": ("num_hash_layers", "moe_n_hash_layers"),
    "index_n_heads": ("index_n_heads", "dsa_indexer_n_heads"),
    "index_head_dim": ("index_head_dim", "dsa_indexer_head_dim"),
    "index_topk": ("index_topk", "dsa_indexer_topk"),
    "qk_nope_head_dim": ("qk_nope_head_dim", "qk_head_dim"),
    "qk_rope_head_dim": ("qk_rope_head_dim", "qk_pos_emb_head_dim"),
    # scoring_func is deleted by DeepseekV4Config (NotSupportedInfo.useless): only this spelling routes
    "use_gating_sigmoid": ("use_gating_sigmoid", "moe_router_score_function"),
}

# mf_ds/patch: the mf-ds MoE layer replaces the top-k MoE blocks (plan_moe); HF's attention (eager: V4 supports no
# other), mHC and hash-routed MoE blocks run as they are.
RUNTIME = PatchTargets(
    f"{MODELS}.deepseek_v4.modeling_deepseek_v4", experts="DeepseekV4Experts", moe_block="DeepseekV4SparseMoeBlock",
    shared="shared_experts", hooks="deepseek4",
    not_applicable={
        "fused_rope": "DeepSeek-V4 rotates the trailing qk_rope lanes interleaved, per layer type (plain and YaRN), "
                      "and back on the attention output: not the split-half RoPE the kernel computes",
        "fused_swiglu": "DeepSeek-V4's SwiGLU clamps gate and up (swiglu_limit) inside HF's experts and shared MLP; "
                        "the kernel does not clamp",
    })

# Memory formulas' inputs when a translated hf_config leaves them out (DeepseekV4Config of transformers 5.23).
MEMORY = {"q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024, "index_n_heads": 64, "index_head_dim": 128,
          "hc_mult": 4, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 6,
          "moe_intermediate_size": 2048, "head_dim": 512, "num_key_value_heads": 1}

# --- the weight names (translators/names.py applies them) -------------------------------------------------------------
# MindFormers 2.1.0's PyNative DeepSeek-V4 (PyNativeDeepseekV4ForCausalLM: the names its GPTModel holds, checked
# against the model built on CPU: tests/fixtures/deepseek4/params.*.json) to transformers' DeepseekV4ForCausalLM.
# The HF side is transformers' own module names (save_pretrained writes DeepSeek's original names, and from_pretrained
# reads both); its stacked experts are written per expert as `experts.{e}.w1/w3/w2.weight`, which it reads too.
DEEPSEEK4_NAMES = (
    ("embedding.word_embeddings.", "model.embed_tokens."),
    ("decoder.final_layernorm.", "model.norm."),
    ("output_layer.", "lm_head."),
    ("decoder.hc_head.", "model.hc_head."),
    (".hc_head.hc_fn.weight", ".hc_head.hc_fn"),
    ("decoder.layers.", "model.layers."),
    (".self_attention.core_attention.indexer.compressor.linear_wkv.", ".self_attn.compressor.indexer.kv_proj."),
    (".self_attention.core_attention.indexer.compressor.linear_wgate.", ".self_attn.compressor.indexer.gate_proj."),
    (".self_attention.core_attention.indexer.compressor.norm.", ".self_attn.compressor.indexer.kv_norm."),
    (".self_attention.core_attention.indexer.compressor.ape", ".self_attn.compressor.indexer.position_bias"),
    (".self_attention.core_attention.indexer.linear_wq_b.", ".self_attn.compressor.indexer.q_b_proj."),
    (".self_attention.core_attention.indexer.linear_weights_proj.",
     ".self_attn.compressor.indexer.scorer.weights_proj."),
    (".self_attention.core_attention.compressor.linear_wkv.", ".self_attn.compressor.kv_proj."),
    (".self_attention.core_attention.compressor.linear_wgate.", ".self_attn.compressor.gate_proj."),
    (".self_attention.core_attention.compressor.norm.", ".self_attn.compressor.kv_norm."),
    (".self_attention.core_attention.compressor.ape", ".self_attn.compressor.position_bias"),
    (".self_attention.core_attention.attn_sink", ".self_attn.sinks"),
    (".self_attention.linear_q_down_proj.", ".self_attn.q_a_proj."),
    (".self_attention.q_layernorm.", ".self_attn.q_a_norm."),
    (".self_attention.linear_q_up_proj.", ".self_attn.q_b_proj."),
    (".self_attention.linear_kv_proj.", ".self_attn.kv_proj."),
    (".self_attention.kv_layernorm.", ".self_attn.kv_norm."),
    (".self_attention.linear_o_group_proj", ".self_attn.o_a_proj.weight"),  # a bare Parameter in MindFormers
    (".self_attention.linear_proj.", ".self_attn.o_b_proj."),
    (".pre_mlp_layernorm.", ".post_attention_layernorm."),
    (".mlp.router.weight", ".mlp.gate.weight"),
    (".mlp.router.tid2eid", ".mlp.gate.tid2eid"),
    (".mlp.expert_bias", ".mlp.gate.e_score_correction_bias"),
    (".mlp.shared_experts.linear_fc2.", ".mlp.shared_experts.down_proj."),
    (".attn_hc.mapping_proj.weight", ".attn_hc.fn"),
    (".attn_hc.bias", ".attn_hc.base"),
    (".ffn_hc.mapping_proj.weight", ".ffn_hc.fn"),
    (".ffn_hc.bias", ".ffn_hc.base"),
)
# HF's mHC `scale` [3] is MindFormers' alpha_pre, alpha_post, alpha_res [1] each (utils.py ScaleSplitConvertOp).
DEEPSEEK4_SPLIT = {
    f".{hc}.scale": ("hc_scale", tuple(f".{hc}.alpha_{part}" for part in ("pre", "post", "res")))
    for hc in ("attn_hc", "ffn_hc")
}
# experts.py: weight1 [E, H, 2I] = per expert [gate^T | up^T] (chunked into halves), weight2 [E, I, H] = down^T.
DEEPSEEK4_EXPERTS = {
    ".mlp.experts.weight1": ("experts_w1", (".mlp.experts.{e}.w1.weight", ".mlp.experts.{e}.w3.weight")),
    ".mlp.experts.weight2": ("experts_w2", (".mlp.experts.{e}.w2.weight",)),
}
# MindFormers parameters HF does not hold, each written beside another when converting back (the frozen ones of the
# weightless norms are checked to be ones when converting to HF): q_rms_gamma, the per-head q norm, v_head_dim wide
# like kv_layernorm; rms_weight, the mHC norm over n x H, mapping_proj's input width; the router's load counter,
# written as zeros (what the network holds after each step), in place of names.EXPERT_LOAD's expert_load.
DEEPSEEK4_FROZEN = {
    ".self_attention.q_rms_gamma": (".self_attention.kv_layernorm.weight", "ones", 0),
    ".attn_hc.rms_weight": (".attn_hc.mapping_proj.weight", "ones", 1),
    ".ffn_hc.rms_weight": (".ffn_hc.mapping_proj.weight", "ones", 1),
    ".mlp.tokens_per_expert": (".mlp.router.weight", "zeros", 0),  # the router's load counter (names.NOT_WEIGHTS), fp32
}
# transformers' save_pretrained writes DeepSeek-V4 under DeepSeek's own names (conversion_mapping.py "deepseek_v4",
# reversed: `layers.N.attn.wq_a`, `ffn.experts.E.w1`, `hc_attn_fn`, `head.weight`, ...): (saved, module name), in
# order, to read such a directory (an mf-ds checkpoint) back; per-expert `mlp.experts.E.w1/w3/w2` stay per expert.
_V4_ATTN = (("wq_a.", "q_a_proj."), ("q_norm.", "q_a_norm."), ("wq_b.", "q_b_proj."), ("wkv.", "kv_proj."),
            ("norm.", "kv_norm."), ("wo_a.", "o_a_proj."), ("wo_b.", "o_b_proj."))
_V4_COMPRESSOR = (("wkv.", "kv_proj."), ("wgate.", "gate_proj."), ("norm.", "kv_norm."), ("ape", "position_bias"))
DEEPSEEK4_SAVED = (
    (".attn_norm.", ".input_layernorm."), (".ffn_norm.", ".post_attention_layernorm."),
    *((f".hc_{part}_{w}", f".{part}_hc.{w}") for part in ("attn", "ffn") for w in ("fn", "base", "scale")),
    (".attn.attn_sink", ".self_attn.sinks"),
    *((f".attn.indexer.compressor.{a}", f".self_attn.compressor.indexer.{b}") for a, b in _V4_COMPRESSOR),
    (".attn.indexer.weights_proj.", ".self_attn.compressor.indexer.scorer.weights_proj."),
    (".attn.indexer.wq_b.", ".self_attn.compressor.indexer.q_b_proj."),
    *((f".attn.compressor.{a}", f".self_attn.compressor.{b}") for a, b in _V4_COMPRESSOR),
    *((f".attn.{a}", f".self_attn.{b}") for a, b in _V4_ATTN),
    (".ffn.gate.bias", ".mlp.gate.e_score_correction_bias"), (".ffn.gate.", ".mlp.gate."),
    (".ffn.shared_experts.w1.", ".mlp.shared_experts.gate_proj."),
    (".ffn.shared_experts.w3.", ".mlp.shared_experts.up_proj."),
    (".ffn.shared_experts.w2.", ".mlp.shared_experts.down_proj."),
    (".ffn.experts.", ".mlp.experts."),
)
# and the top-level ones, whole names (DeepSeek's release also leaves out the `model.` prefix)
DEEPSEEK4_SAVED_TOP = {"head.weight": "lm_head.weight", "embed.weight": "model.embed_tokens.weight",
                       "norm.weight": "model.norm.weight", "hc_head_fn": "model.hc_head.hc_fn",
                       "hc_head_base": "model.hc_head.hc_base", "hc_head_scale": "model.hc_head.hc_scale"}


def saved_to_module(name: str) -> str:
    """An HF checkpoint name as transformers' module holds it (DeepSeek-V4's saved names: DEEPSEEK4_SAVED; the
    record's Weights.saved_names, names.hf_module_name)."""
    if name in DEEPSEEK4_SAVED_TOP:
        return DEEPSEEK4_SAVED_TOP[name]
    if name.startswith("layers."):
        name = "model." + name
    for saved, module in DEEPSEEK4_SAVED:
        name = name.replace(saved, module)
    return name


# One shared-expert MLP: linear_fc1 holds gate and up interleaved per row (pynative/transformers/mlp.py reshapes its
# output to [..., I, 2] and takes gate = [..., 0], up = [..., 1]; MindFormers' own HF template, utils.py, concatenates
# them instead, which that MLP does not read back).
DEEPSEEK4_FUSED = {".shared_experts.linear_fc1.": ("gate_up", (".shared_experts.gate_proj.",
                                                                ".shared_experts.up_proj."))}

RECORDS = (
    FamilyRecord("deepseek_v4", "deepseek_v4", "mcore", True, model_types=("deepseek_v4",),
                 architectures=("DeepseekV4ForCausalLM",),
                 weights=Weights(DEEPSEEK4_NAMES, split=DEEPSEEK4_SPLIT, experts=DEEPSEEK4_EXPERTS,
                                 frozen=DEEPSEEK4_FROZEN, style="deepseek4", fused=DEEPSEEK4_FUSED,
                                 prefixes=(*names.MCORE_PREFIXES, "mtp."), saved_names=saved_to_module, mtp="gpt"),
                 memory_defaults=MEMORY, runtime=RUNTIME, moe_plan=False,
                 pipeline_cut=False),  # its hyper-connection streams and hc_head: not in mf_ds/pipeline.Pieces' cut
)


def specs() -> dict:
    """config class, rules, defaults, derivations and extra spellings."""
    defaults = {**MCORE_DEFAULTS, "return_extra_loss": True, "extend_method": "None"}
    derive = (_heads, _layers, _rope, _moe, _swiglu, _mhc, _untied)
    return {("deepseek_v4", True): mcore_spec("DeepseekV4Config", _rules(), defaults, derive, SPELLINGS)}


def _typed_feeds() -> dict:
    """The keys that only feed derived HF values (_heads, _layers, _rope, _moe, _swiglu, _mhc), typed as read."""
    pos, nonneg = _int(1), _int(0)
    feeds = {key: Feeds(conv=conv) for key, conv in (
        ("hc_mult", pos), ("hc_sinkhorn_iters", pos), ("hc_eps", _positive), ("sliding_window", pos),
        ("num_hash_layers", nonneg), ("compress_rope_theta", _positive), ("norm_topk_prob", _flag),
        ("enable_hyper_connections", _flag), ("csa_dense_mode", _flag), ("v_head_dim", pos), ("head_dim", pos),
        ("qk_nope_head_dim", pos), ("qk_rope_head_dim", pos), ("n_group", None), ("topk_group", None),
        ("shared_expert_num", None))}
    feeds["moe_shared_expert_intermediate_size"] = SharedWidth(conv=_optional(pos))
    untyped = {key: Feeds(conv=lambda value, path: value) for key in (
        "compress_ratios", "hidden_act", "use_gating_sigmoid", "experimental_attention_variant")}
    untyped["swiglu_limit"] = Feeds(unused="ignored: MindFormers' get_activation clamps only a `fusedswiglu` "
                                           "hidden_act (pynative/layers/activation.py); HF's swiglu_limit = inf",
                                    conv=lambda value, path: value)
    return {**feeds, **untyped}


def _rules() -> dict:
    """DeepseekV4Config's keys (models/deepseek4/configuration_deepseek_v4.py, 2.1.0): what each becomes."""
    return {  # DeepseekV4Config (models/deepseek4/configuration_deepseek_v4.py, 2.1.0) -> HF DeepseekV4Config
        # the mcore router settings are read by translators/moe.py, which this family does not use (moe_plan False)
        **{k: v for k, v in MCORE.items() if k not in MCORE_MOE_RULES},
        **_typed_feeds(),
        "tie_word_embeddings": UNTIED,
        "n_kv_heads": Drop("not read: DeepSeek-V4's attention has one shared KV head (as HF's: "
                           "num_key_value_heads 1)"),
        "intermediate_size": Drop("no dense MLP: every DeepSeek-V4 layer is MoE"),
        "pad_token_id": Drop("the tokenizer's pad id: MindFormers' embedding has no padding row, so HF's padding_idx "
                             "is left unset"),
        "use_flash_attention": Drop("Ascend FlashAttention; HF's DeepSeek-V4 attention is eager (sinks and "
                                    "compressed entries on the KV axis): the same softmax attention"),
        "mla_qkv_concat": Drop("not read by DeepSeek-V4's hybrid attention: its q and kv projections are separate "
                               "weights"),
        "q_lora_rank": "q_lora_rank",
        "o_groups": "o_groups",
        "o_lora_rank": "o_lora_rank",
        "index_n_heads": "index_n_heads",
        "index_head_dim": "index_head_dim",
        "index_topk": "index_topk",
        "expert_num": "n_routed_experts",
        "num_experts_chosen": "num_experts_per_tok",
        "moe_intermediate_size": "moe_intermediate_size",
        "routed_scaling_factor": "routed_scaling_factor",
        "qkv_has_bias": DEEPSEEK["qkv_has_bias"],
        "multi_latent_attention": Expect(True, "DeepSeek-V4's low-rank q and shared-KV attention, as HF's",
                                         "HF DeepSeek-V4 always uses its low-rank q / shared-KV attention"),
        "qk_layernorm": Expect(True, "norms on the compressed q and the kv, as HF (q_a_norm, kv_norm)",
                               "HF DeepSeek-V4 always normalises the compressed q and the kv"),
        "normalization": Expect("RMSNorm", "RMSNorm, as HF", "HF DeepSeek-V4 uses RMSNorm"),
        "mtp_depth": Shape(),  # built by mf_ds/mtp_v4.py (translators/mtp.py notes it and mtp_loss_factor)
        "topk_method": Drop("not read by the PyNative router (it limits groups by moe_router_num_groups)"),
        "actual_vocab_size": Drop("DeepseekV4Config's copy of vocab_size (the hash table's rows)"),
        "moe_router_fusion": Drop("Ascend fused-router switch (performance only)"),
        "moe_grouped_gemm": Drop("MindFormers' PyNative MoE needs it (GroupedMatmul); mf-ds' MoE layer always runs "
                                 "its grouped matmul (the top-k layers; HF's experts in the hash layers)"),
        "use_pad_tokens": Drop("Ascend dispatch padding (performance only)"),
        "moe_permute_fusion": Drop("Ascend fused permute (performance only)"),
        "moe_token_drop_policy": Drop("unused: the PyNative MoE drops no tokens (dropless, as HF's block)"),
        "moe_expert_capacity_factor": Drop("unused: the PyNative MoE has no capacity (dropless, as HF's block)"),
        "moe_token_dispatcher_type": Drop("Ascend dispatch strategy (performance only)"),
        "apply_dsa_kernel_fusion": Drop("Ascend fused indexer kernels (performance only)"),
        "moe_router_force_expert_balance": Expect(False, "off: the router's own choice",
                                                  "MindFormers replaces the routing by a round-robin (a load test); "
                                                  "HF routes with the router's scores"),
        "moe_router_dtype": Differs("the top-k layers' router runs in float32 in mf-ds' MoE layer, as in "
                                    "MindFormers; the hash layers' (HF's DeepseekV4HashRouter) in the model's dtype "
                                    "(bf16 under bf16 training; equal in float32 runs)",
                                    conv=_choice("float32", "fp32", "bfloat16")),
        "moe_router_enable_expert_bias": Runtime(
            "the Plan's moe.router.bias_balance (plan_moe): the top-k layers select with the bias (HF's "
            "e_score_correction_bias, MindFormers' mlp.expert_bias) and move it after each step by "
            "moe_router_bias_update_rate x sign(mean load - load), as MindFormers' _update_expert_bias; hash layers "
            "have none, as in MindFormers. With a clamped SwiGLU (hidden_act fusedswiglu) HF's blocks run and the "
            "bias does not move"),
        "moe_router_bias_update_rate": Runtime("the Plan's moe.router.bias_update_rate (see "
                                               "moe_router_enable_expert_bias)"),
        "moe_router_load_balancing_type": Differs(
            "MindFormers adds a sequence-level aux loss (seq_aux_loss x moe_aux_loss_coeff, hash layers too); "
            "HF's DeepSeek-V4 computes none in training here: the LM loss alone"),
        "moe_aux_loss_coeff": Differs("the weight of MindFormers' sequence aux loss; not computed here (see "
                                      "moe_router_load_balancing_type)"),
        "moe_z_loss_coeff": Differs("MindFormers' router z-loss weight; not computed here"),
        "dsa_indexer_loss_coeff": Differs(
            "MindFormers trains the lightning indexer with a KL loss against the attention it selects for "
            "(dsa_indexer_loss.py); HF's DeepSeek-V4 has no indexer loss and its top-k passes no gradient, so the "
            "indexer's weights (compressor.indexer.*) keep their initial or loaded values here"),
        "dsa_indexer_use_sparse_loss": Differs("the indexer loss's sparse form; no indexer loss here (see "
                                               "dsa_indexer_loss_coeff)"),
        # read by mf_ds/families/deepseek4.py init
        "mhc_init_gating_factor": Map("mhc_init_gating_factor", conv=_positive),
        "rope_scaling": Feeds(),
        **_each(("mscale", "mscale_all_dim"), Drop(
            "not read: the hybrid attention applies its YaRN rope with mscale 1.0 (deepseek_v4_hybrid_attention.py "
            "discards the embedding's mscale), as HF's DeepSeek-V4 forces attention_factor 1.0")),
        "is_encoder_decoder": Drop(INFERENCE),
        "is_sample_acceleration": Drop(INFERENCE),
        "quantization_config": Drop(INFERENCE),
        "quantization": Drop(INFERENCE),
        "tokenizer_class": Drop("tokenizer setting; not a model weight or shape"),
        "pet_config": Drop("parameter-efficient fine-tuning (LoRA) switch; not supported here, null in the YAMLs"),
        "parallel_config": Drop("the legacy parallel section the class keeps; the PyNative `parallelism` decides"),
        "_name_or_path": Drop(CHECKPOINT),
        "pretrained_model_dir": Drop(CHECKPOINT),
        "checkpoint_name_or_path": Drop(CHECKPOINT),
        "mindformers_version": Drop("the MindFormers version the config class was saved by"),
        **_each(("scoring_func", "expert_dtype"), DROP("DeepseekV4Config deletes it (NotSupportedInfo.useless)")),
        "use_cache": DROP(INFERENCE),
        **_each(("repetition_penalty", "max_decode_length", "top_k", "top_p", "do_sample", "temperature"),
                DROP(GENERATION)),
    }


def family_moe(hf: dict, model_config: dict, ledger) -> dict | None:
    """The hook translators/families.family_moe calls: plan_moe, with a note saying which blocks run."""
    moe = plan_moe(hf, model_config)
    if moe is None:
        ledger.runtime("", "DeepSeek-V4: the experts clamp their SwiGLU (swiglu_limit), which mf-ds' MoE layer does "
                           "not: transformers' MoE blocks run, and the expert bias does not move")
    else:
        ledger.runtime("", f"DeepSeek-V4: mf-ds' MoE layer replaces the top-k MoE blocks (layers {moe['layers']}); "
                           "the hash-routed ones stay transformers' own")
    return moe


def plan_moe(hf: dict, model_config: dict) -> dict | None:
    """The Plan's `moe` for the top-k (`moe`) layers, which mf-ds' MoE layer replaces: MindFormers' PyNative router
    (moe/router.py: sqrtsoftplus scores in float32, top-k of scores + expert bias, the unbiased scores renormalised
    with + 1e-20 and scaled; the expert bias moved by moe_router_bias_update_rate x sign(mean load - load) after each
    step, moe_layer.py / gpt_model.py _update_expert_bias), dropless. None (HF's blocks run) when the experts clamp
    their SwiGLU, which mf-ds' experts do not. `model_config`: the effective one (class defaults filled in)."""
    if math.isfinite(hf["swiglu_limit"]):
        return None
    layers = [i for i, kind in enumerate(hf["mlp_layer_types"]) if kind == "moe"]
    # the MTP layers' top-k MoE too (mf_ds/mtp_v4.py builds them after the decoder layers; moe/router.py: never hash,
    # and moe_layer.py 71 moves their expert bias as the decoder layers')
    n = hf["num_hidden_layers"]
    mtp = list(range(n, n + len(hf.get(MTP_LAYER_TYPES) or ())))
    layers += mtp
    bias = bool(model_config.get("moe_router_enable_expert_bias", False))
    rate = float(model_config.get("moe_router_bias_update_rate", 1e-3))
    zero = {"expert": 0.0, "device": 0.0, "comm": 0.0}
    return {"num_experts": hf["n_routed_experts"], "top_k": hf["num_experts_per_tok"],
            "intermediate_size": hf["moe_intermediate_size"], "shared_experts": 1, "shared_expert_gating": False,
            "layers": layers, "mtp_layers": mtp, "path": "mcore",
            "router": {"score": hf["scoring_func"], "dtype": "float32", "topk_method": "greedy", "n_group": None,
                       "topk_group": None, "norm_topk_prob": True,
                       "routed_scaling_factor": hf["routed_scaling_factor"], "bias_balance": bias,
                       "bias_update_rate": rate, "bias_updated": bias},
            "aux_loss": zero, "aux_loss_configured": zero, "aux_groups": {"device": 0, "comm": 1}, "z_loss": 0.0,
            "capacity_factor": -1.0, "capacity_multiple": 1, "token_groups": 1, "aux_f": "group", "dropless": True,
            "drop_policy": "kdrop", "safe_tokens": False, "expert_parallel": 1, "drop_rate_callback": False}


class SharedWidth(Feeds):
    """moe_shared_expert_intermediate_size: a Feeds key, noted `runtime` when it sets SHARED_WIDTH (mf-ds, not
    transformers, builds the shared expert that wide)."""

    def account(self, s, key: str, name: str, ctx) -> None:
        fed = ctx.fed.get((s.base, name)) or {}
        if SHARED_WIDTH not in fed:
            super().account(s, key, name, ctx)
            return
        ctx.note(s, key, "runtime", (
            f"hf_config.{SHARED_WIDTH} = {fed[SHARED_WIDTH]}: MindFormers builds the shared expert this wide beside "
            "routed experts of moe_intermediate_size; transformers' DeepSeek-V4 reads one width for both, so mf-ds "
            "builds each layer's shared expert (DeepseekV4MLP) this wide before loading weights "
            "(mf_ds/shared_expert.py: mf-train, deepspeed mf_ds/train.py, mf_ds.hf, mf-convert, any ZeRO stage); "
            "its checkpoints load with mf-ds, not with plain AutoModelForCausalLM.from_pretrained, which builds "
            "the routed width and stops on the shapes"))


def _refuse(m, name: str, message: str):
    from translators.errors import ConfigError

    raise ConfigError(m.path(name), message)


def _heads(m, moe) -> dict:
    """HF's head_dim is the width of every q / kv head: MindFormers' v_head_dim (q_head_dim = v_head_dim in the
    hybrid attention), of which the trailing qk_rope_head_dim lanes are rotated."""
    v, rope = m.need("v_head_dim"), m.get("qk_rope_head_dim")
    if not 0 < rope <= v or rope % 2:
        _refuse(m, "qk_rope_head_dim", f"{rope}: the rotated lanes must be an even number within v_head_dim {v}")
    # DeepseekV4Config sets qk_nope_head_dim = head_dim - qk_rope_head_dim unless the YAML gives it
    nope = m.get("qk_nope_head_dim") if m.given("qk_nope_head_dim") else m.get("head_dim") - rope
    if nope + rope != v:
        name = "qk_nope_head_dim" if m.given("qk_nope_head_dim") else "head_dim"
        _refuse(m, name, f"qk_nope_head_dim {nope} + qk_rope_head_dim {rope} is not v_head_dim {v}: MindFormers "
                         "stops with \"DSv4 hybrid requires qk_head_dim + qk_pos_emb_head_dim == v_head_dim\" "
                         "(TransformerConfig.__post_init__)")
    return {"head_dim": v, "partial_rotary_factor": rope / v, "num_key_value_heads": 1, "pad_token_id": None}


def _layers(m, moe) -> dict:
    """compress_ratios (one per decoder layer, then the MTP layers') -> HF layer_types; num_hash_layers ->
    mlp_layer_types (the router is hash-based for decoder layers < num_hash_layers: moe/router.py)."""
    layers, ratios = m.get("num_layers"), m.get("compress_ratios")
    if not isinstance(ratios, list) or len(ratios) < layers:
        _refuse(m, "compress_ratios", f"expected a list of at least num_hidden_layers ({layers}) ratios, got "
                                      f"{ratios!r}")
    bad = [r for r in ratios[:layers] if r not in LAYER_TYPES]
    if bad:
        _refuse(m, "compress_ratios", f"ratio {bad[0]!r}: HF's DeepSeek-V4 builds 0 (sliding window), 4 (compressed "
                                      "sparse attention) and 128 (heavily compressed attention)")
    if m.get("sliding_window") != 128:
        _refuse(m, "sliding_window", "MindFormers' compressed sparse attention takes only 128 "
                                     "(TransformerConfig.__post_init__)")
    if m.get("csa_dense_mode"):
        _refuse(m, "csa_dense_mode", "True: MindFormers' CSA layers attend to every compressed entry without the "
                                     "indexer; HF's always select the indexer's top-k")
    if m.get("experimental_attention_variant") != "dsv4_hybrid":
        _refuse(m, "experimental_attention_variant", f"{m.get('experimental_attention_variant')!r}: only "
                                                     "dsv4_hybrid is HF's DeepSeek-V4 attention")
    hashed = min(m.get("num_hash_layers") or 0, layers)
    out = {"layer_types": [LAYER_TYPES[r] for r in ratios[:layers]], "sliding_window": 128,
           "compress_rates": {_CSA: 4, _HCA: 128},
           "mlp_layer_types": ["hash_moe"] * hashed + ["moe"] * (layers - hashed)}
    depth = m.get("mtp_depth") or 0
    if depth:
        # the MTP layer's attention reads csa_compress_ratios[num_layers + i] (deepseek_v4_hybrid_attention.py 70-71,
        # multi_token_prediction.py 568: layer_number num_layers + i); TransformerConfig wants exactly that many
        mtp = ratios[layers:layers + depth]
        if len(mtp) < depth or any(r not in LAYER_TYPES for r in mtp):
            _refuse(m, "compress_ratios", f"{ratios!r}: {layers} decoder layers and {depth} MTP layer(s) need "
                                          f"{layers + depth} ratios, each 0, 4 or 128 (MindFormers: \"csa_compress_"
                                          "ratios length must equal num_layers + (mtp_num_layers or 0)\")")
        out[MTP_LAYER_TYPES] = [LAYER_TYPES[r] for r in mtp]
    return out


def _rope(m, moe) -> dict:
    """The sliding layers rotate with plain RoPE (rope_theta), the compressed ones with compress_rope_theta and,
    under position_embedding_type yarn, YaRN (factor, beta_fast, beta_slow; mscale 1; original length 4096)."""
    rope = m.get("qk_rope_head_dim") / m.get("v_head_dim")
    main = {"rope_type": "default", "rope_theta": m.get("theta"), "partial_rotary_factor": rope}
    compress = {"rope_type": "default", "rope_theta": m.get("compress_rope_theta"), "partial_rotary_factor": rope}
    method = m.get("extend_method")
    if method == "YARN":
        factor = m.get("scaling_factor")
        if not isinstance(factor, (int, float)) or isinstance(factor, bool):
            _refuse(m, "scaling_factor", f"YaRN needs a number (rotary_scaling_factor), got {factor!r}")
        compress.update(rope_type="yarn", factor=float(factor), beta_fast=float(m.get("beta_fast") or 32),
                        beta_slow=float(m.get("beta_slow") or 1), original_max_position_embeddings=YARN_ORIGINAL,
                        attention_factor=1.0)
    elif method != "None":
        _refuse(m, "extend_method", f"position embedding {method!r}: DeepSeek-V4 here takes rope or yarn")
    return {"rope_theta": m.get("theta"), "compress_rope_theta": m.get("compress_rope_theta"),
            "rope_parameters": {"main": main, "compress": compress}}


def _moe(m, moe) -> dict:
    """sqrtsoftplus (or sigmoid) scores, gates renormalised (HF always: norm_topk_prob must be True), no group
    limit, one shared expert: SHARED_WIDTH when it is not as wide as a routed one."""
    score = m.get("use_gating_sigmoid")
    if score not in ("sqrtsoftplus", "sigmoid", True):
        _refuse(m, "use_gating_sigmoid", f"{score!r}: HF's DeepSeek-V4 renormalises the gates, as MindFormers does "
                                         "for sqrtsoftplus and sigmoid scores only")
    if not m.get("norm_topk_prob"):
        _refuse(m, "norm_topk_prob", "False: HF's DeepSeek-V4 routers always renormalise the top-k gates")
    for name in ("n_group", "topk_group"):
        if m.get(name):
            _refuse(m, name, f"{m.get(name)}: group-limited routing; HF's DeepSeek-V4 routes over all experts")
    shared, width = m.get("shared_expert_num"), m.get("moe_intermediate_size")
    if shared != 1:
        _refuse(m, "shared_expert_num", f"{shared}: HF's DeepSeek-V4 builds exactly one shared expert")
    out = {"scoring_func": "sigmoid" if score in ("sigmoid", True) else "sqrtsoftplus", "n_shared_experts": 1,
           "norm_topk_prob": True}
    given = m.get("moe_shared_expert_intermediate_size")
    if given is not None and given != width:
        # MindFormers builds the shared expert this wide (moe/shared_experts.py; TransformerConfig only warns)
        out[SHARED_WIDTH] = given
    return out


def _swiglu(m, moe) -> dict:
    """get_activation (pynative/layers/activation.py) clamps only `fusedswiglu`; HF always clamps, so a silu model
    gets swiglu_limit +inf (clamp(x, max=inf) is x)."""
    act = str(m.get("hidden_act")).lower()
    if act not in ("silu", "swish", "swiglu", "fusedswiglu"):
        _refuse(m, "hidden_act", f"{act!r}: HF's DeepSeek-V4 experts are SwiGLU")
    limit = m.get("swiglu_limit") if act == "fusedswiglu" else None
    if limit is None:
        limit = math.inf
    elif not isinstance(limit, (int, float)) or isinstance(limit, bool) or limit <= 0:
        _refuse(m, "swiglu_limit", f"expected a positive number, got {limit!r}")
    return {"hidden_act": "silu", "swiglu_limit": float(limit)}


def _mhc(m, moe) -> dict:
    """HF's mHC normalises the streams with rms_norm_eps and uses hc_eps in the Sinkhorn steps; MindFormers uses
    mhc_layernorm_epsilon (DeepseekV4Config hc_eps) for the norm and a fixed 1e-6 in Sinkhorn."""
    if not m.get("enable_hyper_connections"):
        _refuse(m, "enable_hyper_connections", "False: HF's DeepSeek-V4 always has mHC")
    if m.get("hc_eps") != m.get("rms_norm_eps"):
        _refuse(m, "hc_eps", f"{m.get('hc_eps')} is not rms_norm_eps {m.get('rms_norm_eps')}: HF normalises the "
                             "mHC streams with rms_norm_eps")
    return {"hc_mult": m.get("hc_mult"), "hc_sinkhorn_iters": m.get("hc_sinkhorn_iters"), "hc_eps": SINKHORN_EPS}


# --- memory hooks (translators/memory.py: this family's parameter and activation counts) ------------------------------

def _v4_layer_types(hf: dict) -> list[str]:
    """HF DeepseekV4Config's layer_types (its own default when the hf_config leaves them out: 2 x HCA, then CSA /
    HCA alternating)."""
    L = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types:
        return list(types[:L])
    csa, hca = "compressed_sparse_attention", "heavily_compressed_attention"
    return [hca] * min(L, 2) + [csa if i % 2 else hca for i in range(max(L - 2, 0))]


def memory_inventory(hf: dict) -> list:
    """DeepseekV4ForCausalLM (modeling_deepseek_v4.py, transformers 5.23): every layer is an MoE layer with mHC; its
    attention has a low-rank q, one shared KV head, a grouped low-rank output and per-head sinks, plus a compressor
    (CSA: with the lightning indexer) on the compressed layers. The same count as MindFormers' PyNative model's
    trainable parameters without its MTP layer (tests/fixtures/deepseek4/counts.json)."""
    Weights = memory.Weights
    h, L, V, a = hf["hidden_size"], hf["num_hidden_layers"], hf["vocab_size"], hf["num_attention_heads"]
    d, ql, g, r = hf["head_dim"], hf["q_lora_rank"], hf["o_groups"], hf["o_lora_rank"]
    n, E, width = hf["hc_mult"], hf["n_routed_experts"], hf["moe_intermediate_size"]
    ih, idim = hf["index_n_heads"], hf["index_head_dim"]
    rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128, **(hf.get("compress_rates") or {})}
    types = _v4_layer_types(hf)
    mix = (2 + n) * n  # pre, post and comb weights of one hyper-connection
    out = [Weights("embed_tokens", V * h, 1, "whole"), Weights("norm", h, 1, "whole"),
           Weights("hc_head", n * n * h + n + 1, 1, "whole")]
    if not hf.get("tie_word_embeddings", False):
        out.append(Weights("lm_head", V * h, 1, "whole"))
    out += [
        Weights("moe.norms", h, 2 * L, "whole", "moe"),
        Weights("moe.attention", h * ql + ql + ql * a * d + h * d + d + a * d * r + g * r * h + a, L, "whole", "moe"),
        Weights("moe.hyper_connections", 2 * (mix * n * h + mix + 3), L, "whole", "moe"),
        Weights("moe.router", E * h, L, "whole", "moe"),
        Weights("moe.experts", 3 * h * width, E * L, "expert", "moe"),
        Weights("moe.shared_experts.proj", h * hf.get("mf_shared_expert_intermediate_size", width), 3 * L, "whole",
                "moe"),  # mf-ds builds a shared expert of its own width (SHARED_WIDTH)
    ]
    csa = types.count("compressed_sparse_attention")
    hca = types.count("heavily_compressed_attention")
    if csa:
        m = rates["compressed_sparse_attention"]
        out += [Weights("moe.csa_compressor", 2 * h * 2 * d + m * 2 * d + d, csa, "whole", "moe"),
                Weights("moe.csa_indexer", 2 * h * 2 * idim + m * 2 * idim + idim + ql * ih * idim + h * ih, csa,
                        "whole", "moe")]
    if hca:
        m = rates["heavily_compressed_attention"]
        out.append(Weights("moe.hca_compressor", 2 * h * d + m * d + d, hca, "whole", "moe"))
    return out


def memory_moe_layers(hf: dict) -> list[int]:
    return list(range(hf.get("num_hidden_layers")))  # every layer is MoE


def memory_note(hf: dict) -> str:
    return ("DeepSeek-V4: counted as one-KV-head attention of its widths with its MoE; not counted: the "
            f"{hf.get('hc_mult', 4)} mHC streams a layer keeps (fp32 copies), the compressors, and the "
            "attention probabilities of its eager-only attention (heads x seq x (seq + compressed) per "
            "layer); not measured")
