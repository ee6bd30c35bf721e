"""MFMoE: the mf-ds MoE block that replaces transformers' sparse MoE blocks (mf_ds/patch/moe.py injects it).

    logits = gate(x)                              fp32 router (router.py): scores, top-k, gates, aux losses
    perm   = permute(x, ids, E, capacity)         rows sorted by expert; MindFormers' k-drop / s-drop past C
    y      = down @ swiglu(gate_up @ perm.x)      two grouped matmuls (mf_ds/ops/gmm.py), fused SwiGLU between;
                                                  on CUDA the first one gathers x's rows itself (no perm.x copy);
    out    = unpermute(y, perm, gates)            weighted combine; dropped pairs weigh 0, gates not renormalised
           + [sigmoid(shared_gate(x)) *] shared(x)

Capacity (reference/mindformers/moe.md §3; moe.py calculate_expert_capacity_v2): per MindFormers token group (the N
tokens of one data-parallel x context-parallel shard, x model_parallel under sequence parallel; the Plan's
`token_groups` of them in one forward here, consecutive), C = roundup(min(ceil(k * N * cf / E), N), m) per expert,
m = model_parallel (or expert_model_parallel, 1 under sequence parallel) x comp_comm_parallel_degree; `dropless`
(cf <= 0, whose dynamic capacity drops nothing; use_gmm without mf_ds.gmm_capacity; mcore) keeps every pair.
`safe_tokens` (enable_gmm_safe_tokens, moev3.py `_pad_safe_tokens`) puts one
zero row at the head of every expert's group so no grouped matmul sees an empty group; zero rows give zero
outputs and zero weight gradients, so the numbers are unchanged. With expert parallelism (parallel.py) the experts
here are this rank's shard and the permuted rows travel to their owners by all-to-all.

`use_gmm` and `use_fused_ops_permute` select no code path here (the Plan carries neither switch): the block
always runs mf_ds.ops' grouped matmul, permute and SwiGLU, which take their Triton kernels on CUDA tensors and torch
on CPU. use_gmm's one effect, dropless by default as MoEV3, is already in the Plan's `dropless`.

Weights keep HF v5's layout and names: `gate.weight` [E, H], `experts.gate_up_proj` [E, 2I, H] (gate rows first),
`experts.down_proj` [E, H, I], the shared expert modules as HF built them. Unsharded, they are HF's own
Parameter objects, so `mf_ds.patch.revert` hands back an HF block holding the trained weights.

Aux losses are attached to the block output (Megatron's MoEAuxLossAutoScaler idea) and reported by `aux_loss(model)`,
whose returned tensor, added to the training loss, carries the scale the engine applies to that loss (1/GA, fp16
loss scale) back to every layer's aux loss: correct under activation checkpointing, reentrant or not, where a
returned loss would miss the recomputed graph. Statistics (drops, per-expert load) are counted once per forward in
training, on the device: a recompute inside backward is recognised (`torch._C._current_graph_task_id() != -1`) and
not counted. Both run as ops that decide when the step runs (device_state.py), so torch.compile traces the block
whole (the ops of mf_ds/ops/library.py have static shapes: nothing here reads a count on the host).

Legend: T tokens, H hidden, E experts (E_local on this rank), K top-k, I expert width, M permuted rows.
"""

from __future__ import annotations

import torch
from torch import nn

from mf_ds.moe.device_state import GROUP, AuxHandle, LayerStats, stats_ranks
from mf_ds.moe.router import MFRouter, Routing, aux_losses, aux_top_k, expert_fractions, route
from mf_ds.ops.gmm import gather_supported, grouped_mm, grouped_mm_gather
from mf_ds.ops.permute import Permuted, permute, unpermute
from mf_ds.ops.swiglu import fused_swiglu_packed
from translators.plan_types import MoE


