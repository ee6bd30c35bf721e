"""mf-convert (mf_ds/convert.py) both ways on the MindFormers fixtures: the HF directory gives MindFormers' logits,
and converting back gives MindSpore's tensors bit for bit, in a .ckpt laid out as save_checkpoint lays it out.
(By hand, once, with MindSpore 2.7.2: mindspore.load_checkpoint reads both outputs back bit for bit.)"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from mf_ds.checkpoint.mindspore_ckpt import MindSporeCheckpoint
from mf_ds.convert import cli, to_hf, to_mindformers
from mf_ds.errors import RunError
from tests.conftest import ROOT
from tests.mf_ds.test_mindspore_ckpt import MF, TINY, golden, weights_of
from translators.plan import translate_file
from translators.plan_types import Plan


def plan_for(family: str, gmm: bool = False) -> Plan:
    """The llama fixture's Plan comes from the tiny finetune YAML; the others' HF configs are written out by hand."""
    if family == "llama":
        return translate_file(str(TINY)).plan
    c = golden(family)[0]["config"]
    moe = {}
    if family == "mixtral":  # MindFormers' MoEConfig: expert_num, num_experts_chosen; HF Mixtral renormalises top-k
        moe = {"num_local_experts": c["moe_config"]["expert_num"],
               "num_experts_per_tok": c["moe_config"]["num_experts_chosen"], "router_jitter_noise": 0.0}
    if family == "qwen2_moe":  # legacy MoE: routed and shared experts are intermediate_size wide
        moe = {"num_experts": c["moe_config"]["expert_num"],
               "num_experts_per_tok": c["moe_config"]["num_experts_chosen"],
               "norm_topk_prob": c["moe_config"]["norm_topk_prob"], "moe_intermediate_size": c["intermediate_size"],
               "shared_expert_intermediate_size": c["intermediate_size"], "decoder_sparse_step": 1,
               "mlp_only_layers": []}
    hf = {"model_type": family, "hidden_size": c["hidden_size"], "intermediate_size": c["intermediate_size"],
          "num_hidden_layers": c["num_layers"], "num_attention_heads": c["num_heads"],
          "num_key_value_heads": c["n_kv_heads"], "vocab_size": c["vocab_size"], "rms_norm_eps": c["rms_norm_eps"],
          "rope_theta": c["theta"], "max_position_embeddings": c["seq_length"], "tie_word_embeddings": False, **moe}
    return Plan.from_json({"hf_config": hf, "run": {"family": family, "checkpoint_layout": {"use_gmm": gmm}}},
                          partial=True)


# mixtral, qwen2_moe: 3 projections x 4 experts apart in each layer
HF_TENSORS = {"llama": 21, "qwen2": 27, "mixtral": 41, "qwen2_moe": 55}


@pytest.mark.parametrize("family", ["llama", "qwen2", "mixtral", "qwen2_moe"])
def test_both_ways(tmp_path, family):
    plan = plan_for(family)
    assert to_hf(plan, str(MF / family / "model.ckpt"), str(tmp_path / "hf")) == {
        "loaded": HF_TENSORS[family], "skipped": 2}
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), local_files_only=True).eval()
    _, arrays = golden(family)
    ids = torch.from_numpy(arrays["input_ids"][:, :16].astype(np.int64))
    with torch.no_grad():
        logits = model(ids, attention_mask=(ids != 0).long()).logits
    np.testing.assert_allclose(logits.numpy(), arrays["logits"], atol=1e-5, rtol=0)

    assert to_mindformers(plan, str(tmp_path / "hf"), str(tmp_path / "back.ckpt")) == len(weights_of(family))
    source, back = MindSporeCheckpoint(MF / family / "model.ckpt"), MindSporeCheckpoint(tmp_path / "back.ckpt")
    assert set(back.names()) == set(weights_of(family))
    for name in back.names():
        assert back.entries[name].dtype == source.entries[name].dtype
        assert back.tensor(name).numpy().tobytes() == source.tensor(name).numpy().tobytes(), name

    to_mindformers(plan, str(tmp_path / "hf"), str(tmp_path / "back.safetensors"))
    mindspore_file = load_file(str(MF / family / "model.safetensors"))
    ours = load_file(str(tmp_path / "back.safetensors"))
    assert ours.keys() == mindspore_file.keys() and all(torch.equal(ours[k], mindspore_file[k]) for k in ours)
    with safe_open(str(tmp_path / "back.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "ms"}


@pytest.mark.parametrize("family,w1", [("mixtral", "model.layers.0.feed_forward.ffn.w1.weight"),
                                       ("qwen2_moe", "model.layers.0.feed_forward.routed_experts.ffn.w1.weight")])
def test_moe_grouped_matmul_layout(tmp_path, family, w1):
    """use_gmm experts ([E, in, out], research/mixtral and research/qwen2 convert_ms_to_gmm) give the same HF
    tensors, and go back to the gmm layout bit for bit."""
    to_hf(plan_for(family), str(MF / family / "model.ckpt"), str(tmp_path / "plain"))
    plan = plan_for(family, gmm=True)
    to_hf(plan, str(MF / family / "model_gmm.ckpt"), str(tmp_path / "gmm"))
    plain, gmm = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("plain", "gmm"))
    assert plain.keys() == gmm.keys() and all(torch.equal(plain[k], gmm[k]) for k in plain)
    to_mindformers(plan, str(tmp_path / "gmm"), str(tmp_path / "back.ckpt"))
    source, back = MindSporeCheckpoint(MF / family / "model_gmm.ckpt"), MindSporeCheckpoint(tmp_path / "back.ckpt")
    assert back.entries[w1].dims == (4, 16, 32)
    assert set(back.names()) == set(weights_of(family))
    assert all(torch.equal(back.tensor(n), source.tensor(n)) for n in back.names())


def mcore_plan(family: str, **layout) -> Plan:
    run = {"family": family, "layer_style": "mcore", "checkpoint_layout": layout}
    return Plan.from_json({"hf_config": golden(family)[0]["hf_config"], "run": run}, partial=True)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_mcore_both_ways(tmp_path, family):
    """mcore checkpoints (written by MindFormers' own convert_weight_dict from an HF model: fused linear_qkv per KV
    group, linear_fc1 interleaved, experts stacked in weight1 / weight2) give the HF model's logits back, and the
    HF directory converts back to MindFormers' tensors bit for bit."""
    plan = mcore_plan(family)
    counts = to_hf(plan, str(MF / family / "model.ckpt"), str(tmp_path / "hf"))
    assert counts == {"loaded": {"qwen3": 25, "qwen3_moe": 45}[family], "skipped": 0}
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), local_files_only=True).eval()
    _, arrays = golden(family)
    with torch.no_grad():
        logits = model(torch.from_numpy(arrays["input_ids"].astype(np.int64))).logits
    np.testing.assert_allclose(logits.numpy(), arrays["logits"], atol=1e-5, rtol=0)
    assert to_mindformers(plan, str(tmp_path / "hf"), str(tmp_path / "back.ckpt")) == len(golden(family)[0]["params"])
    source, back = MindSporeCheckpoint(MF / family / "model.ckpt"), MindSporeCheckpoint(tmp_path / "back.ckpt")
    assert set(back.names()) == set(source.names())
    assert all(torch.equal(back.tensor(n), source.tensor(n)) for n in back.names())


