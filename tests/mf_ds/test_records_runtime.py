"""The family records' runtime part names transformers classes and functions by string (translators/ imports no
transformers): every name must exist in the installed transformers, or a patch would fail only on that family."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest

from mf_ds import families
from translators.families import registry


@pytest.mark.parametrize("model_type", sorted(registry.runtimes()))
def test_patch_targets_exist_in_transformers(model_type):
    targets = registry.runtime(model_type)
    modeling = importlib.import_module(targets.module)
    for name in (*targets.mlps, targets.experts, targets.moe_block):
        assert name is None or hasattr(modeling, name), f"{targets.module} has no {name}"
    if targets.rope is None:
        assert set(targets.not_applicable) == {"fused_rope", "fused_swiglu"}
        return
    for interleave in (True, False):  # DeepSeek-V3 picks its function by config.rope_interleave
        model = SimpleNamespace(config=SimpleNamespace(rope_interleave=interleave))
        name, adapter = families.hook(model_type, "ROPES")[targets.rope](model)
        assert callable(getattr(modeling, name)) and callable(adapter)
