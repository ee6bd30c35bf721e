"""TeleChat3 (mcore) is HF Llama: MindFormers 2.1.0's own graph-mode TrainingTeleChat3ForCausalLM on CPU
(tests/fixtures/make_telechat3_golden.py) and transformers' LlamaForCausalLM built from mf-translate's HF config,
with the weights mf-convert turns MindFormers' checkpoint into, give the same logits; and mf-convert writes the
checkpoint back bit for bit.

mha_core (float32 end to end) agrees to 4e-6. gqa_flash is the 36B YAML's attention: GQA under FlashAttention, for
which MindFormers casts q, k and v to float16 (parallel_core/training_graph/transformer/attention.py); HF with the
same casts agrees to 3e-4 (a float16 rounding flipped by float32 noise moves a logit by up to that), HF as is to
1.3e-3. A wrong mapping is O(1) off (gate and up exchanged: 1.5)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from mf_ds.convert import to_hf, to_mindformers
from tests.conftest import ROOT
from translators.errors import ConfigError
from translators.loader import load_yaml
from translators.plan import translate, translate_file

HERE = ROOT / "tests" / "fixtures" / "telechat3"


def _fp16_qkv(module, query, key, value, attention_mask, **kwargs):
    """SDPA after MindFormers' casts around FlashAttentionScore: q, k, v to float16, the output float16."""
    r = lambda t: t.to(torch.float16).to(t.dtype)  # noqa: E731
    out, weights = sdpa_attention_forward(module, r(query), r(key), r(value), attention_mask, **kwargs)
    return r(out), weights


AttentionInterface.register("mf_fp16_qkv", _fp16_qkv)


def test_translates_to_llama():
    plan = translate_file(str(HERE / "gqa_flash.yaml")).plan
    hf = plan.hf_config
    assert plan.run.family == "telechat3" and hf["model_type"] == "llama"
    assert (hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"], hf["tie_word_embeddings"]) == \
        (4, 2, 16, False)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("telechat3")
    result = {}
    for name in ("gqa_flash", "mha_core"):
        plan = translate_file(str(HERE / f"{name}.yaml")).plan
        counts = to_hf(plan, str(HERE / f"{name}.safetensors"), str(out / name))
        assert counts == {"loaded": 21, "skipped": 0}  # 15 MindFormers tensors: q/k/v and gate/up apart in HF
        result[name] = plan, out / name
    return result


@pytest.mark.parametrize("name, attention, atol", [("mha_core", "sdpa", 1e-5), ("gqa_flash", "mf_fp16_qkv", 5e-4),
                                                   ("gqa_flash", "sdpa", 2e-3)])
def test_logits_equal_mindformers(converted, name, attention, atol):
    _, hf_dir = converted[name]
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), local_files_only=True, attn_implementation=attention)
    model.eval()
    assert type(model).__name__ == "LlamaForCausalLM"
    golden = load_file(str(HERE / f"{name}.golden.safetensors"))
    with torch.no_grad():
        logits = model(golden["input_ids"]).logits
    torch.testing.assert_close(logits, golden["logits"], atol=atol, rtol=0)
    with torch.no_grad():  # the check can fail: gate and up exchanged is far off
        for layer in model.model.layers:
            gate, up = layer.mlp.gate_proj.weight.clone(), layer.mlp.up_proj.weight.clone()
            layer.mlp.gate_proj.weight.copy_(up)
            layer.mlp.up_proj.weight.copy_(gate)
        assert (model(golden["input_ids"]).logits - golden["logits"]).abs().max() > 0.1


@pytest.mark.parametrize("name", ["gqa_flash", "mha_core"])
def test_weights_back_bit_for_bit(converted, name, tmp_path):
    plan, hf_dir = converted[name]
    to_mindformers(plan, str(hf_dir), str(tmp_path / "back.safetensors"))
    source, back = load_file(str(HERE / f"{name}.safetensors")), load_file(str(tmp_path / "back.safetensors"))
    assert back.keys() == source.keys() and all(torch.equal(back[k], source[k]) for k in source)


@pytest.mark.parametrize("key, value, message", [
    ("qk_layernorm", True, "qk_layernorm: True: TeleChat3 with q/k norms is not HF Llama"),
    ("multi_latent_attention", True, "multi_latent_attention: True: TeleChat3 with multi-latent attention"),
    ("n_routed_experts", 8, "n_routed_experts: TeleChat3 with MoE layers is not HF Llama")])
def test_what_llama_is_not_is_refused(key, value, message):
    tree = load_yaml(str(HERE / "gqa_flash.yaml"))
    tree["model"]["model_config"][key] = value
    with pytest.raises(ConfigError, match=rf"^model\.model_config\.{message}"):
        translate(tree)
