"""Tensor parallel (DeepSpeed AutoTP) and context parallel (DeepSpeed Ulysses) on 2 CPU ranks equal 1 rank:
same global batch, losses within 1e-5 over 3 steps, whole HF weights saved. Launched as users launch them
(`deepspeed mf_ds/train.py`), with MindFormers' own keys (`parallel_config.model_parallel` / `context_parallel`).

Of the partition_config families, Qwen3-MoE and DeepSeek-V3 (MLA) run here; Mixtral and Qwen2-MoE (tiny_llama.yaml
with moe_config expert_num 8, shared_expert_num 0 / 1), DeepSeek-V2 and GLM4 (tests/fixtures/tiny_deepseek_v2.yaml,
tiny_glm4.yaml) were run the same way by hand, 1 rank against tp 2 with mf_ds.zero_stage=1."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import CONFIGS, CPU_ENV, ROOT, ds_launch, free_port

LLAMA = str(CONFIGS / "tiny_llama.yaml")
QWEN3_MOE = str(CONFIGS / "tiny_qwen3_moe.yaml")
DEEPSEEK_V3 = str(CONFIGS / "tiny_deepseek_v3.yaml")


def train(out: Path, config: str, *sets: str, ranks: int = 1, expect: str = "", steps: int = 3,
          resume: bool = False) -> list[dict]:
    args = ["--output_dir", str(out), "--max_steps", str(steps), *[a for s in sets for a in ("--set", s)]]
    args += ["--resume_training"] if resume else []
    if ranks == 1:
        cmd = [sys.executable, "-m", "mf_ds.cli", config, *args]
    else:
        cmd = [*ds_launch(ranks), str(ROOT / "mf_ds" / "train.py"), "--mf-config", config, *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=CPU_ENV, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert expect in proc.stdout + proc.stderr
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def saved(out: Path) -> dict[str, torch.Tensor]:
    latest = (out / "checkpoint" / "latest").read_text().strip()
    return load_file(str(out / "checkpoint" / latest / "model.safetensors"))


def same_run(one: list[dict], two: list[dict]) -> None:
    assert len(one) == len(two) == 3
    assert [m["loss"] for m in two] == pytest.approx([m["loss"] for m in one], rel=1e-5, abs=1e-5)
    assert [m["grad_norm"] for m in two] == pytest.approx([m["grad_norm"] for m in one], rel=1e-4)


def same_weights(one: dict[str, torch.Tensor], two: dict[str, torch.Tensor]) -> None:
    assert sorted(two) == sorted(one)  # buffers too (DeepSeek's router bias): the TP gather walks parameters only
    for name, tensor in one.items():
        torch.testing.assert_close(two[name], tensor, atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


@pytest.fixture(scope="module")
def llama_one_rank(tmp_path_factory):
    out = tmp_path_factory.mktemp("llama_one")
    return train(out, LLAMA), saved(out)


@pytest.mark.deepspeed
@pytest.mark.parametrize("stage, vocab_emb_dp", [(1, False), (3, True)])
def test_tensor_parallel_equals_one_rank(tmp_path, llama_one_rank, stage, vocab_emb_dp):
    """model_parallel 2 on 2 ranks: one data-parallel rank whose layers AutoTP shards (the HF tp_plan); with
    vocab_emb_dp False the lm_head is vocabulary-sharded with DeepSpeed's distributed cross-entropy."""
    two = train(tmp_path, LLAMA, "parallel_config.model_parallel=2", f"mf_ds.zero_stage={stage}",
                f"parallel_config.vocab_emb_dp={vocab_emb_dp}", ranks=2,
                expect="layers (first: model.layers.0.self_attn.q_proj")
    same_run(llama_one_rank[0], two)
    same_weights(llama_one_rank[1], saved(tmp_path))  # gathered whole: the HF shapes, the 1-rank run's values


@pytest.mark.deepspeed
def test_context_parallel_equals_one_rank(tmp_path, llama_one_rank):
    """context_parallel 2 on 2 ranks: Ulysses, each rank 64 of the 128 tokens of every micro batch; stopped after 2
    steps and resumed from its checkpoint for the 3rd, it still gives the 1-rank run's losses."""
    cp = ["parallel_config.context_parallel=2", "callbacks=[{type: MFLossMonitor}, {type: CheckpointMonitor, "
          "prefix: t, save_checkpoint_steps: 2, keep_checkpoint_max: 2}]"]
    train(tmp_path, LLAMA, *cp, ranks=2, steps=2, expect="Ulysses context parallel 2 over SDPA attention")
    two = train(tmp_path, LLAMA, *cp, ranks=2, resume=True)
    assert [m["step"] for m in two] == [1, 2, 3]
    same_run(llama_one_rank[0], two)


@pytest.mark.deepspeed
def test_moe_tensor_parallel_equals_one_rank(tmp_path):
    """Qwen3-MoE under mf-ds' partition_config: attention (and its per-head norms) sharded, experts whole."""
    one = train(tmp_path / "one", QWEN3_MOE)
    two = train(tmp_path / "two", QWEN3_MOE, "parallel_config.model_parallel=2", ranks=2,
                expect="AutoTP sharded")
    same_run(one, two)
    same_weights(saved(tmp_path / "one"), saved(tmp_path / "two"))


