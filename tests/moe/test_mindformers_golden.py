"""mf-ds' MoE against MindFormers 1.7.0's own outputs (tests/fixtures/moe_golden.json, written by
tests/fixtures/make_moe_golden.py with real MindSpore on CPU). Each test is named after the MindFormers function it
checks; none needs MindSpore."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from torch.testing import assert_close

from mf_ds.moe.callbacks import drop_rate_lines
from mf_ds.moe.layer import group_capacity_mask
from mf_ds.moe.router import aux_losses, aux_top_k, expert_fractions, route
from mf_ds.ops.permute import permute
from tests.moe import moe_spec
from translators.errors import ConfigError
from translators.moe import _token_groups
from translators.plan import translate
from translators.plan_types import MoE
from translators.sections import MoEConfig, ParallelConfig

CONFIGS = Path(__file__).parents[2] / "configs"

GOLDEN = json.loads((Path(__file__).parents[1] / "fixtures" / "moe_golden.json").read_text())
CASES = {case["name"]: case for case in GOLDEN["router"]}


def _specs(case: dict) -> tuple[MoE, float | None]:
    """Our Plan `moe` section for a golden case, built from its MoEConfig and parallel layout the way
    translators/moe.py builds it, and the drop-rate estimate's capacity factor."""
    cfg = MoEConfig.parse({"routing_policy": "TopkRouterV2", **case["moe_config"]})
    pc = ParallelConfig.parse({k: v for k, v in case["parallel"].items() if k != "data_parallel"})
    aux = dict(zip(cfg.aux_loss_types or [], cfg.aux_loss_factors or [], strict=True))
    _, multiple = _token_groups("moev2", pc, cfg, "")
    spec = moe_spec(
        cfg.expert_num, cfg.num_experts_chosen, score="sigmoid" if cfg.use_gating_sigmoid else "softmax",
        topk_method=cfg.topk_method, n_group=cfg.n_group, topk_group=cfg.topk_group,
        norm_topk_prob=cfg.norm_topk_prob and cfg.num_experts_chosen > 1,
        routed_scaling_factor=cfg.routed_scaling_factor, bias_balance=cfg.balance_via_topk_bias,
        aux_expert=aux.get("expert", 0.0), aux_device=aux.get("device", 0.0), aux_comm=aux.get("comm", 0.0),
        z_loss=cfg.z_loss_factor, device_groups=cfg.expert_group_size, comm_groups=pc.expert_parallel,
        token_groups=case["parallel"]["data_parallel"], path="moev2", capacity_factor=cfg.capacity_factor,
        dropless=cfg.capacity_factor <= 0, drop_policy="sdrop" if cfg.enable_sdrop else "kdrop",
        capacity_multiple=multiple)
    return spec, cfg.capacity_factor if aux.get("expert") else None


def _route(case: dict):
    router, estimate_cf = _specs(case)
    logits = torch.tensor(case["logits"])  # (dp, N, E): the dp token groups, consecutive
    groups, tokens, experts = logits.shape
    bias = None if case["topk_bias"] is None else torch.tensor(case["topk_bias"])
    return router, estimate_cf, logits.view(-1, experts), route(logits.view(-1, experts), router, bias), groups, \
        tokens


