"""MFMoE injected into tiny HF MoE models: dropless equality with HF, MindFormers' drop rules pair for pair, the
drop rate, safe tokens, aux losses under activation checkpointing, the bias update and the callbacks."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import yaml
from torch.testing import assert_close
from transformers import AutoConfig, AutoModelForCausalLM

import mf_ds.moe
import mf_ds.moe.layer
import mf_ds.patch
from mf_ds.moe.router import aux_losses, expert_fractions
from tests.conftest import CONFIGS
from tests.moe import FAMILIES, family_plan, grads, moe_plan, tiny_model

TOL = dict(atol=1e-5, rtol=1e-5)


def _batch(seed: int = 0, shape=(2, 13)) -> torch.Tensor:
    return torch.randint(0, 64, shape, generator=torch.Generator().manual_seed(seed))


def _loss_and_grads(model, ids):
    model.zero_grad()
    out = model(ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), grads(model)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_dropless_equals_hf(family):
    """Logits and every gradient equal the unpatched HF model's (fp32); keys unchanged; revert restores."""
    hf = tiny_model(family)
    ours = copy.deepcopy(hf)
    keys = list(hf.state_dict())
    report = mf_ds.patch.apply(ours, family_plan(family))
    assert any("-> MFMoE" in line for line in report)
    assert list(ours.state_dict()) == keys
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in hf.named_parameters()]
    ids = _batch()
    logits_hf, grads_hf = _loss_and_grads(hf, ids)
    logits, grads_ours = _loss_and_grads(ours, ids)
    assert_close(logits, logits_hf, **TOL)
    assert grads_ours.keys() == grads_hf.keys()
    for name, grad in grads_hf.items():
        assert_close(grads_ours[name], grad, **TOL, msg=name)
    mf_ds.patch.revert(ours)
    assert not any(isinstance(m, mf_ds.moe.MFMoE) for m in ours.modules())
    assert_close(ours(ids).logits, logits_hf, **TOL)


def test_plan_from_a_mindformers_yaml_equals_hf():
    """The tiny DeepSeek-V3 YAML through translators (sigmoid, bias, shared expert, dense layer 0, the MTP layer's MoE
    patched as well: mf_ds/mtp.py builds it),
    made dropless, builds a model whose patched logits and gradients equal HF's."""
    from mf_ds.model import build_model
    from translators.plan import translate

    tree = yaml.safe_load((CONFIGS / "tiny_deepseek_v3.yaml").read_text())
    tree["moe_config"]["capacity_factor"] = -1
    plan = translate(tree, world_size=1).plan
    hf = build_model(plan)
    with torch.no_grad():
        for layer in hf.model.layers[1:]:
            layer.mlp.gate.weight.mul_(20)
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.3)
    ours = copy.deepcopy(hf)
    report = mf_ds.patch.apply(ours, plan)
    assert any(line.startswith("model.layers.3.mlp: DeepseekV3MoE -> MFMoE") for line in report), report
    ids = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(1))
    logits_hf, grads_hf = _loss_and_grads(hf, ids)
    logits, grads_ours = _loss_and_grads(ours, ids)
    assert_close(logits, logits_hf, **TOL)
    for name, grad in grads_hf.items():
        assert_close(grads_ours[name], grad, **TOL, msg=name)


# ---- dropping ------------------------------------------------------------------------------------------------------
def _mindformers_within_capacity(ids_TK: torch.Tensor, experts: int, capacity: int, sdrop: bool) -> torch.Tensor:
    """TopkRouterV2 `_maskout_overflowed_tokens_sort_kdrop/_sdrop` (moe.py r1.5.0), its mask part, for dp = 1:
    flatten in priority order, position = cumsum(onehot) * onehot, keep iff 0 < position <= C."""
    T, K = ids_TK.shape
    flat = ids_TK.reshape(T * K) if sdrop else ids_TK.t().reshape(K * T)  # (N, k) -> (Nk) / (k, N) -> (kN)
    onehot = torch.nn.functional.one_hot(flat, experts).float()  # (kN, E)
    position = torch.cumsum(onehot, 0) * onehot
    position = position * (position < capacity + 1)
    within = position.sum(-1) > 0  # (kN)
    return within.view(T, K) if sdrop else within.view(K, T).t()


