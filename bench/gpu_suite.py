"""One command that proves the GPU: kernel tests, training runs of every MoE family, and the benchmarks.

    python bench/gpu_suite.py [--out DIR] [--skip tests,train,bench] [--quick]

Run on a CUDA machine in one go (about 10 minutes on an H100). Steps, each logged to DIR/<step>.log:
1. tests: `pytest tests/ops` on CUDA: every Triton kernel at production tiles (bf16 and fp16, > 128 rows per expert,
   N > 128, skewed and empty experts, rows past 2^31 elements, every autotune config) against the references; and
   tests/mf_ds/test_loss.py, the fused loss' Liger path against HF's loss.
2. train: for each MoE family (Qwen3-MoE, DeepSeek-V3, Mixtral, Qwen2-MoE), a tiny model trained for STEPS steps by
   `deepspeed mf_ds/train.py` with every fused op on (use_gmm, fused RoPE, fused SwiGLU where the family has a
   dense SwiGLU MLP), bf16, ZeRO-2, dropless, aux losses off; and the same run with the HF model unpatched
   (bench/gpu_train_reference.py). Their per-step losses must agree within bf16 noise.
3. bench: bench/gmm_gpu.py (grouped matmul and MoE block vs torch grouped_mm, DeepSpeed's Triton group GEMM, HF v5
   experts) and bench/rope_swiglu_gpu.py (vs Liger, DeepSpeed, HF eager, the copy bandwidth).
4. train_gpu: bench/train_gpu.py, whole optimizer steps of a Qwen3-30B-A3B-shaped and a DeepSeek-V3-shaped model,
   mf-ds vs the same loop on HF's grouped_mm experts (and + Liger), tokens/s, MFU, peak memory, a profile per run.
Writes DIR/gpu_suite-cuda-<device>.json (the verdict of each step, stamped with device, driver and versions) beside
the benchmarks' own result files, and prints each target of issues 15 and 24 as met or not, judged from this run's
own result files only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STEPS = 8
LOSS_TOL = 0.05  # |fused - reference| per step: bf16 kernels against transformers' bf16 math, a tiny model
COMMON = ["model.model_config.compute_dtype=bfloat16", "mf_ds.zero_stage=2", "runner_config.batch_size=2",
          "runner_config.gradient_accumulation_steps=1", "recompute_config.recompute=False",
          "recompute_config.select_recompute=False", "recompute_config.select_comm_recompute=False"]
LLAMA_MOE = ["model.model_config.use_fused_rope=True", "moe_config.num_experts_chosen=2",
             "moe_config.capacity_factor=-1", "moe_config.use_gmm=True", "moe_config.aux_loss_factor=0.0"]
FAMILIES = {  # name: (YAML, overrides)
    "qwen3_moe": ("configs/tiny_qwen3_moe.yaml", ["model.model_config.apply_rope_fusion=True",
                                                  "model.model_config.moe_aux_loss_coeff=0.0"]),
    "deepseek_v3": ("configs/tiny_deepseek_v3.yaml", ["model.model_config.use_fused_rope=True",
                                                      "model.model_config.use_fused_swiglu=True",
                                                      "moe_config.capacity_factor=-1", "moe_config.use_gmm=True",
                                                      "moe_config.aux_loss_factors=[0.0]",
                                                      "moe_config.balance_via_topk_bias=False"]),
    "mixtral": ("configs/tiny_llama.yaml", ["moe_config.expert_num=8", *LLAMA_MOE]),  # every layer MoE: the fused
    # SwiGLU runs inside the MoE block's experts (no dense MLP to patch)
    # the gate on the shared expert on: HF's Qwen2MoE block always applies it, so without it the reference computes
    # another function (the cause of session 3's 5.5e-3 loss difference; tests/mf_ds/test_gpu_suite.py)
    "qwen2_moe": ("configs/tiny_llama.yaml", ["moe_config.expert_num=8", "moe_config.shared_expert_num=1",
                                              "moe_config.use_shared_expert_gating=True",
                                              "model.model_config.use_fused_swiglu=True", *LLAMA_MOE]),
}


def start_step(name: str, cmd: list[str], out: Path, env: dict | None = None) -> tuple:
    log = (out / f"{name}.log").open("w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    return name, cmd, proc, log, time.perf_counter()


def finish_step(started: tuple, out: Path, timeout: float) -> dict:
    name, cmd, proc, log, start = started
    try:
        rc = proc.wait(timeout=max(1.0, timeout - (time.perf_counter() - start)))
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = "timeout"
    log.close()
    tail = (out / f"{name}.log").read_text().strip().splitlines()[-3:]
    return {"step": name, "cmd": " ".join(cmd), "rc": rc, "seconds": round(time.perf_counter() - start, 1),
            "tail": tail}


def run_step(name: str, cmd: list[str], out: Path, timeout: float) -> dict:
    return finish_step(start_step(name, cmd, out), out, timeout)


def losses(output_dir: Path) -> list[float]:
    path = output_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line)["loss"] for line in path.read_text().splitlines() if line.strip()]


def train_all(out: Path, timeout: float = 300) -> list[dict]:
    """Every family's fused and reference run at once (tiny models: the GPU holds them all), then the verdicts."""
    started = {}
    for i, (family, (yaml_path, overrides)) in enumerate(FAMILIES.items()):
        sets = [arg for s in [*COMMON, *overrides] for arg in ("--set", s)]
        scripts = (("fused", "mf_ds/train.py"), ("reference", "bench/gpu_train_reference.py"))
        for j, (kind, script) in enumerate(scripts):
            cmd = ["deepspeed", "--num_gpus", "1", "--master_port", str(29500 + 2 * i + j), script,
                   "--mf-config", yaml_path, *sets, "--max_steps", str(STEPS),
                   "--output_dir", str(out / f"train-{family}-{kind}")]
            started[family, kind] = start_step(f"train-{family}-{kind}", cmd, out)
    verdicts = []
    for family in FAMILIES:
        runs = {kind: finish_step(started[family, kind], out, timeout) for kind in ("fused", "reference")}
        for kind, run in runs.items():
            run["losses"] = losses(out / f"train-{family}-{kind}")
        fused, ref = runs["fused"]["losses"], runs["reference"]["losses"]
        diffs = [abs(a - b) for a, b in zip(fused, ref, strict=False)]
        ok = len(fused) == len(ref) == STEPS and max(diffs, default=1.0) <= LOSS_TOL and fused[-1] < fused[0]
        verdicts.append({"family": family, "ok": ok, "max_loss_diff": max(diffs, default=None), "runs": runs})
    return verdicts


