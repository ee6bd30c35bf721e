"""MindFormers' Muon under DeepSpeed's ZeRO-1/2/3 (mf_ds/muon_zero.py: DeepSpeed gathers each Muon weight's full
gradient and calls our muon_update): the same tiny DeepSeek-V3 (MLA per-head split, stacked experts, AdamW part) and
data at ZeRO 0 and at ZeRO 1, 2, 3 give the same losses and weights, on one rank and on two gloo ranks at ZeRO-3, and
a ZeRO-3 run resumed from its checkpoint ends on the same weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, ds_launch, free_port
from tests.mf_ds.test_deepseek4_train import corpus  # noqa: F401, F811 (the fixture)


def engine_run(stage: int, steps: int, root: str | None = None, save_at: int | None = None,
               resume: bool = False) -> dict:
    """Losses and final weights of `steps` steps of the DeepSpeed engine with mf-ds' Muon at ZeRO `stage` (no
    clipping), each rank its own half of a fixed batch; `save_at`: checkpoint after that many steps; `resume`: load
    the latest checkpoint under `root` first and run `steps` more."""
    import deepspeed

    from mf_ds import muon_zero
    from mf_ds.checkpoint import native
    from mf_ds.optim import build_optimizer
    from tests.mf_ds.test_muon import spec, tiny_deepseek, typed

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    model = tiny_deepseek()
    optimizer = build_optimizer(model, typed(spec(lr=0.01)))
    if stage:
        muon_zero.install(optimizer)
    config = {"train_micro_batch_size_per_gpu": 4 // world, "gradient_accumulation_steps": 1,
              "gradient_clipping": 0.0, "steps_per_print": 10**9, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": stage, **({"reduce_scatter": False} if stage == 3 else {})}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    ids = torch.randint(0, 32, (4, 12), generator=torch.Generator().manual_seed(1))
    mine = ids[rank * (4 // world):(rank + 1) * (4 // world)]
    if resume:
        native.load(engine, native.latest(Path(root)))
    losses = []
    for step in range(steps):
        loss = engine(input_ids=mine, labels=mine, use_cache=False).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
        if save_at is not None and step + 1 == save_at:
            native.save(engine, Path(root), "muon", save_at, {}, keep=1)
    params = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params], enabled=stage == 3):
        weights = {n: p.detach().clone().tolist() for n, p in params}
    muon_zero.uninstall()
    return {"losses": losses, "weights": weights}


def launch(script: str, world: int = 1) -> list[dict]:
    """Run `script` (printing one JSON line last) on `world` gloo ranks; rank 0's answer."""
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
               "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "DS_ACCELERATOR": "cpu"}
        procs.append(subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    return json.loads(outs[0][0].strip().splitlines()[-1])


def close(a: dict, b: dict, rel: float = 1e-5) -> None:
    assert a["losses"] == pytest.approx(b["losses"], rel=rel)
    for name in a["weights"]:
        torch.testing.assert_close(torch.tensor(a["weights"][name]), torch.tensor(b["weights"][name]), rtol=rel,
                                   atol=rel * 1e-2, msg=name)


@pytest.mark.deepspeed
def test_zero_stages_equal_stage_0():
    """One rank, 4 steps at ZeRO 0, 1, 2, 3: the losses equal stage 0's, and the weights: bit for bit at ZeRO 1 / 2;
    at ZeRO-3 the Muon weights bit for bit too, and measured here 4 AdamW tensors (embeddings, output layer, two
    norms) one fp32 ulp apart (their gradients, accumulated over gathered partitions, round differently)."""
    runs = launch("import json; from tests.mf_ds.test_muon_zero import engine_run; "
                  "print(json.dumps([engine_run(s, 4) for s in (0, 1, 2, 3)]))")
    zero0 = runs[0]
    assert zero0["losses"][-1] < zero0["losses"][0]
    for stage, run in enumerate(runs[1:], start=1):
        assert run["losses"] == zero0["losses"], stage
        if stage < 3:
            assert run["weights"] == zero0["weights"], stage
        else:
            close(run, zero0, rel=1e-6)
            on_muon = [n for n in zero0["weights"] if "proj" in n and "experts" not in n or "experts" in n]
            assert on_muon and all(run["weights"][n] == zero0["weights"][n] for n in on_muon)


@pytest.mark.deepspeed
def test_zero3_two_ranks_and_resume(tmp_path):
    """Two gloo ranks at ZeRO-3 (each half of the batch; Newton-Schulz round-robin over the ranks) give the single
    rank's stage-0 losses within 1e-6 and weights within 1% of how far they moved in 4 steps (measured: 0.6% at most,
    on the router; the two-rank gradient average rounds differently in its last fp32 bit, which flips a few bf16
    roundings in Newton-Schulz); killed after 2 of 4 steps and resumed from the ZeRO-3 checkpoint (momentum partitions
    in the optimizer state), the same losses and weights exactly."""
    from tests.mf_ds.test_muon import tiny_deepseek

    root = str(tmp_path)
    zero0 = launch("import json; from tests.mf_ds.test_muon_zero import engine_run; "
                   "print(json.dumps(engine_run(0, 4)))")
    two = launch("import json; from tests.mf_ds.test_muon_zero import engine_run; "
                 f"print(json.dumps(engine_run(3, 4, {root!r}, save_at=2)))", world=2)
    assert two["losses"] == pytest.approx(zero0["losses"], rel=1e-6)
    for name, start in tiny_deepseek().named_parameters():
        want, got = torch.tensor(zero0["weights"][name]), torch.tensor(two["weights"][name])
        moved = float((want - start.detach()).abs().max())
        assert moved > 0, name
        torch.testing.assert_close(got, want, rtol=0, atol=1e-2 * moved, msg=name)
    resumed = launch("import json; from tests.mf_ds.test_muon_zero import engine_run; "
                     f"print(json.dumps(engine_run(3, 2, {root!r}, resume=True)))", world=2)
    assert resumed["losses"] == two["losses"][2:]
    assert resumed["weights"] == two["weights"]


@pytest.mark.deepspeed
def test_deepseek4_flash_muon_under_fsdp(tmp_path, corpus):  # noqa: F811 (the fixture)
    """The shrunk DeepSeek-V4 Flash with its YAML's Muon through mf-train: data_parallel_shard -1 on 2 deepspeed ranks
    (ZeRO-3, built partitioned) gives the single rank's ZeRO-0 losses (measured: within 3e-6 over 3 steps; without
    clipping, which under ZeRO DeepSpeed applies after the Muon update: translators/muon.py)."""
    from tests.mf_ds.test_deepseek4_train import metrics, run

    quiet = ("--max_steps", "3", "--set", "checkpoint.enable_save=False", "--set", "training.max_norm=0")
    run(tmp_path / "one", corpus, *quiet)
    launcher = [*ds_launch(2), str(ROOT / "mf_ds" / "train.py")]
    proc = run(tmp_path / "two", corpus, *quiet, "--set", "parallelism.data_parallel_shard=-1", launcher=launcher)
    assert "built partitioned" in proc.stdout + proc.stderr and "under ZeRO-3" in proc.stderr
    one, two = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert one[-1]["loss"] < one[0]["loss"] - 0.5
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-5)


