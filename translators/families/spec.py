"""The spec of a family's MindFormers config class: its table, the class's defaults, its derivations.

Each family module (translators/families/registry.py MODULES) declares its specs in `specs()`, keyed by the
record's (name, mcore); translators/families/engine.py collects them from the registry and applies them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from translators.families.rules import Map, Rule

Derive = Callable[[Any, Any], dict]  # (model_config values, moe_config values) -> HF values (engine._Values)


@dataclass(frozen=True)
class _Spec:
    config_class: str
    rules: dict[str, Rule | str]  # YAML spelling -> rule ("hf_name" is Map("hf_name"))
    defaults: dict[str, Any]  # canonical name -> the config class's default
    derive: tuple[Derive, ...] = ()
    aliases: dict[str, str] = field(default_factory=dict)  # YAML spelling -> canonical name
    moe_rules: dict[str, Rule | str] = field(default_factory=dict)  # top-level moe_config keys feeding the HF config
    fixed: dict[str, Any] = field(default_factory=dict)  # HF values the family implies
    head_dim_derived: bool = True  # head_dim = hidden_size / num_heads, which must then divide

    def __post_init__(self) -> None:
        for name in ("rules", "moe_rules"):
            table = {k: Map(r) if isinstance(r, str) else r for k, r in getattr(self, name).items()}
            object.__setattr__(self, name, table)


SILU = {"hidden_act": "silu"}  # hard-coded in LlamaFeedForward and the DeepSeek FFNs
