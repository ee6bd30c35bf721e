"""The family records (translators/families/registry.py): one per family the translator detects, each complete."""

from __future__ import annotations

from translators.families import registry
from translators.families.base import _ARCH_FAMILY, _CONFIG_FAMILY, _LLAMA_LIKE
from translators.families.record import FamilyRecord


def test_every_detected_family_has_one_record():
    names = {name for name in (*_CONFIG_FAMILY.values(), *_ARCH_FAMILY.values()) if not name.endswith("*")}
    names |= {"llama", "qwen2", "mixtral", "qwen2_moe", "glm4", "chatglm"}  # the variants of llama* / glm*
    assert _LLAMA_LIKE.endswith("*")
    legacy = {r.name for r in registry.records() if not r.mcore}
    assert names <= legacy, names - legacy
    assert set(registry.mcore_model_types().values()) == {r.name for r in registry.records() if r.mcore}


def test_records_are_complete_where_they_name_an_architecture():
    for record in registry.records():
        assert isinstance(record, FamilyRecord)
        if record.hf_model_type is None:
            assert record.reason and record.runtime is None, record.name
            continue
        assert record.runtime is not None and record.runtime.module.endswith(f".modeling_{record.hf_model_type}")
        assert record.runtime.rope is not None or record.runtime.not_applicable, record.name
    # families sharing an architecture share its runtime part
    by_type = {}
    for record in registry.records():
        if record.runtime is not None:
            assert by_type.setdefault(record.hf_model_type, record.runtime) == record.runtime, record.name


def test_weight_tables_are_found_by_the_weights_key():
    assert registry.weights("qwen3/mcore").names[0] == ("embedding.word_embeddings.", "model.embed_tokens.")
    # checked against the network MindFormers builds (tests/mf_ds/test_convert_deepseek3_mcore.py)
    assert registry.weights("deepseek_v3/mcore").names[4] == (".self_attention.linear_q_down_proj.",
                                                              ".self_attn.q_a_proj.")
    assert registry.weights("chatglm") is registry.weights("glm4")


def test_each_family_module_declares_the_specs_of_its_records():
    from translators.families import engine

    for record in registry.records():
        key = (record.name, record.mcore)
        assert key in registry.module(record).specs(), key  # one way to register: the record's own module
        assert engine._SPECS[key] is not None
    assert set(engine._SPECS) == {(r.name, r.mcore) for r in registry.records()}


def test_hooks_are_found_through_the_record():
    from translators.families import deepseek4, gpt2

    assert registry.hook(registry.record("deepseek_v4", True), "family_moe") is deepseek4.family_moe
    assert registry.hook(registry.record("gpt2", False), "memory_inventory") is gpt2.memory_inventory
    assert registry.hook(registry.record("llama", False), "family_moe") is None
    assert registry.hook(None, "memory_inventory") is None  # an HF model_type no record names


def _string_constants(path: str) -> set[str]:
    """The string literals of a module, docstrings and comments left out."""
    import ast

    tree = ast.parse(open(path).read())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)) and node.body
                  and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return {node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings}


def test_shared_translator_code_names_no_family():
    """memory.py, names.py and the engine ask the family's module (a hook, its record's tables), never branch on a
    family's name."""
    families = {r.name for r in registry.records()} | {r.hf_model_type for r in registry.records() if r.hf_model_type}
    for path in ("translators/memory.py", "translators/names.py", "translators/families/engine.py"):
        found = _string_constants(path) & families
        if path.endswith("names.py"):
            found -= {"llama"}  # is_weight's and fused_kind's default family: the legacy layout, not a branch
        assert not found, (path, found)
