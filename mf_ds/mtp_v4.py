"""DeepSeek-V4's multi-token prediction beside transformers' DeepseekV4ForCausalLM (Plan.mtp.variant "v4"), as
MindFormers 2.1.0's PyNative model computes it (translators/mtp.py says which YAMLs get it; mf_ds/mtp.py the loss).

Source: the 2.1.0 wheel, mindformers/pynative/ (lines as there):
  base_models/gpt/gpt_model.py 373-402: the MTP block gets the decoder's output, which TransformerBlock has collapsed
      with its learnable hc_head and put through final_layernorm (transformer/transformer_block.py 378-388): `h` is
      one stream, after the hc head and the final norm (here: DeepseekV4Model's `self.norm(self.hc_head(h))`).
  transformers/multi_token_prediction.py MultiTokenPredictionLayer.construct 387-435, per depth:
      ids = roll(ids, -1) (zero padded); emb = embedding(ids)                              (_get_embeddings 459-472)
      x = eh_proj(concat((enorm(emb), hnorm(h)), -1))                                      (embedding first)
      x = expand_hyper_connection_streams(x, n, H)        (transformer_block.py 39-48: the same x in every stream)
      x = transformer_layer(x, same mask, same rope)      (layer_number num_layers + i, is_mtp_layer)
      h = final_layernorm(hc_head(x))                     (its own HyperConnectionHead; the next depth takes this h)
  base_models/gpt/gpt_layer_specs.py 234-265 get_gpt_mtp_block_spec: the layer is the last decoder layer's spec and
      `hc_head` the decoder's HyperConnectionHead spec (a new instance per MTP layer, with its own weights).
  The layer's attention kind is csa_compress_ratios[num_layers + i] (experimental_attention_variant/
  deepseek_v4_hybrid_attention.py 70-71); its router is never hash-based (moe/router.py 92-102: `not is_mtp_layer`).
The loss is the PyNative variant's (mf_ds/mtp.py MtpLoss, process_mtp_loss 634-697): the gradient of
mtp_loss_scaling_factor / depth x each depth's masked CE joins the main loss's; the logged loss is the main loss;
each depth's CE is logged beside it.

Modules: depth k's block is `model.layers.{num_hidden_layers + k - 1}` (DeepSeek's HF layout of DeepSeek-V3's MTP,
which mf_ds/mtp.py uses too): transformers' DeepseekV4DecoderLayer built for the MTP layer's attention kind and a
top-k router, plus `enorm`, `hnorm`, `eh_proj`, `hc_head` (a DeepseekV4HyperHead) and `shared_head.norm`.
transformers' DeepseekV4Model.forward runs `for layer in self.layers` (every entry, unlike DeepSeek-V3's
`layers[:num_hidden_layers]`), so the list is made a _MainLayers, whose iteration stops at the decoder layers; its
state dict, modules and indexing keep every entry. Embedding and head are the main model's (shared, not copied).
MindFormers' names (model.mtp.layers.k.{enorm, hnorm, eh_proj, final_layernorm, hc_head, transformer_layer.*}) map
through the family's table (translators/mtp.py MCORE_PARTS); DeepSeek's release names (`mtp.k.*`, e_proj and h_proj
apart) load too (release_slot). The layer's top-k MoE block is in the Plan's MoE layers (translators/families/
deepseek4.py plan_moe): mf-ds' MoE layer replaces it and moves its expert bias, as MindFormers does (moe_layer.py 71).
"""

from __future__ import annotations

import copy
import re

import torch
from torch import nn

from mf_ds.families.deepseek4 import shared_width
from mf_ds.loss import IGNORE_INDEX
from translators.families.deepseek4 import MTP_LAYER_TYPES


class _MainLayers(nn.ModuleList):
    """model.model.layers with the MTP blocks after the decoder layers: iterating yields the first `main` only."""

    main: int | None = None

    def __iter__(self):
        layers = list(self._modules.values())
        return iter(layers if self.main is None else layers[: self.main])


