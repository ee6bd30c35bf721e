"""GPU: the grouped matmul and the whole MoE block, forward + backward, against the peers in one run.

    python bench/gmm_gpu.py [--out DIR] [--quick]     # CUDA only; writes DIR/gmm-cuda-<device>.json

GMM rows: one expert projection (gate_up: K = H, N = 2I, weights in HF's [E, N, K] storage used transposed),
forward + backward (dX and dW), bf16, dropless routing with a skewed router, rows sorted by expert, at the shapes of
Qwen3-30B-A3B (E 128, k 8, H 2048, I 768), Mixtral-8x7B (E 8, k 2, H 4096, I 14336) and DeepSeek-V3 at EP 8
(32 local experts of 256, k 8, H 7168, I 2048: a rank receives about T rows). Competitors, on the same tensors:
  mf_ds        mf_ds.ops.gmm.grouped_mm: per product (fwd, dX, dW) the fastest of its Triton pointer kernels, its
               TMA kernels (gmm_tma.py) and torch's grouped_mm, timed on the first call (MF_DS_GMM=auto)
  mf_ds_triton, mf_ds_tma   every product on that backend alone (each autotuned on its first call per shape)
  torch        torch.nn.functional.grouped_mm (CUTLASS on sm90)
  deepspeed    deepspeed.ops.triton_ops.group_gemm_triton (AutoEP's Triton group GEMM, trans_b=True)
  dense        torch.matmul of one [M, K] x [K, N] with the same FLOPs: the cuBLAS ceiling
Each is checked against a float32 per-expert reference (output, dX, dW: relative error) before it is timed.
TFLOP/s = 6 M K N / time (forward, dX, dW).

Index-map rows: permute's maps from the routing (two Triton kernels) against the torch ops they replace, at the
block's shape and token counts, dropless and at capacity factor 1.0.

MoE block rows: Qwen3-MoE's block (router + experts) at the Qwen3-30B-A3B shape: MFMoE (mf_ds.patch.moe.build_block,
dropless) vs HF v5's experts with `grouped_mm` and `eager`, same weights and
routing (outputs compared first), forward + backward time and the peak memory allocated above the inputs during one
forward + backward.

Timing: triton.testing.do_bench (CUDA events, median of the repeats after warm-up), gradients reset between calls.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu_env import stamp  # noqa: E402
from mf_ds.ops import gmm, gmm_tma, gmm_triton  # noqa: E402

# name: (experts on this rank, top-k, hidden, expert width, rows per token on this rank)
SHAPES = {
    "qwen3_30b_a3b": (128, 8, 2048, 768, 8),
    "mixtral_8x7b": (8, 2, 4096, 14336, 2),
    "deepseek_v3_ep8": (32, 8, 7168, 2048, 1),  # 8 choices over 256 experts, 32 of them here: ~1 row per token
}
TOKENS = (4096, 16384, 32768)
SMOKE_SHAPES = {"smoke": (4, 2, 32, 24, 2)}  # --smoke: CPU, Triton's interpreter, float32, every code path once
DEVICE = "cuda"
TOL = 1e-2  # bf16 operands, fp32 accumulation: relative error well under this


def _time(fn, grads_of=()) -> float:
    if DEVICE == "cpu":  # --smoke: one wall-clock run
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    from triton.testing import do_bench

    return do_bench(fn, warmup=20, rep=150, grad_to_none=list(grads_of), return_mode="median")


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _counts(rows: int, experts: int, g: torch.Generator) -> torch.Tensor:
    """A skewed dropless load: softmax of a biased router over `rows` picks, some experts idle-ish."""
    weights = torch.softmax(torch.linspace(0, 2.0, experts) + 0.5 * torch.randn(experts, generator=g), 0)
    picks = torch.multinomial(weights, rows, replacement=True, generator=g)
    return torch.bincount(picks, minlength=experts)


def gmm_case(name: str, tokens: int, dtype=torch.bfloat16) -> list[dict]:
    experts, _, hidden, width, per_token = {**SHAPES, **SMOKE_SHAPES}[name]
    M, K, N = tokens * per_token, hidden, 2 * width
    g = torch.Generator().manual_seed(0)
    counts = _counts(M, experts, g).to(DEVICE)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    x = (torch.randn(M, K, device=DEVICE, dtype=dtype)).requires_grad_()
    w_store = (torch.randn(experts, N, K, device=DEVICE, dtype=dtype) / K**0.5).requires_grad_()  # HF [E, N, K]
    dy = torch.randn(M, N, device=DEVICE, dtype=dtype)
    flops = 6 * M * K * N

    def reference():
        """float32 per expert: y, dX, dW (dW in w's [E, N, K] storage)."""
        y, dx = torch.empty(M, N, device=DEVICE), torch.empty(M, K, device=DEVICE)
        dw = torch.zeros(experts, N, K, device=DEVICE)
        start = 0
        for e, n in enumerate(counts.tolist()):
            xe, we, dye = x[start:start + n].float(), w_store[e].float(), dy[start:start + n].float()
            y[start:start + n], dx[start:start + n] = xe @ we.t(), dye @ we
            dw[e] = dye.t() @ xe
            start += n
        return y, dx, dw

    ds_gemm = None
    try:
        ds_gemm = importlib.import_module("deepspeed.ops.triton_ops.group_gemm_triton").group_gemm_triton
    except Exception as exc:  # noqa: BLE001 - a peer that cannot load is a row saying why
        ds_note = f"deepspeed unavailable: {type(exc).__name__}: {exc}"
    def with_backend(backend):
        def run():
            os.environ[gmm.BACKEND_ENV] = backend
            return gmm.grouped_mm(x, w_store.transpose(1, 2), counts, exact_rows=True)  # dropless: no padding
        return run

    impls = {
        "mf_ds": with_backend("auto"),  # per product: the Triton kernel or torch's, whichever timed faster
        "mf_ds_triton": with_backend("triton"),
        "mf_ds_tma": with_backend("tma"),
        "torch": lambda: torch.nn.functional.grouped_mm(x, w_store.transpose(1, 2), offs=offs),
        "deepspeed": (lambda: ds_gemm(x, w_store, offs, trans_b=True)) if ds_gemm else None,
    }
    with _no_tf32():
        want = reference()
    rows = []
    times = {}
    for who, fn in impls.items():
        row = {"bench": "gmm", "shape": name, "tokens": tokens, "M": M, "K": K, "N": N, "E": experts,
               "dtype": str(dtype).removeprefix("torch."), "impl": who}
        if fn is None:
            rows.append({**row, "ms": None, "note": ds_note})
            continue
        try:
            x.grad = w_store.grad = None
            y = fn()
            y.backward(dy)
            errs = {"y": _rel_err(y, want[0]), "dx": _rel_err(x.grad, want[1]), "dw": _rel_err(w_store.grad, want[2])}
            row["rel_err"] = errs
            if max(errs.values()) > TOL or not all(map(torch.isfinite, (y.sum(), x.grad.sum(), w_store.grad.sum()))):
                rows.append({**row, "ms": None, "note": f"wrong result: {errs}"})
                continue
            times[who] = _time(lambda fn=fn: fn().backward(dy), (x, w_store))
            rows.append({**row, "ms": times[who], "TFLOPs": flops / times[who] / 1e9})
        except Exception as exc:  # noqa: BLE001
            rows.append({**row, "ms": None, "note": f"failed: {type(exc).__name__}: {str(exc).splitlines()[0]}"})
    os.environ[gmm.BACKEND_ENV] = "auto"
    # each product alone, on each backend `auto` chooses between: the pointer kernels, the TMA kernels, torch's
    w_t = w_store.detach().transpose(1, 2)
    xd = x.detach()
    products = {"fwd": (lambda: gmm_triton._gmm_triton(xd, w_t, offs), lambda: gmm_tma.gmm_fwd(xd, w_t, offs),
                        lambda: gmm._torch_fwd(xd, w_t, offs, True), want[0]),
                "dx": (lambda: gmm_triton._gmm_triton(dy, w_store.detach(), offs),
                       lambda: gmm_tma.gmm_fwd(dy, w_store.detach(), offs),
                       lambda: gmm._torch_fwd(dy, w_store.detach(), offs, True), want[1]),
                "dw": (lambda: gmm_triton._gmm_dw_triton(xd, dy, offs, w_t), lambda: gmm_tma.gmm_dw(xd, dy, offs, w_t),
                       lambda: gmm._torch_dw(xd, dy, offs, w_t), want[2].transpose(1, 2))}
    for product, (*runs, expected) in products.items():
        row = {"bench": "gmm_product", "shape": name, "tokens": tokens, "impl": product}
        for backend, run in zip(("triton", "tma", "torch"), runs, strict=True):
            try:
                err = _rel_err(run(), expected)
                row[f"{backend}_ms"] = _time(run) if err < TOL else None
                row[f"{backend}_rel_err"] = err
            except Exception as exc:  # noqa: BLE001
                row[f"{backend}_ms"] = None
                row[f"{backend}_note"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"
            if row[f"{backend}_ms"]:
                row[f"{backend}_TFLOPs"] = flops / 3 / row[f"{backend}_ms"] / 1e9
        rows.append(row)
    # cuBLAS with the same FLOPs: one [M, K] x [K, N] forward + both backward products
    a = torch.randn(M, K, device=DEVICE, dtype=dtype, requires_grad=True)
    b = torch.randn(K, N, device=DEVICE, dtype=dtype, requires_grad=True)
    dense = _time(lambda: (a @ b).backward(dy), (a, b))
    rows.append({"bench": "gmm", "shape": name, "tokens": tokens, "M": M, "K": K, "N": N, "E": experts,
                 "dtype": str(dtype).removeprefix("torch."), "impl": "dense", "ms": dense,
                 "TFLOPs": flops / dense / 1e9})
    for row in rows:
        if row["bench"] == "gmm" and row["ms"]:
            row["fraction_of_dense"] = dense / row["ms"]
            if "mf_ds" in times:
                row["mf_ds_speedup"] = row["ms"] / times["mf_ds"]
    return rows


class _no_tf32:
    """The reference in true float32."""

    def __enter__(self):
        self.saved = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32 = self.saved


# --- the MoE block ----------------------------------------------------------------------------------------------------

def moe_block_case(tokens: int, dtype=torch.bfloat16, shape: str = "qwen3_30b_a3b") -> list[dict]:
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from bench.moe_layer import _plan
    from mf_ds.patch.moe import build_block

    experts, top_k, hidden, width, _ = {**SHAPES, **SMOKE_SHAPES}[shape]
    config = AutoConfig.for_model("qwen3_moe", hidden_size=hidden, moe_intermediate_size=width, num_experts=experts,
                                  num_experts_per_tok=top_k, norm_topk_prob=True)
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(config).to(DEVICE, dtype)
    with torch.no_grad():
        block.gate.weight.normal_(0, 0.05)  # a realistically uneven load
        block.experts.gate_up_proj.normal_(0, 0.02)
        block.experts.down_proj.normal_(0, 0.02)
    ours = build_block("qwen3_moe", block, _plan(-1.0, E=experts, K=top_k)).train()
    x = torch.randn(1, tokens, hidden, device=DEVICE, dtype=dtype, requires_grad=True)
    dout = torch.randn(1, tokens, hidden, device=DEVICE, dtype=dtype)

    def hf(impl):
        def run():
            config._experts_implementation = impl
            return block(x)
        return run

    def mf_ds(backend):
        def run():
            os.environ[gmm.BACKEND_ENV] = backend
            return ours(x)
        return run

    # mf_ds: the permute folded into the first grouped matmul (Triton), the other products on the faster backend;
    # mf_ds_triton: every product on the Triton kernels; mf_ds_torch_gemm: torch's grouped_mm for every product
    # (so no folded permute) around mf_ds's permute, SwiGLU and combine kernels
    variants = {"mf_ds": mf_ds("auto"), "mf_ds_triton": mf_ds("triton"),
                "mf_ds_torch_gemm": mf_ds("torch"), "hf_grouped_mm": hf("grouped_mm"), "hf_eager": hf("eager")}
    params = [x, *block.parameters()]
    results = {}
    for who, fn in variants.items():
        for p in params:
            p.grad = None
        out = fn()
        out.backward(dout)
        results[who] = (out.detach().float(), x.grad.float(), block.experts.gate_up_proj.grad.float())
    # mf_ds routes in float32 (MindFormers' router_dense_type), HF's Qwen3-MoE router in the block's dtype: near-tie
    # top-k choices differ between the two, so each is checked against a reference that routes as it does: HF's
    # eager block in float32 on the same (bf16-valued) weights and inputs for mf_ds, HF's bf16 eager block for HF.
    import copy

    ref_block = copy.deepcopy(block).float()
    config._experts_implementation = "eager"
    x32 = x.detach().float().requires_grad_()
    out32 = ref_block(x32)
    out32.backward(dout.float())
    results["fp32_reference"] = (out32.detach(), x32.grad, ref_block.experts.gate_up_proj.grad)
    del ref_block
    rows = []
    times = {}
    for who, fn in variants.items():
        ref = results["fp32_reference" if who.startswith("mf_ds") else "hf_eager"]
        errs = {label: _rel_err(a, b) for label, a, b in zip(("out", "dx", "dgate_up"), results[who], ref,
                                                                strict=True)}
        row = {"bench": "moe_block", "shape": shape, "tokens": tokens, "dtype": str(dtype).removeprefix("torch."),
               "impl": who, "rel_err": errs,
               "checked_against": "hf_eager_fp32" if who.startswith("mf_ds") else "hf_eager"}
        if max(errs.values()) > 2e-2:
            rows.append({**row, "ms": None, "note": f"wrong result: {errs}"})
            continue
        for p in params:
            p.grad = None
        peak = 0
        if DEVICE == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fn().backward(dout)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
        times[who] = _time(lambda fn=fn: fn().backward(dout), params)
        rows.append({**row, "ms": times[who], "peak_MiB": peak / 2**20})
    os.environ[gmm.BACKEND_ENV] = "auto"
    for row in rows:
        if row["ms"] and "mf_ds" in times:
            row["mf_ds_speedup"] = row["ms"] / times["mf_ds"]
    return rows


def index_maps_case(tokens: int, shape: str) -> list[dict]:
    """permute's index maps (each pair's row, each row's token, the counts): the two Triton kernels against the torch
    ops (a stable sort and about thirty small launches), dropless and at capacity factor 1.0 (k-drop), same routing.
    Their maps must be equal before they are timed."""
    from mf_ds.ops import permute as permute_mod

    experts, top_k, *_ = {**SHAPES, **SMOKE_SHAPES}[shape]
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(tokens, experts, generator=g) + torch.linspace(0, 2, experts)  # skewed towards high ids
    ids = scores.topk(top_k, dim=1).indices.to(DEVICE)
    rows = []
    for capacity in (None, tokens * top_k // experts):
        M = permute_mod._num_rows(tokens, top_k, experts, capacity, 1)
        args = (ids, experts, capacity, "kdrop", M)
        equal = all(torch.equal(a.long(), b) for a, b in zip(permute_mod._route_triton(*args),
                                                              permute_mod._route(*args), strict=True))
        row = {"bench": "index_maps", "shape": shape, "tokens": tokens, "impl": "mf_ds_triton",
               "capacity": capacity, "equal_to_torch": equal}
        if not equal:
            rows.append({**row, "ms": None, "note": "wrong result: maps differ from the torch ops'"})
            continue
        ms = _time(lambda args=args: permute_mod._route_triton(*args))
        torch_ms = _time(lambda args=args: permute_mod._route(*args))
        rows.append({**row, "ms": ms, "torch_ms": torch_ms, "mf_ds_speedup": torch_ms / ms})
    return rows


def main() -> None:
    global DEVICE
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--quick", action="store_true", help="one token count per shape")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (Triton's interpreter), no file")
    parser.add_argument("--tokens", help="comma-separated token counts for the GMM rows (default: 4096,16384,32768)")
    parser.add_argument("--no-block", action="store_true", help="the GMM rows only")
    args = parser.parse_args()
    if args.smoke:
        os.environ["MF_DS_FORCE_TRITON"] = "1"
        DEVICE = "cpu"
        cases, tokens, block = SMOKE_SHAPES, (16,), [(8, "smoke")]
        dtype = torch.float32
    elif not torch.cuda.is_available():
        sys.exit("bench/gmm_gpu.py needs a CUDA device (or --smoke); CPU numbers: bench/gmm.py, bench/moe_layer.py")
    else:
        cases, tokens, dtype = SHAPES, (16384,) if args.quick else TOKENS, torch.bfloat16
        if args.tokens:
            tokens = tuple(int(t) for t in args.tokens.split(","))
        block = [] if args.no_block else [(4096, "qwen3_30b_a3b"), (16384, "qwen3_30b_a3b")]
    name = torch.cuda.get_device_name().replace(" ", "_") if DEVICE == "cuda" else "cpu"
    suffix = f"-T{'_'.join(map(str, tokens))}" if args.tokens else ""
    out = Path(args.out) / f"gmm-cuda-{name}{suffix}.json"
    rows = []
    for case in cases:
        for t in tokens:
            rows += gmm_case(case, t, dtype)
            _print([r for r in rows if r["shape"] == case and r["tokens"] == t])
            if not args.smoke:
                _write(out, rows)  # after each case: a run cut short keeps what it measured
    for t, shape in block:
        rows += index_maps_case(t, shape)
        rows += moe_block_case(t, dtype, shape)
        _print([r for r in rows if r["bench"] in ("index_maps", "moe_block") and r["tokens"] == t])
    if args.smoke:
        wrong = _wrong(rows)
        sys.exit(f"wrong results: {wrong}" if wrong else 0)
    _write(out, rows)
    print(f"-> {out}")
    if _wrong(rows):  # a benchmark of a wrong result is no benchmark: the suite marks this step failed
        sys.exit(f"mf_ds gave wrong results: {_wrong(rows)}")


def _wrong(rows: list[dict]) -> list[str]:
    return [f"{r['bench']} {r['shape']} T{r['tokens']} {r['impl']}" for r in rows
            if r["impl"].startswith("mf_ds") and "wrong result" in r.get("note", "")]


def _write(out: Path, rows: list[dict]) -> None:
    record = {"benchmark": "gmm_gpu", "rows": rows, "wrong_results": _wrong(rows),
              "targets": "gmm: mf_ds >= 1.2x torch and >= 1.2x deepspeed; moe_block: mf_ds >= 1.3x hf_grouped_mm "
                         "with lower peak memory",
              "autotuned": {"fwd": _configs(gmm_triton._gmm_fwd_tuned), "dw": _configs(gmm_triton._gmm_dw_tuned)},
              "backend_choices": [[str(k), *v] for k, v in gmm.CHOICES.items()],
              "tma_autotuned": {"fwd": _configs(gmm_tma._fwd_tuned), "dw": _configs(gmm_tma._dw_tuned)},
              **stamp()}
    out.write_text(json.dumps(record, indent=2) + "\n")


def _configs(tuner) -> dict[str, str]:
    """The autotuner's choice per key, readable."""
    return {str(key): str(config) for key, config in getattr(tuner, "cache", {}).items()}


def _print(rows: list[dict]) -> None:
    for r in rows:
        if r["bench"] == "gmm_product":
            cells = [f"{b} {r[b + '_ms']:7.3f}" if r.get(b + "_ms") else f"{b} --" for b in ("triton", "tma", "torch")]
            print(f"  {r['shape']:16} T{r['tokens']:<6} {r['impl']:4} ms: " + "  ".join(cells), flush=True)
            continue
        ms = f"{r['ms']:8.3f} ms" if r.get("ms") else f"-- {r.get('note', '')[:90]}"
        extra = f" {r['TFLOPs']:6.0f} TF/s" if "TFLOPs" in r else ""
        extra += f" {r['peak_MiB']:8.0f} MiB" if "peak_MiB" in r else ""
        extra += f" x{r['mf_ds_speedup']:.2f}" if "mf_ds_speedup" in r else ""
        print(f"{r['bench']:9} {r['shape']:16} T{r['tokens']:<6} {r['impl']:13} {ms}{extra}", flush=True)


if __name__ == "__main__":
    main()
