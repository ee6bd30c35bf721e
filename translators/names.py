"""MindFormers parameter names <-> Hugging Face names (pure data; mf_ds/weights.py applies them).

The tables here are per MindFormers model code (LlamaForCausalLM, DeepSeek-V3, ChatGLM2, mcore GPTModel); each
family's record (translators/families/record.py, `weights`) says which ones name its weights, and the functions below
find them through the registry (`family` is the record's weights_key: `qwen3/mcore` for an mcore model).

The HF side is the layout Hugging Face checkpoints are saved in (what `save_pretrained` writes and what MindFormers'
converters read): one tensor per expert and projection (`experts.3.w1.weight`), separate q/k/v and gate/up.
transformers 5 fuses experts in memory (`experts.gate_up_proj` [E, 2I, H]); mf_ds/weights.py maps between the two.

Legacy families (LlamaForCausalLM and its research-folder variants), checked against MindFormers' own converters,
which map with the same substring replacements: mindformers/models/llama/convert_weight.py and convert_reversed.py
(`name_replace`), research/qwen2_5/convert_reversed.py, research/mixtral/convert_weight.py and convert_reversed.py
(1.7.0), and against the names MindFormers' LlamaForCausalLM really has (tests/fixtures/mindformers/*/golden.json).
Qwen2 / Qwen2.5 run on the same LlamaForCausalLM (LlamaConfig with qkv_has_bias), so they share the table. No
weight is permuted: MindFormers' RoPE rotates halves like HF's.
  Fused (`qkv_concat: True`): `attention.w_qkv` is q, k, v interleaved per KV group and `feed_forward.w_gate_hidden`
  is gate and up interleaved per row (mindformers/utils/convert_utils.py qkv_concat_hf2mg / ffn_concat_hf2mg).
  Mixtral's experts: `feed_forward.ffn.w1/w2/w3.weight`, the experts stacked on axis 0 as [E, out, in], or
  [E, in, out] with `use_gmm` (research/mixtral/convert_weight.py, `convert_ms_to_gmm`).

mcore families (`use_legacy: False`: qwen3, qwen3_moe), checked against `weight_mapping` in mindformers/models/
qwen3*/utils.py and `convert_weight_dict` in modeling_qwen3*_train.py with parallel_core/utils/model_mixin.py (1.7.0):
  `self_attention.linear_qkv`: per KV group its q heads, k, v (concat_qkv_weight_megatron), or q, k, v one after the
  other with use_contiguous_weight_layout_attention (concat_qkv_weight_infer).
  `mlp.linear_fc1` (dense): gate and up interleaved per row with use_interleaved_weight_layout_mlp (MindFormers'
  default; concat_ffn_weight_megatron), else gate then up (concat_ffn_weight_infer).
  `mlp.experts.weight1` [E*H, 2I]: per expert cat(gate, up) [2I, H] transposed, stacked, reshaped; `weight2` [E*I, H]:
  per expert down [H, I] transposed (concat_expert_weight).

Names outside the model (optimizer moments `adam_m.*` / `adam_v.*`, `global_step`, `epoch_num`, `step_num`,
`loss_scale`, `scale_sense`, `learning_rate`, ...) are not weights: `mf_to_hf` returns None for them.
"""

from __future__ import annotations

import re

# (MindFormers substring, HF substring), applied in order, as MindFormers' name_replace does.
LLAMA = (
    ("model.tok_embeddings.embedding_weight", "model.embed_tokens.weight"),
    ("model.norm_out.", "model.norm."),
    (".attention.wq.", ".self_attn.q_proj."),
    (".attention.wk.", ".self_attn.k_proj."),
    (".attention.wv.", ".self_attn.v_proj."),
    (".attention.wo.", ".self_attn.o_proj."),
    (".feed_forward.w1.", ".mlp.gate_proj."),
    (".feed_forward.w2.", ".mlp.down_proj."),
    (".feed_forward.w3.", ".mlp.up_proj."),
    (".attention_norm.", ".input_layernorm."),
    (".ffn_norm.", ".post_attention_layernorm."),
)
# balance_via_topk_bias: TopkRouterV2's `topk_bias` (moe.py 1.7.0) is the HF `e_score_correction_bias` (DeepSeek-V3's
# name; mf-ds gives the other families' routers the same buffer: mf_ds/weights.py attach_router_bias).
MIXTRAL = LLAMA + ((".feed_forward.router.dense.", ".block_sparse_moe.gate."),
                   (".feed_forward.router.router.topk_bias", ".block_sparse_moe.gate.e_score_correction_bias"))
