"""MindFormers 2.1.0's Muon transcribed into numpy, line by line, as the golden for tests/mf_ds/test_muon.py.

MindFormers' own Muon does not run on this CPU: in the 2.1.0 wheel (with MindSpore 2.10.0) `newton_schulz` stops at
`mint.norm` ("The kernel LinalgVectorNorm unregistered"); in 2.0.0 at the bf16 Square ("Select CPU operator[Square]
fail! Unsupported data type", bf16). So this is a transcription, reviewed against the source; each line cites it
(P = mindformers/pynative/optimizer/muon.py, A = mindformers/pynative/optimizer/adamw.py, U =
mindformers/pynative/optimizer/muon_utils.py via make_muon_fns, G = mindformers/pynative/base_models/gpt/
gpt_model.py make_model_muon_fns). BF16 rounding (round to nearest even) stands in for the MindSpore casts; a
matmul or fused addmm rounds once, after an fp32 accumulation and an fp32 addition (MindSpore's cube_math_type(4),
which P's docstring says Muon enables).

Independent of mf_ds/muon.py: numpy only, names and layout as MindFormers has them (weights in MindFormers' own
orientation: a fused MLA q_up weight [heads * (nope + rope), q_lora]; experts weight1 [E, H, 2I], not HF's).
"""

from __future__ import annotations

import math
from fnmatch import fnmatch

import numpy as np


def bf16(x: np.ndarray) -> np.ndarray:
    """op_cast(x, mstype.bfloat16) and back: round-to-nearest-even to bf16, held as float32."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32)


def mT(x: np.ndarray) -> np.ndarray:
    return np.swapaxes(x, -1, -2)


def newton_schulz(x, dim_a, dim_b, eps, ns_steps, ns_coefficients):
    """P newton_schulz (lines 1192-1216)."""
    if dim_a > dim_b:                                                    # if dim_a > dim_b: x = x.mT
        x = mT(x)
    # P _normalize_newton_schulz_input: norm = mint.norm(x, p="fro", dim=(-2, -1), keepdim=True, dtype=float32);
    # normalized = x / mint.clamp(norm, min=eps); op_cast(normalized, bfloat16)
    norm = np.sqrt(np.sum(x.astype(np.float64) ** 2, axis=(-2, -1), keepdims=True)).astype(np.float32)
    x = bf16(x / np.maximum(norm, np.float32(eps)))
    for step in range(ns_steps):                                         # for step in range(ns_steps):
        a, b, c = ns_coefficients[step]                                  #     a, b, c = ns_coefficients[step]
        a_mat = bf16(x @ mT(x))                                          #     a_mat = matmul_op(x, x.mT)
        b_mat = bf16(np.float32(b) * a_mat + np.float32(c) * (a_mat @ a_mat))  # addmm(a_mat, a_mat, a_mat, b, c)
        x = bf16(np.float32(a) * x + b_mat @ x)                          #     x = addmm(x, b_mat, x, beta=a, alpha=1)
    if dim_a > dim_b:
        x = mT(x)
    return x


def muon_split(tensor, part_a, part_b):
    """U muon_split: tensor.T, blocks of part_a + part_b along the rows, each part's rows gathered, .T back."""
    t = tensor.T
    prefix = t.shape[0]
    t = t.reshape(prefix, -1, part_a + part_b)
    return t[..., :part_a].reshape(prefix, -1).T, t[..., part_a:].reshape(prefix, -1).T


def muon_merge(first, second, part_a, part_b):
    """U muon_merge."""
    a, b = first.T, second.T
    prefix = a.shape[0]
    t = np.concatenate([a.reshape(prefix, -1, part_a), b.reshape(prefix, -1, part_b)], axis=-1)
    return t.reshape(prefix, -1).T


