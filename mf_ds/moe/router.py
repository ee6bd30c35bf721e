"""The MoE router: scores, top-k (plain, group-limited, with the balancing bias), gates and the aux losses.

MindFormers `TopkRouterV2` (mindformers/modules/transformer/moe.py r1.5.0; reference/mindformers/moe.md §3):
  1. logits = x W^T in float32 (router_dense_type), scores = softmax(logits) or sigmoid(logits);
  2. the k experts with the highest `scores + bias` (the bias of `balance_via_topk_bias` / HF's
     `e_score_correction_bias` only *selects*), optionally inside the `topk_group` best of `n_group` expert groups
     (group score: max for group_limited_greedy, DeepSeek-V2; sum of the top two for noaux_tc, DeepSeek-V3);
  3. gates = the *unbiased* scores of the chosen experts, renormalised to sum 1 if norm_topk_prob (k > 1), then
     times routed_scaling_factor. Choices come out in rank order (first choice first): k-drop drops by that rank.
Aux losses (moe.md §3 step 4, `_expert/_device/_comm_load_balancing`), over the N tokens of this shard, from
`p` = scores (sigmoid scores renormalised over the experts) and a separate plain top-k of `p` (no bias, no groups):
    expert: a * E * sum_i P_i f_i       P_i = mean_t p_ti,  f_i = share of the k*N (token, choice) pairs on i
    device / comm: a * D * sum_d (sum_{i in d} P_i)(sum_{i in d} f_i)   over D equal groups of experts
    z-loss: a * mean_t logsumexp(logits_t)^2                           (ZLoss, ST-MoE)

Legend: T tokens, H hidden, E experts, K top-k, G expert groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

SCORES = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass(frozen=True)
class RouterSpec:
    """The router part of the Plan's `moe` (translators/moe.py)."""

    num_experts: int
    """E, routed experts (moe_config.expert_num)."""
    top_k: int
    """K, experts per token (num_experts_chosen)."""
    score: str = "softmax"
    """softmax | sigmoid (use_gating_sigmoid)."""
    topk_method: str = "greedy"
    """greedy | group_limited_greedy | noaux_tc."""
    n_group: int | None = None
    """Expert groups for the group-limited methods."""
    topk_group: int | None = None
    """Groups a token may use."""
    norm_topk_prob: bool = False
    """Renormalise the K gates to sum 1 (only meaningful for K > 1)."""
    routed_scaling_factor: float = 1.0
    """Multiplies the gates after the renormalisation."""
    bias_balance: bool = False
    """balance_via_topk_bias: a per-expert bias added to the scores for selection only."""
    aux_expert: float = 0.0
    """Factor of the expert-level balance loss."""
    aux_device: float = 0.0
    """Factor of the device-level balance loss."""
    aux_comm: float = 0.0
    """Factor of the communication-level balance loss."""
    z_loss: float = 0.0
    """Factor of the router z-loss."""
    aux_groups: int = 1
    """D, the expert groups of the device and comm losses: the expert-parallel degree."""

    def __post_init__(self):
        if self.score not in SCORES:
            raise ValueError(f"router score {self.score!r}: expected one of {SCORES}")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method {self.topk_method!r}: expected one of {TOPK_METHODS}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.top_k} must be in [1, num_experts {self.num_experts}]")
        if self.topk_method != "greedy":
            if not (self.n_group and self.topk_group) or self.num_experts % self.n_group:
                raise ValueError(f"{self.topk_method} needs n_group dividing {self.num_experts} experts and "
                                 f"topk_group (got {self.n_group}, {self.topk_group})")
        if self.num_experts % self.aux_groups:
            raise ValueError(f"{self.num_experts} experts do not split into {self.aux_groups} aux-loss groups")

    @classmethod
    def from_plan(cls, moe: dict) -> RouterSpec:
        router, aux = moe["router"], moe["aux_loss"]
        return cls(num_experts=moe["num_experts"], top_k=moe["top_k"], score=router["score"],
                   topk_method=router["topk_method"], n_group=router["n_group"], topk_group=router["topk_group"],
                   norm_topk_prob=router["norm_topk_prob"] and moe["top_k"] > 1,
                   routed_scaling_factor=router["routed_scaling_factor"], bias_balance=router["bias_balance"],
                   aux_expert=aux["expert"], aux_device=aux["device"], aux_comm=aux["comm"], z_loss=moe["z_loss"],
                   aux_groups=moe["expert_parallel"])

    @property
    def has_aux(self) -> bool:
        return bool(self.aux_expert or self.aux_device or self.aux_comm or self.z_loss)


