"""LlamaConfig (LC): Llama 2/3, Qwen1.5/2/2.5, DeepSeek-LLM/Coder, Mixtral, Qwen2-MoE, Baichuan2, Telechat; and
MindFormers' MoEConfig defaults."""

from __future__ import annotations

from translators import memory
from translators.families import parts
from translators.families.base import _CONFIG_CLASSES
from translators.families.derive import _ffn, _kv_heads, _llama_positions, _qwen2_moe_widths, _rope
from translators.families.parts import MODELS
from translators.families.record import FamilyRecord, PatchTargets, Weights
from translators.families.rules import (
    _GENERATION_KEYS,
    _SHAPE_KEYS,
    ASCEND,
    ATTENTION,
    CHECKPOINT,
    DROP,
    FFN_GIVEN,
    FLASH,
    FP32_MASTER,
    GENERATION,
    IGNORE_100,
    INERT,
    INFERENCE,
    LAYOUT,
    LOW_MASTER,
    NO_CACHE,
    NO_EXTEND,
    NORM_FP32,
    PAGED,
    PARALLEL_OPT,
    PREDICT_BATCH,
    REGISTER,
    ROTARY_FP32,
    SOFTMAX,
    Differs,
    Expect,
    Feeds,
    Ident,
    Map,
    Rule,
    Shape,
    _each,
)
from translators.families.spec import SILU, _Spec

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
    "use_attn_mask_compression": ATTENTION,
    "use_eod_attn_mask_compression": ATTENTION,
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

