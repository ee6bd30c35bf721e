"""LoRA through PEFT where MindFormers puts it (mf_ds/lora.py).

The reference is MindFormers' own LoRA: 1.7.0's Trainer trained the shrunk llama2 finetune YAML with r1.5.0
lora_llama2_7b.yaml's pet_config (tests/fixtures/mindformers/run/lora_llama2_tiny.yaml) for 10 steps on CPU
(tests/fixtures/make_mindformers_lora_run.py), from init_lora.ckpt: the base weights plus initial adapters under
mindpet's names (`...attention.wq.mindpet_delta_lora_a`), which both programs load. mf-train logs the same loss,
learning rate and global norm (over the adapters only) at every step. Measured 2026-11-27: loss within 1.5e-6, norm
within 1.6e-6 relative, lr within 1e-10. MindFormers' full finetune from the same base weights is 0.18 away at step 3,
and its step-1 loss without the adapters (4.678958) is 0.025 from this run's (4.704437), so the tolerances of
test_mindformers_run.check_run tell a LoRA run from a full one and loaded adapters from fresh ones.

A shrunk Qwen3 (the PyNative tiny_qwen3_pynative.yaml with lora_config on linear_qkv / linear_proj, MindFormers'
names) trains only its adapters: the merged export differs from the base weights in q, k, v, o only, and the PEFT
export loads with PeftModel.from_pretrained onto the base and gives the merged model's logits.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.conftest import CPU_ENV, ROOT
from tests.mf_ds.test_mindformers_run import RUN, check_run, golden

LORA = RUN / "lora_llama2_tiny.yaml"
QWEN3 = ROOT / "tests" / "fixtures" / "pynative" / "tiny_qwen3_pynative.yaml"
QWEN3_LORA = "lora_config={lora_rank: 4, lora_alpha: 8, lora_b_std: 0.02, target_modules: 'linear_qkv|linear_proj'}"


def mf_train(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "mf_ds.cli", *args], cwd=ROOT, env=CPU_ENV, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_lora_equals_mindformers_own_lora_step_by_step(tmp_path):
    """mf-train on the YAML MindFormers trained with pet_config: MindFormers' loss, lr and global norm at each of the
    10 steps; the adapters it trained are the ones MindFormers' optimizer held (the golden's `trainable`)."""
    proc = mf_train(str(LORA), "--output_dir", str(tmp_path))
    reference = json.loads((RUN / "lora_llama2_tiny.golden.json").read_text())
    check_run(tmp_path / "metrics.jsonl", golden("lora_llama2_tiny"))
    assert "16 adapter tensors loaded" in proc.stderr
    assert len(reference["trainable"]) == 16 and all(n.endswith(("mindpet_delta_lora_a", "mindpet_delta_lora_b"))
                                                     for n in reference["trainable"])
    with open(tmp_path / "lora" / "adapter" / "adapter_config.json") as f:
        config = json.load(f)
    assert sorted(config["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert (config["r"], config["lora_alpha"]) == (4, 8)


def test_lora_under_zero3_and_resumed(tmp_path):
    """ZeRO-3 (the whole model built, then partitioned with its adapters by DeepSpeed): MindFormers' first 5 steps;
    stopped there and resumed from the checkpoint (PEFT adapters, DeepSpeed state): its last 5."""
    steps = golden("lora_llama2_tiny")
    mf_train(str(LORA), "--output_dir", str(tmp_path), "--max_steps", "5", "--set", "mf_ds.zero_stage=3")
    check_run(tmp_path / "metrics.jsonl", steps[:5])
    assert (tmp_path / "checkpoint" / "llama2_7b-step5" / "adapter_model.safetensors").is_file()
    mf_train(str(LORA), "--output_dir", str(tmp_path), "--resume_training", "--set", "mf_ds.zero_stage=3")
    check_run(tmp_path / "metrics.jsonl", steps)


def test_lora_under_the_hf_trainer(tmp_path):
    """examples/hf_trainer.py (the HF Trainer, ZeRO-2): MindFormers' first 3 steps; the Trainer saves PEFT's
    layout."""
    proc = subprocess.run([sys.executable, "examples/hf_trainer.py", str(LORA), "--max_steps", "3", "--output_dir",
                           str(tmp_path)], cwd=ROOT, env=CPU_ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_run(tmp_path / "metrics.jsonl", golden("lora_llama2_tiny")[:3])
    assert (tmp_path / "final" / "adapter_config.json").is_file()


@pytest.fixture(scope="module")
def qwen3_run(tmp_path_factory):
    """The shrunk Qwen3 with lora_config, from a saved random base, 3 steps."""
    from mf_ds.data import write_indexed
    from mf_ds.model import hf_config, new_model
    from translators.plan import translate_file

    tmp = tmp_path_factory.mktemp("qwen3_lora")
    rng = torch.Generator().manual_seed(0)
    docs = [[3 + (int(s) + i) % 297 for i in range(64)] for s in torch.randint(3, 300, (40,), generator=rng)]
    write_indexed(str(tmp / "corpus_text_document"), docs)
    torch.manual_seed(1)
    new_model(hf_config(translate_file(str(QWEN3)).plan)).save_pretrained(str(tmp / "base"))
    proc = mf_train(str(QWEN3), "--output_dir", str(tmp / "out"), "--max_steps", "3", "--set",
                    f"train_dataset.dataloader.config.data_path=['1', '{tmp / 'corpus_text_document'}']",
                    "--set", QWEN3_LORA, "--set", f"checkpoint.load_path={tmp / 'base'}")
    return tmp, proc.stderr


def test_qwen3_lora_trains_only_its_adapters(qwen3_run):
    from safetensors.torch import load_file

    tmp, log = qwen3_run
    assert "8 adapters of rank 4, alpha 8 on linear_proj, linear_qkv (MindFormers' names)" in log
    base = load_file(str(tmp / "base" / "model.safetensors"))
    merged = load_file(str(tmp / "out" / "lora" / "merged" / "model.safetensors"))
    assert set(base) == set(merged)
    changed = {k for k in base if not torch.equal(base[k], merged[k])}
    assert changed == {f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(2) for p in "qkvo"}


def test_qwen3_adapters_load_back_with_peft(qwen3_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tmp, _ = qwen3_run
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tmp / "base")),
                                           str(tmp / "out" / "lora" / "adapter"))
    merged = AutoModelForCausalLM.from_pretrained(str(tmp / "out" / "lora" / "merged"))
    base = AutoModelForCausalLM.from_pretrained(str(tmp / "base"))
    x = torch.randint(3, 300, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours, folded, plain = peft_model(x).logits, merged(x).logits, base(x).logits
    torch.testing.assert_close(ours, folded, rtol=0, atol=1e-5)
    assert (ours - plain).abs().max() > 1e-3  # the adapters trained


def test_a_lora_checkpoint_without_pet_config_is_refused(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mf_ds.cli", str(RUN / "finetune_llama2_tiny.yaml"), "--output_dir",
                           str(tmp_path), "--set", f"load_checkpoint={RUN / 'init_lora.ckpt'}", "--max_steps", "1"],
                          cwd=ROOT, env=CPU_ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "mindpet_delta_lora_a is a LoRA adapter; set model.model_config.pet_config" in proc.stderr


# MindFormers' module names and rules, without a run.

def test_graph_mode_rule_is_recursive_replace_dense_cell():
    """re.match on each child's own name from the root; the first match decides (a non-Linear match hides all below
    it, as MindFormers' loop `continue`s without descending); exclude_layers hides a subtree."""
    from mf_ds.lora import _graph_match

    wq = "model.layers.0.attention.wq"
    assert _graph_match(wq, ".*wq|.*wk|.*wv|.*wo", ())
    assert not _graph_match("model.layers.0.feed_forward.w1", ".*wq|.*wk|.*wv|.*wo", ())
    assert not _graph_match(wq, ".*attention", ())  # the attention cell matches first and is not a Linear
    assert not _graph_match(wq, "wq", ("layers",))
    assert _graph_match(wq, "w", ())  # re.match: a prefix of the name is enough