class Routing(NamedTuple):
    scores_TE: torch.Tensor
    """float32 probabilities (softmax or sigmoid), unbiased."""
    gates_TK: torch.Tensor
    """float32 combine weights of the chosen experts (renormalised and scaled as the spec says)."""
    expert_ids_TK: torch.Tensor
    """int64 expert of each choice, first choice first."""


def route(logits_TE: torch.Tensor, spec: RouterSpec, bias_E: torch.Tensor | None = None) -> Routing:
    """Choose K experts per token and their gates (module docstring, steps 1-3)."""
    logits_TE = logits_TE.float()
    scores_TE = logits_TE.softmax(-1) if spec.score == "softmax" else logits_TE.sigmoid()
    with torch.no_grad():
        choice_TE = scores_TE if bias_E is None else scores_TE + bias_E.float()
        if spec.topk_method != "greedy":
            choice_TE = _limit_groups(choice_TE, spec)
        expert_ids_TK = choice_TE.topk(spec.top_k, dim=-1, sorted=True).indices
    gates_TK = scores_TE.gather(1, expert_ids_TK)
    if spec.norm_topk_prob:
        # + 1e-20 as HF DeepseekV3TopkRouter (MindFormers adds 1e-9): only guards sigmoid scores that all underflow
        gates_TK = gates_TK / (gates_TK.sum(-1, keepdim=True) + 1e-20)
    if spec.routed_scaling_factor != 1.0:
        gates_TK = gates_TK * spec.routed_scaling_factor
    return Routing(scores_TE, gates_TK, expert_ids_TK)


def _limit_groups(choice_TE: torch.Tensor, spec: RouterSpec) -> torch.Tensor:
    """Mask (to -inf) the experts outside each token's `topk_group` best groups."""
    tokens, experts = choice_TE.shape
    grouped_TGe = choice_TE.view(tokens, spec.n_group, experts // spec.n_group)
    if spec.topk_method == "group_limited_greedy":  # DeepSeek-V2: the best expert of the group
        group_TG = grouped_TGe.max(-1).values
    else:  # noaux_tc, DeepSeek-V3: the sum of the group's two best
        group_TG = grouped_TGe.topk(min(2, grouped_TGe.shape[-1]), dim=-1).values.sum(-1)
    keep_TG = torch.zeros_like(group_TG, dtype=torch.bool)
    keep_TG.scatter_(1, group_TG.topk(spec.topk_group, dim=-1).indices, True)
    return grouped_TGe.masked_fill(~keep_TG.unsqueeze(-1), float("-inf")).view(tokens, experts)


def aux_losses(logits_TE: torch.Tensor, scores_TE: torch.Tensor, spec: RouterSpec) -> torch.Tensor | None:
    """The balance losses and z-loss of the module docstring, summed; None when every factor is 0."""
    if not spec.has_aux:
        return None
    total = logits_TE.new_zeros((), dtype=torch.float32)
    if spec.aux_expert or spec.aux_device or spec.aux_comm:
        probs_TE = scores_TE if spec.score == "softmax" else scores_TE / (scores_TE.sum(-1, keepdim=True) + 1e-9)
        with torch.no_grad():
            ids = probs_TE.topk(spec.top_k, dim=-1).indices.flatten()
            f_E = torch.zeros(spec.num_experts, device=ids.device).index_add_(
                0, ids, torch.ones_like(ids, dtype=torch.float32)) / ids.numel()
        p_E = probs_TE.mean(0)
        experts = spec.num_experts
        if spec.aux_expert:
            total = total + spec.aux_expert * experts * (p_E * f_E).sum()
        for factor in (spec.aux_device, spec.aux_comm):
            if factor:
                groups = spec.aux_groups
                total = total + factor * groups * (p_E.view(groups, -1).sum(-1) * f_E.view(groups, -1).sum(-1)).sum()
    if spec.z_loss:
        total = total + spec.z_loss * logits_TE.float().logsumexp(-1).square().mean()
    return total


class MFRouter(nn.Module):
    """The router's parameters under HF's names: `weight` [E, H] and, for selection, `e_score_correction_bias` [E].

    It is the HF router's own `weight` Parameter (and DeepSeek's bias buffer), so training updates the HF tensors
    and the state-dict keys stay `...mlp.gate.weight` / `...mlp.gate.e_score_correction_bias`.
    """

    def __init__(self, weight: nn.Parameter, bias: torch.Tensor | None, persistent_bias: bool = True):
        super().__init__()
        self.weight = weight
        if bias is not None:
            self.register_buffer("e_score_correction_bias", bias, persistent=persistent_bias)
        else:
            self.e_score_correction_bias = None

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        """float32 logits [T, E] (MindFormers' router_dense_type float32; HF DeepSeek does the same)."""
        return F.linear(x_TH.float(), self.weight.float())
