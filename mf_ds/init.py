"""MindFormers' initial values where transformers' `_init_weights` starts a model that computes something else.

Applied once to a freshly built model (never to loaded weights: mf_ds/model.py build_model).

DeepSeek-V4 (MindFormers 2.1.0, pynative/transformers/moe/router.py and hyper_connection.py reset_parameter):
  hash routers   tid2eid[v, k] = (v + k) mod E: round-robin experts per token id. transformers leaves the table at
                 zeros ("real values come from the checkpoint"), which sends every token to expert 0, k times over.
  mHC            mapping weights ~ N(0, 1e-4); the three gates alpha_pre / alpha_post / alpha_res (HF's `scale`) at
                 mhc_init_gating_factor; the bias pre -log 3, post 0, comb -5 off the diagonal and 0 on it (HF: weights
                 ~ N(0, initializer_range), scale 1, bias 0); the final head's scale and bias 0 (HF: scale 1).
"""

from __future__ import annotations

import contextlib
import math

import torch


def _gathered(params: list[torch.nn.Parameter]):
    """ZeRO-3 partitions: gather them whole, write on rank 0, partition again (DeepSpeed's own context)."""
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=0)
    return contextlib.nullcontext()


@torch.no_grad()
def deepseek_v4(model: torch.nn.Module) -> list[str]:
    """Returns one report line per kind of module initialised."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

    config = model.config
    gating = getattr(config, "mhc_init_gating_factor", None)
    counts = {"hash routers": 0, "mHC": 0, "mHC head": 0}
    for module in model.modules():
        if isinstance(module, hf.DeepseekV4HashRouter):
            vocab, k = module.tid2eid.shape
            ids = torch.arange(vocab, device=module.tid2eid.device)
            module.tid2eid.copy_(torch.stack([(ids + j) % module.num_experts for j in range(k)], dim=1))
            counts["hash routers"] += 1
        elif isinstance(module, hf.DeepseekV4HyperConnection) and gating is not None:
            n = module.hc_mult
            bias = torch.cat([torch.full((n,), -math.log(3)), torch.zeros(n), ((torch.eye(n) - 1) * 5).flatten()])
            with _gathered([module.fn, module.base, module.scale]):
                module.fn.normal_(mean=0.0, std=1e-4)
                module.scale.fill_(gating)
                module.base.copy_(bias.to(module.base.dtype))
            counts["mHC"] += 1
        elif isinstance(module, hf.DeepseekV4HyperHead) and gating is not None:
            with _gathered([module.hc_base, module.hc_scale]):
                module.hc_base.zero_()
                module.hc_scale.zero_()
            counts["mHC head"] += 1
    return [f"mf-ds: init: {n} {what} as MindFormers starts them" for what, n in counts.items() if n]


INITS = {"deepseek_v4": deepseek_v4}


def as_mindformers(model: torch.nn.Module) -> list[str]:
    """MindFormers' initial values for this model type where they differ in kind from transformers' ([] if none)."""
    init = INITS.get(getattr(model.config, "model_type", None))
    return init(model) if init else []
