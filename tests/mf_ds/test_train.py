"""The main job end to end: gradient accumulation, clipping, resume, checkpoints, data parallelism, configs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import CONFIGS, CORPUS, CPU_ENV, ROOT, ds_launch, free_port, needs_shared

LLAMA = str(CONFIGS / "tiny_llama.yaml")
ENV = CPU_ENV


def train(tmp: Path, *args: str, config: str = LLAMA, launcher: list[str] | None = None,
          check: bool = True) -> subprocess.CompletedProcess:
    cmd = (launcher or [sys.executable, "-m", "mf_ds.cli", config]) + ["--output_dir", str(tmp), *args]
    if launcher:
        cmd = launcher + ["--mf-config", config, "--output_dir", str(tmp), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def metrics(tmp: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp / "metrics.jsonl").read_text().splitlines()]


def weights(tmp: Path) -> dict[str, torch.Tensor]:
    latest = (tmp / "checkpoint" / "latest").read_text().strip()
    return load_file(str(tmp / "checkpoint" / latest / "model.safetensors"))


def test_gradient_accumulation_equals_a_bigger_micro_batch(tmp_path):
    """GA 4 x micro batch 1 == GA 1 x micro batch 4 after 3 steps (fp32, 1e-5)."""
    common = ["--max_steps", "3", "--set", "parallel_config.data_parallel=1"]
    train(tmp_path / "ga", *common, "--set", "runner_config.batch_size=1",
          "--set", "runner_config.gradient_accumulation_steps=4")
    train(tmp_path / "mb", *common, "--set", "runner_config.batch_size=4",
          "--set", "runner_config.gradient_accumulation_steps=1")
    a, b = weights(tmp_path / "ga"), weights(tmp_path / "mb")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-5, msg=name)
    losses_a = [m["loss"] for m in metrics(tmp_path / "ga")]
    losses_b = [m["loss"] for m in metrics(tmp_path / "mb")]
    assert losses_a == pytest.approx(losses_b, rel=1e-5)


def test_resume_continues_with_the_same_losses(tmp_path):
    """6 steps straight == 3 steps, stop, resume, 3 steps."""
    save_every = ["--set", "callbacks=[{type: MFLossMonitor}, {type: CheckpointMonitor, prefix: t, "
                  "save_checkpoint_steps: 3, keep_checkpoint_max: 2}]"]
    train(tmp_path / "straight", "--max_steps", "6", *save_every)
    train(tmp_path / "split", "--max_steps", "3", *save_every)
    train(tmp_path / "split", "--max_steps", "6", "--resume_training", *save_every)
    straight = [m["loss"] for m in metrics(tmp_path / "straight")]
    split = [m["loss"] for m in metrics(tmp_path / "split")]
    assert [m["step"] for m in metrics(tmp_path / "split")] == [1, 2, 3, 4, 5, 6]
    assert split == pytest.approx(straight, rel=1e-6)
    a, b = weights(tmp_path / "straight"), weights(tmp_path / "split")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-6, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory) -> Path:
    """One 2-step run of tiny_llama, read by the checkpoint tests below (one launch instead of one each)."""
    out = tmp_path_factory.mktemp("two_steps")
    train(out, "--max_steps", "2")
    return out


def test_checkpoint_is_hf_layout_and_atomic(tmp_path, two_steps):
    from transformers import AutoModelForCausalLM

    shutil.copytree(two_steps / "checkpoint", tmp_path / "checkpoint")  # a copy: a stale save is planted in it
    latest = tmp_path / "checkpoint" / (tmp_path / "checkpoint" / "latest").read_text().strip()
    model = AutoModelForCausalLM.from_pretrained(str(latest))
    assert model.config.num_hidden_layers == 2
    assert not list((tmp_path / "checkpoint").glob("*.tmp"))
    # A save interrupted after the engine state: the stale .tmp is ignored and the last complete one wins.
    stale = tmp_path / "checkpoint" / "tiny_llama-step9.tmp"
    shutil.copytree(latest, stale)
    (stale / "trainer_state.json").unlink()
    from mf_ds.checkpoint.native import latest as find_latest

    assert find_latest(tmp_path / "checkpoint") == latest


def test_weights_from_an_hf_directory(tmp_path, two_steps):
    src = two_steps / "checkpoint" / (two_steps / "checkpoint" / "latest").read_text().strip()
    hf_dir = tmp_path / "hf"
    shutil.copytree(src, hf_dir, ignore=shutil.ignore_patterns("engine", "trainer_state.json", "rng.json"))
    first = metrics(two_steps)[-1]["loss"]
    train(tmp_path / "b", "--max_steps", "1", "--load_checkpoint", str(hf_dir))
    assert metrics(tmp_path / "b")[0]["loss"] < first + 0.5  # starts where the first run was, not at ~5.8


@pytest.mark.parametrize("args, expected", [
    (["--set", "runner_config.batch_size=zero"], "runner_config.batch_size"),
    (["--train_dataset_dir", "/nonexistent/data"], "/nonexistent/data"),
    (["--load_checkpoint", "/nonexistent/ckpt"], "/nonexistent/ckpt"),
])
def test_bad_input_is_one_line(tmp_path, args, expected):
    proc = train(tmp_path, "--max_steps", "1", *args, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert expected in proc.stderr.strip().splitlines()[-1] and "Traceback" not in proc.stderr


@needs_shared
def test_family_without_hf_architecture_is_a_clear_error(tmp_path):
    proc = train(tmp_path, config=str(CORPUS / "r1.5.0__research__telechat__finetune_telechat_52b.yaml"),
                 check=False)
    assert proc.returncode == 2
    assert "no Hugging Face architecture" in proc.stderr and "Traceback" not in proc.stderr


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    out = tmp_path_factory.mktemp("one_rank")
    train(out, "--max_steps", "3")
    return metrics(out)


@pytest.mark.deepspeed
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_two_ranks_with_the_launcher_equal_one_rank(tmp_path, one_rank, stage):
    """deepspeed mf_ds/train.py on 2 CPU ranks under ZeRO-1/2/3: same global batch, same losses as 1 rank. ZeRO-1
    through the `deepspeed` runner (its coverage, with test_multinode and test_launch_errors), ZeRO-2/3 through the
    launcher it execs (conftest.ds_launch: the runner's own Python less)."""
    port = free_port()
    runner = ["deepspeed", "--num_gpus", "2", "--master_port", str(port)] if stage == 1 else \
        ds_launch(2, port)
    launcher = [*runner, str(ROOT / "mf_ds" / "train.py")]
    train(tmp_path, "--max_steps", "3", "--set", f"mf_ds.zero_stage={stage}", launcher=launcher)
    # DeepSpeed's CPU all-reduce buffers (~67 MB a rank) are not left in /dev/shm (parallel.release_shm_names)
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))
    two = metrics(tmp_path)
    assert [m["loss"] for m in two] == pytest.approx([m["loss"] for m in one_rank], rel=1e-5)
    assert [m["grad_norm"] for m in two] == pytest.approx([m["grad_norm"] for m in one_rank], rel=1e-4)
    from transformers import AutoModelForCausalLM

    latest = tmp_path / "checkpoint" / (tmp_path / "checkpoint" / "latest").read_text().strip()
    assert AutoModelForCausalLM.from_pretrained(str(latest)).num_parameters() > 0  # whole weights, even at ZeRO-3


