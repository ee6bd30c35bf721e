"""DeepSeek-V4's runtime code (translators/families/deepseek4.py names it: RUNTIME.hooks): MindFormers' initial values,
a shared expert of its own width, and the MindFormers names and cuts Muon reads.

Initial values (`init`; MindFormers 2.1.0, pynative/transformers/moe/router.py and hyper_connection.py
reset_parameter):
  hash routers   tid2eid[v, k] = (v + k) mod E: round-robin experts per token id. transformers leaves the table at
                 zeros ("real values come from the checkpoint"), which sends every token to expert 0, k times over.
  mHC            mapping weights ~ N(0, 1e-4); the three gates alpha_pre / alpha_post / alpha_res (HF's `scale`) at
                 mhc_init_gating_factor; the bias pre -log 3, post 0, comb -5 off the diagonal and 0 on it (HF: weights
                 ~ N(0, initializer_range), scale 1, bias 0); the final head's scale and bias 0 (HF: scale 1).

A shared expert of its own width (`shared_experts`, `shared_width`: MindFormers'
moe_shared_expert_intermediate_size, which transformers' class cannot express). MindFormers builds the shared expert
of each MoE layer moe_shared_expert_intermediate_size wide (DeepSeek-V4 Pro: 2048 beside 3072-wide routed experts;
pynative/transformers/moe/shared_experts.py). transformers 5.23's `DeepseekV4SparseMoeBlock` builds
`DeepseekV4MLP(config)`, which reads `config.intermediate_size`, and the config's attribute_map sends that to
moe_intermediate_size: one width for both. The translator writes the shared width as the extra config attribute
SHARED_WIDTH (only when it differs; the config keeps and saves it, config.json round-trips it), and `shared_experts`
gives each MoE layer a `DeepseekV4MLP` of that width, built from a copy of the config whose moe_intermediate_size is
the shared width. It runs right after the model is built and before any weight is loaded (mf_ds/model.py
`new_model`: every build of mf-train, `deepspeed mf_ds/train.py`, mf_ds.hf and mf-convert), on the old module's
device and dtype, initialised as transformers initialises a fresh model (the Linear constructors, then
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
import math

import torch
from torch import nn

from mf_ds.init import _gathered
from translators.families.deepseek4 import SHARED_WIDTH
from translators.mtp import from_decoder
from translators.names import hf_to_mf


@torch.no_grad()
def init(model: torch.nn.Module) -> list[str]:
    """MindFormers' initial values of the hash routers and mHC (module docstring); one report line per kind of
    module initialised."""
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


def shared_width(config) -> int | None:
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
def shared_experts(model: nn.Module) -> list[str]:
    """Replace each DeepSeek-V4 MoE layer's shared expert by one of the config's SHARED_WIDTH; [] when the model has
    none to change, else one report line."""
    shared = shared_width(model.config)
    if shared is None:
        return []
    from transformers.initialization import guard_torch_init_functions
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

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


# HF DeepSeek-V4 names the weight table does not rename (its stacked experts and fused shared fc1 are converted
# by kind, translators/families/deepseek4.py DEEPSEEK4_EXPERTS / DEEPSEEK4_FUSED): HF name part -> MindFormers name part
_V4_STACKED = ((".mlp.experts.gate_up_proj", ".mlp.experts.weight1"),
               (".mlp.experts.down_proj", ".mlp.experts.weight2"),
               (".mlp.shared_experts.gate_proj.", ".mlp.shared_experts.linear_fc1."),
               (".mlp.shared_experts.up_proj.", ".mlp.shared_experts.linear_fc1."))


def mindformers_name(name: str, num_layers: int | None = None) -> str:
    """PyNativeDeepseekV4ForCausalLM's name of an HF parameter (`model.decoder...`, as MindSpore names them; given
    num_layers, the MTP block's as `model.mtp.layers.k...`: mf_ds/mtp_v4.py), as Muon's adamw_include globs see it
    (mf_ds/muon.py mindformers_name)."""
    for hf, mf in _V4_STACKED:
        name = name.replace(hf, mf)
    mf = hf_to_mf(name, "deepseek_v4/mcore")
    return "model." + (mf if num_layers is None else from_decoder(mf, "deepseek_v4/mcore", num_layers))


def muon_split_rule(name: str) -> tuple:
    """How MindFormers cuts this parameter before Newton-Schulz: the schema's experts.weight1 rule only (mf_ds/muon.py
    split_rule's docstring)."""
    return ("halves",) if name.endswith("experts.gate_up_proj") else ("whole",)
