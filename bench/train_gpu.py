"""Whole optimizer steps on one GPU: mf-ds vs the same loop with HF's own experts (grouped_mm) vs HF + Liger.

    python bench/train_gpu.py [--model qwen3_30b_a3b,deepseek_v3] [--steps 12] [--out DIR]
    python bench/train_gpu.py --smoke            # CPU, tiny shapes, 3 steps: the tests run this

Models, each a MindFormers YAML from configs/ with the published model's shapes set over it (real vocabulary; the
layer count cut to fit one 80 GB GPU with ZeRO-1's bf16 + fp32 AdamW states, 16 bytes a parameter):
- qwen3_30b_a3b: Qwen3-30B-A3B (hidden 2048, 32 q / 4 kv heads of 128, 128 experts top-8 of width 768, vocab
  151,936), 3 of its 48 layers: ~2.5B parameters, ~40 GB of weights, gradients and AdamW states.
- deepseek_v3: DeepSeek-V3 (hidden 7168, MLA: 128 heads, q_lora 1536, kv_lora 512, rope 64 + nope 128, v 128;
  experts of width 2048, top-8, vocab 129,280), 2 layers (the first dense, as its first_k_dense_replace), with 16 of
  its 256 experts (one rank's share under expert parallelism 16): ~3.4B parameters, ~55 GB, the embedding and LM
  head (1.85B) the largest part; one of its MoE layers with all 256 experts would not fit one GPU.
Tokens: micro batch 4 x 4096 = 16,384 tokens, gradient accumulation 4: 65,536 tokens per optimizer step. bf16,
ZeRO-1, dropless routing, aux losses off (HF's blocks add theirs only with output_router_logits: with them on, the
two runs would not train the same function), the attention MindFormers' use_flash_attention maps to, in all three.

Peers, the same loop (mf_ds/train.py's, on the same Plan, data, optimizer and seed):
  mf_ds           mf_ds/train.py as a user runs it: every fused op the YAML asks for (GMM experts, fused permute,
                  RoPE, SwiGLU), and the fused loss (mf_ds/loss.py: Liger's fused linear cross-entropy on CUDA)
  mf_ds_unfused   the same with `--fused_loss off`: the loss over the whole [tokens, vocab] logits (the lever's row)
  hf_grouped_mm   the HF model unpatched, its experts on `grouped_mm` (transformers' default experts
                  implementation, set explicitly), HF's own loss: bench/gpu_train_reference.py's run
  hf_liger        the same plus Liger's kernels applied to the model instance (RoPE, SwiGLU, RMSNorm, fused linear
                  cross entropy where Liger has the family); skipped, with the reason, where Liger is absent
  (lever rows, bench/train_gpu_levers.py: mf_ds_compile, mf_ds_gmm_{triton,tma,torch}, hf_sonicmoe; `--impls`
  picks rows, `--micro-batch N` / `--micro-batch-search` the micro batch of each)
Each run is a child process of this script (`--child IMPL`, then mf_ds/train.py's own arguments), so that the peers
share nothing but the GPU. Per run: tokens/s (median over the steps after WARMUP), peak memory
(torch.cuda.max_memory_allocated), and MFU:

    MFU = tokens/s x FLOPs per token / the chip's dense bf16 peak (PEAK_BF16_TFLOPS)
    FLOPs per token = 6 N_active + 3 L n_heads S (d_qk + d_v)       (each run's JSON has it with its numbers)

with N_active the matmul parameters a token passes through (attention, dense MLPs, the router, the shared expert,
top_k / E of the routed experts, the LM head; not the input embedding, a lookup) and the attention term the causal
QK^T and PV products (S / 2 keys per token on average), each x 3 for forward and backward.
One optimizer step (PROFILE_STEP) runs under torch.profiler; its GPU (on CPU: host) time is broken down into GEMMs,
attention, routing / permute, SwiGLU / RoPE / norms (elementwise), the optimizer, the rest, and the host gaps (the
step's wall time the GPU spent idle), written to `train_gpu-<model>-<impl>.profile.json` beside the result JSON
`train_gpu-<device>.json`, which is stamped with device and versions (bench/gpu_env.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import train_gpu_levers as levers  # noqa: E402 - the lever rows (compile, GMM backends, SonicMoE)

WARMUP = 3  # steps left out of the tokens/s median (autotuning, the first allocations)
PROFILE_STEP = 5
IMPLS = ("mf_ds", "mf_ds_unfused", "hf_grouped_mm", "hf_liger", *levers.IMPLS)
COMMON = ["model.model_config.compute_dtype=bfloat16", "mf_ds.zero_stage=1", "parallel_config.data_parallel=1",
          "runner_config.batch_size=4", "runner_config.gradient_accumulation_steps=4",
          "recompute_config.recompute=False", "recompute_config.select_recompute=False",
          "recompute_config.select_comm_recompute=False", "callbacks=[{type: MFLossMonitor, per_print_times: 1}]",
          # the YAMLs' one epoch of the built-in corpus is 7 steps of 16 x 4096 tokens and fewer for larger micro
          # batches (an H200 run at micro batch 16 stopped after its first step): --steps decides, not the corpus
          "runner_config.epochs=1000"]
MODELS = {  # name: (YAML, shape overrides, the smoke run's overrides)
    "qwen3_30b_a3b": ("configs/tiny_qwen3_moe.yaml", [
        "model.model_config.hidden_size=2048", "model.model_config.num_hidden_layers=3",
        "model.model_config.num_attention_heads=32", "model.model_config.num_key_value_heads=4",
        "model.model_config.head_dim=128", "model.model_config.intermediate_size=6144",
        "model.model_config.num_experts=128", "model.model_config.num_experts_per_tok=8",
        "model.model_config.moe_intermediate_size=768", "model.model_config.vocab_size=151936",
        "model.model_config.seq_length=4096", "model.model_config.max_position_embeddings=4096",
        "model.model_config.use_flash_attention=True", "model.model_config.apply_rope_fusion=True",
        "model.model_config.moe_aux_loss_coeff=0.0", "model.model_config.moe_permute_fusion=True",
    ], ["model.model_config.apply_rope_fusion=True", "model.model_config.moe_aux_loss_coeff=0.0",
        "model.model_config.moe_permute_fusion=True"]),
    "deepseek_v3": ("configs/tiny_deepseek_v3.yaml", [
        "model.model_config.hidden_size=7168", "model.model_config.num_layers=2", "model.model_config.num_heads=128",
        "model.model_config.n_kv_heads=128", "model.model_config.q_lora_rank=1536",
        "model.model_config.kv_lora_rank=512", "model.model_config.qk_rope_head_dim=64",
        "model.model_config.qk_nope_head_dim=128", "model.model_config.v_head_dim=128",
        "model.model_config.intermediate_size=18432", "model.model_config.vocab_size=129280",
        "model.model_config.seq_length=4096", "model.model_config.max_position_embeddings=4096",
        "model.model_config.mtp_depth=0", "model.model_config.use_flash_attention=True",
        "model.model_config.use_fused_rope=True", "model.model_config.use_fused_swiglu=True",
        "moe_config.expert_num=16", "moe_config.num_experts_chosen=8", "moe_config.moe_intermediate_size=2048",
        "moe_config.first_k_dense_replace=1", "moe_config.capacity_factor=-1", "moe_config.use_gmm=True",
        "moe_config.use_fused_ops_permute=True", "moe_config.aux_loss_factors=[0.0]",
    ], ["model.model_config.use_fused_rope=True", "model.model_config.use_fused_swiglu=True",
        "moe_config.capacity_factor=-1", "moe_config.use_gmm=True", "moe_config.aux_loss_factors=[0.0]"]),
}
SMOKE = ["model.model_config.compute_dtype=float32", "runner_config.batch_size=2",
         "runner_config.gradient_accumulation_steps=2"]
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0}

# profiler kernel names -> category, first match wins (CUDA kernel names, or aten ops on CPU)
CATEGORIES = (
    ("attention", ("flash", "fmha", "attention", "sdpa", "_efficient_attention", "scaled_dot_product")),
    ("routing_permute", ("_permute", "_unpermute", "_route", "topk", "sort", "scatter", "gather", "index",
                         "histc", "cumsum", "bincount")),
    ("optimizer", ("adam", "multi_tensor", "_foreach", "fused_adam", "clip", "norm_reduce")),
    ("gemm", ("gemm", "_gmm", "grouped_mm", "matmul", "cutlass", "xmma", "nvjet", "aten::mm", "aten::bmm",
              "aten::addmm", "aten::linear", "wgmma", "sm90", "sm80")),
    ("elementwise", ("_rope", "swiglu", "silu", "rms", "norm", "elementwise", "vectorized", "mul", "add", "exp",
                     "softmax", "cross_entropy", "nll", "log_softmax")),
)


def flops_per_token(config, seq: int, active: float) -> tuple[float, str]:
    """(FLOPs per trained token, the formula with its numbers): 6 N_active + 3 L n_heads S (d_qk + d_v), i.e. the
    matmul parameters x 2 FLOPs x 3 (forward, two backward products), plus per attention layer the causal QK^T and
    PV products (S / 2 keys per token on average, 2 FLOPs a multiply-add, x 3)."""
    layers, heads = config.num_hidden_layers, config.num_attention_heads
    if getattr(config, "kv_lora_rank", None):  # MLA
        d_qk, d_v = config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim
    else:
        d_qk = d_v = getattr(config, "head_dim", None) or config.hidden_size // heads
    flops = 6 * active + 3 * layers * heads * seq * (d_qk + d_v)
    return flops, (f"6 x {active:.4g} (N_active) + 3 x {layers} (L) x {heads} (heads) x {seq} (S) x "
                   f"({d_qk} + {d_v}) (d_qk + d_v) = {flops:.4g}")


def active_params(model, config) -> dict:
    """Matmul parameters a token passes through: routed experts count top_k / E of theirs; the input embedding
    (a lookup) not at all."""
    experts = getattr(config, "num_experts", None) or getattr(config, "n_routed_experts", None) or 1
    top_k = getattr(config, "num_experts_per_tok", None) or 1
    embed = model.get_input_embeddings().weight
    dense = routed = 0
    for name, p in model.named_parameters():
        if p is embed or p.dim() < 2:
            continue
        numel = getattr(p, "ds_numel", p.numel())
        if ".experts." in name and "shared" not in name:
            routed += numel
        else:
            dense += numel
    return {"dense": dense, "routed": routed, "routed_active": routed * top_k / experts,
            "active": dense + routed * top_k / experts, "experts": experts, "top_k": top_k}


def categorize(name: str) -> str:
    low = name.lower()
    for category, keys in CATEGORIES:
        if any(k in low for k in keys):
            return category
    return "other"


def breakdown(prof, wall_ms: float, device_kind: str) -> dict:
    """ms per category over one step: device kernels on CUDA (and the host gap: the wall time no kernel ran), the
    leaf aten ops' self time on CPU."""
    totals: dict[str, float] = {}
    busy = []
    for event in prof.events():
        if device_kind == "cuda":
            if event.device_type.name != "CUDA":
                continue
            ms = event.device_time / 1e3
            busy.append((event.time_range.start, event.time_range.end))
        else:
            if not event.name.startswith("aten::"):
                continue
            ms = event.self_cpu_time_total / 1e3  # self: a parent op's children count under their own names
        totals[categorize(event.name)] = totals.get(categorize(event.name), 0.0) + ms
    out = {"step_wall_ms": wall_ms, "ms": {k: round(v, 3) for k, v in sorted(totals.items())}}
    if device_kind == "cuda":  # the union of kernel intervals, against the step's wall time
        union, end = 0.0, -1.0
        for start, stop in sorted(busy):
            if stop > end:
                union += (stop - max(start, end)) / 1e3
                end = stop
        out["gpu_busy_ms"] = round(union, 3)
        out["host_gap_ms"] = round(wall_ms - union, 3)
    else:
        out["host_gap_ms"] = None  # no device: everything is host time
    return out


