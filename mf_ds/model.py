"""Build the HF model the Plan describes: `from_config`, or weights from an HF-layout safetensors directory.

The runtime reads only the Plan (DESIGN.md): `plan.hf_config` is `AutoConfig.for_model` kwargs. Kernel and MoE
settings the runtime cannot honour yet are reported, never silently ignored.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from mf_ds.errors import RunError


def hf_config(plan: dict):
    cfg = plan["hf_config"]
    if cfg is None:
        notes = [n["message"] for n in plan["notes"] if n["key"] == "model"]
        raise RunError("no Hugging Face architecture for this model: " + (notes[0] if notes else "see the plan notes"))
    kwargs = dict(cfg)
    config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    config.use_cache = False  # training: no KV cache
    return config


def build_model(plan: dict, load_checkpoint: str | None = None) -> torch.nn.Module:
    """fp32 parameters (DeepSpeed casts to bf16/fp16 and keeps fp32 masters in its optimizer)."""
    config = hf_config(plan)
    if load_checkpoint:
        path = Path(load_checkpoint)
        if not path.is_dir():
            raise RunError(f"{path}: load_checkpoint must be an HF-layout safetensors directory")
        if not any(path.glob("*.safetensors")):
            raise RunError(f"{path}: no *.safetensors weights in this directory")
        try:
            model = AutoModelForCausalLM.from_pretrained(str(path), config=config, dtype=torch.float32,
                                                         local_files_only=True)
        except (OSError, ValueError, RuntimeError) as exc:
            raise RunError(f"{path}: cannot load the weights: {str(exc).splitlines()[0]}") from None
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model


def pending_features(plan: dict) -> list[str]:
    """Plan features this runtime does not apply yet, each as a report line (a note, not a silent no-op)."""
    lines = []
    kernels = plan["kernels"]
    if kernels["fused_rope"]:
        lines.append("use_fused_rope: the fused RoPE kernel is not in this version; HF's RoPE runs (same numbers)")
    if kernels["fused_swiglu"]:
        lines.append("use_fused_swiglu: the fused SwiGLU kernel is not in this version; HF's MLP runs (same "
                     "numbers)")
    moe = plan["moe"]
    if moe is not None:
        lines.append("moe: the mf-ds MoE layer is not in this version; transformers' own dropless MoE block runs "
                     f"(capacity_factor {moe['capacity_factor']}, gmm {moe['gmm']}, expert_parallel "
                     f"{moe['expert_parallel']} are not applied)")
        if moe["expert_parallel"] > 1:
            raise RunError("parallel_config.expert_parallel > 1 needs the mf-ds MoE layer, which is not in this "
                           "version; set parallel_config.expert_parallel: 1")
    if any(layer["mtp"] for layer in plan["layers"]):
        lines.append("mtp: transformers' DeepSeek-V3 has no MTP layers; the MTP loss is not trained")
    return lines
