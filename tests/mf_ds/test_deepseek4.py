"""DeepSeek-V4 on transformers' DeepseekV4ForCausalLM: the translated config builds it with MindFormers' parameter
count, and mf-convert maps MindFormers' own parameter names (tests/fixtures/deepseek4/params.tiny.json: the PyNative
model built on CPU by tests/fixtures/make_deepseek4_golden.py) to every HF parameter and back, bit for bit."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from mf_ds.convert import to_hf, to_mindformers
from translators import memory
from translators.plan import translate_file

FIXTURES = Path(__file__).parents[1] / "fixtures"
TINY = json.loads((FIXTURES / "deepseek4" / "params.tiny.json").read_text())
FLASH = FIXTURES / "mindformers_wheels" / "2.1.0" / "deepseek4" / "pretrain_deepseek4_flash.yaml"


def tiny_yaml(tmp_path: Path) -> Path:
    """The flash YAML's model with the tiny build's changes, as an mcore model_config."""
    model = {**yaml.safe_load(FLASH.read_text())["model"], **TINY["changes"], "seq_length": 32,
             "use_attn_mask_compression": False}
    path = tmp_path / "tiny_deepseek4.yaml"
    path.write_text(yaml.safe_dump({"use_legacy": False, "model": {"model_config": model},
                                    "runner_config": {"batch_size": 1}}))
    return path


def mindformers_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """Random weights under MindFormers' names and shapes; the frozen ones as MindFormers holds them."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, (shape, _, _) in TINY["params"].items():
        name = name.removeprefix("model.")
        if name.endswith((".q_rms_gamma", ".rms_weight")):
            out[name] = torch.ones(shape)
        elif name.endswith(".tokens_per_expert"):
            out[name] = torch.zeros(shape)
        elif name.endswith(".tid2eid"):
            out[name] = torch.randint(0, shape[0], shape, generator=g, dtype=torch.int32) % 5
        else:
            out[name] = torch.randn(shape, generator=g)
    save_file(out, str(path), metadata={"format": "ms"})
    return out


def test_hf_model_has_mindformers_parameter_count(tmp_path):
    from transformers import AutoModelForCausalLM

    from mf_ds.model import hf_config

    plan = translate_file(str(tiny_yaml(tmp_path))).plan
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(plan), dtype=torch.float32)
    assert type(model).__name__ == "DeepseekV4ForCausalLM"
    hf_count = sum(p.numel() for p in model.parameters())
    mf_count = sum(math.prod(shape) for name, (shape, trainable, _) in TINY["params"].items()
                   if trainable and ".mtp." not in name)
    assert hf_count == mf_count == sum(w.numel * w.count for w in memory.inventory(plan.hf_config))
    assert math.isinf(model.config.swiglu_limit)  # hidden_act silu: MindFormers does not clamp


def test_fresh_model_starts_hash_table_and_mhc_as_mindformers(tmp_path):
    """transformers leaves tid2eid at zeros (every token to expert 0); MindFormers starts it round-robin, and its mHC
    gates at mhc_init_gating_factor (mf_ds/init.py)."""
    from mf_ds.model import build_model

    plan = translate_file(str(tiny_yaml(tmp_path))).plan
    lines = []
    model = build_model(plan, log=lines.append)
    table = model.model.layers[0].mlp.gate.tid2eid
    assert table.tolist()[:3] == [[0, 1], [1, 2], [2, 3]] and int(table.max()) == 4
    hc = model.model.layers[1].attn_hc
    assert hc.scale.tolist() == pytest.approx([0.01] * 3) and hc.base[:4].tolist() == pytest.approx([-math.log(3)] * 4)
    assert hc.base[8:].reshape(4, 4).tolist() == ((torch.eye(4) - 1) * 5).tolist()
    assert float(hc.fn.std()) < 1e-3 and model.model.hc_head.hc_scale.item() == 0.0
    assert any("1 hash routers" in line for line in lines)


