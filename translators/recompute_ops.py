"""MindFormers op patterns -> the HF modules of one decoder layer, one table per layer style (the family record's
`layer_style`, translators/families/record.py), and the per-layer recompute plan the runtime applies.

A pattern (`feed_forward\\.w1\\.activation\\.silu`) is matched the way MindFormers' `LayerSetting.set_pattern_recompute`
matches it: split on the two characters `\\.`, and fullmatch each component against the path component. The layer
sets each pattern applies to come from translators/recompute.py (MindFormers' LayerSetting normalisation).
"""

from __future__ import annotations

import functools
import re
from typing import NamedTuple

from translators.recompute import RecomputeResult

# ---------------------------------------------------------------------------------------------------------------
# MindFormers op paths -> HF module paths of one decoder layer.
#
# `cells` are nn.Cell children: select recompute recomputes the whole cell; comm recompute and the excludes ignore
# them ("is expected to be operation but got cell, this configuration will not be effective"). `prims` are
# primitives, which all three act on. `mlp.mul` and `mlp.shared_experts.mul` name the SwiGLU product
# act_fn(gate) * up, which HF computes inline and the runtime recomputes as an op.

class _Table(NamedTuple):
    cells: dict[str, tuple[str, ...]]
    prims: dict[str, tuple[str, ...]]
    hf: tuple[str, ...]  # every HF path of the layer a pattern may name directly


def _merge(*parts: tuple[dict, dict]) -> tuple[dict, dict]:
    cells, prims = {}, {}
    for c, p in parts:
        cells.update(c)
        prims.update(p)
    return cells, prims


def _norm(mf: str, *hf: str) -> tuple[dict, dict]:
    """LlamaRMSNorm: the fused `norm` op, or the input `cast` (the whole HF norm holds both)."""
    return {mf: hf}, {f"{mf}.norm": hf, f"{mf}.cast": hf}


def _linears(mf: str, names: dict[str, tuple[str, ...]]) -> tuple[dict, dict]:
    """MindFormers Linear cells (each with its `matmul` primitive) under `mf`."""
    return ({f"{mf}.{n}": hf for n, hf in names.items()},
            {f"{mf}.{n}.matmul": hf for n, hf in names.items()})


def _feed_forward(mf: str, hf: str) -> tuple[dict, dict]:
    """LlamaFeedForward: w1 (carrying the SiLU: `activation=hidden_act`), w3, w2, mul; or w_gate_hidden + activate
    under ffn_concat; or the fused swiglu primitive."""
    gate, up, down, act, mul = (f"{hf}.{n}" for n in ("gate_proj", "up_proj", "down_proj", "act_fn", "mul"))
    return _merge(
        ({mf: (hf,), f"{mf}.w1": (gate, act), f"{mf}.w1.activation": (act,), f"{mf}.activate": (act,)},
         {f"{mf}.w1.matmul": (gate,), f"{mf}.w1.activation.silu": (act,), f"{mf}.activate.silu": (act,),
          f"{mf}.mul": (mul,), f"{mf}.swiglu": (act, mul)}),
        _linears(mf, {"w3": (up,), "w2": (down,), "w_gate_hidden": (gate, up)}),
    )


def _moe(shared_hf: str) -> tuple[dict, dict]:
    """MoEV2 as the feed_forward (router + ffn) or LlamaFeedForwardWithMoE (routed_experts + shared_experts)."""
    gate, experts = "mlp.gate", "mlp.experts"
    return _merge(
        ({"feed_forward.router": (gate,), "feed_forward.router.dense": (gate,), "feed_forward.ffn": (experts,),
          "feed_forward.routed_experts": (gate, experts), "feed_forward.routed_experts.router": (gate,),
          "feed_forward.routed_experts.router.dense": (gate,), "feed_forward.routed_experts.ffn": (experts,)}, {}),
        _feed_forward("feed_forward.shared_experts", shared_hf),
    )


