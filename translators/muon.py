"""`optimizer: type: Muon`: MindFormers' keys, defaults and refusals, and what mf-ds runs (mf_ds/muon.py).

Two Muon classes answer to the name (sources: mindformers 2.0.0 / 2.1.0 wheels):
  graph mode   core/optim/muon.py `Muon(params, learning_rate=2e-2, weight_decay=0.1, matched_adamw_rms=0.2,
               momentum=0.95, nesterov=True, ns_steps=5, adamw_betas=(0.95, 0.95), adamw_eps=1e-8,
               qk_clip_threshold=100, model=None, **kwargs)`: every other key lands in **kwargs, unused (swap: True
               raises). Its construct always ends in model.apply_qk_clip_scaling, which reads each attention's
               max_logits_val (a parameter only model_config.track_max_attention_logit creates).
  PyNative     pynative/optimizer/muon.py (2.1.0) adds eps=1e-7, ns_coefficients=(3.4445, -4.7750, 2.0315) or a
               segmented [[[a, b, c], count], ...] schedule, qk_clip_enabled=True, comm_strategy="allgather",
               use_fused_adamw=False, adamw_include=None, phase0/ns/phase4_batch_memory_gb (1, 1, 4).
Both refuse a model without multi-latent attention ("Current Muon implementation only supports models with
Multi-Latent Attention enabled.") and a legacy one ("Muon does not support Legacy Model.").

What mf-ds runs: the PyNative arithmetic on one card (mf_ds/muon.py), and QK-clip (qk_clip_enabled, default on)
with the max-logit statistic it needs (mf_ds/qk_clip.py): per MLA head, the step's max of scale * q k^T over its
micro batches and the data-parallel ranks; after the update q / kv_b rows scaled by sqrt(gamma) / gamma, gamma =
min(1, qk_clip_threshold / max_logit). Only MindFormers' FlashAttention core tracks the statistic: DeepSeek-V3's MLA
does, DeepSeek-V4's CompressedSparseAttention (experimental_attention_variant dsv4_hybrid) and DSA do not, so there
MindFormers' clip scales nothing, and neither does mf-ds. Under context parallelism (Ulysses hands the attention a
head shard) mf-ds does not compute the statistic: QK-clip is refused there. Muon needs each weight whole: at ZeRO
stage 0 each rank updates whole weights; at ZeRO-1/2/3 DeepSpeed's own ZeRO Muon gathers each Muon weight's full
gradient and calls its muon_update, which mf_ds/muon_zero.py points at MindFormers' update (the weights equal stage
0's: tests/mf_ds/test_muon_zero.py). Two things differ there: DeepSpeed measures and clips the gradient norm after
the Muon update replaced the gradient (MindFormers clips the raw gradients first), and QK-clip, which scales rows of
whole fp32 weights, is refused under ZeRO 1-3. ZeRO-3 runs Muon only without reduce_scatter (stage3.py refuses the
two together): `zero_block` turns it off. AutoTP shards the weights: Muon is refused under tensor parallelism.

Graph-mode Muon (a graph-mode YAML naming Muon) is another update, which mf-ds runs as well (`mode: graph` in
mf_ds/muon.py): its Newton-Schulz in bf16 op by op with the fixed triple x 5 whatever ns_steps says, one lr scale
from the last piece, and QK-clip every step at qk_clip_threshold (no switch: qk_clip_enabled is not one of its
arguments). It takes no eps, ns_coefficients or adamw_include (its filter is the default globs'), and ignores them.
"""

from __future__ import annotations

import math
from typing import Any

from translators.errors import ConfigError
from translators.notes import Ledger

PYNATIVE_DEFAULTS: dict[str, Any] = {
    "learning_rate": 2e-2, "weight_decay": 0.1, "matched_adamw_rms": 0.2, "momentum": 0.95, "eps": 1e-7,
    "nesterov": True, "ns_steps": 5, "ns_coefficients": [3.4445, -4.7750, 2.0315], "adamw_betas": [0.95, 0.95],
    "adamw_eps": 1e-8, "qk_clip_enabled": True, "qk_clip_threshold": 100, "comm_strategy": "allgather",
    "use_fused_adamw": False, "adamw_include": None, "phase0_batch_memory_gb": 1, "ns_batch_memory_gb": 1,
    "phase4_batch_memory_gb": 4, "swap": False,
}
GRAPH_DEFAULTS: dict[str, Any] = {
    "learning_rate": 2e-2, "weight_decay": 0.1, "matched_adamw_rms": 0.2, "momentum": 0.95, "nesterov": True,
    "ns_steps": 5, "adamw_betas": [0.95, 0.95], "adamw_eps": 1e-8, "qk_clip_threshold": 100, "swap": False,
}
GRAPH_TRIPLE = [3.4445, -4.7750, 2.0315]  # zeropower_via_newtonschulz5_2d / _3d, 5 steps
ADAMW_INCLUDE = ["*word_embeddings*", "*output_layer*"]  # Muon._build_muon_filter's default
_MAPPED = ("type", "weight_decay", "matched_adamw_rms", "momentum", "eps", "nesterov", "ns_steps", "ns_coefficients",
           "adamw_betas", "adamw_eps", "adamw_include")
