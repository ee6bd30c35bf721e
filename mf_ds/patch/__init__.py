"""The patch room: `apply(model, plan)` changes an HF model as the Plan asks, in the one order that works.

    report = mf_ds.patch.apply(model, plan)    # ["model.layers.3.mlp: Qwen3MoeSparseMoeBlock -> MFMoE", ...]
    mf_ds.patch.revert(model)                  # every original back (tests)

The order is fixed here, so no caller has to know it: `moe.py` (the mf-ds MoE layer, `plan.moe`) first, since it
replaces modules the others then touch; `kernels.py` (fused RoPE and SwiGLU, `plan.kernels`), then `recompute.py`
(`plan.layers`), whose checkpoint regions wrap the forwards the first two installed, then `compile.py`
(`run.compile_layers`: torch.compile on each decoder layer, patched as it is). One table per feature,
`{model_type: patch function}`, drives one generic patcher; a patch function takes `(model, plan, recorder)` and
returns its report lines. Nothing is patched at import. The model's own code is reached only here; the other
places that know transformers' internals are the model build (`mf_ds/model.py`, `mf_ds/zero.py`: construction and
loading) and the parallel wrappers (`mf_ds/parallel.py`, `mf_ds/moe/parallel.py`: AutoTP and Ulysses hooks).
A requested feature on a model type its table does not know, or a patch that matched nothing, raises `PatchError`;
a feature that does not apply to this model (fused SwiGLU on GPT-2's GELU MLP) is a report line saying why.
State-dict keys never change, so a patched model saves and loads as the HF model it is. Patches go on before
`deepspeed.initialize`, since ZeRO-3 partitions the parameters that exist then.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mf_ds.patch.core import Recorder
from translators.plan_types import Plan

PatchFn = Callable[[torch.nn.Module, Plan, Recorder], list[str]]


class PatchError(RuntimeError):
    """A patch the Plan asks for that cannot be applied to this model."""


def _features(plan: Plan) -> list[tuple[str, dict[str, PatchFn]]]:
    """(feature, table) for every feature the Plan turns on, in the order they are applied."""
    from mf_ds.patch import kernels, moe

    wanted = []
    if plan.moe is not None:
        wanted.append(("moe", moe.PATCHES))
    if plan.kernels.fused_rope:
        wanted.append(("fused_rope", kernels.ROPE_PATCHES))
    if plan.kernels.fused_swiglu:
        wanted.append(("fused_swiglu", kernels.SWIGLU_PATCHES))
    return wanted


def apply(model: torch.nn.Module, plan: Plan, checkpoint_fn: Callable | None = None) -> list[str]:
    """Patch `model` as `plan` asks (MoE, kernels, then recompute); returns the report, recompute lines prefixed
    `recompute: `. `checkpoint_fn` checkpoints the fully recomputed layers (torch's non-reentrant checkpoint by
    default). Raises PatchError (ValueError for a recompute plan the model cannot take), leaving it unpatched."""
    from mf_ds.patch.recompute import patch_layers

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
        if plan.layers:
            report += [f"recompute: {line}" for line in patch_layers(model, plan.layers, recorder, checkpoint_fn)]
        if plan.run.compile_layers:  # last: the compiled code is the patched layer
            from mf_ds.patch.compile import compile_layers

            report += compile_layers(model, plan, recorder)
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