def test_pynative_rule_is_replace_modules():
    """re.search on the dotted path; a matching non-Linear is descended into; exclude_layers searched on every
    prefix of the path."""
    from mf_ds.lora import _pynative_match

    qkv = "decoder.layers.1.self_attention.linear_qkv"
    assert _pynative_match(qkv, "linear_qkv", ())
    assert _pynative_match(qkv, "self_attention", ())
    assert not _pynative_match(qkv, "linear_qkv", (r"layers\.1",))


def test_mindformers_names_of_hf_modules():
    from mf_ds.lora import hf_modules, mf_module

    assert mf_module("model.layers.0.self_attn.q_proj", "llama") == "model.layers.0.attention.wq"
    assert mf_module("model.layers.0.mlp.gate_proj", "llama") == "model.layers.0.feed_forward.w1"
    assert mf_module("model.layers.0.self_attn.v_proj", "qwen3/mcore") == "decoder.layers.0.self_attention.linear_qkv"
    assert mf_module("model.layers.0.mlp.down_proj", "qwen3/mcore") == "decoder.layers.0.mlp.linear_fc2"
    assert hf_modules("decoder.layers.0.self_attention.linear_qkv", "qwen3/mcore") == \
        [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]


def _llama_lora():
    from mf_ds import lora
    from mf_ds.model import build_model
    from translators.plan import translate_file

    plan = translate_file(str(LORA)).plan
    weights = str(RUN / "init_lora.ckpt")
    return plan, lora.attach(build_model(plan, weights, full_reason="test"), plan, weights)


