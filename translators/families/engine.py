"""The spec of each family and the engine: one pass over a section's keys with its table, then the derivations."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from translators.errors import ConfigError, did_you_mean, join, show
from translators.families import mcore_keys, registry
from translators.families.base import ARCH, MODEL_CONFIG, MOE_CONFIG, NO_MODEL
from translators.families.llama import MOE_DEFAULTS
from translators.families.record import FamilyRecord
from translators.families.rules import _TYPES, ARCH_RULES, Feeds, Rule
from translators.families.spec import _Spec
from translators.mf_defaults import NEWEST, class_defaults
from translators.notes import Ledger

# ---------------------------------------------------------------------------------------------------------------
# The spec of each family (translators/families/spec.py), declared by its module's `specs()`.

_SPECS: dict[tuple[str, bool], _Spec] = {key: spec for module in registry.modules()
                                         for key, spec in module.specs().items()}
ARCH_SPEC = _Spec("model.arch", ARCH_RULES, {})


# ---------------------------------------------------------------------------------------------------------------
# The engine: one pass over a section's keys with its table, then the derivations, then the notes on their inputs.

class _Values:
    """One YAML section by canonical name: typed by its rules, the config class's defaults behind. Records the names
    a derivation reads, so that the keys it consumed can be noted with what they fed."""

    def __init__(self, spec: _Spec, rules: dict[str, Rule], defaults: dict, base: str, section: dict,
                 seed: dict | None = None, seed_path: str = ""):
        self.base, self.rules, self.aliases, self.defaults = base, rules, spec.aliases, defaults
        self.raw: dict[str, Any] = {}  # YAML spelling -> value as written
        self.typed: dict[str, Any] = {}  # canonical -> typed value (config.json seed below the YAML)
        self.spelling: dict[str, str] = {}  # canonical -> YAML spelling
        self.read: set[str] = set()
        for key, value in (seed or {}).items():
            if key in rules:
                self.typed[self.name(key)] = self._convert(key, value, f"{seed_path}: {key}")
        for key, value in section.items():
            name = self.name(key)
            if name in self.spelling:  # MindFormers: "Multiple configurations provided for the same setting"
                raise ConfigError(join(base, key), f"sets the same thing as {join(base, self.spelling[name])}; "
                                                   "give only one of them")
            self.spelling[name], self.raw[key] = key, value
            if key in rules:
                self.typed[name] = self._convert(key, value, join(base, key))

    def _convert(self, key: str, value: Any, path: str) -> Any:
        rule = self.rules[key]
        if getattr(rule, "untyped", False):
            return value
        conv = rule.conv or _TYPES.get(self.name(key))
        return conv(value, path) if conv else value

    def name(self, key: str) -> str:
        return self.aliases.get(key, key)

    def get(self, name: str) -> Any:
        self.read.add(name)
        return self.typed[name] if name in self.typed else self.defaults.get(name)

    def given(self, name: str) -> bool:
        return name in self.typed

    def path(self, name: str) -> str:
        return join(self.base, self.spelling.get(name, name))

    def need(self, name: str) -> Any:
        value = self.get(name)
        if value is None:
            raise ConfigError(self.path(name), "required (the config class has no default for it)")
        return value


@dataclass
class _Ctx:
    family: FamilyRecord
    ledger: Ledger
    out: dict
    fed: dict[tuple[str, str], dict] = field(default_factory=dict)  # (section, name) -> the HF values it fed

    def note(self, s: _Values, key: str, kind: str, message: str) -> None:
        raw, typed = s.raw.get(key), s.typed.get(s.name(key))
        if isinstance(raw, str) and not isinstance(typed, str) and s.name(key) in s.typed:
            message += f" (the YAML string {raw!r}, read as {typed!r})"
        self.ledger.add(join(s.base, key), kind, message)


def _account(s: _Values, spec_name: str, mcore: bool, ctx: _Ctx, version: str = NEWEST) -> None:
    """Account every key the section holds, and write the defaults of the ones it does not. Under mcore a key
    MindFormers' conversion cannot convert is an error, as it is in MindFormers (translators/families/mcore_keys.py)."""
    for key in s.raw:
        rule = s.rules.get(key)
        if mcore and (spelled := mcore_keys.spelling(version, key, s.raw[key], join(s.base, key))):
            ctx.note(s, key, *spelled)
        elif rule is None:
            hint = did_you_mean(key, s.rules)
            accepted = mcore_keys.accepted(version) if mcore else None
            if accepted is not None and key not in accepted:
                raise ConfigError(join(s.base, key), f"not a {spec_name} key: MindFormers {version}'s mcore "
                                  "conversion refuses it (convert_to_transformer_config)"
                                  + (f"; {hint}" if hint else ""))
            who = "MindFormers keeps it and never reads it" if not mcore else \
                "MindFormers' mcore conversion takes it; nothing here reads it" if accepted is not None else \
                f"MindFormers {version}'s config converter only warns that it is not in its mapping and trains " \
                "without it"
            ctx.note(s, key, "unknown", f"not a {spec_name} key ({who}); ignored" + (f"; {hint}" if hint else ""))
        elif not isinstance(rule, Feeds):
            rule.account(s, key, s.name(key), ctx)
    done = set(s.spelling)
    for key, rule in s.rules.items():
        if s.name(key) not in done:
            done.add(s.name(key))
            rule.absent(s, s.name(key), ctx)


