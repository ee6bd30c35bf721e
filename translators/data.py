"""`train_dataset` / `train_dataset_task` -> the Plan's `run.data`.

MindFormers builds a MindSpore dataset pipeline (CausalLanguageModelDataset, mindformers/dataset/
causal_language_model_dataset.py r1.5.0). Here only the data itself matters:
  * BlendedMegatronDatasetDataLoader: Megatron `.bin`/`.idx` pairs with blend weights (`config.data_path`), read
    by mf_ds directly;
  * MindDataset (`.mindrecord`): cannot be read without MindSpore; a path given there is an error at run time
    unless `--train_dataset_dir` points at Megatron or JSONL data instead;
  * no path at all: the runtime's built-in corpus (documented in the README), with a note.
The pipeline knobs (workers, prefetch, NUMA) have no meaning for a PyTorch DataLoader and are dropped.
"""

from __future__ import annotations

from typing import Any

from translators.errors import ConfigError, join, show
from translators.notes import Ledger
from translators.schema import coerce

_PIPELINE = "MindSpore data-pipeline setting; the PyTorch loader needs none"
DATASET_KEYS = {
    "data_loader": None,  # handled below
    "input_columns": ("runtime", "which columns the data provides (labels / loss_mask / position_ids)"),
    "construct_args_key": ("dropped", "the HF model takes input_ids and labels by keyword"),
    "output_columns": ("dropped", "the HF model takes input_ids and labels by keyword"),
    "batch_size": ("dropped", "overridden by runner_config.batch_size, as in MindFormers"),
    "drop_remainder": ("runtime", "run.data.drop_remainder"),
    "shuffle": ("runtime", "run.data.shuffle"),
    "seed": ("runtime", "run.data.seed"),
    "repeat": ("runtime", "run.data.repeat (passes over the data per epoch)"),
    "num_parallel_workers": ("dropped", _PIPELINE),
    "python_multiprocessing": ("dropped", _PIPELINE),
    "numa_enable": ("dropped", _PIPELINE),
    "prefetch_size": ("dropped", _PIPELINE),
    "eod_reset": ("dropped", "attention is not reset at EOD; documents attend across EOD within a sample"),
    "tokenizer": ("dropped", "online tokenisation of ADGen JSON is not supported; use Megatron or JSONL data"),
    "max_source_length": ("dropped", "ADGen prompt length (online tokenisation is not supported)"),
    "max_target_length": ("dropped", "ADGen answer length (online tokenisation is not supported)"),
    "ignore_pad_token_for_loss": ("dropped", "labels equal to the pad id are masked by the loss"),
    "eos_id": ("dropped", "YiZhao pretraining dataset token ids"),
    "sop_id": ("dropped", "YiZhao pretraining dataset token ids"),
    "gmask_id": ("dropped", "YiZhao pretraining dataset token ids"),
}
MEGATRON_CONFIG = {
    "data_path": "run.data.paths / weights",
    "seq_length": "run.data.seq_length",
    "seed": "run.data.seed",
    "random_seed": "run.data.seed",
    "split": "run.data.split (only the train part is read)",
    "eod_mask_loss": "run.data.eod_mask_loss",
    "reset_position_ids": "run.data.reset_position_ids",
    "reset_attention_mask": "run.data.reset_attention_mask",
    "create_attention_mask": "run.data.create_attention_mask",
    "create_compressed_eod_mask": "run.data.create_compressed_eod_mask",
    "eod_pad_length": "run.data.eod_pad_length",
    "eod": "run.data.eod",
    "pad": "run.data.pad",
    "num_dataset_builder_threads": None,
    "mmap_bin_files": None,
    "path_to_cache": None,
}


