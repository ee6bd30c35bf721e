"""The ledger of a PyNative-schema YAML (translators/pynative.py): what each key of `checkpoint`, `training`,
`parallelism`, `optimizer`, `recompute`, `train_dataset`, `monitor`, ... became, and the settings of the Plan they
decide (ZeRO stage, callbacks, checkpoint saving, the NaN guard). The keys of `model` are the family tables'
(translators/families), of `lr_scheduler` translators/lr.py's, of Muon's translators/muon.py's.

MindFormers' sources: mindformers/pynative/ of the 2.0.0 / 2.1.0 wheels (trainer/trainer.py, distributed/fsdp.py,
distributed/utils.py get_loss_sense, base_models/gpt/parallelize.py, callback/loss_callback.py).
"""

from __future__ import annotations

import posixpath
from typing import Any

from translators import pipeline_compose, pynative_layout
from translators.errors import ConfigError, join, show
from translators.notes import Ledger
from translators.plan_types import MoE
from translators.pynative_trainer import spans
from translators.schema import MAX_INT
from translators.sections import MfDs

_PIPELINE = "no pipeline runs here: pipeline_parallel folds into data parallel"
_NPU = "an Ascend communication / kernel setting with no PyTorch counterpart"
_UNREAD = "not read by MindFormers' PyNative trainer either"


def refusals(cfg: dict, tree: dict) -> None:
    """What mf-ds cannot run at all, one line each."""
    if cfg.get("run_mode", "train") != "train":
        raise ConfigError("run_mode", f"{show(cfg['run_mode'])}: mf-ds trains (MindFormers' 'predict' routes to its "
                          "PyNative inference)")
    if cfg["training"].get("rampup_batch_size") is not None:
        raise ConfigError("training.rampup_batch_size", "batch-size ramp-up is not supported: DeepSpeed's batch is "
                          "fixed for the run")


def data_tree(tree: dict) -> dict:
    """train_dataset as graph mode's data builders read it (data_loader, input_columns); the keys of the PyNative
    schema's own are noted in `sections`."""
    raw = tree.get("train_dataset")
    if not isinstance(raw, dict):
        return {}
    out: dict[str, Any] = {k: v for k, v in raw.items() if k == "drop_remainder"}
    loader = raw.get("dataloader")
    if isinstance(loader, dict):
        out["data_loader"] = {k: v for k, v in loader.items() if k not in ("column_names", "python_multiprocessing")}
        if "column_names" in loader:
            out["input_columns"] = loader["column_names"]
    return {"train_dataset": out}


def output_dir(tree: dict) -> str:
    """run.output_dir: mf-ds' own top-level `output_dir` (mf-train --output_dir sets it), else ./output, where
    MindFormers' PyNative trainer writes its logs; checkpoints go under it (checkpoint_directory)."""
    value = tree.get("output_dir", "./output")
    if not isinstance(value, str) or not value:
        raise ConfigError("output_dir", f"expected a directory path, got {show(value)}")
    return value


def max_nan_steps(cfg: dict, tree: dict, extra: Any) -> int:
    """mf-ds stops after this many non-finite losses in a row: mf_ds.max_nan_steps, else the PyNative guard
    training.max_consecutive_skipped_steps when set (> 0), else mf-ds' default."""
    if isinstance(tree.get("mf_ds"), dict) and "max_nan_steps" in tree["mf_ds"]:
        return extra.max_nan_steps
    guard = cfg["training"].get("max_consecutive_skipped_steps", 0)
    return guard if guard > 0 else extra.max_nan_steps


def seed(cfg: dict) -> int:
    """run.seed, bounded as graph mode bounds its `seed` (translators/schema.py MAX_INT): TrainConfig checks only
    that it is an int, and 2^80 reached torch.manual_seed ("Overflow when unpacking long long")."""
    value = cfg["training"]["seed"]
    if isinstance(value, bool) or not isinstance(value, int) or abs(value) > MAX_INT:
        raise ConfigError("training.seed", f"expected an int within +-{MAX_INT}, got {show(value)}")
    return value


