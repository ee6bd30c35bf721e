"""MindFormers 2.0.0's AdamW update, transcribed line by line in numpy float32 (the reference of
tests/mf_ds/test_optim_state.py).

Source: mindformers/core/optim/adamw.py (2.0.0 wheel; 2.1.0 unchanged)
    :194 construct: `lr = self.get_lr()` (the schedule at global_step before the update, mindspore Optimizer.get_lr),
         :198 `self.assignadd(self.global_step, 1)`, then `_update_run_op(..., step=self.global_step, ...)`
    :38  _update_run_op, per parameter, in fp32:
         :45  next_param = param * (1 - lr * weight_decay)
         :48  exp_avg = exp_avg * beta1 + grad * (1 - beta1)
         :53  exp_avg_sq = addcmul(exp_avg_sq * beta2, grad, grad, 1 - beta2)
         :57  bias_correction1 = 1 - beta1 ** step;  bias_correction2 = 1 - beta2 ** step
         :59  step_size = lr / bias_correction1
         :61  denom = sqrt(exp_avg_sq / bias_correction2) + eps
         :63  return_param = next_param - (exp_avg / denom) * step_size
The PyNative AdamW (pynative/optimizer/adamw.py :30 _run_adamw_opt, :335 forward_opt) computes the same.
"""

from __future__ import annotations

import numpy as np


def adamw_step(param, exp_avg, exp_avg_sq, grad, global_step: int, lr: float, betas, eps: float,
               weight_decay: float):
    """One update from the saved state (global_step = updates so far); returns (param, exp_avg, exp_avg_sq,
    global_step) after it."""
    f32 = np.float32
    beta1, beta2 = f32(betas[0]), f32(betas[1])
    lr, eps, weight_decay = f32(lr), f32(eps), f32(weight_decay)
    step = global_step + 1  # assignadd before the update
    param, grad = param.astype(f32), grad.astype(f32)
    next_param = param * (f32(1) - lr * weight_decay)
    exp_avg = exp_avg * beta1 + grad * (f32(1) - beta1)
    exp_avg_sq = exp_avg_sq * beta2 + grad * grad * (f32(1) - beta2)
    bias_correction1 = f32(1) - beta1 ** f32(step)
    bias_correction2 = f32(1) - beta2 ** f32(step)
    step_size = lr / bias_correction1
    denom = np.sqrt(exp_avg_sq / bias_correction2) + eps
    return next_param - (exp_avg / denom) * step_size, exp_avg, exp_avg_sq, step