def split_fn(kind, tensor, parts):
    """U make_muon_fns split_fn for the G schema kinds used here."""
    if kind == "periodic":                      # linear_qb (nope, rope, heads), linear_kvb (nope, v, heads), fc1 (1, 1)
        return list(muon_split(tensor, parts[0], parts[1]))
    if kind == "reshape_concat":                # experts.weight1 -> [E, H, 2I], halves along the last dimension
        e, h, two_i = parts
        t3 = tensor.reshape(-1, h, two_i)
        return [t3[..., : two_i // 2], t3[..., two_i // 2:]]
    if kind == "reshape_only":                  # U _split_reshape_only: experts.weight2 -> [E, I, H]
        return [tensor.reshape(-1, parts[1], parts[2])]
    return [tensor]


def merge_fn(kind, pieces, parts):
    if kind == "periodic":
        return muon_merge(pieces[0], pieces[1], parts[0], parts[1])
    if kind == "reshape_concat":
        return np.concatenate(pieces, axis=-1).reshape(-1, parts[2])
    if kind == "reshape_only":                  # U _merge_reshape_only
        return pieces[0].reshape(-1, parts[1], parts[2])
    return pieces[0]


# ---- Which parameters take Muon and how each is cut, by MindFormers name (P Muon._build_muon_filter lines
# 2375-2396; G make_model_muon_fns lines 798-867; U make_muon_fns _match_rule). PyNativeDeepseekV4ForCausalLM
# (mindformers/models/deepseek4/modeling_deepseek_v4_pynative.py) holds a GPTModel, so DeepSeek-V4 gets this schema.

def muon_filter(param_name, shape, adamw_include=None):
    """P _build_muon_filter's muon_filter (adamw_include None: the default globs)."""
    if adamw_include is None:
        adamw_include = ("*word_embeddings*", "*output_layer*")
    if len(shape) not in (2, 3):
        return False
    return not any(fnmatch(param_name, pat) for pat in adamw_include)


def model_muon_schema(num_moe_experts, hidden_size, moe_ffn_hidden_size, qk_head_dim, qk_pos_emb_head_dim,
                      num_attention_heads, kv_lora_rank, value_head_dim, q_lora_rank):
    """G make_model_muon_fns' schema (the config's values as arguments)."""
    if q_lora_rank is not None:
        qkv_blocks = (q_lora_rank, kv_lora_rank, qk_pos_emb_head_dim)
    else:
        qkv_blocks = ((qk_head_dim, qk_pos_emb_head_dim, num_attention_heads), kv_lora_rank, qk_pos_emb_head_dim)
    return [
        {"patterns": ["*mlp.experts.weight1*"], "kind": "reshape_concat",
         "reshape": (num_moe_experts, hidden_size, 2 * moe_ffn_hidden_size)},
        {"patterns": ["*mlp.experts.weight2*"], "kind": "reshape_only",
         "reshape": (num_moe_experts, moe_ffn_hidden_size, hidden_size)},
        {"patterns": ["*self_attention.linear_qb.weight*"], "kind": "periodic",
         "parts": (qk_head_dim, qk_pos_emb_head_dim, num_attention_heads)},
        {"patterns": ["*self_attention.linear_kvb.weight*"], "kind": "periodic",
         "parts": (qk_head_dim, value_head_dim, num_attention_heads)},
        {"patterns": ["*self_attention.linear_qkv.weight*"], "kind": "block_split", "blocks": qkv_blocks},
        {"patterns": ["*mlp.shared_experts.linear_fc1.weight*", "*mlp.linear_fc1.weight*"], "kind": "periodic",
         "parts": (1, 1)},
    ]


def match_rule(param_name, schema):
    """U make_muon_fns _match_rule: the first rule one of whose patterns matches, else _IDENTITY_RULE."""
    for rule in schema:
        if any(fnmatch(param_name, pat) for pat in rule["patterns"]):
            return rule
    return {"kind": None}


def is_expert_muon_weight(param_name):
    """P _is_expert_muon_weight: the only 3-D weights _select_muon_matmul_op accepts (others raise ValueError)."""
    return (param_name in ("experts.weight1", "experts.weight2")
            or param_name.endswith((".experts.weight1", ".experts.weight2")))


def apply_muon_update(gradient, muon_m, momentum, use_nesterov, param, lr, weight_decay, matched_adamw_rms,
                      kind, parts, eps, ns_steps, ns_coefficients):
    """P _apply_muon_update (single card: no DTensor redistribution) with P _apply_muon_ns."""
    m_fp32 = muon_m.astype(np.float32)                                   # m_fp32 = op_cast(muon_m, float32)
    gradient_fp32 = gradient.astype(np.float32)
    next_m = m_fp32 * np.float32(momentum) + gradient_fp32               # next_m = m_fp32 * momentum + gradient_fp32
    if use_nesterov:
        gradient_fp32 = gradient_fp32 + next_m * np.float32(momentum)    # gradient_fp32 + next_m * momentum
    else:
        gradient_fp32 = next_m
    x_list = []
    for item in split_fn(kind, gradient_fp32, parts):                    # _apply_muon_ns
        dim_a, dim_b = item.shape[-2:]
        x = newton_schulz(item, dim_a, dim_b, eps, ns_steps, ns_coefficients)
        base_scale = math.sqrt(max(int(dim_a), int(dim_b))) * matched_adamw_rms
        x_list.append(np.float32(lr * base_scale) * x)                   # x = (lr * base_scale) * x (fp32 lr)
    x_ret = merge_fn(kind, x_list, parts)
    param_fp32 = param * np.float32(1 - lr * weight_decay)               # param * (1 - lr * weight_decay)
    next_param = param_fp32 - x_ret.reshape(param_fp32.shape)            # param_fp32 - x_ret.reshape(...)
    return next_param.astype(np.float32), next_m


def run_adamw(beta1, beta2, eps, lr, weight_decay, param, grad, exp_avg, exp_avg_sq, step):
    """A _run_adamw_opt with P construct's bias corrections (global_step incremented first: step 1, 2, ...)."""
    bias_correction1 = 1.0 - beta1**step
    bias_correction2 = 1.0 - beta2**step
    next_param = param * np.float32(1.0 - lr * weight_decay)
    exp_avg = exp_avg * np.float32(beta1) + grad * np.float32(1.0 - beta1)
    exp_avg_sq = exp_avg_sq * np.float32(beta2) + grad * grad * np.float32(1.0 - beta2)
    step_size = lr / bias_correction1
    denom = np.sqrt(exp_avg_sq / np.float32(bias_correction2)) + np.float32(eps)
    return (next_param - (exp_avg / denom) * np.float32(step_size)).astype(np.float32), exp_avg, exp_avg_sq


def normalize_ns_schedule(ns_coefficients, ns_steps):
    """P Muon._normalize_ns_schedule."""
    first = ns_coefficients[0]
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        triple = tuple(float(v) for v in ns_coefficients)
        return tuple(triple for _ in range(ns_steps)), ns_steps
    schedule = []
    for triple_raw, count in ns_coefficients:
        schedule.extend(tuple(float(v) for v in triple_raw) for _ in range(int(count)))
    return tuple(schedule), len(schedule)


# ---- QK-clip (2.1.0). F = mindformers/pynative/layers/flash_attention.py, M = mindformers/pynative/transformers/
# multi_latent_attention.py, G as above (its apply_qk_clip_scaling / _all_reduce_max_logits / reset), C =
# mindformers/pynative/callback/max_logits_monitor.py. Weights in MindFormers' Linear orientation [out, in].

def flash_softmax_max(query, key, allowed, scale):
    """FlashAttentionScore's softmax_max output, one value per (batch, head, query): the row max of the scaled
    logits scale_value * q k^T over the keys the mask keeps (the op computes in fp32; its [.., 8] copies dropped).
    query [B, N, S, D], key [B, N, K, D], allowed [B, N|1, S, K] (True = kept: MindFormers' mask value 0)."""
    logits = np.float32(scale) * np.einsum("bnsd,bnkd->bnsk", query.astype(np.float32), key.astype(np.float32))
    return np.where(allowed, logits, -np.inf).max(axis=-1)


def update_max_logits(max_logits_val, softmax_val):
    """F _update_max_logits (BNSD: reduce_dims (0, 2, 3) over [B, N, S, 8]; here the trailing 8 is gone):
    max_logits = amax(softmax_val, dims); max_logits_val = maximum(max_logits_val, max_logits)."""
    max_logits = softmax_val.max(axis=(0, 2))
    return np.maximum(max_logits_val, max_logits).astype(np.float32)


def init_max_logits_val(head_num):
    """F _init_max_logits_val (and reset_parameter, C on_step_end every step): zeros((head_num,), float32)."""
    return np.zeros((head_num,), dtype=np.float32)


def qk_clip_scales(logit_threshold, stacked_max_logits):
    """G apply_qk_clip_scaling: scales = logit_threshold / clamp(all_reduce_max(stacked), min=logit_threshold);
    `stacked_max_logits` [L, N] already max-reduced over the data x context parallel ranks."""
    threshold = np.float32(logit_threshold)
    return (threshold / np.maximum(stacked_max_logits.astype(np.float32), threshold)).astype(np.float32)


def row_scales(segments):
    """M _row_scales: cat([tile(unsqueeze(factor, 1), (1, rows)) for rows, factor in segments], dim=1).reshape(-1)."""
    per_head = np.concatenate([np.tile(factor[:, None], (1, rows)) for rows, factor in segments], axis=1)
    return per_head.reshape(-1)


def apply_qk_clip(scales, weights, qk_head_dim, qk_pos_emb_head_dim, v_head_dim, q_lora_rank):
    """M apply_qk_clip on one layer. `weights`: {"linear_qkv", "linear_qb", "linear_kvb"} -> [out, in] fp32 masters
    (returned scaled; the dict is not modified). M _clip_projection multiplies every row by its factor."""
    out = {name: w.copy() for name, w in weights.items()}
    root = np.sqrt(scales).astype(np.float32)                                  # root = mint.sqrt(scales)
    q_rows = row_scales(((qk_head_dim, root), (qk_pos_emb_head_dim, scales)))
    if q_lora_rank is None:                                                    # query heads lead linear_qkv
        tail = out["linear_qkv"].shape[0] - q_rows.shape[0]                    # [q | kv_lora | k rope] unscaled
        q_rows = np.concatenate([q_rows, np.ones((tail,), dtype=np.float32)])
        out["linear_qkv"] = out["linear_qkv"] * q_rows[:, None]
    else:
        out["linear_qb"] = out["linear_qb"] * q_rows[:, None]
    kv_rows = row_scales(((qk_head_dim, root), (v_head_dim, np.ones_like(scales))))
    out["linear_kvb"] = out["linear_kvb"] * kv_rows[:, None]
    return out


# ---- Graph mode (2.1.0 mindformers/core/optim/muon.py = GM; the split schema as in U, core/optim/muon_utils.py
# make_muon_fns, the same periodic / reshape_concat / reshape_only kinds). Its bf16 ops do not run on the CPU either
# (MindSpore 2.10 CPU: "Select CPU operator[Square] fail! Unsupported data type!" for x.norm(), the same for MatMul).
# Read as: every op on bf16 tensors returns bf16 (rounded once, products accumulated in fp32); a Python float
# scalar multiplies in fp32 and the result is rounded to bf16; x.norm() is the fp32 norm of the bf16 values, rounded.

def graph_newton_schulz(x, dim_a, dim_b):
    """GM zeropower_via_newtonschulz5_2d / _3d (the batched form on 3-D)."""
    a, b, c = (3.4445, -4.7750, 2.0315)                                   # fixed; ns_steps is not passed
    if dim_a > dim_b:
        x = mT(x)
    norm = np.sqrt(np.sum(x.astype(np.float64) ** 2, axis=(-2, -1), keepdims=True)).astype(np.float32)
    x = bf16(x / bf16(bf16(norm) + np.float32(1e-7)))                    # x = x / (x.norm() + 1e-7)
    for _ in range(5):
        a_mat = bf16(x @ mT(x))                                           # a_mat = x @ x.T
        b_mat = bf16(bf16(np.float32(b) * a_mat) + bf16(bf16(np.float32(c) * a_mat) @ a_mat))  # b*A + (c*A) @ A
        x = bf16(bf16(np.float32(a) * x) + bf16(b_mat @ x))               # x = a * x + b_mat @ x
    if dim_a > dim_b:
        x = mT(x)
    return x


def graph_apply_muon_update(gradient, muon_m, momentum, use_nesterov, param, lr, weight_decay, matched_adamw_rms,
                            kind, parts):
    """GM _apply_muon_update (one card: op = tp = 1, no all-gather or slicing)."""
    m_fp32 = muon_m.astype(np.float32)
    gradient_fp32 = gradient.astype(np.float32)
    next_m = m_fp32 * np.float32(momentum) + gradient_fp32
    gradient_fp32 = gradient_fp32 + next_m * np.float32(momentum) if use_nesterov else next_m
    ns_inputs = bf16(gradient_fp32)                                       # op_cast(gradient_fp32, bfloat16)
    x_list = []
    dim_a = dim_b = None
    for item in split_fn(kind, ns_inputs, parts):
        dim_a, dim_b = item.shape[-2:]                                    # the loop variables outlive the loop
        x_list.append(graph_newton_schulz(item, dim_a, dim_b))
    x_ret = merge_fn(kind, x_list, parts)
    lr = np.float32(lr)                                                   # get_lr(): an fp32 tensor
    param_fp32 = param * (np.float32(1) - lr * np.float32(weight_decay))  # param_fp32 * (1 - lr * weight_decay)
    # adjusted_ratio = op_sqrt(op_cast(max(dim_a, dim_b), float32)) * matched_adamw_rms: the last piece's dims
    adjusted_ratio = np.sqrt(np.float32(max(int(dim_a), int(dim_b)))) * np.float32(matched_adamw_rms)
    update_with_lr = (lr * adjusted_ratio) * x_ret                         # adjusted_lr * x_ret
    next_param = param_fp32 - update_with_lr.reshape(param_fp32.shape)
    return next_param.astype(np.float32), next_m
