"""translators.families over the MindFormers corpus: every YAML's family, its HF config built on the meta device and
counted against the published parameter count, every model key accounted, and bad input named by key path."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from tests.conftest import CONFIGS, CORPUS, ROOT, corpus_files, corpus_params, needs_shared
from translators import families
from translators.errors import ConfigError
from translators.loader import load_yaml
from translators.notes import Ledger, leaves


@dataclass(frozen=True)
class Case:
    family: str
    check: str  # published | nominal | analytic | builds | no-hf | no-model | refused
    expected: float | None  # parameters (published), None where computed or not applicable
    source: str  # where the number comes from, or why the check is different
    error: str = ""  # refused: the start of the one error line


B = 1e9
# One row per corpus YAML. Published counts are the models' Hugging Face cards (safetensors totals) or papers; each
# corpus YAML matches its published model exactly (vocab, tied or untied embeddings, FFN width), so 1% is ample.
CASES: dict[str, Case] = {
    "r1.5.0__configs__llama2__finetune_llama2_7b_bf16": Case(
        "llama", "published", 6.74 * B, "meta-llama/Llama-2-7b-hf card: 6.74B"),
    "r1.5.0__configs__llama2__pretrain_llama2_7b": Case(
        "llama", "published", 6.74 * B, "meta-llama/Llama-2-7b-hf card: 6.74B"),
    "r1.5.0__configs__llama2__finetune_llama2_70b_bf16_64p": Case(  # FFN derived: ffn_dim_multiplier 1.3 -> 28672
        "llama", "published", 69.0 * B, "meta-llama/Llama-2-70b-hf card: 69.0B"),
    "r1.5.0__research__llama3__llama3_8b__finetune_llama3_8b": Case(
        "llama", "published", 8.03 * B, "meta-llama/Meta-Llama-3-8B card: 8.03B"),
    "r1.6.0__research__llama3_1__llama3_1_70b__finetune_llama3_1_70b": Case(
        "llama", "published", 70.6 * B, "meta-llama/Llama-3.1-70B card: 70.6B"),
    "r1.5.0__research__deepseek__deepseek_33b__pretrain_deepseek_33b_16k": Case(  # LlamaConfig, PI x4 RoPE
        "llama", "published", 33.3 * B, "deepseek-ai/deepseek-coder-33b-base card: 33.3B"),
    "r1.5.0__research__mixtral__mixtral_8x7b__pretrain_mixtral-8x7b": Case(
        "mixtral", "published", 46.7 * B, "Mixtral of Experts (arXiv:2401.04088) and the HF card: 46.7B"),
    "r1.5.0__research__qwen1_5__qwen1_5_14b__finetune_qwen1_5_14b": Case(  # trainer.model_name says qwen2_14b
        "qwen2", "published", 14.2 * B, "Qwen/Qwen1.5-14B card: 14.2B (vocab 152064, untied)"),
    "r1.5.0__research__qwen1_5__qwen1_5_4b__finetune_qwen1_5_4b": Case(
        "qwen2", "published", 3.95 * B, "Qwen/Qwen1.5-4B card: 3.95B (vocab 151936, untied)"),
    "r1.5.0__research__qwen2_5__finetune_qwen2.5_72B_32K": Case(
        "qwen2", "published", 72.7 * B, "Qwen/Qwen2.5-72B card: 72.7B"),
    "r1.5.0__research__qwen2_5__finetune_qwen2_5_7b_8k": Case(
        "qwen2", "published", 7.61 * B, "Qwen/Qwen2.5-7B card: 7.61B"),
    "r1.5.0__research__qwen2__qwen2_0_5b__finetune_qwen2_0.5b_32k": Case(
        "qwen2", "published", 0.49 * B, "Qwen/Qwen2-0.5B card: 0.49B (tied embeddings, as the YAML says)"),
    "r1.5.0__research__deepseek2__deepseek2_236b__finetune_deepseek2_236B": Case(
        "deepseek_v2", "published", 236 * B, "deepseek-ai/DeepSeek-V2 card: 236B total"),
    "r1.5.0-beta1__research__deepseek3__deepseek3_671b__pretrain_deepseek3_671b": Case(
        "deepseek_v3", "published", 671 * B, "deepseek-ai/DeepSeek-V3 card: 671B main model + 14B MTP = 685B; "
                                             "transformers builds no MTP module (see test_deepseek_v3_with_mtp)"),
    "r1.7.0__configs__qwen3_moe__pretrain_qwen3_30b_a3b_4k": Case(
        "qwen3_moe", "published", 30.5 * B, "Qwen/Qwen3-30B-A3B card: 30.5B total"),
    "r1.5.0__configs__glm4__finetune_glm4_9b": Case(
        "glm4", "published", 9.4 * B, "THUDM/glm-4-9b card: 9.4B"),
    "r1.5.0__configs__glm3__finetune_glm3_6b_bf16": Case(
        "chatglm", "published", 6.24 * B, "THUDM/chatglm3-6b card: 6.24B"),
    "r1.5.0__research__glm32k__finetune_glm32k": Case(
        "chatglm", "published", 6.24 * B, "THUDM/chatglm3-6b-32k card: 6.24B (rope_ratio 50)"),
    "r1.5.0__configs__gpt2__pretrain_gpt2_13b_fp16": Case(
        "gpt2", "nominal", 13 * B, "MindFormers gpt2 model card names it gpt2_13b; exact count analytic: "
                                   "L(12h^2 + 13h) + (V + P)h + 2h, head tied to the embedding (gpt2.py GPTHead)"),
    "r1.5.0__tests__st__test_distri_core__test_parallel_seqpipe__pretrain_deepseek3_4layer_4p": Case(
        "deepseek_v3", "analytic", None, "test config of no published model (7 layers despite the name, 4 experts):"
                                         " counted from the DeepSeek-V3 architecture"),
    "r1.7.0__tests__st__test_multi_cards_cases__test_model__test_deepseek3__deepseekv3_train": Case(
        "deepseek_v3", "analytic", None, "mcore test config of no published model (4 layers, 16 experts): counted "
                                         "from the DeepSeek-V3 architecture"),
    "r1.7.0__configs__general__llm_pretrain_moe_template": Case(
        "none", "refused", None, "template: its model is pretrained_model_dir/config.json (see "
                                 "test_moe_template_seeded_by_config_json); without one it names no model",
        "pretrained_model_dir: path/to/model_dir/config.json does not exist: MindFormers builds the model from it"),
    "master__configs__telechat3__pretrain_telechat3_105b_a4b_4k": Case(
        "telechat3", "refused", None, "TeleChat3 (HF Llama) with MLA and MoE: not Llama",
        "model.model_config.qk_layernorm: True: TeleChat3 with q/k norms is not HF Llama"),
    "r1.5.0__research__telechat2__finetune_telechat_115b": Case(
        "telechat", "no-hf", None, "TeleChat2 ships as trust_remote_code"),
    "r1.5.0__research__telechat__finetune_telechat_52b": Case(
        "telechat", "no-hf", None, "TeleChat ships as trust_remote_code"),
    "r1.3.0__research__baichuan2__finetune_baichuan2_13b": Case(
        "baichuan2", "no-hf", None, "Baichuan2 ships as trust_remote_code (ALiBi, NormHead)"),
    "r1.5.0__research__yizhao__yizhao_12b__pretrain_yizhao_12b_8k": Case(
        "yizhao", "no-hf", None, "YiZhao is a MindFormers research model"),
    "r1.5.0__tests__st__test_pipeline_balance__mem_pp4": Case(
        "none", "no-model", None, "pipeline-balance solver input: no model section"),
}


@dataclass
class Translated:
    tree: dict
    family: families.FamilyRecord
    ledger: Ledger
    hf: dict | None
    shape: families.ModelShape | None


def translate(tree: dict) -> Translated:
    family = families.detect_family(tree)
    ledger = Ledger(tree)
    hf = families.hf_config(tree, family, ledger)
    shape = None if family is families.NO_MODEL else families.model_shape(tree, family, ledger)
    return Translated(tree, family, ledger, hf, shape)


@functools.cache
def translated(stem: str) -> Translated:
    return translate(load_yaml(str(CORPUS / f"{stem}.yaml")))


@functools.cache
def built(stem: str) -> torch.nn.Module:
    config = AutoConfig.for_model(**translated(stem).hf)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # tied weights are one parameter


def deepseek_v3_params(c) -> int:
    """DeepSeek-V3 as transformers builds it: MLA attention, first_k_dense_replace dense layers, then routed + shared
    experts with a router (its score-correction bias is a buffer); untied embedding and head."""
    h, heads, q_dim = c.hidden_size, c.num_attention_heads, c.qk_nope_head_dim + c.qk_rope_head_dim
    q = h * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * heads * q_dim if c.q_lora_rank else h * heads * q_dim
    kv = h * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank \
        + c.kv_lora_rank * heads * (c.qk_nope_head_dim + c.v_head_dim)
    attention = q + kv + heads * c.v_head_dim * h
    dense = 3 * h * c.intermediate_size
    moe = 3 * h * c.moe_intermediate_size * (c.n_routed_experts + c.n_shared_experts) + c.n_routed_experts * h
    k = c.first_k_dense_replace
    layers = c.num_hidden_layers * (attention + 2 * h) + k * dense + (c.num_hidden_layers - k) * moe
    return 2 * c.vocab_size * h + h + layers


def gpt2_params(c) -> int:
    return c.n_layer * (12 * c.n_embd ** 2 + 13 * c.n_embd) + (c.vocab_size + c.n_positions) * c.n_embd + 2 * c.n_embd


@needs_shared
def test_every_corpus_yaml_has_a_row():
    assert {p.stem for p in corpus_files()} == set(CASES)


@needs_shared
@pytest.mark.parametrize("stem", sorted(CASES))
def test_family(stem):
    case = CASES[stem]
    if case.check == "refused":
        with pytest.raises(ConfigError) as err:
            translated(stem)
        assert str(err.value).startswith(case.error)
        return
    t = translated(stem)
    assert t.family.name == case.family
    if case.check == "no-model":
        assert t.family.hf_model_type is None and t.family.reason == "no model section"
    elif case.check == "no-hf":
        assert t.family.hf_model_type is None and t.family.reason
    else:
        assert t.family.hf_model_type in CONFIG_MAPPING


@needs_shared
@pytest.mark.parametrize("stem", sorted(s for s, c in CASES.items() if c.check != "refused"))
def test_hf_config_is_none_exactly_without_an_architecture(stem):
    case, t = CASES[stem], translated(stem)
    if case.check in ("no-hf", "no-model"):
        assert t.hf is None
        notes = [n for n in t.ledger.finish() if n.key == "model"]
        assert notes and all(case.family in n.message for n in notes)
        for name in ("telechat", "telechat2", "telechat3", "baichuan", "baichuan2", "yizhao"):
            assert name not in CONFIG_MAPPING
    else:
        assert t.hf["model_type"] == t.family.hf_model_type
        json.dumps(t.hf)  # the Plan is JSON


@needs_shared
@pytest.mark.parametrize("stem", sorted(s for s, c in CASES.items() if c.check in ("published", "nominal", "analytic",
                                                                                  "builds")))
def test_parameter_count(stem):
    case, model = CASES[stem], built(stem)
    got = count(model)
    if model.config.model_type == "deepseek_v3":  # an independent count of what transformers built
        assert got == deepseek_v3_params(model.config)
    if case.check == "published":
        assert got == pytest.approx(case.expected, rel=0.01), case.source
    elif case.check == "nominal":
        assert got == gpt2_params(model.config)
        assert round(got / B) == case.expected / B, case.source
    elif case.check == "analytic":
        assert got == deepseek_v3_params(model.config) > 0, case.source
    else:
        assert got > 0


@needs_shared
def test_deepseek_v3_with_mtp():
    """The card's 685B adds the MTP module to the 671B main model: one more MoE decoder layer, eh_proj (2h -> h),
    enorm, hnorm, the shared head's norm, and its own copies of the embedding and the LM head."""
    stem = "r1.5.0-beta1__research__deepseek3__deepseek3_671b__pretrain_deepseek3_671b"
    model, t = built(stem), translated(stem)
    c = model.config
    assert t.shape.mtp_depth == c.num_nextn_predict_layers == 1
    h = c.hidden_size
    mtp = count(model.model.layers[-1]) + 2 * h * h + 3 * h + 2 * c.vocab_size * h
    assert count(model) + mtp == pytest.approx(685 * B, rel=0.01)