UNTRACKED = {"dsv4_hybrid": "DeepSeek-V4's CompressedSparseAttention", "dsa": "DSA's DSAttention"}
_DROPPED = {
    "comm_strategy": "how MindFormers spreads Newton-Schulz over ranks (allgather / one owner per weight): the same "
                     "arithmetic; mf-ds runs it on every rank",
    "phase0_batch_memory_gb": "memory budget of MindFormers' batched Muon phases on the NPU: no arithmetic",
    "ns_batch_memory_gb": "memory budget of MindFormers' batched Muon phases on the NPU: no arithmetic",
    "phase4_batch_memory_gb": "memory budget of MindFormers' batched Muon phases on the NPU: no arithmetic",
    "swap": "False: nothing swapped (Muon refuses swap: True)",
}


def _number(section: dict, key: str, low: float | None = None) -> float:
    value = section[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"optimizer.{key}", f"expected a number, got {value!r}")
    if low is not None and value <= low:
        raise ConfigError(f"optimizer.{key}", f"must be > {low:g}, got {value!r}")
    return float(value)


# More Newton-Schulz steps than this is a typo, not a schedule (MindFormers' YAMLs use 5 to 10).
MAX_NS_STEPS = 100


def schedule(coefficients: Any, ns_steps: Any) -> list[list[float]]:
    """Muon._normalize_ns_schedule and _verify_config, with MindFormers' refusals (its words)."""
    path = "optimizer.ns_coefficients"
    if not isinstance(coefficients, (list, tuple)) or not coefficients:
        raise ConfigError(path, f"ns_coefficients must be a non-empty list/tuple, got {coefficients!r}.")
    first = coefficients[0]
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        if len(coefficients) != 3 or not all(isinstance(v, (int, float)) for v in coefficients):
            raise ConfigError(path, f"flat ns_coefficients must have 3 elements, got {coefficients!r}.")
        if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or ns_steps <= 0:
            raise ConfigError("optimizer.ns_steps", f"ns_steps must be positive, got {ns_steps!r}.")
        _finite(coefficients, path)
        if ns_steps > MAX_NS_STEPS:  # checked before the list is built: 1e9 steps would fill memory first
            raise ConfigError("optimizer.ns_steps", f"{ns_steps} Newton-Schulz steps: more than {MAX_NS_STEPS} is "
                              "a typo, not a schedule")
        return [[float(v) for v in coefficients] for _ in range(ns_steps)]
    out: list[list[float]] = []
    for i, segment in enumerate(coefficients):
        if not isinstance(segment, (list, tuple)) or len(segment) != 2:
            raise ConfigError(path, f"segmented ns_coefficients entry {i} must be [[a, b, c], count], got "
                              f"{segment!r}.")
        triple, count = segment
        if not isinstance(triple, (list, tuple)) or len(triple) != 3 or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in triple):
            raise ConfigError(path, f"segmented ns_coefficients entry {i} must hold a 3-element triple, got "
                              f"{triple!r}.")
        _finite(triple, f"{path}[{i}][0]")
        if isinstance(count, bool) or not isinstance(count, (int, float)) or not math.isfinite(count) or \
                int(count) <= 0:
            raise ConfigError(path, f"segmented ns_coefficients entry {i} count must be positive, got {count!r}.")
        if len(out) + int(count) > MAX_NS_STEPS:  # before extending: a count of 1e9 would fill memory first
            raise ConfigError(path, f"segmented ns_coefficients entry {i} count {count!r} makes more than "
                              f"{MAX_NS_STEPS} Newton-Schulz steps: a typo, not a schedule")
        out.extend([float(v) for v in triple] for _ in range(int(count)))
    return out


def _finite(triple: Any, path: str) -> None:
    """An inf or NaN coefficient turns every Muon update into NaN (MindFormers checks only the shape)."""
    if not all(math.isfinite(v) for v in triple):
        raise ConfigError(path, f"Newton-Schulz coefficients must be finite numbers, got {list(triple)!r}")


