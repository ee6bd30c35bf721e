"""`deepspeed bench/gpu_train_reference.py --mf-config x.yaml ...`: mf_ds/train.py's run with the HF model left as
transformers builds it (no mf-ds MoE layer, no fused kernels): the reference bench/gpu_suite.py compares the fused
run's losses with. Everything else (data, optimizer, LR formula, DeepSpeed config, seed) is the same run.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mf_ds import patch  # noqa: E402
from mf_ds.train import main  # noqa: E402
from translators.plan_types import Kernels  # noqa: E402

_apply = patch.apply


def _unpatched(model, plan, checkpoint_fn=None):
    """mf_ds.patch.apply with the MoE layer and the fused kernels off: the recompute plan still applies."""
    plain = dataclasses.replace(plan, moe=None, kernels=Kernels())
    return [f"reference run: {type(model).__name__} unpatched (transformers' own MoE blocks, RoPE and MLPs)"] + \
        _apply(model, plain, checkpoint_fn=checkpoint_fn)


if __name__ == "__main__":
    patch.apply = _unpatched  # mf_ds.model.prepare calls mf_ds.patch.apply(model, plan) before deepspeed.initialize
    sys.exit(main(prog="bench/gpu_train_reference.py"))
