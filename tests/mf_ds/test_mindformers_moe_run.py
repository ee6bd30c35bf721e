"""MoE runs of MindFormers' own Trainer as the reference: mindformers.Trainer(task='text_generation').train() trained
four shrunk MoE YAMLs (tests/fixtures/mindformers/run_moe/) for 10 steps each on CPU (MindFormers 1.7.0, MindSpore
2.7.2, PYNATIVE: tests/fixtures/make_mindformers_moe_run.py) over right-padded rows. mf-train on the same YAML,
MindRecord file and .ckpt logs the same loss, learning rate and global norm at every step, drops as many (token,
choice) pairs in each MoE layer at each step, and ends with the router bias TopkBiasBalanceCallback left. No
MindSpore needed.

What the runs cover (legacy LlamaForCausalLM + moe_config: MoEV2 / TopkRouterV2):
  moe_dropless_tiny  Mixtral-like, 4 experts, top 2, dynamic capacity (no drop), expert aux and z losses configured,
                     which the Llama path computes and discards
  moe_kdrop_tiny     capacity 1.1, k-drop: the pads are routed and take capacity, so their hidden states (MindFormers
                     masks pad keys) decide which real tokens' second choices are dropped. Before mf-ds kept the pad
                     mask for MoE models (run.trailing_pads_inert), it took the plain causal path on these batches of
                     trailing pads: the pads' routing differed, and from step 3 on the loss (4.718956 where MindFormers
                     has 4.692143) and the global norm (11.82 against 13.84)
  moe_sdrop_tiny     capacity 1.1, s-drop
  moe_deepseek_tiny  DeepSeek-style on the Llama path: 8 experts in 4 groups (group_limited_greedy keeps 2), sigmoid
                     scores, top 2 renormalised, routed_scaling_factor 1.5, a shared expert with its sigmoid gate,
                     balance_via_topk_bias moved by TopkBiasBalanceCallback (rate 0.01), capacity 1.5 with k-drop;
                     its .ckpt holds MindFormers' router.router.topk_bias and expert_load
Measured (2026-11-26): loss within 4.6e-7 relative, global norm within 1.8e-5 relative, the learning rate within
1.2e-6 relative (MindSpore computes it in float32), the same count of dropped pairs in every layer at every step,
and the final router biases bit for bit.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from safetensors.torch import load_file

from mf_ds.checkpoint.mindspore_ckpt import MindSporeCheckpoint
from mf_ds.data import MindRecord
from tests.conftest import CPU_ENV, ROOT
from translators.plan import translate_file

RUN = ROOT / "tests" / "fixtures" / "mindformers" / "run_moe"
RUNS = ("moe_dropless_tiny", "moe_kdrop_tiny", "moe_sdrop_tiny", "moe_deepseek_tiny")
RTOL = 1e-4  # loss and global norm, relative, at every step
LR_ATOL = 1e-6 * 1e-3  # 1e-6 of the peak rate (lr_schedule.learning_rate 1.e-3): MindSpore's float32 rate
PAIRS = 2 * 16 * 2  # (token, choice) pairs per MoE layer and step: batch 2 x seq 16 x top 2


def golden(stem: str) -> dict:
    return json.loads((RUN / f"{stem}.golden.json").read_text())


def test_moe_golden_runs_pad_every_batch_and_drop():
    """Every batch of 2 rows holds trailing pads (id 0) and no pad before a real token; the capacity runs drop pairs
    at most steps; the DeepSeek-style .ckpt carries MindFormers' router state."""
    data = MindRecord([str(RUN / "data.mindrecord")])
    assert len(data) == 10
    rows = [data.row(i)["input_ids"] for i in range(len(data))]
    for first in range(0, 10, 2):
        batch = np.stack(rows[first:first + 2])
        assert (batch == 0).any()
        assert all((row[np.argmax(row == 0):] == 0).all() for row in batch if (row == 0).any())
    for stem in RUNS:
        steps = golden(stem)["steps"]
        assert [s["step"] for s in steps] == list(range(1, 11)) and not any(s["overflow"] for s in steps)
        dropped = sum(len(pairs) for s in steps for pairs in s["drops"])
        assert (dropped == 0) == (stem == "moe_dropless_tiny")
    names = MindSporeCheckpoint(RUN / "init_deepseek.ckpt").names()
    assert "model.layers.1.feed_forward.routed_experts.router.router.topk_bias" in names
    assert "model.layers.1.feed_forward.routed_experts.router.router.expert_load" in names


