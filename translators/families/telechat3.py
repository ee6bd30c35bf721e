"""TeleChat3 and TeleChat3-MoE (MindFormers 1.9.0+, mcore only: models/telechat3, models/telechat3_moe).

transformers has no TeleChat3 architecture (it ships as trust_remote_code). MindFormers builds TeleChat3 as its
generic mcore GPTModel with the local layer spec (modeling_telechat3_train.py): RMSNorm, GQA attention with
rotate-half RoPE and no q/k norm, a SwiGLU MLP, no biases, an untied head. That is HF's `llama`, and the logits say
so: MindFormers 2.1.0's own graph-mode TrainingTeleChat3ForCausalLM on CPU (tests/fixtures/make_telechat3_golden.py)
against transformers' LlamaForCausalLM with the same weights agree to 4e-6 in float32 (and to 3e-4 under flash
attention, for which MindFormers casts q, k, v to float16: tests/mf_ds/test_telechat3.py). The weights are
the mcore names of Qwen3 (translators/families/mcore.py MCORE_NAMES; models/telechat3/utils.py weight_mapping is
Qwen3's without the q/k norms).

TeleChat3-MoE is DeepSeek-V3's MLA + MoE graph; its MoE layers do not run on CPU (GroupedMatmul, MoeTokenPermute
are Ascend-only), so no logits can show a mapping onto HF DeepseekV3 equal: it is refused in one line.
"""

from __future__ import annotations

from translators.families.llama import LLAMA_TARGETS
from translators.families.mcore import MCORE_NAMES
from translators.families.record import FamilyRecord, Weights

RECORDS = (
    # HF Llama's architecture, AutoTP plan, memory inputs and patch targets; Qwen3's mcore weight names
    FamilyRecord("telechat3", "llama", "mcore", True, model_types=("telechat3",),
                 architectures=("TeleChat3ForCausalLM",), weights=Weights(MCORE_NAMES), tp="hf_tp_plan",
                 runtime=LLAMA_TARGETS),
    FamilyRecord("telechat3_moe", None, "mcore", True, model_types=("telechat3_moe",),
                 architectures=("TeleChat3MoeForCausalLM",),
                 reason="TeleChat3-MoE has no transformers architecture, and its MoE layers do not run on CPU here, so "
                        "a mapping onto HF DeepseekV3 cannot be shown equal to MindFormers' model: not supported"),
)



def specs() -> dict:
    """config class, rules, defaults, derivations of each family (imported here: the table modules import base)."""
    from translators.errors import ConfigError
    from translators.families.derive import _kv_heads, _mcore_rope, _untied
    from translators.families.llama import LLAMA
    from translators.families.mcore import MCORE, MCORE_DEFAULTS, UNTIED, mcore_spec
    from translators.families.rules import Expect, Feeds

    def _plain_llama(m, moe) -> dict:
        """TeleChat3Config builds MoE blocks when experts are set, MLA with multi_latent_attention and q/k norms
        with qk_layernorm (modeling_telechat3_train.py); HF Llama has none of them."""
        for name, what in (("qk_layernorm", "q/k norms"), ("multi_latent_attention", "multi-latent attention")):
            if m.get(name):
                raise ConfigError(m.path(name), f"True: TeleChat3 with {what} is not HF Llama; not supported")
        if (m.get("expert_num") or 0) > 1:
            raise ConfigError(m.path("expert_num"), "TeleChat3 with MoE layers is not HF Llama (and MindFormers' "
                                                    "MoE does not run on CPU to prove a mapping); not supported")
        return {}

    rules = {  # TeleChat3Config (models/telechat3/configuration_telechat3.py) -> HF LlamaConfig
        **MCORE,
        "head_dim": "head_dim",
        "qkv_has_bias": Expect(False, "no attention bias, as the TeleChat3 YAMLs say", "HF Llama's attention_bias "
                               "would also bias o_proj", hf="attention_bias"),
        "qk_layernorm": Feeds(),  # must be False: HF Llama has no q/k norm (_plain_llama)
        "multi_latent_attention": Feeds(),  # must be False
        "expert_num": Feeds(),  # must be <= 1
        "mtp_depth": LLAMA["mtp_depth"],
        "tie_word_embeddings": UNTIED,
    }
    return {("telechat3", True): mcore_spec("TeleChat3Config", rules, MCORE_DEFAULTS,
                                            (_kv_heads, _mcore_rope, _untied, _plain_llama)),
            ("telechat3_moe", True): mcore_spec("TeleChat3MoeConfig", MCORE, MCORE_DEFAULTS, ())}
