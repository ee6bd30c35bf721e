"""GPU: mf_ds's Triton RoPE and SwiGLU vs DeepSpeed's and Liger's Triton kernels, HF eager and a device copy.

    python bench/rope_swiglu_gpu.py [--out DIR]   # CUDA: writes DIR/rope_swiglu-cuda-<device>.json (DIR: bench/results)
    python bench/rope_swiglu_gpu.py --smoke       # anywhere: tiny shapes on CPU (Triton's interpreter), writes nothing

Written on a machine without a GPU and not run on one yet: importing it is safe on CPU (it needs no CUDA until
`main` runs), and `--smoke` runs every code path a CPU can (mf_ds's kernels through the interpreter; DeepSpeed's
Triton ops and Liger need CUDA and come out as rows saying so). The numbers come from a CUDA run.

Shapes, bf16, 16k tokens (2 x 8192):
- Llama-3-8B: RoPE on 32 q heads and 8 kv heads of 128 (split halves, HF's q/k views); SwiGLU width 14336.
- DeepSeek-V3: MLA RoPE on the last 64 of 128 heads' 192 q columns and one shared 64-column key (interleaved pairs
  in, split halves out: rope_interleave); dense SwiGLU width 18432; experts' width 2048 on a packed gate_up.
Inputs are what HF's code hands over: q and k are [B, H, S, D] views of the projections' [B, S, H * D] outputs (the
leaves), and the incoming gradients are laid out as HF eager's outputs (Llama's: [B, S, H, D] in memory), so a
kernel that wants another layout pays for the copy, as it would in the model.

Checked before anything is timed: every output and every input gradient against HF's function run in float64 on the
same values (leaves, tables and incoming gradients upcast), as rel_err = ||x - ref|| / ||ref||; a row records the
largest (`rel_err`) and each one (`rel_err_by_tensor`). A result over TOLERANCE is a row "wrong result" and is not
timed. The kernel rows' outputs are filled with NaN before their checked launch, so an element left unwritten fails.

Two kinds of rows:
- kernel: mf_ds's forward and backward launches alone, into preallocated outputs; bandwidth = bytes that must move
  (every input read once, every output written once, forward + backward; RoPE tables once per pass) / time, as a
  fraction of a device-to-device copy's (`dst.copy_(src)`, 1 GiB, read + write). Target >= 0.85.
- autograd: forward + backward through autograd, mf_ds vs HF eager, DeepSpeed (deepspeed/ops/triton_ops:
  fused_apply_rotary_pos_emb, swiglu, swiglu_packed) and Liger (liger_rotary_pos_emb, LigerSiLUMulFunction) where
  installed and applicable (DeepSpeed's and Liger's RoPE are split-half only).
Timing: triton.testing.do_bench (CUDA events, median). Liger's kernels write into their inputs (its RoPE rotates q
and k in place, in the leaves' memory; its SwiGLU backward writes the gradients over gate and up), so calls on the
same leaves would feed it its own outputs: every autograd call, for every competitor alike, clones the saved leaves
and takes HF's views of the clones. That clone is timed alone (`clone_ms`) and subtracted: `ms` is the whole call,
`ms_net` = ms - clone_ms, and mf_ds_speedup = this row's ms_net / mf_ds's ms_net (> 1: mf_ds faster). The incoming
gradients are shared by the timed calls (Liger's RoPE backward rotates them in place: their values drift, the work
does not); the checks run first, each on its own copy.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformers.models.deepseek_v3 import modeling_deepseek_v3  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

from bench.gpu_env import stamp  # noqa: E402
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
# rel_err a result may reach: bf16 results rounded once or a few times land near 2e-3 (HF eager: 1.4e-3 to 2.9e-3 in
# the smoke run; Triton's interpreter truncates to bf16 where a GPU rounds, so mf_ds's read 3e-3 to 4.6e-3 there); a
# wrong formula (a sign, a swapped half, a stale input) is off by O(1)
TOLERANCE = {torch.bfloat16: 1e-2}


# --- timing -----------------------------------------------------------------------------------------------------------

def bench(fn: Callable[[], object], device: str) -> float:
    """ms per call: do_bench's median on CUDA; on CPU (smoke) a few wall-clock runs."""
    if device == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=200, return_mode="median")
    fn()
    start = time.perf_counter()
    for _ in range(2):
        fn()
    return (time.perf_counter() - start) / 2 * 1e3


