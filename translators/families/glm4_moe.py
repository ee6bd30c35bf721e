"""GLM-4.5 / GLM-4-MoE (MindFormers 1.7.0+, mcore: models/glm4_moe, Glm4MoeConfig).

MindFormers does not train it: Glm4MoeForCausalLM builds its inference network only and raises
"Train mode is not supported for Glm4Moe model." otherwise (modeling_glm4_moe.py, 1.7.0 to 2.1.0; its wheels carry a
predict YAML only). A training YAML for it describes no MindFormers run to reproduce, so it is refused in one line
(transformers has `glm4_moe`: a run of it here would be mf-ds' own, not MindFormers').
"""

from __future__ import annotations

from translators.families.record import FamilyRecord

RECORDS = (
    FamilyRecord("glm4_moe", None, "mcore", True, model_types=("glm4_moe",), architectures=("Glm4MoeForCausalLM",),
                 reason="MindFormers does not train Glm4Moe (Glm4MoeForCausalLM raises \"Train mode is not supported "
                        "for Glm4Moe model.\", 1.7.0 to 2.1.0): no MindFormers run to reproduce"),
)


def specs() -> dict:
    """config class, rules, defaults, derivations (the class's defaults still name the model in the notes)."""
    from translators.families.mcore import MCORE, MCORE_DEFAULTS, mcore_spec

    return {("glm4_moe", True): mcore_spec("Glm4MoeConfig", MCORE, MCORE_DEFAULTS, ())}