def zero(cfg: dict, deg: Any, lay: Any, extra: Any, mixed: bool, moe: MoE | None, ledger: Ledger) -> dict:
    """The ZeRO block for the FSDP the YAML asks for (data_parallel_shard over the data-parallel ranks)."""
    p = cfg["parallelism"]
    ep = moe.expert_parallel if moe else 1
    if extra.zero_stage is not None:
        stage, why = extra.zero_stage, "mf_ds.zero_stage"
        ledger.mapped("mf_ds.zero_stage", f"deepspeed.zero_optimization.stage = {stage}")
        if stage == 3 and ep > 1:
            raise ConfigError("mf_ds.zero_stage", "ZeRO-3 with expert parallelism is not supported (DeepSpeed expert "
                              "groups need ZeRO-1 or -2)")
    elif cfg["optimizer"]["type"] == "Muon" and ep > 1 and not mixed:
        stage, why = 0, "Muon beside expert parallelism updates at ZeRO stage 0 (translators/muon.py)"
    elif lay.data_parallel == 1:
        stage, why = (1 if mixed else 0), "one data-parallel rank: nothing to shard" + (
            " (ZeRO-1 keeps the fp32 master weights of bf16/fp16 training)" if mixed else "")
    elif deg.dp_shard == 1:
        stage, why = (1 if mixed else 0), "data_parallel_shard 1: every rank keeps whole weights (pure replication)"
    elif ep > 1:
        stage, why = 2, "DeepSpeed's expert-parallel groups take ZeRO-1 or -2, not 3"
    else:
        stage, why = 3, "parameters, gradients and optimizer states sharded over the data-parallel ranks"
    if lay.pipeline_stage > 1:  # the stages run: ZeRO-1 at most inside them, as graph mode's (deepspeed.zero)
        stage, capped = pipeline_compose.zero(stage, why, explicit=extra.zero_stage is not None)
        why = capped or why
    shard = p["data_parallel_shard"]
    fsdp = f"FSDP over {deg.dp_shard} ranks" + (f", replicated {deg.dp_replicate} times (HSDP)"
                                                 if deg.dp_replicate > 1 else "")
    if stage == 3 and deg.dp_replicate > 1:
        ledger.differs("parallelism.data_parallel_shard", f"{shard}: {fsdp}; ZeRO-3 shards over all "
                       f"{lay.data_parallel} data-parallel ranks (DeepSpeed has no hybrid sharding for it here)")
    elif stage == 3 or deg.dp_shard == 1:
        ledger.mapped("parallelism.data_parallel_shard", f"{shard}: {fsdp} -> deepspeed.zero_optimization.stage = "
                      f"{stage} ({why})")
    else:
        ledger.differs("parallelism.data_parallel_shard", f"{shard}: {fsdp}; deepspeed.zero_optimization.stage = "
                       f"{stage} ({why}): the weights are not sharded")
    if stage == 0:
        block: dict[str, Any] = {"stage": 0}
    else:
        block = {"stage": stage, "overlap_comm": False, "contiguous_gradients": True}
        if stage == 3:
            block["stage3_gather_16bit_weights_on_model_save"] = True
    policy = p["reshard_after_forward_policy"]
    if policy not in ("always", "never", "default"):
        raise ConfigError("parallelism.reshard_after_forward_policy", f"expected 'always', 'never' or 'default', got "
                          f"{show(policy)} (MindFormers' get_fsdp_reshard_after_forward_policy refuses it)")
    if stage < 3:
        ledger.dropped("parallelism.reshard_after_forward_policy",
                       f"{policy}: no parameter sharding runs (ZeRO-{stage})")
    elif policy == "never" or (policy == "default" and deg.pp > 1):
        ledger.differs("parallelism.reshard_after_forward_policy", f"{policy}: FSDP keeps each layer's gathered "
                       "parameters from forward to backward; ZeRO-3 releases them after use and gathers them again "
                       "in backward (less memory, one more all-gather per layer)")
    else:
        ledger.mapped("parallelism.reshard_after_forward_policy", f"{policy}: reshard after forward (FSDP) is what "
                      "ZeRO-3 does: each layer's parameters are released after its forward and gathered again for its "
                      "backward; DeepSpeed may keep up to stage3_max_live_parameters of them and prefetches ahead")
    if p["cpu_offload"]:
        if stage == 0:
            ledger.differs("parallelism.cpu_offload", "no ZeRO stage runs here, so nothing is offloaded")
        else:
            block["offload_optimizer"] = {"device": "cpu"}
            if stage == 3:
                block["offload_param"] = {"device": "cpu"}
            ledger.mapped("parallelism.cpu_offload", "deepspeed.zero_optimization.offload_optimizer (and offload_param "
                          "under ZeRO-3) on the CPU, as FSDP's CPUOffloadPolicy keeps the sharded parameters, "
                          "gradients and optimizer step there")
    else:
        ledger.dropped("parallelism.cpu_offload", "false: nothing offloaded")
    return block


