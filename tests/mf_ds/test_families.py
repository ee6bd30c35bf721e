"""mf_ds/families: a family's runtime code, found through its record (translators/families/record.py
PatchTargets.hooks), and the shared runtime code that calls it names no family."""

from __future__ import annotations

import ast

from mf_ds import families
from mf_ds.families import deepseek4
from translators.families import registry


def test_runtime_module_is_found_by_model_type():
    assert families.module("deepseek_v4") is deepseek4
    assert families.module("llama") is None  # no runtime code of its own
    assert families.module(None) is None and families.module("no_such_model") is None
    assert families.hook("deepseek_v4", "init") is deepseek4.init
    assert families.hook("qwen3", "init") is None


def test_every_named_runtime_module_exists_and_defines_only_known_hooks():
    known = {"init", "shared_experts", "shared_width", "mindformers_name", "muon_split_rule"}
    named = {r.runtime.hooks for r in registry.records() if r.runtime is not None and r.runtime.hooks}
    assert named == {"deepseek4"}
    for name in named:
        module = families.module(next(r.hf_model_type for r in registry.records()
                                      if r.runtime is not None and r.runtime.hooks == name))
        hooks = {n for n in known if callable(getattr(module, n, None))}
        assert hooks == known, hooks  # DeepSeek-V4 has each of them


def test_shared_runtime_code_names_no_family():
    """mf_ds/init.py, shared_expert.py and muon.py call the family's hooks; none compares a model_type."""
    names = {r.name for r in registry.records()} | {r.hf_model_type for r in registry.records() if r.hf_model_type}
    for path in ("mf_ds/init.py", "mf_ds/shared_expert.py", "mf_ds/muon.py"):
        found = {node.value for node in ast.walk(ast.parse(open(path).read()))
                 if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names}
        assert not found, (path, found)