@needs_shared
def test_moe_template_seeded_by_config_json(tmp_path):
    """The r1.7.0 MoE template takes its shape from pretrained_model_dir/config.json; with Qwen3-30B-A3B's it is
    that model (30.5B); without one it is refused: it names no model (MindFormers reads the model from it)."""
    stem = "r1.7.0__configs__general__llm_pretrain_moe_template"
    tree = load_yaml(str(CORPUS / f"{stem}.yaml"))
    qwen3_30b_a3b = {  # Qwen/Qwen3-30B-A3B config.json
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
        "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960, "moe_intermediate_size": 768,
        "num_experts": 128, "num_experts_per_tok": 8, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
        "tie_word_embeddings": False, "norm_topk_prob": True, "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(qwen3_30b_a3b))
    tree["pretrained_model_dir"] = str(tmp_path)
    seeded = translate(tree)
    assert seeded.family.name == "qwen3_moe" and seeded.shape.num_layers == 48
    assert seeded.hf["norm_topk_prob"] is False  # the YAML wins over config.json
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**seeded.hf))
    assert count(model) == pytest.approx(30.5 * B, rel=0.01)

    tree["pretrained_model_dir"] = str(tmp_path / "absent")
    with pytest.raises(ConfigError, match=r"^pretrained_model_dir: .*absent/config\.json does not exist"):
        translate(tree)


