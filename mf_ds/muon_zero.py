"""Muon under ZeRO-1/2/3 through DeepSpeed's own machinery, with MindFormers' arithmetic in the per-weight update.

DeepSpeed 0.19.8 runs Muon under ZeRO itself when the optimizer is a MuonWithAuxAdam (mf_ds.muon.Muon is one): for
each parameter tagged `use_muon` it gathers the full, data-parallel-averaged gradient (stage_1_and_2.py
get_flat_partition; stage3.py _muon_update_sub_group, round-robin over the ranks, then all-gathered), calls
`original_muon.muon_update(grad, momentum, beta, ns_method=..., is_expert_group=param.is_expert_group,
num_heads=param.muon_num_heads)` (looked up in that module at call time) with the parameter's full momentum, writes
the result into the gradient, and hands the optimizer the flat partition of those results; the optimizer then
applies `p * (1 - lr wd) - lr * update`.

DeepSpeed's muon_update is not MindFormers' (EMA momentum, one coefficient triple, no split, a sqrt(rows / cols)
scale), so `install` points `original_muon.muon_update` at `muon_update` here, which, for a parameter mf-ds tagged
(the tag rides in is_expert_group, the one per-parameter argument ZeRO-1/2 passes, and in muon_num_heads, which
ZeRO-3 passes), runs mf_ds.muon's momentum_step and orthogonal_update: MindFormers' momentum, nesterov, split,
segmented Newton-Schulz and lr * sqrt(max(A, B)) * matched_adamw_rms per piece, reading the group's lr when called
(the scheduler moves it after the step). Muon.step then decays the partition and subtracts the update as
MindFormers does (`param * (1 - lr wd) - x_ret`): the same operations in the same order as at ZeRO stage 0, so the
weights are those of stage 0 (tests/mf_ds/test_muon_zero.py). An untagged parameter (someone else's Muon) gets
DeepSpeed's own update.

What still differs from MindFormers (and from stage 0): DeepSpeed computes the global gradient norm, and clips, after
the Muon update has replaced the gradient, so the norm reported and clipped covers the Muon weights' updates and the
AdamW parameters' gradients, where MindFormers clips the raw gradients before Muon (translators/muon.py's note on
optimizer.type says so). QK-clip scales rows of whole weights: refused under ZeRO 1-3; so is expert parallelism
(DeepSpeed's ZeRO-1/2 want the expert shards in their own groups).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, eq=False)
class ZeroTag:
    """The split rule and optimizer group of one Muon weight; truthy, so DeepSpeed's `is_expert_group` checks pass
    it through."""

    rule: tuple
    group: dict

    def __bool__(self) -> bool:
        return True


_ORIGINAL = None


def muon_update(grad, momentum, beta=0.95, ns_steps=5, nesterov=True, ns_method="gram", is_expert_group=False,
                num_heads=None):
    """original_muon.muon_update's signature; MindFormers' update (lr included) for a tagged parameter."""
    from mf_ds.muon import momentum_step, orthogonal_update

    tag = num_heads if isinstance(num_heads, ZeroTag) else is_expert_group
    if not isinstance(tag, ZeroTag):
        return _ORIGINAL(grad, momentum, beta=beta, ns_steps=ns_steps, nesterov=nesterov, ns_method=ns_method,
                         is_expert_group=is_expert_group, num_heads=num_heads)
    next_m, u = momentum_step(momentum, grad.float(), tag.group)
    momentum.copy_(next_m)
    return orthogonal_update(u, tag.rule, tag.group).to(grad.dtype)


def install(optimizer) -> None:
    """Tag the optimizer's Muon weights and point DeepSpeed's muon_update here (idempotent)."""
    global _ORIGINAL
    from deepspeed.runtime.zero.muon import original_muon

    optimizer.zero_hooked = True
    for group in optimizer.param_groups:
        if not group["muon"]:
            continue
        for param, rule in zip(group["params"], group["rules"], strict=True):
            tag = ZeroTag(tuple(rule), group)
            param.is_expert_group = tag
            param.muon_num_heads = tag
    if original_muon.muon_update is not muon_update:
        _ORIGINAL = original_muon.muon_update
        original_muon.muon_update = muon_update


def uninstall() -> None:
    """Put DeepSpeed's muon_update back (tests)."""
    global _ORIGINAL
    from deepspeed.runtime.zero.muon import original_muon

    if _ORIGINAL is not None:
        original_muon.muon_update = _ORIGINAL
        _ORIGINAL = None

