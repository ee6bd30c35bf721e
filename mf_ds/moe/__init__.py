"""The mf-ds MoE layer: router, capacity and drop rules, grouped-matmul experts, expert parallelism, callbacks.

    report = mf_ds.patch.apply(model, plan)           # HF sparse blocks -> MFMoE (mf_ds/patch/moe.py)
    loss = out.loss + (mf_ds.moe.aux_loss(model) or 0) # per forward: the plan's aux + z losses (training)
    engine.backward(loss); engine.step()
    metrics = mf_ds.moe.step_metrics(model)           # per step: {layer: drop_rate, drop_rate_estimate, expert_load}
    lines = mf_ds.moe.drop_rate_lines(metrics)        # MindFormers' "layer: {i}, drop_rate: {r:.5f}" (its estimate,
                                                      # where it has one), then "layer: {i}, measured_drop_rate: ..."
    mf_ds.moe.update_topk_bias(model, plan)           # per step: TopkBiasBalanceCallback (no-op unless listed)

`step_metrics` and `update_topk_bias` are collectives (every rank calls them). `step_metrics` also ends the step for
mcore's gbs_aux_loss (its running f starts again): call it once per optimizer step. Under expert parallelism, HF-format
weights come from `mf_ds.moe.parallel.gather_full_state_dict(model)` (collective).
"""

from mf_ds.moe.callbacks import (
    MoEDropRateCallback,
    TopkBiasBalanceCallback,
    drop_rate_lines,
    step_metrics,
    trainer_callbacks,
    update_topk_bias,
)
from mf_ds.moe.layer import MFExperts, MFMoE, aux_loss, moe_layers
from mf_ds.moe.router import MFRouter, Routing, route

__all__ = ["MFExperts", "MFMoE", "MFRouter", "MoEDropRateCallback", "Routing",
           "TopkBiasBalanceCallback", "aux_loss", "drop_rate_lines", "moe_layers", "route",
           "step_metrics", "trainer_callbacks", "update_topk_bias"]