def _translated(path) -> bool:
    """A YAML that translates (the refused ones are checked by test_family, in their own words)."""
    return not isinstance(path, Path) or CASES.get(path.stem, Case("", "", None, "")).check != "refused"


@pytest.mark.parametrize("path", [p for p in corpus_params(*sorted(CONFIGS.glob("*.yaml"))) if _translated(p)],
                         ids=lambda p: p.stem)
def test_every_model_key_is_accounted(path):
    t = translate(load_yaml(str(path)))
    model_keys = [p for p in leaves(t.tree) if p.startswith(("model.model_config", "model.arch"))]
    assert model_keys or t.family is families.NO_MODEL
    assert [p for p in model_keys if not t.ledger.accounted(p)] == []
    notes = t.ledger.finish()
    unknown = [n.line() for n in notes if n.kind == "unknown" and n.key.startswith("model.")]
    assert unknown == []  # the corpus holds only keys MindFormers defines, or known leftovers
    assert len(notes) == len(set(notes))  # each account once


def test_configs_build():
    for path in sorted(CONFIGS.glob("*.yaml")):
        t = translate(load_yaml(str(path)))
        with torch.device("meta"):
            assert count(AutoModelForCausalLM.from_config(AutoConfig.for_model(**t.hf))) > 0


@needs_shared
def test_model_shape_of_a_pipeline_yaml():
    shape = translated("r1.5.0__research__telechat2__finetune_telechat_115b").shape
    assert (shape.num_layers, shape.hidden_size, shape.num_heads, shape.pp_interleave_num) == (96, 8192, 64, 3)
    assert shape.offset == [[-1, -1, 0, 0, 0, 0, 0, 0], [-1, 0, 0, 0, 0, 0, 0, 0], [0, 0, 0, 1, 1, 1, 1, -1]]
    assert (shape.compute_dtype, shape.param_init_type, shape.mtp_depth) == ("bfloat16", "float32", 0)
    ds3 = translated("r1.5.0-beta1__research__deepseek3__deepseek3_671b__pretrain_deepseek3_671b").shape
    assert (ds3.num_layers, ds3.mtp_depth, ds3.input_sliced_sig, ds3.return_extra_loss) == (61, 1, True, True)


