"""LoRA on a pipeline (mf_ds/pipeline_lora.py): PEFT's adapters on each stage's layers, one rank's losses and global
norms (over the adapters), and one rank's exported adapter and merged weights, name by name."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import QUIET_CPU_ENV, ROOT, ds_launch
from tests.mf_ds.test_pipeline import FOUR, PIPE, _run, plan_of
from tests.mf_ds.test_train import LLAMA, metrics

# legacy Llama's names: adapters on the attention's q, v, o and the MLP's down projection, in every layer
LORA = ("model.model_config.pet_config={pet_type: lora, lora_rank: 4, lora_alpha: 8, lora_dropout: 0.0, "
        "target_modules: '.*wq|.*wv|.*wo|.*w2'}",)
# tied embeddings (TiedLayerSpec: the embedding on the first and the last stage), frozen under LoRA
TIE = "model.model_config.tie_word_embeddings=True"
SAVING = ("callbacks=[{type: MFLossMonitor, per_print_times: 1}, {type: CheckpointMonitor, prefix: t, "
          "save_checkpoint_steps: 2, keep_checkpoint_max: 2}]")


def _adapter(directory) -> tuple[dict, dict]:
    return (load_file(str(directory / "adapter_model.safetensors")),
            json.loads((directory / "adapter_config.json").read_text()))


def _resumed(out, *sets: str) -> subprocess.CompletedProcess:
    """2 stages on 2 ranks: steps 1-2 (a checkpoint at 2), then resumed from it for step 3 (test_pipeline._run's
    launch, in two parts)."""
    args = ["--output_dir", str(out), "--load_checkpoint", str(out.parent / "init")]
    for item in (*FOUR, TIE, SAVING, *sets):
        args += ["--set", item]
    launch = [*ds_launch(2), str(ROOT / "mf_ds" / "train.py"), "--mf-config", LLAMA, *args]
    for more in (["--max_steps", "2"], ["--max_steps", "3", "--resume_training"]):
        proc = subprocess.run(launch + more, cwd=ROOT, env=QUIET_CPU_ENV, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.deepspeed
def test_lora_on_two_stages_equals_one_rank(tmp_path):
    """pp 2 on 2 ranks, ZeRO-1 over the adapters, stopped after step 2 and resumed from its checkpoint: losses and
    global norms equal one rank's 3 steps; the checkpoint of step 3 holds one rank's adapter files, and the export
    at the end (adapter directory, merged weights) equals one rank's, name by name."""
    from mf_ds.model import build_model

    build_model(plan_of("parallel_config.data_parallel=1", *FOUR, TIE).plan).save_pretrained(str(tmp_path / "init"))
    one = _run(tmp_path / "one", "parallel_config.data_parallel=1", "runner_config.gradient_accumulation_steps=4",
               *LORA, base=(*FOUR, TIE, SAVING))
    two = _resumed(tmp_path / "two", *PIPE, "mf_ds.zero_stage=1", *LORA)
    a, b = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert [m["step"] for m in b] == [1, 2, 3] and "resumed from " in two.stderr and "at step 2" in two.stderr
    assert [m["loss"] for m in b] == pytest.approx([m["loss"] for m in a], rel=1e-5)
    assert [m["grad_norm"] for m in b] == pytest.approx([m["grad_norm"] for m in a], rel=1e-5)
    assert a[0]["loss"] != a[-1]["loss"]  # the adapters moved
    placed = [re.findall(r"mf-ds: lora: \d+ adapters .* parameters train", p.stderr) for p in (one, two)]
    assert placed[0] == placed[1] and len(placed[0]) == 1, placed  # the same adapters, the same counts
    assert "16 adapters of rank 4, alpha 8 on w2, wo, wq, wv" in placed[0][0], placed
    for where in ("checkpoint/t-step3", "lora/adapter"):
        adapters, config = _adapter(tmp_path / "two" / where)
        want_adapters, want_config = _adapter(tmp_path / "one" / where)
        # PEFT keeps target_modules as a set: its JSON order is the set's, which varies from process to process
        assert sorted(config.pop("target_modules")) == sorted(want_config.pop("target_modules"))
        assert config == want_config and config["base_model_name_or_path"] == str(tmp_path / "init")
        assert adapters.keys() == want_adapters.keys() and len(adapters) == 32, where
        for name, value in want_adapters.items():
            torch.testing.assert_close(adapters[name], value, rtol=1e-5, atol=1e-6, msg=name)
    merged, want_merged = (load_file(str(tmp_path / run / "lora" / "merged" / "model.safetensors"))
                           for run in ("two", "one"))
    assert merged.keys() == want_merged.keys()
    for name, value in want_merged.items():
        torch.testing.assert_close(merged[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_an_adapter_on_the_lm_head_is_one_line():
    """The last stage lends the head's weight to the loss (pipeline_stage.StageLoss): no adapter there yet."""
    from types import SimpleNamespace

    from mf_ds.errors import RunError
    from mf_ds.pipeline import Pieces
    from mf_ds.pipeline_lora import attach

    head = "model.model_config.pet_config={pet_type: lora, lora_rank: 4, lora_alpha: 8, target_modules: '.*wq|lm_head'}"
    plan = plan_of(*PIPE, *FOUR, head, world_size=2).plan
    with pytest.raises(RunError, match="an adapter on the LM head is not composed with the pipeline yet"):
        attach(SimpleNamespace(pieces=Pieces(plan, None)), plan, None, None)