E2E_SPEEDUP = 1.3  # issue 24: the step >= 1.3x the HF grouped_mm loop's tokens/s ...
E2E_PEAK = 1.0  # ... at equal or lower peak memory
E2E_MFU = {"qwen3_30b_a3b": 0.35}  # ... and >= 35% MFU for the Qwen3-30B-A3B-shaped model on one GPU


def train_verdicts(train: dict) -> list[dict]:
    """Issue 24's end-to-end targets from a bench/train_gpu.py result: per model, mf_ds's tokens/s over the HF
    grouped_mm loop's, its peak memory over theirs, and its MFU where the issue sets one. A peer that could not run
    gives no verdict; an mf_ds run without a result fails its targets."""
    out = []
    for model, record in sorted(train["models"].items()):
        ours, hf = record["runs"].get("mf_ds", {}), record["runs"].get("hf_grouped_mm", {})
        if hf.get("tokens_per_s"):
            value = ours["tokens_per_s"] / hf["tokens_per_s"] if ours.get("tokens_per_s") else None
            out.append(_verdict("e2e tokens/s vs hf_grouped_mm", model, value, E2E_SPEEDUP))
        if hf.get("peak_MiB"):
            value = ours["peak_MiB"] / hf["peak_MiB"] if ours.get("peak_MiB") else None
            out.append(_verdict("e2e peak memory vs hf_grouped_mm", model, value, E2E_PEAK, at_least=False))
        if model in E2E_MFU:
            out.append(_verdict("e2e MFU", model, ours.get("mfu"), E2E_MFU[model]))
    return out


def _verdict(target: str, case: str, value, needed: float, at_least: bool = True) -> dict:
    met = value is not None and (value >= needed if at_least else value <= needed)
    return {"target": target, "case": case, "value": value, "needed": needed, "met": met}


