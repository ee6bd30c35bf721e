"""Regional compilation (mf_ds/patch/compile.py, `mf_ds.compile_layers`, `mf-train --compile_layers`): a tiny patched
MoE model trained three steps with each decoder layer compiled logs the eager run's losses, gradient norms and MoE
statistics (full recompute on); with per-op (select) recompute the patched model's gradients equal eager; revert
takes the compiled calls back; ZeRO-3 is refused in one line."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mf_ds.moe
import mf_ds.patch
from mf_ds.patch import PatchError
from tests.conftest import CONFIGS, QUIET_CPU_ENV, ROOT
from tests.moe import family_plan, grads, tiny_model
from translators.plan_types import Layer

STEPS = ["--max_steps", "3", "--set", "runner_config.batch_size=1", "--set", "parallel_config.data_parallel=1",
         "--set", "model.model_config.seq_length=32", "--set", "recompute_config.recompute=True"]


def _train(out: Path, *args: str) -> list[dict]:
    env = dict(QUIET_CPU_ENV, MF_DS_COMPILE_BACKEND="aot_eager")
    proc = subprocess.run([sys.executable, "-m", "mf_ds.cli", str(CONFIGS / "tiny_qwen3_moe.yaml"), "--output_dir",
                           str(out), *STEPS, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("decoder layers under torch.compile" in proc.stderr) == bool(args), proc.stderr[-2000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_mf_train_with_compiled_layers_logs_the_eager_losses(tmp_path):
    eager = _train(tmp_path / "eager")
    compiled = _train(tmp_path / "compiled", "--compile_layers")
    assert len(eager) == len(compiled) == 3
    for a, b in zip(eager, compiled, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6, abs=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
        assert b["moe"] == a["moe"]  # counted once per forward, the recompute in backward not counted


def _plan(layers: tuple[Layer, ...], compile_layers: bool):
    plan = family_plan("qwen3_moe", capacity_factor=1.0, dropless=False, aux_loss={"expert": 0.01})
    return dataclasses.replace(plan, layers=layers, run=dataclasses.replace(plan.run, compile_layers=compile_layers))


def _grads(model, ids) -> tuple[float, dict]:
    model.zero_grad()
    loss = model(ids, labels=ids).loss + mf_ds.moe.aux_loss(model)
    loss.backward()
    return loss.item(), grads(model)


def test_select_recompute_inside_compiled_layers_equals_eager(monkeypatch):
    monkeypatch.setenv("MF_DS_COMPILE_BACKEND", "aot_eager")
    layers = tuple(Layer(index=i, select_recompute=("input_layernorm", "mlp.gate", "self_attn.q_norm"))
                   for i in range(2))
    eager, compiled = tiny_model("qwen3_moe"), tiny_model("qwen3_moe")
    for model, on in ((eager, False), (compiled, True)):
        model.config.use_cache = False
        report = mf_ds.patch.apply(model.train(), _plan(layers, on))
        assert any("under torch.compile" in line for line in report) == on
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        (loss, want), (got_loss, got) = _grads(eager, ids), _grads(compiled, ids)
        assert got_loss == pytest.approx(loss, rel=1e-6)
        for name, grad in want.items():
            torch.testing.assert_close(got[name], grad, atol=1e-5, rtol=1e-5, msg=name)
    assert all(layer._compiled_call_impl is not None for layer in compiled.model.layers)
    mf_ds.patch.revert(compiled)
    assert all(layer._compiled_call_impl is None for layer in compiled.model.layers)


def test_zero3_is_refused():
    model = tiny_model("qwen3_moe")
    plan = _plan((), True)
    plan = dataclasses.replace(plan, deepspeed={**plan.deepspeed, "zero_optimization": {"stage": 3}})
    with pytest.raises(PatchError, match="mf_ds.compile_layers: not with ZeRO-3"):
        mf_ds.patch.apply(model, plan)
    assert not hasattr(model, "_mf_ds_patches")
