"""Each rank's peak memory on 2 pipeline stages against one rank, and the measured bubble (CPU, gloo).

    python bench/pipeline_memory.py            # writes bench/results/pipeline_memory-cpu.json

configs/tiny_llama.yaml widened to ~168M parameters (32k vocabulary, untied; fp32 weights, gradients and Adam: ~2.7 GB
on one rank), so the model states dominate the process' own floor (torch, DeepSpeed, transformers imported: measured
alone). The same global batch (micro batch 1 x 8 micro batches) runs on one rank (GA 8) and on 2 stages
(mf_ds.pipeline, ZeRO-0), 3 steps each. Peak: each rank's ru_maxrss at exit (a sitecustomize in a temporary directory
records it). Bubble: with a perfect split the pipeline's step takes T1 / pp, so 1 - T1 / (pp x Tpp) is the time the
stages stand idle (1F1B's theoretical (pp - 1) / (m + pp - 1) beside it); the step times are the medians of steps 2-3
from metrics.jsonl (tokens per step / tokens_per_s). Fresh weights (the pipeline seeds each layer: its losses are not
the one-rank run's; tests/mf_ds/test_pipeline.py proves equality from the same weights).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "tiny_llama.yaml"
MODEL = ["model.model_config.hidden_size=1024", "model.model_config.intermediate_size=2816",
         "model.model_config.num_layers=8", "model.model_config.num_heads=16", "model.model_config.n_kv_heads=16",
         "model.model_config.vocab_size=32000", "model.model_config.seq_length=64", "recompute_config.recompute=False",
         "runner_config.batch_size=1", "callbacks=[{type: MFLossMonitor, per_print_times: 1}]"]
MICRO, PP, STEPS = 8, 2, 3
PEAK_HOOK = """import atexit, json, os, resource, sys
def _peak():
    out = os.environ.get("MF_DS_BENCH_PEAK")
    if out and (sys.argv[0].endswith("train.py") or sys.argv[0] == "-c"):  # not the launcher's processes
        with open(os.path.join(out, f"rank{os.environ.get('RANK', '0')}.json"), "w") as f:
            json.dump({"maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}, f)
atexit.register(_peak)
"""


def _env(hook: Path, peaks: Path) -> dict[str, str]:
    path = os.pathsep.join([str(hook), str(ROOT), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": path,
            "MF_DS_BENCH_PEAK": str(peaks), "CUDA_VISIBLE_DEVICES": ""}


def _train(tmp: Path, name: str, ranks: int, sets: list[str], hook: Path) -> dict:
    out, peaks = tmp / name, tmp / f"{name}-peaks"
    peaks.mkdir()
    args = [a for s in MODEL + sets for a in ("--set", s)]
    cmd = ["deepspeed", "--num_gpus", str(ranks), "--master_port", str(29500 + os.getpid() % 1000 + ranks),
           str(ROOT / "mf_ds" / "train.py"), "--mf-config", str(CONFIG), "--output_dir", str(out),
           "--max_steps", str(STEPS), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(hook, peaks), capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{name} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    tokens = MICRO * 64
    step_s = statistics.median(tokens / r["tokens_per_s"] for r in rows[1:])
    held = [int(n) for n in __import__("re").findall(r"holds decoder layers \[[\d, ]*\] \((\d+) parameters\)",
                                                      proc.stderr)]
    peak = [json.loads((peaks / f"rank{r}.json").read_text())["maxrss_mib"] for r in range(ranks)]
    return {"ranks": ranks, "peak_mib": peak, "step_s": step_s, "parameters_per_rank": held or None}


def _floor(hook: Path, tmp: Path) -> float:
    """The peak of a process that imports what train.py imports and builds nothing."""
    peaks = tmp / "floor-peaks"
    peaks.mkdir()
    code = "import torch, deepspeed, transformers, mf_ds.loop"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(hook, peaks), check=True, capture_output=True)
    return json.loads((peaks / "rank0.json").read_text())["maxrss_mib"]


def main() -> None:
    import deepspeed
    import torch
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        hook = tmp / "hook"
        hook.mkdir()
        (hook / "sitecustomize.py").write_text(PEAK_HOOK)
        floor = _floor(hook, tmp)
        one = _train(tmp, "one", 1, ["parallel_config.data_parallel=1",
                                     f"runner_config.gradient_accumulation_steps={MICRO}"], hook)
        pipe = _train(tmp, "pp2", PP, ["parallel_config.data_parallel=1", f"parallel_config.pipeline_stage={PP}",
                                       f"parallel_config.micro_batch_num={MICRO}", "mf_ds.pipeline=true",
                                       "mf_ds.zero_stage=0"], hook)
    result = {
        "benchmark": "pipeline_memory",
        "what": "tiny_llama widened to ~168M parameters: each rank's peak RSS on 2 stages vs one rank, same global "
                "batch (1 x 8 micro batches, seq 64), fp32, ZeRO-0; the measured bubble",
        "note": "peaks are whole-process ru_maxrss: one rank's includes building the whole model (from_config and "
                "its initialisation); not broken down further",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared), OMP_NUM_THREADS=1",
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "deepspeed": deepspeed.__version__, "transformers": transformers.__version__},
        "import_floor_mib": floor,
        "one_rank": one,
        "pipeline": pipe,
        "peak_above_floor_ratio": [(p - floor) / (one["peak_mib"][0] - floor) for p in pipe["peak_mib"]],
        "bubble_measured": 1 - one["step_s"] / (PP * pipe["step_s"]),
        "bubble_1f1b_theory": (PP - 1) / (MICRO + PP - 1),
    }
    path = ROOT / "bench" / "results" / "pipeline_memory-cpu.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