def muon_section(cfg: dict, tree: dict, ledger: Ledger) -> dict:
    """The arguments MindFormers' PyNative trainer hands Muon: the YAML's optimizer keys, and OptimizerConfig's
    defaults where it leaves out eps or weight_decay (trainer/utils.py _build_optimizer passes
    `config.to_dict()` as **kwargs, so those are TrainConfig's 1e-8 / 0.01, not Muon's own 1e-7 / 0.1)."""
    raw = tree.get("optimizer") or {}
    section = dict(raw)
    taken = [f"{name} {cfg['optimizer'][name]!r}" for name in ("eps", "weight_decay") if name not in raw]
    for name in ("eps", "weight_decay"):
        section.setdefault(name, cfg["optimizer"][name])
    if taken:
        ledger.mapped("", "Muon takes OptimizerConfig's defaults for what the optimizer section leaves out, as "
                      "MindFormers' _build_optimizer passes them: " + ", ".join(taken))
    return section


def optimizer_extras(cfg: dict, tree: dict, ledger: Ledger) -> None:
    """AdamW: the keys ds.optimizer does not read."""
    raw = tree.get("optimizer") or {}
    if cfg["optimizer"]["type"] != "AdamW":
        raise ConfigError("optimizer.type", f"{show(cfg['optimizer']['type'])}: the PyNative trainer's optimizers "
                          "are AdamW and Muon")
    for name in ("weight_decay_include", "weight_decay_exclude"):
        if name in raw:
            if raw[name]:
                ledger.differs(join("optimizer", name), "name rules for weight decay are not applied: decay on every "
                               "parameter with ndim > 1 that is not a bias (MindFormers' default rule)")
            else:
                ledger.dropped(join("optimizer", name), "empty: MindFormers' default rule (no decay for 1-D "
                               "parameters and biases), as here")
    for name in raw:
        if name not in ("type", "betas", "eps", "weight_decay", "weight_decay_include", "weight_decay_exclude",
                        "learning_rate"):
            ledger.dropped(join("optimizer", name), "not an AdamW argument: MindFormers' AdamW takes it in **kwargs "
                           "and ignores it" if name not in ("use_fused", "enable_fused_opt") else
                           "MindFormers' fused AdamW kernel: the same update")
    if "learning_rate" in raw:
        ledger.dropped("optimizer.learning_rate", "lr_scheduler.learning_rate is used, as in MindFormers")


def checkpoint_directory(save_path: str, out_dir: str) -> str | None:
    """Where the run's checkpoints go: under the run's output_dir, so that `--output_dir` decides where a run writes
    and a resume reads only that run's own directory (issue 33). MindFormers' save_path is relative to the current
    directory and its default YAMLs name ./output/checkpoint, inside the ./output its PyNative trainer writes to
    (utils/file_utils.py get_output_root_path): output_dir takes the place of that ./output, and any other
    relative save_path goes under output_dir as it is. An absolute save_path is the user's own choice; empty
    (which MindFormers' CheckpointCallback refuses) leaves the runtime's output_dir/checkpoint."""
    if not save_path:
        return None
    if posixpath.isabs(save_path):
        return save_path
    parts = posixpath.normpath(save_path).split("/")
    if parts[0] == "output":
        parts = parts[1:]
    return posixpath.join(out_dir, *parts) if parts else out_dir


