"""pet_config (graph mode) and lora_config (PyNative 2.x) -> run.lora (translators/lora.py), read as MindFormers reads
them: mindformers/pet/pet_config.py LoraConfig's defaults (1.7.0), the PyNative schema's LoraConfig (2.1.0)."""

from __future__ import annotations

import pytest

from tests.conftest import CONFIGS, ROOT
from translators.errors import ConfigError
from translators.plan import translate_file

MF = ROOT / "tests" / "fixtures" / "mindformers"
LORA_7B = MF / "lora_llama2_7b.yaml"  # r1.5.0 configs/llama2/lora_llama2_7b.yaml as shipped
QWEN3 = ROOT / "tests" / "fixtures" / "pynative" / "tiny_qwen3_pynative.yaml"
PET = "model.model_config.pet_config"


def test_the_v1_5_lora_yaml():
    result = translate_file(str(LORA_7B))
    lora = result.plan.run.lora
    assert (lora.source, lora.style, lora.rank, lora.alpha, lora.dropout) == ("pet_config", "legacy", 16, 16.0, 0.05)
    assert lora.target_modules == ".*wq|.*wk|.*wv|.*wo" and lora.a_init == "he_uniform"
    notes = {n.key: n.kind for n in result.plan.notes if n.key.startswith(PET)}
    assert set(notes.values()) == {"runtime"} and f"{PET}.lora_rank" in notes
    assert "run" in result.json and result.json["run"]["lora"]["rank"] == 16


def test_loraconfig_defaults_and_mindformers_default_targets():
    """Only pet_type: MindFormers' LoraConfig defaults, and LoraAdapter's `.*dense*|.*linear*` targets."""
    lora = translate_file(str(LORA_7B), [f"{PET}={{pet_type: lora}}"]).plan.run.lora
    assert (lora.rank, lora.alpha, lora.dropout, lora.target_modules) == (8, 16.0, 0.01, r".*dense*|.*linear*")


def test_mcore_pet_config_draws_a_from_a_normal():
    """Graph-mode mcore: ColumnParallelLinearWithLoRA's lora_a_init 'normal' (sigma 0.01), named `lora_A.weight`."""
    lora = translate_file(str(CONFIGS / "tiny_qwen3_moe.yaml"),
                          [f"{PET}={{pet_type: lora, target_modules: '.*linear_proj'}}"]).plan.run.lora
    assert (lora.style, lora.a_init, lora.a_std, lora.b_std) == ("mcore", "normal", 0.01, 0.0)


@pytest.mark.parametrize(("value", "path", "expected"), [
    ("{pet_type: prefix_tuning}", f"{PET}.pet_type", "mf-ds runs LoRA only"),
    ("{pet_type: lora, freeze_include: ['*']}", f"{PET}.freeze_include", "not supported"),
    ("{pet_type: lora, lora_rnak: 4}", f"{PET}.lora_rnak", "not a LoraConfig key"),
    ("{pet_type: lora, lora_rank: 0}", f"{PET}.lora_rank", "must be >= 1"),
    ("{pet_type: lora, lora_dropout: 1.5}", f"{PET}.lora_dropout", "must be in [0.0, 1.0)"),
    ("{pet_type: lora, target_modules: '(wq'}", f"{PET}.target_modules", "not a regular expression"),
])
def test_bad_pet_config_is_one_line(value, path, expected):
    with pytest.raises(ConfigError) as caught:
        translate_file(str(LORA_7B), [f"{PET}={value}"])
    assert caught.value.path == path and expected in str(caught.value)


def test_pynative_lora_config():
    """No longer refused: 2.1.0's LoraConfig with its normal init (lora_a_std, lora_b_std)."""
    lora = translate_file(str(QWEN3), ["lora_config={lora_rank: 4, lora_alpha: 8, lora_a_std: 0.02, "
                                       "target_modules: 'linear_qkv'}"]).plan.run.lora
    assert (lora.source, lora.style, lora.rank, lora.alpha, lora.a_std, lora.b_std) == \
        ("lora_config", "pynative", 4, 8.0, 0.02, 0.0)
    assert translate_file(str(QWEN3)).plan.run.lora is None