def group_capacity_mask(expert_ids_TK: torch.Tensor, num_experts: int, capacity: int, drop_policy: str,
                        groups: int) -> torch.Tensor:
    """kept [T, K]: per group of T/groups consecutive tokens, each expert keeps its first `capacity` pairs in the
    drop order (k-drop: choice rank, then token; s-drop: token, then choice), as TopkRouterV2 does per dp shard."""
    tokens, k = expert_ids_TK.shape
    group_T = torch.arange(tokens, device=expert_ids_TK.device) // (tokens // groups)
    bucket_P = (expert_ids_TK + (group_T * num_experts).unsqueeze(1)).flatten()  # (group, expert)
    t_P = torch.arange(tokens, device=bucket_P.device).repeat_interleave(k)
    k_P = torch.arange(k, device=bucket_P.device).repeat(tokens)
    priority_P = k_P * tokens + t_P if drop_policy == "kdrop" else t_P * k + k_P
    order = torch.argsort(bucket_P * (tokens * k) + priority_P)
    counts = torch.zeros(groups * num_experts, dtype=torch.long, device=bucket_P.device).scatter_add_(
        0, bucket_P, torch.ones_like(bucket_P))  # not bincount: its length is data (max id + 1) to a tracer
    start = torch.cumsum(counts, 0) - counts
    position_sorted = torch.arange(bucket_P.numel(), device=bucket_P.device) - start[bucket_P[order]]
    kept_P = torch.empty_like(bucket_P, dtype=torch.bool).scatter_(0, order, position_sorted < capacity)
    return kept_P.view(tokens, k)


class MFExperts(nn.Module):
    """The routed experts as HF v5 stores them: gate_up_proj [E, 2I, H] and down_proj [E, H, I]."""

    def __init__(self, gate_up_proj: nn.Parameter, down_proj: nn.Parameter, act_fn: nn.Module | None,
                 safe_tokens: bool = False):
        super().__init__()
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj
        self.act_fn = act_fn  # None: SiLU, through the fused SwiGLU
        self.safe_tokens = safe_tokens

    @property
    def num_experts(self) -> int:
        return getattr(self.gate_up_proj, "ds_shape", self.gate_up_proj.shape)[0]  # ZeRO-3: the whole shape

    def forward(self, x_MH: torch.Tensor, tokens_per_expert_E: torch.Tensor, exact_rows: bool = False
                ) -> torch.Tensor:
        """Rows sorted by expert (groups from row 0, then padding) -> expert outputs, same rows. `exact_rows`: the
        counts sum to the row count (dropless, no padding rows; grouped_mm then zeroes nothing)."""
        x_MH = x_MH.to(self.gate_up_proj.dtype)  # grouped_mm is not autocast-aware (HF casts the same way)
        if self.safe_tokens:
            return self._with_safe_tokens(x_MH, tokens_per_expert_E, exact_rows)
        return self._ffn(x_MH, tokens_per_expert_E, exact_rows)

    def forward_gathered(self, x_TH: torch.Tensor, perm: Permuted, exact_rows: bool = False) -> torch.Tensor:
        """The same as `forward(permuted x, counts)`, with the permute folded into the first grouped matmul's loads
        (no [M, H] copy of the permuted rows, in the forward or kept for the backward). Triton path only."""
        x_TH = x_TH.to(self.gate_up_proj.dtype)
        gate_up_MI2 = grouped_mm_gather(x_TH, self.gate_up_proj.transpose(1, 2), perm.tokens_per_expert_E,
                                        perm.token_of_row_M, perm.row_of_pair_TK)
        return self._ffn(None, perm.tokens_per_expert_E, exact_rows, gate_up_MI2)

    def _ffn(self, x_MH: torch.Tensor | None, tokens_per_expert_E: torch.Tensor, exact_rows: bool,
             gate_up_MI2: torch.Tensor | None = None) -> torch.Tensor:
        if gate_up_MI2 is None:
            gate_up_MI2 = grouped_mm(x_MH, self.gate_up_proj.transpose(1, 2), tokens_per_expert_E, exact_rows)
        if self.act_fn is None:
            h_MI = fused_swiglu_packed(gate_up_MI2)
        else:
            gate_MI, up_MI = gate_up_MI2.chunk(2, dim=-1)
            h_MI = self.act_fn(gate_MI) * up_MI
        return grouped_mm(h_MI, self.down_proj.transpose(1, 2), tokens_per_expert_E, exact_rows)

    def _with_safe_tokens(self, x_MH: torch.Tensor, tokens_per_expert_E: torch.Tensor, exact_rows: bool
                          ) -> torch.Tensor:
        """Insert a zero row at the head of every group (row r of group e moves to r + e + 1, padding rows to
        r + E), run the experts on M + E rows with every count + 1, and take the real rows back."""
        rows, experts = x_MH.shape[0], self.num_experts
        ends_E = torch.cumsum(tokens_per_expert_E, 0)
        row_M = torch.arange(rows, device=x_MH.device)
        expert_of_row_M = torch.searchsorted(ends_E, row_M, right=True)  # E for the padding rows
        moved_M = row_M + expert_of_row_M + (expert_of_row_M < experts).long()
        padded = x_MH.new_zeros(rows + experts, x_MH.shape[1]).index_copy(0, moved_M, x_MH)
        y_padded = self._ffn(padded, tokens_per_expert_E + 1, exact_rows)
        return y_padded.index_select(0, moved_M)


