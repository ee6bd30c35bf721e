"""A shrunk DeepSeek-V4 Flash (tests/fixtures/pynative/tiny_deepseek4_flash.yaml: the 2.1.0 wheel's YAML with its
schema kept; 4 layers of sliding, compressed sparse, heavily compressed and compressed sparse attention, the first
hash-routed; mf-ds' MoE layer in the other three) trains on transformers' DeepseekV4ForCausalLM: 20 steps with
mf-train and the loss falls (and its MTP layer's CE, logged beside it), the expert bias moves as MindFormers moves
it, a run killed mid-way resumes from its checkpoint with the same losses, and 2 ranks of `deepspeed
mf_ds/train.py` give the single rank's losses. With the YAML's own optimizer, MindFormers' Muon (mf_ds/muon.py, its
DeepSeek-V4 split; the other tests run AdamW), the loss falls over 20 steps too and a killed run resumes with the
same losses.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import CPU_ENV, ROOT, ds_launch

TINY = ROOT / "tests" / "fixtures" / "pynative" / "tiny_deepseek4_flash.yaml"
# AdamW for the tests of the model and its parallel runs; the Muon tests (the YAML's optimizer) at the end.
ADAMW = ("--set", "optimizer.type=AdamW")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return counting_corpus(tmp_path_factory.mktemp("megatron") / "corpus_text_document")


def counting_corpus(prefix: Path) -> str:
    """A Megatron .bin / .idx corpus at `prefix` (its path returned)."""
    from mf_ds.data import write_indexed

    rng = torch.Generator().manual_seed(0)
    # counting documents (each token the previous + 1): learnable, so the loss has somewhere to fall
    starts, lengths = torch.randint(3, 300, (80,), generator=rng), torch.randint(30, 200, (80,), generator=rng)
    docs = [[3 + (int(s) + i) % 297 for i in range(int(n))] for s, n in zip(starts, lengths, strict=True)]
    write_indexed(str(prefix), docs)
    return str(prefix)


def run(out: Path, corpus: str, *args: str, launcher: list[str] | None = None, env: dict | None = None,
        check: bool = True, config: Path = TINY, save_every: int = 10) -> subprocess.CompletedProcess:
    """mf-train (or `launcher`) on `config` over the corpus, saving every `save_every` steps under out/checkpoint."""
    data = f"train_dataset.dataloader.config.data_path=['1', '{corpus}']"
    save = ("--set", "checkpoint.enable_save=True", "--set", f"checkpoint.save_interleaved_steps={save_every}",
            "--set", f"checkpoint.save_path={out / 'checkpoint'}")
    cmd = (launcher + ["--mf-config", str(config)] if launcher else [sys.executable, "-m", "mf_ds.cli", str(config)])
    proc = subprocess.run([*cmd, "--output_dir", str(out), "--set", data, *save, *args], cwd=ROOT,
                          env={**CPU_ENV, **(env or {})}, capture_output=True, text=True, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, corpus) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("deepseek4")
    run(out, corpus, *ADAMW)
    return out, metrics(out)


def test_trains_20_steps_with_the_loss_falling(one_rank):
    out, rows = one_rank
    assert [r["step"] for r in rows] == list(range(1, 21))
    first, last = sum(r["loss"] for r in rows[:3]) / 3, sum(r["loss"] for r in rows[-3:]) / 3
    assert last < first - 2.0, (first, last)
    # the YAML's MTP layer (mf_ds/mtp_v4.py): its CE logged beside the loss (the loss is the main loss alone), and
    # trained: it falls too
    mtp = [r["mtp_loss"] for r in rows]
    assert all(math.isfinite(v) and v > 0 for v in mtp), mtp
    assert sum(mtp[-3:]) / 3 < sum(mtp[:3]) / 3 - 1.0, mtp
    assert sorted(p.name for p in (out / "checkpoint").iterdir() if p.name.startswith("checkpoint-step")) == [
        "checkpoint-step10", "checkpoint-step20"]


def test_expert_bias_moves_as_mindformers_moves_it(one_rank):
    """The top-k layers' bias (mf-ds' MoE layer) moves by moe_router_bias_update_rate x sign(mean load - load) after
    each step: after 20 steps, multiples of 1e-4, not all zero; the hash layer has none (HF's block)."""
    from transformers import AutoModelForCausalLM

    out, _ = one_rank
    model = AutoModelForCausalLM.from_pretrained(str(out / "checkpoint" / "checkpoint-step20"))
    for layer in model.model.layers[1:]:
        steps = layer.mlp.gate.e_score_correction_bias / 1e-4
        assert bool(steps.any()) and torch.allclose(steps, steps.round(), atol=1e-3), steps
        assert float(steps.abs().max()) <= 20
    assert not hasattr(model.model.layers[0].mlp.gate, "e_score_correction_bias")
    # the MTP layer's too (MindFormers' is_mtp_layer router is top-k with the bias: moe_layer.py 71), as saved
    from safetensors.torch import load_file

    saved = load_file(str(out / "checkpoint" / "checkpoint-step20" / "model.safetensors"))
    steps = saved["model.layers.4.ffn.gate.bias"] / 1e-4
    assert bool(steps.any()) and torch.allclose(steps, steps.round(), atol=1e-3), steps


def test_mf_convert_of_the_trained_checkpoint_both_ways(tmp_path, one_rank):
    """The run's checkpoint (save_pretrained writes DeepSeek-V4 under DeepSeek's own names) -> MindFormers' PyNative
    names -> an HF directory again: every tensor the same."""
    from transformers import AutoModelForCausalLM

    out, _ = one_rank
    for src, dst in ((out / "checkpoint" / "checkpoint-step20", tmp_path / "mf.safetensors"),
                     (tmp_path / "mf.safetensors", tmp_path / "hf")):
        proc = subprocess.run([sys.executable, "-m", "mf_ds.convert", "--mf-config", str(TINY), str(src), str(dst)],
                              cwd=ROOT, env=CPU_ENV, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
    want = AutoModelForCausalLM.from_pretrained(str(out / "checkpoint" / "checkpoint-step20")).state_dict()
    got = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).state_dict()
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert torch.equal(got[name].to(tensor.dtype), tensor), name


def test_killed_run_resumes_with_the_same_losses(tmp_path, corpus, one_rank):
    """SIGKILLed in step 15's backward; --resume_training continues from step 10's checkpoint."""
    killed = run(tmp_path, corpus, *ADAMW, env={"MF_DS_TEST_KILL_AT": "step.backward@15"}, check=False)
    assert killed.returncode == -9, killed.stderr[-2000:]
    run(tmp_path, corpus, *ADAMW, "--resume_training")
    straight = {r["step"]: r["loss"] for r in one_rank[1]}
    resumed = {r["step"]: r["loss"] for r in metrics(tmp_path)}
    assert sorted(resumed) == list(range(1, 21))
    assert [resumed[s] for s in range(11, 21)] == [straight[s] for s in range(11, 21)]


@pytest.mark.deepspeed
def test_two_ranks_equal_one_rank(tmp_path, corpus, one_rank):
    """data_parallel_shard 1 on 2 ranks: plain data parallel (ZeRO stage 0), accumulation 1 instead of 2, the same
    global batch; the losses and gradient norms are the single rank's."""
    launcher = [*ds_launch(2), str(ROOT / "mf_ds" / "train.py")]
    run(tmp_path, corpus, *ADAMW, "--max_steps", "3", "--set", "checkpoint.enable_save=False", launcher=launcher)
    two, one = metrics(tmp_path), one_rank[1]
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one[:3]], rel=1e-4)
    assert [r["grad_norm"] for r in two] == pytest.approx([r["grad_norm"] for r in one[:3]], rel=1e-3)


