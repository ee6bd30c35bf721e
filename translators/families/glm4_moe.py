"""GLM-4.5 / GLM-4-MoE (MindFormers 1.7.0+, mcore: models/glm4_moe, Glm4MoeConfig).

MindFormers does not train it: Glm4MoeForCausalLM builds its inference network only and raises
"Train mode is not supported for Glm4Moe model." otherwise (modeling_glm4_moe.py, 1.7.0 to 2.1.0; its wheels carry a
predict YAML only). A training YAML for it describes no MindFormers run to reproduce, so it is refused in one line
(transformers has `glm4_moe`: a run of it here would be mf-ds' own, not MindFormers').
"""

from __future__ import annotations

from translators.families.base import Family  # base imports this module once Family exists: nothing else here

GLM4_MOE = Family("glm4_moe", None, "mcore", True,
                  "MindFormers does not train Glm4Moe (Glm4MoeForCausalLM raises \"Train mode is not supported for "
                  "Glm4Moe model.\", 1.7.0 to 2.1.0): no MindFormers run to reproduce")
FAMILIES = (GLM4_MOE,)
MODEL_TYPES = {"glm4_moe": "glm4_moe"}
ARCHS = {"Glm4MoeForCausalLM": "glm4_moe"}


def specs() -> dict[str, tuple]:
    """config class, rules, defaults, derivations (the class's defaults still name the model in the notes)."""
    from translators.families.mcore import MCORE, MCORE_DEFAULTS

    return {"glm4_moe": ("Glm4MoeConfig", MCORE, MCORE_DEFAULTS, ())}
