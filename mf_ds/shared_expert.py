"""A DeepSeek-V4 shared expert of its own width (MindFormers' moe_shared_expert_intermediate_size), which
transformers' class cannot express.

MindFormers builds the shared expert of each MoE layer moe_shared_expert_intermediate_size wide (DeepSeek-V4 Pro:
2048 beside 3072-wide routed experts; pynative/transformers/moe/shared_experts.py). transformers 5.23's
`DeepseekV4SparseMoeBlock` builds `DeepseekV4MLP(config)`, which reads `config.intermediate_size`, and the config's
attribute_map sends that to moe_intermediate_size: one width for both. The translator writes the shared width as the
extra config attribute SHARED_WIDTH (only when it differs; the config keeps and saves it, config.json round-trips it),
and `apply` gives each MoE layer a `DeepseekV4MLP` of that width, built from a copy of the config whose
moe_intermediate_size is the shared width. It runs right after the model is built and before any weight is loaded
(mf_ds/model.py `new_model`: every build of mf-train, `deepspeed mf_ds/train.py`, mf_ds.hf and mf-convert), on the
old module's device and dtype, initialised as transformers initialises a fresh model (the Linear constructors, then
`_init_weights`: normal(initializer_range), zero bias), and inside deepspeed.zero.Init under a partitioned ZeRO-3
build (each new parameter partitioned as it is made, initialised through its gathered copy, as mf_ds/zero.py does
for the rest). The state-dict names stay transformers' (`mlp.shared_experts.{gate,up,down}_proj.weight`); only the
shapes follow the width.

Plain `AutoModelForCausalLM.from_pretrained` of such a checkpoint builds the routed width and refuses the shapes
(tests/mf_ds/test_deepseek4_pro.py); mf-ds' own loading (mf_ds/model.py build_model) reads it.
"""

from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn

from translators.families.deepseek4 import SHARED_WIDTH


def width(config) -> int | None:
    """The shared expert's width where it is not the routed one, else None."""
    value = getattr(config, SHARED_WIDTH, None)
    return value if value and value != getattr(config, "moe_intermediate_size", None) else None


@contextlib.contextmanager
def _dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@torch.no_grad()
def apply(model: nn.Module) -> list[str]:
    """Replace each DeepSeek-V4 MoE layer's shared expert by one of the config's SHARED_WIDTH; [] when the model has
    none to change, else one report line."""
    shared = width(model.config)
    if shared is None or getattr(model.config, "model_type", None) != "deepseek_v4":
        return []
    from transformers.initialization import guard_torch_init_functions
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

    from mf_ds.init import _gathered

    config = copy.copy(model.config)  # a shallow copy: the MLP keeps it as its config
    config.moe_intermediate_size = shared
    blocks = [m for m in model.modules() if isinstance(m, hf.DeepseekV4SparseMoeBlock)]
    for block in blocks:
        old = next(block.shared_experts.parameters())
        # under zero.Init (a partitioned build) the context places and partitions it; else the old module's device
        place = contextlib.nullcontext() if hasattr(old, "ds_id") else torch.device(old.device)
        with place, _dtype(old.dtype):
            mlp = hf.DeepseekV4MLP(config)
        with guard_torch_init_functions():
            for module in mlp.modules():  # children first does not matter: only the Linears hold weights
                with _gathered(list(module.parameters(recurse=False))):
                    model._initialize_weights(module)
        block.shared_experts = mlp
    return [f"mf-ds: shared experts: {len(blocks)} built {shared} wide (routed experts "
            f"{model.config.moe_intermediate_size}), as MindFormers builds them"]
