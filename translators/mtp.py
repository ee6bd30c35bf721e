"""DeepSeek's multi-token prediction (MTP) in the Plan: which MindFormers variant a YAML's `mtp_depth` asks for.

Variants (issue 30 part 5), built by mf_ds/mtp.py:
- research: research/deepseek3 of MindFormers 1.5-1.7 (TrainingDeepseekV3ForCausalLM, deepseek2_model.py
  MTPHiddenFuser): legacy DeepSeek-V3 YAMLs (use_legacy unset or True). loss = main + aux
  + mtp_loss_factor / mtp_depth x sum_k masked CE_k, logged as one number by MFLossMonitor.
- mcore: the graph-mode GPTModel of 1.7.0-2.1.0 (use_legacy: False; parallel_core/training_graph/transformer/
  multi_token_prediction.py, the same math in every one of those versions): embedding first in the concat, the
  hidden state after the final norm, a norm of its own per depth; wrapper.py grads_for_mcore logs
  loss = lm + aux + mtp and mtp_loss (= mtp_loss_factor / depth x CE) beside it. transformer_config.py refuses
  mtp_num_layers > 1 ("The current version only supports ... `mtp_num_layers` = `1`"), so mf-ds does too.
- pynative: 2.x's PyNative GPTModel (the PyNative schema's DeepSeek-V3: mindformers/pynative/transformers/
  multi_token_prediction.py of 2.1.0): the mcore layers and CE, but process_mtp_loss only injects the gradient of
  mtp_loss_scaling_factor / depth x CE_k through _MTPLossAutoScaler (forward: the identity; backward: the main
  loss's scale), so the logged loss is the main loss alone; loss_callback.py logs each depth's unscaled CE
  (mtp_1_loss, summed over micro batches / their count).
- v4: DeepSeek-V4's PyNative model (2.1.0 models/deepseek4, the same multi_token_prediction.py with its mHC branch,
  built by mf_ds/mtp_v4.py): the pynative layer and gradient-only loss, with the projected input expanded into the
  hc_mult residual streams before the decoder layer and collapsed by the layer's own learnable hc_head before its
  final_layernorm; the main model's h is after its hc_head and final norm. One MTP layer at most (the same check).
"""

from __future__ import annotations

import re
from typing import Any

from translators.errors import ConfigError
from translators.notes import Ledger

SOURCES = {"research": "research/deepseek3", "mcore": "mcore multi_token_prediction.py",
           "pynative": "the PyNative multi_token_prediction.py",
           "v4": "the PyNative multi_token_prediction.py with mHC streams (DeepSeek-V4)"}
GRADIENT_ONLY = ("pynative", "v4")  # process_mtp_loss's _MTPLossAutoScaler: the term's gradient, not its value


def variant(family: Any, pynative: bool = False) -> str | None:
    """The MTP variant mf-ds builds for this family (`pynative`: a PyNative-schema YAML), None where it builds none."""
    if family.name == "deepseek_v4":
        return "v4"  # a PyNative-only model (PyNativeDeepseekV4ForCausalLM)
    if family.name != "deepseek_v3":
        return None
    return "pynative" if pynative else "mcore" if family.mcore else "research"


def _graph_mode(ledger: Any) -> bool:
    """Graph mode's keys sit at `model.model_config.*`; the PyNative schema's ledger view (translators/pynative.py)
    renames them to its flat `model.*`."""
    path = getattr(ledger, "path", None)
    return path is None or path("model.model_config.mtp_depth").startswith("model.model_config.")


def account(family: Any, shape: Any, paths: dict[str, str], ledger: Ledger) -> None:
    """Notes model_config.mtp_depth / mtp_loss_factor (`paths`: name -> YAML path, the keys the YAML spells)."""
    kind = variant(family, pynative=not _graph_mode(ledger))
    if kind in ("mcore", *GRADIENT_ONLY) and shape.mtp_depth > 1:
        raise ConfigError(paths.get("mtp_depth", "model.model_config.mtp_depth"),
                          f"{shape.mtp_depth}: MindFormers' mcore GPTModel builds at most 1 MTP layer "
                          "(transformer_config.py refuses mtp_num_layers > 1)")
    built = kind is not None
    source = SOURCES.get(kind)
    if "mtp_depth" in paths and built:
        if shape.mtp_depth:
            ledger.runtime(paths["mtp_depth"], f"{shape.mtp_depth} MTP layer(s) of {source} "
                           "(plan.mtp.depth, mf_ds/mtp.py), built beside the model after its decoder layers")
        else:
            ledger.dropped(paths["mtp_depth"], "0: no MTP layers")
    if "mtp_loss_factor" in paths:
        if built and shape.mtp_depth and kind in GRADIENT_ONLY:
            ledger.runtime(paths["mtp_loss_factor"], "MTP gradient weight (plan.mtp.loss_factor, mf_ds/mtp.py): "
                           f"the gradient of {shape.mtp_loss_factor} / depth x each depth's masked CE joins the "
                           "loss's; the logged loss stays the main loss, each depth's CE is logged beside it")
        elif built and shape.mtp_depth:
            ledger.runtime(paths["mtp_loss_factor"], "MTP loss weight (plan.mtp.loss_factor, mf_ds/mtp.py): "
                           f"loss += {shape.mtp_loss_factor} / depth x each depth's masked CE")
        else:
            ledger.dropped(paths["mtp_loss_factor"], "no MTP layers are built, so no MTP loss is weighted")