def test_mf_convert_round_trip_is_exact_and_covers_every_hf_weight(tmp_path):
    from transformers import AutoModelForCausalLM

    plan = translate_file(str(tiny_yaml(tmp_path))).plan
    assert plan.weights_family == "deepseek_v4/mcore"
    src = tmp_path / "mf.safetensors"
    original = mindformers_checkpoint(src)
    counts = to_hf(plan, str(src), str(tmp_path / "hf"))
    model, info = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), output_loading_info=True)
    # every HF weight and buffer given; left over: only the MTP block (model.layers.4, mf_ds/mtp_v4.py), which
    # transformers does not build
    unexpected = info.pop("unexpected_keys")
    assert not any(info.values()), info
    assert unexpected and all(k.startswith("model.layers.4.") for k in unexpected), unexpected
    state = model.state_dict()
    # spot checks of the layouts: the stacked experts, the grouped output projection, the split mHC scale
    w1 = original["decoder.layers.1.mlp.experts.weight1"]  # [E, H, 2I] = [gate^T | up^T]
    torch.testing.assert_close(state["model.layers.1.mlp.experts.gate_up_proj"], w1.transpose(1, 2), rtol=0,
                               atol=0)
    fc1 = original["decoder.layers.1.mlp.shared_experts.linear_fc1.weight"]  # gate and up interleaved per row
    shared = "model.layers.1.mlp.shared_experts"
    torch.testing.assert_close(state[f"{shared}.gate_proj.weight"], fc1[0::2], rtol=0, atol=0)
    torch.testing.assert_close(state[f"{shared}.up_proj.weight"], fc1[1::2], rtol=0, atol=0)
    torch.testing.assert_close(state["model.layers.0.self_attn.o_a_proj.weight"],
                               original["decoder.layers.0.self_attention.linear_o_group_proj"], rtol=0, atol=0)
    scale = torch.cat([original[f"decoder.layers.2.ffn_hc.alpha_{p}"] for p in ("pre", "post", "res")])
    torch.testing.assert_close(state["model.layers.2.ffn_hc.scale"], scale, rtol=0, atol=0)
    assert torch.equal(state["model.layers.0.mlp.gate.tid2eid"], original["decoder.layers.0.mlp.router.tid2eid"].long())
    assert "mtp_skipped" not in counts  # MindFormers' MTP layer is built (mf_ds/mtp_v4.py) and converted

    back = tmp_path / "back.safetensors"
    to_mindformers(plan, str(tmp_path / "hf"), str(back))
    again = load_file(str(back))
    expected = original
    assert set(again) == set(expected)
    for name, tensor in expected.items():
        assert again[name].dtype == tensor.dtype or name.endswith(".tid2eid"), name
        assert torch.equal(again[name].to(tensor.dtype), tensor), name


def test_a_frozen_norm_that_is_not_ones_is_refused(tmp_path):
    from mf_ds.errors import RunError

    plan = translate_file(str(tiny_yaml(tmp_path))).plan
    src = tmp_path / "mf.safetensors"
    weights = mindformers_checkpoint(src)
    name = "decoder.layers.0.attn_hc.rms_weight"
    weights[name] = torch.full_like(weights[name], 2)
    save_file(weights, str(src), metadata={"format": "ms"})
    with pytest.raises(RunError, match="rms_weight: MindFormers keeps it frozen at ones"):
        to_hf(plan, str(src), str(tmp_path / "hf"))


