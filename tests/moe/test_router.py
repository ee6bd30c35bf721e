"""The router against HF's routers and MindFormers' formulas: selection, gates, group limits, bias, aux losses."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch.testing import assert_close
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from mf_ds.moe.router import aux_losses, route
from tests.moe import moe_plan, moe_spec

T, H, E, K = 37, 16, 8, 3


def _sorted(routing):
    """(ids, gates) ordered by expert id, to compare with routers that return their choices unordered."""
    ids, order = routing[1].sort(-1)
    return ids, routing[0].gather(1, order)


@pytest.mark.parametrize("norm", [False, True])
def test_softmax_topk_matches_qwen3(norm):
    torch.manual_seed(0)
    hf = Qwen3MoeTopKRouter(SimpleNamespace(num_experts_per_tok=K, num_experts=E, norm_topk_prob=norm,
                                            hidden_size=H))
    torch.nn.init.normal_(hf.weight, std=1.0)
    x = torch.randn(T, H)
    logits, gates, ids = hf(x)
    ours = route(logits, moe_spec(E, K, norm_topk_prob=norm))
    assert torch.equal(ours.expert_ids_TK, ids)  # same order: by score, first choice first
    assert_close(ours.gates_TK, gates)
    assert ours.expert_ids_TK.dtype == torch.int64 and ours.gates_TK.dtype == torch.float32


def test_sigmoid_group_limited_with_bias_matches_deepseek_v3():
    torch.manual_seed(1)
    config = SimpleNamespace(num_experts_per_tok=K, num_local_experts=E, hidden_size=H, routed_scaling_factor=2.5,
                             n_group=4, topk_group=2, norm_topk_prob=True)
    hf = DeepseekV3TopkRouter(config)
    torch.nn.init.normal_(hf.weight, std=1.0)
    hf.e_score_correction_bias.copy_(torch.randn(E))
    x = torch.randn(T, H)
    logits, gates, ids = hf(x)
    spec = moe_spec(E, K, score="sigmoid", topk_method="noaux_tc", n_group=4, topk_group=2, norm_topk_prob=True,
                      routed_scaling_factor=2.5, bias_balance=True)
    ours = route(logits, spec, hf.e_score_correction_bias)
    ids_ours, gates_ours = _sorted((ours.gates_TK, ours.expert_ids_TK))
    ids_hf, gates_hf = _sorted((gates, ids))
    assert torch.equal(ids_ours, ids_hf)
    assert_close(gates_ours, gates_hf)
    # the bias only selects: the gates are the unbiased sigmoid scores of the chosen experts
    raw = logits.sigmoid().gather(1, ours.expert_ids_TK)
    assert_close(ours.gates_TK, 2.5 * raw / raw.sum(-1, keepdim=True))


def test_group_limited_greedy_matches_deepseek_v2():
    torch.manual_seed(2)
    config = SimpleNamespace(num_experts_per_tok=K, num_experts=E, hidden_size=H, routed_scaling_factor=1.5,
                             topk_method="group_limited_greedy", n_group=4, topk_group=2)
    hf = DeepseekV2TopkRouter(config)
    torch.nn.init.normal_(hf.weight, std=1.0)
    logits, gates, ids = hf(torch.randn(T, H))
    ours = route(logits, moe_spec(E, K, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                    routed_scaling_factor=1.5))
    assert torch.equal(_sorted((ours.gates_TK, ours.expert_ids_TK))[0], _sorted((gates, ids))[0])
    assert_close(_sorted((ours.gates_TK, ours.expert_ids_TK))[1], _sorted((gates, ids))[1])
    # every choice lies in one of the token's two best groups (group score: its best expert)
    group_best = logits.softmax(-1).view(T, 4, 2).max(-1).values.topk(2, dim=-1).indices
    assert all(set((ours.expert_ids_TK[t] // 2).tolist()) <= set(group_best[t].tolist()) for t in range(T))


def test_aux_losses_follow_mindformers_formulas():
    torch.manual_seed(3)
    logits = torch.randn(T, E, requires_grad=True)
    spec = moe_spec(E, K, aux_expert=0.01, aux_device=0.02, aux_comm=0.03, z_loss=0.004, device_groups=2,
                      comm_groups=2)
    scores = logits.softmax(-1)
    got = aux_losses(logits, scores, spec, scores.topk(K, dim=-1).indices)
    # naive, per moe.md §3: P_i = mean_t p_ti, f_i = share of the k*T pairs on i
    ids = scores.topk(K, dim=-1).indices
    f = torch.stack([(ids == i).sum() for i in range(E)]).float() / (K * T)
    P = scores.mean(0)
    expert = 0.01 * E ** 2 * (P * f).mean()  # alpha * E^2 * mean_E(P f), MindFormers' expression
    dev = sum(P[d * 4:(d + 1) * 4].mean() * f[d * 4:(d + 1) * 4].mean() for d in range(2)) / 2 * E ** 2
    z = 0.004 * torch.log(logits.exp().sum(-1)).square().mean()
    assert_close(got, expert + (0.02 + 0.03) * dev + z)
    got.backward()
    assert logits.grad.abs().sum() > 0


def test_sigmoid_aux_loss_uses_renormalised_scores():
    torch.manual_seed(4)
    logits = torch.randn(T, E)
    spec = moe_spec(E, K, score="sigmoid", aux_expert=0.1)
    scores = logits.sigmoid()
    probs = scores / scores.sum(-1, keepdim=True)
    ids = probs.topk(K, dim=-1).indices
    f = torch.stack([(ids == i).sum() for i in range(E)]).float() / (K * T)
    assert_close(aux_losses(logits, scores, spec, ids), 0.1 * E * (probs.mean(0) * f).sum(), rtol=1e-5, atol=1e-6)
    assert aux_losses(logits, scores, moe_spec(E, K, score="sigmoid")) is None


@pytest.mark.parametrize("tokens, cf, expected", [
    (4096, 1.1, 1127),  # moe.md §3: the corpus Mixtral-8x7B, k=2, E=8
    (10, 100.0, 10),  # clamped to N
    (5, 0.5, 1),
])
def test_capacity_formula(tokens, cf, expected):
    spec = moe_plan(num_experts=8, top_k=2, capacity_factor=cf, dropless=False).moe
    assert spec.capacity(tokens) == expected == min(math.ceil(2 * tokens * cf / 8), tokens)
    assert moe_plan(capacity_factor=cf, dropless=True).moe.capacity(tokens) is None
    with pytest.raises(ValueError, match="dropless must be True"):  # cf <= 0 is dropless, decided by translators/
        moe_plan(capacity_factor=-1.0, dropless=False)


def test_bad_specs_are_refused():
    with pytest.raises(ValueError, match="top_k"):
        moe_spec(4, 5)
    with pytest.raises(ValueError, match="n_group"):
        moe_spec(8, 2, topk_method="noaux_tc", n_group=3, topk_group=1)
    with pytest.raises(ValueError, match="score"):
        moe_spec(8, 2, score="relu")
