"""Per-family model tables: MindFormers `model.model_config` (+ `model.arch`) -> a Hugging Face config dict.

`detect_family` names the architecture a YAML describes; `hf_config` turns its `model_config` into the keyword
arguments of `transformers.AutoConfig.for_model(**d)`; `model_shape` extracts what the rest of the translator needs
(layer count, dtypes, pipeline layout, fused-kernel switches) for every family, with or without an HF architecture.

One table per MindFormers config class (LlamaConfig, DeepseekV2/V3Config, ChatGLM2Config, GPT2Config, the mcore
`use_legacy: False` configs) says, key by key, what each `model_config` key becomes:
  "hf_name" / Map   an HF config key (the value typed by `_TYPES`, the key's MindFormers type)
  Feeds             an input of a derived HF value (intermediate_size from multiple_of, rope_parameters from
                    theta/extend_method/scaling_factor, ...); noted with what it fed, or why it went unused
  Expect            a value the HF architecture hard-codes: fine when the YAML agrees, a `differs` note when not
  Differs           carried (or not) with behaviour that differs from MindFormers (a warning)
  Drop              understood and not carried: inference-only, Ascend performance, weight layout, generation,
                    inert leftovers
  Shape             read by `model_shape` into the Plan (pipeline layout, fused kernels, losses), noted there
  Runtime           read by the mf_ds runtime from the YAML section as it is (mcore MoE router settings)
  Ident             names the family (config class, arch class, model_type)
A key in no table gets an `unknown` note: MindFormers' legacy configs keep unknown keys (PretrainedConfig **kwargs)
and never read them. `hf_config` and `model_shape` together account for every key under `model.model_config` and
`model.arch`; of the top-level `moe_config` only the keys that feed the HF config are accounted here. mcore YAMLs keep
their MoE settings in model_config: translators/moe.py MCORE_MOE gives the legacy moe_config name of each.

Sources (keys.md): LC = mindformers/models/llama/llama_config.py r1.5.0, DS3 = research/deepseek3/deepseek3_config.py,
DS2 = research/deepseek2/deepseek2_config.py, GLM = mindformers/models/glm2/glm2_config.py, GPT2 =
mindformers/models/gpt2/gpt2_config.py, MAP = COMMON_CONFIG_MAPPING in parallel_core/transformer_config_utils.py
(master), MoE = MoEConfig in mindformers/modules/transformer/moe.py r1.5.0 (moe.md §1).

The package holds one module per family group (llama, deepseek, glm, gpt2, mcore, telechat3, glm4_moe, deepseek4:
each its records, config specs, weight-name tables and hooks, registry.MODULES), the rule classes and value types
they share (rules), the spec type (spec), the names that tell legacy families apart (base), the derived HF values
(derive), and the engine that applies a spec (engine); this module detects the family and is the public API.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from translators import mtp
from translators.errors import ConfigError, join, show
from translators.families import registry
from translators.families.base import (
    _ARCH_FAMILY,
    _CONFIG_CLASSES,
    _CONFIG_FAMILY,
    _GLM_LIKE,
    _LLAMA_LIKE,
    ARCH,
    MODEL_CONFIG,
    MOE_CONFIG,
    NO_MODEL,
    ModelShape,
)
from translators.families.engine import (
    _SPECS,
    ARCH_SPEC,
    _account,
    _check_heads,
    _Ctx,
    _derive,
    _load,
    _model_section,
    _seed,
    _Spec,
    _Values,
)
from translators.families.record import FamilyRecord
from translators.families.registry import mcore_architectures, mcore_model_types, record
from translators.families.rules import _TYPES
from translators.mf_defaults import NEWEST, class_defaults
from translators.moe import MCORE_MOE
from translators.notes import Ledger

# ---------------------------------------------------------------------------------------------------------------
# Which family: model.arch.type, then model_config.type, then trainer.model_name (legacy); model_type,
# architectures, then telltale keys (mcore). LlamaConfig and ChatGLM2Config host several architectures, told
# apart by their keys.

_NAME_FAMILY = (("deepseekv3", "deepseek_v3"), ("deepseek3", "deepseek_v3"), ("deepseekv2", "deepseek_v2"),
                ("deepseek2", "deepseek_v2"), ("deepseek", _LLAMA_LIKE), ("llama", _LLAMA_LIKE),
                ("qwen", _LLAMA_LIKE), ("mixtral", _LLAMA_LIKE), ("yizhao", "yizhao"), ("glm", _GLM_LIKE),
                ("gpt2", "gpt2"), ("telechat", "telechat"), ("baichuan", "baichuan2"))


def _experts(moe: dict) -> int:
    return _TYPES["expert_num"](moe.get("expert_num", 1), join(MOE_CONFIG, "expert_num"))


def _shared(moe: dict) -> int:
    return _TYPES["shared_expert_num"](moe.get("shared_expert_num", 0), join(MOE_CONFIG, "shared_expert_num"))


_VARIANTS: dict[str, tuple[tuple[str, Callable[[dict, dict, str], bool]], ...]] = {
    # first match wins: (family, test(model_config, moe_config, trainer.model_name))
    _LLAMA_LIKE: (("qwen2_moe", lambda c, moe, name: _experts(moe) > 1 and _shared(moe) > 0),
                  ("mixtral", lambda c, moe, name: _experts(moe) > 1),
                  ("qwen2", lambda c, moe, name: c.get("qkv_has_bias") is True),
                  ("llama", lambda c, moe, name: True)),
    _GLM_LIKE: (("glm4", lambda c, moe, name: c.get("padded_vocab_size") == 151552 or name.startswith("glm4")),
                ("chatglm", lambda c, moe, name: True)),
    "mcore": (("deepseek_v3", lambda c, moe, name: name.startswith("deepseek") or any(
                   k in c for k in ("n_routed_experts", "kv_lora_rank", "q_lora_rank", "multi_latent_attention"))),
              ("qwen3_moe", lambda c, moe, name: any(k in c for k in ("num_experts", "num_moe_experts"))),
              ("qwen3", lambda c, moe, name: name.startswith("qwen3"))),
}


def _spec(family: FamilyRecord) -> _Spec:
    return _SPECS[(family.name, family.mcore)]


def _model_name(tree: dict) -> str:
    """trainer.model_name, lower case without '_' and '-' ('deepseekV3' -> 'deepseekv3', 'qwen2_05b' -> 'qwen205b')."""
    trainer = tree.get("trainer")
    name = trainer.get("model_name") if isinstance(trainer, dict) else None
    return re.sub(r"[_\-]", "", name.lower()) if isinstance(name, str) else ""


def _variant(kind: str, config: dict, tree: dict) -> str | None:
    moe = tree.get(MOE_CONFIG) if isinstance(tree.get(MOE_CONFIG), dict) else {}
    return next((name for name, test in _VARIANTS[kind] if test(config, moe, _model_name(tree))), None)


def _lookup(table: dict, value: Any) -> str | None:
    return table.get(value) if isinstance(value, str) else None


def _detect_legacy(tree: dict, config: dict) -> FamilyRecord:
    arch = tree["model"].get("arch") or {}
    name = _model_name(tree)
    kind = (_lookup(_ARCH_FAMILY, arch.get("type")) or _lookup(_CONFIG_FAMILY, config.get("type"))
            or next((family for prefix, family in _NAME_FAMILY if name.startswith(prefix)), None))
    if kind is None:
        raise ConfigError("model", f"cannot tell the model family: model.arch.type {show(arch.get('type'))}, "
                                   f"model.model_config.type {show(config.get('type'))} and trainer.model_name "
                                   f"{show((tree.get('trainer') or {}).get('model_name'))} are none this "
                                   "translator knows",
                          f"known config classes: {', '.join(_CONFIG_CLASSES)}")
    return record(_variant(kind, config, tree) if kind in _VARIANTS else kind, False)


def _detect_mcore(tree: dict, config: dict) -> FamilyRecord:
    seed, seed_path = _seed(tree)
    if seed_path and not seed:
        # MindFormers builds the model from this config.json and raises "... does not exist" without it
        # (models/build_config.py get_model_config -> merge_model_config, 1.7.0 to 2.1.0)
        raise ConfigError("pretrained_model_dir", f"{seed_path} does not exist: MindFormers builds the model from "
                                                  "it (and stops without it); point pretrained_model_dir at the "
                                                  "Hugging Face model directory")
    merged = {**seed, **config}
    model_type = merged.get("model_type")
    if model_type is not None:
        if _lookup(mcore_model_types(), model_type) is None:
            where = join(MODEL_CONFIG, "model_type") if "model_type" in config else f"{seed_path}: model_type"
            raise ConfigError(where, f"not an mcore model this translator knows: {show(model_type)}",
                              f"known: {', '.join(mcore_model_types())}")
        return record(mcore_model_types()[model_type], True)
    archs = merged.get("architectures")
    for arch in archs if isinstance(archs, list) else [archs]:
        if _lookup(mcore_architectures(), arch):
            return record(mcore_architectures()[arch], True)
    variant = _variant("mcore", merged, tree)
    if variant is None:
        raise ConfigError("model", "cannot tell which mcore model this is (use_legacy: False)",
                          f"set model.model_config.model_type to one of {', '.join(mcore_model_types())}")
    return record(variant, True)


# ---------------------------------------------------------------------------------------------------------------
# Public API.

def detect_family(tree: dict) -> FamilyRecord:
    """The architecture a MindFormers YAML describes; NO_MODEL (hf_model_type None) when it has no model section."""
    if tree.get("model") is None:
        return NO_MODEL
    config = _model_section(tree)
    return _detect_mcore(tree, config) if tree.get("use_legacy") is False else _detect_legacy(tree, config)


def model_shape(tree: dict, family: FamilyRecord, ledger: Ledger, version: str = NEWEST) -> ModelShape:
    """The model numbers the rest of the translator needs; notes the keys carried into the Plan as `runtime`.
    `version`: the MindFormers version whose config-class defaults fill what the YAML leaves out (mcore)."""
    spec, m, _ = _load(tree, family, version)
    _check_heads(spec, m)
    shape = ModelShape(
        num_layers=m.need("num_layers"), mtp_depth=m.get("mtp_depth") or 0, hidden_size=m.need("hidden_size"),
        num_heads=m.need("num_heads"), vocab_size=m.need("vocab_size"), seq_length=m.need("seq_length"),
        compute_dtype=m.need("compute_dtype"), param_init_type=m.need("param_init_type"),
        use_fused_rope=bool(m.get("use_fused_rope")), use_fused_swiglu=bool(m.get("use_fused_swiglu")),
        pp_interleave_num=m.get("pp_interleave_num") or 1,
        offset=m.get("offset") if m.get("offset") is not None else 0,
        input_sliced_sig=bool(m.get("input_sliced_sig")),
        mtp_loss_factor=m.get("mtp_loss_factor") if m.get("mtp_loss_factor") is not None else 0.3,
        return_extra_loss=bool(m.get("return_extra_loss")),
    )
    for name, message in _SHAPE_NOTES.items():
        if name in m.spelling:
            ledger.runtime(m.path(name), message(getattr(shape, name)))
    mtp.account(family, shape, {k: m.path(k) for k in ("mtp_depth", "mtp_loss_factor") if k in m.spelling}, ledger)
    return shape


_SHAPE_NOTES: dict[str, Callable[[Any], str]] = {
    "seq_length": lambda v: f"training sequence length {v} (ModelShape.seq_length)",
    "offset": lambda v: "pipeline layer layout (ModelShape.offset)",
    "pp_interleave_num": lambda v: "virtual-pipeline chunks of the layer layout (ModelShape.pp_interleave_num)",
    "use_fused_rope": lambda v: "the fused RoPE kernel" if v else "plain RoPE (no fused kernel)",
    "use_fused_swiglu": lambda v: "the fused SwiGLU kernel" if v else "plain SwiGLU (no fused kernel)",
    "input_sliced_sig": lambda v: "dataset rows hold seq_length tokens and their labels" if v
    else "dataset rows hold seq_length + 1 tokens, shifted into inputs and labels",
    "return_extra_loss": lambda v: "MoE aux losses added to the LM loss" if v else "MoE aux losses not added",
}


def hf_config(tree: dict, family: FamilyRecord, ledger: Ledger, version: str = NEWEST) -> dict | None:
    """`AutoConfig.for_model(**d)` keyword arguments for the YAML's model, or None (with a note on `model`) when
    transformers has no architecture for the family. Every key under model.model_config and model.arch is noted."""
    if family.hf_model_type is None:
        ledger.dropped("model", f"family {family.name}: {family.reason}; no Hugging Face config")
        return None
    spec, m, moe = _load(tree, family, version)
    _check_heads(spec, m)
    ctx = _Ctx(family, ledger, {"model_type": family.hf_model_type, **spec.fixed})
    _account(m, spec.config_class, family.mcore, ctx, version)
    if not family.mcore:
        _account(moe, MOE_CONFIG, False, ctx)
    arch = tree["model"].get("arch") or {}
    _account(_Values(ARCH_SPEC, ARCH_SPEC.rules, {}, ARCH, arch), ARCH, False, ctx)
    _derive(spec, m, moe, ctx)
    if family.mcore:
        if isinstance(_model_section(tree).get("rope_scaling"), dict):
            ledger.mapped(join(MODEL_CONFIG, "rope_scaling"), "flattened as MindFormers' TransformerConfig does "
                          "(type -> position_embedding_type, factor -> rotary_scaling_factor, "
                          "original_max_position_embeddings -> max_position_embeddings): hf rope_parameters = "
                          f"{ctx.out.get('rope_parameters')}")
        _note_seed(tree, spec, ledger)
        _note_class_defaults(spec, m, version, ledger)
    return ctx.out


# The settings that shape an mcore model, named in the note on the class defaults a YAML relies on.
_SHAPING = ("num_layers", "hidden_size", "num_heads", "n_kv_heads", "head_dim", "intermediate_size", "vocab_size",
            "expert_num", "num_experts_chosen", "first_k_dense_replace", "shared_expert_num", "moe_intermediate_size",
            "routed_scaling_factor", "norm_topk_prob", "n_group", "topk_group", "kv_lora_rank", "q_lora_rank",
            "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "mtp_depth", "tie_word_embeddings")


def _note_class_defaults(spec: _Spec, m: _Values, version: str, ledger: Ledger) -> None:
    """One line saying which of the model's shaping settings the YAML left to its config class, and their values."""
    raw = class_defaults(version, spec.config_class)
    spelled = {spec.aliases.get(key, key): key for key in raw}
    taken = [f"{spelled[name]} {m.get(name)!r}" for name in _SHAPING
             if not m.given(name) and name in spelled and raw[spelled[name]] is not None
             and not getattr(spec.rules.get(spelled[name]), "unused", None)]  # MLA's kv heads: not read
    if taken:
        ledger.mapped("", f"model.model_config leaves to {spec.config_class} of MindFormers {version}: "
                          + ", ".join(taken))


