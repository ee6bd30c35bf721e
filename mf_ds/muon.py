"""Muon as MindFormers 2.1.0 computes it (mindformers/pynative/optimizer/muon.py, the `allgather` path, one card's
arithmetic; the model's split schema from pynative/base_models/gpt/gpt_model.py make_model_muon_fns), on an HF
MLA model's parameters (DeepSeek-V3 naming).

Which parameters (Muon._build_muon_filter): 2-D and 3-D weights whose MindFormers name matches no `adamw_include`
glob (default `*word_embeddings*`, `*output_layer*`) take Muon; every other parameter takes AdamW.

DeepSeek-V4 (transformers' DeepseekV4ForCausalLM; MindFormers 2.1.0's PyNativeDeepseekV4ForCausalLM holds the same
GPTModel, so the same make_model_muon_fns schema): its MindFormers names (translators/names.py DEEPSEEK4, read
backwards) meet only two of the schema's rules. experts.weight1 [E, H, 2I] is cut into gate / up halves (HF's
gate_up_proj [E, 2I, H]: the same pieces transposed, and Newton-Schulz works on the wider orientation either way);
shared_experts.linear_fc1's interleaved gate / up rows are cut apart, which HF already holds as two weights. Its
attention is named linear_q_up_proj / linear_kv_proj / linear_o_group_proj, not the linear_qb / linear_kvb /
linear_qkv the per-head rules look for, so every attention weight (o_groups' grouped wo_a too) is orthogonalized
whole; the mHC mappings (attn_hc / ffn_hc fn, hc_head.hc_fn), the router, the compressor's and indexer's
projections and position biases are 2-D and take Muon whole; the mHC scales, bases, sinks and norms are vectors and
take AdamW; tid2eid is an integer buffer, not a parameter (tests/mf_ds/test_muon.py: the split and every update
against the transcription on MindFormers' names and layout).

Muon, per parameter (`_apply_muon_update`, `_apply_muon_ns`, `newton_schulz`), all in fp32 unless said:
    next_m = m * momentum + g                                       (m: the momentum, "muon_m", fp32)
    u      = g + next_m * momentum   if nesterov   else next_m
    pieces = split(u)                 MLA weights per head: q rows [nope | rope] -> (nope rows, rope rows),
                                      kv_b rows [k_nope | v] -> (k_nope, v), kv_a rows [kv_lora | rope] -> two;
                                      stacked experts gate_up [E, 2I, H] -> gate, up (3-D, batched)
    each piece X [.., A, B]:  transposed when A > B
        X = bf16(X / max(||X||_F, eps))                 the Frobenius norm in fp32, over the last two dims
        for (a, b, c) in the schedule:                  ns_coefficients: one triple x ns_steps, or segments
            G = X X^T;  G = b G + c G G;  X = a X + G X (bf16 matmuls, each addmm's sum in fp32 then bf16:
                                                        MindSpore's cube_math_type(4), what torch.addmm does)
        X = (lr * sqrt(max(A, B)) * matched_adamw_rms) * X   (per piece, in fp32)
    W = W * (1 - lr * wd) - merge(pieces)
AdamW (pynative/optimizer/adamw.py `_run_adamw_opt`, the same in graph mode):
    W = W * (1 - lr wd);  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
    W = W - lr / (1 - b1^t) * m / (sqrt(v / (1 - b2^t)) + eps)

torch.optim.Muon (2.13) runs the same Newton-Schulz loop body (X X^T, addmm, addmm) but differs in what MindFormers
does around it: it normalizes in bf16 (MindFormers in fp32, then casts), takes one coefficient triple (no segmented
schedule), 2-D matrices only (no 3-D experts, no per-head split: it orthogonalizes a fused MLA projection whole),
a fixed 0.2 in `adjust_lr_fn="match_rms_adamw"` (MindFormers' matched_adamw_rms is a setting) and keeps an EMA
momentum (buf.lerp_(g, 1 - momentum): MindFormers' m scaled by 1 - momentum, so their states do not interchange).
Hence its own loop here; tests/mf_ds/test_muon.py checks that on an unsplit 2-D weight both agree to bf16 rounding.

QK-clip (`qk_clip_threshold`, P construct after the update loop: model.apply_qk_clip_scaling): after every
parameter's update, each MLA layer's q / kv_b rows are scaled per head from the step's max attention logit
(mf_ds/qk_clip.py); the statistic is zeroed for the next step.

MindFormers' graph-mode Muon (core/optim/muon.py, 2.0.0 / 2.1.0; `mode: graph`) differs again: the update is cast
to bf16 before the split, Newton-Schulz normalizes in bf16 (x / (||x|| + 1e-7)) and runs unfused bf16 ops
(X X^T, b A + (c A) A, a X + B X, each rounded) with the fixed triple x 5 whatever ns_steps says, one lr scale from
the last piece's dims serves every piece, and QK-clip runs every step (`graph_newton_schulz`; tests/mf_ds/
test_muon.py against a transcription of the graph-mode source).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from fnmatch import fnmatch

import torch

from mf_ds import families
from translators.plan_types import MuonOptimizer

# HF name suffix -> the MindFormers piece layout along dim 0 (periodic: (a, b, blocks) rows repeated per block)
_PERIODIC = {
    "self_attn.q_proj.weight": lambda c: (c.qk_nope_head_dim, c.qk_rope_head_dim, c.num_attention_heads),
    "self_attn.q_b_proj.weight": lambda c: (c.qk_nope_head_dim, c.qk_rope_head_dim, c.num_attention_heads),
    "self_attn.kv_a_proj_with_mqa.weight": lambda c: (c.kv_lora_rank, c.qk_rope_head_dim, 1),
    "self_attn.kv_b_proj.weight": lambda c: (c.qk_nope_head_dim, c.v_head_dim, c.num_attention_heads),
}
# HF DeepSeek-V3 names -> MindFormers' mcore names, in order, for adamw_include's globs only (MindFormers matches
# them against its own names: parallel_core/.../multi_latent_attention.py, moe/*.py, gpt_model.py)
_MCORE_NAMES = (("model.embed_tokens.", "embedding.word_embeddings."), ("lm_head.", "output_layer."),
                ("model.norm.", "decoder.final_layernorm."), ("model.layers.", "decoder.layers."),
                (".self_attn.q_a_proj.", ".self_attention.linear_q_down_proj."),
                (".self_attn.q_b_proj.", ".self_attention.linear_q_up_proj."),
                (".self_attn.q_proj.", ".self_attention.linear_q_proj."),
                (".self_attn.kv_a_proj_with_mqa.", ".self_attention.linear_kv_down_proj."),
                (".self_attn.kv_b_proj.", ".self_attention.linear_kv_up_proj."),
                (".self_attn.o_proj.", ".self_attention.linear_proj."),
                (".self_attn.q_a_layernorm.", ".self_attention.q_layernorm."),
                (".self_attn.kv_a_layernorm.", ".self_attention.kv_layernorm."),
                (".post_attention_layernorm.", ".pre_mlp_layernorm."),
                (".mlp.experts.gate_up_proj", ".mlp.experts.weight1"),
                (".mlp.experts.down_proj", ".mlp.experts.weight2"),
                (".mlp.gate.weight", ".mlp.router.weight"),
                (".mlp.shared_experts.gate_proj.", ".mlp.shared_experts.linear_fc1."),
                (".mlp.shared_experts.up_proj.", ".mlp.shared_experts.linear_fc1."),
                (".mlp.shared_experts.down_proj.", ".mlp.shared_experts.linear_fc2."),
                (".mlp.gate_proj.", ".mlp.linear_fc1."), (".mlp.up_proj.", ".mlp.linear_fc1."),
                (".mlp.down_proj.", ".mlp.linear_fc2."))




def mindformers_name(name: str, model_type: str | None = None, num_layers: int | None = None) -> str:
    """The MindFormers name of an HF parameter, as adamw_include's globs see it: mcore's for DeepSeek-V3 (and any
    other MLA model), or the family's own (its `mindformers_name` hook, mf_ds/families/<family>.py: DeepSeek-V4's,
    which names the MTP block's, layers num_layers and up, as MindFormers' `mtp.layers.k`)."""
    own = families.hook(model_type, "mindformers_name")
    if own is not None:
        return own(name, num_layers)
    for hf, mf in _MCORE_NAMES:
        name = name.replace(hf, mf)
    return name


def split_rule(name: str, config) -> tuple:
    """How MindFormers cuts this parameter before Newton-Schulz: ("whole",), ("periodic", a, b, blocks) or
    ("halves",) (stacked experts gate_up [E, 2I, H]: gate rows, up rows)."""
    own = families.hook(getattr(config, "model_type", None), "muon_split_rule")
    if own is not None:
        return own(name)
    for suffix, parts in _PERIODIC.items():
        if name.endswith(suffix):
            return ("periodic", *parts(config))
    if name.endswith("experts.gate_up_proj"):
        return ("halves",)
    return ("whole",)


def split(x: torch.Tensor, rule: tuple) -> list[torch.Tensor]:
    if rule[0] == "periodic":
        _, a, b, blocks = rule
        grouped = x.reshape(blocks, a + b, x.shape[-1])
        return [grouped[:, :a].reshape(blocks * a, -1), grouped[:, a:].reshape(blocks * b, -1)]
    if rule[0] == "halves":
        return list(x.chunk(2, dim=-2))
    return [x]


def merge(pieces: list[torch.Tensor], rule: tuple) -> torch.Tensor:
    if rule[0] == "periodic":
        _, a, b, blocks = rule
        return torch.cat([pieces[0].reshape(blocks, a, -1), pieces[1].reshape(blocks, b, -1)], dim=1).reshape(
            blocks * (a + b), -1)
    if rule[0] == "halves":
        return torch.cat(pieces, dim=-2)
    return pieces[0]


def newton_schulz(x: torch.Tensor, schedule: tuple[tuple[float, float, float], ...], eps: float) -> torch.Tensor:
    """MindFormers 2.1.0 `newton_schulz` on a 2-D or stacked 3-D fp32 input; returns bf16."""
    wide = x.shape[-2] > x.shape[-1]
    if wide:
        x = x.mT
    norm = torch.linalg.matrix_norm(x.float(), ord="fro", keepdim=True)
    x = (x / norm.clamp(min=eps)).to(torch.bfloat16)
    for a, b, c in schedule:
        if x.dim() == 2:
            gram = x @ x.mT
            gram = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.addmm(x, gram, x, beta=a, alpha=1.0)
        else:
            gram = torch.bmm(x, x.mT)
            gram = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.baddbmm(x, gram, x, beta=a, alpha=1.0)
    return x.mT if wide else x


def graph_newton_schulz(x: torch.Tensor) -> torch.Tensor:
    """Graph mode's zeropower_via_newtonschulz5_2d / _3d (core/optim/muon.py) on a bf16 input: every op in bf16,
    rounded once (a scalar times a bf16 tensor computed in fp32), the fixed triple x 5."""
    a, b, c = (3.4445, -4.7750, 2.0315)
    wide = x.shape[-2] > x.shape[-1]
    if wide:
        x = x.mT
    norm = torch.linalg.matrix_norm(x.float(), ord="fro", keepdim=True).to(torch.bfloat16)
    x = x / (norm + 1e-7)
    for _ in range(5):
        gram = x @ x.mT
        x = a * x + (b * gram + (c * gram) @ gram) @ x
    return x.mT if wide else x


def schedule_of(ns_coefficients, ns_steps: int) -> tuple[tuple[float, float, float], ...]:
    """Muon._normalize_ns_schedule: a flat triple x ns_steps, or segments [[[a, b, c], count], ...]."""
    first = ns_coefficients[0]
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return tuple(tuple(float(v) for v in ns_coefficients) for _ in range(ns_steps))
    return tuple(tuple(float(v) for v in triple) for triple, count in ns_coefficients for _ in range(int(count)))


def _muon_base() -> type:
    """DeepSpeed's MuonWithAuxAdam: its ZeRO-1/2/3 optimizers recognise a Muon optimizer by this class."""
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    return MuonWithAuxAdam