# --- the child: one run of mf_ds/train.py's loop ----------------------------------------------------------------

def child(impl: str, result_path: Path, profile_step: int, train_args: list[str]) -> int:
    import torch

    from mf_ds import checkpoint, patch
    from mf_ds.train import main

    captured = {}
    real_apply = patch.apply

    def apply(model, plan, checkpoint_fn=None):
        captured["model"], captured["seq"] = model, plan.run.seq_length
        if levers.is_mf_ds(impl):
            return real_apply(model, plan, checkpoint_fn=checkpoint_fn)
        import dataclasses

        from translators.plan_types import Kernels

        model.config._experts_implementation = "grouped_mm"  # HF's default, stated: the peer the targets name
        lines = [f"reference run: {type(model).__name__} unpatched (transformers' own MoE blocks, RoPE and MLPs)",
                 f"{impl}: experts on grouped_mm"]
        lines += levers.apply_hf(impl, model)
        if impl == "hf_liger":
            from liger_kernel.transformers import _apply_liger_kernel_to_instance

            _apply_liger_kernel_to_instance(model=model)
            lines.append("hf_liger: Liger's kernels applied to the instance")
        # then the recompute plan, which wraps the forwards in place (mf_ds.patch.apply with its own patches off)
        plain = dataclasses.replace(plan, moe=None, kernels=Kernels())
        return lines + real_apply(model, plain, checkpoint_fn=checkpoint_fn)

    patch.apply = apply
    device_kind = "cuda" if torch.cuda.is_available() else "cpu"
    real_fault_point = checkpoint.fault_point
    prof_state: dict = {}

    def fault_point(point: str, step: int) -> None:  # called after every optimizer step ("step.update")
        real_fault_point(point, step)
        if point != "step.update":
            return
        if step == profile_step - 1:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device_kind == "cuda":
                torch.cuda.synchronize()
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            prof_state["prof"] = torch.profiler.profile(activities=activities)
            prof_state["prof"].__enter__()
            prof_state["start"] = time.perf_counter()
        elif step == profile_step and "prof" in prof_state:
            if device_kind == "cuda":
                torch.cuda.synchronize()
            wall_ms = (time.perf_counter() - prof_state["start"]) * 1e3
            prof_state["prof"].__exit__(None, None, None)
            prof_state["breakdown"] = breakdown(prof_state["prof"], wall_ms, device_kind)

    checkpoint.fault_point = fault_point
    if device_kind == "cuda":
        torch.cuda.reset_peak_memory_stats()
    rc = main(train_args, prog=f"bench/train_gpu.py --child {impl}")
    out_dir = Path(train_args[train_args.index("--output_dir") + 1])
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    model = captured["model"]
    params = active_params(model, model.config)
    flops, formula = flops_per_token(model.config, captured["seq"], params["active"])
    result = {"impl": impl, "rc": rc, "steps": len(rows), "losses": [r["loss"] for r in rows],
              "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows[WARMUP:] or rows),
              "peak_MiB": torch.cuda.max_memory_allocated() / 2**20 if device_kind == "cuda" else None,
              "params": params, "flops_per_token": flops, "flops_formula": formula,
              "profile": prof_state.get("breakdown")}
    result_path.write_text(json.dumps(result, indent=2) + "\n")
    return rc


