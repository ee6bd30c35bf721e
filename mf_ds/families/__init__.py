"""The runtime's family code: one module per family that has some (mf_ds/families/<module>.py: RoPE adapters,
initial values, module surgery, its MindFormers names and Muon cuts), named by its record
(translators/families/record.py PatchTargets.hooks) and found through the same registry
(translators/families/registry.py) by transformers' model_type. A family without runtime code has no module here.

A module defines the hooks it needs, each a plain function (ROPES: a table) the shared code calls where the family
differs:
  ROPES[PatchTargets.rope](model) -> (name, adapter)   the fused RoPE adapter and the modeling function it replaces
                                              (mf_ds/patch/kernels.py _patch_rope)
  rope_probe(adapter) -> (rot, complex)       the probe's rotated columns of an 8-wide head, one complex table
                                              (mf_ds/patch/kernels.py _probe; default (8, False))
  init(model) -> report lines                 MindFormers' initial values (mf_ds/init.py as_mindformers)
  shared_experts(model) -> report lines       module surgery before weights load (mf_ds/shared_expert.py apply)
  shared_width(config) -> int | None          the width that surgery builds (mf_ds/shared_expert.py width)
  mindformers_name(hf_name) -> str            the name adamw_include's globs see (mf_ds/muon.py mindformers_name)
  muon_split_rule(hf_name) -> tuple           MindFormers' Newton-Schulz cut (mf_ds/muon.py split_rule)
"""

from __future__ import annotations

import importlib
from types import ModuleType

from translators.families import registry


def module(model_type: str | None) -> ModuleType | None:
    """The runtime module of transformers' `model_type`'s family, None where it has none."""
    targets = registry.runtime(model_type) if model_type is not None else None
    if targets is None or targets.hooks is None:
        return None
    return importlib.import_module(f"mf_ds.families.{targets.hooks}")


def hook(model_type: str | None, name: str):
    """The family's hook `name` (module docstring), None where the family has none (the shared code's default)."""
    return getattr(module(model_type), name, None)
