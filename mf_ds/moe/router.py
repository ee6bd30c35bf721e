"""The MoE router: scores, top-k (plain, group-limited, with the balancing bias), gates and the aux losses.

Three MindFormers code paths (the Plan's `moe.path`; reference/mindformers/moe.md, tests/fixtures/moe_golden.json):
  moev2  `TopkRouterV2` (mindformers/modules/transformer/moe.py), the legacy capacity MoE:
    1. logits = x W^T in float32 (router_dense_type), scores = softmax(logits) or sigmoid(logits);
    2. the k experts with the highest `scores + bias` (the bias of `balance_via_topk_bias` / HF's
       `e_score_correction_bias` only *selects*). group_limited_greedy / noaux_tc first score the n_group groups
       (max / sum of the top two of `scores + bias`), keep every group scoring >= the topk_group-th best, and
       set the other groups' scores to **0.0** (not -inf: a negative biased score loses to a dropped group's 0.0);
    3. gates = the top-k values of those masked scores, or with the bias the *unbiased* scores of the chosen
       experts; renormalised to sum 1 (+1e-9) if norm_topk_prob (k > 1), then times routed_scaling_factor.
  moev3  `MoEV3` (moev3.py, use_gmm): plain top-k of `scores (+ bias)` whatever topk_method says, gates as above.
  mcore  `TopKRouter` (parallel_core/training_graph/transformer/moe/router.py): groups when n_group/topk_group
       are set, scored by the sum of their top k/topk_group, exactly topk_group kept, 0.0 mask; +1e-20.
Choices come out in rank order (first choice first): k-drop drops by that rank. The masked groups' 0.0s tie: they
go to the lower expert id (MindSpore's CPU TopK orders them otherwise; tests/moe/test_mindformers_golden.py).

Aux losses, per token group (the N tokens of one MindFormers data-parallel shard, `token_groups` of them in this
forward) and averaged over the groups, from `p` = scores (sigmoid scores renormalised over the experts) and the
aux top-k: the routing's own choices, except a separate plain top-k of `p` in moev2 with the bias and a balance
loss, and in moev3 with the bias:
    expert: a * E * sum_i P_i f_i       P_i = mean_t p_ti,  f_i = share of the k*N (token, choice) pairs on i
    device: a * D * sum_d (sum_{i in d} P_i)(sum_{i in d} f_i)   D = expert_group_size equal groups of experts
    comm:   the same over D = the YAML's expert_parallel groups
    (mcore gbs_aux_loss: f is the mean over all ranks of this and the step's earlier micro-batches, TopKRouter's
    fi_accu, reset every step; seq_aux_loss: a group is a whole data-parallel x context-parallel shard)
    z-loss: a * mean_t logsumexp(logits_t)^2                           (ZLoss, ST-MoE)
Which of them exist on each path is the translator's business (translators/moe.py): moev3 has only the expert
loss, mcore no z-loss, and the legacy Llama path discards them all.

Legend: T tokens, H hidden, E experts, K top-k, G expert groups, S token groups, N tokens of a group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from translators.plan_types import MoE

SCORES = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
PATHS = ("moev2", "moev3", "mcore")


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
    """greedy | group_limited_greedy | noaux_tc (mcore: any but greedy means its own group rule)."""
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
    device_groups: int | None = None
    """D of the device loss: moe_config.expert_group_size."""
    comm_groups: int = 1
    """D of the comm loss: the YAML's parallel_config.expert_parallel (not this run's)."""
    token_groups: int = 1
    """MindFormers token groups (data-parallel shards) in one forward on this rank: capacity and aux losses are
    per group."""
    path: str = "moev2"
    """moev2 | moev3 | mcore: whose routing rules (module docstring)."""
    configured_balance: tuple[float, float, float] | None = None
    """The YAML's (expert, device, comm) factors before the path dropped any (the legacy Llama path computes the
    losses and discards them): they still decide the aux top-k and MindFormers' drop-rate estimate. None: the
    aux_* factors."""
    global_batch_f: bool = False
    """mcore gbs_aux_loss: f of the balance loss is the mean over every rank and the step's micro-batches so far
    (MFMoE keeps it), not the group's own."""

    def __post_init__(self):
        if self.score not in SCORES:
            raise ValueError(f"router score {self.score!r}: expected one of {SCORES}")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method {self.topk_method!r}: expected one of {TOPK_METHODS}")
        if self.path not in PATHS:
            raise ValueError(f"router path {self.path!r}: expected one of {PATHS}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.top_k} must be in [1, num_experts {self.num_experts}]")
        if self.grouped:
            if not (self.n_group and self.topk_group) or self.num_experts % self.n_group:
                raise ValueError(f"{self.topk_method} needs n_group dividing {self.num_experts} experts and "
                                 f"topk_group (got {self.n_group}, {self.topk_group})")
        if self.aux_device and (not self.device_groups or self.num_experts % self.device_groups):
            raise ValueError(f"the device loss needs expert_group_size dividing {self.num_experts} experts "
                             f"(got {self.device_groups})")
        if self.aux_comm and self.num_experts % self.comm_groups:
            raise ValueError(f"{self.num_experts} experts do not split into {self.comm_groups} comm-loss groups")
        if self.token_groups < 1:
            raise ValueError(f"token_groups {self.token_groups} must be >= 1")

    @classmethod
    def from_plan(cls, moe: MoE) -> RouterSpec:
        """The router of the Plan's typed `moe` section, flat (the routing functions' argument)."""
        router, aux, configured = moe.router, moe.aux_loss, moe.aux_loss_configured
        return cls(num_experts=moe.num_experts, top_k=moe.top_k, score=router.score,
                   topk_method=router.topk_method, n_group=router.n_group, topk_group=router.topk_group,
                   norm_topk_prob=router.norm_topk_prob, routed_scaling_factor=router.routed_scaling_factor,
                   bias_balance=router.bias_balance, aux_expert=aux.expert, aux_device=aux.device, aux_comm=aux.comm,
                   z_loss=moe.z_loss, device_groups=moe.aux_groups.device, comm_groups=moe.aux_groups.comm,
                   token_groups=moe.token_groups, path=moe.path,
                   configured_balance=(configured.expert, configured.device, configured.comm),
                   global_batch_f=moe.aux_f == "global_batch")

    @property
    def grouped(self) -> bool:
        """Group-limited selection (MoEV3 has none)."""
        return self.topk_method != "greedy" and self.path != "moev3"

    @property
    def has_balance(self) -> bool:
        return bool(self.aux_expert or self.aux_device or self.aux_comm)

    @property
    def has_aux(self) -> bool:
        return self.has_balance or bool(self.z_loss)

    @property
    def configured(self) -> tuple[float, float, float]:
        """The YAML's (expert, device, comm) balance factors, added or not."""
        return self.configured_balance or (self.aux_expert, self.aux_device, self.aux_comm)

    @property
    def plain_aux_topk(self) -> bool:
        """f of the balance losses (and MoEDropRateCallback's estimate) from a separate plain top-k of p, not from
        the routing (moe.py TopkRouterV2.construct; moev3.py MoEV3.construct; mcore uses the routing)."""
        if self.path == "moev2":
            return self.bias_balance and any(factor > 0 for factor in self.configured)
        return self.bias_balance and self.path == "moev3"


