"""DeepSeek-V4 Pro's shared expert, narrower than its routed experts (2048 beside 3072; MindFormers builds it so:
tests/fixtures/deepseek4/params.pro5.json), on transformers' DeepseekV4ForCausalLM, which reads one width for both:
mf-ds builds it at its own width (mf_ds/shared_expert.py) from tests/fixtures/pynative/tiny_deepseek4_pro.yaml (the
2.1.0 wheel's Pro YAML shrunk: shared 16 beside routed 24). The build, its parameter count (the memory planner's),
its checkpoints (mf-ds loads them; plain from_pretrained refuses the shapes), mf-convert both ways bit for bit, mf-ds'
MoE layer keeping the shared expert as built, mf-train (the loss falls, a killed run resumes with the same losses and
the width), the ZeRO-3 partitioned build (the same first step as one rank) and the HF Trainer path (mf-train's
losses)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import CPU_ENV, ROOT, ds_launch, free_port
from tests.mf_ds.test_deepseek4_train import counting_corpus, metrics
from tests.mf_ds.test_deepseek4_train import run as train_run
from translators import memory
from translators.plan import translate_file

TINY = ROOT / "tests" / "fixtures" / "pynative" / "tiny_deepseek4_pro.yaml"
SHARED, ROUTED, HIDDEN = 16, 24, 32


@pytest.fixture(scope="module")
def plan():
    return translate_file(str(TINY)).plan


def _shared_shapes(model) -> set[tuple]:
    return {tuple(tuple(getattr(layer.mlp.shared_experts, f"{p}_proj").weight.shape) for p in ("gate", "up", "down"))
            for layer in model.model.layers}


def test_builds_the_shared_expert_at_its_own_width(plan):
    from mf_ds.convert import _meta_model
    from mf_ds.model import build_model

    assert plan.hf_config["mf_shared_expert_intermediate_size"] == SHARED
    assert plan.hf_config["moe_intermediate_size"] == ROUTED
    lines = []
    model = build_model(plan, log=lines.append)
    assert _shared_shapes(model) == {((SHARED, HIDDEN), (SHARED, HIDDEN), (HIDDEN, SHARED))}
    assert tuple(model.model.layers[0].mlp.experts.gate_up_proj.shape) == (4, 2 * ROUTED, HIDDEN)
    assert any("4 built 16 wide (routed experts 24)" in line for line in lines), lines
    # initialised as transformers initialises a Linear: normal(initializer_range), on the model's dtype
    weight = model.model.layers[1].mlp.shared_experts.down_proj.weight
    assert weight.dtype == torch.float32 and abs(float(weight.detach().std()) - model.config.initializer_range) < 0.008
    count = sum(p.numel() for p in model.parameters())
    mtp = sum(p.numel() for p in model.model.layers[4:].parameters())  # the YAML's MTP block (mf_ds/mtp_v4.py)
    assert count - mtp == sum(w.numel * w.count for w in memory.inventory(plan.hf_config)) == 124_829
    assert mtp == 23_943 and model.model.layers[4].mlp.shared_experts.down_proj.weight.shape == (HIDDEN, SHARED)
    assert _shared_shapes(_meta_model(plan)) == _shared_shapes(model)  # mf-convert's shapes too


def test_checkpoint_loads_with_mf_ds_not_with_plain_from_pretrained(plan, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from mf_ds.model import build_model

    model = build_model(plan)
    model.save_pretrained(str(tmp_path))
    assert json.loads((tmp_path / "config.json").read_text())["mf_shared_expert_intermediate_size"] == SHARED
    assert AutoConfig.from_pretrained(str(tmp_path)).mf_shared_expert_intermediate_size == SHARED  # @strict keeps it
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):  # transformers builds the routed width
        AutoModelForCausalLM.from_pretrained(str(tmp_path))
    loaded = build_model(plan, str(tmp_path))
    want, got = model.state_dict(), loaded.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_mf_convert_both_ways_bit_for_bit(plan, tmp_path):
    """HF -> MindFormers' names (the shared expert's linear_fc1 [2 x 16, 32], gate and up interleaved per row) -> HF
    -> MindFormers again: every tensor the same bits."""
    from mf_ds.convert import to_hf, to_mindformers
    from mf_ds.model import build_model

    model = build_model(plan)
    model.save_pretrained(str(tmp_path / "hf"))
    to_mindformers(plan, str(tmp_path / "hf"), str(tmp_path / "mf.safetensors"))
    mf = load_file(str(tmp_path / "mf.safetensors"))
    fc1, fc2 = (mf[f"decoder.layers.3.mlp.shared_experts.linear_fc{i}.weight"] for i in (1, 2))
    assert (tuple(fc1.shape), tuple(fc2.shape)) == ((2 * SHARED, HIDDEN), (HIDDEN, SHARED))
    shared = model.model.layers[3].mlp.shared_experts
    assert torch.equal(fc1[0::2], shared.gate_proj.weight) and torch.equal(fc1[1::2], shared.up_proj.weight)
    to_hf(plan, str(tmp_path / "mf.safetensors"), str(tmp_path / "hf2"))
    want = model.state_dict()
    for source in (tmp_path / "hf2", tmp_path / "mf.safetensors"):  # load_checkpoint takes either
        back = build_model(plan, str(source)).state_dict()
        assert set(back) == set(want) and all(torch.equal(back[k], want[k]) for k in want), source
    to_mindformers(plan, str(tmp_path / "hf2"), str(tmp_path / "mf2.safetensors"))
    again = load_file(str(tmp_path / "mf2.safetensors"))
    assert set(again) == set(mf) and all(torch.equal(again[k], mf[k]) for k in mf)


def test_mf_moe_layer_keeps_the_shared_expert_as_built(plan):
    from mf_ds import patch
    from mf_ds.model import build_model
    from mf_ds.moe.layer import MFMoE

    model = build_model(plan)
    built = [layer.mlp.shared_experts for layer in model.model.layers]
    mtp = model.model.layers[4]  # the MTP block (mf_ds/mtp_v4.py): top-k, its shared expert 16 wide too
    mtp_shared = mtp.mlp.shared_experts
    patch.apply(model, plan)
    assert plan.moe.layers == (2, 3, 4)  # the two hash-routed layers stay transformers' blocks
    assert [isinstance(layer.mlp, MFMoE) for layer in model.model.layers] == [False, False, True, True]
    assert isinstance(mtp.mlp, MFMoE) and mtp.mlp.shared_experts is mtp_shared
    assert mtp_shared.down_proj.weight.shape == (HIDDEN, SHARED)
    assert [layer.mlp.shared_experts for layer in model.model.layers] == built  # the same modules
    ids = torch.randint(0, 320, (1, 256))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    assert built[3].down_proj.weight.grad is not None and torch.isfinite(out.loss)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return counting_corpus(tmp_path_factory.mktemp("megatron") / "corpus_text_document")


def run(out: Path, corpus: str, *args: str, **kwargs) -> subprocess.CompletedProcess:
    """test_deepseek4_train's run on the Pro fixture, saving every 4 steps."""
    return train_run(out, corpus, *args, config=TINY, save_every=4, **kwargs)


