"""LoRA on a pipeline (mf_ds/pipeline_lora.py): PEFT's adapters on each stage's layers, one rank's losses and global
norms (over the adapters), and one rank's exported adapter and merged weights, name by name."""

from __future__ import annotations

import json
import re

import pytest
import torch

from tests.mf_ds.test_pipeline import FOUR, PIPE, _run, plan_of
from tests.mf_ds.test_train import metrics

# legacy Llama's names: adapters on the attention's q, v, o and the MLP's down projection, in every layer
LORA = ("model.model_config.pet_config={pet_type: lora, lora_rank: 4, lora_alpha: 8, lora_dropout: 0.0, "
        "target_modules: '.*wq|.*wv|.*wo|.*w2'}",)


def _files(out) -> tuple[dict, dict, dict]:
    from safetensors.torch import load_file

    root = out / "lora"
    return (load_file(str(root / "adapter" / "adapter_model.safetensors")),
            json.loads((root / "adapter" / "adapter_config.json").read_text()),
            load_file(str(root / "merged" / "model.safetensors")))


@pytest.mark.deepspeed
def test_lora_on_two_stages_equals_one_rank(tmp_path):
    """pp 2 on 2 ranks, ZeRO-1 over the adapters, clipping at 1.0: losses and global norms equal one rank's; only
    adapters train; the exported adapter directory and merged weights equal one rank's name by name."""
    from mf_ds.model import build_model

    build_model(plan_of("parallel_config.data_parallel=1", *FOUR).plan).save_pretrained(str(tmp_path / "init"))
    one = _run(tmp_path / "one", "parallel_config.data_parallel=1", "runner_config.gradient_accumulation_steps=4",
               *LORA)
    two = _run(tmp_path / "two", *PIPE, "mf_ds.zero_stage=1", *LORA, ranks=2)
    a, b = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert [m["loss"] for m in b] == pytest.approx([m["loss"] for m in a], rel=1e-5)
    assert [m["grad_norm"] for m in b] == pytest.approx([m["grad_norm"] for m in a], rel=1e-5)
    assert a[0]["loss"] != a[-1]["loss"]  # the adapters moved
    placed = [re.findall(r"mf-ds: lora: \d+ adapters .* parameters train", p.stderr) for p in (one, two)]
    assert placed[0] == placed[1] and len(placed[0]) == 1, placed  # the same adapters, the same counts
    assert "16 adapters of rank 4, alpha 8 on w2, wo, wq, wv" in placed[0][0], placed
    adapters, config, merged = _files(tmp_path / "two")
    want_adapters, want_config, want_merged = _files(tmp_path / "one")
    # PEFT keeps target_modules as a set: its JSON order is the set's, which varies from process to process
    assert sorted(config.pop("target_modules")) == sorted(want_config.pop("target_modules"))
    assert config == want_config and config["base_model_name_or_path"] == str(tmp_path / "init")
    assert adapters.keys() == want_adapters.keys() and len(adapters) == 32
    for name, value in want_adapters.items():
        torch.testing.assert_close(adapters[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert merged.keys() == want_merged.keys()
    for name, value in want_merged.items():
        torch.testing.assert_close(merged[name], value, rtol=1e-5, atol=1e-6, msg=name)