class MFMoE(nn.Module):
    """The routed experts (with capacity and drop rules), plus the shared experts when the model has them."""

    def __init__(self, spec: MoE, gate: MFRouter, experts: MFExperts, layer_index: int,
                 shared: dict[str, nn.Module] | None = None, shared_names: tuple[str, str | None] = ("", None),
                 expert_parallel=None, estimate_capacity_factor: float | None = None):
        super().__init__()
        self.spec = spec  # the Plan's moe section
        # cf of MindFormers' drop-rate estimate sum_i max(0, f_i - cf/E); None: no estimate
        # (Plan.estimate_capacity_factor)
        self.estimate_capacity_factor = estimate_capacity_factor
        self.gate = gate
        self.experts = experts
        self.layer_index = layer_index  # global decoder layer index (MTP layers follow the decoder layers)
        for name, module in (shared or {}).items():  # under HF's names: shared_expert(_gate) / shared_experts
            self.add_module(name, module)
        self._shared_name, self._shared_gate_name = shared_names
        self.expert_parallel = expert_parallel  # parallel.ExpertParallel, or None
        self._aux_value: torch.Tensor | None = None
        self._gbs_accu: torch.Tensor | None = None
        self._gbs_f: torch.Tensor | None = None
        self.stats: LayerStats | None = None

    def forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`input_ids`: what DeepSeek-V4's decoder layer passes every MoE block (its hash blocks route by them;
        this block, replacing a top-k one, does not read them)."""
        shape = hidden_states.shape
        x_TH = hidden_states.reshape(-1, shape[-1])
        spec = self.spec
        groups = spec.token_groups
        if x_TH.shape[0] % groups:  # not a batch of the YAML's shape (an eval tail): one group, as a whole shard
            groups = 1
        bias_E = self.gate.e_score_correction_bias if spec.router.bias_balance else None
        logits_TE = self.gate(x_TH)
        routing = route(logits_TE, spec, bias_E)
        capacity = spec.capacity(x_TH.shape[0] // groups)
        expert_ids_TK = routing.expert_ids_TK
        if capacity is not None and groups > 1:  # each group keeps its own C; permute then drops no more
            kept_TK = group_capacity_mask(expert_ids_TK, spec.num_experts, capacity, spec.drop_policy, groups)
            expert_ids_TK = expert_ids_TK.masked_fill(~kept_TK, -1)
            capacity *= groups
        # On the Triton path the first grouped matmul gathers the token rows itself (no permuted copy).
        gathered = self.expert_parallel is None and not spec.safe_tokens and gather_supported(x_TH)
        perm = permute(x_TH, expert_ids_TK, spec.num_experts, capacity=capacity,
                       drop_policy=spec.drop_policy, materialize=not gathered)
        exact = self.expert_parallel is None and spec.dropless  # every row a kept pair: no padding rows
        if gathered:
            y_MH = self.experts.forward_gathered(x_TH, perm, exact)
        elif self.expert_parallel is None:
            y_MH = self.experts(perm.x_MH, perm.tokens_per_expert_E, exact)
        else:
            y_MH = self.expert_parallel.run(perm.x_MH, perm.tokens_per_expert_E, self.experts)
        gates_TK = routing.gates_TK
        # not a recompute inside backward (under torch.compile only the ops in device_state can tell, at run time)
        counted = self.training and (torch.compiler.is_compiling() or torch._C._current_graph_task_id() == -1)
        if self.training:
            self._count(routing, perm, spec, groups)  # a recompute is skipped inside the op
        if self.training and spec.has_aux:
            f_E = self._global_batch_f(routing, spec, counted, groups) if spec.global_batch_f else None
            aux = aux_losses(logits_TE, routing.scores_TE, spec, routing.expert_ids_TK, f_E, groups)
            if counted:
                self._aux_value = aux.detach()
            # on the gates (a [T, K] copy, not [T, H]): their backward runs whenever the output's does
            gates_TK = torch.ops.mf_ds.attach_aux(gates_TK, aux)
        out_TH = unpermute(y_MH.to(x_TH.dtype), perm, gates_TK)
        if self._shared_name:
            shared_TH = getattr(self, self._shared_name)(x_TH)
            if self._shared_gate_name:
                shared_TH = torch.sigmoid(getattr(self, self._shared_gate_name)(x_TH)) * shared_TH
            out_TH = out_TH + shared_TH
        return out_TH.view(shape)

    @torch.no_grad()
    def _global_batch_f(self, routing: Routing, spec: MoE, counted: bool, groups: int) -> torch.Tensor:
        """gbs_aux_loss's f (mcore TopKRouter._expert_load_balancing, fi_accu): this micro-batch's f averaged over
        every rank (MindFormers' dp x tp x cp groups), added to the step's running sum, normalised. A recompute
        in backward reuses the value of the forward it repeats; `step_metrics` resets the sum every step.
        Collective over the default group (a pipeline stage's data-parallel group) in every counted training forward."""
        if counted or self._gbs_f is None:
            f_E = expert_fractions(aux_top_k(routing.scores_TE, routing.expert_ids_TK, spec), spec, groups).mean(0)
            ranks = stats_ranks()  # every rank, or this pipeline stage's data-parallel ranks
            if ranks > 1:
                torch.distributed.all_reduce(f_E, group=GROUP.get("stats"))
                f_E /= ranks
            self._gbs_accu = f_E if self._gbs_accu is None else self._gbs_accu + f_E
            self._gbs_f = self._gbs_accu / self._gbs_accu.sum()
        return self._gbs_f

    def reset_step(self) -> None:
        """Step end: gbs_aux_loss's running f starts again (MindFormers' _reset_accu_gbs_fi)."""
        self._gbs_accu = self._gbs_f = None

    def ensure_stats(self, device: torch.device) -> LayerStats:
        """The step's counters on `device` (made before torch.compile traces the block: a traced first forward
        that made them would be compiled again once they exist)."""
        if self.stats is None or self.stats.device != device:
            self.stats = LayerStats(self.spec.num_experts, device)
        return self.stats

    @torch.no_grad()
    def _count(self, routing: Routing, perm: Permuted, spec: MoE, groups: int) -> None:
        ids = routing.expert_ids_TK
        self.ensure_stats(ids.device)
        cf, estimate = self.estimate_capacity_factor, None
        if cf is not None:  # MoEDropRateCallback: sum_i max(0, f_i - cf/E) of fi_parameter, which each forward
            # overwrites (the last micro-batch's), from the aux top-k, of this rank's (first) token group
            f_E = expert_fractions(aux_top_k(routing.scores_TE, ids, spec), spec, groups)[0]
            estimate = (f_E.double() - cf / spec.num_experts).clamp(min=0).sum()
        self.stats.count(ids, perm.kept_TK, estimate)

    def extra_repr(self) -> str:
        spec = self.spec
        capacity = "dropless" if spec.dropless else f"capacity_factor={spec.capacity_factor}, {spec.drop_policy}"
        ep = "" if self.expert_parallel is None else f", expert_parallel={self.expert_parallel.size}"
        return (f"layer={self.layer_index}, experts={spec.num_experts}, top_k={spec.top_k}, "
                f"{capacity}{', safe_tokens' if spec.safe_tokens else ''}{ep}")


def moe_layers(model: nn.Module) -> list[MFMoE]:
    """The model's MFMoE blocks in layer order."""
    return sorted((m for m in model.modules() if isinstance(m, MFMoE)), key=lambda m: m.layer_index)


def aux_loss(model: nn.Module) -> torch.Tensor | None:
    """The sum of this forward's aux and z losses over the MoE layers (then cleared); None if no layer has one.

    Add it to the training loss: the gradient the engine sends into this tensor (including 1/GA and any loss
    scale) is what every layer's aux loss receives in backward.
    """
    layers = [m for m in moe_layers(model) if m._aux_value is not None]
    if not layers:
        return None
    total = torch.stack([m._aux_value for m in layers]).sum()
    for m in layers:
        m._aux_value = None
    anchor = torch.zeros((), device=total.device, requires_grad=True)
    return AuxHandle.apply(anchor, total)