def target_verdicts(gmm_rows: list[dict], rope_rows: list[dict]) -> list[dict]:
    """Issue 15's targets, each case against its peer from the same run: {target, case, value, needed, met}.
    GMM fwd+bwd >= 1.2x torch grouped_mm and DeepSpeed's Triton group GEMM; the MoE block >= 1.3x HF v5 grouped_mm
    experts with lower peak memory; RoPE and SwiGLU kernels >= 0.85 of copy bandwidth and mf_ds fastest through
    autograd. A peer that could not run gives no verdict; an mf_ds row without a time fails its target."""
    out = []

    def verdict(target, case, value, needed, at_least=True):
        out.append(_verdict(target, case, value, needed, at_least))

    for bench, peers, needed in (("gmm", ("torch", "deepspeed"), 1.2), ("moe_block", ("hf_grouped_mm",), 1.3)):
        cases = {(r["shape"], r["tokens"]) for r in gmm_rows if r["bench"] == bench}
        for shape, tokens in sorted(cases):
            rows = {r["impl"]: r for r in gmm_rows if r["bench"] == bench and (r["shape"], r["tokens"]) == (shape,
                                                                                                         tokens)}
            ours = rows.get("mf_ds", {})
            for peer in peers:
                theirs = rows.get(peer, {})
                if not theirs.get("ms"):
                    continue
                speedup = theirs["ms"] / ours["ms"] if ours.get("ms") else None
                verdict(f"{bench} vs {peer}", f"{shape} T{tokens}", speedup, needed)
                if bench == "moe_block" and ours.get("ms"):
                    verdict(f"{bench} peak memory vs {peer}", f"{shape} T{tokens}",
                            ours["peak_MiB"] / theirs["peak_MiB"], 1.0, at_least=False)
    for r in rope_rows:
        case = f"{r['op']} {r['case']}"
        if r["kind"] == "kernel":
            verdict("kernel fraction of copy bandwidth", case, r.get("fraction_of_copy"), 0.85)
        elif r["kind"] == "autograd" and r.get("impl") != "mf_ds" and r.get("ms_net") is not None:
            verdict(f"autograd vs {r['impl']}", case, r.get("mf_ds_speedup"), 1.0)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--skip", default="", help="comma-separated steps to skip: tests, train, bench (all three "
                        "benchmarks), gmm_gpu, rope_swiglu_gpu, train_gpu")
    parser.add_argument("--quick", action="store_true", help="benchmarks at one token count per shape")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench/gpu_suite.py needs a CUDA device")
    from bench.gpu_env import stamp

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    record = {"suite": "gpu_suite", **stamp(), "steps": []}
    started = time.time()
    py = sys.executable
    if "tests" not in skip:
        tests = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "8", "tests/ops",
                 "tests/mf_ds/test_loss.py"]  # 8 compiling in parallel; the fused loss' Liger path
        # MF_DS_COMPILE_ALL: tests/ops/test_compile.py compiles every launch at every config here (16 cores)
        record["steps"].append(finish_step(start_step("tests", tests, out, env={"MF_DS_COMPILE_ALL": "1"}), out,
                                           timeout=500))
        print("tests:", record["steps"][-1]["rc"], record["steps"][-1]["tail"][-1:], flush=True)
    if "train" not in skip:
        record["train"] = train_all(out)
        for t in record["train"]:
            print(f"train {t['family']:12} ok={t['ok']} max|dloss|={t['max_loss_diff']} "
                  f"fused={[round(x, 3) for x in t['runs']['fused']['losses']]} "
                  f"ref={[round(x, 3) for x in t['runs']['reference']['losses']]}", flush=True)
    if "bench" not in skip:
        quick = ["--quick"] if args.quick else []
        for cmd in ([py, "bench/gmm_gpu.py", "--out", str(out), *quick],
                    [py, "bench/rope_swiglu_gpu.py", "--out", str(out)],
                    [py, "bench/train_gpu.py", "--out", str(out),
                     *(["--steps", "8", "--impls", "mf_ds,hf_grouped_mm,mf_ds_compile"] if args.quick else [])]):
            if Path(cmd[1]).stem in skip:
                continue
            # train_gpu: 16 runs (--quick: 6), each building a multi-GB model and autotuning its GEMMs once
            record["steps"].append(run_step(Path(cmd[1]).stem, cmd, out, timeout=2400 if "train" in cmd[1] else 900))
            print(cmd[1], record["steps"][-1]["rc"], flush=True)
            print((out / f"{Path(cmd[1]).stem}.log").read_text()[-3000:], flush=True)
    device = record["device"]["name"].replace(" ", "_")
    results = [out / f"gmm-cuda-{device}.json", out / f"rope_swiglu-cuda-{device}.json"]
    record["targets"] = []
    if "bench" not in skip and all(p.is_file() and p.stat().st_mtime >= started for p in results):  # this run's
        record["targets"] = target_verdicts(*(json.loads(p.read_text())["rows"] for p in results))
    train_result = out / f"train_gpu-{device}.json"
    if "bench" not in skip and train_result.is_file() and train_result.stat().st_mtime >= started:
        record["targets"] += train_verdicts(json.loads(train_result.read_text()))
    if record["targets"]:
        for t in record["targets"]:
            value = "--" if t["value"] is None else f"{t['value']:.2f}"
            print(f"target {'met    ' if t['met'] else 'NOT met'} {t['target']:40} {t['case']:28} {value} "
                  f"(needed {'>=' if 'memory' not in t['target'] else '<='} {t['needed']})", flush=True)
    path = out / f"gpu_suite-cuda-{device}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"-> {path}")
    failed = [s["step"] for s in record["steps"] if s["rc"] != 0] + \
        [t["family"] for t in record.get("train", []) if not t["ok"]]
    print("FAILED: " + ", ".join(failed) if failed else "all steps passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