def test_model_shape_defaults_per_config_class():
    tree = {"model": {"model_config": {"type": "LlamaConfig"}, "arch": {"type": "LlamaForCausalLM"}}}
    shape = families.model_shape(tree, families.detect_family(tree), Ledger(tree))
    assert (shape.num_layers, shape.seq_length, shape.compute_dtype, shape.param_init_type) == (
        32, 2048, "float16", "float16")  # LlamaConfig.__init__
    assert (shape.use_fused_rope, shape.use_fused_swiglu, shape.offset, shape.pp_interleave_num) == (False, False, 0, 1)
    tree["model"]["model_config"].update(use_fused_rope=True, use_fused_swiglu=True)
    shape = families.model_shape(tree, families.detect_family(tree), Ledger(tree))
    assert shape.use_fused_rope and shape.use_fused_swiglu


@needs_shared
def test_no_model_section():
    tree = load_yaml(str(CORPUS / "r1.5.0__tests__st__test_pipeline_balance__mem_pp4.yaml"))
    assert families.detect_family(tree) is families.NO_MODEL
    with pytest.raises(ConfigError) as err:
        families.model_shape(tree, families.NO_MODEL, Ledger(tree))
    assert err.value.path == "model"


# --- derived values -----------------------------------------------------------------------------------------------