@pytest.mark.parametrize("name", sorted(CASES))
def test_TopkRouterV2_construct(name):
    """Selection, gates (0 for a dropped pair), capacity, drops and the extra loss, case by case."""
    case = CASES[name]
    router, _, logits, routing, groups, tokens = _route(case)
    k = router.top_k
    theirs = torch.tensor(case["expert_ids"]).view(-1, k)
    if router.plain_aux_topk or not router.has_balance:  # the extra loss does not depend on the routing's ties
        extra = aux_losses(logits, routing.scores_TE, router, routing.expert_ids_TK)
        assert_close(float(0.0 if extra is None else extra), case["extra_loss"], rtol=1e-5, atol=1e-8)
    if not torch.equal(routing.expert_ids_TK, theirs):
        _assert_same_up_to_masked_ties(case, router, routing.expert_ids_TK, theirs)
        return
    capacity = router.capacity(tokens)
    if capacity is None:  # capacity_factor <= 0: MindFormers' dynamic capacity holds every pair
        kept = torch.ones_like(routing.expert_ids_TK, dtype=torch.bool)
    else:
        assert capacity == case["capacity"]
        kept = group_capacity_mask(routing.expert_ids_TK, router.num_experts, capacity, router.drop_policy, groups)
        if groups == 1:  # the single-group path of MFMoE.forward: permute's own capacity
            x = torch.zeros(logits.shape[0], 1)
            assert torch.equal(permute(x, routing.expert_ids_TK, router.num_experts, capacity,
                                       router.drop_policy).kept_TK, kept)
    assert kept.view(groups, tokens, k).tolist() == case["kept"]
    assert_close((routing.gates_TK * kept).view(groups, tokens, k), torch.tensor(case["router_coeff"]),
                 rtol=1e-5, atol=1e-7)
    extra = aux_losses(logits, routing.scores_TE, router, routing.expert_ids_TK)
    assert_close(float(0.0 if extra is None else extra), case["extra_loss"], rtol=1e-5, atol=1e-8)


def _assert_same_up_to_masked_ties(case: dict, router: MoE, ours: torch.Tensor, theirs: torch.Tensor):
    """Where a group-limited choice falls on the 0.0 of a masked group, every masked expert ties: ours takes the
    lowest id, MindSpore's CPU TopK another. Then the choices agree up to that tie: same experts elsewhere, and
    each differing one is a masked 0.0 on both sides (and the case is built to have them: negative biased
    scores, so a masked group's 0.0 wins, which -inf masking would never allow)."""
    assert router.grouped and case["topk_bias"] is not None, "choices differ outside a masked tie"
    probs = torch.tensor(case["logits"]).view(ours.shape[0], -1)
    probs = probs.softmax(-1) if router.router.score == "softmax" else probs.sigmoid()
    from mf_ds.moe.router import _limit_groups

    masked = _limit_groups(probs + torch.tensor(case["topk_bias"]), router)
    differ = ours != theirs
    assert differ.any()
    assert (masked.gather(1, ours)[differ] == 0).all() and (masked.gather(1, theirs)[differ] == 0).all()
    assert (masked.gather(1, theirs) == 0).any()  # MindFormers too chose a masked group's expert