def _mlp_hf(prefix: str) -> tuple[str, ...]:
    return (prefix,) + tuple(f"{prefix}.{n}" for n in ("gate_proj", "up_proj", "down_proj", "act_fn", "mul"))


def _mcore_mlp(mf: str, hf: str) -> tuple[dict, dict]:
    """mcore MLP / SharedExpertMLP: linear_fc1 (gate and up fused), activation_func, mul, linear_fc2."""
    return _merge(
        ({mf: (hf,), f"{mf}.activation_func": (f"{hf}.act_fn",)},
         {f"{mf}.activation_func.silu": (f"{hf}.act_fn",), f"{mf}.mul": (f"{hf}.mul",)}),
        _linears(mf, {"linear_fc1": (f"{hf}.gate_proj", f"{hf}.up_proj"), "linear_fc2": (f"{hf}.down_proj",)}),
    )


_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_NORMS_HF = ("input_layernorm", "post_attention_layernorm")
_QKVO_HF = ("self_attn",) + _QKV + ("self_attn.o_proj",)
_ATTN_HF = _QKVO_HF + ("self_attn.q_norm", "self_attn.k_norm")
_MLA_HF = ("self_attn", "self_attn.q_a_proj", "self_attn.q_a_layernorm", "self_attn.q_b_proj", "self_attn.q_proj",
           "self_attn.kv_a_proj_with_mqa", "self_attn.kv_a_layernorm", "self_attn.kv_b_proj", "self_attn.o_proj")
_MOE_HF = ("mlp.gate", "mlp.experts")