def llama(**config) -> dict:
    base = {"type": "LlamaConfig", "num_layers": 2, "hidden_size": 64, "num_heads": 4, "vocab_size": 100,
            "seq_length": 32}
    return {"model": {"model_config": {**base, **config}, "arch": {"type": "LlamaForCausalLM"}}}


def hf_of(tree: dict) -> tuple[dict, Ledger]:
    ledger = Ledger(tree)
    return families.hf_config(tree, families.detect_family(tree), ledger), ledger


@pytest.mark.parametrize("config, expected", [
    ({"hidden_size": 8192, "num_heads": 64, "ffn_dim_multiplier": 1.3}, 28672),  # Llama-2-70B
    ({"hidden_size": 4096, "num_heads": 32}, 11008),  # Llama-2-7B: 4h * 2/3 rounded up to 256
    ({"hidden_size": 4096, "num_heads": 32, "multiple_of": 1024, "ffn_dim_multiplier": 1.3}, 14336),  # Llama-3-8B
    ({"intermediate_size": 100, "multiple_of": 64}, 100),
])
def test_llama_ffn_width(config, expected):
    hf, ledger = hf_of(llama(**config))
    assert hf["intermediate_size"] == expected
    if "intermediate_size" in config:
        assert any(n.kind == "dropped" and n.key.endswith("multiple_of") for n in ledger.finish())


@pytest.mark.parametrize("config, rope", [
    ({"theta": 500000}, {"rope_type": "default", "rope_theta": 500000.0}),
    ({"extend_method": "PI", "scaling_factor": 4}, {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}),
    ({"extend_method": "NTK", "scaling_factor": 2.0}, {"rope_type": "default", "rope_theta": 20000.0}),
    ({"extend_method": "YARN", "scaling_factor": {"factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                                                  "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}},
     {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32.0, "beta_slow": 1.0,
      "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}),
    ({"extend_method": "None", "scaling_factor": 8.0}, {"rope_type": "default", "rope_theta": 10000.0}),
])
def test_rope_parameters(config, rope):
    hf, _ = hf_of(llama(**config))
    assert hf["rope_parameters"] == rope
    AutoConfig.for_model(**hf)


def test_positions_kv_heads_and_yaml_strings():
    hf, ledger = hf_of(llama(rms_norm_eps="1e-5", n_kv_heads="None", max_position_embedding=16, seq_length=64))
    assert hf["rms_norm_eps"] == 1e-5 and isinstance(hf["rms_norm_eps"], float)
    assert hf["num_key_value_heads"] == 4
    assert hf["max_position_embeddings"] == 64  # FreqsMgr covers at least seq_length
    notes = {n.key: n.message for n in ledger.finish()}
    assert "'1e-5'" in notes["model.model_config.rms_norm_eps"]


def test_mindformers_defaults_not_hf_defaults():
    hf, _ = hf_of(llama())
    assert (hf["rms_norm_eps"], hf["initializer_range"], hf["bos_token_id"], hf["dtype"]) == (1e-5, 0.01, 1, "float16")


@pytest.mark.parametrize("moe, family, hf_key", [
    ({"expert_num": 8, "num_experts_chosen": 2}, "mixtral", "num_local_experts"),
    ({"expert_num": 64, "num_experts_chosen": 8, "shared_expert_num": 8.0}, "qwen2_moe", "num_experts"),
])
def test_llama_moe_families(moe, family, hf_key):
    tree = llama(intermediate_size=32)
    tree["moe_config"] = {**moe, "capacity_factor": 1.1}
    hf, ledger = hf_of(tree)
    assert families.detect_family(tree).name == family
    assert hf[hf_key] == moe["expert_num"] and hf["num_experts_per_tok"] == moe["num_experts_chosen"]
    if family == "qwen2_moe":
        assert (hf["moe_intermediate_size"], hf["shared_expert_intermediate_size"]) == (32, 256)
    assert not ledger.accounted("moe_config.capacity_factor")  # the MoE module's key
    with torch.device("meta"):
        AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf))


