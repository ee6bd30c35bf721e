"""DeepSeek's MTP (mf_ds/mtp.py) against MindFormers' own research DeepSeek-V3 (tests/fixtures/make_mtp_golden.py:
TrainingDeepseekV3ForCausalLM of 1.7.0 run on CPU with one MTP layer), its weights both ways, the Plan, a run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mf_ds import mtp
from mf_ds.errors import RunError
from mf_ds.model import build_model
from mf_ds.weights import layout_of, to_hf
from tests.conftest import CONFIGS, CPU_ENV, ROOT
from translators import names
from translators.plan import translate_file

FIX = ROOT / "tests" / "fixtures" / "mindformers" / "mtp"
YAML = FIX / "ds3_mtp_tiny.yaml"
GOLDEN = json.loads((FIX / "golden.json").read_text())


def _plan(*sets: str):
    return translate_file(str(YAML), list(sets)).plan


def _forward(model, plan):
    """The loop's inputs for rows of seq_length + 1 ids (legacy: shifted; pads out of the loss), then the terms."""
    ids = torch.tensor(GOLDEN["input_ids"])
    tokens, labels = ids[:, :-1], ids[:, 1:]
    labels = labels.masked_fill(tokens == plan.run.loss_mask_pad_id, -100)
    out = model(input_ids=tokens, labels=labels, shift_labels=labels)
    (ce,) = mtp.depth_losses(model, tokens, labels)
    return out.loss, ce, mtp.MtpLoss(plan).add(model, out.loss, tokens, labels)


def test_plan_carries_the_research_variant():
    plan = _plan()
    assert (plan.mtp.variant, plan.mtp.depth, plan.mtp.loss_factor) == ("research", 1, 0.3)
    notes = {n.key: n for n in plan.notes}
    assert notes["model.model_config.mtp_depth"].kind == "runtime"
    assert "plan.mtp.loss_factor" in notes["model.model_config.mtp_loss_factor"].message
    assert plan.hf_config["first_k_dense_replace"] == 3  # dense (expert_num 1): the MTP layer too
    assert _plan("model.model_config.mtp_depth=0").mtp is None


def test_loss_equals_mindformers():
    """main CE, depth 1's masked CE and the total (main + 0.3 / 1 x CE_1) equal MindFormers' (fp32)."""
    plan = _plan()
    model = build_model(plan, str(FIX / "model.ckpt"))
    main, ce, total = _forward(model, plan)
    assert main.item() == pytest.approx(GOLDEN["main"], rel=1e-5)
    assert ce.item() == pytest.approx(GOLDEN["mtp_ce"], rel=1e-5)
    assert total.item() == pytest.approx(GOLDEN["total"], rel=1e-5)
    assert total.item() != pytest.approx(main.item(), rel=1e-3)  # the term is there


def test_mtp_gradients_equal_mindformers():
    """d total / d every MTP-only weight (fuser, norms, the MTP decoder layer), mapped to HF names as the loader
    maps the weights, equals MindFormers' gradients."""
    plan = _plan()
    model = build_model(plan, str(FIX / "model.ckpt"))
    _, _, total = _forward(model, plan)
    total.backward()
    params = dict(model.named_parameters())
    grads = np.load(FIX / "grads.npz")
    assert len(grads.files) > 10
    for mf_name in grads.files:
        for piece in to_hf(mf_name, torch.from_numpy(grads[mf_name]), plan.weights_family, model.config,
                           layout_of(plan)):
            grad = params[piece.name].grad
            region = grad.reshape(piece.view)[piece.index] if piece.view else grad
            torch.testing.assert_close(region, piece.tensor, rtol=1e-4, atol=1e-6, msg=mf_name)


def test_mindformers_names_both_ways(tmp_path):
    """mf-convert: the MindFormers checkpoint's MTP weights go to DeepSeek's HF layout (model.layers.2.enorm,
    .hnorm, .eh_proj, .shared_head.norm) and back to the same MindFormers names and values."""
    from safetensors import safe_open

    from mf_ds.checkpoint.mindspore_ckpt import mindformers_weights
    from mf_ds.convert import to_hf as convert_to_hf
    from mf_ds.convert import to_mindformers

    plan = _plan()
    counts = convert_to_hf(plan, str(FIX / "model.ckpt"), str(tmp_path / "hf"))
    assert "mtp_skipped" not in counts
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        hf = set(f.keys())
    assert {"model.layers.2.enorm.weight", "model.layers.2.hnorm.weight", "model.layers.2.eh_proj.weight",
            "model.layers.2.shared_head.norm.weight", "model.layers.2.self_attn.o_proj.weight"} <= hf
    to_mindformers(plan, str(tmp_path / "hf"), str(tmp_path / "back.safetensors"))
    original = {name: load() for name, _, load in mindformers_weights(FIX / "model.ckpt")}
    back = {name: load() for name, _, load in mindformers_weights(tmp_path / "back.safetensors")}
    mtp_names = [n for n in original if names.mtp_layer(n, "deepseek_v3", 2)]
    assert "model.mtp_hidden_fusers.0.dense.weight" in mtp_names and "model.mtp_norms.0.weight" in mtp_names
    for name in mtp_names:
        torch.testing.assert_close(back[name], original[name], rtol=0, atol=0, msg=name)