def _capture_permute(monkeypatch) -> list:
    seen = []
    original = mf_ds.moe.layer.permute

    def spy(x_TH, expert_ids_TK, num_experts, **kwargs):
        perm = original(x_TH, expert_ids_TK, num_experts, **kwargs)
        seen.append((expert_ids_TK.clone(), perm.kept_TK.clone(), kwargs["capacity"]))
        return perm

    monkeypatch.setattr(mf_ds.moe.layer, "permute", spy)
    return seen


def _naive_block(block, x_TH, kept_TK):
    """The MoE block by hand: per token, the kept choices' gate * SwiGLU expert, gates not renormalised."""
    routing = mf_ds.moe.route(block.gate(x_TH), block.spec)
    out = torch.zeros_like(x_TH)
    w1, w2 = block.experts.gate_up_proj, block.experts.down_proj
    for t in range(x_TH.shape[0]):
        for k in range(routing.expert_ids_TK.shape[1]):
            if kept_TK[t, k]:
                e = routing.expert_ids_TK[t, k]
                gate, up = (w1[e] @ x_TH[t]).chunk(2)
                out[t] = out[t] + routing.gates_TK[t, k] * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    return out


@pytest.mark.parametrize("policy", ["kdrop", "sdrop"])
def test_dropping_follows_mindformers_pair_for_pair(monkeypatch, policy):
    model = tiny_model("qwen3_moe", router_scale=40.0)
    mf_ds.patch.apply(model, family_plan("qwen3_moe", capacity_factor=0.75, dropless=False, drop_policy=policy))
    model.train()
    block = model.model.layers[1].mlp
    seen = _capture_permute(monkeypatch)
    x = torch.randn(3, 11, 32, requires_grad=True)
    out = block(x)
    (ids, kept, capacity), = seen
    assert capacity == math.ceil(2 * 33 * 0.75 / 8) == 7
    expected = _mindformers_within_capacity(ids, 8, capacity, sdrop=policy == "sdrop")
    assert torch.equal(kept, expected)
    assert 0 < (~kept).sum() < kept.numel()  # something was dropped, not everything
    # outputs and gradients equal the hand-made block with the same kept pairs
    x_ref = x.detach().clone().requires_grad_()
    ref = _naive_block(block, x_ref.view(-1, 32), kept).view_as(x)
    assert_close(out, ref, **TOL)
    weight = torch.randn_like(out)
    (out * weight).sum().backward()
    experts_grad = block.experts.gate_up_proj.grad.clone()
    block.zero_grad()
    (ref * weight).sum().backward()
    assert_close(x.grad, x_ref.grad, **TOL)
    assert_close(experts_grad, block.experts.gate_up_proj.grad, **TOL)


def test_logged_drop_rate_equals_the_counted_one(monkeypatch):
    model = tiny_model("mixtral", router_scale=40.0)
    plan = family_plan("mixtral", capacity_factor=1.0, dropless=False, drop_policy="sdrop",
                       aux_loss={"expert": 0.01})
    mf_ds.patch.apply(model, plan)
    model.train()
    seen = _capture_permute(monkeypatch)
    for seed in range(2):  # two micro-batches of one step
        model(_batch(seed, (2, 9))).logits.sum().backward()
    metrics = mf_ds.moe.step_metrics(model)
    assert sorted(metrics) == [0, 1]
    for layer in (0, 1):
        micro = seen[layer::2]  # forward order: layer 0, layer 1, layer 0, layer 1
        dropped = sum(int((~kept).sum()) for _, kept, _ in micro)
        pairs = sum(kept.numel() for _, kept, _ in micro)
        assert metrics[layer]["drop_rate"] == pytest.approx(dropped / pairs)
        assert dropped > 0
        loads = [torch.bincount(ids.flatten(), minlength=8).double() for ids, _, _ in micro]
        assert metrics[layer]["expert_load"] == pytest.approx((sum(loads) / pairs).tolist())
        # MindFormers' fi_parameter holds the last micro-batch's f only
        last = loads[-1]
        assert metrics[layer]["drop_rate_estimate"] == pytest.approx((last / last.sum() - 1.0 / 8).clamp(min=0).sum())
    lines = mf_ds.moe.drop_rate_lines(metrics)
    assert lines == [f"layer: {i}, drop_rate: {metrics[i]['drop_rate_estimate']:.5f}" for i in (0, 1)] + \
        [f"layer: {i}, measured_drop_rate: {metrics[i]['drop_rate']:.5f}" for i in (0, 1)]
    assert mf_ds.moe.step_metrics(model)[0]["drop_rate"] == 0.0  # counters were reset