# --- the parent: every model, every peer ----------------------------------------------------------------------------

def loss_args(impl: str) -> list[str]:
    """mf_ds/train.py's loss flag per row: the mf_ds rows keep its default (the fused loss, on where exact); the
    unfused row and the HF peers take the whole logits (hf_liger's own forward fuses them with Liger's kernel)."""
    return ["--fused_loss", "off"] if impl == "mf_ds_unfused" or not levers.is_mf_ds(impl) else []


def fused_loss_effect(runs: dict) -> dict:
    """The fused loss lever: mf_ds against mf_ds_unfused, tokens/s and peak memory ratios."""
    on, off = runs.get("mf_ds", {}), runs.get("mf_ds_unfused", {})
    out = {}
    if on.get("tokens_per_s") and off.get("tokens_per_s"):
        out["fused_loss_speedup"] = on["tokens_per_s"] / off["tokens_per_s"]
        if on.get("peak_MiB") and off.get("peak_MiB"):
            out["fused_loss_peak_ratio"] = on["peak_MiB"] / off["peak_MiB"]
    return out


def skip_reason(impl: str, device_kind: str) -> str | None:
    """Why a peer cannot run here, or None."""
    if impl != "hf_liger":
        return levers.skip_reason(impl, device_kind)
    import importlib.util

    if importlib.util.find_spec("liger_kernel") is None:
        return "liger-kernel is not installed"
    if device_kind != "cuda":
        return "Liger's kernels are Triton kernels for CUDA"
    return None


