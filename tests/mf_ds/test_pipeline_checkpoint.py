"""Checkpoints of a pipelined run (mf_ds/checkpoint/pipelined.py): the HF weights a one-rank run writes, written per
stage; a kill mid-run resumes with the straight run's losses; mf-convert exports them; another stage count is
refused in one line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mf_ds.checkpoint import native
from mf_ds.checkpoint.pipelined import INDEX, load
from mf_ds.errors import RunError
from mf_ds.pipeline import refusal
from tests.conftest import QUIET_CPU_ENV, ROOT, ds_launch
from tests.mf_ds.test_pipeline import FOUR, PIPE, plan_of
from tests.mf_ds.test_train import LLAMA, metrics

SAVE = "callbacks=[{type: MFLossMonitor, per_print_times: 1}, {type: CheckpointMonitor, prefix: t, " \
    "save_checkpoint_steps: 2, keep_checkpoint_max: 1}]"
SHORT = [*FOUR, "model.model_config.seq_length=32"]


def test_saving_and_resuming_are_no_longer_refused_but_checkpoint2_is():
    assert refusal(plan_of(*PIPE, SAVE).plan, resume2=False) is None
    # Checkpoint 2.0 saves fold the stages at translation time (translators/pipeline_compose.py)
    legacy_off = plan_of(*PIPE, SAVE.replace("keep_checkpoint_max: 1", "keep_checkpoint_max: 1, "
                                             "use_legacy_format: False")).plan
    assert legacy_off.parallel.pipeline_stage is None
    assert "use_legacy_format: True" in legacy_off.parallel.folded["parallel_config.pipeline_stage"]
    assert "resuming a Checkpoint 2.0" in refusal(plan_of(*PIPE, SAVE).plan, resume2=True)


def test_a_pipelined_checkpoint_without_a_pipeline_and_back_is_refused_in_one_line(tmp_path):
    """Another count of stages resumes (test_a_killed_pipeline_resumes... below); a run without a pipeline keeps
    DeepSpeed's module in one file, a pipelined one per layer: between them, one line naming both counts."""
    (tmp_path / native.STATE).write_text(json.dumps({"step": 2, "pipeline_stage": 2}))
    with pytest.raises(RunError) as caught:
        load(None, tmp_path, plan_of("parallel_config.data_parallel=1").plan, None, trust=False)
    line = str(caught.value)
    assert "\n" not in line and "saved by a run of 2 pipeline stage(s), this run has 1" in line
    assert "parallel_config.pipeline_stage: 2" in line and "--load_checkpoint" in line
    (tmp_path / native.STATE).write_text(json.dumps({"step": 2}))  # a run without a pipeline wrote it
    with pytest.raises(RunError, match="saved by a run of 1 pipeline stage"):
        load(None, tmp_path, plan_of(*PIPE).plan, None, trust=False)


def _train(out: Path, *sets: str, ranks: int = 1, args: tuple = (), env: dict | None = None) -> \
        subprocess.CompletedProcess:
    cmd = [*ds_launch(ranks), str(ROOT / "mf_ds" / "train.py"), "--mf-config", LLAMA] if ranks > 1 else \
        [sys.executable, "-m", "mf_ds.cli", LLAMA]
    cmd += ["--output_dir", str(out), *args]
    for item in (*SHORT, *sets):
        cmd += ["--set", item]
    return subprocess.run(cmd, cwd=ROOT, env={**QUIET_CPU_ENV, **(env or {})}, capture_output=True, text=True,
                          timeout=600)


def _ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _hf_copy(src: Path, dst: Path) -> Path:
    """The HF files of a checkpoint alone (a weights-only start: no trainer_state.json)."""
    dst.mkdir()
    for path in src.iterdir():
        if path.name in ("config.json", INDEX) or path.suffix == ".safetensors":
            shutil.copy(path, dst / path.name)
    return dst