def test_no_estimate_without_an_expert_loss_or_on_the_gmm_and_mcore_paths():
    """MindFormers writes fi_parameter only in TopkRouterV2's expert loss: MoEV3 and mcore have none."""
    for settings in ({}, {"aux_loss": {"expert": 0.01}, "path": "moev3"}, {"aux_loss": {"expert": 0.01},
                                                                           "path": "mcore"}):
        model = tiny_model("mixtral", router_scale=40.0)
        mf_ds.patch.apply(model, family_plan("mixtral", capacity_factor=1.0, dropless=False, **settings))
        model.train()
        model(_batch())
        metrics = mf_ds.moe.step_metrics(model)
        assert all(m["drop_rate_estimate"] is None for m in metrics.values())
        assert all("measured_drop_rate" in line for line in mf_ds.moe.drop_rate_lines(metrics))


def test_capacity_per_token_group_with_rounding(monkeypatch):
    """token_groups 3 (e.g. sequence parallel over 3): each third of the tokens keeps its own C =
    roundup(ceil(k N cf / E), multiple), in MindFormers' order, and nothing else is dropped."""
    model = tiny_model("qwen3_moe", router_scale=40.0)
    plan = family_plan("qwen3_moe", capacity_factor=0.5, dropless=False, token_groups=3, capacity_multiple=2)
    mf_ds.patch.apply(model, plan)
    model.train()
    seen = _capture_permute(monkeypatch)
    block = model.model.layers[0].mlp
    x = torch.randn(2, 12, 32)  # 24 tokens, 3 groups of 8
    block(x)
    (ids, kept, capacity), = seen
    c = math.ceil(2 * 8 * 0.5 / 8)
    c += c % 2
    assert c == 2 and capacity == 3 * c
    routing = mf_ds.moe.route(block.gate(x.view(-1, 32)), block.spec)
    expected = torch.cat([_mindformers_within_capacity(part, 8, c, sdrop=False)
                          for part in routing.expert_ids_TK.split(8)])
    assert torch.equal(kept, expected) and (~expected).any()
    block(torch.randn(1, 7, 32))  # 7 tokens: not the YAML's shape, one group
    assert seen[-1][2] == math.ceil(2 * 7 * 0.5 / 8) + 1


def test_bias_of_a_llama_path_model_without_shared_experts_never_moves():
    """TopkBiasBalanceCallback reaches only `feed_forward.routed_experts` routers (callback.py 1.7.0)."""
    model = tiny_model("mixtral")
    plan = family_plan("mixtral", router=dict(bias_balance=True, bias_updated=False, bias_update_rate=0.1),
                       callbacks={"topk_bias_balance": BIAS_CALLBACK})
    mf_ds.patch.apply(model, plan)
    model.train()
    model(_batch()).logits.sum().backward()
    before = model.model.layers[0].mlp.gate.e_score_correction_bias.clone()
    mf_ds.moe.update_topk_bias(model, plan)
    assert torch.equal(model.model.layers[0].mlp.gate.e_score_correction_bias, before)
    assert mf_ds.moe.trainer_callbacks(plan) == []


