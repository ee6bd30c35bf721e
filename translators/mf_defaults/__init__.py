"""The defaults of MindFormers' model config classes, per MindFormers version, as MindFormers' own code gives them.

`<version>.json` beside this file is written by tests/fixtures/make_mf_config_defaults.py, which builds each class
with no arguments in that version's MindFormers and dumps `to_dict()`; tests/fixtures/mf_config_defaults/ holds the
same golden files and tests/translators/test_mf_defaults.py checks that the two agree. A run says its version with
`mindformers_version:` in the YAML or `mf-translate --mindformers-version`; without either the newest is taken.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

from translators.errors import ConfigError, show

_HERE = os.path.dirname(os.path.abspath(__file__))


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


VERSIONS: tuple[str, ...] = tuple(sorted((name[:-5] for name in os.listdir(_HERE) if name.endswith(".json")),
                                         key=_key))
NEWEST = VERSIONS[-1]


@functools.cache
def _load(version: str) -> dict:
    with open(os.path.join(_HERE, f"{version}.json"), encoding="utf-8") as f:
        return json.load(f)["classes"]


def resolve(value: Any, where: str) -> str:
    """The MindFormers version a run names ('2.1.0', '2.1', 2.1), or the newest when it names none."""
    if value is None:
        return NEWEST
    text = str(value).strip().lstrip("v")
    parts = text.split(".")
    if not all(p.isdigit() for p in parts) or not 1 <= len(parts) <= 3:
        raise ConfigError(where, f"expected a MindFormers version such as {NEWEST}, got {show(value)}")
    text = ".".join(parts + ["0"] * (3 - len(parts)))
    if text not in VERSIONS:
        raise ConfigError(where, f"MindFormers {text}: no config-class defaults for it here",
                          f"known versions: {', '.join(VERSIONS)}")
    return text


def class_defaults(version: str, config_class: str) -> dict[str, Any]:
    """`config_class()`'s to_dict() in MindFormers `version` (MindFormers' own key names)."""
    classes = _load(version)
    if config_class not in classes:
        raise ConfigError("model.model_config", f"{config_class} does not exist in MindFormers {version}",
                          "set mindformers_version (or --mindformers-version) to the version the YAML comes from")
    return dict(classes[config_class]["defaults"])

