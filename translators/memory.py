"""Memory per device of a DeepSpeed run of the Plan: model states for the ZeRO stage and activations per micro batch.

Pure arithmetic over `plan.hf_config`, `plan.deepspeed`, `plan.layers` and the degrees of `plan.parallel`.
Legend: P parameters, N ZeRO shard degree, T tokens of a micro batch on one rank (micro x seq_length / cp),
h hidden, a heads, k KV heads, d head dim, I MLP width, V vocabulary, e bytes of the compute dtype.

Model states (DeepSpeed 0.19.8, measured on CPU ranks: tests/translators/test_memory_deepspeed.py):
  bf16/fp16, ZeRO-1/2  params e*P (whole, DeepSpeed's flat bit16 buffer), fp32 master 4P/N, Adam moments 8P/N,
                       gradients e*P/N (`grads_in_partition`: with contiguous_gradients ZeRO-1 partitions them as
                       ZeRO-2 does); during backward the reduce bucket (`reduce_bucket_size` x e), at the step the
                       fp32 gradient partition 4P/N.
  ZeRO-3               params e*P/N (+ e x each parameter under `stage3_param_persistence_threshold`, kept whole),
                       master 4P/N, moments 8P/N, gradients e*P/N, the reduce bucket for the whole run.
  fp32                 the same with e = 4 (the optimizer still keeps its own fp32 partition).
  N is the data-parallel degree (x context parallel: Ulysses ranks share weights); routed experts are split over
  expert parallelism and sharded by ZeRO over the expert-data-parallel group (world / ep). AutoTP shards the
  attention and dense/shared MLP weights by tp; embeddings, norms and routers stay whole on every TP rank.

Activations (what autograd keeps, counted op by op for HF's Llama-style decoder layer under SDPA/flash attention,
measured with the torch memory profiler on CPU: tests/translators/test_memory_activations.py), bytes per token:
  RMSNorm          (4 + e)h       its fp32 copy of x and the normalised x (x.to(fp32), weight * x.to(e))
  linear inputs    e(2h + ad/tp)  q/k/v input, MLP input, o_proj input (the SDPA output, no copy)
  attention        e(ad + 2kd)/tp + 4a/tp   q and k after RoPE, v, the log-sum-exp (fp32)
  SwiGLU MLP       4eI/tp         gate, up, act(gate), the product
  loss             (12 + e)V      log_softmax output (fp32), the logits (e), two fp32 gradients at the loss
  MLA (DeepSeek)   q_a / kv_a norms and up-projection inputs, q and k at (nope + rope), v and the SDPA output at v
  MoE layer        router scores 3 x 4E (fp32), top_k routed rows of e(2h + 4I_moe), shared experts as an MLP
A fully recomputed layer keeps its input (e h); select recompute drops what mf_ds/patch/recompute.py drops (act+mul:
2eI; an RMSNorm: 4h). Peak = max(loss peak, backward of each layer: the kept sets below it + its whole set +
the backward working set (12 + e)h + the logits eV).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from translators.errors import ConfigError
from translators.plan_types import Layer, Plan

GiB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# DeepSpeed 0.19.8 defaults (runtime/zero/config.py)
REDUCE_BUCKET = 500_000_000
PERSISTENCE_THRESHOLD = 100_000


def with_defaults(hf: dict) -> dict:
    """`hf` with HF's config defaults for the keys read here that a translated hf_config may leave out (the family
    record's memory_defaults, transformers 5.23)."""
    from translators.families import registry

    found = registry.by_hf_type(hf["model_type"])
    return {**(found.memory_defaults if found else {}), **hf}


def _tied_default(model_type: str) -> bool:
    from translators.families import registry

    found = registry.by_hf_type(model_type)
    return found.tied_embeddings if found else False


