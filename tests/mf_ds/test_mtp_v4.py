"""DeepSeek-V4's MTP (mf_ds/mtp_v4.py, Plan.mtp.variant "v4") against a plain-torch transcription of MindFormers
2.1.0's source (tests/mf_ds/mtp_v4_reference.py: its PyNative model has no CPU forward): the loss, the logged term and
every gradient; the layer MindFormers builds; the Plan and its refusals; its weights under MindFormers' names and in
mf-ds' own checkpoints. The training run is tests/mf_ds/test_deepseek4_train.py's (the tiny YAML has one MTP layer)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from mf_ds import mtp
from mf_ds.model import build_model
from tests.conftest import ROOT
from tests.mf_ds import mtp_v4_reference as ref
from tests.mf_ds.test_deepseek4 import mindformers_checkpoint, tiny_yaml
from translators.errors import ConfigError
from translators.families.deepseek4 import LAYER_TYPES, MTP_LAYER_TYPES
from translators.plan import translate_file

TINY = ROOT / "tests" / "fixtures" / "pynative" / "tiny_deepseek4_flash.yaml"  # compress_ratios [0, 4, 128, 4, 0]


def _plan(*sets: str):
    return translate_file(str(TINY), list(sets)).plan


def test_plan_carries_the_v4_variant():
    plan = _plan()
    assert (plan.mtp.variant, plan.mtp.depth, plan.mtp.loss_factor) == ("v4", 1, 0.3)
    assert plan.hf_config[MTP_LAYER_TYPES] == ["sliding_attention"]  # compress_ratios[4]
    notes = {n.key: n for n in plan.notes}
    assert notes["model.num_nextn_predict_layers"].kind == "runtime"
    assert notes["model.mtp_loss_factor"].kind == "runtime" and "gradient" in notes["model.mtp_loss_factor"].message
    assert _plan("model.num_nextn_predict_layers=0").mtp is None


def test_refusals_are_one_line():
    with pytest.raises(ConfigError, match="at most 1 MTP layer"):  # transformer_config.py 2343-2347
        _plan("model.num_nextn_predict_layers=2")
    with pytest.raises(ConfigError, match="csa_compress_ratios length") as err:  # 3215-3220: one ratio per layer
        _plan("model.compress_ratios=[0, 4, 128, 4]")
    assert err.value.path == "model.compress_ratios"


@pytest.fixture(scope="module")
def model_and_plan():
    plan = _plan()
    torch.manual_seed(0)
    model = build_model(plan)
    with torch.no_grad():  # off MindFormers' initial values (zero hc_head gates): every part shows in the loss
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model, plan


def test_the_mtp_layer_is_the_one_mindformers_builds(model_and_plan):
    """Layer num_layers + 0: the attention kind of compress_ratios[4] (0: sliding), a top-k router (is_mtp_layer:
    never hash-routed); transformers' forward runs the 4 decoder layers only."""
    model, _ = model_and_plan
    layers = model.model.layers
    block = layers[4]
    assert block.self_attn.layer_type == LAYER_TYPES[0] and not block.mlp.is_hash
    assert type(block.hc_head).__name__ == "DeepseekV4HyperHead" and block.eh_proj.weight.shape == (32, 64)
    assert len(layers) == 5 and sum(1 for _ in layers) == 4
    ratios = _plan("model.compress_ratios=[0, 4, 128, 4, 128]").hf_config[MTP_LAYER_TYPES]
    assert ratios == [LAYER_TYPES[128]]


def _inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 320, (2, 257), generator=g)
    tokens, labels = ids[:, :-1], ids[:, 1:]
    loss_mask = torch.ones_like(tokens)
    loss_mask[0, 100:140] = 0  # masked spans: the rolled mask moves with the rolled labels
    loss_mask[1, 250:] = 0
    return tokens, labels, loss_mask


