"""MindFormers tensors <-> HF checkpoint tensors <-> a transformers 5 model's parameters (the tables: translators/
names.py). Every split, stack and transpose here is exact (views and copies: the bits are kept).

Shapes (legend): E experts, H hidden, I expert width, G KV groups, R q heads per group, D head_dim.
  qkv      MindFormers [G*(R+2)*D, H] (per group: R q heads, k, v) or, `qkv_contiguous`, [q; k; v]
  gate_up  MindFormers [2I, H] rows interleaved (gate_0, up_0, gate_1, ...) or, not `ffn_interleaved`, [gate; up]
  stack    MindFormers [E, out, in] (Mixtral), [E, in, out] with `gmm`
  weight1  MindFormers [E*H, 2I]: expert e's [gate_e; up_e] transposed; weight2 [E*I, H]: down_e transposed
  experts_w1  MindFormers [E, H, 2I] = [gate_e^T | up_e^T] (DeepSeek-V4's GroupedMLP); experts_w2 [E, I, H] = down_e^T
  hc_scale MindFormers alpha_pre / alpha_post / alpha_res [1] each: HF's mHC `scale` [3] (DeepSeek-V4)
transformers 5 holds the experts fused: `experts.gate_up_proj` [E, 2I, H] = [gate_e; up_e] per expert,
`experts.down_proj` [E, H, I] (transformers/conversion_mapping.py "mixtral", "qwen2_moe"), and Mixtral's
`block_sparse_moe` is its `mlp`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from translators import mtp as mtp_names
from translators import names
from translators.families.mcore import MCORE_MLA_ROPE
from translators.plan_types import Plan


@dataclass(frozen=True)
class WeightLayout:
    """How the YAML's MindFormers checkpoint lays out fused weights."""

    gmm: bool = False  # stacked experts [E, in, out] (moe_config.use_gmm: GroupedMatmul)
    qkv_concat: bool = False  # legacy: attention.w_qkv and feed_forward.w_gate_hidden (LlamaConfig qkv_concat);
    #                           GLM: query_key_value (ChatGLM2Config qkv_concat, default True)
    mlp_concat: bool = True  # GLM: dense_h_to_4h, else dense_left / dense_right
    qkv_contiguous: bool = False  # mcore use_contiguous_weight_layout_attention (MindFormers default False)
    ffn_interleaved: bool = True  # mcore use_interleaved_weight_layout_mlp (MindFormers default True)
    mla_concat: bool = True  # mcore MLA mla_qkv_concat (TransformerConfig default True): linear_qkv, linear_qb, ...


DEFAULT_LAYOUT = WeightLayout()


def layout_of(plan: Plan) -> WeightLayout:
    """The WeightLayout the Plan's run.checkpoint_layout names (translators/names.py checkpoint_layout), with the
    family's own defaults where the YAML is silent."""
    from mf_ds.errors import RunError

    given = plan.run.checkpoint_layout
    glm = names.style(plan.weights_family) == "glm"
    if glm and given.use_rearrange_rope:
        raise RunError("model.model_config.use_rearrange_rope: True: MindFormers' q/k rows are rearranged "
                       "(glm2/convert_weight.py rearrange_w); mf-ds reads checkpoints without it only")
    qkv_concat = given.qkv_concat
    return WeightLayout(gmm=given.use_gmm, qkv_concat=glm if qkv_concat is None else qkv_concat,
                  mlp_concat=given.mlp_concat is not False,
                  qkv_contiguous=given.use_contiguous_weight_layout_attention,
                  ffn_interleaved=given.use_interleaved_weight_layout_mlp, mla_concat=given.mla_qkv_concat)


def _dims(config) -> tuple[int, int, int]:
    heads, groups = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return groups, heads // groups, head_dim


