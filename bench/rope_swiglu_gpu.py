"""GPU: mf_ds's Triton RoPE and SwiGLU vs DeepSpeed's and Liger's Triton kernels, HF eager and a device copy.

    python bench/rope_swiglu_gpu.py            # CUDA: writes bench/results/rope_swiglu-gpu-<device>.json
    python bench/rope_swiglu_gpu.py --smoke    # anywhere: tiny shapes on CPU (Triton's interpreter), writes nothing

Written on a machine without a GPU and not run on one yet: importing it is safe on CPU (it needs no CUDA until
`main` runs), and `--smoke` runs every code path a CPU can (mf_ds's kernels through the interpreter; DeepSpeed's
RoPE and Liger need CUDA and are listed as unavailable there). The numbers come from a CUDA run.

Shapes, bf16, 16k tokens (2 x 8192):
- Llama-3-8B: RoPE on 32 q heads and 8 kv heads of 128 (split halves, HF's q/k views); SwiGLU width 14336.
- DeepSeek-V3: MLA RoPE on the last 64 of 128 heads' 192 q columns and one shared 64-column key (interleaved pairs
  in, split halves out: rope_interleave); dense SwiGLU width 18432; experts' width 2048 on a packed gate_up.
Two kinds of rows:
- kernel: mf_ds's forward and backward launches alone, into preallocated outputs; bandwidth = bytes that must move
  (every input read once, every output written once, forward + backward; RoPE tables once per pass) / time, as a
  fraction of a device-to-device copy's (`dst.copy_(src)`, 1 GiB, read + write). Target >= 0.85.
- autograd: forward + backward through autograd on HF's inputs, mf_ds vs HF eager, DeepSpeed
  (deepspeed/ops/triton_ops: fused_apply_rotary_pos_emb, swiglu, swiglu_packed) and Liger (liger_rotary_pos_emb,
  LigerSiLUMulFunction) where installed and applicable (DeepSpeed's and Liger's RoPE are split-half only).
Timing: triton.testing.do_bench (CUDA events, median), gradients reset to None between runs.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformers.models.deepseek_v3 import modeling_deepseek_v3  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

from mf_ds.ops import rope, swiglu  # noqa: E402

# name: (batch, seq, q heads, k heads, rotary dim, q head width (MLA: 192, rotated: its last columns), layout)
ROPE = {
    "llama3_8b": (2, 8192, 32, 8, 128, 128, "split_half"),
    "deepseek_v3_mla": (2, 8192, 128, 1, 64, 192, "interleaved_to_split"),
}
SWIGLU = {"llama3_8b_dense": (16384, 14336, False), "deepseek_v3_dense": (16384, 18432, False),
          "deepseek_v3_experts_packed": (16384 * 8, 2048, True)}  # top-8 routing: 8 rows per token
SMOKE = {"rope": {"llama3_8b": (1, 5, 4, 2, 16, 16, "split_half"),
                  "deepseek_v3_mla": (1, 5, 4, 1, 16, 48, "interleaved_to_split")},
         "swiglu": {"dense": (6, 40, False), "packed": (6, 40, True)}}
BYTES = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 4}


# --- timing -----------------------------------------------------------------------------------------------------------

def bench(fn: Callable[[], object], device: str, grads_of=()) -> float:
    """ms per call: do_bench's median on CUDA; on CPU (smoke) a few wall-clock runs."""
    if device == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=200, grad_to_none=list(grads_of), return_mode="median")
    fn()
    start = time.perf_counter()
    for _ in range(2):
        for x in grads_of:
            x.grad = None
        fn()
    return (time.perf_counter() - start) / 2 * 1e3


def copy_bandwidth(device: str, gib: float) -> float:
    """GB/s of a device-to-device copy: bytes read + bytes written over the time."""
    n = int(gib * 2**30) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), device)
    return 2 * n * 2 / ms / 1e6


def optional(name: str, load: Callable[[], Callable]) -> tuple[Callable | None, str]:
    try:
        return load(), ""
    except Exception as exc:  # an absent or incompatible competitor is a row saying so, not a failed benchmark
        return None, f"{name} unavailable: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


# --- RoPE -------------------------------------------------------------------------------------------------------------