def test_bfloat16_router_dense_type():
    model = tiny_model("qwen3_moe")
    mf_ds.patch.apply(model, family_plan("qwen3_moe", router=dict(dtype="bfloat16")))
    gate = model.model.layers[0].mlp.gate
    x = torch.randn(5, 32)
    logits = gate(x)
    assert logits.dtype == torch.bfloat16
    assert torch.equal(logits, torch.nn.functional.linear(x.bfloat16(), gate.weight.bfloat16()))


def test_dropless_and_eval_forwards_count_nothing_dropped():
    model = tiny_model("qwen3_moe")
    mf_ds.patch.apply(model, family_plan("qwen3_moe"))
    model.eval()
    model(_batch())
    assert all(m["expert_load"] == [0.0] * 8 for m in mf_ds.moe.step_metrics(model).values())
    model.train()
    model(_batch())
    metrics = mf_ds.moe.step_metrics(model)
    assert all(m["drop_rate"] == 0.0 and m["drop_rate_estimate"] is None for m in metrics.values())
    assert sum(metrics[0]["expert_load"]) == pytest.approx(1.0)


# ---- safe tokens -----------------------------------------------------------------------------------------------------
def test_safe_tokens_change_nothing_with_an_idle_expert():
    """Expert 3 never chosen (selection bias -100): safe tokens give the same outputs and gradients."""
    base = tiny_model("qwen3_moe")
    runs = []
    for safe in (False, True):
        model = copy.deepcopy(base)
        mf_ds.patch.apply(model, family_plan("qwen3_moe", safe_tokens=safe, capacity_factor=1.5, dropless=False,
                                             router=dict(bias_balance=True)))
        for layer in model.model.layers:
            layer.mlp.gate.e_score_correction_bias[3] = -100.0
        model.train()
        runs.append((_loss_and_grads(model, _batch()), mf_ds.moe.step_metrics(model)))
    ((logits_a, grads_a), metrics_a), ((logits_b, grads_b), metrics_b) = runs
    assert metrics_a[0]["expert_load"][3] == 0.0 and metrics_a == metrics_b
    assert_close(logits_b, logits_a, **TOL)
    for name, grad in grads_a.items():
        assert_close(grads_b[name], grad, **TOL, msg=name)


def test_safe_tokens_give_every_expert_a_row(monkeypatch):
    model = tiny_model("qwen3_moe")
    mf_ds.patch.apply(model, family_plan("qwen3_moe", safe_tokens=True))
    experts = model.model.layers[0].mlp.experts
    counts_seen = []
    original = mf_ds.moe.layer.grouped_mm
    monkeypatch.setattr(mf_ds.moe.layer, "grouped_mm",
                        lambda x, w, counts, *rest: counts_seen.append(counts.clone()) or original(x, w, counts, *rest))
    counts = torch.tensor([3, 0, 2, 0, 0, 4, 1, 0])
    x = torch.randn(12, 32)  # 10 rows + 2 padding rows
    y = experts(x, counts)
    assert all(bool((c >= 1).all()) for c in counts_seen)
    monkeypatch.setattr(mf_ds.moe.layer, "grouped_mm", original)
    experts.safe_tokens = False
    assert_close(y, experts(x, counts), **TOL)
    assert y[10:].abs().sum() == 0


# ---- aux losses ------------------------------------------------------------------------------------------------------
def _reference_aux_grads(model, ids, monkeypatch):
    """lm loss + every layer's aux loss as a plain graph-connected sum (valid without checkpointing)."""
    captured = []
    monkeypatch.setattr(mf_ds.moe.layer, "aux_losses", lambda *a: captured.append(aux_losses(*a)) or captured[-1])
    model.zero_grad()
    out = model(ids, labels=ids)
    total = out.loss + sum(captured)
    (total * 0.5).backward()  # as engine.backward under gradient accumulation 2
    monkeypatch.setattr(mf_ds.moe.layer, "aux_losses", aux_losses)
    return sum(captured).detach(), grads(model)