@dataclass(frozen=True)
class Weights:
    """A family of equal tensors: `count` tensors of `numel` elements, sharded as `shard` says."""

    name: str
    numel: int
    count: int
    shard: str  # "whole" (every rank), "tp" (AutoTP splits it), "expert" (expert parallelism splits the count)
    layer: int | None = None  # decoder layer kind index for per-layer sums (None: outside the layers)


def _get(hf: dict, *names: str, default=None):
    for name in names:
        if hf.get(name) is not None:
            return hf[name]
    return default


def inventory(hf: dict) -> list[Weights]:
    """Every parameter tensor of `AutoModelForCausalLM.from_config(hf)` (checked against torch's meta device)."""
    hf = with_defaults(hf)
    mt = hf["model_type"]
    if mt == "gpt2":
        return _gpt2(hf)
    if mt == "deepseek_v4":
        return _deepseek_v4(hf)
    h, L, V = hf["hidden_size"], hf["num_hidden_layers"], hf["vocab_size"]
    a = hf["num_attention_heads"]
    k = _get(hf, "num_key_value_heads", default=a)
    d = _get(hf, "head_dim", default=h // a)
    out = [Weights("embed_tokens", V * h, 1, "whole"), Weights("norm", h, 1, "whole")]
    if not hf.get("tie_word_embeddings", _tied_default(mt)):
        out.append(Weights("lm_head", V * h, 1, "whole"))
    moe_layers = _moe_layers(hf)
    counts = {"dense": L - len(moe_layers), "moe": len(moe_layers)}
    for kind, n in counts.items():
        if n == 0:
            continue
        out += [Weights(f"{kind}.norms", h, 2 * n, "whole", kind)]
        out += [Weights(f"{kind}.{w.name}", w.numel, w.count * n, w.shard, kind) for w in _attention(hf, h, a, k, d)]
        out += [Weights(f"{kind}.{w.name}", w.numel, w.count * n, w.shard, kind) for w in
                (_moe(hf, h) if kind == "moe" else _mlp(hf, h, hf["intermediate_size"]))]
    return out


def _attention(hf: dict, h: int, a: int, k: int, d: int) -> list[Weights]:
    mt = hf["model_type"]
    if mt in ("deepseek_v2", "deepseek_v3"):
        nope, rope, v, ql, kvl = _mla(hf)
        bias = 1 if hf.get("attention_bias") else 0
        w = [Weights("kv_a_proj_with_mqa", (h + bias) * (kvl + rope), 1, "whole"),
             Weights("kv_a_layernorm", kvl, 1, "whole"), Weights("kv_b_proj", kvl * a * (nope + v), 1, "tp"),
             Weights("o_proj", a * v * h + bias * h, 1, "tp")]
        if ql:
            w += [Weights("q_a_proj", (h + bias) * ql, 1, "whole"), Weights("q_a_layernorm", ql, 1, "whole"),
                  Weights("q_b_proj", ql * a * (nope + rope), 1, "tp")]
        else:
            w.append(Weights("q_proj", h * a * (nope + rope), 1, "tp"))
        return w
    qkv_bias = {"qwen2": True, "qwen2_moe": True, "glm": hf.get("attention_bias", True)}.get(
        mt, bool(hf.get("attention_bias")))
    o_bias = bool(hf.get("attention_bias")) if mt in ("llama", "qwen3", "qwen3_moe") else False
    w = [Weights("q_proj", (h + qkv_bias) * a * d, 1, "tp"), Weights("kv_proj", (h + qkv_bias) * k * d, 2, "tp"),
         Weights("o_proj", a * d * h + o_bias * h, 1, "tp")]
    if mt in ("qwen3", "qwen3_moe"):
        w.append(Weights("qk_norm", d, 2, "whole"))
    return w


def _mla(hf: dict) -> tuple:
    """(qk_nope, qk_rope, v head dims, q_lora_rank, kv_lora_rank)."""
    return hf["qk_nope_head_dim"], hf["qk_rope_head_dim"], hf["v_head_dim"], hf["q_lora_rank"], hf["kv_lora_rank"]


def _mlp(hf: dict, h: int, width: int, name: str = "mlp") -> list[Weights]:
    return [Weights(f"{name}.proj", h * width, 3, "tp")]


def _moe_layers(hf: dict) -> list[int]:
    mt, L = hf["model_type"], hf.get("num_hidden_layers")
    if mt == "gpt2":
        return []
    if mt in ("deepseek_v2", "deepseek_v3"):
        if not hf.get("n_routed_experts"):
            return []
        first, freq = hf.get("first_k_dense_replace", 0), hf.get("moe_layer_freq", 1)
        return [i for i in range(L) if i >= first and i % freq == 0]
    if mt in ("mixtral", "deepseek_v4"):
        return list(range(L))
    if mt in ("qwen2_moe", "qwen3_moe"):
        step, only = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
        return [i for i in range(L) if i not in only and hf.get("num_experts", 0) > 0 and (i + 1) % step == 0]
    return []


def num_experts(hf: dict) -> int:
    return _get(hf, "n_routed_experts", "num_local_experts", "num_experts", default=0) if _moe_layers(hf) else 0


def _moe(hf: dict, h: int) -> list[Weights]:
    mt, E = hf["model_type"], num_experts(hf)
    width = hf["intermediate_size"] if mt == "mixtral" else hf["moe_intermediate_size"]
    w = [Weights("router", E * h, 1, "whole"), Weights("experts", 3 * h * width, E, "expert")]
    if mt in ("deepseek_v2", "deepseek_v3") and hf.get("n_shared_experts"):
        w += _mlp(hf, h, width * hf["n_shared_experts"], "shared_experts")
    if mt == "qwen2_moe":
        w += _mlp(hf, h, hf["shared_expert_intermediate_size"], "shared_expert")
        w.append(Weights("shared_expert_gate", h, 1, "whole"))
    return w


def _v4_layer_types(hf: dict) -> list[str]:
    """HF DeepseekV4Config's layer_types (its own default when the hf_config leaves them out: 2 x HCA, then CSA /
    HCA alternating)."""
    L = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types:
        return list(types[:L])
    csa, hca = "compressed_sparse_attention", "heavily_compressed_attention"
    return [hca] * min(L, 2) + [csa if i % 2 else hca for i in range(max(L - 2, 0))]


def _deepseek_v4(hf: dict) -> list[Weights]:
    """DeepseekV4ForCausalLM (modeling_deepseek_v4.py, transformers 5.23): every layer is an MoE layer with mHC; its
    attention has a low-rank q, one shared KV head, a grouped low-rank output and per-head sinks, plus a compressor
    (CSA: with the lightning indexer) on the compressed layers. The same count as MindFormers' PyNative model's
    trainable parameters without its MTP layer (tests/fixtures/deepseek4/counts.json)."""
    h, L, V, a = hf["hidden_size"], hf["num_hidden_layers"], hf["vocab_size"], hf["num_attention_heads"]
    d, ql, g, r = hf["head_dim"], hf["q_lora_rank"], hf["o_groups"], hf["o_lora_rank"]
    n, E, width = hf["hc_mult"], hf["n_routed_experts"], hf["moe_intermediate_size"]
    ih, idim = hf["index_n_heads"], hf["index_head_dim"]
    rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128, **(hf.get("compress_rates") or {})}
    types = _v4_layer_types(hf)
    mix = (2 + n) * n  # pre, post and comb weights of one hyper-connection
    out = [Weights("embed_tokens", V * h, 1, "whole"), Weights("norm", h, 1, "whole"),
           Weights("hc_head", n * n * h + n + 1, 1, "whole")]
    if not hf.get("tie_word_embeddings", False):
        out.append(Weights("lm_head", V * h, 1, "whole"))
    out += [
        Weights("moe.norms", h, 2 * L, "whole", "moe"),
        Weights("moe.attention", h * ql + ql + ql * a * d + h * d + d + a * d * r + g * r * h + a, L, "whole", "moe"),
        Weights("moe.hyper_connections", 2 * (mix * n * h + mix + 3), L, "whole", "moe"),
        Weights("moe.router", E * h, L, "whole", "moe"),
        Weights("moe.experts", 3 * h * width, E * L, "expert", "moe"),
        Weights("moe.shared_experts.proj", h * hf.get("mf_shared_expert_intermediate_size", width), 3 * L, "whole",
                "moe"),  # mf-ds builds a shared expert of its own width (translators/families/deepseek4.py)
    ]
    csa = types.count("compressed_sparse_attention")
    hca = types.count("heavily_compressed_attention")
    if csa:
        m = rates["compressed_sparse_attention"]
        out += [Weights("moe.csa_compressor", 2 * h * 2 * d + m * 2 * d + d, csa, "whole", "moe"),
                Weights("moe.csa_indexer", 2 * h * 2 * idim + m * 2 * idim + idim + ql * ih * idim + h * ih, csa,
                        "whole", "moe")]
    if hca:
        m = rates["heavily_compressed_attention"]
        out.append(Weights("moe.hca_compressor", 2 * h * d + m * d + d, hca, "whole", "moe"))
    return out


