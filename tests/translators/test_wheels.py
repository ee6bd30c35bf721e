"""The sweep over the training YAMLs of the MindFormers 1.8.0, 1.9.0, 2.0.0 and 2.1.0 wheels (their `configs/`,
copied under tests/fixtures/mindformers_wheels/): each translates to MindFormers' own model, or is refused in one line
that names what is missing; never a traceback.

MindFormers' model is the config its own code builds from the YAML (tests/fixtures/make_mf_wheel_configs.py, run in
each version: mf_model_configs.json beside the YAMLs). The translated HF config must hold the same shape, and the
parameter counts (total and active, translators/memory.py's inventory of what transformers builds) must equal those
of MindFormers' config and, where the model is published, its published size."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from tests.conftest import ROOT
from translators.cli import run
from translators.memory import inventory

WHEELS = ROOT / "tests" / "fixtures" / "mindformers_wheels"
VERSIONS = ("1.8.0", "1.9.0", "2.0.0", "2.1.0")
B = 1e9


@dataclass(frozen=True)
class Model:
    family: str  # Plan run.family
    total: float | None = None  # published parameters of the main model, None where none is published
    active: float | None = None  # published activated parameters per token (MoE)
    source: str = ""


@dataclass(frozen=True)
class Refused:
    line: str  # the start of the one error line, after "mf-translate: error: "


# DeepSeek-V4 (the PyNative YAMLs' flagship; translators/families/deepseek4.py): Flash and Pro translate, their Muon
# under FSDP (data_parallel_shard -1: ZeRO-3, mf_ds/muon_zero.py; QK-clip on, which dsv4_hybrid attention gives nothing
# to clip); Pro's shared expert (2048 beside 3072-wide routed experts) is built that wide by mf-ds
# (mf_shared_expert_intermediate_size, mf_ds/shared_expert.py)
DEEPSEEK_V4 = Model("deepseek_v4")
DEEPSEEK_V4_PRO = Model("deepseek_v4", None, 49 * B, "DeepSeek-V4-Pro: 1.6T, 49B activated (DeepSeek's figures)")
NO_TEMPLATE_DIR = Refused("pretrained_model_dir: path/to/model_dir/config.json does not exist: MindFormers builds "
                          "the model from it")
TELECHAT3_MOE = Refused("model.model_config.model_type: telechat3_moe: TeleChat3-MoE has no transformers architecture")
EXPECT = {
    "deepseek3/pretrain_deepseek3_671b.yaml": Model(
        "deepseek_v3", 671 * B, 37 * B, "deepseek-ai/DeepSeek-V3 card: 671B main model + 14B MTP = 685B, 37B "
                                        "activated (DeepSeek-V3 technical report)"),
    "deepseek3/finetune_deepseek3_671b.yaml": Refused(
        "pretrained_model_dir: /path/to/DeepSeek-V3/config.json does not exist"),
    "deepseek3/pretrain_deepseek3_12b_16p_pp16.yaml": Model("deepseek_v3"),
    "deepseek3/finetune_deepseek3_12b_16p_pp16.yaml": Refused(
        "pretrained_model_dir: /path/to/DeepSeek-V3/config.json does not exist"),
    "deepseek3/pretrain_deepseek3_1b_8p_pynative.yaml": Model("deepseek_v3"),  # the PyNative schema
    "deepseek4/pretrain_deepseek4_flash.yaml": DEEPSEEK_V4,
    "deepseek4/pretrain_deepseek4_flash_reduction.yaml": DEEPSEEK_V4,
    "deepseek4/pretrain_deepseek4_pro.yaml": DEEPSEEK_V4_PRO,
    "deepseek4/pretrain_deepseek4_pro_reduction.yaml": DEEPSEEK_V4,  # fewer layers: no published size
    "general/llm_pretrain_dense_template.yaml": NO_TEMPLATE_DIR,
    "general/llm_finetune_dense_template.yaml": NO_TEMPLATE_DIR,
    "general/llm_pretrain_moe_template.yaml": NO_TEMPLATE_DIR,
    "general/llm_finetune_moe_template.yaml": NO_TEMPLATE_DIR,
    "general/run_general_task.yaml": Refused("model.arch: expected a mapping with the model class (type), got None"),
    "glm4/finetune_glm4_9b.yaml": Model("glm4", 9.4 * B, None, "THUDM/glm-4-9b card: 9.4B"),
    "qwen3/finetune_qwen3.yaml": Refused("pretrained_model_dir: /path/to/Qwen3-32B/config.json does not exist"),
    "qwen3/pretrain_qwen3_32b_4k.yaml": Model("qwen3", 32.8 * B, None, "Qwen/Qwen3-32B card: 32.8B"),
    "qwen3_moe/pretrain_qwen3_30b_a3b_4k.yaml": Model(
        "qwen3_moe", 30.5 * B, 3.3 * B, "Qwen/Qwen3-30B-A3B card: 30.5B total, 3.3B activated"),
    "telechat3/pretrain_telechat3_36b.yaml": Model(
        "telechat3", 36 * B, None, "TeleChat3-36B (its name; HF Llama arithmetic: tests/mf_ds/test_telechat3.py)"),
    "telechat3_moe/pretrain_telechat3_105b_a4b_4k.yaml": TELECHAT3_MOE,
}
# The shape keys compared with MindFormers' own config (HF names, which the mcore config classes share).
SHAPE = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size", "head_dim",
         "tie_word_embeddings", "n_routed_experts", "num_experts", "num_experts_per_tok", "first_k_dense_replace",
         "moe_intermediate_size", "n_shared_experts", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
         "qk_nope_head_dim", "v_head_dim", "num_nextn_predict_layers", "n_group", "topk_group",
         "routed_scaling_factor", "norm_topk_prob")


GLM_NAMES = {"num_layers": "num_hidden_layers", "hidden_size": "hidden_size",
             "num_attention_heads": "num_attention_heads", "ffn_hidden_size": "intermediate_size",
             "padded_vocab_size": "vocab_size", "kv_channels": "head_dim"}  # ChatGLM2Config -> HF glm


def wheel_yamls() -> list:
    return [pytest.param(v, p.relative_to(WHEELS / v).as_posix(), id=f"{v}/{p.relative_to(WHEELS / v).as_posix()}")
            for v in VERSIONS for p in sorted((WHEELS / v).rglob("*.yaml"))]


def mf_config(version: str, rel: str) -> dict:
    """MindFormers' model config of a wheel YAML: make_mf_wheel_configs.py's, or for a PyNative-schema YAML the model
    config class make_pynative_golden.py built from its flat `model`."""
    found = json.loads((WHEELS / version / "mf_model_configs.json").read_text())["yamls"].get(rel)
    if found is None:
        golden = ROOT / "tests" / "fixtures" / "pynative_golden" / f"{version}.json"
        found = json.loads(golden.read_text())["yamls"][rel]["model_config"]
    return found


def counts(hf: dict) -> tuple[int, int]:
    """(total, activated) parameters of the HF model: a token runs top-k of the routed experts of each MoE layer."""
    weights = inventory(hf)
    total = sum(w.numel * w.count for w in weights)
    k = hf.get("num_experts_per_tok") or 0
    experts = next((hf[n] for n in ("n_routed_experts", "num_experts") if hf.get(n)), 0)
    idle = sum(w.numel * w.count * (experts - k) // experts for w in weights if w.name.endswith(".experts"))
    return total, total - idle


def test_every_wheel_yaml_has_a_row():
    assert {rel for _, rel in (p.values for p in wheel_yamls())} == set(EXPECT)
    assert [len(list((WHEELS / v).rglob("*.yaml"))) for v in VERSIONS] == [9, 15, 16, 20]


@pytest.mark.parametrize("version, rel", wheel_yamls())
def test_wheel_yaml(version, rel, tmp_path, capsys):
    expect = EXPECT[rel]
    plan_path = tmp_path / "plan.json"
    code = run([str(WHEELS / version / rel), "--plan", str(plan_path), "--mindformers-version", version])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    if isinstance(expect, Refused):
        assert code == 2 and out == ""
        errors = [line for line in err.splitlines() if line.startswith("mf-translate: error: ")]
        assert errors == [err.strip().splitlines()[-1]], err
        assert errors[0].startswith("mf-translate: error: " + expect.line), err
        return
    assert code == 0, err
    plan = json.loads(plan_path.read_text())
    assert plan["run"]["family"] == expect.family and plan["run"]["mindformers_version"] == version
    hf = plan["hf_config"]
    golden = mf_config(version, rel)
    theirs = golden["config"]
    if golden["class"] == "ChatGLM2Config":  # legacy GLM: its own names for the same shape
        theirs = {hf_name: theirs[name] for name, hf_name in GLM_NAMES.items()} | {
            "num_key_value_heads": theirs["multi_query_group_num"] if theirs["multi_query_attention"]
            else theirs["num_attention_heads"], "attention_bias": theirs["add_qkv_bias"]}
    else:  # the mcore classes use HF's names
        theirs = {**theirs, "num_key_value_heads": hf["num_key_value_heads"]}  # MLA: not read (test_mf_defaults)
    assert {k: hf.get(k) for k in SHAPE if k in theirs and k in hf} == \
           {k: theirs[k] for k in SHAPE if k in theirs and k in hf}
    if hf["model_type"] != "deepseek_v4":  # its count is checked against MindFormers' model built on CPU instead
        assert counts(hf) == counts({**theirs, "model_type": hf["model_type"]})  # (tests/translators/test_deepseek4)
    total, active = counts(hf)
    if expect.total:
        assert total == pytest.approx(expect.total, rel=0.01), expect.source
    if expect.active:
        assert active == pytest.approx(expect.active, rel=0.03), expect.source
    if "moe" in expect.family or expect.family == "deepseek_v3":
        assert plan["moe"] is not None and plan["moe"]["top_k"] == hf["num_experts_per_tok"]


@pytest.mark.parametrize("version", VERSIONS[1:])
def test_deepseek_v3_671b_is_mindformers_model(version):
    """DeepSeek-V3 671B mcore leaves the experts, top-k, dense layers and heads to DeepseekV3Config (256, 8, 3, 128);
    the main model is 671B (37B activated) and the MTP layer makes the card's 685B with its own embedding and head."""
    from translators.plan import translate_file

    plan = translate_file(str(WHEELS / version / "deepseek3/pretrain_deepseek3_671b.yaml"),
                          mindformers_version=version).json
    hf = plan["hf_config"]
    assert (hf["n_routed_experts"], hf["num_experts_per_tok"], hf["first_k_dense_replace"],
            hf["num_attention_heads"]) == (256, 8, 3, 128)
    assert plan["moe"]["num_experts"] == 256 and plan["moe"]["top_k"] == 8 and plan["moe"]["layers"][:2] == [3, 4]
    said = [n["message"] for n in plan["notes"] if n["key"] == "" and "leaves to DeepseekV3Config" in n["message"]]
    assert said == [f"model.model_config leaves to DeepseekV3Config of MindFormers {version}: num_attention_heads "
                    "128, n_routed_experts 256, num_experts_per_tok 8, first_k_dense_replace 3, n_shared_experts 1, "
                    "routed_scaling_factor 2.5, norm_topk_prob True, kv_lora_rank 512, q_lora_rank 1536, "
                    "qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128, tie_word_embeddings False"]
    assert hf["num_nextn_predict_layers"] == 1
    total, active = counts(hf)
    h, v = hf["hidden_size"], hf["vocab_size"]
    moe_layer = counts({**hf, "num_hidden_layers": 4, "first_k_dense_replace": 3})[0] \
        - counts({**hf, "num_hidden_layers": 3, "first_k_dense_replace": 3})[0]
    mtp = moe_layer + 2 * h * h + 3 * h + 2 * v * h  # a MoE layer, eh_proj, enorm/hnorm/head norm, embedding, head
    assert total == pytest.approx(671 * B, rel=0.005) and active == pytest.approx(37 * B, rel=0.03)
    assert total + mtp == pytest.approx(685 * B, rel=0.005)