class Routing(NamedTuple):
    scores_TE: torch.Tensor
    """float32 probabilities (softmax or sigmoid), unbiased."""
    gates_TK: torch.Tensor
    """float32 combine weights of the chosen experts (renormalised and scaled as the spec says)."""
    expert_ids_TK: torch.Tensor
    """int64 expert of each choice, first choice first."""


def _topk(x_TE: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k, ties to the lower index (the 0.0 of masked groups ties)."""
    values, indices = x_TE.sort(dim=-1, descending=True, stable=True)
    return values[:, :k], indices[:, :k]


def route(logits_TE: torch.Tensor, spec: RouterSpec, bias_E: torch.Tensor | None = None) -> Routing:
    """Choose K experts per token and their gates (module docstring, steps 1-3)."""
    # scores in the logits' dtype (bfloat16 with router_dense_type bfloat16, as MindFormers' gating), then float32
    scores_TE = (logits_TE.softmax(-1) if spec.score == "softmax" else logits_TE.sigmoid()).float()
    biased_TE = scores_TE if bias_E is None else scores_TE + bias_E.float()
    if spec.grouped:
        biased_TE = _limit_groups(biased_TE, spec)
    # the masked groups' 0.0s tie: a stable sort gives them to the lower id; elsewhere torch's top-k (faster)
    topk = _topk if spec.grouped else (lambda x, k: x.topk(k, dim=-1, sorted=True))
    if bias_E is None:  # the gates are the top-k values themselves (masked ones included: 0.0)
        gates_TK, expert_ids_TK = topk(biased_TE, spec.top_k)
    else:
        with torch.no_grad():
            expert_ids_TK = topk(biased_TE, spec.top_k)[1]
        gates_TK = scores_TE.gather(1, expert_ids_TK)
    if spec.norm_topk_prob:
        eps = 1e-20 if spec.path == "mcore" else 1e-9
        gates_TK = gates_TK / (gates_TK.sum(-1, keepdim=True) + eps)
    if spec.routed_scaling_factor != 1.0:
        gates_TK = gates_TK * spec.routed_scaling_factor
    return Routing(scores_TE, gates_TK, expert_ids_TK)


def _limit_groups(choice_TE: torch.Tensor, spec: RouterSpec) -> torch.Tensor:
    """Set (to 0.0) the scores outside each token's kept groups (module docstring, step 2)."""
    tokens, experts = choice_TE.shape
    grouped_TGe = choice_TE.view(tokens, spec.n_group, experts // spec.n_group)
    with torch.no_grad():
        if spec.path == "mcore":  # sum of the top k/topk_group, exactly topk_group groups
            group_TG = grouped_TGe.topk(spec.top_k // spec.topk_group, dim=-1).values.sum(-1)
            keep_TG = torch.zeros_like(group_TG, dtype=torch.bool)
            keep_TG.scatter_(1, _topk(group_TG, spec.topk_group)[1], True)
        else:
            if spec.topk_method == "group_limited_greedy":  # DeepSeek-V2: the best expert of the group
                group_TG = grouped_TGe.max(-1).values
            else:  # noaux_tc, DeepSeek-V3: the sum of the group's two best
                group_TG = grouped_TGe.topk(2, dim=-1).values.sum(-1)
            # every group at least as good as the topk_group-th best (ties keep more groups)
            keep_TG = group_TG >= group_TG.topk(spec.topk_group, dim=-1).values.min(-1, keepdim=True).values
    return grouped_TGe.masked_fill(~keep_TG.unsqueeze(-1), 0.0).view(tokens, experts)


def aux_top_k(scores_TE: torch.Tensor, expert_ids_TK: torch.Tensor, spec: RouterSpec) -> torch.Tensor:
    """The (token, choice) experts that f counts: the routing's, or a plain top-k of p (`plain_aux_topk`)."""
    if not spec.plain_aux_topk:
        return expert_ids_TK
    with torch.no_grad():
        return _aux_probs(scores_TE, spec).topk(spec.top_k, dim=-1).indices


def _aux_probs(scores_TE: torch.Tensor, spec: RouterSpec) -> torch.Tensor:
    return scores_TE if spec.score == "softmax" else scores_TE / (scores_TE.sum(-1, keepdim=True) + 1e-9)


def expert_fractions(aux_ids_TK: torch.Tensor, spec: RouterSpec) -> torch.Tensor:
    """f [S, E]: per token group, the share of its k*N (token, choice) pairs on each expert."""
    ids_SP = aux_ids_TK.reshape(spec.token_groups, -1)
    counts_SE = torch.zeros(ids_SP.shape[0], spec.num_experts, device=ids_SP.device).scatter_add_(
        1, ids_SP, torch.ones_like(ids_SP, dtype=torch.float32))
    return counts_SE / ids_SP.shape[1]


def aux_losses(logits_TE: torch.Tensor, scores_TE: torch.Tensor, spec: RouterSpec,
               expert_ids_TK: torch.Tensor | None = None, f_E: torch.Tensor | None = None) -> torch.Tensor | None:
    """The balance losses and z-loss of the module docstring, summed; None when every factor is 0.
    `expert_ids_TK`: the routing's choices (needed unless `plain_aux_topk`); `f_E`: f for every group instead of
    the group's own (gbs_aux_loss)."""
    if not spec.has_aux:
        return None
    total = logits_TE.new_zeros((), dtype=torch.float32)
    if spec.has_balance:
        probs_TE = _aux_probs(scores_TE, spec)
        groups, experts = spec.token_groups, spec.num_experts
        if f_E is None:
            f_SE = expert_fractions(aux_top_k(scores_TE, expert_ids_TK, spec), spec)
        else:
            f_SE = f_E.float().expand(groups, experts)
        p_SE = probs_TE.view(groups, -1, experts).mean(1)
        if spec.aux_expert:
            total = total + spec.aux_expert * experts * (p_SE * f_SE).sum(-1).mean()
        for factor, d in ((spec.aux_device, spec.device_groups), (spec.aux_comm, spec.comm_groups)):
            if factor:
                p_SD = p_SE.view(groups, d, -1).sum(-1)
                f_SD = f_SE.view(groups, d, -1).sum(-1)
                total = total + factor * d * (p_SD * f_SD).sum(-1).mean()
    if spec.z_loss:
        total = total + spec.z_loss * logits_TE.float().logsumexp(-1).square().mean()
    return total


class MFRouter(nn.Module):
    """The router's parameters under HF's names: `weight` [E, H] and, for selection, `e_score_correction_bias` [E].

    It is the HF router's own `weight` Parameter (and DeepSeek's bias buffer), so training updates the HF tensors
    and the state-dict keys stay `...mlp.gate.weight` / `...mlp.gate.e_score_correction_bias`.
    """

    def __init__(self, weight: nn.Parameter, bias: torch.Tensor | None, persistent_bias: bool = True,
                 dtype: str = "float32"):
        super().__init__()
        self.weight = weight
        self.dtype = getattr(torch, dtype)  # router_dense_type: float32 (float16 maps to it) or bfloat16
        if bias is not None:
            self.register_buffer("e_score_correction_bias", bias, persistent=persistent_bias)
        else:
            self.e_score_correction_bias = None

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        """Logits [T, E] in router_dense_type: MindFormers casts the input and the weight to it (Router.construct;
        mcore Router.gating). HF DeepSeek computes in float32 too."""
        return F.linear(x_TH.to(self.dtype), self.weight.to(self.dtype))
