"""The one registry of families: every module below declares its records (`RECORDS`, translators/families/record.py),
its config specs (`specs()`, keyed by (name, mcore): translators/families/engine.py), its weight-name tables (in its
records' `weights`) and the hooks where it differs from the shared code (`hook(record, name)`: `family_moe`, the
`memory_*` hooks of translators/memory.py); its runtime module, if any, is mf_ds/families/<runtime.hooks>.py.

Adding a family: its module named here, and its tests (docs/DESIGN.md, "How to add a family"). The translator
finds a family with `record(name, mcore)`; the parallel layout, memory and weight tables with `by_hf_type` and
`weights`; mf_ds/patch and mf_ds/families with `runtime(model_type)`.
"""

from __future__ import annotations

import importlib
from functools import cache

from translators.families.record import FamilyRecord, PatchTargets, Weights

# translators/families/<module>.py: the config classes' modules, then the families with a module of their own. The
# order matters: the first record of an HF model_type gives its memory hooks and patch targets (by_hf_type).
MODULES = ("llama", "deepseek", "glm", "gpt2", "mcore", "telechat3", "glm4_moe", "deepseek4")


def modules() -> list:
    return [importlib.import_module(f"translators.families.{module}") for module in MODULES]


@cache
def records() -> tuple[FamilyRecord, ...]:
    found = tuple(r for module in modules() for r in module.RECORDS)
    keys = [(r.name, r.mcore) for r in found]
    assert len(set(keys)) == len(keys), f"two records for one family: {keys}"
    return found


@cache
def _by_key() -> dict[tuple[str, bool], FamilyRecord]:
    return {(r.name, r.mcore): r for r in records()}


def record(name: str, mcore: bool) -> FamilyRecord:
    return _by_key()[(name, mcore)]


@cache
def _modules_by_key() -> dict[tuple[str, bool], object]:
    return {(r.name, r.mcore): module for module in modules() for r in module.RECORDS}


def module(family: FamilyRecord | None):
    """The module that declares `family` (its specs, tables and hooks); None for None or a record outside the
    registry (base.NO_MODEL)."""
    return None if family is None else _modules_by_key().get((family.name, family.mcore))


def hook(family: FamilyRecord | None, name: str):
    """The family module's hook `name` (a function the module defines for its records), or None."""
    return getattr(module(family), name, None)


def by_hf_type(model_type: str | None) -> FamilyRecord | None:
    """The first record of a transformers model_type (records sharing one architecture share its parts)."""
    return next((r for r in records() if model_type is not None and r.hf_model_type == model_type), None)


def runtime(model_type: str) -> PatchTargets | None:
    found = by_hf_type(model_type)
    return found.runtime if found else None


def runtimes() -> dict[str, PatchTargets]:
    """transformers model_type -> what mf_ds/patch replaces in it."""
    out: dict[str, PatchTargets] = {}
    for r in records():
        if r.hf_model_type is not None and r.runtime is not None:
            out.setdefault(r.hf_model_type, r.runtime)
    return out


def mcore_model_types() -> dict[str, str]:
    """mcore `model_type` -> family name."""
    return {t: r.name for r in records() if r.mcore for t in r.model_types}


def mcore_architectures() -> dict[str, str]:
    """mcore `architectures` class name -> family name."""
    return {a: r.name for r in records() if r.mcore for a in r.architectures}


def weights(key: str) -> Weights | None:
    """The weight tables of a record's weights_key (`llama`, `qwen3/mcore`), None where it has none."""
    return next((r.weights for r in records() if r.weights_key == key and r.weights is not None), None)


def weight_families() -> list[str]:
    return sorted(r.weights_key for r in records() if r.weights is not None)
