"""MindFormers parameter names <-> Hugging Face names: the shared machinery (mf_ds/weights.py applies it).

The tables are per MindFormers model code (LlamaForCausalLM, DeepSeek-V3, ChatGLM2, mcore GPTModel, the PyNative
DeepSeek-V4) and live in the family's module (translators/families/llama.py LLAMA_NAMES, deepseek.py, glm.py,
mcore.py, deepseek4.py); each family's record (translators/families/record.py, `weights`) holds them, and the
functions below find them through the registry (`family` is the record's weights_key: `qwen3/mcore` for an mcore
model). Here: the schema-wide fused layouts and name prefixes, what is not a weight, the checkpoint layout switches
and DeepSeek's MTP names.

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

# Fused MindFormers tensors: (name part, kind, HF name parts it holds, in order).
QKV = (".self_attn.q_proj.", ".self_attn.k_proj.", ".self_attn.v_proj.")
FUSED = {
    "legacy": {".attention.w_qkv.": ("qkv", QKV),
               ".feed_forward.w_gate_hidden.": ("gate_up", (".mlp.gate_proj.", ".mlp.up_proj."))},
    "mcore": {".self_attention.linear_qkv.": ("qkv", QKV),
              ".mlp.linear_fc1.": ("gate_up", (".mlp.gate_proj.", ".mlp.up_proj."))},
}
LEGACY_PREFIXES = ("model.", "lm_head.")
MCORE_PREFIXES = ("embedding.", "decoder.", "output_layer.")
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


def _concat_names(family: str) -> tuple[tuple[str, str], ...]:
    from translators.families import registry

    found = registry.weights(family)
    return found.concat_names if found else ()


def hf_module_name(name: str, family: str) -> str:
    """An HF checkpoint name as transformers' module holds it (the record's Weights.saved_names: DeepSeek-V4's saved
    names); other families' names are their module names already."""
    from translators.families import registry

    found = registry.weights(family)
    return found.saved_names(name) if found is not None and found.saved_names is not None else name


def is_mcore(family: str) -> bool:
    return family.endswith("/mcore")


def style(family: str) -> str:
    """Which MindFormers model code names the family's weights: 'mcore', 'deepseek4' (the PyNative DeepSeek-V4),
    'glm' (ChatGLM2 classes) or 'legacy'."""
    from translators.families import registry

    found = registry.weights(family)
    if found is not None and found.style:
        return found.style
    return "mcore" if is_mcore(family) else "legacy"


def fused_parts(family: str) -> dict[str, tuple[str, tuple[str, ...]]]:
    from translators.families import registry

    found = registry.weights(family)
    return found.fused if found is not None and found.fused is not None else FUSED[style(family)]


def strip(name: str, family: str) -> str:
    """An mcore network holds GPTModel as `model`: its checkpoint names may carry that `model.` prefix."""
    if is_mcore(family) and name.startswith("model.") and name[6:].startswith((*MCORE_PREFIXES, "mtp.")):
        return name[6:]
    return name


def is_weight(name: str, family: str = "llama") -> bool:
    """True for a model parameter; False for optimizer state and counters saved beside it."""
    from translators.families import registry

    found = registry.weights(family)
    prefixes = found.prefixes if found is not None and found.prefixes else \
        MCORE_PREFIXES if style(family) == "mcore" else LEGACY_PREFIXES
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
    from translators.families import registry

    found = registry.weights(family)
    kind = found.mtp if found is not None else ""
    if kind == "gpt":  # GPTModel's `mtp.layers.N` (MultiTokenPrediction)
        return strip(name, family).startswith("mtp.")
    if kind != "research":
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
    for apart, concat in _concat_names(family):
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
    if mla_concat:
        for apart, concat in _concat_names(family):
            name = name.replace(apart, concat)
    for gmm_name, bmm_name in () if gmm else _bmm_names(family):
        name = name.replace(gmm_name, bmm_name)
    return name
