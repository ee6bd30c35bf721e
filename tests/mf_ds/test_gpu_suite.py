"""bench/gpu_suite.py compares each MoE family's fused training run with the same run on the unpatched HF model: that
comparison only means something when both compute the same function. Checked here on CPU in float32, where the
patched model runs the torch references: logits equal to float32 round-off, with the suite's own overrides."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.gpu_suite import COMMON, FAMILIES
from mf_ds import patch
from mf_ds.model import build_model
from translators.plan import translate_file

FP32 = [s for s in COMMON if not s.startswith("model.model_config.compute_dtype")]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_suite_family_patched_equals_unpatched(family):
    yaml_path, overrides = FAMILIES[family]
    plan = translate_file(yaml_path, [*FP32, *overrides]).plan
    assert plan["hf_config"]["model_type"] == family
    torch.manual_seed(0)
    model = build_model(plan)
    reference = copy.deepcopy(model)
    patch.apply(model, plan)  # module-level functions too (RoPE): reverted below, or later tests see them patched
    try:
        ids = torch.randint(0, model.config.vocab_size, (2, 24))
        with torch.no_grad():
            got, want = model(ids, labels=ids), reference(ids, labels=ids)
    finally:
        patch.revert(model)
    torch.testing.assert_close(got.logits, want.logits, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got.loss, want.loss, atol=2e-6, rtol=1e-6)


@pytest.mark.parametrize("script,rows", [
    ("bench/gmm_gpu.py", ("gmm       smoke", "index_maps smoke", "moe_block smoke            T8      mf_ds_torch_gemm")),
    ("bench/rope_swiglu_gpu.py", ("rope", "swiglu_packed packed                     mf_ds")),
])
def test_gpu_benchmark_smoke_runs_every_row(script, rows):
    """The suite's benchmarks, every row once, at tiny shapes on CPU (Triton's interpreter): a GPU session gets
    benchmarks that run, with every mf_ds variant's result checked before it is timed (both exit non-zero on a wrong
    one). The MoE block's Plan comes from the translator, so it cannot drift from what a run uses."""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, script, "--smoke"], cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    for row in rows:
        assert row in done.stdout, done.stdout[-2000:]


def test_target_verdicts_on_the_recorded_h100_run():
    """The suite's target verdicts, computed from the H100 results in bench/results (gpu-notes.md says what they
    show): DeepSpeed's group GEMM beaten by >= 1.2x at every shape, torch's grouped_mm not; the MoE block's 1.3x met
    at 16K tokens and not at 4K, with less memory at both; the MLA RoPE kernel just under 0.85 of copy."""
    from bench.gpu_suite import target_verdicts

    results = Path(__file__).resolve().parents[2] / "bench" / "results"
    gmm_rows = json.loads((results / "gmm-cuda-NVIDIA_H100_80GB_HBM3.json").read_text())["rows"]
    rope_rows = json.loads((results / "rope_swiglu-cuda-NVIDIA_H100_80GB_HBM3.json").read_text())["rows"]
    got = {(t["target"], t["case"]): t for t in target_verdicts(gmm_rows, rope_rows)}
    for shape in ("qwen3_30b_a3b", "mixtral_8x7b", "deepseek_v3_ep8"):
        assert got["gmm vs deepspeed", f"{shape} T16384"]["met"]
        assert not got["gmm vs torch", f"{shape} T16384"]["met"]
    assert got["gmm vs torch", "mixtral_8x7b T16384"]["value"] == pytest.approx(0.947, abs=1e-3)
    assert got["moe_block vs hf_grouped_mm", "qwen3_30b_a3b T16384"]["met"]
    assert not got["moe_block vs hf_grouped_mm", "qwen3_30b_a3b T4096"]["met"]
    assert all(got["moe_block peak memory vs hf_grouped_mm", f"qwen3_30b_a3b T{t}"]["met"] for t in (4096, 16384))
    assert not got["kernel fraction of copy bandwidth", "rope deepseek_v3_mla"]["met"]
    assert got["kernel fraction of copy bandwidth", "rope llama3_8b"]["met"]
