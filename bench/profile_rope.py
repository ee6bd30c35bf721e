"""Where one fused-RoPE forward + backward spends its time on CUDA: torch.profiler's table of GPU kernels and CPU
ops for mf_ds, DeepSpeed and Liger at the Llama-3-8B shape of bench/rope_swiglu_gpu.py (HF's q/k views of the
projections, fresh inputs every step), to tell launch overhead (GPU idle between kernels) from kernel time.

    python bench/profile_rope.py        # CUDA only; prints the tables
"""

from __future__ import annotations

import importlib
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mf_ds.ops import rope  # noqa: E402

B, S, HQ, HK, D = 2, 8192, 32, 8, 128


def main() -> None:
    dt = torch.bfloat16
    proj_q = torch.randn(B, S, HQ * D, device="cuda", dtype=dt)
    proj_k = torch.randn(B, S, HK * D, device="cuda", dtype=dt)
    angles = torch.arange(S, device="cuda").float()[:, None] / (10000 ** (torch.arange(0, D, 2, device="cuda") / D))
    angles = torch.cat((angles, angles), -1)[None]
    cos, sin = angles.cos().to(dt), angles.sin().to(dt)
    grads = (torch.randn(B, S, HQ, D, device="cuda", dtype=dt).transpose(1, 2),
             torch.randn(B, S, HK, D, device="cuda", dtype=dt).transpose(1, 2))
    impls = {"mf_ds": lambda q, k: rope.fused_rope(q, k, cos, sin)}
    for name, module, attr in (("deepspeed", "deepspeed.ops.triton_ops.fused_rotary_pos_emb",
                                "fused_apply_rotary_pos_emb"),
                               ("liger", "liger_kernel.transformers.rope", "liger_rotary_pos_emb")):
        try:
            fn = getattr(importlib.import_module(module), attr)
            impls[name] = lambda q, k, fn=fn: fn(q, k, cos, sin)
        except Exception as exc:  # noqa: BLE001
            print(f"{name}: unavailable ({type(exc).__name__})")
    for name, fn in impls.items():
        def step(fn=fn):
            pq, pk = (x.clone().requires_grad_() for x in (proj_q, proj_k))
            q, k = pq.view(B, S, HQ, D).transpose(1, 2), pk.view(B, S, HK, D).transpose(1, 2)
            torch.autograd.backward(fn(q, k), [g.clone() for g in grads])

        for _ in range(5):
            step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(20):
            step()
        torch.cuda.synchronize()
        print(f"== {name}: {(time.perf_counter() - start) / 20 * 1e3:.3f} ms per step (wall, with the clones)")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                step()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=48))


if __name__ == "__main__":
    main()
