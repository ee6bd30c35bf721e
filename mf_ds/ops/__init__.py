"""Kernels, one op per file: docstring with the math and the HF function replaced, Triton kernel(s), the plain-torch
reference (test oracle and CPU path), launcher, autograd.Function, public function.

    rope.py      fused_rope(q, k, cos, sin, unsqueeze_dim=1, layout, out_dtype)     RoPE of q and k in one launch
    swiglu.py    fused_swiglu(gate, up), fused_swiglu_packed(gate_up)               silu(gate) * up, silu recomputed
    gmm.py       grouped_mm(x, w, tokens_per_expert)                                MoE experts' grouped matmul
                 (its pointer kernels in gmm_triton.py, its TMA kernels in gmm_tma.py)
    permute.py   permute(...), unpermute(...)                                       MoE token permutation
    library.py   torch.ops.mf_ds.*: the MoE ops above as custom ops (fakes, autograd)  what torch.compile traces
    gmm_choice.py  the grouped matmul's CUDA backend per product, chosen before the first step
    dispatch.py  use_triton(*tensors), on_device(kernel, *tensors), CompiledCPU     CUDA -> Triton, CPU -> torch

Nothing is imported here, so `import mf_ds.ops.<op>` loads only that op (and Triton).
"""