_TABLES: dict[str, _Table] = {
    # Llama/Qwen/Mixtral/Qwen2-MoE legacy models (llama_transformer.py, llama_layer.py) -> HF Llama family
    "llama": _Table(*_merge(
        _norm("attention_norm", "input_layernorm"), _norm("ffn_norm", "post_attention_layernorm"),
        ({"attention": ("self_attn",)}, {}),
        _linears("attention", {"wq": _QKV[:1], "wk": _QKV[1:2], "wv": _QKV[2:], "wo": ("self_attn.o_proj",),
                               "w_qkv": _QKV}),
        _feed_forward("feed_forward", "mlp"), _moe("mlp.shared_expert"),
        _linears("feed_forward", {"shared_experts_gate": ("mlp.shared_expert_gate",)}),
    ), _NORMS_HF + _ATTN_HF + _mlp_hf("mlp") + _MOE_HF + _mlp_hf("mlp.shared_expert") + ("mlp.shared_expert_gate",)),
    # research/deepseek3/deepseek2_model.py (DeepSeekV2Attention; both the fused and the split q/kv names)
    "deepseek": _Table(*_merge(
        _norm("attention_norm", "input_layernorm"), _norm("ffn_norm", "post_attention_layernorm"),
        _norm("attention.lq_norm", "self_attn.q_a_layernorm"), _norm("attention.lkv_norm", "self_attn.kv_a_layernorm"),
        ({"attention": ("self_attn",)}, {}),
        _linears("attention", {
            "q2l_proj": ("self_attn.q_a_proj",), "q_proj": ("self_attn.q_proj",), "wo": ("self_attn.o_proj",),
            **dict.fromkeys(("l2q_proj", "l2q_nope_proj", "l2q_pe_proj"), ("self_attn.q_b_proj",)),
            **dict.fromkeys(("kv2l", "kv2l_k_pe", "kv2l_latent_kv"), ("self_attn.kv_a_proj_with_mqa",)),
            **dict.fromkeys(("lkv2kv", "lkv2kv_k_nope", "lkv2kv_v"), ("self_attn.kv_b_proj",))}),
        _feed_forward("feed_forward", "mlp"), _moe("mlp.shared_experts"),
    ), _NORMS_HF + _MLA_HF + _mlp_hf("mlp") + _MOE_HF + _mlp_hf("mlp.shared_experts")),
    # ChatGLM2Block (glm2_transformer.py: GLM2/3/4) -> HF Glm / Glm4, whose MLP fuses gate and up
    "glm": _Table(*_merge(
        _norm("input_layernorm", "input_layernorm"), _norm("post_attention_layernorm", "post_attention_layernorm"),
        ({"self_attention": ("self_attn",), "mlp": ("mlp",), "mlp.activation_func": ("mlp.activation_fn", "mlp.mul"),
          "mlp.activation_func.silu": ("mlp.activation_fn",)},
         {"mlp.activation_func.silu.silu": ("mlp.activation_fn",), "mlp.activation_func.mul": ("mlp.mul",)}),
        _linears("self_attention", {"query_key_value": _QKV, "dense": ("self_attn.o_proj",)}),
        _linears("mlp", {"dense_h_to_4h": ("mlp.gate_up_proj",), "dense_4h_to_h": ("mlp.down_proj",)}),
    ), _NORMS_HF + ("post_self_attn_layernorm", "post_mlp_layernorm") + _QKVO_HF
       + ("mlp", "mlp.gate_up_proj", "mlp.down_proj", "mlp.activation_fn", "mlp.mul")),
    # MindFormers mcore models (parallel_core, Megatron names) -> HF Llama/Qwen3(-MoE) or DeepSeek names; a model
    # has one attention kind, so the runtime finds one of q_layernorm's two targets
    "mcore": _Table(*_merge(
        _norm("input_layernorm", "input_layernorm"), _norm("pre_mlp_layernorm", "post_attention_layernorm"),
        _norm("self_attention.q_layernorm", "self_attn.q_norm", "self_attn.q_a_layernorm"),
        _norm("self_attention.k_layernorm", "self_attn.k_norm"),
        _norm("self_attention.kv_layernorm", "self_attn.kv_a_layernorm"),
        ({"self_attention": ("self_attn",), "mlp.router": ("mlp.gate",), "mlp.experts": ("mlp.experts",)}, {}),
        _linears("self_attention", {
            "linear_qkv": _QKV, "linear_proj": ("self_attn.o_proj",), "linear_q_proj": ("self_attn.q_proj",),
            "linear_q_down_proj": ("self_attn.q_a_proj",), "linear_q_up_proj": ("self_attn.q_b_proj",),
            "linear_kv_down_proj": ("self_attn.kv_a_proj_with_mqa",), "linear_kv_up_proj": ("self_attn.kv_b_proj",)}),
        _mcore_mlp("mlp", "mlp"), _mcore_mlp("mlp.shared_experts", "mlp.shared_experts"),
    ), tuple(dict.fromkeys(_NORMS_HF + _ATTN_HF + _MLA_HF + _mlp_hf("mlp") + _MOE_HF
                           + _mlp_hf("mlp.shared_experts")))),
    # GPT-2 in MindFormers honours only the full-recompute bool (§1), so there are no op names to translate
    "gpt2": _Table({}, {}, ("ln_1", "attn", "attn.c_attn", "attn.c_proj", "ln_2", "mlp", "mlp.c_fc", "mlp.act",
                            "mlp.c_proj")),
}
STYLES = tuple(_TABLES)

_NO_MODULE = ("flash_attention", "apply_rotary_emb", "core_attention", "softmax", "batch_matmul", "batch_matmul_q_k")
_NO_MODULE_NOTE = "runs inside HF self_attn's forward with no module of its own; nothing to recompute on its own"
RESHAPE_NOTE = "a reshape saves no activation; nothing to recompute"


def _fullmatch(parts: list[str], path: str) -> bool:
    names = path.split(".")
    return len(names) == len(parts) and all(re.fullmatch(p, n) for p, n in zip(parts, names, strict=True))


