"""Refusals that depend only on the Plan and this machine, made before anything slow starts.

A run that cannot train should say so before the model is built (4 s for a tiny model, 98 s for a large one were
measured before the refusal came): fp16 asks for DeepSpeed's fp16 optimizer, which the CPU accelerator does not have.
The data set is built before the model too (mf_ds/model.py prepare), so a missing or unreadable data path is refused
first as well.
"""

from __future__ import annotations

import torch

from mf_ds.errors import RunError
from translators.plan_types import Plan


def refuse(plan: Plan) -> None:
    """Raise RunError (one line, naming the key) for a Plan this machine cannot train."""
    if plan.run.compute_dtype == "float16" and not torch.cuda.is_available():
        raise RunError("model_config.compute_dtype float16 needs a GPU: DeepSpeed's CPU accelerator has no "
                       "fp16; train here with --set model.model_config.compute_dtype=bfloat16 (or float32)")