def momentum_step(m: torch.Tensor, g: torch.Tensor, group: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """P _apply_muon_update: next_m = m * momentum + g; the Newton-Schulz input (nesterov: g + next_m * momentum)."""
    mu = group["momentum"]
    next_m = m.float() * mu + g
    return next_m, (g + next_m * mu if group["nesterov"] else next_m)


def orthogonal_update(u: torch.Tensor, rule: tuple, group: dict) -> torch.Tensor:
    """P _apply_muon_ns: split, Newton-Schulz per piece, each scaled by lr * sqrt(max(A, B)) * matched_adamw_rms,
    merged back to u's shape (fp32): what MindFormers subtracts from the decayed weight."""
    lr = group["lr"]
    graph = group.get("mode") == "graph"
    pieces = []
    inputs = split(u.to(torch.bfloat16) if graph else u, tuple(rule))  # GM: op_cast(gradient_fp32, bf16) first
    # PyNative: each piece's own sqrt(max(A, B)); graph mode: the last piece's dims for all (its loop variables)
    widths = [max(x.shape[-2], x.shape[-1]) for x in inputs]
    if graph:
        widths = [widths[-1]] * len(widths)
    # graph mode's lr and matched_adamw_rms are fp32 tensors, so its scalars round to fp32 each
    lr32, rms32 = (torch.tensor(v, dtype=torch.float32) for v in (lr, group["matched_adamw_rms"]))
    for piece, width in zip(inputs, widths, strict=True):
        if graph:  # GM: adjusted_lr = lr * (sqrt(fp32(max(A, B))) * matched_adamw_rms)
            ratio = torch.tensor(width, dtype=torch.float32).sqrt() * rms32
            pieces.append((lr32 * ratio) * graph_newton_schulz(piece).float())
        else:
            scale = lr * math.sqrt(width) * group["matched_adamw_rms"]
            pieces.append(newton_schulz(piece, group["schedule"], group["eps"]).float() * scale)
    return merge(pieces, tuple(rule)).reshape(u.shape)


def decayed(p: torch.Tensor, group: dict) -> torch.Tensor:
    """param * (1 - lr * weight_decay), in fp32 (graph mode: its fp32 tensors' rounding)."""
    if group.get("mode") == "graph":
        lr32, wd32 = (torch.tensor(v, dtype=torch.float32) for v in (group["lr"], group["weight_decay"]))
        return p.float() * (1 - lr32 * wd32)
    return p.float() * (1 - group["lr"] * group["weight_decay"])


class Muon(_muon_base()):
    """MindFormers' Muon with its AdamW part. Each group has `muon` (bool) and `rules` (split_rule per parameter);
    the state per parameter is `momentum_buffer` (Muon) or `exp_avg`, `exp_avg_sq`, `step` (AdamW), fp32.

    A subclass of DeepSpeed's MuonWithAuxAdam (groups carry `use_muon`, parameters `use_muon`) so that DeepSpeed's
    ZeRO-1/2/3 optimizers gather each Muon weight's full gradient and call original_muon.muon_update, which
    mf_ds/muon_zero.py points at MindFormers' update (momentum, split, Newton-Schulz, lr scale); the flat
    partition's gradient then holds that update, and step() only decays and subtracts it (see step)."""

    def __init__(self, params, lr: float = 2e-2, weight_decay: float = 0.1, matched_adamw_rms: float = 0.2,
                 momentum: float = 0.95, nesterov: bool = True, schedule=((3.4445, -4.7750, 2.0315),) * 5,
                 eps: float = 1e-7, adamw_betas: tuple[float, float] = (0.95, 0.95), adamw_eps: float = 1e-8,
                 mode: str = "pynative"):
        if mode not in ("pynative", "graph"):
            raise ValueError(f"mode: 'pynative' or 'graph', got {mode!r}")
        defaults = {"lr": lr, "weight_decay": weight_decay, "matched_adamw_rms": matched_adamw_rms,
                    "momentum": momentum, "nesterov": nesterov, "schedule": tuple(map(tuple, schedule)), "eps": eps,
                    "adamw_betas": tuple(adamw_betas), "adamw_eps": adamw_eps, "muon": False, "rules": None,
                    "mode": mode, "ns_method": "mindformers"}
        torch.optim.Optimizer.__init__(self, params, defaults)  # not MuonWithAuxAdam's: it builds its own Adam
        self.aux_optimizer = None  # MuonWithAuxAdam.load_state_dict reads it
        for group in self.param_groups:
            group["use_muon"] = group["muon"]
            for param in group["params"]:
                param.use_muon = group["muon"]
        self.qk_clip = None  # mf_ds.qk_clip.QKClip, set by build_muon when the plan asks for QK-clip
        self._where: dict[int, tuple[int, int]] = {}
        self.zero_hooked = False  # mf_ds/muon_zero.py install: DeepSpeed's ZeRO runs the Muon update

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            rules = group["rules"] or [("whole",)] * len(group["params"])
            if len(rules) != len(group["params"]):  # a ZeRO optimizer's flat partition in place of the weights
                rules = [("whole",)] * len(group["params"])
            for p, rule in zip(group["params"], rules, strict=True):
                if p.grad is None:
                    continue
                if group["muon"] and p.dim() == 1:
                    if not self.zero_hooked:  # a flat copy no ZeRO Muon filled: DeepSpeed's bf16/fp16 wrapper
                        from mf_ds.errors import RunError

                        raise RunError(f"Muon got a flat {p.numel()}-element partition that no ZeRO optimizer "
                                       "orthogonalized (DeepSpeed's bf16/fp16 optimizer at ZeRO stage 0?): run Muon "
                                       "in float32 at ZeRO stage 0, or under ZeRO 1-3")
                    # ZeRO-1/2/3: mf_ds/muon_zero.py's muon_update ran on each full gradient when DeepSpeed
                    # gathered it, leaving MindFormers' lr-scaled update in this partition's gradient
                    p.copy_(decayed(p, group) - p.grad.float())
                    continue
                (self._muon if group["muon"] else self._adamw)(p, p.grad.float(), self.state[p], rule, group)
        if self.qk_clip is not None:  # P construct: model.apply_qk_clip_scaling after the update loop
            self.qk_clip.apply(self._held)
        return loss

    def set_qk_clip(self, clip) -> None:
        """Clip after each step; remembers where each parameter sits in the groups (a wrapper that swaps the groups'
        tensors, keeping their shapes, is then still scaled where the optimizer reads)."""
        self.qk_clip = clip
        self._where = {id(p): (g, i) for g, group in enumerate(self.param_groups)
                       for i, p in enumerate(group["params"])}

    def _held(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The tensor this optimizer updates for a model parameter (MindFormers' fp32_param_map)."""
        if id(param) not in self._where:
            return param
        g, i = self._where[id(param)]
        held = self.param_groups[g]["params"][i]
        if held.shape != param.shape:
            from mf_ds.errors import RunError

            raise RunError(f"QK-clip: the optimizer holds a {tuple(held.shape)} tensor for a {tuple(param.shape)} "
                           "weight (a ZeRO partition?); QK-clip needs ZeRO stage 0")
        return held

    @staticmethod
    def _muon(p: torch.Tensor, g: torch.Tensor, state: dict, rule: tuple, group: dict) -> None:
        if p.dim() not in (2, 3):
            from mf_ds.errors import RunError

            raise RunError(f"Muon got a {p.dim()}-D parameter of {p.numel()} elements")
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
        m = state["momentum_buffer"]
        next_m, u = momentum_step(m, g, group)
        p.copy_(decayed(p, group) - orthogonal_update(u, rule, group).reshape(p.shape))
        m.copy_(next_m)

    @staticmethod
    def _adamw(p: torch.Tensor, g: torch.Tensor, state: dict, rule: tuple, group: dict) -> None:
        lr, (beta1, beta2) = group["lr"], group["adamw_betas"]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
            state["step"] = 0
        state["step"] += 1
        m, v, t = state["exp_avg"], state["exp_avg_sq"], state["step"]
        weight = p.float() * (1.0 - lr * group["weight_decay"])
        m.copy_(m * beta1 + g * (1.0 - beta1))
        v.copy_(torch.addcmul(v * beta2, g, g, value=1.0 - beta2))
        denom = (v / (1.0 - beta2**t)).sqrt() + group["adamw_eps"]
        p.copy_(weight - (m / denom) * (lr / (1.0 - beta1**t)))


def uses_muon(name: str, param: torch.Tensor, adamw_include: tuple[str, ...], model_type: str | None = None,
              num_layers: int | None = None) -> bool:
    """Muon._build_muon_filter: 2-D / 3-D, and no adamw_include glob matches its MindFormers name (or its HF one).
    A parameter built partitioned (deepspeed.zero.Init) is judged by its full shape, ds_shape."""
    if len(getattr(param, "ds_shape", None) or param.shape) not in (2, 3):
        return False
    mf = mindformers_name(name, model_type, num_layers)
    return not any(fnmatch(mf, pat) or fnmatch(name, pat) for pat in adamw_include)


def build_muon(model: torch.nn.Module, spec: MuonOptimizer) -> Muon:
    """Muon over MindFormers' groups: Muon weights (decayed), AdamW matrices (decayed), AdamW vectors (not)."""
    include = tuple(spec.adamw_include)
    muon, decay, no_decay = [], [], []
    model_type = getattr(model.config, "model_type", None)
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if uses_muon(name, param, include, model_type, getattr(model.config, "num_hidden_layers", None)):
            muon.append((name, param))
        else:
            full = getattr(param, "ds_shape", None) or param.shape
            (decay if len(full) > 1 and not name.endswith(".bias") else no_decay).append((name, param))
    wd = spec.weight_decay
    groups = [{"params": [p for _, p in muon], "muon": True, "weight_decay": wd, "name": "muon",
               "rules": [split_rule(n, model.config) for n, _ in muon]},
              {"params": [p for _, p in decay], "weight_decay": wd, "name": "adamw_decay"},
              {"params": [p for _, p in no_decay], "weight_decay": 0.0, "name": "adamw_no_decay"}]
    optimizer = Muon([g for g in groups if g["params"]], lr=spec.lr, weight_decay=wd,
                     matched_adamw_rms=spec.matched_adamw_rms, momentum=spec.momentum, nesterov=spec.nesterov,
                     schedule=spec.ns_schedule, eps=spec.eps, adamw_betas=tuple(spec.adamw_betas),
                     adamw_eps=spec.adamw_eps, mode=spec.mode)
    if spec.qk_clip_threshold is not None:
        from mf_ds import qk_clip

        layers = qk_clip.install(model)
        if not layers:
            from mf_ds.errors import RunError

            raise RunError("QK-clip: the plan asks for it and the model has no MLA attention whose max logit "
                           "MindFormers tracks (DeepSeek-V4's and DSA's keep none: translators/muon.py leaves "
                           "run.optimizer.qk_clip_threshold null for experimental_attention_variant dsv4_hybrid / dsa)")
        optimizer.set_qk_clip(qk_clip.QKClip(layers, spec.qk_clip_threshold))
    return optimizer
