"""DeepSeek's multi-token prediction (MTP) in the Plan: which MindFormers variant a YAML's `mtp_depth` asks for.

Variants (issue 30 part 5); only `research` is built (mf_ds/mtp.py), the others keep a `differs` note:
- research: research/deepseek3 of MindFormers 1.5-1.7 (TrainingDeepseekV3ForCausalLM, deepseek2_model.py
  MTPHiddenFuser): legacy DeepSeek-V3 YAMLs (use_legacy unset or True). loss = main + aux
  + mtp_loss_factor / mtp_depth x sum_k masked CE_k, logged as one number by MFLossMonitor.
- mcore (1.7 graph mode multi_token_prediction.py, DeepSeek-V3 with use_legacy: False) and DeepSeek-V4's PyNative
  model: not built; `mtp_depth` there stays the `differs` note of translators/families/deepseek.py MTP_ABSENT.
"""

from __future__ import annotations

from typing import Any

from translators.notes import Ledger


def variant(family: Any) -> str | None:
    """The MTP variant mf-ds builds for this family, None where it builds none."""
    return "research" if family.name == "deepseek_v3" and not family.mcore else None


def account(family: Any, shape: Any, paths: dict[str, str], ledger: Ledger) -> None:
    """Notes model_config.mtp_depth / mtp_loss_factor (`paths`: name -> YAML path, the keys the YAML spells)."""
    built = variant(family) is not None
    if "mtp_depth" in paths and built:
        if shape.mtp_depth:
            ledger.runtime(paths["mtp_depth"], f"{shape.mtp_depth} MTP layer(s) of research/deepseek3 "
                           "(plan.mtp.depth, mf_ds/mtp.py), built beside the model after its decoder layers")
        else:
            ledger.dropped(paths["mtp_depth"], "0: no MTP layers")
    if "mtp_loss_factor" in paths:
        if built and shape.mtp_depth:
            ledger.runtime(paths["mtp_loss_factor"], "MTP loss weight (plan.mtp.loss_factor, mf_ds/mtp.py): "
                           f"loss += {shape.mtp_loss_factor} / depth x each depth's masked CE")
        else:
            ledger.dropped(paths["mtp_loss_factor"], "no MTP layers are built, so no MTP loss is weighted")


def plan(family: Any, shape: Any, hf_config: dict | None) -> dict | None:
    """Plan.mtp: {variant, depth, loss_factor}, None without MTP layers built; the HF config gets DeepSeek's
    num_nextn_predict_layers (its checkpoints' config.json name for the depth)."""
    if shape is None or not shape.mtp_depth or variant(family) is None:
        return None
    if hf_config is not None:
        hf_config["num_nextn_predict_layers"] = shape.mtp_depth
    return {"variant": variant(family), "depth": shape.mtp_depth, "loss_factor": float(shape.mtp_loss_factor)}