def rope_inputs(shape, dtype, device):
    batch, seq, hq, hk, rot, width, layout = shape
    g = torch.Generator(device="cpu").manual_seed(0)
    mla = layout == "interleaved_to_split"
    proj_q = torch.randn(batch, seq, hq * width, generator=g).to(device, dtype).requires_grad_()
    proj_k = torch.randn(batch, seq, (512 if mla else 0) + hk * rot, generator=g).to(device, dtype).requires_grad_()

    def views():
        """What HF's attention hands the function (DeepseekV3Attention: q_rot and k_rot are views)."""
        q = proj_q.view(batch, seq, hq, width).transpose(1, 2)[..., width - rot:]
        k = proj_k[..., 512:].view(batch, 1, seq, rot) if mla else proj_k.view(batch, seq, hk, rot).transpose(1, 2)
        return q, k

    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    angles = torch.arange(seq).float()[None, :, None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1).expand(batch, seq, rot)
    cos, sin = angles.cos().to(device, dtype).contiguous(), angles.sin().to(device, dtype).contiguous()
    grads = tuple(torch.randn(x.shape, generator=g).to(device, dtype) for x in views())
    return (proj_q, proj_k), views, cos, sin, grads


def rope_rows(name, shape, dtype, device, copy_gbs):
    batch, seq, hq, hk, rot, width, layout = shape
    leaves, views, cos, sin, grads = rope_inputs(shape, dtype, device)
    rows = []
    # kernel: forward and backward launches alone
    q, k = (x.detach() for x in views())
    q_out, k_out = (torch.empty(x.shape, dtype=dtype, device=device) for x in (q, k))
    grad_q, grad_k = (torch.empty(x.shape, dtype=dtype, device=device) for x in (q, k))
    fwd = bench(lambda: rope._launch(q, k, q_out, k_out, cos, sin, layout, False), device)
    bwd = bench(lambda: rope._launch(*grads, grad_q, grad_k, cos, sin, layout, True), device)
    table_cols = rot if layout == "split_half" else rot // 2  # the interleaved layouts read the first half only
    moved = 2 * (2 * (q.numel() + k.numel()) + 2 * batch * seq * table_cols) * BYTES[dtype]  # fwd + bwd
    gbs = moved / (fwd + bwd) / 1e6
    rows.append({"op": "rope", "case": name, "kind": "kernel", "fwd_ms": fwd, "bwd_ms": bwd, "bytes": moved,
                 "GB_per_s": gbs, "fraction_of_copy": gbs / copy_gbs if copy_gbs else None})

    hf = (modeling_deepseek_v3.apply_rotary_pos_emb_interleave if layout == "interleaved_to_split"
          else modeling_llama.apply_rotary_pos_emb)
    competitors = {"mf_ds": (lambda q, k: rope.fused_rope(q, k, cos, sin, layout=layout), ""),
                   "hf_eager": (lambda q, k: hf(q, k, cos, sin), "")}
    if layout == "split_half":
        ds, why = optional("deepspeed fused_apply_rotary_pos_emb", lambda: importlib.import_module(
            "deepspeed.ops.triton_ops.fused_rotary_pos_emb").fused_apply_rotary_pos_emb)
        competitors["deepspeed"] = ((lambda q, k: ds(q, k, cos, sin)) if ds else None, why)
        liger, why = optional("liger rope", lambda: importlib.import_module(
            "liger_kernel.transformers.rope").liger_rotary_pos_emb)
        competitors["liger"] = ((lambda q, k: liger(q, k, cos, sin)) if liger else None, why)
    else:
        competitors["deepspeed"] = (None, "deepspeed's fused RoPE is split-half only (no interleaved MLA layout)")
        competitors["liger"] = (None, "liger's RoPE is split-half only (no interleaved MLA layout)")
    rows += autograd_rows("rope", name, competitors, lambda fn: fn(*views()), leaves, grads, device)
    return rows


# --- SwiGLU -----------------------------------------------------------------------------------------------------------