def peak_tflops(device: dict) -> float | None:
    name = device.get("name", "")
    return next((tf for key, tf in PEAK_BF16_TFLOPS.items() if key in name), None)


def overrides(name: str, smoke: bool) -> list[str]:
    """The --set list of one model's runs."""
    _, shape, smoke_sets = MODELS[name]
    sets = [*COMMON, *(SMOKE + smoke_sets if smoke else shape)]
    if name == "deepseek_v3":  # its YAML's bias balancing needs the callback list COMMON replaces
        sets.append("moe_config.balance_via_topk_bias=False")
    return sets


def run_impl(name: str, impl: str, yaml_path: str, sets: list[str], steps: int, profile_step: int, out: Path,
             env: dict, device: dict, tag: str = "") -> dict:
    """One child run of one row: its result (tokens/s, MFU, peak, profile), or {"failed": the log's tail}."""
    batch = int(next(s.split("=", 1)[1] for s in sets if s.startswith("runner_config.batch_size=")))
    stem = f"train_gpu-{name}-{impl}{tag}"
    run_dir = out / stem
    result_path = out / f"{stem}.result.json"
    args = ["--mf-config", yaml_path, *[a for s in sets for a in ("--set", s)], "--max_steps", str(steps),
            "--output_dir", str(run_dir), *levers.train_args(impl), *loss_args(impl)]
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", impl, str(result_path), str(profile_step),
           "--", *args]
    log = out / f"{stem}.log"
    with log.open("w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, env={**env, **levers.env(impl)}, stdout=f,
                            stderr=subprocess.STDOUT).returncode
    if rc or not result_path.is_file():
        print(f"{name:14} {impl:14} FAILED (rc {rc}), see {log}", flush=True)
        return {"impl": impl, "rc": rc, "failed": log.read_text()[-2000:]}
    result = json.loads(result_path.read_text())
    result_path.unlink()
    if result["steps"] < steps:  # the tokens/s median would then rest on the warm-up steps alone
        print(f"{name:14} {impl:14} FAILED: ran {result['steps']} of {steps} steps, see {log}", flush=True)
        return {**result, "failed": f"ran {result['steps']} of {steps} steps"}
    profile = out / f"{stem}.profile.json"
    profile.write_text(json.dumps(result["profile"], indent=2) + "\n")
    peak = peak_tflops(device)
    result["mfu"] = result["tokens_per_s"] * result["flops_per_token"] / (peak * 1e12) if peak else None
    result["micro_batch"] = batch
    mfu = "--" if result["mfu"] is None else f"{result['mfu']:.3f}"
    mem = "--" if result["peak_MiB"] is None else f"{result['peak_MiB']:.0f} MiB"
    print(f"{name:14} {impl:14} mb {batch:>3} {result['tokens_per_s']:10.0f} tokens/s  MFU {mfu}  peak {mem}  "
          f"profile -> {profile.name}", flush=True)
    return result