@pytest.mark.deepspeed
def test_zero3_partitioned_build_starts_from_the_same_weights(tmp_path, corpus, one_rank):
    """data_parallel_shard -1 (FSDP: ZeRO-3) builds the model partitioned; mf_ds/init.py's MindFormers values are
    written through DeepSpeed's gathered parameters: the first step's loss and gradient norm are the single rank's
    (later steps drift by routing ties: top-k choices flip on last-bit differences of the reduction order)."""
    launcher = [*ds_launch(2), str(ROOT / "mf_ds" / "train.py")]
    proc = run(tmp_path, corpus, *ADAMW, "--max_steps", "2", "--set", "checkpoint.enable_save=False", "--set",
               "parallelism.data_parallel_shard=-1", launcher=launcher)
    assert "built partitioned" in proc.stdout + proc.stderr
    two, one = metrics(tmp_path), one_rank[1]
    assert two[0]["loss"] == pytest.approx(one[0]["loss"], rel=1e-6)
    assert two[0]["grad_norm"] == pytest.approx(one[0]["grad_norm"], rel=1e-5)
    assert two[1]["loss"] == pytest.approx(one[1]["loss"], rel=1e-3)


@pytest.fixture(scope="module")
def muon_rank(tmp_path_factory, corpus) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("deepseek4_muon")
    run(out, corpus)
    return out, metrics(out)


