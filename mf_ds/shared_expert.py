"""A shared expert of its own width, where a family's MindFormers model builds one that transformers' class cannot
express (DeepSeek-V4: mf_ds/families/deepseek4.py). Runs right after the model is built and before any weight is
loaded (mf_ds/model.py); the family's `shared_experts` / `shared_width` hooks (mf_ds/families) do the work.
"""

from __future__ import annotations

from torch import nn

from mf_ds import families


def width(config) -> int | None:
    """The shared expert's width where it is not the routed one, else None."""
    own = families.hook(getattr(config, "model_type", None), "shared_width")
    return own(config) if own else None


def apply(model: nn.Module) -> list[str]:
    """Rebuild the shared experts at the family's width; [] when the model has none to change, else report lines."""
    own = families.hook(getattr(model.config, "model_type", None), "shared_experts")
    return own(model) if own else []