@pytest.mark.deepspeed
def test_a_killed_pipeline_resumes_exactly_and_saves_what_one_rank_saves(tmp_path):
    """pp 2 on 2 ranks, ZeRO-1, 4 steps, a checkpoint every 2 (keep 1): SIGKILLed at step 3 (after save 2), resumed;
    its losses and norms equal one rank's straight run (fp32, rel 1e-5; pipelined == one rank:
    tests/mf_ds/test_pipeline.py), its step-4 HF weights equal one rank's step-4 weights, `from_pretrained`, a
    one-rank mf-train run and mf-convert read them; resumed on 4 stages for steps 5-6, still one rank's losses; a
    one-rank resume of it is refused in one line."""
    from transformers import AutoModelForCausalLM

    from mf_ds.convert import cli
    from mf_ds.model import build_model

    from_init = ("--load_checkpoint", str(tmp_path / "init"), "--max_steps", "4")
    build_model(plan_of("parallel_config.data_parallel=1", *SHORT).plan).save_pretrained(str(tmp_path / "init"))
    _ok(_train(tmp_path / "one", SAVE.replace("keep_checkpoint_max: 1", "keep_checkpoint_max: 2"),
               "parallel_config.data_parallel=1", "runner_config.gradient_accumulation_steps=4",
               args=("--load_checkpoint", str(tmp_path / "init"), "--max_steps", "6")))
    one = metrics(tmp_path / "one")
    assert max(m["grad_norm"] for m in one) > 1.0  # clipping at 1.0 active
    pipe = (*PIPE, "mf_ds.zero_stage=1", SAVE)
    killed = _train(tmp_path / "pp", *pipe, ranks=2, args=from_init, env={native.KILL_AT: "step.update@3"})
    assert killed.returncode != 0 and [p.name for p in native.complete(tmp_path / "pp" / "checkpoint")] == \
        ["t-step2"]
    resumed = _ok(_train(tmp_path / "pp", *pipe, ranks=2, args=(*from_init, "--resume_training")))
    assert f"resumed from {tmp_path / 'pp' / 'checkpoint' / 't-step2'} at step 2" in resumed.stderr
    two = metrics(tmp_path / "pp")
    assert [m["step"] for m in two] == [1, 2, 3, 4]
    for key in ("loss", "grad_norm"):
        assert [m[key] for m in two] == pytest.approx([m[key] for m in one[:4]], rel=1e-5), key

    saved = tmp_path / "pp" / "checkpoint" / "t-step4"
    assert [p.name for p in native.complete(saved.parent)] == ["t-step4"]  # keep_checkpoint_max 1 pruned 2
    assert native.verify(saved, required=True) is None
    assert sorted(p.name for p in saved.glob("*.safetensors")) == ["model-00001-of-00002.safetensors",
                                                                   "model-00002-of-00002.safetensors"]
    assert json.loads((saved / native.STATE).read_text())["pipeline_stage"] == 2
    loaded = AutoModelForCausalLM.from_pretrained(str(saved), dtype=torch.float32).state_dict()
    expected = load_file(str(tmp_path / "one" / "checkpoint" / "t-step4" / "model.safetensors"))
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(loaded[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    assert (saved / "config.json").read_text() == (tmp_path / "one" / "checkpoint" / "t-step4" /
                                                   "config.json").read_text()

    # mf-convert: the pipelined output to a MindFormers .ckpt and back, bit for bit
    sets = [arg for item in SHORT for arg in ("--set", item)]
    assert cli(["--mf-config", LLAMA, *sets, str(saved), str(tmp_path / "pp.ckpt")]) == 0
    assert cli(["--mf-config", LLAMA, *sets, str(tmp_path / "pp.ckpt"), str(tmp_path / "back")]) == 0
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert back.keys() == loaded.keys() and all(torch.equal(back[k], loaded[k]) for k in back)

    # a one-rank run starts from the pipelined weights as from its own: the same first loss
    firsts = []
    for name, source in (("from_pp", saved), ("from_one", tmp_path / "one" / "checkpoint" / "t-step4")):
        weights = _hf_copy(source, tmp_path / f"{name}-weights")
        _ok(_train(tmp_path / name, "parallel_config.data_parallel=1", "runner_config.gradient_accumulation_steps=4",
                   args=("--load_checkpoint", str(weights), "--max_steps", "1")))
        firsts.append(metrics(tmp_path / name)[0]["loss"])
    assert firsts[0] == pytest.approx(firsts[1], rel=1e-5) and firsts[0] < one[0]["loss"]

    # the 2-stage checkpoint resumed on 4 stages (4 ranks, a layer each): weights by layer, the ZeRO-1 state per
    # parameter (mf_ds/checkpoint/restage.py); steps 5-6 as one rank's
    four = ("parallel_config.data_parallel=1", "parallel_config.pipeline_stage=4", *PIPE[2:], "mf_ds.zero_stage=1",
            SAVE)
    _ok(_train(tmp_path / "pp", *four, ranks=4, args=("--load_checkpoint", str(tmp_path / "init"), "--max_steps",
                                                      "6", "--resume_training")))
    six = metrics(tmp_path / "pp")
    assert [m["step"] for m in six] == [1, 2, 3, 4, 5, 6]
    for key in ("loss", "grad_norm"):
        assert [m[key] for m in six] == pytest.approx([m[key] for m in one], rel=1e-5), key

    # one rank resuming the 4-stage checkpoint: refused in one line, before DeepSpeed reads files of another layout
    other = _train(tmp_path / "pp", SAVE, "parallel_config.data_parallel=1",
                   "runner_config.gradient_accumulation_steps=4", args=(*from_init, "--resume_training"))
    assert other.returncode == 2
    errors = [line for line in other.stderr.splitlines() if "saved by a run of 4 pipeline stage(s)" in line]
    assert len(errors) == 1 and "this run has 1" in errors[0]


def test_another_stage_count_without_zero1_is_refused_in_one_line(tmp_path):
    """Without ZeRO-1 shards (mf_ds.zero_stage 0: the optimizer state per stage, by position) nothing names each
    parameter's state: another stage count is refused, naming both counts and the weights-only start."""
    from types import SimpleNamespace

    from mf_ds.checkpoint.restage import load as restage

    (tmp_path / native.STATE).write_text(json.dumps({"step": 2, "pipeline_stage": 2}))
    state = tmp_path / native.ENGINE / "state"
    state.mkdir(parents=True)
    (state / "mp_rank_00_model_states.pt").write_bytes(b"")
    engine = SimpleNamespace(grid=SimpleNamespace(get_pipe_parallel_world_size=lambda: 4))
    with pytest.raises(RunError) as caught:
        restage(engine, tmp_path, {"0.embed_tokens.weight": ("exp_avg", "exp_avg_sq")}, 2, trust=False)
    line = str(caught.value)
    assert "\n" not in line and "saved by a run of 2 pipeline stages, this run has 4" in line
    assert "ZeRO-1" in line and "parallel_config.pipeline_stage: 2" in line and "--load_checkpoint" in line