@pytest.fixture(scope="module")
def straight(tmp_path_factory, corpus) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("pro")
    run(out, corpus)
    return out, metrics(out)


def test_mf_train_trains_with_the_loss_falling(straight, plan):
    """The YAML's Muon, 8 steps: the loss falls; the checkpoint keeps the width (config and shapes)."""
    from mf_ds.model import build_model

    out, rows = straight
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert sum(r["loss"] for r in rows[-2:]) / 2 < sum(r["loss"] for r in rows[:2]) / 2 - 1.5, rows
    saved = out / "checkpoint" / "checkpoint-step8"
    assert json.loads((saved / "config.json").read_text())["mf_shared_expert_intermediate_size"] == SHARED
    assert _shared_shapes(build_model(plan, str(saved))) == {((SHARED, HIDDEN), (SHARED, HIDDEN), (HIDDEN, SHARED))}


def test_killed_run_resumes_with_the_same_losses_and_width(tmp_path, corpus, straight):
    """SIGKILLed in step 7's backward; --resume_training continues from step 4's checkpoint (the model built with
    the shared width, then DeepSpeed's states loaded into it) with the straight run's losses, bit for bit."""
    killed = run(tmp_path, corpus, env={"MF_DS_TEST_KILL_AT": "step.backward@7"}, check=False)
    assert killed.returncode == -9, killed.stderr[-2000:]
    run(tmp_path, corpus, "--resume_training")
    want = {r["step"]: r["loss"] for r in straight[1]}
    got = {r["step"]: r["loss"] for r in metrics(tmp_path)}
    assert sorted(got) == list(range(1, 9))
    assert [got[s] for s in range(5, 9)] == [want[s] for s in range(5, 9)]
    weights = load_file(str(tmp_path / "checkpoint" / "checkpoint-step8" / "model.safetensors"))
    assert tuple(weights["model.layers.3.ffn.shared_experts.w2.weight"].shape) == (HIDDEN, SHARED)