def test_moe_plans_keep_the_pad_mask():
    """The MoE YAMLs' Plan says trailing pads are not inert (mf_ds/attention.py then masks them); the dense finetune
    YAML of the same data layout keeps the faster causal path."""
    for stem in RUNS:
        run = translate_file(str(RUN / f"{stem}.yaml")).plan.run
        assert run.pad_attention_mask and not run.trailing_pads_inert
    dense = translate_file(str(RUN.parent / "run" / "finetune_llama2_tiny.yaml")).plan.run
    assert dense.pad_attention_mask and dense.trailing_pads_inert


@pytest.mark.parametrize("stem", RUNS)
def test_moe_trainer_train_step_by_step(tmp_path, stem):
    """mindformers.Trainer.train on an MoE YAML: mf-train logs MindFormers' loss and global norm within 1e-4 and its
    learning rate at each of the 10 steps, and drops as many pairs in each layer at each step."""
    proc = subprocess.run([sys.executable, "-m", "mf_ds.cli", str(RUN / f"{stem}.yaml"), "--output_dir",
                           str(tmp_path)], cwd=ROOT, env=CPU_ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = golden(stem)["steps"]
    assert [row["step"] for row in ours] == [s["step"] for s in steps]
    np.testing.assert_allclose([row["loss"] for row in ours], [s["loss"] for s in steps], rtol=RTOL, atol=0)
    np.testing.assert_allclose([row["grad_norm"] for row in ours], [s["global_norm"] for s in steps], rtol=RTOL,
                               atol=0)
    np.testing.assert_allclose([row["lr"] for row in ours], [s["lr"] for s in steps], rtol=0, atol=LR_ATOL)
    assert [[round(row["moe"][layer]["drop_rate"] * PAIRS) for layer in sorted(row["moe"])] for row in ours] == \
        [[len(pairs) for pairs in s["drops"]] for s in steps]
    if "topk_bias" in steps[-1]:  # TopkBiasBalanceCallback's bias after step 10, saved by mf-train at the end
        checkpoint = tmp_path / "checkpoint"
        weights = load_file(str(checkpoint / (checkpoint / "latest").read_text().strip() / "model.safetensors"))
        for layer, bias in enumerate(steps[-1]["topk_bias"]):
            saved = weights[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"].numpy()
            np.testing.assert_array_equal(saved, np.array(bias, dtype=np.float32))
            assert np.abs(saved).max() > 0


def test_moe_kdrop_under_the_hf_trainer(tmp_path):
    """The HF Trainer path (mf_ds.hf.MFTrainer) gets the same pad masks per sample: MindFormers' first 4 steps of the
    k-drop run (the step-3 divergence of the unmasked pads included), with the same drops."""
    proc = subprocess.run([sys.executable, "examples/hf_trainer.py", str(RUN / "moe_kdrop_tiny.yaml"),
                           "--max_steps", "4", "--output_dir", str(tmp_path)], cwd=ROOT, env=CPU_ENV,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = golden("moe_kdrop_tiny")["steps"][:4]
    np.testing.assert_allclose([row["loss"] for row in ours], [s["loss"] for s in steps], rtol=RTOL, atol=0)
    np.testing.assert_allclose([row["grad_norm"] for row in ours], [s["global_norm"] for s in steps], rtol=RTOL,
                               atol=0)
    assert [[round(row["moe"][layer]["drop_rate"] * PAIRS) for layer in sorted(row["moe"])] for row in ours] == \
        [[len(pairs) for pairs in s["drops"]] for s in steps]