def callbacks(cfg: dict, moe: MoE | None, ledger: Ledger, out_dir: str = "./output") -> dict:
    """run.callbacks: the PyNative trainer's built-in loss logging (LossCallback, which also moves the
    aux-loss-free expert bias every step) and checkpoint saving (CheckpointCallback from `checkpoint`)."""
    c = cfg["checkpoint"]
    out: dict[str, Any] = {"loss_monitor": {"per_print_times": 1, "check_for_nan_in_loss_and_grad": False},
                           "checkpoint": None, "topk_bias_balance": None, "moe_drop_rate": None}
    if c["enable_save"]:
        if c["save_max"] < 1 or c["save_interleaved_steps"] < 1:
            key = "save_max" if c["save_max"] < 1 else "save_interleaved_steps"
            raise ConfigError(join("checkpoint", key), f"expected an int >= 1, got {c[key]}")
        out["checkpoint"] = {"prefix": c["prefix"] or "checkpoint",
                             "directory": checkpoint_directory(c["save_path"], out_dir),
                             "save_checkpoint_steps": c["save_interleaved_steps"], "keep_checkpoint_max": c["save_max"],
                             "checkpoint_format": "safetensors",
                             # mf-ds' own resumable checkpoints (DeepSpeed state + HF weights), optimizer included
                             "use_legacy_format": True, "save_optimizer": True}
    if moe is not None and moe.router.bias_balance:
        # loss_callback.py: with moe_router_enable_expert_bias the bias moves every step (gpt_model.py
        # _update_expert_bias: += moe_router_bias_update_rate x sign(mean load - load)), no callback needed
        out["topk_bias_balance"] = {"balance_via_topk_bias": None, "topk_bias_update_rate": None, "expert_num": None}
        ledger.runtime("", "the aux-loss-free expert bias moves every step, as MindFormers' PyNative LossCallback "
                       "moves it (run.callbacks.topk_bias_balance)")
    for i, entry in enumerate(cfg["callbacks"]):
        kind = entry.get("type") if isinstance(entry, dict) else None
        if kind == "MaxLogitsMonitor":
            ledger.dropped(join("callbacks", i), "MaxLogitsMonitor logs each head's max attention logit, which mf-ds's "
                           "attention does not track")
        else:
            ledger.differs(join("callbacks", i), f"{show(kind)}: not a callback mf-ds runs; ignored")
    return out


def sections(cfg: dict, tree: dict, deg: Any, lay: Any, moe: MoE | None, ga: int, global_batch: int,
             full: set[int], n_layers: int, sections_known: tuple[str, ...], ledger: Ledger) -> None:
    """The notes on the keys of checkpoint, training, parallelism, recompute*, swap, train_dataset, monitor, context,
    profiler, callbacks and the top level."""
    _training(cfg, deg, lay, ga, global_batch, ledger)
    _parallelism(cfg, deg, lay, moe, ledger)
    _parallel_switches(cfg, lay, ledger)
    _checkpoint(cfg, ledger)
    _recompute(cfg, full, n_layers, ledger)
    _rest(cfg, tree, deg, sections_known, ledger)


def _training(cfg: dict, deg: Any, lay: Any, ga: int, global_batch: int, ledger: Ledger) -> None:
    present, t = ledger.present, cfg["training"]
    for name, kind, message in (
            ("steps", "runtime", f"run.stop_step = {t['steps']} steps, with run.epochs = {t['steps']} so that the "
                                 "data is passed over as often as the steps need (MindFormers counts steps, not "
                                 "epochs); the LR schedule's total_steps, as MindFormers' _build_lr_scheduler passes "
                                 "it"),
            ("local_batch_size", "mapped", f"deepspeed.train_micro_batch_size_per_gpu = {t['local_batch_size']}"),
            ("global_batch_size", "mapped", f"deepspeed.gradient_accumulation_steps = {ga} on {lay.data_parallel} "
                                            f"data-parallel ranks: a global batch of {global_batch} (MindFormers: "
                                            f"{deg.global_batch} = {t['local_batch_size']} x data_parallel "
                                            f"{deg.data_parallel} x accumulation {deg.gradient_accumulation_steps})"),
            ("max_norm", "mapped", f"deepspeed.gradient_clipping = {t['max_norm']}" if t["max_norm"] > 0 else
                                   "<= 0: no clipping (deepspeed.gradient_clipping = 0.0)"),
            ("seed", "runtime", "run.seed (torch, numpy and Python RNGs, data order)"),
            ("deterministic", "runtime", "run.deterministic: torch.use_deterministic_algorithms(warn_only=True)")):
        if present(join("training", name)):
            ledger.add(join("training", name), kind, message)
    if t["global_batch_size"] != deg.global_batch and present("training.global_batch_size"):
        ledger.runtime("training.global_batch_size", f"MindFormers 2.0.0 floors the accumulation: "
                       f"{deg.global_batch} samples a step, not {t['global_batch_size']}")
    if present("training.use_skip_step_on_nan"):
        if t["use_skip_step_on_nan"]:
            ledger.dropped("training.use_skip_step_on_nan", "true, as mf-ds always does: a step whose gradients hold "
                           "inf/NaN is skipped, no update, the LR schedule holds (mf_ds/loop.py): nothing to carry")
        else:
            ledger.differs("training.use_skip_step_on_nan", "false: mf-ds always skips a step whose gradients hold "
                           "inf/NaN (no update, the LR holds); MindFormers would apply it")
    if present("training.max_consecutive_skipped_steps"):
        n = t["max_consecutive_skipped_steps"]
        ledger.add("training.max_consecutive_skipped_steps", *(
            ("differs", f"run.max_nan_steps = {n}: the run stops after {n} non-finite losses in a row; MindFormers "
                        "counts skipped steps (non-finite gradients), which a finite loss can have") if n > 0 else
            ("differs", "0: MindFormers never stops; mf-ds stops after mf_ds.max_nan_steps non-finite losses in a "
                        "row")))
    if present("lr_scheduler.total_steps"):
        ledger.dropped("lr_scheduler.total_steps", f"MindFormers' PyNative trainer replaces it with training.steps "
                       f"{t['steps']} (trainer/utils.py _build_lr_scheduler)")
    if present("training.rampup_batch_size"):
        ledger.dropped("training.rampup_batch_size", "null: a fixed batch")


