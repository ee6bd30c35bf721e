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