def test_mcore_other_layouts_round_trip(tmp_path):
    """The non-default switches (use_contiguous_weight_layout_attention: True, use_interleaved_weight_layout_mlp:
    False) write q;k;v and gate;up one after the other, and read back to the same HF tensors."""
    to_hf(mcore_plan("qwen3"), str(MF / "qwen3" / "model.ckpt"), str(tmp_path / "hf"))
    plan = mcore_plan("qwen3", use_contiguous_weight_layout_attention=True, use_interleaved_weight_layout_mlp=False)
    to_mindformers(plan, str(tmp_path / "hf"), str(tmp_path / "flat.ckpt"))
    hf = load_file(str(tmp_path / "hf" / "model.safetensors"))
    flat = MindSporeCheckpoint(tmp_path / "flat.ckpt")
    attn, mlp = "model.layers.1.self_attn.", "model.layers.1.mlp."
    assert torch.equal(flat.tensor("decoder.layers.1.self_attention.linear_qkv.weight"),
                       torch.cat([hf[attn + p + "_proj.weight"] for p in "qkv"]))
    assert torch.equal(flat.tensor("decoder.layers.1.mlp.linear_fc1.weight"),
                       torch.cat([hf[mlp + "gate_proj.weight"], hf[mlp + "up_proj.weight"]]))
    to_hf(plan, str(tmp_path / "flat.ckpt"), str(tmp_path / "hf2"))
    again = load_file(str(tmp_path / "hf2" / "model.safetensors"))
    assert again.keys() == hf.keys() and all(torch.equal(again[k], hf[k]) for k in hf)