def test_own_checkpoint_saves_and_loads_the_mtp_block(tmp_path):
    """An mf-ds (HF-layout) checkpoint holds the MTP block and loads back into it; num_nextn_predict_layers in
    config.json; the shared embedding and head are not copied into it."""
    plan = _plan()
    model = build_model(plan, str(FIX / "model.ckpt"))
    model.save_pretrained(str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    again = build_model(plan, str(tmp_path))
    theirs = dict(again.named_parameters())
    assert any(name.startswith("model.layers.2.eh_proj") for name in theirs)
    for name, param in model.named_parameters():
        torch.testing.assert_close(theirs[name], param, rtol=0, atol=0, msg=name)


def test_shared_copies_of_hf_releases_are_dropped():
    assert names.mtp_shared_copy("model.layers.61.embed_tokens.weight", 61)
    assert names.mtp_shared_copy("model.layers.61.shared_head.head.weight", 61)
    assert not names.mtp_shared_copy("model.layers.61.shared_head.norm.weight", 61)
    assert not names.mtp_shared_copy("model.layers.60.embed_tokens.weight", 61)


def test_refusals_are_one_line():
    plan = _plan("parallel_config.model_parallel=2", "use_parallel=True")
    with pytest.raises(RunError, match="mtp_depth"):
        build_model(plan)


def test_hf_trainer_and_mf_train_train_the_same_mtp_loss(tmp_path):
    """The HF Trainer path (MFTrainer.compute_loss) adds the same MTP term as mf-train: equal losses over 2 steps
    from MindFormers' weights."""
    import yaml

    from mf_ds.data import write_indexed

    rng = torch.Generator().manual_seed(0)  # documents of the tiny vocabulary (the built-in corpus needs 259 ids)
    write_indexed(str(tmp_path / "docs"), [torch.randint(1, 64, (20,), generator=rng).tolist() for _ in range(8)])
    tree = yaml.safe_load(YAML.read_text())
    tree["load_checkpoint"] = str(FIX / "model.ckpt")  # MindFormers' weights for both (hf_trainer.py has no flag)
    tree["train_dataset"]["data_loader"] = {
        "type": "BlendedMegatronDatasetDataLoader", "datasets_type": "GPTDataset", "sizes": [8, 0, 0],
        "config": {"seq_length": 8, "data_path": ["1", str(tmp_path / "docs")]}}
    yaml_file = tmp_path / "ds3_mtp_tiny.yaml"
    yaml_file.write_text(yaml.safe_dump(tree))
    runs = {}
    for name, cmd in (("hf", [sys.executable, "examples/hf_trainer.py", str(yaml_file)]),
                      ("ds", [sys.executable, "-m", "mf_ds.cli", str(yaml_file)])):
        out = tmp_path / name
        proc = subprocess.run([*cmd, "--max_steps", "2", "--output_dir", str(out)], cwd=ROOT, env=CPU_ENV,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(runs["ds"]) == 2 and runs["hf"] == pytest.approx(runs["ds"], rel=1e-5)


def test_mf_train_logs_the_mtp_loss(tmp_path):
    """A shrunk DeepSeek-V3 YAML with mtp_depth 1 trains with mf-train: mtp_loss in metrics.jsonl and the log line,
    inside `loss`."""
    proc = subprocess.run([sys.executable, "-m", "mf_ds.cli", str(CONFIGS / "tiny_deepseek_v3.yaml"),
                           "--max_steps", "2", "--output_dir", str(tmp_path), "--set", "use_parallel=False",
                           "--set", "parallel_config.data_parallel=1", "--set", "model.model_config.seq_length=32"],
                          cwd=ROOT, env=CPU_ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in Path(tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(0 < row["mtp_loss"] < row["loss"] for row in rows)
    assert "mtp_loss: " in proc.stdout + proc.stderr
    assert "MTP block(s) of research/deepseek3" in proc.stdout + proc.stderr


def test_resume_gives_the_straight_runs_losses(tmp_path):
    """mf-train's own checkpoint (HF-layout weights + DeepSpeed state) resumes the MTP block exactly."""
    base = [sys.executable, "-m", "mf_ds.cli", str(CONFIGS / "tiny_deepseek_v3.yaml"), "--set", "use_parallel=False",
            "--set", "parallel_config.data_parallel=1", "--set", "model.model_config.seq_length=32"]

    def run(out: Path, steps: int, *extra: str) -> list[tuple[float, float]]:
        proc = subprocess.run([*base, "--max_steps", str(steps), "--output_dir", str(out), *extra], cwd=ROOT,
                              env=CPU_ENV, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return [(row["loss"], row["mtp_loss"]) for row in rows]

    straight = run(tmp_path / "a", 3)
    run(tmp_path / "b", 2)
    assert run(tmp_path / "b", 3, "--resume_training") == straight