def _note_seed(tree: dict, spec: _Spec, ledger: Ledger) -> None:
    seed, path = _seed(tree)
    if seed:
        ledger.mapped("pretrained_model_dir", f"{path} seeds model.model_config (model_config keys win)")


def mcore_model_config(tree: dict, family: FamilyRecord, version: str = NEWEST) -> dict:
    """The model_config MindFormers builds an mcore model from: its config class's defaults in `version`, then
    pretrained_model_dir's config.json, then the YAML's model_config (MindFormers' own names; the MoE plan and the
    layout checks read it). Legacy families: the YAML's model_config as written."""
    config = _model_section(tree)
    if not family.mcore:
        return config
    seed, _ = _seed(tree)
    spec = _spec(family)
    given = {_setting(spec, key) for key in (*seed, *config)}
    defaults = {k: v for k, v in class_defaults(version, spec.config_class).items() if _setting(spec, k) not in given}
    return {**defaults, **seed, **config}


def family_moe(family: FamilyRecord, hf: dict, model_config: dict, ledger: Ledger) -> dict | None:
    """The Plan's `moe` of a family whose module builds it (record.moe_plan False: translators/moe.py does not read
    its MoE keys); None where it has none, or where HF's blocks run, with a note saying so."""
    family_hook = registry.hook(family, "family_moe")
    return family_hook(hf, model_config, ledger) if family_hook else None