def test_muon_trains_20_steps_with_the_loss_falling(muon_rank, one_rank):
    """The YAML's Muon (8 + 2 segmented Newton-Schulz, matched_adamw_rms 0.2, nesterov, the AdamW part for the
    embeddings, output layer and vectors) at its lr 2e-2: the loss falls, and the run is not the AdamW one."""
    _, rows = muon_rank
    assert [r["step"] for r in rows] == list(range(1, 21))
    first, last = sum(r["loss"] for r in rows[:3]) / 3, sum(r["loss"] for r in rows[-3:]) / 3
    assert last < first - 2.0, (first, last)
    # the YAML's MTP layer (mf_ds/mtp_v4.py): its CE logged beside the loss (the loss is the main loss alone), and
    # trained: it falls too
    mtp = [r["mtp_loss"] for r in rows]
    assert all(math.isfinite(v) and v > 0 for v in mtp), mtp
    assert sum(mtp[-3:]) / 3 < sum(mtp[:3]) / 3 - 1.0, mtp
    assert [r["loss"] for r in rows[1:]] != [r["loss"] for r in one_rank[1][1:]]


def test_muon_killed_run_resumes_with_the_same_losses(tmp_path, corpus, muon_rank):
    """SIGKILLed in step 15's backward; --resume_training continues from step 10's checkpoint (Muon momentum, the
    AdamW part's moments and step in the optimizer state) with the straight run's losses, bit for bit."""
    killed = run(tmp_path, corpus, env={"MF_DS_TEST_KILL_AT": "step.backward@15"}, check=False)
    assert killed.returncode == -9, killed.stderr[-2000:]
    run(tmp_path, corpus, "--resume_training")
    straight = {r["step"]: r["loss"] for r in muon_rank[1]}
    resumed = {r["step"]: r["loss"] for r in metrics(tmp_path)}
    assert sorted(resumed) == list(range(1, 21))
    assert [resumed[s] for s in range(11, 21)] == [straight[s] for s in range(11, 21)]


def test_plan():
    from translators.plan import translate_file

    plan = translate_file(str(TINY), world_size=2).plan
    assert plan.zero_stage == 0 and plan.run.gradient_accumulation_steps == 1
    # the hash layer 0 stays HF's; the MTP layer (4) is top-k
    assert plan.moe.layers == (1, 2, 3, 4) and plan.moe.mtp_layers == (4,) and plan.moe.router.score == "sqrtsoftplus"
    assert plan.hf_config["model_type"] == "deepseek_v4" and plan.weights_family == "deepseek_v4/mcore"
