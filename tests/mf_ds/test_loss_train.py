"""The fused loss in the two training paths: mf-train (mf_ds/loop.py) and the HF Trainer (mf_ds/hf.py) train the same
steps with it on and off: the same losses and gradient norms, with MoE aux losses, recompute, ZeRO-3, bf16 and the
interleave. (Ulysses and AutoTP: tests/mf_ds/test_parallel.py compares them with one rank, now fused by default.)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import CONFIGS, CPU_ENV, ROOT, free_port

HF_RUN = """
import sys, torch
from mf_ds.hf import from_mf_yaml
torch.set_flush_denormal(True)
setup = from_mf_yaml(sys.argv[1], output_dir=sys.argv[2], max_steps=3, **{"mf_ds.fused_loss": sys.argv[3] == "on"})
print("\\n".join(setup.report), file=sys.stderr)
setup.trainer().train()
"""


def _both(cmds: dict[str, list[str]], one_rank: bool = False) -> dict[str, subprocess.CompletedProcess]:
    """Run the commands side by side (one thread each: the machine has 2 cores); `one_rank`: each its own
    one-rank torch.distributed world (mf-train makes its own)."""

    def env():
        return {**CPU_ENV, **({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                               "MASTER_PORT": str(free_port())} if one_rank else {})}

    procs = {k: subprocess.Popen(c, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k, c in cmds.items()}
    done = {}
    for key, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        done[key] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        assert proc.returncode == 0, err[-3000:]
    return done


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _same(on: Path, off: Path, rel: float) -> None:
    a, b = _rows(on), _rows(off)
    assert len(a) == len(b) == 3
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], rel=rel)
    assert [r["grad_norm"] for r in a] == pytest.approx([r["grad_norm"] for r in b], rel=rel * 10)


@pytest.mark.deepspeed
@pytest.mark.parametrize("config,sets,rel", [
    ("tiny_qwen3_moe", ["mf_ds.zero_stage=3"], 1e-5),  # MoE aux losses added after, ZeRO-3's gathered head
    ("tiny_deepseek_v3", [], 1e-5),  # MLA, MoE with bias balancing, recompute
    ("tiny_llama", ["model.model_config.compute_dtype=bfloat16", "micro_batch_interleave_num=2"], 1e-2),
], ids=["qwen3_moe-zero3", "deepseek_v3", "llama-bf16-interleave"])
def test_mf_train_fused_equals_unfused(tmp_path, config, sets, rel):
    base = [sys.executable, "-m", "mf_ds.cli", str(CONFIGS / f"{config}.yaml"), "--max_steps", "3",
            *[a for s in sets for a in ("--set", s)]]
    runs = _both({flag: [*base, "--output_dir", str(tmp_path / flag), "--fused_loss", flag] for flag in ("on", "off")})
    assert "fused loss: on (chunked torch on CPU)" in runs["on"].stderr
    assert "fused loss: off (mf_ds.fused_loss: false)" in runs["off"].stderr
    _same(tmp_path / "on", tmp_path / "off", rel)


@pytest.mark.deepspeed
def test_hf_trainer_fused_equals_unfused(tmp_path):
    """The Trainer's own reduction (the window's token count, num_items_in_batch) and the MoE aux losses."""
    yaml = str(CONFIGS / "tiny_qwen3_moe.yaml")
    runs = _both({flag: [sys.executable, "-c", HF_RUN, yaml, str(tmp_path / flag), flag] for flag in ("on", "off")},
                 one_rank=True)
    assert "fused loss: on" in runs["on"].stderr and "fused loss: off" in runs["off"].stderr
    _same(tmp_path / "on", tmp_path / "off", 1e-5)
