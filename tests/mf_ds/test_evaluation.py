"""do_eval as MindFormers schedules and computes it (translators/evaluation.py, mf_ds/evaluation.py).

The run: the shrunk llama2 finetune YAML of the Trainer references (tests/fixtures/mindformers/run/), 5 steps per
epoch, evaluated on its own MindRecord file with eval_step_interval 3 and eval_epoch_interval 2: EvalCallBack
evaluates after steps 3, 6 and 9, and at the end of epoch 2 (step 10). The eval loss is checked against the weights
saved at step 10, evaluated here with transformers alone: PerplexityMetric's mean of the 5 batches' mean losses.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import CPU_ENV, ROOT
from tests.mf_ds.test_mindformers_run import RUN
from translators.errors import ConfigError
from translators.plan import translate_file

YAML = RUN / "finetune_llama2_tiny.yaml"
EVAL = [f"eval_dataset.data_loader.dataset_dir={RUN / 'data.mindrecord'}", "eval_dataset.input_columns=[input_ids, "
        "labels]", "do_eval=True", "eval_step_interval=3", "eval_epoch_interval=2"]


def test_the_schedule_is_eval_callbacks():
    """base_trainer.py: step_interval `eval_step_interval or 100`, epoch_interval `eval_epoch_interval or -1`."""
    run = translate_file(str(YAML), EVAL).plan.run
    assert (run.evaluation.step_interval, run.evaluation.epoch_interval) == (3, 2)
    assert run.evaluation.data.kind == "mindrecord" and not run.evaluation.data.shuffle
    zero = translate_file(str(YAML), [*EVAL[:3], "eval_step_interval=0", "eval_epoch_interval=0"]).plan.run
    assert (zero.evaluation.step_interval, zero.evaluation.epoch_interval) == (100, -1)
    off = translate_file(str(YAML))
    assert off.plan.run.evaluation is None
    assert {n.kind for n in off.plan.notes if n.key.startswith(("do_eval", "eval_dataset", "metric"))} == {"dropped"}


def test_do_eval_without_data_is_one_line():
    with pytest.raises(ConfigError, match="eval_dataset.data_loader: do_eval: True needs data to evaluate on"):
        translate_file(str(YAML), ["do_eval=True"])


def _eval_loss_of(weights, batch: int) -> float:
    """PerplexityMetric by hand: the mean over the eval batches of each batch's mean token loss."""
    from transformers import AutoModelForCausalLM

    from mf_ds.data import MindRecord

    model = AutoModelForCausalLM.from_pretrained(str(weights)).eval()
    data = MindRecord([str(RUN / "data.mindrecord")])
    rows = [data.row(i) for i in range(len(data))]
    losses = []
    for start in range(0, len(rows), batch):
        part = rows[start:start + batch]
        ids = torch.tensor([r["input_ids"][:-1] for r in part], dtype=torch.long)
        labels = torch.tensor([r["labels"][1:] for r in part], dtype=torch.long)
        with torch.no_grad():
            losses.append(model(input_ids=ids, labels=labels, shift_labels=labels).loss.item())
    return sum(losses) / len(losses)


@pytest.fixture(scope="module")
def mf_train(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("eval")
    proc = subprocess.run([sys.executable, "-m", "mf_ds.cli", str(YAML), "--output_dir", str(tmp_path),
                           *[a for s in EVAL for a in ("--set", s)]],
                          cwd=ROOT, env=CPU_ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp_path, proc.stderr


def test_mf_train_evaluates_at_the_yaml_intervals(mf_train):
    tmp_path, stderr = mf_train
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evaluated = {r["step"]: r for r in rows if "eval_loss" in r}
    assert sorted(evaluated) == [3, 6, 9, 10]
    assert all(r["eval_batches"] == 5 and r["eval_ppl"] == pytest.approx(math.exp(r["eval_loss"]))
               for r in evaluated.values())
    # the epoch-end evaluation of step 10 saw the weights the run saved at its end
    assert evaluated[10]["eval_loss"] == pytest.approx(
        _eval_loss_of(tmp_path / "checkpoint" / "llama2_7b-step10", 2), abs=1e-5)
    lines = [line for line in stderr.splitlines() if line.startswith("{ Epoch") and "eval_loss" in line]
    assert [int(line.split("step:[")[1].split("/")[0]) for line in lines] == [3, 6, 9, 10]
    assert "mf-ds: eval: step 9: Eval result: {'loss': " in stderr
    from mf_ds.report import plot_run

    plotted = plot_run(tmp_path)["loss.png"]
    assert plotted["eval_step"] == [3, 6, 9, 10]
    assert os.path.isdir(tmp_path / "tensorboard")


def test_the_hf_trainer_path_evaluates_the_same(tmp_path, mf_train):
    """mf_ds.hf: the same evaluations, the same numbers as mf-train's (in one process, 6 steps; the YAML's
    eval_epoch_interval left at -1)."""
    script = ("import json,sys; from mf_ds.hf import from_mf_yaml; "
              "s = from_mf_yaml(sys.argv[1], output_dir=sys.argv[2], max_steps=6, **json.loads(sys.argv[3])); "
              "s.trainer().train()")
    overrides = {"do_eval": True, "eval_step_interval": 3, "eval_dataset.data_loader.dataset_dir":
                 str(RUN / "data.mindrecord"), "eval_dataset.input_columns": ["input_ids", "labels"]}
    env = {**CPU_ENV, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29713"}
    proc = subprocess.run([sys.executable, "-c", script, str(YAML), str(tmp_path / "hf"), json.dumps(overrides)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "hf" / "metrics.jsonl").read_text().splitlines()]
    evaluated = {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r}
    assert sorted(evaluated) == [3, 6]
    ours = {r["step"]: r["eval_loss"] for r in map(json.loads, (mf_train[0] / "metrics.jsonl").read_text().splitlines())
            if "eval_loss" in r}
    assert evaluated == pytest.approx({3: ours[3], 6: ours[6]}, abs=2e-6)