def _split_qkv(fused: torch.Tensor, config, contiguous: bool) -> list[torch.Tensor]:
    groups, per_group, head_dim = _dims(config)
    if contiguous:
        q, k, v = fused.split([groups * per_group * head_dim, groups * head_dim, groups * head_dim])
        return [q, k, v]
    grouped = fused.reshape(groups, (per_group + 2) * head_dim, -1)
    shape = lambda n: (n * head_dim,) + tuple(fused.shape[1:])  # noqa: E731 (a bias stays 1-d)
    return [grouped[:, : per_group * head_dim].reshape(shape(groups * per_group)),
            grouped[:, per_group * head_dim:(per_group + 1) * head_dim].reshape(shape(groups)),
            grouped[:, (per_group + 1) * head_dim:].reshape(shape(groups))]


def _join_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config, contiguous: bool) -> torch.Tensor:
    if contiguous:
        return torch.cat([q, k, v])
    groups, per_group, head_dim = _dims(config)
    rest = tuple(q.shape[1:])
    grouped = torch.cat([q.reshape(groups, per_group * head_dim, -1), k.reshape(groups, head_dim, -1),
                         v.reshape(groups, head_dim, -1)], dim=1)
    return grouped.reshape((groups * (per_group + 2) * head_dim,) + rest)