def swiglu_rows(name, shape, dtype, device, copy_gbs):
    tokens, width, packed = shape
    g = torch.Generator(device="cpu").manual_seed(0)
    if packed:
        leaves = (torch.randn(tokens, 2 * width, generator=g).to(device, dtype).requires_grad_(),)
    else:
        leaves = tuple(torch.randn(tokens, width, generator=g).to(device, dtype).requires_grad_() for _ in range(2))
    grad = torch.randn(tokens, width, generator=g).to(device, dtype)
    gate, up = leaves[0].detach().chunk(2, dim=-1) if packed else (x.detach() for x in leaves)
    out, grad_gate, grad_up = (torch.empty(tokens, width, dtype=dtype, device=device) for _ in range(3))
    fwd = bench(lambda: swiglu._launch_fwd(gate, up, out), device)
    bwd = bench(lambda: swiglu._launch_bwd(grad, gate, up, grad_gate, grad_up), device)
    moved = 8 * tokens * width * BYTES[dtype]  # fwd: read gate, up, write out; bwd: read grad, gate, up, write 2
    gbs = moved / (fwd + bwd) / 1e6
    rows = [{"op": "swiglu_packed" if packed else "swiglu", "case": name, "kind": "kernel", "fwd_ms": fwd,
             "bwd_ms": bwd, "bytes": moved, "GB_per_s": gbs, "fraction_of_copy": gbs / copy_gbs if copy_gbs else None}]

    ds_module, why = optional("deepspeed swiglu_triton", lambda: importlib.import_module(
        "deepspeed.ops.triton_ops.swiglu_triton"))
    if packed:
        competitors = {"mf_ds": (swiglu.fused_swiglu_packed, ""),
                       "hf_eager": (lambda gu: F.silu(gu.chunk(2, dim=-1)[0]) * gu.chunk(2, dim=-1)[1], ""),
                       "deepspeed": (ds_module.swiglu_packed if ds_module else None, why),
                       "liger": (None, "liger has no packed gate_up SwiGLU function to call on a tensor")}
    else:
        liger, liger_why = optional("liger swiglu", lambda: importlib.import_module(
            "liger_kernel.ops.swiglu").LigerSiLUMulFunction.apply)
        competitors = {"mf_ds": (swiglu.fused_swiglu, ""), "hf_eager": (lambda a, b: F.silu(a) * b, ""),
                       "deepspeed": (ds_module.swiglu if ds_module else None, why), "liger": (liger, liger_why)}
    return rows + autograd_rows(rows[0]["op"], name, competitors, lambda fn: fn(*leaves), leaves, (grad,), device)


def autograd_rows(op, case, competitors, call, leaves, grads, device):
    """forward + backward of each competitor on the same inputs; a competitor that cannot run is a row saying why."""
    rows, times = [], {}
    for who, (fn, why) in competitors.items():
        if fn is None:
            rows.append({"op": op, "case": case, "kind": "autograd", "impl": who, "ms": None, "note": why})
            continue

        def step(fn=fn):
            outputs = call(fn)
            torch.autograd.backward(outputs, grads if isinstance(outputs, tuple) else grads[0])

        try:
            times[who] = bench(step, device, leaves)
            rows.append({"op": op, "case": case, "kind": "autograd", "impl": who, "ms": times[who]})
        except Exception as exc:
            rows.append({"op": op, "case": case, "kind": "autograd", "impl": who, "ms": None,
                         "note": f"failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"})
    for row in rows:
        if row["ms"] and "mf_ds" in times:
            row["mf_ds_speedup"] = row["ms"] / times["mf_ds"]
    return rows


# --- main -------------------------------------------------------------------------------------------------------------

def versions() -> dict[str, str]:
    found = {"python": platform.python_version(), "torch": torch.__version__}
    for package in ("triton", "transformers", "deepspeed", "liger-kernel"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = "not installed"
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU through Triton's interpreter")
    args = parser.parse_args()
    if args.smoke:
        os.environ["MF_DS_FORCE_TRITON"] = "1"  # mf_ds's kernels on CPU tensors (dispatch.on_device interprets them)
        device, rope_shapes, swiglu_shapes = "cpu", SMOKE["rope"], SMOKE["swiglu"]
    elif not torch.cuda.is_available():
        sys.exit("bench/rope_swiglu_gpu.py needs a CUDA device (or --smoke); CPU numbers: bench/rope_swiglu.py")
    else:
        device, rope_shapes, swiglu_shapes = "cuda", ROPE, SWIGLU
    dtype = torch.bfloat16
    copy_gbs = copy_bandwidth(device, 1.0 if device == "cuda" else 0.01)
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s", flush=True)
    rows = []
    for name, shape in rope_shapes.items():
        rows += rope_rows(name, shape, dtype, device, copy_gbs)
    for name, shape in swiglu_shapes.items():
        rows += swiglu_rows(name, shape, dtype, device, copy_gbs)
    for row in rows:
        if row["kind"] == "kernel":
            print(f"{row['op']:14} {row['case']:28} kernel fwd {row['fwd_ms']:.3f} ms bwd {row['bwd_ms']:.3f} ms "
                  f"{row['GB_per_s']:.0f} GB/s ({row['fraction_of_copy']:.2f} of copy)")
        else:
            timing = f"{row['ms']:.3f} ms" if row["ms"] else row["note"]
            print(f"{row['op']:14} {row['case']:28} {row['impl']:10} {timing}")
    if args.smoke:
        return
    name = torch.cuda.get_device_name().replace(" ", "_")
    record = {"benchmark": "rope_swiglu_gpu", "dtype": "bfloat16", "copy_GB_per_s": copy_gbs, "target":
              "kernel fraction_of_copy >= 0.85; mf_ds fastest in every autograd case", "rows": rows,
              "device": f"cuda: {torch.cuda.get_device_name()}", "versions": versions()}
    path = ROOT / "bench" / "results" / f"rope_swiglu-gpu-{name}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"-> {path}")


if __name__ == "__main__":
    main()