def copy_bandwidth(device: str, gib: float) -> float:
    """GB/s of a device-to-device copy: bytes read + bytes written over the time."""
    n = int(gib * 2**30) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), device)
    return 2 * n * 2 / ms / 1e6


def describe(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def optional(name: str, load: Callable[[], Callable]) -> tuple[Callable | None, str]:
    try:
        return load(), ""
    except Exception as exc:  # an absent or incompatible competitor is a row saying so, not a failed benchmark
        return None, f"{name} unavailable: {describe(exc)}"


# --- checking ---------------------------------------------------------------------------------------------------------

@dataclass
class Problem:
    """One case's inputs: the saved leaves (the projections' outputs), how a call's arguments are made from (copies
    of) them, and the incoming gradients of the outputs; names label the outputs and leaves in rel_err_by_tensor."""

    op: str
    case: str
    leaves: tuple[torch.Tensor, ...]
    args: Callable[[tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]]
    grads: tuple[torch.Tensor, ...]
    out_names: tuple[str, ...]
    leaf_names: tuple[str, ...]

    @property
    def dtype(self) -> torch.dtype:
        return self.leaves[0].dtype

    def row(self, kind: str, **fields) -> dict:
        return {"op": self.op, "case": self.case, "dtype": str(self.dtype).removeprefix("torch."), "kind": kind,
                **fields}

    def fresh(self) -> tuple[torch.Tensor, ...]:
        """New leaves holding the saved values: Liger writes into its inputs (module docstring)."""
        return tuple(x.detach().clone().requires_grad_() for x in self.leaves)


def as_tuple(outputs) -> tuple:
    return tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)


def reference(problem: Problem, fn64: Callable) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """(outputs, leaf gradients) of `fn64` (HF's function, its tables in float64) on the leaves and incoming gradients
    upcast to float64."""
    leaves = tuple(x.detach().double().requires_grad_() for x in problem.leaves)
    outputs = as_tuple(fn64(*problem.args(leaves)))
    torch.autograd.backward(outputs, tuple(g.double() for g in problem.grads))
    # contiguous: the kernel checks take the same views of these as of the leaves
    return tuple(x.detach() for x in outputs), tuple(x.grad.contiguous() for x in leaves)


