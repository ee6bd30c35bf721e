"""Tied embeddings as MindFormers builds them (issue 33 item 6). Qwen3 and Qwen3-MoE tie the output layer to the
embedding by tie_word_embeddings alone (modeling_qwen3_train.py: share_embeddings_and_output_weights=
self.config.tie_word_embeddings, 1.7.0 to 2.1.0); untie_embeddings_and_output_weights is read by no model, so the
2.1.0 wheel's finetune_qwen3.yaml (untie_embeddings_and_output_weights: True) with a tied Qwen3-0.6B / 1.7B / 4B
pretrained_model_dir trains tied, as its README lists these sizes. DeepSeek-V3's GPTModel is built without
share_embeddings_and_output_weights: never tied."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import CPU_ENV, ROOT
from translators.plan import translate_file

WHEEL = ROOT / "tests" / "fixtures" / "mindformers_wheels" / "2.1.0"
FINETUNE = WHEEL / "qwen3" / "finetune_qwen3.yaml"
# Qwen3-0.6B's config.json, shrunk to the YAML's layout (4 stages, model_parallel 4; its keys and tie kept)
QWEN3_SMALL = {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
               "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 16, "hidden_act": "silu",
               "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 128,
               "max_position_embeddings": 40960, "max_window_layers": 4, "model_type": "qwen3",
               "num_attention_heads": 4, "num_hidden_layers": 4, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
               "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
               "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
               "use_sliding_window": False, "vocab_size": 256}


@pytest.fixture
def tied_dir(tmp_path):
    directory = tmp_path / "Qwen3-0.6B"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(QWEN3_SMALL))
    return directory


def test_finetune_qwen3_with_a_tied_model_is_tied(tied_dir):
    result = translate_file(str(FINETUNE), [f"pretrained_model_dir={tied_dir}"])
    assert result.plan.hf_config["tie_word_embeddings"] is True
    lines = {line.split(" = ")[0]: line for line in result.ledger.explain()}
    assert "[dropped] read by no MindFormers mcore model" in \
        lines["model.model_config.untie_embeddings_and_output_weights"]
    from mf_ds.model import hf_config, new_model

    model = new_model(hf_config(result.plan))
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_mf_translate_takes_it(tied_dir):
    proc = subprocess.run([sys.executable, "-m", "translators.cli", str(FINETUNE), "--set",
                           f"pretrained_model_dir={tied_dir}"], cwd=ROOT, env=CPU_ENV, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "contradicts" not in proc.stderr


def test_an_untied_model_stays_untied(tied_dir):
    (tied_dir / "config.json").write_text(json.dumps({**QWEN3_SMALL, "tie_word_embeddings": False}))
    plan = translate_file(str(FINETUNE), [f"pretrained_model_dir={tied_dir}"]).plan
    assert plan.hf_config["tie_word_embeddings"] is False
    plan = translate_file(str(FINETUNE), [f"pretrained_model_dir={tied_dir}",
                                          "model.model_config.tie_word_embeddings=true"]).plan
    assert plan.hf_config["tie_word_embeddings"] is True  # the YAML over config.json, as MindFormers merges them


def test_deepseek_v3_is_never_tied():
    path = WHEEL / "deepseek3" / "pretrain_deepseek3_671b.yaml"
    result = translate_file(str(path), ["model.model_config.tie_word_embeddings=true"])
    assert result.plan.hf_config["tie_word_embeddings"] is False
    assert [note.line() for note in result.warnings if note.key.endswith("tie_word_embeddings")] == [
        "model.model_config.tie_word_embeddings: [differs] MindFormers builds this family's GPTModel without "
        "share_embeddings_and_output_weights: its output layer is never the embedding; untied here too"]
