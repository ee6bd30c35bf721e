"""The mf-ds MoE layer (mf_ds/moe/) injected in place of transformers' MoE blocks, per model type."""

from __future__ import annotations

from mf_ds.patch import PatchFn

PATCHES: dict[str, PatchFn] = {}
