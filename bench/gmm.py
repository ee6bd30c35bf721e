"""MoE experts forward+backward: mf_ds ops (permute -> grouped_mm -> SwiGLU -> grouped_mm -> unpermute) vs
transformers v5's own experts implementations ("grouped_mm", "eager") on the same weights and routing, side by side.

    python bench/gmm.py [--threads N]   # writes bench/results/gmm-<device>.json

One Qwen3-MoE experts module (gate_up_proj [E, 2I, H], down_proj [E, H, I]) at a small Qwen3-MoE-like shape on CPU;
the router is not timed (all three get the same top-k ids and weights). Rounds alternate the implementations so
machine noise hits them alike; each number is the median (and the min) over rounds of one forward+backward. On a
shared CPU box other jobs dominate the spread: `--threads 1` and the min are the steadier figures; the load average
is recorded beside them. SwiGLU is the same
plain torch expression in all three, so the difference is the permute, the grouped matmuls and the combine.
A second table times the grouped matmul alone, fwd+bwd, for the CPU path choice: F.grouped_mm (mf_ds's CPU path)
vs a per-expert loop vs a padded bmm. On a CUDA device the mf_ds rows are the Triton kernels.
Target (issue 4): mf_ds no slower than HF grouped_mm, well ahead of eager.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mf_ds.ops.gmm import grouped_mm  # noqa: E402
from mf_ds.ops.permute import permute, unpermute  # noqa: E402

SHAPES = [  # (E, K, H, I, T)
    (8, 2, 256, 128, 2048),
    (16, 4, 256, 128, 2048),
]
DTYPES = [torch.float32, torch.bfloat16]
WARMUP, ROUNDS = 2, 11


def _hf_experts(E, H, inter, dtype, impl):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=inter, num_experts=E, hidden_act="silu")
    cfg._experts_implementation = impl
    return Qwen3MoeExperts(cfg).to(dtype)


def mf_ds_experts(module, x_TH, ids_TK, gates_TK):
    """The same math as HF's experts forward, on mf_ds ops; weights used in their HF layout (transposed views)."""
    perm = permute(x_TH, ids_TK, module.num_experts)
    h = grouped_mm(perm.x_MH, module.gate_up_proj.transpose(1, 2), perm.tokens_per_expert_E)
    gate, up = h.chunk(2, dim=-1)
    y = grouped_mm(module.act_fn(gate) * up, module.down_proj.transpose(1, 2), perm.tokens_per_expert_E)
    return unpermute(y, perm, gates_TK)


def _time(fn, args, dout) -> float:
    t0 = time.perf_counter()
    out = fn(*args)
    out.backward(dout)
    return (time.perf_counter() - t0) * 1e3


def _rounds(impls: dict, make_args, dout) -> dict[str, list[float]]:
    times = {name: [] for name in impls}
    for r in range(WARMUP + ROUNDS):
        for name, fn in impls.items():
            ms = _time(fn, make_args(), dout)
            if r >= WARMUP:
                times[name].append(ms)
    return times


def bench_experts(E, K, H, inter, T, dtype, device) -> dict:
    g = torch.Generator().manual_seed(0)
    modules = {impl: _hf_experts(E, H, inter, dtype, impl).to(device) for impl in ("grouped_mm", "eager")}
    gate_up = (torch.randn(E, 2 * inter, H, generator=g) / H**0.5).to(device, dtype)
    down = (torch.randn(E, H, inter, generator=g) / inter**0.5).to(device, dtype)
    for m in modules.values():
        m.gate_up_proj.data.copy_(gate_up)
        m.down_proj.data.copy_(down)
    x = torch.randn(T, H, generator=g).to(device, dtype)
    scores = (torch.randn(T, E, generator=g) + torch.linspace(0, 1.5, E)).softmax(-1)  # a skewed router
    gates, ids = scores.topk(K, dim=-1)
    gates, ids = gates.to(device, dtype), ids.to(device)
    dout = torch.randn(T, H, generator=g).to(device, dtype)

    def make_args():
        for m in modules.values():
            m.zero_grad(set_to_none=True)
        return (x.clone().requires_grad_(), ids, gates.clone().requires_grad_())

    impls = {
        "mf_ds": lambda x_, i_, g_: mf_ds_experts(modules["grouped_mm"], x_, i_, g_),
        "hf_grouped_mm": lambda x_, i_, g_: modules["grouped_mm"](x_, i_, g_),
        "hf_eager": lambda x_, i_, g_: modules["eager"](x_, i_, g_),
    }
    # same numbers first: outputs and every gradient of mf_ds vs HF grouped_mm
    diffs = {}
    args_a, args_b = make_args(), make_args()
    out_a = impls["mf_ds"](*args_a)
    out_a.backward(dout)
    grads_a = [args_a[0].grad, args_a[2].grad, modules["grouped_mm"].gate_up_proj.grad]
    modules["grouped_mm"].zero_grad(set_to_none=True)
    out_b = impls["hf_grouped_mm"](*args_b)
    out_b.backward(dout)
    grads_b = [args_b[0].grad, args_b[2].grad, modules["grouped_mm"].gate_up_proj.grad]
    diffs["out"] = (out_a - out_b).abs().max().item()
    for label, a, b in zip(("dx", "dgates", "dgate_up"), grads_a, grads_b, strict=True):
        diffs[label] = (a - b).abs().max().item()

    times = _rounds(impls, make_args, dout)
    med = {name: statistics.median(v) for name, v in times.items()}
    best = {name: min(v) for name, v in times.items()}
    return {
        "E": E, "K": K, "H": H, "I": inter, "T": T, "dtype": str(dtype).removeprefix("torch."),
        "tokens_per_expert": torch.bincount(ids.flatten().cpu(), minlength=E).tolist(),
        "fwd_bwd_ms_median": med,
        "fwd_bwd_ms_min": best,
        "fwd_bwd_ms_rounds": times,
        "speedup_vs_hf_grouped_mm": {"median": med["hf_grouped_mm"] / med["mf_ds"],
                                     "min": best["hf_grouped_mm"] / best["mf_ds"]},
        "speedup_vs_hf_eager": {"median": med["hf_eager"] / med["mf_ds"], "min": best["hf_eager"] / best["mf_ds"]},
        "max_abs_diff_vs_hf_grouped_mm": diffs,
    }