def activated(hf: dict) -> int:
    """Parameters one token computes with: everything but the routed experts it is not sent to."""
    weights = inventory(hf)
    k = with_defaults(hf).get("num_experts_per_tok", 1)
    total = 0
    for w in weights:
        if w.shard == "expert":
            layers = w.count // max(num_experts(with_defaults(hf)), 1)
            total += w.numel * k * layers
        else:
            total += w.numel * w.count
    return total


def _gpt2(hf: dict) -> list[Weights]:
    h, L, V = hf["n_embd"], hf["n_layer"], hf["vocab_size"]
    inner = hf.get("n_inner") or 4 * h
    per_layer = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * inner + inner) + (inner * h + h)
    return [Weights("wte", V * h, 1, "whole"), Weights("wpe", hf["n_positions"] * h, 1, "whole"),
            Weights("ln_f", 2 * h, 1, "whole"), Weights("dense.layer", per_layer, L, "whole", "dense")]


@dataclass(frozen=True)
class Degrees:
    """The degrees DeepSpeed runs (plan.parallel)."""

    world: int
    dp: int
    tp: int = 1
    cp: int = 1
    ep: int = 1

    @property
    def zero_dense(self) -> int:
        """ZeRO's shard degree for non-expert weights: the data-parallel ranks (Ulysses ranks count in it)."""
        return self.dp * self.cp

    @property
    def zero_expert(self) -> int:
        """The expert-data-parallel group: world / ep (TP lanes hold the same, unsplit experts)."""
        return self.world // self.ep