def plan(family: Any, shape: Any, hf_config: dict | None, pynative: bool = False) -> dict | None:
    """Plan.mtp: {variant, depth, loss_factor}, None without MTP layers built; the HF config gets DeepSeek's
    num_nextn_predict_layers (its checkpoints' config.json name for the depth)."""
    kind = variant(family, pynative)
    if shape is None or not shape.mtp_depth or kind is None:
        return None
    if hf_config is not None:
        hf_config["num_nextn_predict_layers"] = shape.mtp_depth
    return {"variant": kind, "depth": shape.mtp_depth, "loss_factor": float(shape.mtp_loss_factor)}


# --- mcore MTP weight names (GPTModel `mtp`, MultiTokenPredictionBlock: multi_token_prediction.py 146-184, 384-399)
# MindFormers: [model.]mtp.layers.{k}.{enorm, hnorm, eh_proj, final_layernorm, transformer_layer.<a decoder layer>};
# DeepSeek's HF layout: model.layers.{num_layers + k}.{enorm, hnorm, eh_proj, shared_head.norm, <the layer>}. The
# decoder-layer part takes the mcore table as the main layers do: here the depth's names become `decoder.layers.N`
# names (and back), which translators/names.py MCORE_MLA maps.
# DeepSeek-V4's layer adds its learnable mHC head (MultiTokenPredictionLayer.hc_head, a HyperConnectionHead: hc_fn,
# hc_base, hc_scale), held as `hc_head` beside them; the table maps its `.hc_head.hc_fn.weight` as the main model's.
MCORE_PARTS = (("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"), ("final_layernorm", "shared_head.norm"),
               ("hc_head", "hc_head"), ("transformer_layer", ""))
MCORE_FAMILY = "deepseek_v3/mcore"
GPT_FAMILIES = (MCORE_FAMILY, "deepseek_v4/mcore")  # the weight families whose MTP is GPTModel's `mtp.layers.N`
_MCORE_MF = re.compile(r"^(?:model\.)?mtp\.layers\.(\d+)\."
                       r"(enorm|hnorm|eh_proj|final_layernorm|hc_head|transformer_layer)\.")
_MCORE_DECODER = re.compile(r"^(model\.)?decoder\.layers\.(\d+)\."
                            r"(enorm\.|hnorm\.|eh_proj\.|shared_head\.norm\.|hc_head\.)?")


def mcore_to_decoder(name: str, num_layers: int) -> str:
    """A MindFormers mcore MTP name as the `decoder.layers.{num_layers + k}` name the mcore table maps to HF; any
    other name unchanged."""
    m = _MCORE_MF.match(name)
    if not m:
        return name
    part = dict(MCORE_PARTS)[m.group(2)]
    return f"decoder.layers.{num_layers + int(m.group(1))}." + (f"{part}." if part else "") + name[m.end():]


def decoder_to_mcore(name: str, num_layers: int) -> str:
    """The MindFormers mcore MTP name of a `decoder.layers.N` name with N >= num_layers (mcore_to_decoder
    backwards); any other name unchanged."""
    m = _MCORE_DECODER.match(name)
    if not m or int(m.group(2)) < num_layers:
        return name
    part = {hf: mf for mf, hf in MCORE_PARTS}[(m.group(3) or ".")[:-1]]
    return f"{m.group(1) or ''}mtp.layers.{int(m.group(2)) - num_layers}.{part}." + name[m.end():]


def to_decoder(name: str, family: str, num_layers: int) -> str:
    """mcore_to_decoder for the mcore DeepSeek-V3's and DeepSeek-V4's names; any other family's unchanged."""
    return mcore_to_decoder(name, num_layers) if family in GPT_FAMILIES else name


def from_decoder(name: str, family: str, num_layers: int) -> str:
    """decoder_to_mcore for the mcore DeepSeek-V3's and DeepSeek-V4's names; any other family's unchanged."""
    return decoder_to_mcore(name, num_layers) if family in GPT_FAMILIES else name