def test_a_flat_copy_no_zero_muon_filled_is_an_error():
    """DeepSpeed's bf16 / fp16 optimizer at ZeRO stage 0 hands the optimizer flat fp32 copies whose gradient is the raw
    gradient: Muon stops with one line (translators/muon.py refuses the configuration before) instead of subtracting
    it as an update; once mf_ds/muon_zero.py is installed the flat gradient is the update and is subtracted after the
    decay."""
    from mf_ds.errors import RunError
    from mf_ds.muon import Muon

    flat = torch.nn.Parameter(torch.ones(6))
    optimizer = Muon([{"params": [flat], "muon": True, "rules": [("whole",)]}], lr=0.5, weight_decay=0.1)
    flat.grad = torch.full((6,), 0.25)
    with pytest.raises(RunError, match="no ZeRO optimizer orthogonalized"):
        optimizer.step()
    optimizer.zero_hooked = True
    optimizer.step()
    torch.testing.assert_close(flat.detach(), torch.full((6,), 1 * (1 - 0.5 * 0.1) - 0.25))


def test_hf_trainer_runs_muon_as_mf_train_does(tmp_path, corpus):  # noqa: F811 (the fixture)
    """The shrunk DeepSeek-V4 Flash in bf16 (ZeRO-1, DeepSpeed's ZeRO Muon with MindFormers' update) through the HF
    Trainer path (examples/hf_trainer.py, mf_ds/hf.py MFTrainer.create_optimizer) gives mf-train's losses (measured:
    equal to 1e-7 over 3 steps)."""
    import yaml

    from tests.conftest import CPU_ENV
    from tests.mf_ds.test_deepseek4_train import TINY

    tree = yaml.safe_load(TINY.read_text())
    tree["model"]["compute_dtype"] = "bfloat16"
    tree["training"]["max_norm"] = 0
    tree["train_dataset"]["dataloader"]["config"]["data_path"] = ["1", corpus]
    config = tmp_path / "tiny_bf16.yaml"
    config.write_text(yaml.safe_dump(tree, sort_keys=False))
    losses = {}
    for name, cmd in (("hf", ["examples/hf_trainer.py", str(config)]), ("ds", ["-m", "mf_ds.cli", str(config)])):
        done = subprocess.run([sys.executable, *cmd, "--max_steps", "3", "--output_dir", str(tmp_path / name)],
                              cwd=ROOT, env=CPU_ENV, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        losses[name] = [json.loads(line)["loss"] for line in lines]
    assert len(losses["ds"]) == 3 and losses["ds"][-1] < losses["ds"][0] - 0.5
    assert losses["hf"] == pytest.approx(losses["ds"], rel=1e-6)
