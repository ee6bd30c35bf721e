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


def _family_hook(hf: dict, name: str):
    """The memory hook `name` of the family module of hf's model_type (translators/families/<family>.py), or None:
    the formulas here are the default, a family's hook its own count."""
    from translators.families import registry

    return registry.hook(registry.by_hf_type(hf["model_type"]), name)


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
    own = _family_hook(hf, "memory_inventory")  # a model of its own layout (GPT-2, DeepSeek-V4)
    if own is not None:
        return own(hf)
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
    own = _family_hook(hf, "memory_attention")  # its biases, q/k norms, or MLA
    return own(hf, h, a, k, d) if own is not None else dense_attention(h, a, k, d, bool(hf.get("attention_bias")))


def dense_attention(h: int, a: int, k: int, d: int, qkv_bias: bool, o_bias: bool = False,
                    qk_norm: bool = False) -> list[Weights]:
    """q, k, v and o projections of a + 2k heads of width d (their biases), and per-head q / k norms."""
    w = [Weights("q_proj", (h + qkv_bias) * a * d, 1, "tp"), Weights("kv_proj", (h + qkv_bias) * k * d, 2, "tp"),
         Weights("o_proj", a * d * h + o_bias * h, 1, "tp")]
    if qk_norm:
        w.append(Weights("qk_norm", d, 2, "whole"))
    return w


def _mla(hf: dict) -> tuple:
    """(qk_nope, qk_rope, v head dims, q_lora_rank, kv_lora_rank)."""
    return hf["qk_nope_head_dim"], hf["qk_rope_head_dim"], hf["v_head_dim"], hf["q_lora_rank"], hf["kv_lora_rank"]


def _mlp(hf: dict, h: int, width: int, name: str = "mlp") -> list[Weights]:
    return [Weights(f"{name}.proj", h * width, 3, "tp")]


def _moe_layers(hf: dict) -> list[int]:
    own = _family_hook(hf, "memory_moe_layers")  # which decoder layers are MoE (none without the hook)
    return own(hf) if own is not None else []


def sparse_step_layers(hf: dict) -> list[int]:
    """Qwen2-MoE's and Qwen3-MoE's MoE layers: every decoder_sparse_step-th, but mlp_only_layers."""
    L = hf.get("num_hidden_layers")
    step, only = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
    return [i for i in range(L) if i not in only and hf.get("num_experts", 0) > 0 and (i + 1) % step == 0]


def num_experts(hf: dict) -> int:
    return _get(hf, "n_routed_experts", "num_local_experts", "num_experts", default=0) if _moe_layers(hf) else 0


def _moe(hf: dict, h: int) -> list[Weights]:
    E = num_experts(hf)
    width = _routed_width(hf)
    w = [Weights("router", E * h, 1, "whole"), Weights("experts", 3 * h * width, E, "expert")]
    own = _family_hook(hf, "memory_shared_experts")  # the shared experts' tensors (none without the hook)
    return w + own(hf, h, width) if own is not None else w


def _routed_width(hf: dict) -> int:
    own = _family_hook(hf, "memory_routed_width")  # Mixtral's experts are intermediate_size wide
    return own(hf) if own is not None else hf["moe_intermediate_size"]


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


def dense_attention_bytes(hf: dict, e: int, tp: int, h: int, a: int) -> float:
    """Bytes per token a + 2k-head attention keeps: its input, q, k, v, SDPA out, lse."""
    k = hf.get("num_key_value_heads") or a
    d = hf.get("head_dim") or h // a
    return e * 2 * h + e * (2 * a * d + 2 * k * d) / tp + 4 * a / tp


def _layer_bytes(hf: dict, moe: bool, e: int, tp: int) -> tuple[float, float]:
    """(bytes per token a layer keeps with nothing recomputed, its MLP width per rank) for the layer kind."""
    h = hf.get("hidden_size") or hf["n_embd"]
    a = hf.get("num_attention_heads") or hf["n_head"]
    norms = 2 * (4 + e) * h
    own = _family_hook(hf, "memory_attention_bytes")  # MLA, GPT-2's, q/k norms
    attn = own(hf, e, tp, h, a) if own is not None else dense_attention_bytes(hf, e, tp, h, a)
    if not moe:
        width = (hf.get("intermediate_size") or hf.get("n_inner") or 4 * h) / tp
        return norms + attn + 4 * e * width, width
    width = _routed_width(hf)
    top_k = hf.get("num_experts_per_tok", 1)
    E = num_experts(hf)
    own = _family_hook(hf, "memory_shared_width")  # DeepSeek's: n_shared_experts routed widths
    shared = own(hf, width) if own is not None else hf.get("shared_expert_intermediate_size", 0)
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
    own = _family_hook(hf, "memory_note")  # what the formulas leave out of the family's model
    if own is not None:
        notes.append(own(hf))
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
