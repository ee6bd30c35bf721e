"""A misspelt mcore model key (issue 33 item 4): refused in one line with a did-you-mean where MindFormers' mcore
conversion refuses it (1.7.0, 1.8.0: convert_to_transformer_config raises), a warning naming the right key where
MindFormers only warns and trains without it (1.9.0 on: the config class's ConfigConverter). And 1.7.0's own
spelling residual_dtype (issue 33 item 6), checked against MindFormers 1.7.0's conversion run on CPU."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from tests.conftest import CORPUS, CPU_ENV, ROOT, needs_shared
from translators.errors import ConfigError
from translators.families import mcore_keys
from translators.loader import load_yaml
from translators.plan import translate_file

QWEN3_21 = ROOT / "tests" / "fixtures" / "mindformers_wheels" / "2.1.0" / "qwen3" / "pretrain_qwen3_32b_4k.yaml"
QWEN3_MOE_17 = CORPUS / "r1.7.0__configs__qwen3_moe__pretrain_qwen3_30b_a3b_4k.yaml"
TYPO = "model.model_config.num_hidden_layer=8"


@needs_shared
def test_refused_where_mindformers_refuses_it():
    """The 1.7.0 YAML under 1.7.0, and the 2.1.0 YAML under 1.8.0; mf-train stops before building anything."""
    for path, version in ((QWEN3_MOE_17, "1.7.0"), (QWEN3_21, "1.8.0")):
        with pytest.raises(ConfigError) as refused:
            translate_file(str(path), [TYPO], mindformers_version=version)
        assert str(refused.value).startswith("model.model_config.num_hidden_layer: not a Qwen3")
        assert str(refused.value).endswith(f"MindFormers {version}'s mcore conversion refuses it "
                                           "(convert_to_transformer_config); did you mean 'num_hidden_layers'?")
    proc = subprocess.run([sys.executable, "-m", "mf_ds.cli", str(QWEN3_MOE_17), "--set", TYPO, "--set",
                           "mindformers_version=1.7.0"], cwd=ROOT, env=CPU_ENV, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith("did you mean 'num_hidden_layers'?")


def test_a_warning_where_mindformers_only_warns():
    """2.1.0 (the YAML's own version): MindFormers' Qwen3ConfigConverter logs the key as not in its mapping and
    trains the YAML's 64 layers; so does mf-ds, with the warning and the right spelling."""
    result = translate_file(str(QWEN3_21), [TYPO], mindformers_version="2.1.0")
    lines = [note.line() for note in result.warnings if note.key == "model.model_config.num_hidden_layer"]
    assert lines == ["model.model_config.num_hidden_layer: [unknown] not a Qwen3Config key (MindFormers 2.1.0's "
                     "config converter only warns that it is not in its mapping and trains without it); ignored; did "
                     "you mean 'num_hidden_layers'?"]
    assert result.plan.hf_config["num_hidden_layers"] == 64


def test_the_table_says_which_versions_refuse():
    assert {v for v in ("1.7.0", "1.8.0", "1.9.0", "2.0.0", "2.1.0") if mcore_keys.accepted(v) is not None} == {
        "1.7.0", "1.8.0"}
    keys = mcore_keys.accepted("1.7.0")
    # COMMON_CONFIG_MAPPING's spellings, DEFAULT_WHITE_KEY's entries, and residual_dtype (1.7.0 maps it)
    assert {"num_hidden_layers", "num_layers", "n_layer", "use_past", "residual_dtype"} <= keys
    assert "num_hidden_layer" not in keys


GOLDEN = ROOT / "tests" / "fixtures" / "mcore_conversion_1.7.0.json"


@pytest.mark.parametrize("case", json.loads(GOLDEN.read_text()), ids=lambda c: json.dumps(c["keys"]))
def test_mindformers_170s_conversion_decides(tmp_path, case):
    """Each case as MindFormers 1.7.0's Qwen3Config + convert_to_transformer_config took it (golden file): refused
    where it raised; otherwise the residual precision it chose is what the ledger says (issue 33 items 4 and 6)."""
    tree = load_yaml(str(QWEN3_21))
    config = tree["model"]["model_config"]
    del config["fp32_residual_connection"]  # 1.8.0's spelling, which the 2.1.0 YAML writes
    config.update(case["keys"])
    path = tmp_path / "x.yaml"
    path.write_text(yaml.safe_dump(tree))
    if "error" in case:
        with pytest.raises(ConfigError) as refused:
            translate_file(str(path), mindformers_version="1.7.0")
        assert str(refused.value).startswith(f"model.model_config.{next(iter(case['keys']))}: ")
        return
    lines = [line for line in translate_file(str(path), mindformers_version="1.7.0").ledger.explain()
             if "residual" in line]
    fp32 = any("[differs]" in line and "fp32_residual_connection True" in line for line in lines)
    assert fp32 == case["fp32_residual_connection"], lines
    assert len(lines) == len(case["keys"])