def _loop_mm(x, w, counts):
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        outs.append(x[start : start + n] @ w[e])
        start += n
    return torch.cat(outs)


def _bmm_mm(x, w, counts):
    """Pad each group to the largest one, one bmm, unpad."""
    E, cap = counts.numel(), int(counts.max())
    offs = torch.cumsum(counts, 0) - counts
    slot = torch.arange(x.shape[0]) - torch.repeat_interleave(offs, counts)
    expert = torch.repeat_interleave(torch.arange(E), counts)
    xp = x.new_zeros(E, cap, x.shape[1]).index_put((expert, slot), x)
    return torch.bmm(xp, w)[expert, slot]


def bench_gmm_only(E, K, H, inter, T, dtype) -> dict:
    g = torch.Generator().manual_seed(0)
    scores = (torch.randn(T, E, generator=g) + torch.linspace(0, 1.5, E)).softmax(-1)
    counts = torch.bincount(scores.topk(K, dim=-1).indices.flatten(), minlength=E)
    x = torch.randn(T * K, H, generator=g).to(dtype)
    w = (torch.randn(E, 2 * inter, H, generator=g) / H**0.5).to(dtype).transpose(1, 2)  # HF layout, as used
    dout = torch.randn(T * K, 2 * inter, generator=g).to(dtype)

    def make_args():
        return (x.clone().requires_grad_(), w.detach().clone().requires_grad_(), counts)

    impls = {"F.grouped_mm (mf_ds cpu path)": grouped_mm, "per_expert_loop": _loop_mm, "padded_bmm": _bmm_mm}
    times = _rounds(impls, make_args, dout)
    return {"E": E, "K": K, "H": H, "N": 2 * inter, "M": T * K, "dtype": str(dtype).removeprefix("torch."),
            "fwd_bwd_ms_median": {name: statistics.median(v) for name, v in times.items()},
            "fwd_bwd_ms_min": {name: min(v) for name, v in times.items()}}


def _cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    load_before = os.getloadavg()
    experts = [bench_experts(*shape, dtype, device) for shape in SHAPES for dtype in DTYPES]
    gmm_only = [bench_gmm_only(*shape, dtype) for shape in SHAPES for dtype in DTYPES] if device == "cpu" else []
    import deepspeed
    import transformers
    import triton

    desc = torch.cuda.get_device_name() if device == "cuda" else f"cpu ({os.cpu_count()} cores, {_cpu_model()})"
    result = {
        "benchmark": "moe_experts_fwd_bwd",
        "what": "one MoE layer's experts, forward+backward, same weights and routing; router not timed",
        "rounds": ROUNDS, "warmup": WARMUP,
        "experts": experts,
        "grouped_mm_only": gmm_only,
        "target": "mf_ds no slower than hf_grouped_mm, well ahead of hf_eager",
        "device": desc,
        "torch_threads": torch.get_num_threads(),
        "loadavg_1min_before_after": [load_before[0], os.getloadavg()[0]],
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "deepspeed": deepspeed.__version__,
                     "triton": triton.__version__},
    }
    out = ROOT / "bench" / "results" / f"gmm-{device}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    for r in experts:
        print(f"E={r['E']} K={r['K']} {r['dtype']}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in
              r["fwd_bwd_ms_median"].items()) + f"  (x{r['speedup_vs_hf_grouped_mm']['median']:.2f} vs grouped_mm, "
              f"x{r['speedup_vs_hf_eager']['median']:.2f} vs eager; medians)", file=sys.stderr)
    for r in gmm_only:
        print(f"gmm E={r['E']} M={r['M']} {r['dtype']}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in
              r["fwd_bwd_ms_median"].items()), file=sys.stderr)
    print(out)


if __name__ == "__main__":
    main()