@pytest.mark.parametrize("checkpointing", [None, "non-reentrant", "reentrant"])
def test_aux_loss_gradient_reaches_the_router_under_checkpointing(monkeypatch, checkpointing):
    base = tiny_model("deepseek_v3")
    plan = family_plan("deepseek_v3", aux_loss={"expert": 0.3, "device": 0.0, "comm": 0.1}, z_loss=0.01)
    reference = copy.deepcopy(base)
    mf_ds.patch.apply(reference, plan)
    reference.train()
    ids = _batch()
    aux_ref, grads_ref = _reference_aux_grads(reference, ids, monkeypatch)

    model = copy.deepcopy(base)
    mf_ds.patch.apply(model, plan)
    model.train()
    if checkpointing:
        model.activation_checkpointing_enable({"use_reentrant": checkpointing == "reentrant"})
        model.enable_input_require_grads()
        assert model.model.layers[1].gradient_checkpointing
    out = model(ids, labels=ids)
    aux = mf_ds.moe.aux_loss(model)
    assert_close(aux.detach(), aux_ref, **TOL)
    assert mf_ds.moe.aux_loss(model) is None  # cleared
    ((out.loss + aux) * 0.5).backward()
    router = "model.layers.1.mlp.gate.weight"
    assert grads_ref[router].abs().sum() > 0
    for name, grad in grads_ref.items():
        assert_close(grads(model)[name], grad, **TOL, msg=name)
    assert mf_ds.moe.step_metrics(model)[1]["expert_load"] != [0.0] * 8  # counted once, not per recompute


def test_aux_loss_not_added_means_no_aux_gradient():
    base = tiny_model("qwen3_moe")
    plain, with_aux = copy.deepcopy(base), copy.deepcopy(base)
    mf_ds.patch.apply(plain, family_plan("qwen3_moe"))
    mf_ds.patch.apply(with_aux, family_plan("qwen3_moe", aux_loss={"expert": 0.5, "device": 0.0, "comm": 0.0}))
    ids = _batch()
    _, grads_plain = _loss_and_grads(plain.train(), ids)
    _, grads_aux = _loss_and_grads(with_aux.train(), ids)
    for name, grad in grads_plain.items():
        assert_close(grads_aux[name], grad, **TOL, msg=name)


# ---- bias balance and callbacks --------------------------------------------------------------------------------------
BIAS_CALLBACK = {"balance_via_topk_bias": True, "topk_bias_update_rate": None, "expert_num": 8}  # as the Plan has it
DROP_CALLBACK = {"expert_num": 8, "capacity_factor": None}


@pytest.mark.parametrize("callback_rate, rate", [(None, 0.01), (0.05, 0.05)])
def test_topk_bias_update_moves_against_the_load(callback_rate, rate):
    """bias += u * sign(mean load - load), u the callback's rate else moe_config's; only with the callback."""
    model = tiny_model("deepseek_v3")
    plan = family_plan("deepseek_v3",
                       callbacks={"topk_bias_balance": {**BIAS_CALLBACK, "topk_bias_update_rate": callback_rate}})
    mf_ds.patch.apply(model, plan)
    model.train()
    gate = model.model.layers[1].mlp.gate
    before = gate.e_score_correction_bias.clone()
    model(_batch()).logits.sum().backward()
    load = torch.tensor(mf_ds.moe.step_metrics(model)[1]["expert_load"], dtype=torch.float64)
    mf_ds.moe.update_topk_bias(model, family_plan("deepseek_v3"))  # no TopkBiasBalanceCallback: no move
    assert torch.equal(gate.e_score_correction_bias, before)
    mf_ds.moe.update_topk_bias(model, plan)
    expected = before + rate * torch.sign(load.mean() - load).float()
    assert_close(gate.e_score_correction_bias, expected)
    assert gate.e_score_correction_bias.dtype == torch.float32
    assert not torch.equal(expected, before)
    mf_ds.moe.update_topk_bias(model, plan)  # its load counter was reset: no tokens, no move
    assert_close(gate.e_score_correction_bias, expected)


def test_bias_balance_on_a_family_without_a_native_bias_adds_one_buffer():
    model = tiny_model("qwen3_moe")
    keys = set(model.state_dict())
    report = mf_ds.patch.apply(model, family_plan("qwen3_moe", router=dict(bias_balance=True)))
    assert set(model.state_dict()) - keys == {f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in (0, 1)}
    assert any("new fp32 buffer" in line for line in report)