def _reference(model, tokens, labels, loss_mask):
    """The transcription on a copy of the model: the decoder layers (main and MTP) as functions, the rest its own."""
    n = model.config.num_hidden_layers
    seen = {}
    model.model.layers[0].register_forward_pre_hook(lambda m, a, kw: seen.update(kwargs=kw), with_kwargs=True)
    model.model.layers[n - 1].register_forward_hook(lambda m, a, out: seen.update(streams=out))
    model(input_ids=tokens)  # the main decoder's streams, with their graph
    kw = {k: seen["kwargs"][k] for k in ("attention_mask", "position_ids", "position_embeddings")}
    block = model.model.layers[n]
    p = {name: t.double() for name, t in model.named_parameters()}
    m, b = "model.", f"model.layers.{n}."
    w = {"embedding": p[m + "embed_tokens.weight"], "output": p["lm_head.weight"], "final_norm": p[m + "norm.weight"],
         "hc_head.fn": p[m + "hc_head.hc_fn"], "hc_head.base": p[m + "hc_head.hc_base"],
         "hc_head.scale": p[m + "hc_head.hc_scale"], "enorm": p[b + "enorm.weight"], "hnorm": p[b + "hnorm.weight"],
         "eh_proj": p[b + "eh_proj.weight"], "mtp_hc.fn": p[b + "hc_head.hc_fn"],
         "mtp_hc.base": p[b + "hc_head.hc_base"], "mtp_hc.scale": p[b + "hc_head.hc_scale"],
         "final_layernorm": p[b + "shared_head.norm.weight"]}
    eps = model.config.rms_norm_eps
    return ref.mtp(w, seen["streams"].double(), tokens, labels, loss_mask,
                   lambda x: block(x.float(), **kw).double(), eps, eps, 0.3)


def test_loss_and_gradients_equal_the_transcription_of_mindformers(model_and_plan):
    """The loss mf-ds backpropagates is the main loss (the logged value), its gradient main + 0.3 x CE_1's, and the
    logged term CE_1: all as the transcription of 2.1.0's source computes them (fp32 model, fp64 transcription)."""
    model, plan = model_and_plan
    tokens, labels, loss_mask = _inputs()
    theirs = copy.deepcopy(model)
    main_ref, ce_ref, objective = _reference(theirs, tokens, labels, loss_mask)
    objective.backward()

    model.zero_grad()
    hf_labels = labels.masked_fill(loss_mask == 0, -100)
    loss = model(input_ids=tokens, labels=hf_labels, shift_labels=hf_labels).loss  # the loop's call: pre-shifted
    term = mtp.MtpLoss(plan)
    total = term.add(model, loss, tokens, hf_labels)
    total.backward()
    assert total.item() == pytest.approx(main_ref.item(), rel=1e-5)  # gradient only: the value is the main loss
    assert term.take(1) == pytest.approx(ce_ref.item(), rel=1e-5)
    assert abs(ce_ref.item() - main_ref.item()) > 1e-3
    grads = dict(theirs.named_parameters())
    checked = 0
    for name, param in model.named_parameters():
        want = grads[name].grad
        if want is None:  # no path to the loss in either (the unused indexer of HF's CSA layers)
            assert param.grad is None or not param.grad.any(), name
            continue
        torch.testing.assert_close(param.grad, want, rtol=2e-4, atol=2e-6 * float(want.abs().max()) + 1e-9,
                                   msg=name)
        checked += 1
    for part in ("eh_proj.weight", "hc_head.hc_fn", "enorm.weight", "shared_head.norm.weight", "attn_hc.fn"):
        assert model.model.layers[4].get_parameter(part).grad.abs().sum() > 0, part
    assert checked > 100