def parse_data(tree: dict, ledger: Ledger, seq_length: int | None) -> dict[str, Any]:
    """run.data: {kind: megatron | mindrecord | json | builtin, paths, weights, seq_length, ...}."""
    raw = tree.get("train_dataset")
    task = tree.get("train_dataset_task")
    if raw is None and isinstance(task, dict) and isinstance(task.get("dataset_config"), dict):
        raw = task["dataset_config"]
    data: dict[str, Any] = {"kind": "builtin", "paths": [], "weights": [], "seq_length": seq_length,
                            "shuffle": True, "seed": None, "drop_remainder": True, "repeat": 1,
                            "input_columns": ["input_ids"], "train_samples": None, "eod_mask_loss": False,
                            "eod": None, "pad": None}
    if isinstance(task, dict):
        for name, value in task.items():
            path = join("train_dataset_task", name)
            if name == "dataset_config":
                ledger.runtime(path, "the same settings as train_dataset (a YAML alias in MindFormers' configs)")
            elif name == "type":
                ledger.runtime(path, f"{value}: read as a causal-LM data set")
            else:
                ledger.dropped(path, "research-dir class registration")
    if raw is None:
        ledger.runtime("train_dataset", "absent: the built-in corpus is used")
        return data
    if not isinstance(raw, dict):
        raise ConfigError("train_dataset", f"expected a mapping, got {show(raw)}")
    for name in raw:
        path = join("train_dataset", name)
        if name not in DATASET_KEYS:
            ledger.unknown(path, "not a data set key mf_ds knows; ignored")
        elif DATASET_KEYS[name] is not None:
            ledger.add(path, *DATASET_KEYS[name])
    for name, hint in (("drop_remainder", bool), ("seed", int), ("repeat", int), ("input_columns", list[str])):
        if name in raw:
            data[name] = coerce(raw[name], hint, join("train_dataset", name)).value
    if data["repeat"] < 1:
        raise ConfigError("train_dataset.repeat", f"expected an int >= 1, got {data['repeat']}")
    loader = raw.get("data_loader")
    if loader is None:
        ledger.runtime("train_dataset", "no data_loader: the built-in corpus is used")
        return data
    if not isinstance(loader, dict) or not isinstance(loader.get("type"), str):
        raise ConfigError("train_dataset.data_loader", f"expected a mapping with a 'type', got {show(loader)}")
    kind = loader["type"]
    if "shuffle" in loader:
        data["shuffle"] = coerce(loader["shuffle"], bool, "train_dataset.data_loader.shuffle").value
        ledger.runtime("train_dataset.data_loader.shuffle", "run.data.shuffle")
    ledger.runtime("train_dataset.data_loader.type", f"{kind}")
    if kind == "BlendedMegatronDatasetDataLoader":
        _megatron(loader, data, ledger)
    elif kind == "MindDataset":
        directory = coerce(loader.get("dataset_dir", ""), str, "train_dataset.data_loader.dataset_dir").value
        for name in loader:
            if name not in ("type", "shuffle", "dataset_dir"):
                ledger.dropped(join("train_dataset.data_loader", name), "MindRecord reader setting")
        if directory:
            data.update(kind="mindrecord", paths=[directory])
            ledger.differs("train_dataset.data_loader.dataset_dir", "MindRecord files cannot be read without "
                           "MindSpore: give --train_dataset_dir with Megatron .bin/.idx or JSONL data")
        else:
            ledger.differs("train_dataset.data_loader.dataset_dir", "empty: the built-in corpus is used")
    else:
        for name in loader:
            if name not in ("type", "shuffle"):
                ledger.dropped(join("train_dataset.data_loader", name), f"{kind} setting")
        path = loader.get("dataset_dir")
        if isinstance(path, str) and path.endswith((".jsonl", ".json")):
            data.update(kind="json", paths=[path])
            ledger.differs("train_dataset.data_loader.type", f"{kind}: read as JSON lines with a 'text' field "
                           "and a local tokenizer directory (--set mf_ds.tokenizer_dir=...)")
        else:
            ledger.differs("train_dataset.data_loader.type", f"{kind} is not supported: the built-in corpus is "
                           "used unless --train_dataset_dir is given")
    return data


def _megatron(loader: dict, data: dict, ledger: Ledger) -> None:
    base = "train_dataset.data_loader"
    data["kind"] = "megatron"
    for name in loader:
        if name not in ("type", "shuffle", "config", "sizes", "datasets_type"):
            ledger.unknown(join(base, name), "not a BlendedMegatronDatasetDataLoader key; ignored")
    if "datasets_type" in loader:
        if loader["datasets_type"] != "GPTDataset":
            raise ConfigError(join(base, "datasets_type"),
                              f"expected 'GPTDataset', got {show(loader['datasets_type'])}")
        ledger.runtime(join(base, "datasets_type"), "GPT-style samples of seq_length + 1 tokens")
    if "sizes" in loader:
        sizes = coerce(loader["sizes"], list[int], join(base, "sizes")).value
        if not sizes or sizes[0] < 0:
            raise ConfigError(join(base, "sizes"), f"expected [train_samples, test, eval], got {show(sizes)}")
        data["train_samples"] = sizes[0] or None
        ledger.runtime(join(base, "sizes"), "run.data.train_samples = sizes[0] (test and eval splits unused)")
    config = loader.get("config") or {}
    cfg = join(base, "config")
    if not isinstance(config, dict):
        raise ConfigError(cfg, f"expected a mapping, got {show(config)}")
    for name in config:
        path = join(cfg, name)
        if name not in MEGATRON_CONFIG:
            ledger.unknown(path, "not a GPTDataset config key; ignored")
        elif MEGATRON_CONFIG[name] is None:
            ledger.dropped(path, "Megatron builder performance setting")
        else:
            ledger.runtime(path, MEGATRON_CONFIG[name])
    if "seq_length" in config:
        data["seq_length"] = coerce(config["seq_length"], int, join(cfg, "seq_length")).value
    for name in ("seed", "random_seed"):
        if name in config:
            data["seed"] = coerce(config[name], int, join(cfg, name)).value
    for name, hint in (("eod_mask_loss", bool), ("eod", int), ("pad", int)):
        if name in config:
            data[name] = coerce(config[name], hint, join(cfg, name)).value
    blend = config.get("data_path", [])
    blend_path = join(cfg, "data_path")
    if not isinstance(blend, list) or len(blend) % 2:
        raise ConfigError(blend_path, f"expected [weight, path, weight, path, ...], got {show(blend)}")
    for i in range(0, len(blend), 2):
        weight = coerce(blend[i], float, join(blend_path, i)).value
        path = coerce(blend[i + 1], str, join(blend_path, i + 1)).value
        if weight < 0:
            raise ConfigError(join(blend_path, i), f"expected a weight >= 0, got {weight}")
        data["weights"].append(weight)
        data["paths"].append(path)
