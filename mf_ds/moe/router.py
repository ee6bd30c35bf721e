"""The MoE router: scores, top-k (plain, group-limited, with the balancing bias), gates and the aux losses.

Three MindFormers code paths (the Plan's `moe.path`; reference/mindformers/moe.md, tests/fixtures/moe_golden.json):
  moev2  `TopkRouterV2` (mindformers/modules/transformer/moe.py), the legacy capacity MoE:
    1. logits = x W^T in float32 (router_dense_type), scores = softmax(logits) or sigmoid(logits) (or, on
       DeepSeek-V4's mcore path, sqrt(softplus(logits)));
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

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from translators.plan_types import MoE


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


def route(logits_TE: torch.Tensor, spec: MoE, bias_E: torch.Tensor | None = None) -> Routing:
    """Choose K experts per token and their gates (module docstring, steps 1-3)."""
    # scores in the logits' dtype (bfloat16 with router_dense_type bfloat16, as MindFormers' gating), then float32
    scores_TE = _scores(logits_TE, spec.router.score).float()
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
    if spec.router.norm_topk_prob:
        eps = 1e-20 if spec.path == "mcore" else 1e-9
        gates_TK = gates_TK / (gates_TK.sum(-1, keepdim=True) + eps)
    if spec.router.routed_scaling_factor != 1.0:
        gates_TK = gates_TK * spec.router.routed_scaling_factor
    return Routing(scores_TE, gates_TK, expert_ids_TK)


def _scores(logits_TE: torch.Tensor, score: str) -> torch.Tensor:
    """softmax over the experts, sigmoid, or DeepSeek-V4's sqrt(softplus(x)) (MindFormers 2.1.0 pynative
    moe/router.py _compute_router_scores; transformers' ACT2FN["sqrtsoftplus"])."""
    if score == "softmax":
        return logits_TE.softmax(-1)
    if score == "sqrtsoftplus":
        return F.softplus(logits_TE).sqrt()
    return logits_TE.sigmoid()


def _limit_groups(choice_TE: torch.Tensor, spec: MoE) -> torch.Tensor:
    """Set (to 0.0) the scores outside each token's kept groups (module docstring, step 2)."""
    tokens, experts = choice_TE.shape
    grouped_TGe = choice_TE.view(tokens, spec.router.n_group, experts // spec.router.n_group)
    with torch.no_grad():
        if spec.path == "mcore":  # sum of the top k/topk_group, exactly topk_group groups
            group_TG = grouped_TGe.topk(spec.top_k // spec.router.topk_group, dim=-1).values.sum(-1)
            keep_TG = torch.zeros_like(group_TG, dtype=torch.bool)
            keep_TG.scatter_(1, _topk(group_TG, spec.router.topk_group)[1], True)
        else:
            if spec.router.topk_method == "group_limited_greedy":  # DeepSeek-V2: the best expert of the group
                group_TG = grouped_TGe.max(-1).values
            else:  # noaux_tc, DeepSeek-V3: the sum of the group's two best
                group_TG = grouped_TGe.topk(2, dim=-1).values.sum(-1)
            # every group at least as good as the topk_group-th best (ties keep more groups)
            keep_TG = group_TG >= group_TG.topk(spec.router.topk_group, dim=-1).values.min(-1, keepdim=True).values
    return grouped_TGe.masked_fill(~keep_TG.unsqueeze(-1), 0.0).view(tokens, experts)


def aux_top_k(scores_TE: torch.Tensor, expert_ids_TK: torch.Tensor, spec: MoE) -> torch.Tensor:
    """The (token, choice) experts that f counts: the routing's, or a plain top-k of p (`plain_aux_topk`)."""
    if not spec.plain_aux_topk:
        return expert_ids_TK
    with torch.no_grad():
        return _aux_probs(scores_TE, spec).topk(spec.top_k, dim=-1).indices


def _aux_probs(scores_TE: torch.Tensor, spec: MoE) -> torch.Tensor:
    return scores_TE if spec.router.score == "softmax" else scores_TE / (scores_TE.sum(-1, keepdim=True) + 1e-9)


def expert_fractions(aux_ids_TK: torch.Tensor, spec: MoE, groups: int | None = None) -> torch.Tensor:
    """f [S, E]: per token group (`groups`, else spec.token_groups), the share of its k*N (token, choice) pairs on
    each expert."""
    ids_SP = aux_ids_TK.reshape(groups or spec.token_groups, -1)
    counts_SE = torch.zeros(ids_SP.shape[0], spec.num_experts, device=ids_SP.device).scatter_add_(
        1, ids_SP, torch.ones_like(ids_SP, dtype=torch.float32))
    return counts_SE / ids_SP.shape[1]


def aux_losses(logits_TE: torch.Tensor, scores_TE: torch.Tensor, spec: MoE,
               expert_ids_TK: torch.Tensor | None = None, f_E: torch.Tensor | None = None,
               groups: int | None = None) -> torch.Tensor | None:
    """The balance losses and z-loss of the module docstring, summed; None when every factor is 0.
    `expert_ids_TK`: the routing's choices (needed unless `plain_aux_topk`); `f_E`: f for every group instead of
    the group's own (gbs_aux_loss); `groups`: the token groups of this batch (default spec.token_groups)."""
    if not spec.has_aux:
        return None
    total = logits_TE.new_zeros((), dtype=torch.float32)
    if spec.has_balance:
        probs_TE = _aux_probs(scores_TE, spec)
        groups, experts = groups or spec.token_groups, spec.num_experts
        if f_E is None:
            f_SE = expert_fractions(aux_top_k(scores_TE, expert_ids_TK, spec), spec, groups)
        else:
            f_SE = f_E.float().expand(groups, experts)
        p_SE = probs_TE.view(groups, -1, experts).mean(1)
        if spec.aux_loss.expert:
            total = total + spec.aux_loss.expert * experts * (p_SE * f_SE).sum(-1).mean()
        for factor, d in ((spec.aux_loss.device, spec.aux_groups.device), (spec.aux_loss.comm, spec.aux_groups.comm)):
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