def test_mindformers_checkpoint_loads_into_the_mtp_block(tmp_path):
    """MindFormers' own names of the MTP layer (tests/fixtures/deepseek4/params.tiny.json: the PyNative model built
    by MindFormers) load into the block, and mf-ds' own checkpoint (HF layout, model.layers.4) saves and loads it."""
    plan = translate_file(str(tiny_yaml(tmp_path))).plan
    src = tmp_path / "mf.safetensors"
    original = mindformers_checkpoint(src)
    model = build_model(plan, str(src))
    block = model.model.layers[4]
    mf = "mtp.layers.0."
    pairs = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
             "final_layernorm.weight": "shared_head.norm.weight", "hc_head.hc_fn.weight": "hc_head.hc_fn",
             "hc_head.hc_base": "hc_head.hc_base", "hc_head.hc_scale": "hc_head.hc_scale",
             "transformer_layer.self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
             "transformer_layer.attn_hc.mapping_proj.weight": "attn_hc.fn",
             "transformer_layer.mlp.router.weight": "mlp.gate.weight"}
    for theirs, ours in pairs.items():
        torch.testing.assert_close(block.get_parameter(ours), original[mf + theirs], rtol=0, atol=0, msg=ours)
    w1 = original[mf + "transformer_layer.mlp.experts.weight1"]
    torch.testing.assert_close(block.mlp.experts.gate_up_proj, w1.transpose(1, 2), rtol=0, atol=0)

    model.save_pretrained(str(tmp_path / "own"))
    assert json.loads((tmp_path / "own" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    again = dict(build_model(plan, str(tmp_path / "own")).named_parameters())
    assert any(name.startswith("model.layers.4.hc_head") for name in again)
    for name, param in model.named_parameters():
        torch.testing.assert_close(again[name], param, rtol=0, atol=0, msg=name)


def _mtp_count(plan) -> int:
    from mf_ds.model import hf_config, new_model

    with torch.device("meta"):
        model = new_model(hf_config(plan))
    return sum(p.numel() for p in model.model.layers[model.config.num_hidden_layers:].parameters())


def test_mtp_block_has_mindformers_parameter_count(tmp_path):
    """The block's parameters are as many as the trainable ones of MindFormers' MTP layer: the tiny model built by
    MindFormers (params.tiny.json: hidden 40, 5 experts) and Flash and Pro at their real widths (counts.json)."""
    tiny = json.loads((ROOT / "tests" / "fixtures" / "deepseek4" / "params.tiny.json").read_text())["params"]
    want = sum(torch.Size(shape).numel() for n, (shape, trainable, _) in tiny.items() if trainable and ".mtp." in n)
    assert _mtp_count(translate_file(str(tiny_yaml(tmp_path))).plan) == want
    counts = json.loads((ROOT / "tests" / "fixtures" / "deepseek4" / "counts.json").read_text())
    wheel = ROOT / "tests" / "fixtures" / "mindformers_wheels" / "2.1.0" / "deepseek4"
    for key in ("flash", "pro"):
        assert _mtp_count(translate_file(str(wheel / f"pretrain_deepseek4_{key}.yaml")).plan) == counts[key]["mtp"]


def test_deepseek_release_names_of_the_mtp_layer_load(tmp_path):
    """DeepSeek's release names the MTP layer `mtp.0.*` (transformers' DeepseekV4 ignores them): written here as
    MindFormers 2.1.0's converter reads them (models/deepseek4/utils.py 80-90: norm is final_layernorm,
    hc_head_{fn,base,scale}; 268-275: eh_proj = concat(e_proj, h_proj) on dim 1), they load into the block."""
    from safetensors.torch import load_file, save_file

    plan = _plan()
    torch.manual_seed(3)
    model = build_model(plan)
    model.save_pretrained(str(tmp_path))
    (shard,) = tmp_path.glob("*.safetensors")
    saved, release = load_file(str(shard)), {}
    parts = {"shared_head.norm.weight": "norm.weight", "hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base",
             "hc_head.hc_scale": "hc_head_scale"}
    for name, tensor in saved.items():
        if not name.startswith("model.layers.4."):
            release[name] = tensor
            continue
        rest = name.removeprefix("model.layers.4.")
        if rest == "eh_proj.weight":
            release["mtp.0.e_proj.weight"], release["mtp.0.h_proj.weight"] = tensor.chunk(2, dim=1)
        else:
            release["mtp.0." + parts.get(rest, rest)] = tensor
    assert "mtp.0.attn.wq_a.weight" in release and "mtp.0.ffn.experts.0.w1.weight" in release
    shard.unlink()
    save_file({k: v.contiguous() for k, v in release.items()}, str(tmp_path / "model.safetensors"))
    again = dict(build_model(plan, str(tmp_path)).named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(again[name], param, rtol=0, atol=0, msg=name)