def rel_err(x: torch.Tensor | None, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in float64; inf for a missing result (an input left without a gradient)."""
    if x is None:
        return math.inf
    if x.shape != ref.shape:
        raise ValueError(f"result of shape {tuple(x.shape)}, expected {tuple(ref.shape)}")
    return ((x.detach().double() - ref).norm() / ref.norm()).item()


def check(problem: Problem, fn: Callable, ref) -> dict[str, float]:
    """rel_err of every output and every input gradient of one forward + backward of `fn` on fresh leaves."""
    ref_outputs, ref_grads = ref
    leaves = problem.fresh()
    outputs = as_tuple(fn(*problem.args(leaves)))
    # the outputs are measured before backward runs: a backward writing into memory an output shares cannot hide a
    # wrong forward
    errors = {name: rel_err(out, r) for name, out, r in zip(problem.out_names, outputs, ref_outputs, strict=True)}
    torch.autograd.backward(outputs, tuple(g.clone() for g in problem.grads))  # a copy: Liger's RoPE writes over it
    errors |= {f"d {name}": rel_err(x.grad, r) for name, x, r in zip(problem.leaf_names, leaves, ref_grads,
                                                                       strict=True)}
    return errors


def verdict(errors: dict[str, float], dtype: torch.dtype) -> tuple[bool, dict]:
    """(within TOLERANCE, the row's fields): the largest rel_err, each one, and a note if the result is wrong."""
    tolerance = TOLERANCE[dtype]
    worst = max(errors, key=lambda name: math.inf if math.isnan(errors[name]) else errors[name])
    ok = all(e <= tolerance for e in errors.values())  # NaN compares False: a NaN anywhere fails

    def plain(e: float) -> float | str:  # JSON has no NaN or inf
        return e if math.isfinite(e) else str(e)

    fields = {"rel_err": plain(errors[worst]), "rel_err_by_tensor": {k: plain(e) for k, e in errors.items()}}
    if not ok:
        fields["note"] = f"wrong result: rel_err {errors[worst]:.2e} ({worst}) > {tolerance:g}"
    return ok, fields


# --- rows -------------------------------------------------------------------------------------------------------------

def kernel_row(problem: Problem, errors: dict[str, float], fwd: Callable, bwd: Callable, moved: int,
               copy_gbs: float, device: str) -> dict:
    """mf_ds's launches alone, timed if their checked launch was right."""
    ok, fields = verdict(errors, problem.dtype)
    row = problem.row("kernel", fwd_ms=None, bwd_ms=None, **fields)
    if ok:
        row["fwd_ms"], row["bwd_ms"] = bench(fwd, device), bench(bwd, device)
        gbs = moved / (row["fwd_ms"] + row["bwd_ms"]) / 1e6
        row.update(bytes=moved, GB_per_s=gbs, fraction_of_copy=gbs / copy_gbs if copy_gbs else None)
    return row


def autograd_rows(problem: Problem, competitors: dict, ref, device: str) -> list[dict]:
    """Every competitor checked, then each right one timed, forward + backward on fresh leaves; one that cannot run
    or is wrong is a row saying why."""
    rows, right = {}, []
    for who, (fn, why) in competitors.items():
        if fn is None:
            rows[who] = problem.row("autograd", impl=who, ms=None, note=why)
            continue
        try:
            ok, fields = verdict(check(problem, fn, ref), problem.dtype)
        except Exception as exc:
            rows[who] = problem.row("autograd", impl=who, ms=None, note=f"failed: {describe(exc)}")
            continue
        rows[who] = problem.row("autograd", impl=who, ms=None, **fields)
        if ok:
            right.append(who)

    clone_ms = bench(lambda: problem.args(problem.fresh()), device)
    net = {}
    for who in right:
        def step(fn=competitors[who][0]):
            outputs = as_tuple(fn(*problem.args(problem.fresh())))
            torch.autograd.backward(outputs, problem.grads)

        try:
            ms = bench(step, device)
        except Exception as exc:
            rows[who]["note"] = f"failed while timed: {describe(exc)}"
            continue
        net[who] = ms - clone_ms
        rows[who].update(ms=ms, clone_ms=clone_ms, ms_net=net[who])
    for who in net:
        if net.get("mf_ds", 0) > 0 and net[who] > 0:  # noise can push a net time of a tiny smoke case below 0
            rows[who]["mf_ds_speedup"] = net[who] / net["mf_ds"]
    return list(rows.values())


# --- RoPE -------------------------------------------------------------------------------------------------------------

def rope_rows(name, shape, dtype, device, copy_gbs) -> list[dict]:
    batch, seq, hq, hk, rot, width, layout = shape
    mla = layout == "interleaved_to_split"
    g = torch.Generator(device="cpu").manual_seed(0)
    proj_q = torch.randn(batch, seq, hq * width, generator=g).to(device, dtype).requires_grad_()
    proj_k = torch.randn(batch, seq, (512 if mla else 0) + hk * rot, generator=g).to(device, dtype).requires_grad_()

    def views(leaves):
        """What HF's attention hands the function (DeepseekV3Attention: q_rot and k_rot are views)."""
        proj_q, proj_k = leaves
        q = proj_q.view(batch, seq, hq, width).transpose(1, 2)[..., width - rot:]
        k = proj_k[..., 512:].view(batch, 1, seq, rot) if mla else proj_k.view(batch, seq, hk, rot).transpose(1, 2)
        return q, k

    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    angles = torch.arange(seq).float()[None, :, None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1).expand(batch, seq, rot)
    cos, sin = angles.cos().to(device, dtype).contiguous(), angles.sin().to(device, dtype).contiguous()
    cos64, sin64 = cos.double(), sin.double()
    hf = modeling_deepseek_v3.apply_rotary_pos_emb_interleave if mla else modeling_llama.apply_rotary_pos_emb
    with torch.no_grad():  # HF's outputs, for their layout
        grads = tuple(torch.empty_like(x).copy_(torch.randn(x.shape, generator=g))
                      for x in hf(*views((proj_q, proj_k)), cos, sin))
    problem = Problem("rope", name, (proj_q, proj_k), views, grads, ("q", "k"), ("proj_q", "proj_k"))
    ref = reference(problem, lambda q, k: hf(q, k, cos64, sin64))

    # kernel: forward and backward launches alone, checked once into outputs filled with NaN
    q, k = (x.detach() for x in views(problem.leaves))
    q_out, k_out, grad_q, grad_k = (torch.full(x.shape, math.nan, dtype=dtype, device=device) for x in (q, k, q, k))

    def fwd():
        rope._launch(q, k, q_out, k_out, cos, sin, layout, False)

    def bwd():
        rope._launch(*grads, grad_q, grad_k, cos, sin, layout, True)

    fwd()
    bwd()
    ref_grad_q, ref_grad_k = views(ref[1])
    errors = {"q": rel_err(q_out, ref[0][0]), "k": rel_err(k_out, ref[0][1]), "d q": rel_err(grad_q, ref_grad_q),
              "d k": rel_err(grad_k, ref_grad_k)}
    table_cols = rot if layout == "split_half" else rot // 2  # the interleaved layouts read the first half only
    moved = 2 * (2 * (q.numel() + k.numel()) + 2 * batch * seq * table_cols) * BYTES[dtype]  # fwd + bwd
    rows = [kernel_row(problem, errors, fwd, bwd, moved, copy_gbs, device)]

    competitors = {"mf_ds": (lambda q, k: rope.fused_rope(q, k, cos, sin, layout=layout), ""),
                   "hf_eager": (lambda q, k: hf(q, k, cos, sin), "")}
    if not mla:
        ds, why = optional("deepspeed fused_apply_rotary_pos_emb", lambda: importlib.import_module(
            "deepspeed.ops.triton_ops.fused_rotary_pos_emb").fused_apply_rotary_pos_emb)
        competitors["deepspeed"] = ((lambda q, k: ds(q, k, cos, sin)) if ds else None, why)
        liger, why = optional("liger rope", lambda: importlib.import_module(
            "liger_kernel.transformers.rope").liger_rotary_pos_emb)
        competitors["liger"] = ((lambda q, k: liger(q, k, cos, sin)) if liger else None, why)
    else:
        competitors["deepspeed"] = (None, "deepspeed's fused RoPE is split-half only (no interleaved MLA layout)")
        competitors["liger"] = (None, "liger's RoPE is split-half only (no interleaved MLA layout)")
    return rows + autograd_rows(problem, competitors, ref, device)


# --- SwiGLU -----------------------------------------------------------------------------------------------------------

def swiglu_rows(name, shape, dtype, device, copy_gbs) -> list[dict]:
    tokens, width, packed = shape
    g = torch.Generator(device="cpu").manual_seed(0)
    if packed:
        leaves = (torch.randn(tokens, 2 * width, generator=g).to(device, dtype).requires_grad_(),)
    else:
        leaves = tuple(torch.randn(tokens, width, generator=g).to(device, dtype).requires_grad_() for _ in range(2))
    grad = torch.randn(tokens, width, generator=g).to(device, dtype)

    def halves(tensors):
        """(gate, up): the two halves of a packed gate_up, or the two tensors."""
        return tuple(tensors[0].chunk(2, dim=-1)) if packed else tuple(tensors)

    def hf(*tensors):
        gate, up = halves(tensors)
        return F.silu(gate) * up

    problem = Problem("swiglu_packed" if packed else "swiglu", name, leaves, lambda leaves: leaves, (grad,),
                      ("out",), ("gate_up",) if packed else ("gate", "up"))
    ref = reference(problem, hf)

    # kernel: forward and backward launches alone, checked once into outputs filled with NaN
    gate, up = halves(tuple(x.detach() for x in leaves))
    out, grad_gate, grad_up = (torch.full((tokens, width), math.nan, dtype=dtype, device=device) for _ in range(3))

    def fwd():
        swiglu._launch_fwd(gate, up, out)

    def bwd():
        swiglu._launch_bwd(grad, gate, up, grad_gate, grad_up)

    fwd()
    bwd()
    ref_grad_gate, ref_grad_up = halves(ref[1])
    errors = {"out": rel_err(out, ref[0][0]), "d gate": rel_err(grad_gate, ref_grad_gate),
              "d up": rel_err(grad_up, ref_grad_up)}
    moved = 8 * tokens * width * BYTES[dtype]  # fwd: read gate, up, write out; bwd: read grad, gate, up, write 2
    rows = [kernel_row(problem, errors, fwd, bwd, moved, copy_gbs, device)]

    ds_module, why = optional("deepspeed swiglu_triton", lambda: importlib.import_module(
        "deepspeed.ops.triton_ops.swiglu_triton"))
    if packed:
        competitors = {"mf_ds": (swiglu.fused_swiglu_packed, ""), "hf_eager": (hf, ""),
                       "deepspeed": (ds_module.swiglu_packed if ds_module else None, why),
                       "liger": (None, "liger has no packed gate_up SwiGLU function to call on a tensor")}
    else:
        liger, liger_why = optional("liger swiglu", lambda: importlib.import_module(
            "liger_kernel.ops.swiglu").LigerSiLUMulFunction.apply)
        competitors = {"mf_ds": (swiglu.fused_swiglu, ""), "hf_eager": (hf, ""),
                       "deepspeed": (ds_module.swiglu if ds_module else None, why), "liger": (liger, liger_why)}
    return rows + autograd_rows(problem, competitors, ref, device)


# --- main -------------------------------------------------------------------------------------------------------------

def line(row: dict) -> str:
    """One row of the table printed last (a caller may keep only the tail of the output)."""
    head = f"{row['op']:13} {row['case']:26} {row.get('impl', row['kind']):9}"
    err = f" err {row['rel_err']:.1e}" if isinstance(row.get("rel_err"), float) else ""
    if row["kind"] == "kernel" and row.get("fwd_ms") is not None:
        fraction = f" {row['fraction_of_copy']:.2f} of copy" if row.get("fraction_of_copy") else ""
        return f"{head} fwd {row['fwd_ms']:.3f} bwd {row['bwd_ms']:.3f} ms {row['GB_per_s']:.0f} GB/s{fraction}{err}"
    if row.get("ms") is not None:
        speedup = f" x{row['mf_ds_speedup']:.2f}" if "mf_ds_speedup" in row else ""
        return f"{head} {row['ms']:.3f} ms net {row['ms_net']:.3f}{speedup}{err}"
    return f"{head} {row.get('note', '')[:64]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU through Triton's interpreter")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for the JSON (default bench/results; with --smoke, written only if given)")
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
    rows = []
    for kind, shapes, make in (("rope", rope_shapes, rope_rows), ("swiglu", swiglu_shapes, swiglu_rows)):
        for name, shape in shapes.items():
            try:
                rows += make(name, shape, dtype, device, copy_gbs)
            except Exception as exc:  # one case's failure (out of memory, say) leaves the others' rows standing
                traceback.print_exc()
                rows.append({"op": kind, "case": name, "dtype": str(dtype).removeprefix("torch."), "kind": "case",
                             "note": f"case failed: {describe(exc)}"})
    record = {"benchmark": "rope_swiglu_gpu", "dtype": str(dtype).removeprefix("torch."), "copy_GB_per_s": copy_gbs,
              "tolerance_rel_err": TOLERANCE[dtype],
              "target": "kernel fraction_of_copy >= 0.85; mf_ds fastest (ms_net) in every autograd case",
              "rows": rows, **stamp()}
    if device == "cpu":
        record["device"]["processor"] = platform.processor() or platform.machine()
    path = None
    if not args.smoke or args.out:  # written before the table is printed: a printing slip loses no numbers
        folder = args.out or ROOT / "bench" / "results"
        folder.mkdir(parents=True, exist_ok=True)
        label = "smoke-cpu" if args.smoke else f"cuda-{torch.cuda.get_device_name().replace(' ', '_')}"
        path = folder / f"rope_swiglu-{label}.json"
        path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"copy {copy_gbs:.0f} GB/s | ms: fwd + bwd; net: minus the input clone; x: net / mf_ds's net; "
          f"err: max rel err vs float64 HF (limit {TOLERANCE[dtype]:g})")
    for row in rows:
        print(line(row))
    if path:
        print(f"-> {path}")
    if mf_ds_failures(rows):  # a benchmark of a wrong result is no benchmark: the suite marks this step failed
        sys.exit(f"mf_ds gave wrong results or failed: {mf_ds_failures(rows)}")


def mf_ds_failures(rows: list[dict]) -> list[str]:
    """mf_ds's rows (its kernel launches, its autograd functions) that were wrong or failed, and cases that failed."""
    return [f"{r['op']} {r['case']} {r.get('impl', r['kind'])}: {r['note'][:80]}" for r in rows
            if r.get("impl", "mf_ds") == "mf_ds" and r.get("note", "").startswith(("wrong result", "failed", "case "))]


if __name__ == "__main__":
    main()