@pytest.mark.parametrize("file,gmm,n_mtp", [("model.ckpt", True, 23), ("model_bmm.ckpt", False, 24)])
def test_deepseek_v3_both_ways(tmp_path, file, gmm, n_mtp):
    """Legacy DeepSeek-V3 (written by research/deepseek3/convert_weight.py's own functions from an HF model): MLA
    halves (q_b, kv_a with their rope rows reordered, kv_b), shared experts, router bias, routed experts in the
    grouped-matmul or the batched layout. The MTP layer is skipped (transformers builds none) and not written back."""
    g, arrays = golden("deepseek_v3")
    plan = Plan.from_json({"hf_config": g["hf_config"], "run": {"family": "deepseek_v3", "layer_style": "deepseek",
                                                                "checkpoint_layout": {"use_gmm": gmm}}}, partial=True)
    counts = to_hf(plan, str(MF / "deepseek_v3" / file), str(tmp_path / "hf"))
    assert counts == {"loaded": 47, "skipped": 0, "mtp_skipped": n_mtp}  # 41 HF tensors, 3 of them per layer in 2 parts
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), local_files_only=True).eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(arrays["input_ids"].astype(np.int64))).logits
    np.testing.assert_allclose(logits.numpy(), arrays["logits"], atol=1e-5, rtol=0)
    to_mindformers(plan, str(tmp_path / "hf"), str(tmp_path / "back.ckpt"))
    source, back = MindSporeCheckpoint(MF / "deepseek_v3" / file), MindSporeCheckpoint(tmp_path / "back.ckpt")
    mtp = {n for n in source.names() if n.startswith(("model.mtp_", "model.layers.2."))}
    # beside the router bias, the network's expert_load counter (zeros), which the converter does not write
    load = {n.replace(".topk_bias", ".expert_load") for n in source.names()
            if n.endswith(".topk_bias") and n not in mtp}
    assert len(mtp) == n_mtp and len(load) == 1 and set(back.names()) == (set(source.names()) - mtp) | load
    assert all(torch.equal(back.tensor(n), source.tensor(n)) for n in back.names() if n not in load)
    assert all(not back.tensor(n).any() for n in load)


@pytest.mark.parametrize("family", ["qwen2", "qwen2_moe"])
def test_legacy_qkv_concat(tmp_path, family):
    """qkv_concat: True (LlamaConfig; it fuses gate/up too): HF -> attention.w_qkv (weight and bias, per KV group,
    mindformers/utils/convert_utils.py qkv_concat_hf2mg) and feed_forward.w_gate_hidden (dense layers), which read
    back to the same HF tensors."""
    to_hf(plan_for(family), str(MF / family / "model.ckpt"), str(tmp_path / "hf"))
    plan = plan_for(family)
    plan = dataclasses.replace(plan, run=dataclasses.replace(
        plan.run, checkpoint_layout=dataclasses.replace(plan.run.checkpoint_layout, qkv_concat=True)))
    to_mindformers(plan, str(tmp_path / "hf"), str(tmp_path / "fused.ckpt"))
    fused = MindSporeCheckpoint(tmp_path / "fused.ckpt")
    assert "model.layers.0.attention.w_qkv.bias" in fused.names()
    assert not any(".attention.wq." in n or ".attention.wk." in n for n in fused.names())
    assert ("model.layers.0.feed_forward.w_gate_hidden.weight" in fused.names()) == (family == "qwen2")
    to_hf(plan, str(tmp_path / "fused.ckpt"), str(tmp_path / "again"))
    hf, again = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("hf", "again"))
    assert again.keys() == hf.keys() and all(torch.equal(again[k], hf[k]) for k in hf)


def glm_plan(**layout) -> Plan:
    c = golden("glm4")[0]["config"]
    hf = {"model_type": "glm", "hidden_size": c["hidden_size"], "intermediate_size": c["ffn_hidden_size"],
          "num_hidden_layers": c["num_layers"], "num_attention_heads": c["num_attention_heads"],
          "num_key_value_heads": c["multi_query_group_num"], "head_dim": c["kv_channels"],
          "vocab_size": c["padded_vocab_size"], "rms_norm_eps": c["layernorm_epsilon"], "attention_bias": True,
          "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0 * c["rope_ratio"],
                              "partial_rotary_factor": 0.5},
          "max_position_embeddings": c["seq_length"], "pad_token_id": 0, "tie_word_embeddings": False}
    run = {"family": "glm4", "layer_style": "glm", "checkpoint_layout": layout}
    return Plan.from_json({"hf_config": hf, "run": run}, partial=True)


