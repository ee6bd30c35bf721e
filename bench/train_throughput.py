"""Training throughput of mf_ds vs a plain DeepSpeed loop on the same HF model and config, side by side.

    python bench/train_throughput.py            # writes bench/results/train_throughput-<device>.json

Both train configs/tiny_llama.yaml (recompute off, so both do the same work) for the same number of steps at the
same global batch, one process each, alternating mf_ds and the plain loop for several rounds so that machine noise
hits both alike. Each run reports tokens/s per optimizer step (data fetch included); the first 5 steps are
warm-up. Target: mf_ds / plain >= 0.95 on CPU.
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
SETS = ["recompute_config.recompute=false", "parallel_config.data_parallel=1"]
STEPS, ROUNDS = 40, 3


def run(cmd: list[str]) -> None:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "")}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")


def main() -> None:
    sets = [arg for s in SETS for arg in ("--set", s)]
    results: dict[str, list[float]] = {"mf_ds": [], "plain_deepspeed": []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        run([sys.executable, "-m", "translators.cli", str(CONFIG), *sets, "--hf-config", str(tmp / "hf.json"),
             "--plan", str(tmp / "plan.json")])
        (tmp / "ds.json").write_text(json.dumps(json.loads((tmp / "plan.json").read_text())["deepspeed"]))
        for r in range(ROUNDS):
            out = tmp / f"mf{r}"
            run([sys.executable, "-m", "mf_ds.cli", str(CONFIG), *sets, "--max_steps", str(STEPS),
                 "--output_dir", str(out), "--set", "callbacks=[{type: MFLossMonitor, per_print_times: 1000}]"])
            rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            results["mf_ds"].append(statistics.median(row["tokens_per_s"] for row in rows[5:]))
            run([sys.executable, str(ROOT / "bench" / "plain_deepspeed_loop.py"), "--hf", str(tmp / "hf.json"),
                 "--ds", str(tmp / "ds.json"), "--steps", str(STEPS), "--out", str(tmp / f"plain{r}.json")])
            results["plain_deepspeed"].append(json.loads((tmp / f"plain{r}.json").read_text())["median"])
    import deepspeed
    import torch
    import transformers

    mf, plain = statistics.median(results["mf_ds"]), statistics.median(results["plain_deepspeed"])
    record = {
        "benchmark": "train_throughput", "config": str(CONFIG.relative_to(ROOT)), "overrides": SETS,
        "steps": STEPS, "rounds": ROUNDS, "tokens_per_s_median": {"mf_ds": mf, "plain_deepspeed": plain},
        "per_round": results, "ratio_mf_ds_over_plain": mf / plain, "target": ">= 0.95",
        "device": "cuda:" + torch.cuda.get_device_name() if torch.cuda.is_available() else
        f"cpu ({os.cpu_count()} cores, {platform.processor() or platform.machine()})",
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "deepspeed": deepspeed.__version__, "transformers": transformers.__version__},
    }
    kind = "gpu" if torch.cuda.is_available() else "cpu"
    path = ROOT / "bench" / "results" / f"train_throughput-{kind}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record["tokens_per_s_median"]), f"ratio {record['ratio_mf_ds_over_plain']:.3f} -> {path}")


if __name__ == "__main__":
    main()