def _parallelism(cfg: dict, deg: Any, lay: Any, moe: MoE | None, ledger: Ledger) -> None:
    present, p = ledger.present, cfg["parallelism"]
    folded = lay.folded
    for name, degree, what in (
            ("tensor_parallel", deg.tp, f"deepspeed.tensor_parallel.autotp_size = {lay.tensor_parallel} (AutoTP; "
                                        f"{'the HF tp_plan' if lay.tp_rule == 'hf_tp_plan' else 'partition_config'})"),
            ("context_parallel", deg.cp, f"deepspeed.sequence_parallel_size = {lay.context_parallel} (DeepSpeed "
                                         "Ulysses: each rank holds seq_length / cp tokens, all-to-all over heads)"),
            ("pipeline_parallel", deg.pp, None)):
        path = join("parallelism", name)
        if path in folded:
            ledger.differs(path, folded[path])
        elif degree > 1 and name == "pipeline_parallel":  # DeepSpeed's PipelineEngine runs the stages
            ledger.runtime(path, pynative_layout.stages_note(lay))
        elif degree > 1 and what:
            ledger.mapped(path, what)
        elif present(path):
            ledger.dropped(path, f"{degree}: nothing to split")
    for path, reason in folded.items():
        if path == "parallelism.expert_parallel":
            ledger.differs(path, reason)
    if "parallelism.expert_parallel" not in folded and present("parallelism.expert_parallel"):
        if moe is not None:
            ledger.runtime("parallelism.expert_parallel", f"moe.expert_parallel = {lay.expert_parallel} (DeepSpeed "
                           "expert-parallel groups inside data parallel)")
        elif deg.ep == 1:  # a dense model's ep > 1 is noted by translators/moe.py
            ledger.dropped("parallelism.expert_parallel", "1: a dense model, no experts to shard")
    method = (p["context_parallel_method"] or "colossal").lower()
    if present("parallelism.context_parallel_method"):
        if lay.context_parallel == 1:
            ledger.dropped("parallelism.context_parallel_method", f"{method}: no context parallelism runs")
        elif method == "ulysses":
            ledger.mapped("parallelism.context_parallel_method", "ulysses: DeepSpeed Ulysses")
        else:
            ledger.differs("parallelism.context_parallel_method", f"{method}: "
                           + ("ring attention (colossal)" if method == "colossal" else "Ulysses inside ring attention")
                           + " has no DeepSpeed counterpart for HF models; Ulysses (all-to-all over heads) computes "
                             "the same attention")
    for name, why in (("ulysses_degree_in_cp", "the whole context-parallel degree is Ulysses here"),
                      ("context_parallel_async", "MindFormers' asynchronous context-parallel hooks (an overlap)"),
                      ("context_parallel_mask_type", "causal, as here")):
        if present(join("parallelism", name)):
            ledger.dropped(join("parallelism", name), why)
    if lay.pipeline_stage > 1:  # the pipeline runs: what of its keys applies (translators/pynative_layout.py)
        pynative_layout.account(p, lay, present, ledger)
        return
    for name in ("layers_per_stage", "schedule", "microbatch_size", "interleave_num", "overlap_p2p", "overlap_b_f",
                 "enable_dxdw_split", "p2p_transport"):
        name = f"pipeline_parallel_{name}"
        if present(join("parallelism", name)):
            ledger.dropped(join("parallelism", name), _PIPELINE)