def test_mf_moe_equals_hf_topk_block_forward_and_backward(tmp_path):
    """mf-ds' MoE layer on a top-k DeepSeek-V4 block (sqrtsoftplus, expert bias selecting, renormalised and scaled
    gates, the shared expert) computes HF's block: outputs and every gradient."""
    import copy

    from transformers import AutoModelForCausalLM

    from mf_ds.model import hf_config
    from mf_ds.patch.moe import build_block

    plan = translate_file(str(tiny_yaml(tmp_path))).plan
    assert plan.moe.layers == (1, 2, 3, 4) and plan.moe.router.score == "sqrtsoftplus"  # 4: the MTP layer
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(plan), dtype=torch.float32)
    block = model.model.layers[1].mlp
    with torch.no_grad():
        block.gate.e_score_correction_bias.copy_(torch.randn(5) * 0.1)  # selects, does not weigh
    ours = build_block("deepseek_v4", copy.deepcopy(block), plan, layer_index=1)
    x = torch.randn(2, 7, 40)
    x_hf, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_hf, y_ours = block(x_hf), ours(x_ours, input_ids=None)
    torch.testing.assert_close(y_ours, y_hf, rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(y_hf)
    y_hf.backward(grad)
    y_ours.backward(grad)
    torch.testing.assert_close(x_ours.grad, x_hf.grad, rtol=1e-5, atol=1e-6)
    theirs = dict(block.named_parameters())
    for name, param in ours.named_parameters():
        torch.testing.assert_close(param.grad, theirs[name].grad, rtol=1e-5, atol=1e-6, msg=name)


def test_patched_model_keeps_hash_blocks_and_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    from mf_ds import patch
    from mf_ds.model import hf_config

    plan = translate_file(str(tiny_yaml(tmp_path))).plan
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(plan), dtype=torch.float32)
    ids = torch.randint(0, 50, (2, 160))  # past 128 tokens: the compressed layers hold entries
    want = model(input_ids=ids).logits
    keys = list(model.state_dict())
    report = patch.apply(model, plan)
    assert any("layers.0.mlp: hash-routed DeepseekV4SparseMoeBlock kept" in line for line in report), report
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["DeepseekV4SparseMoeBlock"] + ["MFMoE"] * 3
    assert list(model.state_dict()) == keys
    torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=1e-4, atol=1e-5)


MODULES = FIXTURES / "deepseek4" / "modules.golden.safetensors"


