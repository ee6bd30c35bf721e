"""Top-level scalars (T GeneralConfig), `trainer`, `context` and the other sections with no PyTorch meaning.

MindFormers only warns about unknown top-level keys ("useless for train"), so do we, with a did-you-mean: a
misspelt section name (`recompute_confg`) would otherwise lose a whole section without a word.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from translators.errors import ConfigError, did_you_mean, join, show
from translators.notes import Ledger
from translators.schema import Section, at_least, key


@dataclass(frozen=True)
class General(Section):
    """The top-level scalars (T GeneralConfig, r1.5.0; master additions noted)."""

    PATH = ""
    seed: int = key(1, "global seed")
    output_dir: str = key("./output", "logs and checkpoints")
    run_mode: str | None = key(None, "train | finetune | eval | predict")
    use_parallel: bool = key(False, "initialise distributed; False resets parallel_config to 1s")
    load_checkpoint: str = key("", "checkpoint file or directory to load")
    load_ckpt_format: str | None = key("ckpt", "ckpt | safetensors (checked only when a checkpoint is loaded)")
    resume_training: bool | str = key(False, "restore optimizer state and step from load_checkpoint")
    ignore_data_skip: bool = key(False, "on resume, do not skip the consumed batches")
    auto_trans_ckpt: bool = key(False, "reshard load_checkpoint to this layout")
    src_strategy_path_or_dir: str = key("", "strategy of a sharded source checkpoint")
    only_save_strategy: bool = key(False, "dump the sharding strategy and exit")
    micro_batch_interleave_num: int = key(1, "parts per batch whose losses are added (MicroBatchInterleaved)",
                                          check=at_least(1))
    use_legacy: bool = key(True, "False selects the mcore model_config")
    pretrained_model_dir: str = key("", "HF model directory whose config.json seeds the mcore model_config")
    print_separate_loss: bool = key(True, "log LM, aux and MTP losses separately")
    train_precision_sync: bool | None = key(None, "deterministic computation")
    do_eval: bool = key(False, "evaluate during training")
    eval_step_interval: int = key(100, "evaluate every N steps (< 0 off)")
    eval_epoch_interval: int = key(-1, "evaluate every N epochs (< 0 off)")
    lr_scale: bool = key(False, "scale the learning rate by global batch / lr_scale_factor")
    lr_scale_factor: int = key(256, "see lr_scale", check=at_least(1))
    layer_scale: bool = key(False, "layer-wise learning-rate decay (ViT era)")
    layer_decay: float = key(0.65, "decay factor for layer_scale")
    profile: bool = key(False, "MindSpore profiler")
    profile_start_step: int = key(1, "profiler window start")
    profile_stop_step: int = key(10, "profiler window end")
    profile_communication: bool = key(False, "profile communication")
    profile_memory: bool = key(True, "profile memory")
    init_start_profile: bool = key(False, "start profiling at init")
    profiler_level: int = key(0, "profiler detail level")
    remote_save_url: str | None = key(None, "OBS URL on Huawei AICC")
    auto_tune: bool = key(False, "MindSpore dataset autotune")
    autotune_per_step: int = key(10, "autotune interval")
    filepath_prefix: str = key("./autotune", "autotune output")
    transform_process_num: int = key(1, "processes used for resharding")
    remove_redundancy: bool = key(False, "checkpoint de-duplication")
    use_legacy_format: bool = key(True, "False: Checkpoint 2.0 checkpoints (MindFormers 2.0 graph mode)")
    mindformers_version: str | float | None = key(None, "mf-ds: the MindFormers version the YAML comes from (its "
                                                      "config classes' defaults fill what model_config leaves out; "
                                                      "default the newest)")


# What each top-level scalar becomes; "run.x" = carried in the Plan for the runtime.
GENERAL_BECOMES = {
    "seed": ("runtime", "run.seed (torch, numpy and Python RNGs, data order)"),
    "output_dir": ("runtime", "run.output_dir (checkpoints, metrics.jsonl, logs)"),
    "run_mode": ("dropped", "train and finetune train the same way here (eval and predict are refused; finetune "
                            "expects load_checkpoint)"),
    "use_parallel": ("runtime", "False resets parallel_config to 1s, as MindFormers does"),
    "load_checkpoint": ("runtime", "run.load_checkpoint: a MindSpore .ckpt, rank_0/*.ckpt, MindFormers-named "
                        "safetensors (mf_ds/checkpoint/mindspore_ckpt.py), or an HF-layout safetensors directory"),
    "load_ckpt_format": ("dropped", "the weights' own format is read from the file "
                                    "(mf_ds/checkpoint/mindspore_ckpt.py)"),
    "resume_training": ("runtime", "run.resume_training (DeepSpeed engine state: optimizer, step, data position)"),
    "ignore_data_skip": ("runtime", "run.ignore_data_skip: a resumed run starts the data from the beginning "
                                    "instead of after the batches already consumed"),
    "micro_batch_interleave_num": ("runtime", "run.micro_batch_interleave_num: each micro batch is one part of the "
                                              "batch and its loss is multiplied by it, so the gradient is the sum "
                                              "over the parts, as MindFormers' MicroBatchInterleaved adds their "
                                              "losses; the logged loss is their mean (MFLossMonitor divides by it). "
                                              "The TP overlap it exists for does not apply"),
    "use_legacy": ("runtime", "selects the model_config key names (legacy or mcore)"),
    "print_separate_loss": ("dropped", "the loss line shows the total loss (LM + aux); no MTP loss is trained "
                                       "here"),
    "train_precision_sync": ("runtime", "run.deterministic: torch.use_deterministic_algorithms(warn_only=True)"),
    "lr_scale": ("mapped", "learning rate x device count (dp x mp x cp x pp) x batch_size / lr_scale_factor when "
                           "True, as MindFormers' learning_rate_scale"),
    "lr_scale_factor": ("mapped", "see lr_scale"),
    "auto_trans_ckpt": ("dropped", "DeepSpeed checkpoints and HF safetensors need no resharding strategy"),
    "src_strategy_path_or_dir": ("dropped", "MindSpore sharding strategies do not apply to DeepSpeed checkpoints"),
    "only_save_strategy": ("dropped", "there is no sharding strategy to save"),
    "transform_process_num": ("dropped", "no resharding step"),
    "mindformers_version": ("mapped", "model_config leaves its other keys to this MindFormers version's config "
                                      "class defaults (run.mindformers_version records it)"),
    "remove_redundancy": ("dropped", "DeepSpeed writes each shard once; HF weights are saved from rank 0"),
    "use_legacy_format": ("runtime", "run.callbacks.checkpoint.use_legacy_format unless CheckpointMonitor sets it (as "
                                     "MindFormers hands it to the callback): False saves Checkpoint 2.0 "
                                     "(mf_ds/checkpoint/sharded_run.py); load_checkpoint is told by its files either "
                                     "way"),
    "pretrained_model_dir": ("runtime", "mcore: its config.json seeds model_config (model_config keys win, as "
                                        "build_config.merge_model_config); with load_checkpoint empty and "
                                        "*.safetensors in it, run.load_checkpoint (trainer.py "
                                        "_try_use_pretrained_model_dir_as_ckpt)"),
    "layer_scale": ("dropped", "layer-wise LR decay is a ViT-era option"),
    "layer_decay": ("dropped", "only used with layer_scale"),
    "profile": ("dropped", "the MindSpore profiler; use torch.profiler"),
    "profile_start_step": ("dropped", "the MindSpore profiler"),
    "profile_stop_step": ("dropped", "the MindSpore profiler"),
    "profile_communication": ("dropped", "the MindSpore profiler"),
    "profile_memory": ("dropped", "the MindSpore profiler"),
    "init_start_profile": ("dropped", "the MindSpore profiler"),
    "profiler_level": ("dropped", "the MindSpore profiler"),
    "remote_save_url": ("dropped", "Huawei OBS upload (ModelArts only)"),
    "auto_tune": ("dropped", "MindSpore dataset autotune"),
    "autotune_per_step": ("dropped", "MindSpore dataset autotune"),
    "filepath_prefix": ("dropped", "MindSpore dataset autotune"),
}

EVALUATION_KEYS = ("do_eval", "eval_step_interval", "eval_epoch_interval")

# Whole sections with nothing to carry (the ones with meaning have their own modules).
SECTIONS_DROPPED = {
    "context": "MindSpore context (graph mode, Ascend device and memory settings); PyTorch needs none of it",
    "processor": "the tokenizer of inference pipelines; training reads token ids from the data set",
    "pipeline_config": "input of MindFormers' pipeline-balance tool, not a run setting",
    "memory_usage": "input of MindFormers' pipeline-balance tool, not a run setting",
    "monitor_config": "MindFormers' TrainingStateMonitor dumps; metrics.jsonl carries loss, lr and grad norm",
    "swap_config": "Ascend host-device activation swap; no DeepSpeed counterpart here",
    "grouped_lr_schedule": "per-parameter-group learning rates are not supported; lr_schedule applies to all",
}

# Sections handled by other modules (schemas there); listed so the did-you-mean knows them.
SECTIONS = ("runner_config", "runner_wrapper", "recompute_config", "moe_config", "model", "parallel_config",
            "parallel", "optimizer", "lr_schedule", "callbacks", "train_dataset", "train_dataset_task", "trainer",
            "mf_ds", "eval_dataset", "eval_dataset_task", "eval_callbacks", "metric", *SECTIONS_DROPPED)


@dataclass(frozen=True)
class Trainer(Section):
    """trainer: the MindFormers trainer class and the model name."""

    PATH = "trainer"
    type: str = key("CausalLanguageModelingTrainer", "trainer class")
    model_name: str = key("", "informational model name (checkpoint prefix default)")


def weights_path(general: General) -> str | None:
    """What MindFormers loads: load_checkpoint, else pretrained_model_dir when it holds *.safetensors
    (mindformers/trainer/trainer.py _try_use_pretrained_model_dir_as_ckpt with contains_safetensors_files)."""
    if general.load_checkpoint:
        return general.load_checkpoint
    directory = general.pretrained_model_dir
    if directory and os.path.isdir(directory) and any(n.endswith(".safetensors") for n in os.listdir(directory)):
        return directory
    return None


def parse_general(tree: dict, ledger: Ledger) -> General:
    """Parse the top-level scalars and account for every top-level key that is not a known section."""
    scalars = {k: v for k, v in tree.items() if k in General.fields()}
    general = General.parse(scalars, ledger)
    for name in scalars:
        if name in EVALUATION_KEYS:
            continue  # noted by translators/evaluation.py
        kind, message = GENERAL_BECOMES.get(name, ("runtime", f"run.{name}"))
        ledger.add(name, kind, message)
    for name in tree:
        if name in General.fields() or name in SECTIONS:
            continue
        hint = did_you_mean(name, list(SECTIONS) + list(General.fields()))
        ledger.unknown(name, "not a MindFormers top-level key; ignored (MindFormers: 'useless for train')"
                       + (f" ({hint})" if hint else ""))
    for name, reason in SECTIONS_DROPPED.items():
        if name in tree:
            ledger.dropped(name, reason)
    if general.load_ckpt_format not in (None, "ckpt", "safetensors"):
        # MindFormers checks the format only on the way to loading one (trainer/utils.py
        # check_checkpoint_config_valid, r1.5.0 and 1.7.0); the r1.5.0 DeepSeek-V3 finetune YAML has ''. It runs
        # after _try_use_pretrained_model_dir_as_ckpt, so pretrained_model_dir's weights count.
        if weights_path(general):
            raise ConfigError("load_ckpt_format", f"expected 'ckpt' or 'safetensors' with load_checkpoint set, got "
                              f"{show(general.load_ckpt_format)} (MindFormers: config.load_ckpt_format only support "
                              "for 'ckpt' or 'safetensors')")
        ledger.dropped("load_ckpt_format", f"{show(general.load_ckpt_format)}: no load_checkpoint, so MindFormers "
                       "never reads it; nothing is loaded")
    if general.run_mode is not None and general.run_mode not in ("train", "finetune"):
        raise ConfigError("run_mode", f"expected 'train' or 'finetune' (mf-ds trains), got {show(general.run_mode)}")
    if general.run_mode == "finetune" and not weights_path(general):
        ledger.differs("run_mode", "finetune without load_checkpoint starts from random weights")
    if isinstance(general.resume_training, str) and not general.load_checkpoint:
        raise ConfigError("resume_training", "a checkpoint name needs load_checkpoint set")
    if isinstance(general.resume_training, str) and not general.use_legacy_format:
        raise ConfigError("resume_training", "must be a bool with use_legacy_format False (MindFormers: "
                          "resume_training should be a bool value when the use_legacy_format is False)")
    if general.layer_scale:
        ledger.differs("layer_scale", "layer-wise learning-rate decay is not supported; one LR for all layers")
    if general.train_precision_sync:
        ledger.differs("train_precision_sync", "deterministic kernels in PyTorch can be slower and some ops "
                       "have none (torch.use_deterministic_algorithms(warn_only=True))")
    return general


def parse_trainer(tree: dict, ledger: Ledger) -> Trainer:
    trainer = Trainer.parse(tree.get("trainer"), ledger)
    if ledger.present("trainer.type"):
        if trainer.type == "CausalLanguageModelingTrainer":
            ledger.runtime("trainer.type", "the mf_ds causal-LM training loop")
        else:
            ledger.differs("trainer.type", f"{trainer.type}: mf-ds trains causal language models only; "
                           "the causal-LM loop is used")
    if ledger.present("trainer.model_name"):
        ledger.dropped("trainer.model_name", "informational: nothing here reads it (the checkpoint prefix is "
                       "CheckpointMonitor's prefix)")
    return trainer


def check_section_types(tree: dict) -> None:
    """Sections that must be mappings (a list or a scalar there is a typo, not a configuration). A PyNative-schema
    YAML (top-level training / parallelism) never comes here: translators/pynative.py reads it."""
    for name in tree:
        if not isinstance(name, str):  # load_yaml refuses these too; a tree built in Python may hold them
            raise ConfigError(show(name), "a top-level key must be a string")
    for name in SECTIONS:
        if name in tree and tree[name] is not None and name != "callbacks" and name != "eval_callbacks":
            if not isinstance(tree[name], dict):
                raise ConfigError(join("", name), f"expected a mapping, got {show(tree[name])}")