def run_model(name: str, out: Path, steps: int, smoke: bool, device: dict, impls: tuple[str, ...] = IMPLS,
              micro_batch: int | None = None, search: bool = False, save=lambda runs: None) -> dict:
    """Every row of one model; `save(runs)` after each row, so that a run stopped by its time limit keeps the rows
    that finished."""
    yaml_path = MODELS[name][0]
    sets = levers.with_micro_batch(overrides(name, smoke), micro_batch)
    # each child is a one-process run of its own (mf_ds/train.py gives it a free port): a launcher's or a test
    # process's rendezvous variables would send every child to a port that process already holds (EADDRINUSE)
    rendezvous = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {**{k: v for k, v in os.environ.items() if k not in rendezvous},
           **({"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""} if smoke else {})}
    runs = {}
    for impl in impls:
        why = skip_reason(impl, device["kind"])
        if why:
            runs[impl] = {"impl": impl, "skipped": why}
            print(f"{name:14} {impl:14} skipped: {why}", flush=True)
            continue

        def run_one(impl, sets, steps, tag=""):
            return run_impl(name, impl, yaml_path, sets, steps, min(PROFILE_STEP, steps), out, env, device, tag)

        if search:
            runs[impl] = levers.search(run_one, impl, sets)
            print(f"{name:14} {impl:14} largest micro batch: {runs[impl].get('micro_batch')} "
                  f"(tried {runs[impl]['tried']})", flush=True)
        else:
            runs[impl] = run_one(impl, sets, steps)
        save(runs)
    record = {"overrides": sets, "steps": steps, "runs": runs, **fused_loss_effect(runs)}
    ours, hf = runs.get("mf_ds", {}), runs.get("hf_grouped_mm", {})
    if ours.get("tokens_per_s") and hf.get("tokens_per_s"):
        record["speedup_vs_hf_grouped_mm"] = ours["tokens_per_s"] / hf["tokens_per_s"]
        if ours.get("peak_MiB") and hf.get("peak_MiB"):
            record["peak_ratio_vs_hf_grouped_mm"] = ours["peak_MiB"] / hf["peak_MiB"]
    return record


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:  # --child IMPL RESULT PROFILE_STEP -- train args
        impl, result, profile_step = argv[1], Path(argv[2]), int(argv[3])
        return child(impl, result, profile_step, argv[argv.index("--") + 1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, 3 steps")
    parser.add_argument("--impls", default=",".join(IMPLS), help="comma-separated rows: " + ", ".join(IMPLS))
    parser.add_argument("--micro-batch", type=int, help="sequences a micro batch, every row (default: 4)")
    parser.add_argument("--micro-batch-search", action="store_true",
                        help="each row at 4, 8, 16, ... sequences until one fails; the largest that ran is reported")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.impls.split(",")) - set(IMPLS))
    if unknown:
        parser.error(f"--impls: unknown rows {unknown} (known: {', '.join(IMPLS)})")
    import torch

    from bench.gpu_env import stamp

    if not args.smoke and not torch.cuda.is_available():
        sys.exit("bench/train_gpu.py needs a CUDA device (--smoke runs on CPU)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    steps = 3 if args.smoke else args.steps
    stamped = stamp()
    if args.smoke:
        stamped["device"] = {"kind": "cpu"}
    record = {"benchmark": "train_gpu", **stamped, "smoke": args.smoke, "warmup_steps": WARMUP,
              "peak_bf16_TFLOPS": peak_tflops(stamped["device"]), "models": {}}
    device = "cpu" if args.smoke else stamped["device"]["name"].replace(" ", "_")
    path = out / f"train_gpu-{device}.json"

    def save(name):  # the record as it stands, rewritten after each row
        def write(runs):
            record["models"][name] = {"runs": dict(runs), "partial": True}
            path.write_text(json.dumps(record, indent=2) + "\n")
        return write

    for name in args.model.split(","):
        record["models"][name] = run_model(name, out, steps, args.smoke, stamped["device"],
                                           tuple(args.impls.split(",")), args.micro_batch, args.micro_batch_search,
                                           save=save(name))
        path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"-> {path}")
    failed = [f"{m} {i}" for m, r in record["models"].items() for i, run in r["runs"].items() if "failed" in run]
    print("FAILED: " + ", ".join(failed) if failed else "all runs finished")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