def test_fp16_on_cpu_is_a_clear_error(tmp_path):
    proc = train(tmp_path, "--max_steps", "1", "--set", "model.model_config.compute_dtype=float16", check=False)
    assert proc.returncode == 2 and "needs a GPU" in proc.stderr and "Traceback" not in proc.stderr


def test_megatron_data(tmp_path):
    from mf_ds.data import write_indexed

    rng = torch.Generator().manual_seed(0)
    docs = [torch.randint(3, 259, (int(n),), generator=rng).tolist() for n in torch.randint(50, 400, (60,))]
    write_indexed(str(tmp_path / "corpus_text_document"), docs)
    loader = ("train_dataset.data_loader={type: BlendedMegatronDatasetDataLoader, datasets_type: GPTDataset, "
              f"sizes: [64, 0, 0], config: {{seq_length: 128, data_path: ['1', '{tmp_path}/corpus_text_document']}}}}")
    train(tmp_path / "run", "--max_steps", "2", "--set", loader)
    assert len(metrics(tmp_path / "run")) == 2


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_qwen3_moe", "tiny_deepseek_v3"])
def test_configs_train_with_the_loss_falling(tmp_path, name):
    proc = train(tmp_path, config=str(CONFIGS / f"{name}.yaml"))
    rows = metrics(tmp_path)
    assert len(rows) == 150
    first = sum(r["loss"] for r in rows[:5]) / 5
    last = sum(r["loss"] for r in rows[-10:]) / 10
    assert first > 5.0 and last < first - 1.5, (first, last)
    assert "Epoch:[" in proc.stderr
    # TensorBoard events and the PNG report, written by the run itself
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx([r["loss"] for r in rows], rel=1e-6)
    assert {p.name for p in (tmp_path / "report").glob("*.png")} >= {"loss.png", "throughput.png"}


def test_save_checkpoint_steps_0_writes_no_checkpoint(tmp_path):
    """MindSpore's CheckpointConfig takes 0 (no step-based saving): no checkpoint by steps, none at the end."""
    train(tmp_path, "--max_steps", "2", "--set", "callbacks=[{type: MFLossMonitor}, {type: CheckpointMonitor, "
          "prefix: t, save_checkpoint_steps: 0, keep_checkpoint_max: 2}]")
    assert [m["step"] for m in metrics(tmp_path)] == [1, 2]
    assert not (tmp_path / "checkpoint").exists() or not any((tmp_path / "checkpoint").iterdir())