def test_drop_rate_estimate_uses_the_callbacks_capacity_factor():
    ids = _batch()
    estimates = []
    for callback_cf in (None, 0.5):
        model = tiny_model("qwen3_moe", router_scale=40.0)
        plan = family_plan("qwen3_moe", capacity_factor=1.5, dropless=False, aux_loss={"expert": 0.01},
                           callbacks={"moe_drop_rate": {**DROP_CALLBACK, "capacity_factor": callback_cf}})
        mf_ds.patch.apply(model, plan)
        model.train()
        model(ids)
        metrics = mf_ds.moe.step_metrics(model)[0]
        load = torch.tensor(metrics["expert_load"])
        cf = 1.5 if callback_cf is None else callback_cf
        assert metrics["drop_rate_estimate"] == pytest.approx((load - cf / 8).clamp(min=0).sum().item(), abs=1e-6)
        estimates.append(metrics["drop_rate_estimate"])
    assert estimates[1] > estimates[0]


def test_hf_trainer_callbacks(capsys):
    model = tiny_model("deepseek_v3", router_scale=40.0)
    plan = family_plan("deepseek_v3", capacity_factor=1.0, dropless=False, drop_rate_callback=True,
                       callbacks={"topk_bias_balance": BIAS_CALLBACK, "moe_drop_rate": DROP_CALLBACK})
    callbacks = mf_ds.moe.trainer_callbacks(plan)
    assert [type(c).__name__ for c in callbacks] == ["MoEDropRateCallback", "TopkBiasBalanceCallback"]
    assert mf_ds.moe.trainer_callbacks(family_plan("deepseek_v3", drop_rate_callback=True)) == []  # no entries
    assert not family_plan("deepseek_v3", callbacks={"moe_drop_rate": DROP_CALLBACK}).logs_drop_rate
    mf_ds.patch.apply(model, plan)
    model.train()
    model(_batch()).logits.sum().backward()
    bias_before = model.model.layers[1].mlp.gate.e_score_correction_bias.clone()
    for callback in callbacks:
        callback.on_step_end(None, None, None, model=model)
    err = capsys.readouterr().err.splitlines()
    # no expert aux loss: MindFormers prints nothing; our measured rate has its own line
    assert err == [f"layer: 1, measured_drop_rate: {callbacks[0].metrics[1]['drop_rate']:.5f}"]
    assert callbacks[0].metrics[1]["drop_rate"] > 0
    assert not torch.equal(model.model.layers[1].mlp.gate.e_score_correction_bias, bias_before)


@pytest.mark.parametrize("safe_tokens", [True, False])  # False: the permute folded into the first grouped matmul
def test_triton_kernels_through_the_interpreter_match_the_torch_path(monkeypatch, safe_tokens):
    """MF_DS_FORCE_TRITON=1: the block's permute, grouped matmuls, SwiGLU and unpermute run their Triton kernels
    (interpreted on CPU), with dropping, with and without safe tokens; same outputs and gradients as the torch
    path."""
    base = tiny_model("qwen3_moe")
    plan = family_plan("qwen3_moe", capacity_factor=1.0, dropless=False, safe_tokens=safe_tokens)
    gathers = []
    real_gather = mf_ds.moe.layer.grouped_mm_gather
    monkeypatch.setattr(mf_ds.moe.layer, "grouped_mm_gather", lambda *a: gathers.append(1) or real_gather(*a))
    runs = []
    for force in ("0", "1"):
        model = copy.deepcopy(base)
        mf_ds.patch.apply(model, plan)
        block = model.model.layers[0].mlp.train()
        x = torch.randn(1, 7, 32, generator=torch.Generator().manual_seed(0), requires_grad=True)
        monkeypatch.setenv("MF_DS_FORCE_TRITON", force)
        y = block(x)
        y.square().sum().backward()
        runs.append((y.detach(), x.grad, block.experts.gate_up_proj.grad, block.experts.down_proj.grad,
                     block.gate.weight.grad))
    for torch_path, triton_path in zip(*runs, strict=True):
        assert_close(triton_path, torch_path, **TOL)
    assert len(gathers) == (0 if safe_tokens else 1), "the gathered path runs on the Triton path without safe tokens"