def test_mindpet_adapters_read_and_written_back_bit_for_bit():
    """init_lora.ckpt's adapters (mindpet's names) into the PEFT model, then out under mindpet's names again."""
    from mf_ds import lora, lora_export
    from mf_ds.checkpoint.mindspore_ckpt import mindformers_weights

    plan, model = _llama_lora()
    state = {k: v for k, v in model.state_dict().items() if ".lora_" in k}
    written = dict(lora_export.to_mindformers(state, plan, model.config))
    given = {n: load() for n, _, load in mindformers_weights(str(RUN / "init_lora.ckpt")) if lora.is_adapter(n)}
    assert sorted(written) == sorted(given) and len(given) == 16
    for name, tensor in given.items():
        assert torch.equal(written[name], tensor), name
    assert {n for n, p in model.named_parameters() if p.requires_grad} == \
        {n for n in model.state_dict() if ".lora_" in n}


def test_fused_linear_qkv_adapter_round_trip():
    """mcore's linear_qkv adapter: its A to q, k and v, B's rows split as the fused weight's (per KV group); back to
    one adapter when the three A agree, refused in one line when they differ."""
    from mf_ds import lora_export
    from mf_ds.errors import RunError
    from mf_ds.model import hf_config
    from translators.plan import translate_file

    plan = translate_file(str(QWEN3), [QWEN3_LORA]).plan
    config = hf_config(plan)
    rows = (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim
    a, b = torch.randn(4, config.hidden_size), torch.randn(rows, 4)
    peft = {f"base_model.model.model.layers.0.self_attn.{p}_proj.lora_A.weight": a for p in "qkv"}
    peft |= {f"base_model.model.model.layers.0.self_attn.{p}_proj.lora_B.weight": part
             for p, part in zip("qkv", _split_rows(b, config), strict=True)}
    back = dict(lora_export.to_mindformers(peft, plan, config))
    assert torch.equal(back["decoder.layers.0.self_attention.linear_qkv.lora_a"], a)
    assert torch.equal(back["decoder.layers.0.self_attention.linear_qkv.lora_b"], b)
    peft["base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"] = a + 1
    with pytest.raises(RunError, match="parts' A differ"):
        dict(lora_export.to_mindformers(peft, plan, config))


def _split_rows(b, config):
    from mf_ds.weights import WeightLayout, to_hf

    pieces = to_hf("decoder.layers.0.self_attention.linear_qkv.weight", b, "qwen3/mcore", config, WeightLayout())
    return [p.tensor for p in pieces]


def test_mf_convert_lora_both_ways(tmp_path):
    """mf-convert: the MindFormers LoRA checkpoint -> HF weights + PEFT adapters (PeftModel.from_pretrained gives
    the logits of mf-train's model from the same checkpoint) -> back to mindpet's names, bit for bit."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from mf_ds.checkpoint.mindspore_ckpt import mindformers_weights

    def convert(src, dst):
        proc = subprocess.run([sys.executable, "-m", "mf_ds.convert", "--mf-config", str(LORA), str(src), str(dst)],
                              cwd=ROOT, env=CPU_ENV, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(proc.stdout)

    assert convert(RUN / "init_lora.ckpt", tmp_path / "hf")["adapters"] == 16
    assert convert(tmp_path / "hf" / "adapter", tmp_path / "back.ckpt")["tensors"] == 16
    given = {n: load() for n, _, load in mindformers_weights(str(RUN / "init_lora.ckpt")) if "mindpet" in n}
    back = {n: load() for n, _, load in mindformers_weights(str(tmp_path / "back.ckpt"))}
    assert sorted(back) == sorted(given) and all(torch.equal(back[n], given[n]) for n in given)
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")),
                                           str(tmp_path / "hf" / "adapter"))
    _, ours = _llama_lora()
    x = torch.randint(3, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(peft_model(x).logits, ours(x).logits, rtol=0, atol=1e-6)


def test_what_lora_cannot_place_is_one_line():
    """PyNative's regex reaching the routed experts (GroupedMLPWithLoRA in MindFormers; fused parameters in HF), a
    regex matching no Linear, and a family without MindFormers' weight names: RunError, before any training."""
    from mf_ds.errors import RunError
    from mf_ds.lora import targets
    from mf_ds.model import hf_config, new_model
    from translators.plan import translate_file
    from translators.plan_types import Lora

    plan = translate_file(str(ROOT / "configs" / "tiny_qwen3_moe.yaml")).plan
    model = new_model(hf_config(plan))
    with pytest.raises(RunError, match="matches the routed experts"):
        targets(model, Lora(style="pynative", target_modules="mlp"), plan.weights_family, plan)
    kept = targets(model, Lora(style="pynative", target_modules="mlp|linear_proj", exclude_layers=("experts",)),
                   plan.weights_family, plan)
    assert sorted(kept) == [f"model.layers.{i}.self_attn.o_proj" for i in range(plan.hf_config["num_hidden_layers"])]
    with pytest.raises(RunError, match="matches no Linear layer"):
        targets(model, Lora(style="mcore", target_modules="wq"), plan.weights_family, plan)
    with pytest.raises(RunError, match="no MindFormers weight-name table"):
        targets(model, Lora(style="pynative", target_modules="x"), "glm4_moe/mcore")