@dataclass
class States:
    """Model-state bytes on one rank."""

    params: float
    gradients: float
    master: float
    moments: float
    bucket: float          # the reduce bucket: backward only (ZeRO-1/2), the whole run (ZeRO-3)
    step_grads: float      # the fp32 gradient partition at the optimizer step
    gathered: float = 0.0  # ZeRO-3: whole parameters of the layer being computed and the one prefetched (estimate)
    local_params: int = 0  # parameters this rank computes with (after TP and EP)

    @property
    def persistent(self) -> float:
        return self.params + self.gradients + self.master + self.moments


def local_counts(weights: list[Weights], deg: Degrees) -> tuple[float, float]:
    """(dense, expert) parameters a rank computes with: TP splits 'tp' tensors, EP splits expert counts."""
    dense = sum(w.numel * w.count / (deg.tp if w.shard == "tp" else 1) for w in weights if w.shard != "expert")
    expert = sum(w.numel * w.count / deg.ep for w in weights if w.shard == "expert")
    return dense, expert


def model_states(weights: list[Weights], deg: Degrees, zero: dict, mixed: bool, dtype: str) -> States:
    stage = zero.get("stage", 0)
    e = DTYPE_BYTES[dtype] if mixed else 4
    dense, expert = local_counts(weights, deg)
    shard = dense / deg.zero_dense + expert / deg.zero_expert if stage >= 1 else dense + expert
    bucket = zero.get("reduce_bucket_size", REDUCE_BUCKET) * e if stage >= 1 else 0
    if stage >= 3:
        threshold = zero.get("stage3_param_persistence_threshold", PERSISTENCE_THRESHOLD)
        persistent = sum(w.numel * w.count / (deg.tp if w.shard == "tp" else 1)
                         for w in weights if w.shard != "expert" and w.numel / (deg.tp if w.shard == "tp" else 1)
                         < threshold)
        params = e * shard + e * persistent
        largest = max(sum(w.numel * w.count for w in weights if w.layer == kind) / n
                      for kind, n in _layer_counts(weights).items()) if _layer_counts(weights) else 0
        gathered = 2 * e * largest / deg.tp
    else:
        params, gathered = e * (dense + expert), 0.0
    if stage == 0:
        return States(params, e * (dense + expert), 0.0, 8 * (dense + expert), 0, 0, 0, int(dense + expert))
    return States(params, e * shard, 4 * shard, 8 * shard, bucket, 4 * shard, gathered, int(dense + expert))