def test_version_decides_and_is_recorded(tmp_path):
    """TeleChat3Config does not exist before 1.9.0: a telechat3 YAML said to come from 1.8.0 is refused; the newest
    version is the default and the Plan says which it took."""
    from translators.errors import ConfigError
    from translators.plan import translate_file

    with pytest.raises(ConfigError, match=r"TeleChat3Config does not exist in MindFormers 1\.8\.0"):
        translate_file(str(WHEELS / "2.1.0/telechat3/pretrain_telechat3_36b.yaml"), mindformers_version="1.8.0")
    with pytest.raises(ConfigError, match=r"^--mindformers-version: MindFormers 3\.0\.0: no config-class defaults"):
        translate_file(str(WHEELS / "2.1.0/qwen3/pretrain_qwen3_32b_4k.yaml"), mindformers_version="3.0")
    plan = translate_file(str(WHEELS / "2.1.0/qwen3/pretrain_qwen3_32b_4k.yaml")).json
    assert plan["run"]["mindformers_version"] == "2.1.0"


def test_glm4_moe_is_refused_as_mindformers_refuses_to_train_it():
    """The wheels carry only a predict YAML for GLM-4-MoE: MindFormers' Glm4MoeForCausalLM raises in train mode."""
    from translators.errors import ConfigError
    from translators.plan import translate

    tree = {"use_legacy": False, "runner_config": {"batch_size": 1},
            "model": {"model_config": {"model_type": "glm4_moe", "num_hidden_layers": 2, "head_dim": 128}}}
    with pytest.raises(ConfigError, match=r"^model\.model_config\.model_type: glm4_moe: MindFormers does not train "
                                          r"Glm4Moe \(Glm4MoeForCausalLM raises \"Train mode is not supported"):
        translate(tree)