def zero_block(zero: dict[str, Any]) -> dict[str, Any]:
    """The ZeRO block Muon runs under: stage 3 without reduce_scatter (DeepSpeed's stage3.py: "Muon and reduce
    scatter cannot be used together")."""
    return {**zero, "reduce_scatter": False} if zero.get("stage") == 3 else zero


def plan(section: dict, lr: float, *, zero_stage: int, mla: bool, mcore: bool, pynative: bool,
         ledger: Ledger, attention_variant: str | None = None, context_parallel: int = 1,
         tensor_parallel: int = 1, clipping: float = 0.0, expert_parallel: int = 1,
         mixed: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """DeepSpeed's optimizer block and run.optimizer for a Muon section; every key accounted for in `ledger`.
    attention_variant: the model's experimental_attention_variant (dsv4_hybrid, dsa: no max-logit statistic);
    clipping: the run's gradient clipping (under ZeRO 1-3 DeepSpeed applies it to the Muon update); mixed: bf16 /
    fp16 compute (at ZeRO stage 0 DeepSpeed's bf16 / fp16 optimizer hands Muon flat fp32 copies: refused)."""
    s, clip, threshold = _refusals(section, zero_stage=zero_stage, mla=mla, mcore=mcore, pynative=pynative,
                                   attention_variant=attention_variant, context_parallel=context_parallel,
                                   tensor_parallel=tensor_parallel, expert_parallel=expert_parallel, mixed=mixed)
    include, ns_schedule, eps = _arithmetic(s, pynative)
    betas = s["adamw_betas"]
    if not isinstance(betas, (list, tuple)) or len(betas) != 2 or not all(
            isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in betas):
        raise ConfigError("optimizer.adamw_betas", f"expected two numbers in [0, 1), got {betas!r}")
    if not isinstance(s["nesterov"], bool):
        raise ConfigError("optimizer.nesterov", f"expected true or false, got {s['nesterov']!r}")
    run = {"type": "Muon", "torch": "Muon", "lr": lr, "weight_decay": _number(s, "weight_decay"),
           "matched_adamw_rms": _number(s, "matched_adamw_rms"), "momentum": _number(s, "momentum"),
           "nesterov": s["nesterov"], "ns_schedule": ns_schedule, "eps": eps,
           "adamw_betas": [float(b) for b in betas], "adamw_eps": _number(s, "adamw_eps", 0),
           "adamw_include": list(include), "bias_correction": True,
           "weight_decay_on": "Muon weights and AdamW parameters with ndim > 1 that are not biases",
           "mode": "pynative" if pynative else "graph", "qk_clip_threshold": threshold if clip else None}
    _account(section, s, run, clip, threshold, attention_variant, pynative, zero_stage, clipping, mixed, ledger)
    ds = {"type": "Muon", "params": {"lr": lr, "momentum": run["momentum"], "weight_decay": run["weight_decay"]}}
    return ds, run


def _refusals(section: dict, *, zero_stage: int, mla: bool, mcore: bool, pynative: bool,
              attention_variant: str | None, context_parallel: int, tensor_parallel: int, expert_parallel: int,
              mixed: bool) -> tuple[dict, bool, float]:
    """What MindFormers' Muon stops on, and what mf-ds cannot run; the section with its defaults, whether QK-clip
    runs, its threshold."""
    if not mcore:
        raise ConfigError("optimizer.type", "Muon: MindFormers stops with \"Muon does not support Legacy Model.\"")
    if not mla:
        raise ConfigError("optimizer.type", "Muon: MindFormers stops with \"Current Muon implementation only supports "
                          "models with Multi-Latent Attention enabled.\"")
    s = {**(PYNATIVE_DEFAULTS if pynative else GRAPH_DEFAULTS), **section}
    if s["swap"]:
        raise ConfigError("optimizer.swap", "Muon: MindFormers stops with \"Muon does not support swap.\"")
    threshold = _number(s, "qk_clip_threshold")
    if pynative:
        if not isinstance(s["qk_clip_enabled"], bool):
            raise ConfigError("optimizer.qk_clip_enabled", f"expected true or false, got {s['qk_clip_enabled']!r}")
        if s["qk_clip_enabled"] and threshold <= 0:
            raise ConfigError("optimizer.qk_clip_threshold", f"qk_clip_threshold must be positive, got "
                              f"{s['qk_clip_threshold']!r}.")
        clip = s["qk_clip_enabled"] and attention_variant not in UNTRACKED
    else:
        if threshold <= 0:
            raise ConfigError("optimizer.qk_clip_threshold", f"{s['qk_clip_threshold']!r}: graph-mode Muon clips "
                              "every step, and MindFormers does not check the threshold: at or below 0 it would zero "
                              "or flip the q / k weights; mf-ds refuses it")
        clip = attention_variant not in UNTRACKED
    if clip and context_parallel > 1:
        raise ConfigError("optimizer.qk_clip_enabled" if pynative else "optimizer.type",
                          f"QK-clip under context parallelism ({context_parallel}): Ulysses hands the attention a head "
                          "shard, for which mf-ds does not compute the max-logit statistic; "
                          + ("set qk_clip_enabled: false or run without context parallelism" if pynative else
                             "graph-mode Muon always clips: run without context parallelism"))
    if tensor_parallel > 1:
        raise ConfigError("optimizer.type", f"Muon needs each weight whole and tensor parallelism "
                          f"({tensor_parallel}) shards them (MindFormers all-gathers them for Newton-Schulz); run "
                          "Muon without tensor parallelism")
    if mixed and not zero_stage:
        raise ConfigError("optimizer.type", "Muon in bf16 / fp16 at ZeRO stage 0: DeepSpeed's bf16 / fp16 optimizer "
                          "hands the optimizer flat fp32 copies, which no ZeRO Muon has orthogonalized; run it under "
                          "ZeRO 1-3 (not mf_ds.zero_stage: 0) or in float32")
    if zero_stage and expert_parallel > 1:
        raise ConfigError("optimizer.type", f"Muon under ZeRO-{zero_stage} with expert parallelism "
                          f"({expert_parallel}): DeepSpeed's ZeRO-1/2 need the expert shards in their own parameter "
                          "groups, which mf-ds' Muon groups are not; run Muon beside expert parallelism in float32 "
                          "(ZeRO stage 0) or without expert parallelism")
    if clip and zero_stage:
        raise ConfigError("optimizer.qk_clip_enabled" if pynative else "optimizer.type",
                          f"QK-clip under ZeRO-{zero_stage}: it scales rows of whole fp32 weights after the step, and "
                          "ZeRO partitions them flat; mf-ds clips at ZeRO stage 0 only: "
                          + ("set qk_clip_enabled: false or run at ZeRO stage 0 (mf_ds.zero_stage: 0)" if pynative
                             else "graph-mode Muon always clips: run at ZeRO stage 0 (mf_ds.zero_stage: 0)"))
    return s, clip, threshold


def _arithmetic(s: dict, pynative: bool) -> tuple[list, list, float]:
    """The AdamW include patterns, the Newton-Schulz schedule and eps of the mode's update."""
    if pynative:
        if s["comm_strategy"] not in ("allgather", "allgather_deredundency"):
            raise ConfigError("optimizer.comm_strategy", f"comm_strategy must be 'allgather' or "
                              f"'allgather_deredundency', got {s['comm_strategy']!r}.")
        for key in ("phase0_batch_memory_gb", "ns_batch_memory_gb", "phase4_batch_memory_gb"):
            _number(s, key, 0)
        include = ADAMW_INCLUDE if s["adamw_include"] is None else s["adamw_include"]
        include = [include] if isinstance(include, str) else include
        if not isinstance(include, list) or not all(isinstance(p, str) for p in include):
            raise ConfigError("optimizer.adamw_include", "adamw_include must be a list of glob strings.")
        ns_schedule, eps = schedule(s["ns_coefficients"], s["ns_steps"]), _number(s, "eps", 0)
    else:
        include, ns_schedule, eps = ADAMW_INCLUDE, [list(GRAPH_TRIPLE) for _ in range(5)], 1e-7
    return include, ns_schedule, eps


def _account(section: dict, s: dict, run: dict, clip: bool, threshold: float, attention_variant: str | None,
             pynative: bool, zero_stage: int, clipping: float, mixed: bool, ledger: Ledger) -> None:
    """Every key of the Muon section in the ledger."""
    source = "MindFormers 2.1.0 PyNative arithmetic" if pynative else \
        "MindFormers' graph-mode arithmetic, core/optim/muon.py: bf16 Newton-Schulz op by op, last piece's lr scale"
    summary = (f"mf_ds.muon.Muon ({source}): {len(run['ns_schedule'])} Newton-Schulz "
               f"steps, matched_adamw_rms {run['matched_adamw_rms']}, momentum {run['momentum']}, nesterov "
               f"{run['nesterov']}, AdamW betas {run['adamw_betas']} eps {run['adamw_eps']}, AdamW for "
               f"{run['adamw_include']}")
    for key in _MAPPED if pynative else ("weight_decay", "matched_adamw_rms", "momentum", "nesterov", "adamw_betas",
                                         "adamw_eps"):
        if ledger.present(f"optimizer.{key}"):
            ledger.mapped(f"optimizer.{key}", summary)
    _account_clip(s, clip, threshold, attention_variant, pynative, ledger)
    if ledger.present("optimizer.learning_rate"):
        ledger.dropped("optimizer.learning_rate", "lr_schedule's learning rate is used, as in MindFormers")
    for key, why in _DROPPED.items():
        if ledger.present(f"optimizer.{key}") and (pynative or key == "swap"):
            ledger.dropped(f"optimizer.{key}", why)
    if pynative and ledger.present("optimizer.use_fused_adamw"):
        ledger.differs("optimizer.use_fused_adamw", "MindFormers' fused AdamW kernel (gen.AdamW, not bit-identical "
                       "by its own comment); mf-ds runs the unfused _run_adamw_opt arithmetic" if s["use_fused_adamw"]
                       else "false: the unfused _run_adamw_opt arithmetic, which mf-ds runs")
    if not pynative and ledger.present("optimizer.ns_steps"):
        ledger.dropped("optimizer.ns_steps", "graph-mode Muon runs 5 Newton-Schulz steps of (3.4445, -4.7750, "
                       "2.0315) whatever ns_steps says (zeropower_via_newtonschulz5_2d / _3d)")
    known = PYNATIVE_DEFAULTS if pynative else GRAPH_DEFAULTS
    for key in section:
        if key not in known and key != "type":
            ledger.dropped(f"optimizer.{key}", "graph-mode Muon has no switch: it clips every step (not one of its "
                           "arguments: **kwargs, ignored)" if key == "qk_clip_enabled" and not pynative else
                           "not a Muon argument: MindFormers' Muon takes it in **kwargs and ignores it")
    zero_note = ""
    if zero_stage:
        zero_note = (f"; under ZeRO-{zero_stage} DeepSpeed gathers each Muon weight's full gradient and mf_ds/"
                     "muon_zero.py gives it MindFormers' update (the weights of ZeRO stage 0), but DeepSpeed measures "
                     "the gradient norm after that update replaced the Muon weights' gradients: the norm it reports "
                     "covers their updates and the AdamW parameters' gradients")
        if clipping:
            zero_note += (f", and it clips at {clipping:g} by that norm, the updates included (MindFormers clips the "
                          "raw gradients before Muon)")
        if mixed:
            zero_note += ("; in bf16 / fp16 DeepSpeed holds Muon's momentum in the gradient dtype (ZeRO-1/2) or the "
                          "communication dtype (ZeRO-3), not in fp32 as MindFormers' muon_m")
    ledger.differs("optimizer.type", "Muon: mf-train and mf_ds.hf run MindFormers' update (mf_ds/muon.py); the "
                   "DeepSpeed JSON alone names DeepSpeed's Muon, which is not it (one triple, EMA momentum, no "
                   "per-head split)" + zero_note)


def _account_clip(s: dict, clip: bool, threshold: float, attention_variant: str | None, pynative: bool,
                  ledger: Ledger) -> None:
    keys = ("qk_clip_enabled", "qk_clip_threshold") if pynative else ("qk_clip_threshold",)
    if clip:
        why = (f"run.optimizer.qk_clip_threshold = {threshold:g}: after each step, per MLA head, q nope rows x "
               "sqrt(gamma), q rope rows x gamma, kv_b k_nope rows x sqrt(gamma), gamma = min(1, threshold / the "
               "step's max attention logit over micro batches and ranks) (mf_ds/qk_clip.py)")
        for key in keys:
            if ledger.present(f"optimizer.{key}"):
                ledger.runtime(f"optimizer.{key}", why)
    elif not pynative or s["qk_clip_enabled"]:
        why = (f"MindFormers' QK-clip scales nothing here: {UNTRACKED[attention_variant]} keeps no max_logits_val "
               "(only its FlashAttention core does), so apply_qk_clip_scaling finds no layer; neither does mf-ds")
        for key in keys:
            if ledger.present(f"optimizer.{key}"):
                ledger.dropped(f"optimizer.{key}", why)
    else:
        if ledger.present("optimizer.qk_clip_enabled"):
            ledger.mapped("optimizer.qk_clip_enabled", "false: no QK-clip")
        if ledger.present("optimizer.qk_clip_threshold"):
            ledger.dropped("optimizer.qk_clip_threshold", "unused: qk_clip_enabled is false")