def _derive(spec: _Spec, m: _Values, moe: _Values, ctx: _Ctx) -> None:
    """Run the derivations, then note each Feeds key with the HF values it fed (or why it fed none)."""
    sections = tuple(dict.fromkeys((m, moe)))  # one section under mcore, where moe is model_config
    for derive in spec.derive:
        for s in sections:
            s.read.clear()
        produced = derive(m, moe)
        ctx.out.update(produced)
        for s in sections:
            for name in s.read:
                ctx.fed.setdefault((s.base, name), {}).update(produced)
    for s in sections:
        for key in s.raw:
            if isinstance(s.rules.get(key), Feeds):
                s.rules[key].account(s, key, s.name(key), ctx)


def _model_section(tree: dict) -> dict:
    model = tree["model"]
    if not isinstance(model, dict):
        raise ConfigError("model", f"expected a mapping with model_config, got {show(model)}")
    config = model.get("model_config")
    if not isinstance(config, dict):
        raise ConfigError(MODEL_CONFIG, f"expected a mapping of model settings, got {show(config)}")
    if not isinstance(model.get("arch", {}), dict):
        raise ConfigError(ARCH, f"expected a mapping with the model class (type), got {show(model['arch'])}")
    return config


def _seed(tree: dict) -> tuple[dict, str]:
    """mcore models start from pretrained_model_dir/config.json, overridden by model_config (keys.md); returns that
    config ({} when absent) and its path ('' when no directory is set)."""
    directory = tree.get("pretrained_model_dir")
    if not isinstance(directory, str) or not directory:
        return {}, ""
    path = os.path.join(directory, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            seed = json.load(f)
    except (FileNotFoundError, NotADirectoryError):
        return {}, path
    except (OSError, ValueError) as exc:
        raise ConfigError(path, f"cannot read the Hugging Face config: {exc}") from None
    if not isinstance(seed, dict):
        raise ConfigError(path, f"expected a JSON object, got {type(seed).__name__}")
    return _flat_rope_scaling(seed, path, tree), path


def _flat_rope_scaling(seed: dict, path: str, tree: dict) -> dict:
    """An HF `rope_scaling` dict becomes the flat mcore keys, as TransformerConfig.__post_init__ does
    (parallel_core/transformer_config.py, 1.7.0 to 2.1.0): its type the position_embedding_type, factor the
    rotary_scaling_factor, original_max_position_embeddings (else seq_length) the max_position_embeddings, the
    other keys (beta_fast, mscale, ...) as they are."""
    scaling = seed.get("rope_scaling")
    if not isinstance(scaling, dict):
        return seed
    scaling = dict(scaling)
    flat = {k: v for k, v in seed.items() if k != "rope_scaling"}
    kind = scaling.pop("type", None) or scaling.pop("rope_type", None)
    if "factor" not in scaling:
        raise ConfigError(path if path.endswith("rope_scaling") else f"{path}: rope_scaling",
                          "has no factor (MindFormers' TransformerConfig needs one)")
    flat["position_embedding_type"], flat["rotary_scaling_factor"] = kind, scaling.pop("factor")
    config = (tree.get("model") or {}).get("model_config") or {}
    original = scaling.pop("original_max_position_embeddings", None) or config.get("seq_length") \
        or seed.get("seq_length")
    if original is not None:
        flat["max_position_embeddings"] = original
    flat.update(scaling)
    return flat


_CLASS_DEFAULTS: dict[tuple[str, str], dict] = {}
# DeepseekV3Config's own compute_dtype default is 'bf16' (the mcore TransformerConfig takes the short names)
_DTYPE_SHORT = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# The tokenizer's ids are not the model's arithmetic, and a class default (Qwen3Config's pad_token_id 151643) would
# become HF's embedding padding_idx, whose row then gets no gradient: MindFormers' embedding has no padding row.
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")


def class_defaults_typed(spec: _Spec, version: str) -> dict[str, Any]:
    """The spec's defaults with its config class's own defaults in MindFormers `version` over them (canonical names,
    typed as the YAML's values are); keys the class does not hold (the layout keys) keep the spec's."""
    cached = _CLASS_DEFAULTS.get((spec.config_class, version))
    if cached is not None:
        return cached
    out = dict(spec.defaults)
    for key, value in sorted(class_defaults(version, spec.config_class).items()):
        rule = spec.rules.get(key)
        if value is None or rule is None or getattr(rule, "untyped", False) or key in _TOKEN_IDS:
            continue
        name = spec.aliases.get(key, key)
        value = _DTYPE_SHORT.get(value, value) if isinstance(value, str) else value
        conv = rule.conv or _TYPES.get(name)
        out[name] = conv(value, f"{spec.config_class}.{key} (MindFormers {version})") if conv else value
    _CLASS_DEFAULTS[(spec.config_class, version)] = out
    return out


def _load(tree: dict, family: FamilyRecord, version: str = NEWEST) -> tuple[_Spec, _Values, _Values]:
    """The family's spec, its model_config values, and the MoE values (moe_config, or model_config under mcore).
    mcore values a YAML leaves out take the defaults of MindFormers `version`'s config class."""
    if family is NO_MODEL:
        raise ConfigError("model", "no model section: a run config needs model.model_config")
    spec = _SPECS[(family.name, family.mcore)]
    seed, seed_path = _seed(tree) if family.mcore else ({}, "")
    defaults = class_defaults_typed(spec, version) if family.mcore else spec.defaults
    section = _model_section(tree)
    if family.mcore and isinstance(section.get("rope_scaling"), dict):  # as config.json's (COMMON_CONFIG_MAPPING)
        section = _flat_rope_scaling(section, join(MODEL_CONFIG, "rope_scaling"), tree)
    m = _Values(spec, spec.rules, defaults, MODEL_CONFIG, section, seed, seed_path)
    if family.mcore:
        return spec, m, m
    moe_section = tree.get(MOE_CONFIG) or {}
    if not isinstance(moe_section, dict):
        raise ConfigError(MOE_CONFIG, f"expected a mapping, got {show(moe_section)}")
    only_ours = {key: value for key, value in moe_section.items() if key in spec.moe_rules}
    return spec, m, _Values(spec, spec.moe_rules, MOE_DEFAULTS, MOE_CONFIG, only_ours)


def _check_heads(spec: _Spec, m: _Values) -> None:
    hidden, heads = m.need("hidden_size"), m.need("num_heads")
    if spec.head_dim_derived and hidden % heads:
        raise ConfigError(m.path("num_heads"), f"hidden_size {hidden} is not divisible by num_heads {heads} "
                                               "(head_dim = hidden_size / num_heads)")
