"""`deepspeed bench/gpu_train_reference.py --mf-config x.yaml ...`: mf_ds/train.py's run with the HF model left as
transformers builds it (no mf-ds MoE layer, no fused kernels): the reference bench/gpu_suite.py compares the fused
run's losses with. Everything else (data, optimizer, LR formula, DeepSpeed config, seed) is the same run.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mf_ds import patch  # noqa: E402
from mf_ds.train import main  # noqa: E402


def _unpatched(model, plan):
    return [f"reference run: {type(model).__name__} unpatched (transformers' own MoE blocks, RoPE and MLPs)"]


if __name__ == "__main__":
    patch.apply = _unpatched  # the loop calls mf_ds.patch.apply(model, plan) before deepspeed.initialize
    sys.exit(main(prog="bench/gpu_train_reference.py"))
