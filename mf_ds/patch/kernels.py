"""Fused RoPE and SwiGLU (mf_ds/ops/rope.py, mf_ds/ops/swiglu.py) injected per model type: ROPE_PATCHES, SWIGLU_PATCHES.

RoPE. HF attention modules call a function of their modeling module (`query_states, key_states =
apply_rotary_pos_emb(query_states, key_states, cos, sin)` in LlamaAttention.forward, transformers 5.23). That module
global is the only hook: `use_kernelized_func` on the attention classes needs the `kernels` package and hub kernels.
So the patch rebinds that one attribute (recorded, so `revert` puts the original back) to an adapter with the same
signature, which raises on anything it cannot do exactly (extra arguments, tables that need grad, odd shapes). The
rebinding holds for every model of that family in the process until revert. Before rebinding, a probe runs the
original and the adapter on small random tensors: a transformers release whose function computes something else
raises PatchError rather than changing the numbers.

SwiGLU. Every dense SwiGLU MLP (LlamaMLP's `down_proj(act_fn(gate_proj(x)) * up_proj(x))` and its copies; GlmMLP's
`gate_up_proj` halves) gets an instance forward: the same modules in the same order (state-dict keys and module hooks,
ZeRO-3's included, unchanged), with `act_fn(gate) * up` replaced by `mf_ds.ops.swiglu`. In training the product is
not kept either: `down_proj(swiglu(gate, up))` runs under torch's non-reentrant checkpoint, whose early stop rebuilds
the product in backward and ends before down_proj's matmul. What is kept is gate and up (2 T I fewer elements than
HF's MLP: silu(gate) and the product). That is MindFormers' select_recompute of `feed_forward.w1.activation.silu` +
`feed_forward.mul`, the same mechanism as mf_ds.patch.recompute's SwiGLU region. MoE experts' SwiGLU is the MoE layer's
(mf_ds/moe/layer.py calls mf_ds.ops.swiglu.fused_swiglu_packed); here it is a report line. So a model whose every
MLP is an MoE block (Mixtral, Qwen3-MoE without mlp_only_layers) has no MLP for this patch and a report that says
where the SwiGLU is fused: MindFormers too fuses it inside the experts there (use_fused_swiglu reaches the MoE
FFN); that is a note, not an error.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from mf_ds import families
from mf_ds.ops.swiglu import fused_swiglu, fused_swiglu_packed
from mf_ds.patch import PatchError, PatchFn
from mf_ds.patch.core import Recorder, is_silu, swiglu_graph
from translators.families import registry
from translators.families.record import PatchTargets
from translators.plan_types import Plan

# --- the families (their records' patch targets, translators/families/record.py) -----------------------------------
# Each family's RoPE adapters live in its runtime module (mf_ds/families/<hooks>.py): its ROPES maps the record's
# PatchTargets.rope to model -> (the function's name in the modeling module, its adapter), and its optional
# rope_probe(adapter) -> (rotated columns of the probe's 8-wide head, one complex table) shapes the probe.
FAMILIES: dict[str, PatchTargets] = {t: r for t, r in registry.runtimes().items() if not r.not_applicable}
# known families where a kernel has nothing to replace: a report line, not an error
NOT_APPLICABLE = {t: r.not_applicable for t, r in registry.runtimes().items() if r.not_applicable}


# --- RoPE -------------------------------------------------------------------------------------------------------------

def _probe(model_type: str, where: str, original: Callable, adapter: Callable) -> None:
    """The adapter against the function it replaces, on small random fp32 CPU tensors with HF-shaped tables."""
    gen = torch.Generator().manual_seed(0)
    shape = families.hook(model_type, "rope_probe")
    rot, complex_table = shape(adapter) if shape is not None else (8, False)  # the family's (GLM: part of the head)
    head_dim = 8
    q, k = torch.randn(2, 3, 5, head_dim, generator=gen), torch.randn(2, 1, 5, head_dim, generator=gen)
    angles = torch.rand(2, 5, rot // 2, generator=gen) * 6
    if complex_table:
        args = (torch.polar(torch.ones_like(angles), angles),)
    else:
        angles = torch.cat((angles, angles), dim=-1)
        args = (angles.cos(), angles.sin())
    with torch.no_grad():
        expected, got = original(q, k, *args), adapter(q, k, *args)
    if not all(torch.allclose(g, e, atol=1e-5, rtol=1e-5) for g, e in zip(got, expected, strict=True)):
        raise PatchError(f"fused_rope: {where} in this transformers version does not compute what "
                         f"{adapter.__name__} does; not patched")


def _patch_rope(model_type: str, model: nn.Module, plan: Plan, recorder: Recorder) -> list[str]:
    family = FAMILIES[model_type]
    modeling = importlib.import_module(family.module)
    name, adapter = families.hook(model_type, "ROPES")[family.rope](model)
    original = getattr(modeling, name, None)
    if original is None:
        raise PatchError(f"fused_rope: {family.module} has no {name} in this transformers version")
    if original is adapter:
        return [f"{family.module}.{name}: already {adapter.__name__} (another patched {model_type} model)"]
    _probe(model_type, f"{family.module}.{name}", original, adapter)
    recorder.set(modeling, name, adapter)
    return [f"{family.module}.{name} -> {adapter.__module__}.{adapter.__name__} (mf_ds.ops.rope; every {model_type} "
            "model in this process until revert)"]


# --- SwiGLU -----------------------------------------------------------------------------------------------------------

@dataclass
class FusedSwiGLUForward:
    """Instance forward of a SwiGLU MLP with the fused SwiGLU (an object, so deepcopy rebinds it to the copy)."""

    mlp: nn.Module
    packed: bool  # GlmMLP: gate and up are the halves of gate_up_proj's output

    def __call__(self, *args, **kwargs):
        (x,) = (*args, *kwargs.values())  # HF calls mlp(hidden_states); LlamaMLP names it x, GlmMLP hidden_states
        mlp = self.mlp
        inputs = (mlp.gate_up_proj(x),) if self.packed else (mlp.gate_proj(x), mlp.up_proj(x))
        if mlp.training and torch.is_grad_enabled():
            # keeps gate and up only; no random op here, so no RNG state to stash
            return checkpoint(self._product_down, *inputs, use_reentrant=False, preserve_rng_state=False)
        return self._product_down(*inputs)

    def _product_down(self, *inputs: torch.Tensor) -> torch.Tensor:
        product = fused_swiglu_packed(*inputs) if self.packed else fused_swiglu(*inputs)
        return self.mlp.down_proj(product)


def _swiglu_mlp(module: nn.Module) -> tuple[bool, str | None]:
    """(packed, why not) for a dense MLP class of the table: None when it is a SiLU-gated MLP this patch can fuse."""
    graph = swiglu_graph(module)
    if graph is None:
        return False, f"{type(module).__name__} has neither gate_proj/up_proj/act_fn nor gate_up_proj/activation_fn"
    packed = any(op.kind == "view" for op in graph)  # gate and up are the halves of one projection
    act = module._modules[next(op.name for op in graph if op.kind == "act")]
    if not is_silu(act):
        return packed, f"its activation is {type(act).__name__}, not SiLU (hidden_act), so it is no SwiGLU"
    return packed, None


def _patch_swiglu(model_type: str, model: nn.Module, plan: Plan, recorder: Recorder) -> list[str]:
    from mf_ds.moe.layer import MFExperts

    family = FAMILIES[model_type]
    report, experts, fused, unfused = [], [], [], []
    for name, module in model.named_modules():
        kind = type(module).__name__
        if kind == family.experts:
            experts.append(name)
        if isinstance(module, MFExperts):  # the mf-ds MoE layer (mf_ds.patch.moe runs first)
            (fused if module.act_fn is None else unfused).append((name, module))
        if kind not in family.mlps:
            continue
        if "forward" in module.__dict__:  # recompute.py's regions wrap this forward, never the other way round
            raise PatchError(f"fused_swiglu: {name} already has an instance forward (apply mf_ds.patch before "
                             "mf_ds.patch.recompute)")
        packed, why = _swiglu_mlp(module)
        if why is not None:
            report.append(f"{name}: {kind} not fused: {why}")
            continue
        recorder.set(module, "forward", FusedSwiGLUForward(module, packed))
        op = "fused_swiglu_packed" if packed else "fused_swiglu"
        report.append(f"{name}: {kind}.forward -> fused SwiGLU (mf_ds.ops.swiglu.{op}; keeps gate and up, silu and "
                      "the product recomputed in backward)")
    if experts:
        report.append(f"{len(experts)} {family.experts} ({experts[0]}, ...): not fused by this patch: the experts' "
                      "SwiGLU is fused by the mf-ds MoE layer (plan.moe) where it replaces them")
    if fused:
        report.append(f"{len(fused)} MFExperts ({fused[0][0]}, ...): nothing to replace: the experts' SwiGLU already "
                      "runs fused inside the mf-ds MoE layer (mf_ds.ops.swiglu.fused_swiglu_packed), where "
                      "MindFormers fuses it too")
    if unfused:
        act = type(unfused[0][1].act_fn).__name__
        report.append(f"{len(unfused)} MFExperts ({unfused[0][0]}, ...): not fused: the experts' activation is {act}, "
                      "not SiLU (hidden_act), so it is no SwiGLU")
    return report


def _not_applicable(feature: str, model_type: str, model, plan, recorder) -> list[str]:
    return [f"{feature}: not applicable to {model_type}: {NOT_APPLICABLE[model_type][feature]}; nothing replaced"]


ROPE_PATCHES: dict[str, PatchFn] = {t: functools.partial(_patch_rope, t) for t in FAMILIES}
SWIGLU_PATCHES: dict[str, PatchFn] = {t: functools.partial(_patch_swiglu, t) for t in FAMILIES}
for _type in NOT_APPLICABLE:
    ROPE_PATCHES[_type] = functools.partial(_not_applicable, "fused_rope", _type)
    SWIGLU_PATCHES[_type] = functools.partial(_not_applicable, "fused_swiglu", _type)