@functools.cache
def _resolve(pattern: str, style: str, *, prims_only: bool) -> tuple[tuple[str, ...], str | None]:
    if style not in _TABLES:
        raise ValueError(f"unknown recompute style {style!r}; expected one of {', '.join(STYLES)}")
    table = _TABLES[style]
    parts = pattern.split(r"\.")
    sources = (table.prims,) if prims_only else (table.cells, table.prims)
    targets = {hf for src in sources for mf, hfs in src.items() if _fullmatch(parts, mf) for hf in hfs}
    targets |= {hf for hf in table.hf if hf == pattern or _fullmatch(parts, hf)}
    if targets:
        return tuple(sorted(targets)), None
    if re.fullmatch(parts[-1], "reshape"):
        return (), RESHAPE_NOTE
    if prims_only and any(_fullmatch(parts, mf) for mf in table.cells):
        return (), (f"'{pattern}' names a cell; MindFormers applies comm recompute and excludes to primitives only "
                    "(\"this configuration will not be effective\")")
    if any(re.fullmatch(parts[-1], name) for name in _NO_MODULE):
        return (), f"'{pattern}' {_NO_MODULE_NOTE}"
    return (), f"'{pattern}' matches no MindFormers op or HF module of a {style} decoder layer; nothing recomputed"


def hf_targets(pattern: str, style: str) -> tuple[list[str], str | None]:
    """HF module paths (within one decoder layer) that a select pattern denotes, and a note when there are none."""
    paths, note = _resolve(pattern, style, prims_only=False)
    return list(paths), note


def layer_plan(result: RecomputeResult, num_layers: int, style: str, *,
               first_mtp_layer: int | None = None) -> tuple[list[dict], list[tuple[str, str]]]:
    """One entry per global layer for the runtime, and (pattern, note) for each pattern in use that maps to nothing.

    `full_recompute_exclude` lists the ops an exclude keeps out of a fully recomputed layer (MindFormers switches
    their primitives back off inside the recomputed cell).
    """
    unmapped: dict[str, str] = {}

    def targets(patterns: dict[str, frozenset[int]], layer: int, *, prims_only: bool) -> set[str]:
        found = set()
        for pattern, layers in patterns.items():
            if layer in layers:
                paths, note = _resolve(pattern, style, prims_only=prims_only)
                found.update(paths)
                if note:
                    unmapped.setdefault(pattern, note)
        return found

    plan = []
    for i in range(num_layers):
        excluded = targets(result.select_exclude, i, prims_only=True)
        full = i in result.full
        plan.append({
            "index": i,
            "full_recompute": full,
            "select_recompute": sorted(targets(result.select, i, prims_only=False) - excluded),
            "comm_recompute": sorted(targets(result.comm, i, prims_only=True)
                                     - targets(result.comm_exclude, i, prims_only=True)),
            "full_recompute_exclude": sorted(excluded) if full else [],
            "mtp": first_mtp_layer is not None and i >= first_mtp_layer,
        })
    return plan, list(unmapped.items())


def module_targets(pattern: str, style: str) -> tuple[tuple[str, ...], str | None]:
    """HF module paths (within one decoder layer) that a PyNative `recompute.select_module` key denotes: a regular
    expression fullmatched against each dotted module path of the layer, as MindFormers 2.x's activation_checkpoint.py
    `_expand_select_module` matches it (`self_attention`, `mlp\\..*`); this style's MindFormers names and the HF names
    both count. A path whose parent is also named is left to the parent, as `_add_modules_dedup` leaves it."""
    table = _TABLES[style]
    try:
        regex = re.compile(pattern)
    except re.error as exc:
        return (), f"'{pattern}' is not a regular expression ({exc}); nothing recomputed"
    targets = {hf for src in (table.cells, table.prims) for mf, hfs in src.items() if regex.fullmatch(mf)
               for hf in hfs}
    targets |= {hf for hf in table.hf if regex.fullmatch(hf)}
    kept = tuple(sorted(p for p in targets if not any(p.startswith(q + ".") for q in targets)))
    if kept:
        return kept, None
    return (), f"'{pattern}' matches no module of a {style} decoder layer; nothing recomputed"