# The published config.json of each model (the keys that shape it), for the finetune YAMLs' pretrained_model_dir.
DEEPSEEK_V3_JSON = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_nextn_predict_layers": 1, "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
    "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8,
    "topk_group": 4, "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3,
    "norm_topk_prob": True, "scoring_func": "sigmoid", "rms_norm_eps": 1e-06, "tie_word_embeddings": False,
    "max_position_embeddings": 163840, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"}}
QWEN3_32B_JSON = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 5120,
    "intermediate_size": 25600, "num_hidden_layers": 64, "num_attention_heads": 64, "num_key_value_heads": 8,
    "head_dim": 128, "rms_norm_eps": 1e-06, "rope_theta": 1000000, "tie_word_embeddings": False}


@pytest.mark.parametrize("rel, config_json, total, active", [
    ("deepseek3/finetune_deepseek3_671b.yaml", DEEPSEEK_V3_JSON, 671 * B, 37 * B),
    ("qwen3/finetune_qwen3.yaml", QWEN3_32B_JSON, 32.8 * B, None),
    ("general/llm_finetune_dense_template.yaml", QWEN3_32B_JSON, 32.8 * B, None)])
def test_finetune_yamls_with_their_model_dir(rel, config_json, total, active, tmp_path):
    """The YAMLs refused for want of pretrained_model_dir/config.json translate to the published model with it."""
    from translators.plan import translate_file

    (tmp_path / "config.json").write_text(json.dumps(config_json))
    plan = translate_file(str(WHEELS / "2.1.0" / rel), [f"pretrained_model_dir={tmp_path}"]).json
    got_total, got_active = counts(plan["hf_config"])
    assert got_total == pytest.approx(total, rel=0.01)
    if active:
        assert got_active == pytest.approx(active, rel=0.03)
    if "rope_scaling" in config_json:  # MindFormers' TransformerConfig flattens it: YaRN x40 over 4096 positions
        assert plan["hf_config"]["rope_parameters"] == {
            "rope_theta": 10000.0, "rope_type": "yarn", "factor": 40.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}


def test_rope_scaling_in_the_yaml_is_flattened_as_mindformers_does():
    """model_config.rope_scaling (a COMMON_CONFIG_MAPPING key) becomes the flat mcore keys in TransformerConfig:
    the 12B YAML written with DeepSeek-V3's rope_scaling dict instead of its flat YaRN keys."""
    from translators.loader import load_yaml
    from translators.plan import translate

    tree = load_yaml(str(WHEELS / "2.1.0/deepseek3/pretrain_deepseek3_12b_16p_pp16.yaml"))
    config = tree["model"]["model_config"]
    for key in ("position_embedding_type", "scaling_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
        del config[key]
    config["rope_scaling"] = DEEPSEEK_V3_JSON["rope_scaling"]
    result = translate(tree)
    assert result.json["hf_config"]["rope_parameters"] == {
        "rope_theta": 10000.0, "rope_type": "yarn", "factor": 40.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}
    notes = result.ledger.finish()
    assert [n.kind for n in notes if n.key == "model.model_config.rope_scaling"] == ["mapped"]
    assert not [n for n in notes if n.kind == "unknown" and "rope_scaling" in n.key]