@pytest.mark.deepspeed
def test_zero3_partitioned_build_starts_from_the_same_weights(tmp_path, corpus):
    """data_parallel_shard -1 (ZeRO-3) on 2 ranks builds the model partitioned, the narrower shared experts inside
    deepspeed.zero.Init: the first step's loss and gradient norm are one rank's whole build's (AdamW)."""
    one = tmp_path / "one"
    run(one, corpus, "--set", "optimizer.type=AdamW", "--max_steps", "1", "--set", "checkpoint.enable_save=False")
    launcher = [*ds_launch(2), str(ROOT / "mf_ds" / "train.py")]
    proc = run(tmp_path / "two", corpus, "--set", "optimizer.type=AdamW", "--max_steps", "1", "--set",
               "checkpoint.enable_save=False", "--set", "parallelism.data_parallel_shard=-1", launcher=launcher)
    log = proc.stdout + proc.stderr
    assert "4 built 16 wide" in log
    # every parameter partitioned, the new shared experts too (held whole, they would put 3,072 elements over half)
    held = re.search(r"built partitioned \(deepspeed.zero.Init\): this rank holds ([\d,]+) of ([\d,]+)", log)
    mine, total = (int(g.replace(",", "")) for g in held.groups())
    assert total == 124_829 + 23_943 and 0 <= 2 * mine - total < 100, (mine, total)  # the MTP block's too
    two, first = metrics(tmp_path / "two")[0], metrics(one)[0]
    assert two["loss"] == pytest.approx(first["loss"], rel=1e-6)
    assert two["grad_norm"] == pytest.approx(first["grad_norm"], rel=1e-5)


def test_hf_trainer_builds_it_and_gives_mf_train_losses(tmp_path, corpus):
    """mf_ds.hf (examples/hf_trainer.py) builds the narrower shared experts through the same prepare(): 3 steps of
    its Muon give mf-train's losses (max_norm 0, as tests/mf_ds/test_muon_zero.py compares the two)."""
    import yaml

    tree = yaml.safe_load(TINY.read_text())
    tree["training"]["max_norm"] = 0
    tree["train_dataset"]["dataloader"]["config"]["data_path"] = ["1", corpus]
    config = tmp_path / "tiny_pro.yaml"
    config.write_text(yaml.safe_dump(tree, sort_keys=False))
    losses = {}
    for name, cmd in (("hf", ["examples/hf_trainer.py", str(config)]), ("ds", ["-m", "mf_ds.cli", str(config)])):
        done = subprocess.run([sys.executable, *cmd, "--max_steps", "3", "--output_dir", str(tmp_path / name)],
                              cwd=ROOT, env={**CPU_ENV, "MASTER_PORT": str(free_port())}, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        losses[name] = [row["loss"] for row in metrics(tmp_path / name)]
    assert len(losses["ds"]) == 3 and losses["ds"][-1] < losses["ds"][0] - 0.5
    assert losses["hf"] == pytest.approx(losses["ds"], rel=1e-6)