# research/qwen2/convert_moe_weight.py (1.6.0; the folder left MindFormers in 1.7.0) name_replace.
QWEN2_MOE = LLAMA + (
    (".feed_forward.routed_experts.router.dense.", ".mlp.gate."),
    (".feed_forward.routed_experts.router.router.topk_bias", ".mlp.gate.e_score_correction_bias"),
    (".feed_forward.shared_experts.w1.", ".mlp.shared_expert.gate_proj."),
    (".feed_forward.shared_experts.w2.", ".mlp.shared_expert.down_proj."),
    (".feed_forward.shared_experts.w3.", ".mlp.shared_expert.up_proj."),
    (".feed_forward.shared_experts_gate.", ".mlp.shared_expert_gate."),
)
# mindformers/models/qwen3_moe/utils.py weight_mapping, MindFormers side first (the table there reads HF -> mcore).
MCORE = (
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
# (rotary_interleaved False) where HF DeepSeek-V3 de-interleaves pairs (rope_interleave), as in the legacy DEEPSEEK.
MCORE_MLA = (
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
# `linear_qb`, `linear_kvb`, `k_layernorm`), and fuses the two down projections in `linear_qkv` (FUSED "mcore_mla"):
# (name apart, name with mla_qkv_concat).
MCORE_MLA_CONCAT = ((".self_attention.linear_q_up_proj.", ".self_attention.linear_qb."),
                    (".self_attention.linear_kv_up_proj.", ".self_attention.linear_kvb."),
                    (".self_attention.kv_layernorm.", ".self_attention.k_layernorm."))
# The HF tensors whose rope rows MindFormers keeps in halves: HF part -> its rows (q_b: per head nope then rope;
# kv_a: the latent rows then the shared k rope rows).
MCORE_MLA_ROPE = {".self_attn.q_b_proj.": "q_b", ".self_attn.kv_a_proj_with_mqa.": "kv_a"}
# research/deepseek3/convert_weight.py (1.7.0): plain_name_replace, mla_name_replace, mlp_name_replace with
# use_grouped_gemm (its default; DEEPSEEK_BMM below for the other).
DEEPSEEK = (
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
# With use_gmm the Llama path builds MoEV3, which holds its router and bias itself (moev3.py 1.7.0: router_dense,
# topk_bias, expert_load; TopkBiasBalanceCallback's `routed_experts.topk_bias`): (MoEV2 name, MoEV3 name). Read
# both ways; written (hf_to_mf) with the MoEV2 names, as research/mixtral/convert_weight.py writes them, use_gmm too.
MIXTRAL_GMM = ((".feed_forward.router.dense.weight", ".feed_forward.router_dense.weight"),
               (".feed_forward.router.router.topk_bias", ".feed_forward.topk_bias"))
QWEN2_MOE_GMM = (
    (".feed_forward.routed_experts.router.dense.weight", ".feed_forward.routed_experts.router_dense.weight"),
    (".feed_forward.routed_experts.router.router.topk_bias", ".feed_forward.routed_experts.topk_bias"),
)
# MindFormers 2.1.0's PyNative DeepSeek-V4 (PyNativeDeepseekV4ForCausalLM: the names its GPTModel holds, checked
# against the model built on CPU: tests/fixtures/deepseek4/params.*.json) to transformers' DeepseekV4ForCausalLM.
# The HF side is transformers' own module names (save_pretrained writes DeepSeek's original names, and from_pretrained
# reads both); its stacked experts are written per expert as `experts.{e}.w1/w3/w2.weight`, which it reads too.
DEEPSEEK4 = (
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
# written as zeros (what the network holds after each step), in place of EXPERT_LOAD's expert_load.
DEEPSEEK4_FROZEN = {
    ".self_attention.q_rms_gamma": (".self_attention.kv_layernorm.weight", "ones", 0),
    ".attn_hc.rms_weight": (".attn_hc.mapping_proj.weight", "ones", 1),
    ".ffn_hc.rms_weight": (".ffn_hc.mapping_proj.weight", "ones", 1),
    ".mlp.tokens_per_expert": (".mlp.router.weight", "zeros", 0),  # the router's load counter (NOT_WEIGHTS), float32
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


def hf_module_name(name: str, family: str) -> str:
    """An HF checkpoint name as transformers' module holds it (DeepSeek-V4's saved names: DEEPSEEK4_SAVED); other
    families' names are their module names already."""
    from translators.families import registry

    found = registry.weights(family)
    if found is None or found.names is not DEEPSEEK4:
        return name
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
# mindformers/models/glm2/convert_weight.py + convert_reversed.py (1.7.0) and ChatGLM2ForConditionalGeneration's
# own names, to transformers' `glm` (THUDM/glm-4-9b-hf): the same weights, renamed; both fuse gate/up, gate first.
GLM = (
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
# One HF tensor that MindFormers keeps in two (research/deepseek3/convert_weight.py _mla_pt_to_ms): HF part, kind,
# MindFormers parts. The rope rows of q_b_proj and kv_a_proj_with_mqa are reordered from HF's interleaved pairs
# to halves (evens, then odds), as MindFormers' rotary embedding rotates halves.
# GLM with mlp_concat False: dense_left (gate) and dense_right (up) are the halves of gate_up_proj (mlp_split).
DEEPSEEK_SPLIT = {
    ".self_attn.q_b_proj.": ("q_b", (".attention.l2q_nope_proj.", ".attention.l2q_pe_proj.")),
    ".self_attn.kv_a_proj_with_mqa.": ("kv_a", (".attention.kv2l_latent_kv.", ".attention.kv2l_k_pe.")),
    ".self_attn.kv_b_proj.": ("kv_b", (".attention.lkv2kv_k_nope.", ".attention.lkv2kv_v.")),
}
GLM_SPLIT = {".mlp.gate_up_proj.": ("halves", (".mlp.dense_left.", ".mlp.dense_right."))}

# Fused MindFormers tensors: (name part, kind, HF name parts it holds, in order).
_QKV = (".self_attn.q_proj.", ".self_attn.k_proj.", ".self_attn.v_proj.")
FUSED = {
    "legacy": {".attention.w_qkv.": ("qkv", _QKV),
               ".feed_forward.w_gate_hidden.": ("gate_up", (".mlp.gate_proj.", ".mlp.up_proj."))},
    "mcore": {".self_attention.linear_qkv.": ("qkv", _QKV),
              ".mlp.linear_fc1.": ("gate_up", (".mlp.gate_proj.", ".mlp.up_proj."))},
    # glm2/convert_weight.py attn_split: query_key_value is q, k, v one after the other (np.split on axis 0)
    "glm": {".self_attention.query_key_value.": ("qkv_cat", _QKV)},
    "deepseek4": DEEPSEEK4_FUSED,
    # multi_latent_attention.py: linear_qkv = concat(linear_q_down_proj, linear_kv_down_proj), split back into
    # [q_lora_rank, kv_lora_rank, qk_rope_head_dim] rows
    "mcore_mla": {".self_attention.linear_qkv.": ("mla_qkv", (".self_attn.q_a_proj.",
                                                              ".self_attn.kv_a_proj_with_mqa.")),
                  ".mlp.linear_fc1.": ("gate_up", (".mlp.gate_proj.", ".mlp.up_proj.")),
                  ".mlp.shared_experts.linear_fc1.": ("gate_up", (".mlp.shared_experts.gate_proj.",
                                                                  ".mlp.shared_experts.up_proj."))},
}
# Stacked experts: (MindFormers name part, kind, HF per-expert name parts, `{e}` the expert).
MIXTRAL_EXPERTS = {
    ".feed_forward.ffn.w1.weight": ("stack", (".block_sparse_moe.experts.{e}.w1.weight",)),
    ".feed_forward.ffn.w2.weight": ("stack", (".block_sparse_moe.experts.{e}.w2.weight",)),
    ".feed_forward.ffn.w3.weight": ("stack", (".block_sparse_moe.experts.{e}.w3.weight",)),
}
QWEN2_MOE_EXPERTS = {
    ".feed_forward.routed_experts.ffn.w1.weight": ("stack", (".mlp.experts.{e}.gate_proj.weight",)),
    ".feed_forward.routed_experts.ffn.w2.weight": ("stack", (".mlp.experts.{e}.down_proj.weight",)),
    ".feed_forward.routed_experts.ffn.w3.weight": ("stack", (".mlp.experts.{e}.up_proj.weight",)),
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
MCORE_EXPERTS = {
    ".mlp.experts.weight1": ("weight1", (".mlp.experts.{e}.gate_proj.weight", ".mlp.experts.{e}.up_proj.weight")),
    ".mlp.experts.weight2": ("weight2", (".mlp.experts.{e}.down_proj.weight",)),
}
LEGACY_PREFIXES = ("model.", "lm_head.")
MCORE_PREFIXES = ("embedding.", "decoder.", "output_layer.")
GLM_PREFIXES = ("transformer.",)
# Not weights: inference KV caches a network saves beside its weights; the routers' per-step load counter
# `expert_load` (TopkRouterV2 `router.router.expert_load`, MoEV3 `expert_load`, mcore `router.expert_load`, with
# balance_via_topk_bias / moe_router_enable_expert_bias), which TopkBiasBalanceCallback (mcore: GPTModel.
# update_topk_bias) reads and sets back to 0 at every step end (callback.py, gpt_model.py 1.7.0), while mf-ds counts
# each step's load itself (LayerStats.bias_load_E); and mcore's gbs_aux_loss accumulator `router.fi_accu`, reset
# every step (wrapper.py _reset_accu_gbs_fi; mf-ds: MFMoE.reset_step). A checkpoint written after the step end holds
# zeros; one written before the callback ran (CheckpointMonitor listed first) holds the step's load, which
# MindFormers would add into the first bias update after a resume and mf-ds does not.
NOT_WEIGHTS = (".paged_attention_mgr.", ".expert_load", ".router.fi_accu", ".mlp.tokens_per_expert",
               "_dropout.seed", "_dropout.offset")  # mcore's dropout RNG state (Int64 scalars beside the weights)
# HF -> MindFormers: beside each router bias, its expert_load as zeros (what the network holds after every step).
EXPERT_LOAD = {".topk_bias": ".expert_load", ".expert_bias": ".expert_load"}


# model.model_config switches that say how a MindFormers checkpoint of the model lays out its fused weights, with
# MindFormers' defaults (LlamaConfig: qkv_concat False, which also fuses gate/up: llama_transformer.py passes
# ffn_concat=qkv_concat; TransformerConfig: use_contiguous_weight_layout_attention False,
# use_interleaved_weight_layout_mlp True, mla_qkv_concat True); moe_config.use_gmm: experts [E, in, out].
# qkv_concat / mlp_concat: None when the YAML does not say (the default is the family's: ChatGLM2Config True).
LAYOUT_KEYS = {"qkv_concat": None, "mlp_concat": None, "use_rearrange_rope": False,
               "use_contiguous_weight_layout_attention": False, "use_interleaved_weight_layout_mlp": True,
               "mla_qkv_concat": True}


def _flag(value, default: bool | None) -> bool | None:
    return default if value is None else value is True or str(value).lower() == "true"  # YAML may say "True"


def checkpoint_layout(tree: dict) -> dict[str, bool]:
    """The YAML's checkpoint layout switches (run.checkpoint_layout), MindFormers' defaults where absent."""
    model = tree.get("model") if isinstance(tree.get("model"), dict) else {}
    config = model.get("model_config") if isinstance(model.get("model_config"), dict) else {}
    moe = tree.get("moe_config") if isinstance(tree.get("moe_config"), dict) else {}
    out = {key: _flag(config.get(key), default) for key, default in LAYOUT_KEYS.items()}
    out["use_gmm"] = _flag(moe.get("use_gmm"), False) or _flag(config.get("moe_grouped_gemm"), False)
    return out


def table_key(family: str, layer_style: str | None = None) -> str:
    """The key of the family's tables: mcore models (use_legacy: False) name their weights differently."""
    return f"{family}/mcore" if layer_style == "mcore" else family


def weights(family: str):
    """The family's weight tables (its record's `weights`, translators/families/record.py); KeyError if it has none."""
    from translators.families import registry

    found = registry.weights(family)
    if found is None:
        raise KeyError(f"no MindFormers -> HF parameter name map for family {family!r} (have: "
                       f"{', '.join(registry.weight_families())})")
    return found


def name_map(family: str) -> tuple[tuple[str, str], ...]:
    return weights(family).names


def experts(family: str) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Stacked-experts parts of the family's checkpoints ({} for none, or for a family without name tables)."""
    from translators.families import registry

    found = registry.weights(family)
    return dict(found.experts) if found else {}


def splits(family: str) -> dict[str, tuple[str, tuple[str, ...]]]:
    """HF tensors the family's checkpoints keep in two ({} for none)."""
    from translators.families import registry

    found = registry.weights(family)
    return dict(found.split) if found else {}


def _bmm_names(family: str) -> tuple[tuple[str, str], ...]:
    from translators.families import registry

    found = registry.weights(family)
    return found.bmm_names if found else ()


def _gmm_names(family: str) -> tuple[tuple[str, str], ...]:
    from translators.families import registry

    found = registry.weights(family)
    return found.gmm_names if found else ()


def is_mcore(family: str) -> bool:
    return family.endswith("/mcore")


def style(family: str) -> str:
    """Which MindFormers model code names the family's weights: 'mcore', 'deepseek4' (the PyNative DeepSeek-V4),
    'glm' (ChatGLM2 classes) or 'legacy'."""
    from translators.families import registry

    found = registry.weights(family)
    if found is not None and found.names is DEEPSEEK4:
        return "deepseek4"
    if found is not None and found.names is MCORE_MLA:
        return "mcore_mla"
    return "mcore" if is_mcore(family) else "glm" if found is not None and found.names is GLM else "legacy"


def fused_parts(family: str) -> dict[str, tuple[str, tuple[str, ...]]]:
    return FUSED[style(family)]


def strip(name: str, family: str) -> str:
    """An mcore network holds GPTModel as `model`: its checkpoint names may carry that `model.` prefix."""
    if is_mcore(family) and name.startswith("model.") and name[6:].startswith((*MCORE_PREFIXES, "mtp.")):
        return name[6:]
    return name


def is_weight(name: str, family: str = "llama") -> bool:
    """True for a model parameter; False for optimizer state and counters saved beside it."""
    prefixes = {"mcore": MCORE_PREFIXES, "deepseek4": (*MCORE_PREFIXES, "mtp."), "mcore_mla": (*MCORE_PREFIXES, "mtp."),
                "glm": GLM_PREFIXES}.get(
        style(family), LEGACY_PREFIXES)
    return strip(name, family).startswith(prefixes) and not any(part in name for part in NOT_WEIGHTS)


def fused_kind(name: str, family: str = "llama") -> str | None:
    """'qkv', 'qkv_cat' or 'gate_up' for a fused MindFormers weight, else None."""
    return next((kind for part, (kind, _) in fused_parts(family).items() if part in name), None)


def expert_kind(name: str, family: str) -> tuple[str, str, tuple[str, ...]] | None:
    """(MindFormers part, kind, HF per-expert parts) for a stacked-experts weight, else None."""
    for part, (kind, hf_parts) in experts(family).items():
        if name.endswith(part):
            return part, kind, hf_parts
    return None


def split_kind(name: str, family: str) -> tuple[str, str, str, int] | None:
    """(MindFormers part, kind, HF part, which half) for a MindFormers tensor that is part of one HF tensor."""
    for hf, (kind, mf_parts) in splits(family).items():
        for i, part in enumerate(mf_parts):
            if part in name:
                return part, kind, hf, i
    return None


def mtp_layer(name: str, family: str, num_layers: int) -> bool:
    """A weight of DeepSeek's multi-token-prediction layers (research/deepseek3 mtp_name_replace: the fusers and
    norms, and layers num_layers and up), which transformers' DeepseekV3 does not build."""
    if family in ("deepseek_v4/mcore", "deepseek_v3/mcore"):  # GPTModel's `mtp.layers.N` (MultiTokenPrediction)
        return strip(name, family).startswith("mtp.")
    if family != "deepseek_v3":
        return False
    if name.startswith(("model.mtp_hidden_fusers.", "model.mtp_norms.")):
        return True
    parts = name.split(".")
    return len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) >= num_layers


# research/deepseek3/convert_weight.py mtp_name_replace (1.5.0 = 1.7.0): the MTP fuser and head norm of depth k,
# MindFormers <-> DeepSeek's HF layout at model.layers.{num_layers + k} (its decoder-layer part uses the table).
MTP_PARTS = (("norm_emb", "enorm"), ("norm", "hnorm"), ("dense", "eh_proj"))
_MF_MTP = re.compile(r"^model\.(?:mtp_hidden_fusers\.(\d+)\.(norm_emb|norm|dense)|mtp_norms\.(\d+))\.")
_HF_MTP = re.compile(r"^model\.layers\.(\d+)\.(enorm|hnorm|eh_proj|shared_head\.norm)\.")


def mtp_to_hf(name: str, num_layers: int) -> str:
    """A MindFormers MTP fuser / head-norm name in DeepSeek's HF layout; any other name unchanged."""
    m = _MF_MTP.match(name)
    if not m:
        return name
    if m.group(3) is not None:
        return f"model.layers.{num_layers + int(m.group(3))}.shared_head.norm." + name[m.end():]
    return f"model.layers.{num_layers + int(m.group(1))}.{dict(MTP_PARTS)[m.group(2)]}." + name[m.end():]


def mtp_to_mf(name: str, num_layers: int) -> str:
    """The MindFormers name of an HF MTP fuser / head-norm weight (model.layers.{num_layers + k}.enorm, ...)."""
    m = _HF_MTP.match(name)
    if not m or int(m.group(1)) < num_layers:
        return name
    k = int(m.group(1)) - num_layers
    if m.group(2) == "shared_head.norm":
        return f"model.mtp_norms.{k}." + name[m.end():]
    return f"model.mtp_hidden_fusers.{k}.{dict((h, mf) for mf, h in MTP_PARTS)[m.group(2)]}." + name[m.end():]


def mtp_shared_copy(name: str, num_layers: int) -> bool:
    """DeepSeek's HF checkpoints repeat the embedding and head in each MTP layer (model.layers.{n}.embed_tokens,
    .shared_head.head); MindFormers' converter drops them (_mtp_pt_to_ms), the model shares the main ones."""
    parts = name.split(".")
    return len(parts) > 3 and parts[:2] == ["model", "layers"] and parts[2].isdigit() \
        and int(parts[2]) >= num_layers and ".".join(parts[3:5]) in ("embed_tokens.weight", "shared_head.head")


def frozen(family: str) -> dict[str, tuple[str, str, int]]:
    """MindFormers parameters the HF model does not hold: {part: (the part written beside it, constant, axis of
    that tensor giving its length)} ({} for none)."""
    from translators.families import registry

    found = registry.weights(family)
    return dict(found.frozen) if found else {}


def mf_to_hf(name: str, family: str) -> str | None:
    """The HF name of MindFormers parameter `name` (of a fused or stacked one: its stem, before the split); None
    when it is not a model weight."""
    if not is_weight(name, family):
        return None
    name = strip(name, family)
    if style(family) == "mcore_mla":
        for apart, concat in MCORE_MLA_CONCAT:
            name = name.replace(concat, apart)
    for gmm, bmm in _bmm_names(family):
        name = name.replace(bmm, gmm)
    for moev2, moev3 in _gmm_names(family):
        name = name.replace(moev3, moev2)
    for mf, hf in name_map(family):
        name = name.replace(mf, hf)
    return name


def hf_to_mf(name: str, family: str, gmm: bool = True, mla_concat: bool = False) -> str:
    """The MindFormers name of HF parameter `name` (the table backwards); `gmm`: the router's use_gmm names;
    `mla_concat`: an mcore MLA model's mla_qkv_concat names."""
    for mf, hf in reversed(name_map(family)):
        name = name.replace(hf, mf)
    if mla_concat and style(family) == "mcore_mla":
        for apart, concat in MCORE_MLA_CONCAT:
            name = name.replace(apart, concat)
    for gmm_name, bmm_name in () if gmm else _bmm_names(family):
        name = name.replace(gmm_name, bmm_name)
    return name
