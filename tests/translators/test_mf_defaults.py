"""translators/mf_defaults: MindFormers' config-class defaults per version, equal to the golden files that
tests/fixtures/make_mf_config_defaults.py generated with MindFormers' own code; the version a run names decides."""

from __future__ import annotations

import json

import pytest

from tests.conftest import ROOT
from translators import mf_defaults
from translators.errors import ConfigError
from translators.families import engine

GOLDEN = ROOT / "tests" / "fixtures" / "mf_config_defaults"


def test_versions_are_the_golden_files():
    assert mf_defaults.VERSIONS == ("1.7.0", "1.8.0", "1.9.0", "2.0.0", "2.1.0") and mf_defaults.NEWEST == "2.1.0"
    assert sorted(p.stem for p in GOLDEN.glob("*.json")) == list(mf_defaults.VERSIONS)


@pytest.mark.parametrize("version", mf_defaults.VERSIONS)
def test_translator_data_equals_the_golden_file(version):
    golden = json.loads((GOLDEN / f"{version}.json").read_text())
    assert golden["mindformers"] == version
    for name, entry in golden["classes"].items():
        assert mf_defaults.class_defaults(version, name) == entry["defaults"]


@pytest.mark.parametrize("version", mf_defaults.VERSIONS)
def test_each_mcore_family_takes_its_class_defaults(version):
    """What a YAML leaves out is the class default (canonical names): DeepseekV3Config's 256 experts, top-8, 3 dense
    layers, 128 heads; Qwen3MoeConfig's 128 experts; token ids excepted (not the model's arithmetic)."""
    golden = json.loads((GOLDEN / f"{version}.json").read_text())["classes"]
    for (family, mcore), spec in engine._SPECS.items():
        if not mcore or spec.config_class not in golden:
            continue
        typed = engine.class_defaults_typed(spec, version)
        raw = golden[spec.config_class]["defaults"]
        for key, value in raw.items():
            rule = spec.rules.get(key)
            if value is None or rule is None or getattr(rule, "untyped", False) or key in engine._TOKEN_IDS:
                continue
            assert typed[spec.aliases.get(key, key)] is not None, (family, key)
    ds = engine.class_defaults_typed(engine._SPECS[("deepseek_v3", True)], version)
    assert (ds["expert_num"], ds["num_experts_chosen"], ds["first_k_dense_replace"], ds["num_heads"]) == (256, 8, 3,
                                                                                                           128)
    assert ds["compute_dtype"] == "bfloat16"  # the class says 'bf16'
    assert engine.class_defaults_typed(engine._SPECS[("qwen3_moe", True)], version)["expert_num"] == 128


def test_derived_kv_heads():
    """DeepseekV3Config keeps num_key_value_heads 128 whatever num_attention_heads is (MLA never reads it), so the
    12B YAML's 8 heads are not a GQA split of 128: HF DeepseekV3 gets num_key_value_heads = num_attention_heads."""
    golden = json.loads((GOLDEN / "2.1.0.json").read_text())["classes"]["DeepseekV3Config"]
    assert golden["derived"] == [{"given": {"num_attention_heads": 8}, "changed": {"num_attention_heads": 8}}]


@pytest.mark.parametrize("given, resolved", [(None, "2.1.0"), ("2.1.0", "2.1.0"), ("1.7", "1.7.0"), (1.9, "1.9.0"),
                                             ("v2.0.0", "2.0.0")])
def test_resolve(given, resolved):
    assert mf_defaults.resolve(given, "mindformers_version") == resolved


@pytest.mark.parametrize("given, message", [("1.6.0", "MindFormers 1.6.0: no config-class defaults for it here"),
                                            ("latest", "expected a MindFormers version such as 2.1.0")])
def test_resolve_refuses(given, message):
    with pytest.raises(ConfigError, match=f"^mindformers_version: {message}"):
        mf_defaults.resolve(given, "mindformers_version")


@pytest.mark.parametrize("version", mf_defaults.VERSIONS)
def test_legacy_tables_equal_the_golden_file(version):
    """The legacy families keep their defaults as tables beside them (llama.py LLAMA_DEFAULTS and MOE_DEFAULTS,
    glm.py GLM_DEFAULTS): every value there is LlamaConfig's / MoEConfig's / ChatGLM2Config's own in each version.
    (mtp_depth, pp_interleave_num and offset are the layout's, not the class's.)"""
    from translators.families.glm import GLM_ALIASES, GLM_DEFAULTS
    from translators.families.llama import LLAMA_DEFAULTS, MOE_DEFAULTS

    classes = json.loads((GOLDEN / f"{version}.json").read_text())["classes"]
    llama, glm = classes["LlamaConfig"]["defaults"], classes["ChatGLM2Config"]["defaults"]
    assert {k: v for k, v in LLAMA_DEFAULTS.items() if k != "mtp_depth"} == {k: llama[k] for k in LLAMA_DEFAULTS
                                                                              if k != "mtp_depth"}
    assert MOE_DEFAULTS == {k: llama["moe_config"][k] for k in MOE_DEFAULTS}  # first_k_dense_replace True == 1
    spelled = {name: key for key, name in GLM_ALIASES.items()}
    assert GLM_DEFAULTS == {k: glm[spelled.get(k, k)] for k in GLM_DEFAULTS}
