"""The one place that knows transformers' internals: `apply(model, plan)` patches an HF model as the Plan asks.

    report = mf_ds.patch.apply(model, plan)    # ["model.layers.3.mlp: Qwen3MoeSparseMoeBlock -> MFMoE", ...]
    mf_ds.patch.revert(model)                  # every original back (tests)

One table per feature, `{model_type: patch function}`, drives one generic patcher: `kernels.py` (fused RoPE and
SwiGLU, `plan.kernels`), `moe.py` (the mf-ds MoE layer, `plan.moe`). A patch function takes
`(model, plan, recorder)` and returns its report lines. Nothing is patched at import. A requested feature on a model
type its table does not know, or a patch that matched nothing, raises `PatchError`; a feature that does not apply
to this model (fused SwiGLU on GPT-2's GELU MLP) is a report line saying why. State-dict keys never change, so a
patched model saves and loads as the HF model it is. Patches go on before `deepspeed.initialize`, since ZeRO-3
partitions the parameters that exist then.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mf_ds.patch.core import Recorder

PatchFn = Callable[[torch.nn.Module, dict, Recorder], list[str]]


class PatchError(RuntimeError):
    """A patch the Plan asks for that cannot be applied to this model."""


def _features(plan: dict) -> list[tuple[str, dict[str, PatchFn]]]:
    """(feature, table) for every feature the Plan turns on, in the order they are applied."""
    from mf_ds.patch import kernels, moe

    wanted = []
    if plan.get("moe") is not None:
        wanted.append(("moe", moe.PATCHES))
    if plan["kernels"]["fused_rope"]:
        wanted.append(("fused_rope", kernels.ROPE_PATCHES))
    if plan["kernels"]["fused_swiglu"]:
        wanted.append(("fused_swiglu", kernels.SWIGLU_PATCHES))
    return wanted


def apply(model: torch.nn.Module, plan: dict) -> list[str]:
    """Patch `model` as `plan` asks; returns the report. Raises PatchError, leaving the model unpatched."""
    if getattr(model, "_mf_ds_patches", None):
        raise PatchError("this model is already patched; call mf_ds.patch.revert(model) first")
    model_type = model.config.model_type
    recorder = Recorder()
    report: list[str] = []
    try:
        for feature, table in _features(plan):
            if model_type not in table:
                raise PatchError(f"{feature}: no patch for model type {model_type!r} (known: "
                                 f"{', '.join(sorted(table))})")
            lines = table[model_type](model, plan, recorder)
            if not lines:
                raise PatchError(f"{feature}: the {model_type} patch matched nothing in {type(model).__name__}")
            report += lines
    except BaseException:
        recorder.revert()
        raise
    for release in recorder.on_success:  # what only a failed apply would have needed back
        release()
    model._mf_ds_patches = recorder
    return report


def revert(model: torch.nn.Module) -> None:
    """Undo `apply` on this model."""
    recorder = getattr(model, "_mf_ds_patches", None)
    if recorder is None:
        raise PatchError("this model is not patched")
    if recorder.irreversible:
        raise PatchError(f"this patch cannot be reverted: {recorder.irreversible}")
    recorder.revert()
    del model._mf_ds_patches