def blocks(config, layer_class, n: int, depth: int) -> list[nn.Module]:
    """The MTP blocks, fp32, uninitialised: a decoder layer of the MTP layer's attention kind with a top-k router,
    and the MTP parts."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

    kinds = getattr(config, MTP_LAYER_TYPES, None)
    if not kinds or len(kinds) < depth:
        from mf_ds.errors import RunError

        raise RunError(f"DeepSeek-V4 MTP: the HF config's {MTP_LAYER_TYPES} names {kinds!r}, not {depth} attention "
                       "kind(s) (the compress_ratios entries after the decoder layers')")
    own = copy.copy(config)  # a shallow copy: the layer keeps it; the lists are new
    own.layer_types = list(config.layer_types[:n]) + list(kinds[:depth])
    own.mlp_layer_types = list(config.mlp_layer_types[:n]) + ["moe"] * depth  # MTP layers never hash-route
    width = shared_width(config)
    narrow = copy.copy(config)
    if width is not None:
        narrow.moe_intermediate_size = width
    out = []
    for k in range(depth):
        block = layer_class(own, n + k)
        if width is not None:  # a shared expert of its own width, as mf_ds/families/deepseek4.py builds the others'
            block.mlp.shared_experts = hf.DeepseekV4MLP(narrow)
        block.enorm = hf.DeepseekV4RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        block.hnorm = hf.DeepseekV4RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        block.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        block.hc_head = hf.DeepseekV4HyperHead(config)
        block.shared_head = nn.Module()
        block.shared_head.norm = hf.DeepseekV4RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        out.append(block)
    return out


def guard(layers: nn.ModuleList, n: int) -> None:
    """Make transformers' forward run only the first n layers of `layers` (_MainLayers)."""
    layers.__class__ = _MainLayers
    layers.main = n


# DeepSeek's release names of the MTP layer (`mtp.{k}.*`; transformers' DeepseekV4 defines none and ignores them on
# load), as MindFormers 2.1.0 reads them (models/deepseek4/utils.py weight_mapping 80-90, MTP converters 254-345):
# norm -> final_layernorm, hc_head_{fn,base,scale} -> hc_head, e_proj and h_proj concatenated (dim 1, embedding first)
# into eh_proj, the rest a decoder layer under DeepSeek's names (the family's saved-name table has read those).
_RELEASE = re.compile(r"^mtp\.(\d+)\.")
_RELEASE_PARTS = (("norm.", "shared_head.norm."), ("hc_head_fn", "hc_head.hc_fn"), ("hc_head_base", "hc_head.hc_base"),
                  ("hc_head_scale", "hc_head.hc_scale"))


def release_slot(name: str, state: dict, num_layers: int) -> tuple[str, tuple] | None:
    """Where DeepSeek's release tensor `name` (after names.hf_module_name) lies in the MTP block: (parameter, index)
    as weights.model_slot gives it; None for any other name."""
    from mf_ds.weights import model_slot

    m = _RELEASE.match(name)
    if not m:
        return None
    block, rest = f"model.layers.{num_layers + int(m.group(1))}.", name[m.end():]
    for proj, half in (("e_proj.weight", 0), ("h_proj.weight", 1)):
        if rest == proj and block + "eh_proj.weight" in state:
            width = state[block + "eh_proj.weight"].shape[1] // 2
            return block + "eh_proj.weight", (slice(None), slice(half * width, (half + 1) * width))
    for saved, module in _RELEASE_PARTS:
        if rest.startswith(saved):
            rest = module + rest[len(saved):]
            break
    return model_slot(block + rest, state)


def _shift(x: torch.Tensor, k: int, fill: int) -> torch.Tensor:
    """roll_tensor(x, -1, -1) applied k times: x[:, k:] then k columns of `fill`."""
    return torch.cat([x[:, k:], x.new_full((x.shape[0], k), fill)], dim=1)


def depths(blocks, embed: nn.Module, head: nn.Module, h: torch.Tensor, kwargs: dict, hc_mult: int,
           input_ids: torch.Tensor, labels: torch.Tensor, ce) -> list[torch.Tensor]:
    """Each depth's masked CE (fp32). `h`: the main model's output after its hc_head and final norm; `kwargs`: the
    decoder layers' mask and RoPE keywords; `ce(h_NH, head, target)`: the fp32 CE sum over the kept targets."""
    out = []
    for k, block in enumerate(blocks, 1):
        emb = embed(_shift(input_ids, k, 0))
        x = block.eh_proj(torch.cat([block.enorm(emb), block.hnorm(h)], dim=-1))
        streams = x.unsqueeze(2).expand(-1, -1, hc_mult, -1).contiguous()  # [B, S, n, H], as HF's decoder input
        streams = block(streams, **kwargs)
        streams = streams[0] if isinstance(streams, tuple) else streams
        h = block.shared_head.norm(block.hc_head(streams))  # the next depth's h (final_layernorm's output)
        target = _shift(labels, k, IGNORE_INDEX).flatten()
        out.append(ce(h.flatten(0, 1), head, target) / ((target != IGNORE_INDEX).sum() + 1e-8))
    return out