def _parallel_switches(cfg: dict, lay: Any, ledger: Ledger) -> None:
    present, p = ledger.present, cfg["parallelism"]
    if present("parallelism.disable_gradient_division"):
        if p["disable_gradient_division"]:
            ledger.dropped("parallelism.disable_gradient_division", "true: MindFormers sums the gradients over the "
                           "FSDP ranks and scales each rank's loss by 1 / (world / pp) (distributed/utils.py "
                           "get_loss_sense): together the mean over the data-parallel ranks, which DeepSpeed's "
                           "averaging computes anyway: nothing to carry")
        else:
            ledger.differs("parallelism.disable_gradient_division", "false: MindFormers divides twice (FSDP's mean and "
                           "the 1 / (world / pp) loss sense), a gradient 1/dp of the mean; mf-ds takes the mean (AdamW "
                           "barely sees the scale, but max_norm clips a gradient dp times larger here)")
    for name, why in (("data_parallel_shard_strategy", f"{_UNREAD} (ZeRO's stage decides what is sharded)"),
                      ("npu_nums_per_device", _NPU), ("enable_mc2", _NPU), ("expert_parallel_async_d2h", _NPU),
                      ("expert_parallel_use_safe_tokens", "a zero-probability token per expert so that the NPU's "
                                                          "grouped matmul never sees an empty group; mf-ds' grouped "
                                                          "matmul takes empty groups, numerics unchanged")):
        if present(join("parallelism", name)):
            ledger.dropped(join("parallelism", name), why)
    if present("parallelism.dense_fsdp_shard_size"):
        if p["dense_fsdp_shard_size"] is None:
            ledger.dropped("parallelism.dense_fsdp_shard_size", "null: dense weights sharded over the whole group")
        else:
            ledger.differs("parallelism.dense_fsdp_shard_size", "ZeRO shards every weight over the whole "
                           "data-parallel group")
    if present("parallelism.sequence_parallel"):
        if lay.tensor_parallel > 1 and p["sequence_parallel"]:
            ledger.differs("parallelism.sequence_parallel", "Megatron sequence parallelism (inside TP) has no "
                           "DeepSpeed counterpart: each TP rank keeps the norm and dropout activations whole")
        else:
            ledger.dropped("parallelism.sequence_parallel", "no tensor parallelism runs" if lay.tensor_parallel == 1
                           else "false")
    if present("parallelism.enable_loss_parallel"):
        if p["enable_loss_parallel"] and lay.tensor_parallel > 1:
            ledger.mapped("parallelism.enable_loss_parallel", "deepspeed.tensor_parallel.vocab_parallel_lm_head "
                          "(logits sharded over the vocabulary, DeepSpeed's distributed cross-entropy)")
        else:
            ledger.dropped("parallelism.enable_loss_parallel", "no tensor parallelism runs" if p["enable_loss_parallel"]
                           else "false")
    if present("parallelism.moe_token_dispatcher_type"):
        if lay.expert_parallel == 1:
            ledger.dropped("parallelism.moe_token_dispatcher_type", f"{p['moe_token_dispatcher_type']}: no expert "
                           "parallelism runs, so no tokens travel between ranks")
        elif p["moe_token_dispatcher_type"] == "alltoall":
            ledger.runtime("parallelism.moe_token_dispatcher_type", "alltoall: mf-ds' MoE layer dispatches with "
                           "all-to-all over the expert-parallel group (moe.expert_parallel)")
        else:
            ledger.differs("parallelism.moe_token_dispatcher_type", f"{p['moe_token_dispatcher_type']}: the plain "
                           "all-to-all here (the per-node de-duplication is a communication saving: the same tokens "
                           "reach the same experts)")


