"""MindFormers' initial values where transformers' `_init_weights` starts a model that computes something else.

Applied once to a freshly built model (never to loaded weights: mf_ds/model.py build_model). The values are the
family's (its `init` hook, mf_ds/families/<family>.py: DeepSeek-V4's hash routers and mHC); here the dispatch and the
ZeRO-3 gathering they share.
"""

from __future__ import annotations

import contextlib

import torch

from mf_ds import families


def _gathered(params: list[torch.nn.Parameter]):
    """ZeRO-3 partitions: gather them whole, write on rank 0, partition again (DeepSpeed's own context)."""
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=0)
    return contextlib.nullcontext()


def as_mindformers(model: torch.nn.Module) -> list[str]:
    """MindFormers' initial values for this model type where they differ in kind from transformers' ([] if none):
    the family's `init` hook (mf_ds/families/<family>.py)."""
    init = families.hook(getattr(model.config, "model_type", None), "init")
    return init(model) if init else []