def test_qwen2_detected_by_qkv_bias():
    assert families.detect_family(llama(qkv_has_bias=True)).name == "qwen2"
    assert families.detect_family(llama()).name == "llama"


def test_family_from_model_name_alone():
    tree = {"model": {"model_config": {"num_layers": 2}}, "trainer": {"model_name": "deepseekV3"}}
    assert families.detect_family(tree).name == "deepseek_v3"


def test_unknown_key_warns_with_a_hint():
    _, ledger = hf_of(llama(num_layer=3))
    [note] = [n for n in ledger.finish() if n.key == "model.model_config.num_layer"]
    assert note.kind == "unknown" and "did you mean 'num_layers'" in note.message


def test_mcore_spellings():
    tree = {"use_legacy": False, "model": {"model_config": {
        "model_type": "qwen3", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 100, "intermediate_size": 128, "rope_theta": 1e6,
        "params_dtype": "float32", "apply_rope_fusion": True}}}
    hf, ledger = hf_of(tree)
    shape = families.model_shape(tree, families.detect_family(tree), ledger)
    assert (hf["num_hidden_layers"], hf["num_key_value_heads"], hf["rope_parameters"]["rope_theta"]) == (2, 2, 1e6)
    assert shape.use_fused_rope and shape.param_init_type == "float32"
    with torch.device("meta"):
        AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf))


# --- bad input -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tree, path, message", [
    (llama(num_layers="abc"), "model.model_config.num_layers", "expected a positive int, got 'abc'"),
    (llama(hidden_size=-1), "model.model_config.hidden_size", "expected a positive int, got -1"),
    (llama(num_heads=0), "model.model_config.num_heads", "expected a positive int, got 0"),
    (llama(num_layers=True), "model.model_config.num_layers", "expected a positive int, got True"),
    (llama(hidden_size=100, num_heads=3), "model.model_config.num_heads", "not divisible by num_heads 3"),
    (llama(n_kv_heads=3), "model.model_config.n_kv_heads", "not a multiple of n_kv_heads 3"),
    (llama(rms_norm_eps="abc"), "model.model_config.rms_norm_eps", "expected a number"),
    (llama(compute_dtype="bf16"), "model.model_config.compute_dtype", "expected one of"),
    (llama(extend_method="YARNN"), "model.model_config.extend_method", "did you mean 'YARN'"),
    (llama(extend_method="YARN", scaling_factor=4.0), "model.model_config.scaling_factor", "needs a dict"),
    ({**llama(), "moe_config": {"expert_num": "eight"}}, "moe_config.expert_num", "expected a positive int"),
    ({"model": {"model_config": [1, 2]}}, "model.model_config", "expected a mapping"),
    ({"model": {"model_config": {"num_layers": 2}}}, "model", "cannot tell the model family"),
    ({"use_legacy": False, "model": {"model_config": {"model_type": "qwen9"}}}, "model.model_config.model_type",
     "not an mcore model"),
    ({"use_legacy": False, "model": {"model_config": {"model_type": "qwen3", "num_layers": 2,
                                                      "num_hidden_layers": 2}}},
     "model.model_config.num_hidden_layers", "sets the same thing as model.model_config.num_layers"),
])
def test_bad_input_names_the_key(tree, path, message):
    with pytest.raises(ConfigError) as err:
        family = families.detect_family(tree)
        ledger = Ledger(tree)
        families.model_shape(tree, family, ledger)
        families.hf_config(tree, family, ledger)
    assert err.value.path == path and message in str(err.value)


def test_pure_python():
    code = ("import sys, translators.families; "
            "print(sorted(m for m in ('torch', 'transformers', 'deepspeed', 'triton', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_dtype_names_in_any_case():
    """convert_mstype (models/utils.py) lower-cases the name: 'BFloat16' runs in MindFormers."""
    tree = load_yaml(str(CONFIGS / "tiny_llama.yaml"))
    tree["model"]["model_config"].update(compute_dtype="BFloat16", param_init_type="Float32")
    got = translate(tree)
    assert got.shape.compute_dtype == "bfloat16" and got.hf["dtype"] == "bfloat16"
    tree["model"]["model_config"]["compute_dtype"] = "half"
    with pytest.raises(ConfigError, match=r"^model\.model_config\.compute_dtype: expected one of bfloat16, float16, "
                                          r"float32; got 'half'"):
        translate(tree)