@pytest.mark.parametrize("file,concat", [("model.ckpt", True), ("model_split.ckpt", False)])
def test_glm_both_ways(tmp_path, file, concat):
    """ChatGLM2ForConditionalGeneration's weights (GLM-4-9B's classes; query_key_value q;k;v, dense_h_to_4h
    gate;up, or split by glm2/convert_weight.py) -> transformers' `glm`: MindFormers' logits; and back bit for bit
    (the paged-attention caches MindFormers saves beside them are not weights)."""
    plan = glm_plan(qkv_concat=concat, mlp_concat=concat)
    counts = to_hf(plan, str(MF / "glm4" / file), str(tmp_path / "hf"))
    assert counts == {"loaded": 25 if concat else 27, "skipped": 4}  # split: gate_up_proj from 2 halves per layer
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), local_files_only=True).eval()
    _, arrays = golden("glm4")
    with torch.no_grad():
        logits = model(torch.from_numpy(arrays["input_ids"][:, :16].astype(np.int64))).logits
    # measured: 2044 of the 2048 logits within 1e-5; the 4 others, all at batch 1 position 7, by up to 1.42e-5
    # (float32 sums in another order; the logits are of size 1 to 4)
    np.testing.assert_allclose(logits.numpy(), arrays["logits"], atol=2e-5, rtol=0)
    to_mindformers(plan, str(tmp_path / "hf"), str(tmp_path / "back.ckpt"))
    source, back = MindSporeCheckpoint(MF / "glm4" / file), MindSporeCheckpoint(tmp_path / "back.ckpt")
    assert set(back.names()) == {n for n in source.names() if "paged_attention_mgr" not in n}
    assert all(torch.equal(back.tensor(n), source.tensor(n)) for n in back.names())


def test_glm_rearranged_rope_is_refused(tmp_path):
    with pytest.raises(RunError, match="use_rearrange_rope: True"):
        to_hf(glm_plan(use_rearrange_rope=True), str(MF / "glm4" / "model.ckpt"), str(tmp_path / "hf"))


def test_ckpt_layout_is_save_checkpoints(tmp_path):
    """The same messages as mindspore.save_checkpoint(net): the file is exactly model_crc.ckpt less its 17-byte
    CRC trailer in size (the order of the parameters is HF's, sorted)."""
    plan = plan_for("llama")
    to_hf(plan, str(MF / "llama" / "model.ckpt"), str(tmp_path / "hf"))
    to_mindformers(plan, str(tmp_path / "hf"), str(tmp_path / "back.ckpt"))
    assert (tmp_path / "back.ckpt").stat().st_size == (MF / "llama" / "model_crc.ckpt").stat().st_size - 17


def test_bfloat16_keeps_its_bits(tmp_path):
    plan = plan_for("llama")
    to_hf(plan, str(MF / "llama" / "model_bf16.ckpt"), str(tmp_path / "hf"))
    assert {t.dtype for t in load_file(str(tmp_path / "hf" / "model.safetensors")).values()} == {torch.bfloat16}
    to_mindformers(plan, str(tmp_path / "hf"), str(tmp_path / "back.ckpt"))
    source, back = MindSporeCheckpoint(MF / "llama" / "model_bf16.ckpt"), MindSporeCheckpoint(tmp_path / "back.ckpt")
    for name in back.names():
        assert back.entries[name].dtype == "BFloat16" and torch.equal(back.tensor(name).view(torch.int16),
                                                                      source.tensor(name).view(torch.int16))


def test_cli(tmp_path, capsys):
    assert cli(["--mf-config", str(TINY), str(MF / "llama" / "model.ckpt"), str(tmp_path / "hf")]) == 0
    assert json.loads(capsys.readouterr().out) == {"direction": "mindformers->hf", "loaded": 21, "skipped": 2,
                                                   "output": str(tmp_path / "hf")}
    assert cli(["--mf-config", str(TINY), str(tmp_path / "hf"), str(tmp_path / "x.bin")]) == 2
    err = capsys.readouterr().err
    assert err == (f"mf-convert: error: {tmp_path / 'x.bin'}: the MindFormers output must end in .ckpt or "
                   ".safetensors, or be a directory (Checkpoint 2.0)\n")
    assert cli(["--mf-config", str(TINY), str(MF / "qwen2" / "model.ckpt"), str(tmp_path / "q")]) == 2
    assert "is not a weight of this llama model" in capsys.readouterr().err


