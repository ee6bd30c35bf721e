"""TeleChat3 and TeleChat3-MoE (MindFormers 1.9.0+, mcore only: models/telechat3, models/telechat3_moe).

transformers has no TeleChat3 architecture (it ships as trust_remote_code). MindFormers builds TeleChat3 as its
generic mcore GPTModel (modeling_telechat3_train.py: the local layer spec, MoE blocks when num_moe_experts is set)
and TeleChat3-MoE as DeepSeek-V3's MLA + MoE graph. Mapping either onto an HF architecture needs the arithmetic shown
equal (logits against MindFormers' own graph-mode model); until then both are refused in one line, with the
config class each YAML would take its defaults from.
"""

from __future__ import annotations

from translators.families.base import Family

REASON = ("TeleChat3 has no transformers architecture (it ships as trust_remote_code), and mapping it onto one is "
          "not proven equal to MindFormers' model yet: not supported")
TELECHAT3 = Family("telechat3", None, "mcore", True, REASON)
TELECHAT3_MOE = Family("telechat3_moe", None, "mcore", True, REASON.replace("TeleChat3", "TeleChat3-MoE", 1))
FAMILIES = (TELECHAT3, TELECHAT3_MOE)
MODEL_TYPES = {"telechat3": "telechat3", "telechat3_moe": "telechat3_moe"}
ARCHS = {"TeleChat3ForCausalLM": "telechat3", "TeleChat3MoeForCausalLM": "telechat3_moe"}
CONFIG_CLASSES = {"telechat3": "TeleChat3Config", "telechat3_moe": "TeleChat3MoeConfig"}
