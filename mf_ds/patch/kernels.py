"""Fused RoPE and SwiGLU (mf_ds/ops/rope.py, mf_ds/ops/swiglu.py) injected per model type."""

from __future__ import annotations

from mf_ds.patch import PatchFn

ROPE_PATCHES: dict[str, PatchFn] = {}
SWIGLU_PATCHES: dict[str, PatchFn] = {}