@pytest.mark.parametrize("name", sorted(CASES))
def test_TopkRouterV2_expert_load_balancing_fi(name):
    """fi_parameter, what MoEDropRateCallback reads: per group, from the aux top-k (a plain top-k of the
    probabilities with the balancing bias, the routing's own choices otherwise); zero without an expert loss."""
    case = CASES[name]
    router, _, _, routing, _, _ = _route(case)
    if not router.aux_loss.expert:
        assert not any(any(row) for row in case["fi"])
        return
    f_SE = expert_fractions(aux_top_k(routing.scores_TE, routing.expert_ids_TK, router), router)
    assert_close(f_SE, torch.tensor(case["fi"]), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", sorted(CASES))
def test_MoEDropRateCallback_callback_droprate(name):
    """The logged line. MindFormers' standalone run sums fi over its dp rows (on a cluster each rank holds its
    own row): our per-group estimates summed give that line."""
    case = CASES[name]
    router, estimate_cf, _, routing, _, _ = _route(case)
    metrics = {1: {"drop_rate": 0.0, "drop_rate_estimate": None}}
    if estimate_cf is not None:
        f_SE = expert_fractions(aux_top_k(routing.scores_TE, routing.expert_ids_TK, router), router)
        cf = estimate_cf
        metrics[1]["drop_rate_estimate"] = float((f_SE - cf / router.num_experts).clamp(min=0).sum())
    mindformers_lines = [line for line in drop_rate_lines(metrics) if "measured" not in line]
    assert mindformers_lines == case["drop_rate_lines"]


@pytest.mark.parametrize("name", [n for n in sorted(CASES) if "expert_load" in CASES[n]])
def test_TopkRouterV2_update_expert_load(name):
    """expert_load (TopkBiasBalanceCallback's input): the share of the routed pairs per expert, from the biased
    selection, averaged over the groups."""
    case = CASES[name]
    router, _, _, routing, _, _ = _route(case)
    theirs = torch.tensor(case["expert_ids"]).view(routing.expert_ids_TK.shape)
    load = expert_fractions(theirs, router).mean(0)  # MindFormers' own choices (ties: test_TopkRouterV2_construct)
    assert_close(load, torch.tensor(case["expert_load"]), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("row", GOLDEN["capacity"], ids=lambda r: f"k{r['k']}-N{r['tokens']}-mp{r['mp']}")
def test_calculate_expert_capacity_v2(row):
    spec = moe_spec(row["experts"], row["k"], capacity_factor=row["capacity_factor"], dropless=False,
                    capacity_multiple=row["mp"])
    assert spec.capacity(row["tokens"]) == row["capacity"]


@pytest.mark.parametrize("row", GOLDEN["groups"], ids=lambda r: json.dumps(r["parallel"]) + str(r["moe_config"]))
def test_MoEV2_init_token_groups(row):
    """MoEV2's token groups (dp_group = data_parallel x our groups per shard) and its router's capacity rounding
    (mp x comp_comm degree), from the same YAML layout."""
    cfg = MoEConfig.parse(row["moe_config"])
    pc = ParallelConfig.parse(row["parallel"])
    groups, multiple = _token_groups("moev2", pc, cfg, "")
    assert groups * pc.data_parallel == row["dp_group"]
    assert multiple == row["router_mp"] * row["comp_comm_degree"]


def test_MoEV2_init_refuses_the_default_routing_policy():
    tree = {"model": {"model_config": {"type": "LlamaConfig", "num_layers": 2, "hidden_size": 32, "num_heads": 4,
                                       "intermediate_size": 48, "vocab_size": 64, "seq_length": 16}},
            "moe_config": {"expert_num": 4, "num_experts_chosen": 2}}
    message = GOLDEN["refusals"]["routing_policy_default"].split(": ", 1)[1]
    with pytest.raises(ConfigError) as raised:
        translate(tree)
    assert message in str(raised.value) and "moe_config.routing_policy" in str(raised.value)


@pytest.mark.parametrize("case", GOLDEN["moev3"], ids=lambda c: c["name"])
def test_MoEV3_construct_routing_and_loss(case):
    """use_gmm: a plain top-k although the moe_config asks for group-limited routing, and only the expert loss
    (the device and z losses it configures are not computed), over MoEV3's data_parallel x model_parallel token
    groups: the Plan translators/moe.py writes for such a YAML, run by the router."""
    from translators.plan import translate

    tree = yaml.safe_load((CONFIGS / "tiny_deepseek_v3.yaml").read_text())
    shape = {key: tree["moe_config"][key] for key in ("moe_intermediate_size", "shared_expert_num",
                                                     "first_k_dense_replace")}
    tree["moe_config"] = {**case["moe_config"], **shape}
    tree["parallel_config"] = {**tree["parallel_config"], **case["parallel"]}
    tree["use_parallel"] = True
    tree["callbacks"] = [c for c in tree["callbacks"] if "expert_num" not in c]
    moe = translate(tree).plan.moe  # the YAML's own world (its model_parallel runs as TP)
    router = moe
    assert (router.path, router.router.topk_method, router.token_groups) == ("moev3", "greedy", case["groups"])
    logits = torch.tensor(case["logits"])
    groups, tokens, experts = logits.shape
    bias = None if case["topk_bias"] is None else torch.tensor(case["topk_bias"])
    routing = route(logits.view(-1, experts), router, bias)
    assert routing.expert_ids_TK.view(groups, tokens, -1).tolist() == case["expert_ids"]
    assert_close(routing.gates_TK.view(groups, tokens, -1), torch.tensor(case["router_coeff"]), rtol=1e-5, atol=1e-7)
    extra = aux_losses(logits.view(-1, experts), routing.scores_TE, router, routing.expert_ids_TK)
    assert_close(float(extra), case["extra_loss"], rtol=1e-5, atol=1e-8)