def test_mhc_and_compressors_equal_mindformers_own(tmp_path):
    """MindFormers 2.1.0's own mHC and compressors, run on CPU (make_deepseek4_golden.py modules: CPU stand-ins that
    keep the arithmetic), against transformers' modules built from the translated config with the same weights:
    the collapsed input, the Sinkhorn comb, the post gates and the updated streams; the compressed sparse (overlapping
    windows) and heavily compressed entries with their YaRN RoPE on the trailing lanes."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

    from mf_ds.model import hf_config

    g = load_file(str(MODULES))
    config = hf_config(translate_file(str(tiny_yaml(tmp_path))).plan)
    n, h = config.hc_mult, config.hidden_size
    hc = hf.DeepseekV4HyperConnection(config)
    with torch.no_grad():
        hc.fn.copy_(g["mhc.w.mapping_proj.weight"])
        hc.base.copy_(g["mhc.w.bias"])
        hc.scale.copy_(torch.cat([g[f"mhc.w.alpha_{p}"] for p in ("pre", "post", "res")]))
    s, b = g["mhc.x"].shape[:2]
    streams = g["mhc.x"].permute(1, 0, 2).reshape(b, s, n, h)  # MindFormers [s, b, n*H] -> HF [B, S, n, H]
    post, comb, collapsed = hc(streams)
    torch.testing.assert_close(collapsed, g["mhc.aggregated"].permute(1, 0, 2), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(comb, g["mhc.h_res"].permute(1, 0, 2, 3), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(post, g["mhc.h_post"].permute(1, 0, 2, 3)[..., 0], rtol=1e-5, atol=1e-5)
    sub = g["mhc.sub"].permute(1, 0, 2)
    out = post.unsqueeze(-1) * sub.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), streams)  # the decoder layer
    torch.testing.assert_close(out.reshape(b, s, n * h), g["mhc.out"].permute(1, 0, 2), rtol=1e-5, atol=1e-5)

    for name, cls, layer in (("csa", hf.DeepseekV4CSACompressor, 1), ("hca", hf.DeepseekV4HCACompressor, 2)):
        compressor = cls(config)
        with torch.no_grad():
            compressor.kv_proj.weight.copy_(g[f"{name}.w.linear_wkv.weight"])
            compressor.gate_proj.weight.copy_(g[f"{name}.w.linear_wgate.weight"])
            compressor.position_bias.copy_(g[f"{name}.w.ape"])
            compressor.kv_norm.weight.copy_(g[f"{name}.w.norm.weight"])
        x = g[f"{name}.x"].permute(1, 0, 2)
        positions = torch.arange(x.shape[1]).unsqueeze(0).expand(x.shape[0], -1)
        compressed, _ = compressor(x, torch.randn(x.shape[0], x.shape[1], config.q_lora_rank), positions, None, layer)
        torch.testing.assert_close(compressed.squeeze(1), g[f"{name}.y"].squeeze(2).permute(1, 0, 2), rtol=1e-5,
                                   atol=1e-5)


def _by_expert(gates: torch.Tensor, experts: torch.Tensor) -> list[dict[int, float]]:
    return [{int(e): float(g) for g, e in zip(gr, er, strict=True)} for gr, er in zip(gates, experts, strict=True)]


def _same_routing(got: list[dict], want: list[dict]) -> None:
    assert [sorted(t) for t in got] == [sorted(t) for t in want]
    for g, w in zip(got, want, strict=True):
        # rel 2e-5: MindSpore's CPU softplus is log(1 + exp(x)) in float32 (make_deepseek4_golden.py modules)
        assert [g[e] for e in sorted(g)] == pytest.approx([w[e] for e in sorted(w)], rel=2e-5, abs=1e-6)


def test_routers_equal_mindformers_own(tmp_path):
    """MindFormers' own routers on CPU (modules.golden.safetensors): the top-k one (sqrtsoftplus, expert bias
    selecting, renormalised and scaled gates) against HF's DeepseekV4TopKRouter and mf-ds' router, the hash one
    (tid2eid[input_ids]) against HF's DeepseekV4HashRouter."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

    from mf_ds.model import hf_config
    from mf_ds.moe.router import route

    g = load_file(str(MODULES))
    plan = translate_file(str(tiny_yaml(tmp_path))).plan
    config = hf_config(plan)
    want = _by_expert(g["topk.gates"], g["topk.experts"])
    x = g["topk.x"].reshape(-1, config.hidden_size)  # MindFormers' token order (s-major)
    router = hf.DeepseekV4TopKRouter(config)
    with torch.no_grad():
        router.weight.copy_(g["topk.w.weight"])
        router.e_score_correction_bias.copy_(g["topk.w.expert_bias"])
    _, gates, experts = router(x)
    _same_routing(_by_expert(gates, experts), want)
    ours = route(x @ g["topk.w.weight"].T, plan.moe, g["topk.w.expert_bias"])
    _same_routing(_by_expert(ours.gates_TK, ours.expert_ids_TK), want)

    router = hf.DeepseekV4HashRouter(config)
    with torch.no_grad():
        router.weight.copy_(g["hash.w.weight"])
        router.tid2eid.copy_(g["hash.w.tid2eid"].long())
    ids = g["hash.input_ids"].T.reshape(1, -1)  # MindFormers flattens input_ids.T: s-major, as its tokens
    _, gates, experts = router(g["hash.x"].reshape(1, -1, config.hidden_size), ids)
    _same_routing(_by_expert(gates, experts), _by_expert(g["hash.gates"], g["hash.experts"]))


def test_the_mtp_layer_is_built_not_reported_pending():
    """The YAML's MTP layer is built (mf_ds/mtp_v4.py), so no report line says it is not trained."""
    from mf_ds.model import pending_features
    from translators.plan import translate_file

    root = Path(__file__).resolve().parents[1] / "fixtures" / "pynative" / "tiny_deepseek4_flash.yaml"
    plan = translate_file(str(root), world_size=1).plan
    assert (plan.mtp.variant, plan.mtp.depth) == ("v4", 1)
    assert pending_features(plan) == []
