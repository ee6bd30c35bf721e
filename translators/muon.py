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

What mf-ds runs: the PyNative arithmetic on one card (mf_ds/muon.py), with the statistic QK-clip needs missing:
mf-ds's attention does not track each head's max logit, so QK-clip is refused (qk_clip_enabled: false runs the rest
exactly), and with it graph-mode Muon, whose clip has no switch. Muon needs each weight whole: DeepSpeed's ZeRO-1/2/3
optimizers hand a client optimizer flat partitions (and ZeRO-1/2's own Muon, `use_muon` parameters, is DeepSpeed's
update: one coefficient triple, EMA momentum, no per-head split), so only ZeRO stage 0 runs it (data parallel
gradients are still averaged over ranks, each rank then updates whole weights).
"""

from __future__ import annotations

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
ADAMW_INCLUDE = ["*word_embeddings*", "*output_layer*"]  # Muon._build_muon_filter's default
_MAPPED = ("type", "weight_decay", "matched_adamw_rms", "momentum", "eps", "nesterov", "ns_steps", "ns_coefficients",
           "adamw_betas", "adamw_eps", "adamw_include", "qk_clip_enabled")
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
        if isinstance(count, bool) or not isinstance(count, (int, float)) or int(count) <= 0:
            raise ConfigError(path, f"segmented ns_coefficients entry {i} count must be positive, got {count!r}.")
        out.extend([float(v) for v in triple] for _ in range(int(count)))
    if len(out) > 100:
        raise ConfigError(path, f"{len(out)} Newton-Schulz steps: more than 100 is a typo, not a schedule")
    return out


def plan(section: dict, lr: float, *, zero_stage: int, mla: bool, mcore: bool, pynative: bool,
         ledger: Ledger) -> tuple[dict[str, Any], dict[str, Any]]:
    """DeepSpeed's optimizer block and run.optimizer for a Muon section; every key accounted for in `ledger`."""
    if not mcore:
        raise ConfigError("optimizer.type", "Muon: MindFormers stops with \"Muon does not support Legacy Model.\"")
    if not mla:
        raise ConfigError("optimizer.type", "Muon: MindFormers stops with \"Current Muon implementation only supports "
                          "models with Multi-Latent Attention enabled.\"")
    if not pynative:
        raise ConfigError("optimizer.type", "graph-mode Muon (mindformers/core/optim/muon.py) applies QK-clip every "
                          "step (apply_qk_clip_scaling, no switch) from each head's max attention logit, which mf-ds's "
                          "attention does not track; mf-ds runs the PyNative Muon with qk_clip_enabled: false")
    s = {**PYNATIVE_DEFAULTS, **section}
    if s["swap"]:
        raise ConfigError("optimizer.swap", "Muon: MindFormers stops with \"Muon does not support swap.\"")
    if s["qk_clip_enabled"] is not False:
        raise ConfigError("optimizer.qk_clip_enabled", "QK-clip scales q/k by each head's max attention logit, which "
                          "mf-ds's attention does not track; set qk_clip_enabled: false to run the rest of Muon as "
                          "MindFormers computes it")
    if zero_stage:
        raise ConfigError("optimizer.type", f"Muon needs whole weights and ZeRO-{zero_stage} gives the optimizer flat "
                          "partitions (DeepSpeed's own ZeRO Muon is not MindFormers' update); run with ZeRO stage 0: "
                          "no parallel.enable_parallel_optimizer, float32 parameters or compute, mf_ds.zero_stage: 0")
    if s["comm_strategy"] not in ("allgather", "allgather_deredundency"):
        raise ConfigError("optimizer.comm_strategy", f"comm_strategy must be 'allgather' or 'allgather_deredundency', "
                          f"got {s['comm_strategy']!r}.")
    for key in ("phase0_batch_memory_gb", "ns_batch_memory_gb", "phase4_batch_memory_gb"):
        _number(s, key, 0)
    include = ADAMW_INCLUDE if s["adamw_include"] is None else s["adamw_include"]
    include = [include] if isinstance(include, str) else include
    if not isinstance(include, list) or not all(isinstance(p, str) for p in include):
        raise ConfigError("optimizer.adamw_include", "adamw_include must be a list of glob strings.")
    betas = s["adamw_betas"]
    if not isinstance(betas, (list, tuple)) or len(betas) != 2 or not all(
            isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in betas):
        raise ConfigError("optimizer.adamw_betas", f"expected two numbers in [0, 1), got {betas!r}")
    if not isinstance(s["nesterov"], bool):
        raise ConfigError("optimizer.nesterov", f"expected true or false, got {s['nesterov']!r}")
    run = {"type": "Muon", "torch": "Muon", "lr": lr, "weight_decay": _number(s, "weight_decay"),
           "matched_adamw_rms": _number(s, "matched_adamw_rms"), "momentum": _number(s, "momentum"),
           "nesterov": s["nesterov"], "ns_schedule": schedule(s["ns_coefficients"], s["ns_steps"]),
           "eps": _number(s, "eps", 0), "adamw_betas": [float(b) for b in betas],
           "adamw_eps": _number(s, "adamw_eps", 0), "adamw_include": list(include), "bias_correction": True,
           "weight_decay_on": "Muon weights and AdamW parameters with ndim > 1 that are not biases"}
    summary = (f"mf_ds.muon.Muon (MindFormers 2.1.0 PyNative arithmetic): {len(run['ns_schedule'])} Newton-Schulz "
               f"steps, matched_adamw_rms {run['matched_adamw_rms']}, momentum {run['momentum']}, nesterov "
               f"{run['nesterov']}, AdamW betas {run['adamw_betas']} eps {run['adamw_eps']}, AdamW for "
               f"{run['adamw_include']}")
    for key in _MAPPED:
        if ledger.present(f"optimizer.{key}"):
            ledger.mapped(f"optimizer.{key}", summary)
    if ledger.present("optimizer.qk_clip_threshold"):
        ledger.dropped("optimizer.qk_clip_threshold", "unused: qk_clip_enabled is false")
    if ledger.present("optimizer.learning_rate"):
        ledger.dropped("optimizer.learning_rate", "lr_schedule's learning rate is used, as in MindFormers")
    for key, why in _DROPPED.items():
        if ledger.present(f"optimizer.{key}"):
            ledger.dropped(f"optimizer.{key}", why)
    if ledger.present("optimizer.use_fused_adamw"):
        ledger.differs("optimizer.use_fused_adamw", "MindFormers' fused AdamW kernel (gen.AdamW, not bit-identical "
                       "by its own comment); mf-ds runs the unfused _run_adamw_opt arithmetic" if s["use_fused_adamw"]
                       else "false: the unfused _run_adamw_opt arithmetic, which mf-ds runs")
    for key in section:
        if key not in PYNATIVE_DEFAULTS and key != "type":
            ledger.dropped(f"optimizer.{key}", "not a Muon argument: MindFormers' Muon takes it in **kwargs and "
                           "ignores it")
    ledger.differs("optimizer.type", "Muon: mf-train and mf_ds.hf run MindFormers' update (mf_ds/muon.py); the "
                   "DeepSpeed JSON alone names DeepSpeed's Muon, which is not it (one triple, EMA momentum, no "
                   "per-head split)")
    ds = {"type": "Muon", "params": {"lr": lr, "momentum": run["momentum"], "weight_decay": run["weight_decay"]}}
    return ds, run
