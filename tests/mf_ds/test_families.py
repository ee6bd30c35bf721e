"""mf_ds/families: a family's runtime code, found through its record (translators/families/record.py
PatchTargets.hooks), and the shared runtime code that calls it names no family."""

from __future__ import annotations

import ast

from mf_ds import families
from mf_ds.families import deepseek, deepseek4, glm, llama
from translators.families import registry


def test_runtime_module_is_found_by_model_type():
    assert families.module("deepseek_v4") is deepseek4
    assert families.module("gpt2") is None  # no runtime code of its own
    assert families.module("llama") is llama and families.module("qwen3") is llama  # Qwen3's RoPE is Llama's
    assert families.module(None) is None and families.module("no_such_model") is None
    assert families.hook("deepseek_v4", "init") is deepseek4.init
    assert families.hook("qwen3", "init") is None


def test_every_named_runtime_module_exists_and_defines_only_known_hooks():
    known = {"init", "shared_experts", "shared_width", "mindformers_name", "muon_split_rule"}
    named = {r.runtime.hooks for r in registry.records() if r.runtime is not None and r.runtime.hooks}
    assert named == {"deepseek4", "llama", "glm", "deepseek"}
    hooks = {n for n in known if callable(getattr(deepseek4, n, None))}
    assert hooks == known, hooks  # DeepSeek-V4 has each of them
    for module in (llama, glm, deepseek):  # the RoPE adapters only
        assert not {n for n in known if hasattr(module, n)}, module.__name__


def test_every_rope_key_has_its_adapter_in_the_named_module():
    """Each record with a rotary embedding names the runtime module whose ROPES holds its PatchTargets.rope."""
    for record in registry.records():
        targets = record.runtime
        if targets is None or targets.rope is None:
            continue
        assert targets.rope in families.hook(record.hf_model_type, "ROPES"), record.name
    assert glm.rope_probe(glm.rope_glm) == (4, False)
    assert deepseek.rope_probe(deepseek.rope_deepseek_v2) == (8, True)
    assert deepseek.rope_probe(llama.rope_split_half) == (8, False)


def test_shared_runtime_code_names_no_family():
    """mf_ds/init.py, shared_expert.py, muon.py and patch/kernels.py call the family's hooks; none compares a
    model_type."""
    names = {r.name for r in registry.records()} | {r.hf_model_type for r in registry.records() if r.hf_model_type}
    for path in ("mf_ds/init.py", "mf_ds/shared_expert.py", "mf_ds/muon.py", "mf_ds/patch/kernels.py"):
        found = {node.value for node in ast.walk(ast.parse(open(path).read()))
                 if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names}
        assert not found, (path, found)