def test_plan_and_model_disagreeing_is_an_error():
    model = tiny_model("deepseek_v3")
    with pytest.raises(mf_ds.patch.PatchError, match="layer 0"):
        mf_ds.patch.apply(model, family_plan("deepseek_v3", layers=[0, 1]))
    with pytest.raises(mf_ds.patch.PatchError, match="experts"):
        mf_ds.patch.apply(model, family_plan("deepseek_v3", num_experts=16))
    assert not any(isinstance(m, mf_ds.moe.MFMoE) for m in model.modules())
    llama = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "llama", hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, vocab_size=64))
    with pytest.raises(mf_ds.patch.PatchError, match="no patch for model type 'llama'"):
        mf_ds.patch.apply(llama, moe_plan())


def test_gbs_aux_loss_uses_the_running_f_of_the_step():
    """mcore gbs_aux_loss (TopKRouter fi_accu): micro-batch m's expert loss takes f = the mean of the step's f so
    far (all ranks: one here); the step end starts it again."""
    model = tiny_model("qwen3_moe", router_scale=10.0)
    mf_ds.patch.apply(model, family_plan("qwen3_moe", path="mcore", aux_f="global_batch",
                                         aux_loss={"expert": 0.1}))
    model.train()
    block = model.model.layers[0].mlp
    spec = block.spec
    xs = [torch.randn(10, 32, generator=torch.Generator().manual_seed(seed)) for seed in range(3)]
    fs, got = [], []
    for x in xs[:2]:
        block(x)
        got.append(block._aux_value)
        routing = mf_ds.moe.route(block.gate(x), spec)
        fs.append(expert_fractions(routing.expert_ids_TK, spec)[0])
        expected_f = torch.stack(fs).mean(0)
        assert_close(got[-1], aux_losses(block.gate(x), routing.scores_TE, spec, routing.expert_ids_TK, expected_f))
    assert not torch.allclose(got[1], aux_losses(block.gate(xs[1]), mf_ds.moe.route(block.gate(xs[1]), spec).scores_TE,
                                                 spec, mf_ds.moe.route(block.gate(xs[1]), spec).expert_ids_TK))
    mf_ds.moe.step_metrics(model)  # step end
    block(xs[2])
    routing = mf_ds.moe.route(block.gate(xs[2]), spec)
    assert_close(block._aux_value, aux_losses(block.gate(xs[2]), routing.scores_TE, spec, routing.expert_ids_TK))


def test_llama_path_estimate_without_the_discarded_loss():
    """Legacy Llama MoE: the expert loss is computed (fi written) and discarded, so MindFormers logs its estimate
    while nothing is added to the loss; with the balancing bias the estimate counts a plain top-k."""
    model = tiny_model("mixtral", router_scale=40.0)
    plan = family_plan("mixtral", capacity_factor=1.0, dropless=False, aux_loss_configured={"expert": 0.01},
                       router=dict(bias_balance=True, bias_updated=False))
    mf_ds.patch.apply(model, plan)
    model.train()
    block = model.model.layers[0].mlp
    with torch.no_grad():
        block.gate.e_score_correction_bias.copy_(torch.tensor([5.0, 0, 0, 0, 0, 0, 0, 0]))  # selection: expert 0
    x = torch.randn(1, 12, 32)
    block(x)
    assert block._aux_value is None  # no loss added
    metrics = mf_ds.moe.step_metrics(model)
    scores = block.gate(x.view(-1, 32)).softmax(-1)
    f = torch.bincount(scores.topk(2, dim=-1).indices.flatten(), minlength=8).double() / 24
    assert metrics[0]["drop_rate_estimate"] == pytest.approx(float((f - 1.0 / 8).clamp(min=0).sum()))
    routed = torch.tensor(metrics[0]["expert_load"])
    assert routed[0] == pytest.approx(0.5)  # the routing itself took the biased choice