_SCORE_SPELLINGS = ("use_gating_sigmoid", "scoring_func", "moe_router_score_function")


def _setting(spec: _Spec, key: str) -> str:
    """One name for every spelling of a setting (a default must not override the YAML's other spelling of it)."""
    if key in _SCORE_SPELLINGS:
        return "use_gating_sigmoid"
    if key in MCORE_MOE:
        return MCORE_MOE[key].name
    return spec.aliases.get(key, key)


# ---------------------------------------------------------------------------------------------------------------
# The one entry point both schemas call: a model section -> its family, shape, HF config and built model_config.

@dataclass(frozen=True)
class ParsedModel:
    """What a model section describes: the family record, the numbers the rest of the translator needs, the HF
    config (None: no transformers architecture), and the model_config MindFormers builds (mcore: with its class
    defaults under the YAML's keys)."""

    family: FamilyRecord
    shape: ModelShape
    hf_config: dict | None
    config: dict


def mcore_tree(config: Any, **top: Any) -> dict:
    """A model section written flat (the PyNative schema's `model:`, MindFormers 2.x) as the graph-mode mcore tree
    the tables read: `use_legacy: False`, `model.model_config` = the section, plus the top-level keys `top`."""
    return {**top, "use_legacy": False, "model": {"model_config": config}}


def parse_model(tree: dict, ledger: Ledger, version: str = NEWEST) -> ParsedModel:
    """Parse the model of a graph-mode tree (or of `mcore_tree(section)`) for its family: every key under
    model.model_config / model.arch (and moe_config's model keys) noted in `ledger` (a Ledger, or a LedgerView that
    renames model.model_config to the schema's own path). Refuses an mcore family transformers has no class for."""
    family = detect_family(tree)
    shape = model_shape(tree, family, ledger, version)
    if family.mcore and family.hf_model_type is None:
        raise ConfigError(join(MODEL_CONFIG, "model_type"), f"{family.name}: {family.reason}")
    config = hf_config(tree, family, ledger, version)
    built = mcore_model_config(tree, family, version) if family.mcore else _model_section(tree)
    return ParsedModel(family, shape, config, built)