def _layer_counts(weights: list[Weights]) -> dict[str, int]:
    """Decoder layers of each kind, read off the per-layer norms (two per layer)."""
    counts = {w.layer: w.count // 2 for w in weights if w.name.endswith(".norms")}
    if not counts:
        counts = {w.layer: w.count for w in weights if w.layer is not None}
    return counts


# --- activations -----------------------------------------------------------------------------------------------------

@dataclass
class Activations:
    peak: float                      # bytes on one rank, one micro batch
    kept: float                      # what the forward keeps for backward (the layers, before the loss)
    where: str                       # which moment is the peak
    per_layer_full: float            # one layer, nothing recomputed
    notes: list[str] = field(default_factory=list)


def _layer_bytes(hf: dict, moe: bool, e: int, tp: int) -> tuple[float, float]:
    """(bytes per token a layer keeps with nothing recomputed, its MLP width per rank) for the layer kind."""
    mt = hf["model_type"]
    h = hf.get("hidden_size") or hf["n_embd"]
    a = hf.get("num_attention_heads") or hf["n_head"]
    norms = 2 * (4 + e) * h
    if mt in ("deepseek_v2", "deepseek_v3"):
        nope, rope, v, ql, kvl = _mla(hf)
        ql = ql or 0
        attn = (e * 2 * h                              # q_a / kv_a input, the MLP input
                + (4 + 2 * e) * ql                     # q_a_layernorm (fp32 x, normalised), q_b_proj input
                + (4 + 2 * e) * kvl + e * rope         # kv_a_layernorm, kv_b_proj input, k_pe
                + e * a * (2 * (nope + rope) + 2 * v) / tp + 4 * a / tp)  # q, k, v, SDPA out (o_proj input), lse
    elif mt == "gpt2":
        attn = e * 2 * h + e * 5 * h / tp + 4 * a / tp
    else:
        k = hf.get("num_key_value_heads") or a
        d = hf.get("head_dim") or h // a
        attn = e * 2 * h + e * (2 * a * d + 2 * k * d) / tp + 4 * a / tp
        if mt in ("qwen3", "qwen3_moe"):
            attn += (4 + e) * (a + k) * d / tp  # q_norm / k_norm on each head
    if not moe:
        width = (hf.get("intermediate_size") or hf.get("n_inner") or 4 * h) / tp
        return norms + attn + 4 * e * width, width
    width = hf["intermediate_size"] if mt == "mixtral" else hf["moe_intermediate_size"]
    top_k = hf.get("num_experts_per_tok", 1)
    E = num_experts(hf)
    shared = width * hf.get("n_shared_experts", 0) if mt in ("deepseek_v2", "deepseek_v3") else \
        hf.get("shared_expert_intermediate_size", 0)
    # router scores (fp32, a few copies of T x E), each routed row: its input, gate/up/act/product, output
    router = 3 * 4 * E
    routed = top_k * (2 * e * h + 4 * e * width)
    return norms + attn + router + routed + 4 * e * shared / tp, max(width, shared / tp)


def activations(plan: Plan, deg: Degrees, micro: int, seq: int, dtype: str) -> Activations:
    """Peak activation bytes of one micro batch (forward + backward) on one rank under the Plan's recompute."""
    hf = with_defaults(dict(plan.hf_config))
    e = DTYPE_BYTES[dtype]
    T = micro * seq / deg.cp
    h = hf.get("hidden_size") or hf["n_embd"]
    V = hf["vocab_size"]
    moe_layers = set(_moe_layers(hf))
    notes = []
    if hf["model_type"] == "gpt2":
        notes.append("GPT-2: counted as a pre-norm layer of the same widths (LayerNorm, GELU MLP, dropout masks "
                     "not counted separately; not measured)")
    if hf["model_type"] == "deepseek_v4":
        notes.append("DeepSeek-V4: counted as one-KV-head attention of its widths with its MoE; not counted: the "
                     f"{hf.get('hc_mult', 4)} mHC streams a layer keeps (fp32 copies), the compressors, and the "
                     "attention probabilities of its eager-only attention (heads x seq x (seq + compressed) per "
                     "layer); not measured")
    if moe_layers:
        notes.append("MoE layers: top_k routed rows per token, none dropped (tiny DeepSeek-V3 on CPU: 5% under "
                     "the measured peak)")
    kept, full = [], []
    by_index = {entry.index: entry for entry in plan.layers if not entry.mtp}
    L = hf.get("num_hidden_layers") or hf["n_layer"]
    unmodelled = set()
    for i in range(L):
        whole, width = _layer_bytes(hf, i in moe_layers, e, deg.tp)
        entry = by_index.get(i, Layer(i))
        if entry.full_recompute:
            keep = e * h
        else:
            keep = whole
            ops = set(entry.select_recompute) | set(entry.comm_recompute)
            mlp_ops = {op.rpartition(".")[2] for op in ops if op.startswith("mlp.")} if i not in moe_layers else set()
            keep -= e * width * (len(mlp_ops & {"act_fn", "mul", "gate_proj", "up_proj"}))
            for op in ops:
                if op.endswith("layernorm") or op.endswith("norm"):
                    keep -= 4 * h
                elif not op.startswith("mlp.") or i in moe_layers:
                    unmodelled.add(op)
        kept.append(keep * T)
        full.append(whole * T)
    if unmodelled:
        notes.append(f"select recompute of {', '.join(sorted(unmodelled))}: not modelled (counted as kept)")
    final = ((4 + e) * h + e * h) * T
    logits = e * V * T
    work = (12 + e) * h * T
    moments = {"loss": sum(kept) + final + (12 + e) * V * T,
               "backward of the final norm": sum(kept) + final + work + logits}
    below = 0.0
    for i in range(L):
        moments[f"backward of layer {i}"] = below + full[i] + work + logits
        below += kept[i]
    where = max(moments, key=moments.get)
    return Activations(moments[where], sum(kept) + final, where, full[-1] if full else 0.0, notes)


# --- the verdict -----------------------------------------------------------------------------------------------------

def parse_size(text: str) -> float:
    """'80GiB', '80GB', '141G', '80' (GiB) -> bytes."""
    units = {"": GiB, "g": GiB, "gib": GiB, "gb": 1e9, "t": 2**40, "tib": 2**40, "tb": 1e12, "m": 2**20,
             "mib": 2**20, "mb": 1e6}
    s = text.strip().lower().replace(" ", "")
    number = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in units or not value > 0 or not math.isfinite(value):
        raise ConfigError("--gpu-memory", f"expected a size such as 80GiB or 141GB, got {text!r}")
    return value * units[unit]