def _split_gate_up(fused: torch.Tensor, interleaved: bool) -> list[torch.Tensor]:
    if interleaved:
        pairs = fused.reshape(fused.shape[0] // 2, 2, *fused.shape[1:])
        return [pairs[:, 0], pairs[:, 1]]
    return list(fused.chunk(2))


def _join_gate_up(gate: torch.Tensor, up: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if interleaved:
        return torch.stack([gate, up], dim=1).reshape(2 * gate.shape[0], *gate.shape[1:])
    return torch.cat([gate, up])


@dataclass(frozen=True)
class Piece:
    """An HF checkpoint tensor, or (with `view`) the part `view(*view)[index]` of one, from a MindFormers tensor."""

    name: str
    tensor: torch.Tensor
    view: tuple[int, ...] | None = None
    index: tuple = ()


def _mla(config) -> tuple[int, int, int, int]:
    return (config.num_attention_heads, config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim)


def _halves_to_pairs(rows: torch.Tensor, rope: int) -> torch.Tensor:
    """[..., rope, r] rows reordered evens-then-odds (MindFormers) -> interleaved pairs (HF), along axis -2."""
    lead = rows.shape[:-2]
    return rows.reshape(*lead, 2, rope // 2, rows.shape[-1]).transpose(-3, -2).reshape(*lead, rope, rows.shape[-1])


def _pairs_to_halves(rows: torch.Tensor, rope: int) -> torch.Tensor:
    lead = rows.shape[:-2]
    return rows.reshape(*lead, rope // 2, 2, rows.shape[-1]).transpose(-3, -2).reshape(*lead, rope, rows.shape[-1])


def _num_experts(config) -> int:
    """HF's routed-expert count (DeepSeek-V3 names it n_routed_experts)."""
    return getattr(config, "num_experts", None) or config.n_routed_experts


def _mla_rope(hf_name: str, tensor: torch.Tensor, config, to_hf: bool) -> torch.Tensor:
    """An mcore MLA tensor's rope rows between MindFormers' halves and HF's pairs (MCORE_MLA_ROPE)."""
    kind = next((k for part, k in MCORE_MLA_ROPE.items() if part in hf_name), None)
    if kind is None:
        return tensor
    heads, nope, rope, _ = _mla(config)
    turn = _halves_to_pairs if to_hf else _pairs_to_halves
    out = tensor.clone()
    if kind == "kv_a":  # [kv_lora + rope, H]: the last rope rows
        out[-rope:] = turn(tensor[-rope:], rope)
        return out
    rows = out.view(heads, nope + rope, tensor.shape[-1])  # q_b [heads * (nope + rope), q_lora]
    rows[:, nope:] = turn(rows[:, nope:].clone(), rope)
    return out


def _split_where(kind: str, half: int, config, cols: int) -> tuple[tuple[int, ...], tuple]:
    """research/deepseek3/convert_weight.py _mla_pt_to_ms, undone: the view of the HF tensor and the index in it
    where MindFormers half `half` lies."""
    if kind == "halves":  # GLM gate_up_proj [2I, H]: gate rows, then up rows
        return (2, config.intermediate_size, cols), (half,)
    if kind == "hc_scale":  # DeepSeek-V4 mHC scale [3]: pre, post, comb (utils.py ScaleSplitConvertOp)
        return (3,), (slice(half, half + 1),)
    heads, nope, rope, v_dim = _mla(config)
    if kind == "kv_a":  # HF [kv_lora + rope, H]: the latent rows, then the shared k rope rows
        lora = config.kv_lora_rank
        return (lora + rope, cols), ((slice(0, lora),) if half == 0 else (slice(lora, None),))
    second = rope if kind == "q_b" else v_dim  # q_b: per head nope then rope rows; kv_b: k_nope then v rows
    rows = slice(0, nope) if half == 0 else slice(nope, None)
    return (heads, nope + second, cols), (slice(None), rows)


def _split_piece(kind: str, half: int, hf_name: str, tensor: torch.Tensor, config) -> Piece:
    view, index = _split_where(kind, half, config, tensor.shape[-1])
    if kind in ("halves", "hc_scale"):
        return Piece(hf_name, tensor, view, index)
    rope = config.qk_rope_head_dim
    if kind == "kv_a":
        return Piece(hf_name, _halves_to_pairs(tensor, rope) if half else tensor, view, index)
    part = tensor.reshape(view[0], -1, view[-1])
    return Piece(hf_name, _halves_to_pairs(part, rope) if half and kind == "q_b" else part, view, index)


def to_hf(mf_name: str, tensor: torch.Tensor, family: str, config, layout: WeightLayout) -> list[Piece] | None:
    """The HF checkpoint tensors (or parts of them) that MindFormers tensor `mf_name` holds; None when it is not a
    model weight."""
    stem = names.mf_to_hf(names.mtp_to_hf(mtp_names.to_decoder(mf_name, family, config.num_hidden_layers),
                                          config.num_hidden_layers), family)
    if stem is None:
        return None
    for part, (_, constant, _) in names.frozen(family).items():
        if mf_name.endswith(part):  # a frozen constant HF does not hold (a weightless norm's ones)
            if constant == "ones" and not bool((tensor == 1).all()):
                from mf_ds.errors import RunError

                raise RunError(f"{mf_name}: MindFormers keeps it frozen at ones (HF's norm there has no weight); "
                               "this checkpoint holds other values, which HF's DeepSeek-V4 cannot represent")
            return []
    expert = names.expert_kind(mf_name, family)
    if expert:
        part, kind, hf_parts = expert
        base = stem[: -len(part)]  # the tables leave the experts' own name part as it is
        out = []
        if kind in ("stack", "stack_bmm"):
            for e, w in enumerate(tensor.unbind(0)):
                w = w.transpose(0, 1) if layout.gmm and kind == "stack" else w
                out.append(Piece(base + hf_parts[0].format(e=e), w.contiguous()))
        elif kind in ("gmm_w1", "experts_w1"):  # [E, H, 2I] = [gate^T | up^T]
            for e, w in enumerate(tensor.unbind(0)):
                gate, up = w.transpose(0, 1).chunk(2)
                out += [Piece(base + hf_parts[0].format(e=e), gate.contiguous()),
                        Piece(base + hf_parts[1].format(e=e), up.contiguous())]
        elif kind in ("gmm_w2", "experts_w2"):  # [E, I, H] = down^T
            out = [Piece(base + hf_parts[0].format(e=e), w.transpose(0, 1).contiguous())
                   for e, w in enumerate(tensor.unbind(0))]
        elif kind == "weight1":  # [E*H, 2I] -> per expert [2I, H] = [gate; up]
            for e, w in enumerate(tensor.reshape(_num_experts(config), -1, tensor.shape[-1]).unbind(0)):
                gate, up = w.transpose(0, 1).chunk(2)
                out += [Piece(base + hf_parts[0].format(e=e), gate.contiguous()),
                        Piece(base + hf_parts[1].format(e=e), up.contiguous())]
        else:  # weight2: [E*I, H] -> per expert down [H, I]
            out = [Piece(base + hf_parts[0].format(e=e), w.transpose(0, 1).contiguous())
                   for e, w in enumerate(tensor.reshape(_num_experts(config), -1, tensor.shape[-1]).unbind(0))]
        return out
    split = names.split_kind(mf_name, family)
    if split:
        part, kind, hf_part, half = split
        return [_split_piece(kind, half, stem.replace(part, hf_part), tensor, config)]
    for part, (kind, hf_parts) in names.fused_parts(family).items():
        if part in stem:
            mcore = names.is_mcore(family)
            if kind == "mla_qkv":  # [q_lora; kv_lora + rope] rows
                q_a, kv_a = tensor.split([config.q_lora_rank, tensor.shape[0] - config.q_lora_rank])
                return [Piece(stem.replace(part, hf_parts[0]), q_a.contiguous()),
                        Piece(stem.replace(part, hf_parts[1]), _mla_rope(hf_parts[1], kv_a, config, True))]
            pieces = (_split_qkv(tensor, config, kind == "qkv_cat" or (mcore and layout.qkv_contiguous))
                      if kind.startswith("qkv") else _split_gate_up(tensor, not mcore or layout.ffn_interleaved))
            return [Piece(stem.replace(part, hf), p.contiguous()) for hf, p in zip(hf_parts, pieces, strict=True)]
    if names.style(family) == "mcore_mla":
        return [Piece(stem, _mla_rope(stem, tensor, config, True))]
    return [Piece(stem, tensor)]


def _expert_entries(family: str, layout: WeightLayout):
    """The stacked-expert entries that apply to this layout (DeepSeek names its experts by use_gmm)."""
    for part, (kind, hf_parts) in names.experts(family).items():
        if (kind.startswith("gmm_") and not layout.gmm) or (kind == "stack_bmm" and layout.gmm):
            continue
        yield part, kind, hf_parts


def _expert_pattern(hf: str) -> re.Pattern:
    return re.compile(re.escape(hf).replace(re.escape("{e}"), r"(\d+)") + "$")


def mindformers_names(hf_names: list[str], family: str, layout: WeightLayout = DEFAULT_LAYOUT,
                      num_layers: int | None = None) -> dict[str, list[str]]:
    """{MindFormers name: the HF names it is built from, in order} for the HF checkpoint names given; `num_layers`:
    the main layers, past which DeepSeek's MTP fusers and norms take MindFormers' MTP names (names.mtp_to_mf)."""
    out: dict[str, list[str]] = {}
    # mcore checkpoints always hold q/k/v and gate/up fused; legacy ones when the YAML says qkv_concat: True (the
    # network then has only w_qkv / w_gate_hidden, and MindFormers loads nothing else into them).
    fused = {hf: part for part, (kind, hf_parts) in names.fused_parts(family).items() for hf in hf_parts
             if (names.is_mcore(family) or layout.qkv_concat) and (kind != "mla_qkv" or layout.mla_concat)}
    experts = [(_expert_pattern(hf), part) for part, _, hf_parts in _expert_entries(family, layout) for hf in hf_parts]
    splits = {hf: v for hf, v in names.splits(family).items() if v[0] != "halves" or not layout.mlp_concat}
    for name in hf_names:
        for pattern, part in experts:
            m = pattern.search(name)
            if m:
                out.setdefault(names.hf_to_mf(name[: m.start()], family, layout.gmm) + part, []).append(name)
                break
        else:
            hit = next(((hf, part) for hf, part in fused.items() if hf in name), None)
            split = next(((hf, parts) for hf, (_, parts) in splits.items() if hf in name), None)
            if hit:
                mf = names.hf_to_mf(name.replace(hit[0], "\0"), family).replace("\0", hit[1])
                out.setdefault(mf, []).append(name)
            elif split:
                stem = names.hf_to_mf(name.replace(split[0], "\0"), family, layout.gmm)
                for part in split[1]:
                    out[stem.replace("\0", part)] = [name]
            else:
                research = num_layers is not None and family not in mtp_names.GPT_FAMILIES  # GPTModel's: below
                mtp = names.mtp_to_mf(name, num_layers) if research else name
                out[names.hf_to_mf(mtp, family, layout.gmm, layout.mla_concat)] = [name]
    return out if num_layers is None else {mtp_names.from_decoder(mf, family, num_layers): hf for mf, hf in out.items()}


def from_hf(mf_name: str, hf_names: list[str], read: Callable[[str], torch.Tensor], family: str, config,
            layout: WeightLayout) -> torch.Tensor:
    """MindFormers tensor `mf_name` built from the HF checkpoint tensors `hf_names` (read one at a time)."""
    expert = names.expert_kind(mf_name, family)
    if expert:
        _, kind, hf_parts = expert
        index = {}
        for name in hf_names:
            for i, hf in enumerate(hf_parts):
                m = _expert_pattern(hf).search(name)
                if m:
                    index[(int(m.group(1)), i)] = name
        experts = 1 + max(e for e, _ in index)
        if kind in ("stack", "stack_bmm", "gmm_w2", "experts_w2"):
            turn = (layout.gmm and kind == "stack") or kind in ("gmm_w2", "experts_w2")
            first = read(index[(0, 0)])
            out = torch.empty((experts, *(first.shape[::-1] if turn else first.shape)), dtype=first.dtype)
            for e in range(experts):
                w = first if e == 0 else read(index[(e, 0)])
                out[e] = w.transpose(0, 1) if turn else w
            return out
        if kind in ("gmm_w1", "experts_w1"):  # [E, H, 2I] = [gate^T | up^T]
            gate = read(index[(0, 0)])
            out = torch.empty((experts, gate.shape[1], 2 * gate.shape[0]), dtype=gate.dtype)
            for e in range(experts):
                out[e, :, : gate.shape[0]] = (gate if e == 0 else read(index[(e, 0)])).transpose(0, 1)
                out[e, :, gate.shape[0]:] = read(index[(e, 1)]).transpose(0, 1)
            return out
        if kind == "weight1":
            gate = read(index[(0, 0)])
            out = torch.empty((experts, gate.shape[1], 2 * gate.shape[0]), dtype=gate.dtype)
            for e in range(experts):
                g = gate if e == 0 else read(index[(e, 0)])
                out[e, :, : g.shape[0]] = g.transpose(0, 1)
                out[e, :, g.shape[0]:] = read(index[(e, 1)]).transpose(0, 1)
            return out.reshape(-1, out.shape[-1])
        down = read(index[(0, 0)])
        out = torch.empty((experts, down.shape[1], down.shape[0]), dtype=down.dtype)
        for e in range(experts):
            out[e] = (down if e == 0 else read(index[(e, 0)])).transpose(0, 1)
        return out.reshape(-1, out.shape[-1])
    split = names.split_kind(mf_name, family)
    if split:
        _, kind, _, half = split
        (name,) = hf_names
        whole = read(name)
        view, where = _split_where(kind, half, config, whole.shape[-1])
        part = whole.reshape(view)[where]
        if kind == "hc_scale":
            return part.clone()
        if half == 1 and kind in ("q_b", "kv_a"):
            part = _pairs_to_halves(part, config.qk_rope_head_dim)
        return part.reshape(-1, whole.shape[-1]).contiguous()
    kind = names.fused_kind(mf_name, family)
    if kind:
        mcore = names.is_mcore(family)
        order = {hf: i for _, (k, hf_parts) in names.fused_parts(family).items() if k == kind
                 for i, hf in enumerate(hf_parts)}
        parts = sorted(hf_names, key=lambda n: next(i for hf, i in order.items() if hf in n))
        tensors = [read(n) for n in parts]
        if kind == "mla_qkv":
            return torch.cat([tensors[0], _mla_rope(parts[1], tensors[1], config, False)])
        if kind.startswith("qkv"):
            return _join_qkv(*tensors, config, kind == "qkv_cat" or (mcore and layout.qkv_contiguous))
        return _join_gate_up(*tensors, not mcore or layout.ffn_interleaved)
    (name,) = hf_names
    if names.style(family) == "mcore_mla":
        return _mla_rope(name, read(name), config, False)
    return read(name)


# HF checkpoint names -> transformers 5 parameters: (pattern, parameter, slot). Slot: None (the whole parameter),
# ("expert", i) (row e of a stacked parameter, the i-th half along dim 1 of gate_up).
_EXPERT_PARAMS = (
    (re.compile(r"^(.*)\.block_sparse_moe\.experts\.(\d+)\.w1\.weight$"), r"\1.mlp.experts.gate_up_proj", 0),
    (re.compile(r"^(.*)\.block_sparse_moe\.experts\.(\d+)\.w3\.weight$"), r"\1.mlp.experts.gate_up_proj", 1),
    (re.compile(r"^(.*)\.block_sparse_moe\.experts\.(\d+)\.w2\.weight$"), r"\1.mlp.experts.down_proj", None),
    (re.compile(r"^(.*)\.mlp\.experts\.(\d+)\.gate_proj\.weight$"), r"\1.mlp.experts.gate_up_proj", 0),
    (re.compile(r"^(.*)\.mlp\.experts\.(\d+)\.up_proj\.weight$"), r"\1.mlp.experts.gate_up_proj", 1),
    (re.compile(r"^(.*)\.mlp\.experts\.(\d+)\.down_proj\.weight$"), r"\1.mlp.experts.down_proj", None),
    # DeepSeek-V4 (transformers/conversion_mapping.py "deepseek_v4" reads these per-expert names)
    (re.compile(r"^(.*)\.mlp\.experts\.(\d+)\.w1\.weight$"), r"\1.mlp.experts.gate_up_proj", 0),
    (re.compile(r"^(.*)\.mlp\.experts\.(\d+)\.w3\.weight$"), r"\1.mlp.experts.gate_up_proj", 1),
    (re.compile(r"^(.*)\.mlp\.experts\.(\d+)\.w2\.weight$"), r"\1.mlp.experts.down_proj", None),
)


def model_slot(hf_name: str, state: dict[str, torch.Tensor]) -> tuple[str, tuple] | None:
    """Where HF checkpoint tensor `hf_name` lies in a transformers 5 model: (parameter, index); None if nowhere."""
    if hf_name in state:
        return hf_name, ()
    for pattern, target, half in _EXPERT_PARAMS:
        m = pattern.match(hf_name)
        if m and m.expand(target) in state:
            param = m.expand(target)
            e = int(m.group(2))
            if half is None:
                return param, (e,)
            rows = state[param].shape[1] // 2
            return param, (e, slice(half * rows, (half + 1) * rows))
    renamed = hf_name.replace(".block_sparse_moe.", ".mlp.")
    return (renamed, ()) if renamed in state else None


ROUTER_BIAS = ".gate.e_score_correction_bias"


def attach_router_bias(model: torch.nn.Module, hf_name: str, tensor: torch.Tensor) -> str | None:
    """MindFormers' selection bias (`...router.router.topk_bias`, HF name `...gate.e_score_correction_bias`) for a
    model whose HF router has no such buffer (Mixtral, Qwen2-MoE: only DeepSeek-V3's has one): registered on the HF
    router as the fp32 buffer mf-ds' MoE patch then selects with (mf_ds/patch/moe.py), so the trained bias is kept.
    Returns the model's name of the buffer, or None when `hf_name` is no router bias of this model (a router there,
    [E, H] to this [E])."""
    if not hf_name.endswith(ROUTER_BIAS):
        return None
    path = hf_name.replace(".block_sparse_moe.", ".mlp.")[: -len(".e_score_correction_bias")]
    try:
        router = model.get_submodule(path)
    except AttributeError:
        return None
    weight = getattr(router, "weight", None)
    rows = getattr(weight, "ds_shape", getattr(weight, "shape", None))  # ZeRO-3: the whole shape (mf_ds/zero.py)
    if rows is None or tensor.dim() != 1 or rows[0] != tensor.numel():
        return None
    if getattr(router, "e_score_correction_bias", None) is None:
        router.register_buffer("e_score_correction_bias", torch.zeros(tensor.numel(), dtype=torch.float32,
                                                                       device=weight.device))
    return f"{path}.e_score_correction_bias"