@pytest.mark.parametrize("family,file", [("mixtral", "model_gmm.ckpt"), ("qwen2_moe", "model.ckpt"),
                                         ("deepseek_v3", "model.ckpt"), ("glm4", "model_split.ckpt"),
                                         ("qwen3_moe", "model.ckpt")])
def test_load_into_a_live_model(tmp_path, family, file):
    """What mf-train's load_checkpoint does (build_model): the tensors go straight into transformers' fused
    parameters (experts.gate_up_proj [E, 2I, H], q_b_proj from its two MindFormers halves, ...), the same model
    from_pretrained makes of mf-convert's HF directory."""
    from mf_ds.checkpoint.mindspore_ckpt import load_into
    from mf_ds.model import build_model
    from mf_ds.weights import layout_of

    plans = {"mixtral": lambda: plan_for("mixtral", gmm=True), "qwen2_moe": lambda: plan_for("qwen2_moe"),
             "glm4": lambda: glm_plan(qkv_concat=False, mlp_concat=False),
             "qwen3_moe": lambda: mcore_plan("qwen3_moe"),
             "deepseek_v3": lambda: Plan.from_json({"hf_config": golden("deepseek_v3")[0]["hf_config"],
                                                    "run": {"family": "deepseek_v3", "layer_style": "deepseek",
                                                            "checkpoint_layout": {"use_gmm": True}}}, partial=True)}
    plan = plans[family]()
    to_hf(plan, str(MF / family / file), str(tmp_path / "hf"))
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), local_files_only=True)
    model = build_model(plan)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))  # poisoned: every element must be written
    family_key = plan.weights_family
    load_into(model, MF / family / file, family_key, layout=layout_of(plan))
    expected = reference.state_dict()
    assert all(torch.equal(t, expected[n]) for n, t in model.state_dict().items()), family
    built = build_model(plan, str(MF / family / file)).state_dict()  # mf-train's own path, the layout from the Plan
    assert all(torch.equal(t, expected[n]) for n, t in built.items())


def test_cli_round_trip_on_an_mcore_yaml(tmp_path, capsys):
    """configs/tiny_qwen3_moe.yaml through the translator: its Plan names the mcore table and layout; an HF
    directory -> .ckpt (MindFormers' mcore names, experts stacked) -> HF again, the same tensors."""
    from mf_ds.model import hf_config

    yaml = str(ROOT / "configs" / "tiny_qwen3_moe.yaml")
    plan = translate_file(yaml).plan
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(hf_config(plan), dtype=torch.float32).save_pretrained(str(tmp_path / "hf"))
    capsys.readouterr()  # what the libraries printed so far (DeepSpeed's first accelerator line goes to stdout)
    assert cli(["--mf-config", yaml, str(tmp_path / "hf"), str(tmp_path / "mf.ckpt")]) == 0
    assert json.loads(capsys.readouterr().out)["direction"] == "hf->mindformers"  # the one line mf-convert prints
    mf = MindSporeCheckpoint(tmp_path / "mf.ckpt")
    assert "decoder.layers.0.mlp.experts.weight1" in mf.names() and "output_layer.weight" in mf.names()
    assert cli(["--mf-config", yaml, str(tmp_path / "mf.ckpt"), str(tmp_path / "again")]) == 0
    first, again = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("hf", "again"))
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)


def test_progress_counts_every_weight_byte(tmp_path):
    """load_into reports each MindFormers tensor's bytes as it goes (mf-convert's progress bar): the weights' total,
    nothing for the counters it skips."""
    from mf_ds.checkpoint.mindspore_ckpt import load_into
    from mf_ds.convert import _meta_model

    plan = plan_for("mixtral")
    seen = []
    load_into(_meta_model(plan), MF / "mixtral" / "model.ckpt", "mixtral", write=lambda n, t: None,
              progress=seen.append)
    ckpt = MindSporeCheckpoint(MF / "mixtral" / "model.ckpt")
    assert len(seen) == len(weights_of("mixtral"))
    assert sum(seen) == sum(ckpt.tensor(n).numel() * 4 for n in weights_of("mixtral"))


RUN_MOE = ROOT / "tests" / "fixtures" / "mindformers" / "run_moe"