def _checkpoint(cfg: dict, ledger: Ledger) -> None:
    present, c = ledger.present, cfg["checkpoint"]
    load = c["load_path"]
    table = {
        "enable_save": ("runtime", "run.callbacks.checkpoint: mf-ds checkpoints (DeepSpeed state and HF safetensors "
                        "weights, resumable) every save_interleaved_steps steps; MindFormers' PyNative trainer writes "
                        "Checkpoint 2.0, which `mf-convert --mf-config <yaml> <step dir> <out>` makes of one"
                        if c["enable_save"] else "false: no checkpoint is written (run.callbacks.checkpoint null)"),
        "save_path": ("runtime", "run.callbacks.checkpoint.directory, under output_dir when relative (output_dir "
                      "in place of MindFormers' ./output)") if c["enable_save"] else
        ("dropped", "enable_save is false: nothing is saved"),
        "save_max": ("runtime", "run.callbacks.checkpoint.keep_checkpoint_max") if c["enable_save"] else
        ("dropped", "enable_save is false"),
        "save_interleaved_steps": ("runtime", "run.callbacks.checkpoint.save_checkpoint_steps") if c["enable_save"]
        else ("dropped", "enable_save is false"),
        "prefix": ("runtime", "run.callbacks.checkpoint.prefix"),
        "no_save_optim": ("differs", "true: mf-ds' checkpoints always hold the optimizer state (a resume needs it)")
        if c["no_save_optim"] else ("dropped", "false: mf-ds' checkpoints hold the optimizer state, as asked"),
        "async_save": ("dropped", "checkpoints are written synchronously (never left half-written)"),
        "remove_redundancy": ("dropped", "DeepSpeed writes each shard once; the HF weights come from rank 0"),
        "load_path": ("runtime", "run.load_checkpoint: a Checkpoint 2.0 directory (mf_ds/checkpoint/sharded.py, its "
                                 "ranks "
                                 "merged), MindFormers safetensors or an HF directory") if load else
        ("dropped", "empty: the model starts from random weights"),
        "no_load_optim": ("runtime", "true: the weights only, the optimizer starts fresh (run.resume_training "
                                     "false)") if c["no_load_optim"] else
        ("runtime", "false: run.resume_training: a Checkpoint 2.0 at load_path resumes with its optimizer state, "
                    "step and LR schedule (mf_ds/checkpoint/sharded_run.py; one without optimizer files is refused); "
                    "MindFormers "
                    "safetensors or an HF directory give the weights") if load else ("dropped", "no load_path"),
        "load_balanced": ("dropped", "how MindFormers spreads the reading over ranks"),
        "load_worker_number": ("dropped", "MindFormers' reader threads"),
        "reshard_worker_num": ("dropped", "MindFormers' resharding threads (the merge here needs none)"),
        "save_global_layout_cache": ("dropped", "MindFormers' layout cache for its checkpoint metadata"),
        "save_trainable_only": ("dropped", "mf-ds' checkpoints of a LoRA run hold the adapters in PEFT's layout "
                                "(mf_ds/lora.py), whatever it says"),
        "base_load_path": ("dropped", "the base weights come from checkpoint.load_path (mf-ds' checkpoints of a LoRA "
                           "run hold the adapters only)"),
    }
    for name, (kind, message) in table.items():
        if present(join("checkpoint", name)):
            ledger.add(join("checkpoint", name), kind, message)


