"""The step line a run prints, in the words of the MindFormers trainer its YAML is written for.

Graph mode (MindFormers' Trainer, core/callback/callback.py MFLossMonitor):
    { Epoch:[  1/  2], step:[    5/   20], loss: 6.123456, lr: 1.000000e-04, global_norm: [1.234567], tokens/s: ... }
shortened to what PyTorch knows. The PyNative trainer of 2.x counts steps only (a PyNative YAML has no epochs: it
trains `training.steps`, passing over the data as often as they need), and prints (pynative/callback/
loss_callback.py `_print_log`, 2.1.0):
    { step:[    5/  300], consumed_samples: 40, global_batch_size: 8, loss:   6.123456, per_step_time:    812ms,
      lr: 1.000000e-04, grad_norm:   1.234567 }
"""

from __future__ import annotations

import math

from translators.plan_types import Run


def step_line(run: Run, *, epoch: int, step: int, total: int, loss: float, lr: float, grad_norm: float | None,
              tokens_per_s: float, extra: str = "") -> str:
    """The line; `extra` (", data: 0.0012 s, eval_loss: ...") goes before the closing brace."""
    if run.log_line == "pynative":
        tokens = run.global_batch_size * (run.seq_length or 0)
        step_ms = round(1000 * tokens / tokens_per_s) if tokens_per_s else 0
        norm = "grad_norm: NaN" if grad_norm is None or not math.isfinite(grad_norm) else \
            f"grad_norm: {grad_norm:10.6f}"
        parts = [f"step:[{step:5d}/{total:5d}]", f"consumed_samples: {step * run.global_batch_size}",
                 f"global_batch_size: {run.global_batch_size}", f"loss: {loss:10.6f}",
                 f"per_step_time: {step_ms:6d}ms", f"lr: {lr:10.6e}", norm]
        return "{ " + ", ".join(parts) + extra + " }"
    return (f"{{ Epoch:[{epoch:3d}/{run.epochs:3d}], step:[{step:5d}/{total:5d}], loss: {loss:.6f}, lr: {lr:.6e}, "
            f"global_norm: [{grad_norm or 0:.6f}], tokens/s: {tokens_per_s:.1f}{extra} }}")