def _with_router_state(src, dst, bias_part: str, add: bool) -> dict[str, torch.Tensor]:
    """`src`'s tensors written to `dst` with every router's topk_bias random (added beside the router weight when
    `add`, with its expert_load, as MindFormers saves a balance_via_topk_bias network); returns the biases."""
    from mf_ds.checkpoint.mindspore_ckpt import write_ckpt

    source = MindSporeCheckpoint(src)
    tensors, biases = {}, {}
    for name in source.names():
        tensors[name] = source.tensor(name)
        if add and name.endswith(".feed_forward.router.dense.weight"):
            stem = name[: -len(".dense.weight")]
            tensors[stem + ".router.topk_bias"] = torch.zeros(tensors[name].shape[0])
            tensors[stem + ".router.expert_load"] = torch.full((tensors[name].shape[0],), 0.25)
    for name in tensors:
        if name.endswith(bias_part):
            tensors[name] = biases[name] = torch.randn(tensors[name].shape, generator=torch.Generator().manual_seed(
                len(biases)))
    write_ckpt(dst, iter(tensors.items()))
    return biases


@pytest.mark.parametrize("stem,ckpt,add,hf_part", [
    ("moe_deepseek_tiny", "init_deepseek.ckpt", False, ".mlp.gate.e_score_correction_bias"),
    ("moe_kdrop_tiny", "init_mixtral.ckpt", True, ".block_sparse_moe.gate.e_score_correction_bias")])
def test_router_bias_both_ways(tmp_path, stem, ckpt, add, hf_part):
    """balance_via_topk_bias on the Llama path (Qwen2-MoE-like with shared experts; Mixtral): MindFormers'
    router.router.topk_bias is the HF e_score_correction_bias, expert_load is skipped (a per-step counter), and the
    way back writes every name the MindFormers network has: the bias bit for bit, expert_load as zeros."""
    plan = translate_file(str(RUN_MOE / f"{stem}.yaml"), ["moe_config.balance_via_topk_bias=True"]).plan
    biases = _with_router_state(RUN_MOE / ckpt, tmp_path / "src.ckpt", ".router.router.topk_bias", add)
    assert len(biases) == 2
    counts = to_hf(plan, str(tmp_path / "src.ckpt"), str(tmp_path / "hf"))
    loads = [n for n in MindSporeCheckpoint(tmp_path / "src.ckpt").names() if n.endswith(".expert_load")]
    assert len(loads) == 2 and counts["skipped"] == 2  # expert_load, not read
    hf = load_file(str(tmp_path / "hf" / "model.safetensors"))
    for name, bias in biases.items():
        layer = name.split(".")[2]
        assert torch.equal(hf[f"model.layers.{layer}{hf_part}"], bias)
    to_mindformers(plan, str(tmp_path / "hf"), str(tmp_path / "back.ckpt"))
    source, back = MindSporeCheckpoint(tmp_path / "src.ckpt"), MindSporeCheckpoint(tmp_path / "back.ckpt")
    weights = {n for n in source.names() if n.startswith(("model.", "lm_head."))}
    assert set(back.names()) == weights
    for name in weights:
        expected = torch.zeros(4) if name.endswith("expert_load") and add else source.tensor(name)
        assert torch.equal(back.tensor(name), expected.to(back.tensor(name).dtype)), name


def test_router_bias_from_a_mindformers_checkpoint_selects(tmp_path):
    """A Mixtral checkpoint's topk_bias reaches the patched model's router (its HF router has no bias: the loader
    gives it one, which the MoE patch keeps and selects with) and is saved under the HF name."""
    from mf_ds import patch
    from mf_ds.model import build_model
    from mf_ds.moe import moe_layers

    plan = translate_file(str(RUN_MOE / "moe_kdrop_tiny.yaml"), ["moe_config.balance_via_topk_bias=True"]).plan
    biases = _with_router_state(RUN_MOE / "init_mixtral.ckpt", tmp_path / "src.ckpt", ".router.router.topk_bias",
                                True)
    model = build_model(plan, str(tmp_path / "src.ckpt"))
    patch.apply(model, plan)
    layers = moe_layers(model)
    assert len(layers) == 2
    for layer, bias in zip(layers, biases.values(), strict=True):
        assert torch.equal(layer.gate.e_score_correction_bias, bias)
    state = model.state_dict()
    assert torch.equal(state["model.layers.1.mlp.gate.e_score_correction_bias"], list(biases.values())[1])
    model.save_pretrained(str(tmp_path / "hf"))
    again = build_model(plan, str(tmp_path / "hf"))  # an HF directory: from_pretrained drops it, the loader does not
    assert torch.equal(again.model.layers[1].mlp.gate.e_score_correction_bias, list(biases.values())[1])