def _recompute(cfg: dict, full: set[int], n_layers: int, ledger: Ledger) -> None:
    present = ledger.present
    rc, comm = cfg["recompute"], cfg["recompute_comm"]
    if present("recompute.mode"):
        ledger.runtime("recompute.mode", f"{rc['mode']}: {len(full)} of {n_layers} layers fully recomputed "
                       "(plan.layers)")
    if present("recompute.full_recompute_layer"):
        ledger.runtime("recompute.full_recompute_layer", f"layers {spans(full)} fully recomputed (plan.layers; "
                       "MTP layers count after the decoder layers)" if full else "mode is not full: unused")
    if present("recompute.select_module") and rc["mode"] != "select":
        ledger.dropped("recompute.select_module", f"mode is {rc['mode']!r}: MindFormers reads it only with 'select'")
    if present("recompute.exclude_op"):
        if rc["exclude_op"]:
            ledger.differs("recompute.exclude_op", "not applied: the recomputed layers recompute every op")
        else:
            ledger.dropped("recompute.exclude_op", "null: nothing excluded")
    if present("recompute_comm"):
        if comm["enable"]:
            ledger.differs("recompute_comm", "communication recompute is not done: DeepSpeed's collectives are not "
                           "recomputed")
        else:
            ledger.dropped("recompute_comm", "enable is false")
    if present("swap"):
        if cfg["swap"]["enable"]:
            ledger.differs("swap", "activation offload to the host is not done (no DeepSpeed counterpart for HF "
                           "layers); activations stay on the device")
        else:
            ledger.dropped("swap", "enable is false")


def _rest(cfg: dict, tree: dict, deg: Any, sections_known: tuple[str, ...], ledger: Ledger) -> None:
    """train_dataset's own keys, the sections with no PyTorch meaning, the top level."""
    present = ledger.present
    # train_dataset: the PyNative schema's own keys (the loader's: translators/data.py)
    for name, kind, message in (
            ("num_parallel_workers", "dropped", "MindSpore data-pipeline setting; the PyTorch loader needs none"),
            ("prefetch_size", "dropped", "MindSpore data-pipeline setting"),
            ("numa_enable", "dropped", "MindSpore data-pipeline setting"),
            ("use_distribute_dataset", "dropped", "each data-parallel rank reads its own shard; TP / CP peers read the "
                                                  "same one"),
            ("dataloader.python_multiprocessing", "dropped", "MindSpore data-pipeline setting")):
        if present(f"train_dataset.{name}"):
            ledger.add(f"train_dataset.{name}", kind, message)
    if present("train_dataset.balance_enabled"):
        if cfg["train_dataset"].get("balance_enabled"):
            ledger.differs("train_dataset.balance_enabled", "attention-load balancing across data-parallel ranks is "
                           "not done")
        else:
            ledger.dropped("train_dataset.balance_enabled", "false")

    # whole sections with no PyTorch meaning
    for name, why in (("monitor", "MindFormers' training-state monitors (norms, TensorBoard, tokens per expert); "
                                  "metrics.jsonl carries loss, lr and grad norm"),
                      ("context", "MindSpore context (PyNative mode, Ascend device memory); PyTorch needs none of it"),
                      ("inference", "read only when run_mode is 'predict'")):
        if present(name):
            ledger.dropped(name, why)
    if present("profiler"):
        if cfg["profiler"]["enable_profiling"]:
            ledger.differs("profiler", "the MindSpore profiler is not run; use torch.profiler")
        else:
            ledger.dropped("profiler", "enable_profiling is false")
    if present("run_mode"):
        ledger.dropped("run_mode", "train: what mf-ds does")
    if present("mindformers_version"):
        ledger.mapped("mindformers_version", "the model leaves its other keys to this MindFormers version's config "
                      "class defaults, and the schema is this version's (run.mindformers_version records it)")
    if present("mf_ds"):
        ledger.runtime("mf_ds", "mf-ds' own settings")
        MfDs.note_compile(tree, ledger)
    if present("output_dir"):
        ledger.runtime("output_dir", "run.output_dir (mf-ds' own key, set by mf-train --output_dir: metrics, logs "
                       "and checkpoints (a relative checkpoint.save_path goes under it); MindFormers' PyNative trainer "
                       "reads no such key)")
    if present("callbacks") and not cfg["callbacks"]:
        ledger.dropped("callbacks", "empty: the trainer's built-in loss logging and checkpoint saving only")
    for name in tree:
        if name not in sections_known and name not in ("mindformers_version", "mf_ds", "output_dir"):
            ledger.unknown(name, "not a PyNative TrainConfig section: MindFormers keeps it as an attribute and "
                           "nothing reads it")
    ledger.mapped("", f"PyNative schema: data_parallel {deg.data_parallel} = world {deg.world} / (tp {deg.tp} x pp "
                  f"{deg.pp} x cp {deg.cp}), accumulation "
                  f"{deg.gradient_accumulation_steps} = global_batch_size / (local_batch_size x data_parallel)")