@pytest.mark.deepspeed
def test_mla_tensor_parallel_equals_one_rank(tmp_path):
    """DeepSeek-V3 (MLA, first dense layer, shared experts, aux-loss-free router bias) under mf-ds' partition_config:
    q_b_proj / kv_b_proj split by head, o_proj by input, the dense MLP and shared experts split; q_a_proj,
    kv_a_proj_with_mqa, their norms, the router and the routed experts whole. The rope key k_pe, shared by every
    head, gets its gradient summed over TP (mf_ds.parallel.mla_rope_key_grads; without it kv_a_proj_with_mqa was
    2.4e-3 off after 3 steps while the losses still agreed to 1e-7). capacity_factor 1.5 gives C = 96 pairs per
    expert, already a multiple of model_parallel 2 (MindFormers rounds C up to one), so both runs drop the same."""
    no_mtp = "model.model_config.mtp_depth=0"  # MTP under tensor parallel is refused (mf_ds/mtp.py)
    one = train(tmp_path / "one", DEEPSEEK_V3, "mf_ds.zero_stage=1", no_mtp)
    two = train(tmp_path / "two", DEEPSEEK_V3, "mf_ds.zero_stage=1", "parallel_config.model_parallel=2", no_mtp,
                ranks=2, expect="layers (first: model.layers.0.self_attn.q_b_proj")
    same_run(one, two)
    same_weights(saved(tmp_path / "one"), saved(tmp_path / "two"))


def test_hf_trainer_path_refuses_context_parallel_in_one_line(monkeypatch, tmp_path):
    from mf_ds.errors import RunError
    from mf_ds.hf import from_mf_yaml

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RunError) as err:
        from_mf_yaml(LLAMA, output_dir=tmp_path, **{"parallel_config.context_parallel": 2})
    text = str(err.value)
    assert "\n" not in text and text.startswith("parallel_config.context_parallel 2: the HF Trainer path cannot")


HF_TRAINER = """
import sys
from mf_ds.hf import from_mf_yaml
setup = from_mf_yaml(sys.argv[1], output_dir=sys.argv[2], max_steps=3, **{"parallel_config.model_parallel": 2})
trainer = setup.trainer()
trainer.train()
trainer.save_model(sys.argv[2] + "/final")
"""


@pytest.mark.deepspeed
def test_hf_trainer_path_takes_tensor_parallel(tmp_path, llama_one_rank):
    """mf_ds.hf.from_mf_yaml with model_parallel 2 under torchrun: accelerate runs DeepSpeed AutoTP, TP peers get the
    same batches, the losses are the mf-ds loop's on 1 rank and save_model writes whole HF weights."""
    script = tmp_path / "hf_tp.py"
    script.write_text(HF_TRAINER)
    out = tmp_path / "hf"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(script), LLAMA, str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env={**CPU_ENV, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "AutoTP sharded" in proc.stderr
    two = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["loss"] for m in two] == pytest.approx([m["loss"] for m in llama_one_rank[0]], rel=1e-5, abs=1e-5)
    weights = load_file(str(out / "final" / "model.safetensors"))
    for name, tensor in llama_one_rank[1].items():
        torch.testing.assert_close(weights[name], tensor, atol=1e-5, rtol=1e-4)


HF_TRAINER_BIAS = """
import sys
import torch
from safetensors.torch import load_file
from mf_ds.hf import from_mf_yaml
setup = from_mf_yaml(sys.argv[1], output_dir=sys.argv[2], max_steps=2,  # MTP under TP is refused (mf_ds/mtp.py)
                     **{"parallel_config.model_parallel": 2, "model.model_config.mtp_depth": 0})
trainer = setup.trainer()
trainer.train()
trainer.save_model(sys.argv[2] + "/final")
if trainer.is_world_process_zero():
    saved = load_file(sys.argv[2] + "/final/model.safetensors")
    live = {k: v for k, v in setup.model.state_dict().items() if k.endswith("e_score_correction_bias")}
    torch.save({"saved": {k: saved.get(k) for k in live}, "live": live}, sys.argv[2] + "/biases.pt")
"""


@pytest.mark.deepspeed
def test_hf_trainer_save_under_tensor_parallel_keeps_buffers(tmp_path):
    """MFTrainer.save_model under AutoTP (model_parallel 2): accelerate's get_state_dict gathers parameters only, so
    DeepSeek-V3's router bias (a persistent buffer that TopkBiasBalanceCallback moves) was missing from
    model.safetensors; it is saved now, with the values the model trained."""
    script = tmp_path / "hf_tp_bias.py"
    script.write_text(HF_TRAINER_BIAS)
    out = tmp_path / "hf"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(script), DEEPSEEK_V3, str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env={**CPU_ENV, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    biases = torch.load(out / "biases.pt")
    assert biases["live"] and all(bias.any() for bias in biases["live"].values())  # moved by the callback
    for name, bias in biases["live"].items():
        assert biases["saved"][name] is not None, f"{name} not saved"
        torch.testing.assert_close(biases["saved"][name], bias, atol=0, rtol=0)


def _expert_groups(rank: int, port: int, world: int) -> None:
    import datetime
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        from mf_ds.moe.parallel import ExpertParallel

        ep = ExpertParallel(2, 4, tensor_parallel=2)
        # TP peers (0, 1) read the same data: each expert group spans ranks of distinct data, TP-strided
        assert dist.get_process_group_ranks(ep.group) == [rank % 2, rank % 2 + 2]
        assert ep.first == 2 * (rank // 2)
    finally:
        dist.destroy_process_group()


@pytest.mark.deepspeed
def test_expert_groups_under_tensor_parallel_are_tp_strided():
    import os

    import torch.multiprocessing as mp

    os.environ["DS_ACCELERATOR"] = "cpu"
    mp.spawn(_expert_groups, args=(free_port(), 4), nprocs=4, join=True)