# --- the weight names (translators/names.py applies them) -------------------------------------------------------------
# (MindFormers substring, HF substring), applied in order, as MindFormers' name_replace does.
LLAMA_NAMES = (
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
MIXTRAL_NAMES = LLAMA_NAMES + (
    (".feed_forward.router.dense.", ".block_sparse_moe.gate."),
    (".feed_forward.router.router.topk_bias", ".block_sparse_moe.gate.e_score_correction_bias"),
)
# research/qwen2/convert_moe_weight.py (1.6.0; the folder left MindFormers in 1.7.0) name_replace.
QWEN2_MOE_NAMES = LLAMA_NAMES + (
    (".feed_forward.routed_experts.router.dense.", ".mlp.gate."),
    (".feed_forward.routed_experts.router.router.topk_bias", ".mlp.gate.e_score_correction_bias"),
    (".feed_forward.shared_experts.w1.", ".mlp.shared_expert.gate_proj."),
    (".feed_forward.shared_experts.w2.", ".mlp.shared_expert.down_proj."),
    (".feed_forward.shared_experts.w3.", ".mlp.shared_expert.up_proj."),
    (".feed_forward.shared_experts_gate.", ".mlp.shared_expert_gate."),
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

# --- the family records (translators/families/record.py) ------------------------------------------------------------
_LLAMA_WEIGHTS = Weights(LLAMA_NAMES)  # Qwen2 runs on LlamaForCausalLM too: the same names
LLAMA_TARGETS = PatchTargets(f"{MODELS}.llama.modeling_llama", rope="split_half", hooks="llama", mlps=("LlamaMLP",))
RECORDS = (
    FamilyRecord("llama", "llama", "llama", False, weights=_LLAMA_WEIGHTS, tp="hf_tp_plan", runtime=LLAMA_TARGETS),
    FamilyRecord("qwen2", "qwen2", "llama", False, weights=_LLAMA_WEIGHTS, tp="hf_tp_plan",
                 runtime=PatchTargets(f"{MODELS}.qwen2.modeling_qwen2", rope="split_half", hooks="llama",
                                      mlps=("Qwen2MLP",))),
    FamilyRecord("mixtral", "mixtral", "llama", False,
                 weights=Weights(MIXTRAL_NAMES, experts=MIXTRAL_EXPERTS, gmm_names=MIXTRAL_GMM),
                 tp=parts.ATTENTION,
                 # router_jitter_noise is not applied: MindFormers has none
                 runtime=PatchTargets(f"{MODELS}.mixtral.modeling_mixtral", rope="split_half", hooks="llama",
                                      experts="MixtralExperts", moe_block="MixtralSparseMoeBlock")),
    FamilyRecord("qwen2_moe", "qwen2_moe", "llama", False,
                 weights=Weights(QWEN2_MOE_NAMES, experts=QWEN2_MOE_EXPERTS, gmm_names=QWEN2_MOE_GMM),
                 tp=parts.ATTENTION + parts.MLP,
                 # the shared expert, scaled by sigmoid(shared_expert_gate(x)) under use_shared_expert_gating
                 runtime=PatchTargets(f"{MODELS}.qwen2_moe.modeling_qwen2_moe", rope="split_half", hooks="llama",
                                      mlps=("Qwen2MoeMLP",), experts="Qwen2MoeExperts",
                                      moe_block="Qwen2MoeSparseMoeBlock", shared="shared_expert",
                                      shared_gate="shared_expert_gate")),
    FamilyRecord("telechat", None, "llama", False,  # Telechat names its ops as Llama does
                 reason="Telechat has no transformers architecture (it ships as trust_remote_code)"),
    FamilyRecord("baichuan2", None, "llama", False,
                 reason="Baichuan2 has no transformers architecture (trust_remote_code: NormHead, and ALiBi in the "
                        "13B)"),
)


def specs() -> dict[tuple[str, bool], _Spec]:
    """LlamaConfig's families: the table, the class's defaults, the derivations (translators/families/spec.py)."""
    derive = (_kv_heads, _ffn, _llama_positions, _rope)
    return {
        ("llama", False): _Spec("LlamaConfig", LLAMA, LLAMA_DEFAULTS, derive, fixed=SILU),
        ("qwen2", False): _Spec("LlamaConfig", QWEN2, LLAMA_DEFAULTS, derive, fixed=SILU),
        ("mixtral", False): _Spec("LlamaConfig", MIXTRAL, LLAMA_DEFAULTS, derive, fixed=SILU,
                                  moe_rules={"expert_num": "num_local_experts",
                                             "num_experts_chosen": "num_experts_per_tok"}),
        ("qwen2_moe", False): _Spec("LlamaConfig", QWEN2_MOE, LLAMA_DEFAULTS, (*derive, _qwen2_moe_widths),
                                    fixed=SILU,
                                    moe_rules={"expert_num": "num_experts", "num_experts_chosen": "num_experts_per_tok",
                                               "norm_topk_prob": "norm_topk_prob", "shared_expert_num": Feeds()}),
        ("baichuan2", False): _Spec("LlamaConfig", LLAMA, LLAMA_DEFAULTS),
        ("telechat", False): _Spec("TelechatConfig", LLAMA, LLAMA_DEFAULTS),
    }


# --- memory hooks (translators/memory.py: this family's parameter and activation counts) ------------------------------

def memory_attention(hf: dict, h: int, a: int, k: int, d: int) -> list:
    """Qwen2's and Qwen2-MoE's q/k/v always carry a bias, o_proj none; Llama's all four follow attention_bias."""
    mt = hf["model_type"]
    qkv_bias = True if mt in ("qwen2", "qwen2_moe") else bool(hf.get("attention_bias"))
    o_bias = bool(hf.get("attention_bias")) if mt == "llama" else False
    return memory.dense_attention(h, a, k, d, qkv_bias, o_bias)


def memory_moe_layers(hf: dict) -> list[int]:
    mt, L = hf["model_type"], hf.get("num_hidden_layers")
    if mt == "mixtral":
        return list(range(L))
    if mt == "qwen2_moe":
        return memory.sparse_step_layers(hf)
    return []


def memory_routed_width(hf: dict) -> int:
    return hf["intermediate_size"] if hf["model_type"] == "mixtral" else hf["moe_intermediate_size"]


def memory_shared_experts(hf: dict, h: int, width: int) -> list:
    """Qwen2-MoE's shared expert and its sigmoid gate."""
    if hf["model_type"] != "qwen2_moe":
        return []
    return [*memory._mlp(hf, h, hf["shared_expert_intermediate_size"], "shared_expert"),
            memory.Weights("shared_expert_gate", h, 1, "whole")]
