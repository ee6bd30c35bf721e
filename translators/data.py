"""`train_dataset` / `train_dataset_task` -> the Plan's `run.data`.

MindFormers builds a MindSpore dataset pipeline (CausalLanguageModelDataset, mindformers/dataset/
causal_language_model_dataset.py r1.5.0). Here only the data itself matters:
  * BlendedMegatronDatasetDataLoader: Megatron `.bin`/`.idx` pairs with blend weights (`config.data_path`), read
    by mf_ds directly;
  * MindDataset (`.mindrecord`): `dataset_dir` (a directory, or one file and its shards) or `dataset_files`, read
    by mf_ds/data/mindrecord.py without MindSpore. Which column feeds which model argument is MindFormers' rule
    (base_trainer.py `_get_columns_with_strategy`, wrapper.py `DataOrderWrapperCell`): the YAML's input_columns
    zipped with construct_args_key when given, else with the model's construct parameters in order (`columns`);
    `shifted` says whether the model cuts rows of seq_length + 1 tokens into inputs and next-token labels
    (legacy models unless input_sliced_sig; mcore models take rows as they are);
  * HFDataLoader: `datasets.load_dataset` and MindFormers' handlers (translators/hfdata.py, mf_ds/data/hfloader.py);
  * another loader: `refused` (the run stops before the model unless --train_dataset_dir / mf_ds.builtin_corpus);
  * no path at all: the runtime's built-in corpus (documented in docs/data.md), with a note.
The pipeline knobs (workers, prefetch, NUMA) have no meaning for a PyTorch DataLoader and are dropped.
"""

from __future__ import annotations

from typing import Any

from translators.errors import ConfigError, join, show
from translators.hfdata import parse_hf
from translators.notes import Ledger
from translators.schema import coerce

_PIPELINE = "MindSpore data-pipeline setting; the PyTorch loader needs none"
DATASET_KEYS = {
    "data_loader": None,  # handled below
    "input_columns": ("runtime", "which columns the data provides (labels / loss_mask / position_ids)"),
    "construct_args_key": ("runtime", "which model argument each input column feeds (run.data.columns)"),
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
    "eod_reset": None,  # translators/attention.py: what the model makes of it
    "eod_token_id": None,  # translators/attention.py
    "tokenizer": ("dropped", "online tokenisation of ADGen JSON is not supported; use Megatron or JSONL data"),
    "max_source_length": ("dropped", "ADGen prompt length (online tokenisation is not supported)"),
    "max_target_length": ("dropped", "ADGen answer length (online tokenisation is not supported)"),
    "ignore_pad_token_for_loss": ("dropped", "labels equal to the pad id are masked by the loss"),
    "eos_id": ("dropped", "YiZhao pretraining dataset token ids"),
    "sop_id": ("dropped", "YiZhao pretraining dataset token ids"),
    "gmask_id": ("dropped", "YiZhao pretraining dataset token ids"),
}
# The model's construct parameters, in order: a column without construct_args_key feeds the one at its position.
LEGACY_ARGS = ("input_ids", "labels", "input_position", "position_ids", "attention_mask")  # llama.py:637
MCORE_ARGS = ("input_ids", "position_ids", "attention_mask", "decoder_input", "labels")  # gpt_model.py:398
# Read by the runtime; attention_mask / actual_seq_len / position_ids through translators/attention.py
USED_ARGS = ("input_ids", "labels", "loss_mask", "attention_mask", "actual_seq_len", "position_ids")
MEGATRON_CONFIG = {
    "data_path": "run.data.paths / weights",
    "seq_length": "run.seq_length (samples of seq_length + 1 tokens)",
    "seed": "run.data.seed",
    "random_seed": "run.data.seed",
    "split": None,  # _split below
    "eod_mask_loss": "run.data.eod_mask_loss",
    "reset_position_ids": None,  # translators/attention.py: what the model makes of them
    "reset_attention_mask": None,
    "create_attention_mask": None,
    "create_compressed_eod_mask": None,
    "eod_pad_length": None,
    "eod": "run.data.eod",
    "pad": "run.data.pad",
    "num_dataset_builder_threads": "",
    "mmap_bin_files": "",
    "path_to_cache": "",
}
# The columns a Megatron GPTDataset hands the model when the YAML names none (base_trainer.py:840-853, 1.7.0):
# each feeds the model argument of its own name (construct_args_key defaults to the column names).
MEGATRON_COLUMNS = ("input_ids", "labels", "loss_mask", "position_ids")


def parse_data(tree: dict, ledger: Ledger, seq_length: int | None, mcore: bool = False,
               sliced: bool = False) -> dict[str, Any]:
    """run.data: {kind: megatron | mindrecord | json | builtin, paths, weights, seq_length, ...}.

    `mcore`: the YAML's model is an mcore one (use_legacy: False); `sliced`: model_config.input_sliced_sig.
    """
    raw = tree.get("train_dataset")
    task = tree.get("train_dataset_task")
    if raw is None and isinstance(task, dict) and isinstance(task.get("dataset_config"), dict):
        raw = task["dataset_config"]
    data: dict[str, Any] = {"kind": "builtin", "paths": [], "weights": [], "seq_length": seq_length,
                            "shuffle": True, "seed": None, "drop_remainder": True, "repeat": 1,
                            "input_columns": ["input_ids"], "train_samples": None, "eod_mask_loss": False,
                            "eod": None, "pad": None, "files_as_given": False, "columns": {},
                            "shifted": not (mcore or sliced), "reset_attention_mask": False,
                            "reset_position_ids": False, "eod_pad_length": None}
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
        data["columns"] = _megatron_columns(raw, loader.get("config") or {})
    elif kind == "MindDataset":
        _mindrecord(loader, raw, data, mcore, ledger)
    elif kind == "HFDataLoader":  # translators/hfdata.py, built by mf_ds/data/hfloader.py
        parse_hf(loader, data, mcore, ledger)
        data["columns"] = hf_columns(raw, data["hf"])
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
            data["refused"] = f"train_dataset.data_loader.type: {kind} is not read by mf-ds"
            ledger.differs("train_dataset.data_loader.type", f"{kind} is not supported: the run is refused "
                           "unless --train_dataset_dir or --set mf_ds.builtin_corpus=true names other data")
    return data


def hf_columns(raw: dict, hf: dict) -> dict[str, str]:
    """{column: model argument} of HFDataLoader data: HFDataset's columns (packed: input_ids, labels, loss_mask,
    position_ids, then actual_seq_len or attention_mask), narrowed by input_columns and zipped with
    construct_args_key when the YAML gives them (base_trainer.py `_get_columns_with_strategy`)."""
    columns = ["input_ids", "labels"]
    if hf["packed"]:
        columns += ["loss_mask", "position_ids", "actual_seq_len" if hf["compressed"] else "attention_mask"]
    if "input_columns" in raw:
        columns = coerce(raw["input_columns"], list[str], "train_dataset.input_columns").value
    keys = coerce(raw.get("construct_args_key", columns), list[str], "train_dataset.construct_args_key").value
    return dict(zip(columns, keys, strict=False))


def _mindrecord(loader: dict, raw: dict, data: dict, mcore: bool, ledger: Ledger) -> None:
    base = "train_dataset.data_loader"
    for name in loader:
        if name not in ("type", "shuffle", "dataset_dir", "dataset_files"):
            ledger.dropped(join(base, name), "MindDataset pipeline setting")
    directory = coerce(loader.get("dataset_dir") or "", str, join(base, "dataset_dir")).value
    files = loader.get("dataset_files")
    if isinstance(files, str):
        files = [files]
    files = coerce(files or [], list[str], join(base, "dataset_files")).value
    if directory:  # causal_language_model_dataset.py: dataset_dir first, then dataset_files
        data.update(kind="mindrecord", paths=[directory])
        ledger.runtime(join(base, "dataset_dir"), "MindRecord, read by mf_ds/data/mindrecord.py: a directory "
                       "(searched recursively) or one file with its shards")
        if files:
            ledger.dropped(join(base, "dataset_files"), "dataset_dir is given and wins, as in MindFormers")
    elif files:
        data.update(kind="mindrecord", paths=files, files_as_given=True)
        ledger.runtime(join(base, "dataset_files"), "MindRecord files, read by mf_ds/data/mindrecord.py")
    else:
        if "dataset_dir" in loader:
            ledger.differs(join(base, "dataset_dir"), "empty: the built-in corpus is used")
        return
    keys = raw.get("construct_args_key")
    if keys is not None:
        keys = coerce(keys, list[str], "train_dataset.construct_args_key").value
    columns = column_roles(data["input_columns"], keys, mcore)
    if "input_ids" not in columns.values():
        path = "train_dataset.construct_args_key" if keys is not None else "train_dataset.input_columns"
        raise ConfigError(path, f"no column feeds the model's input_ids (columns -> arguments: {columns})")
    data["columns"] = columns
    for column, argument in columns.items():
        if argument not in USED_ARGS:
            ledger.differs("train_dataset.input_columns", f"{column} -> {argument}: not read; the HF model builds "
                           "its causal mask and position ids itself")
    unused = data["input_columns"][len(columns):]
    if unused:
        ledger.differs("train_dataset.input_columns", f"{', '.join(unused)}: no model argument left to feed "
                       "(MindFormers' DataOrderWrapperCell drops them too)")


def column_roles(input_columns: list[str], construct_args_key: list[str] | None, mcore: bool) -> dict[str, str]:
    """{column: model argument}: zipped with construct_args_key (wrapper.py DataOrderWrapperCell), else by position
    with the model's construct parameters (MFTrainOneStepCell passes the columns positionally)."""
    keys = construct_args_key if construct_args_key is not None else (MCORE_ARGS if mcore else LEGACY_ARGS)
    return dict(zip(input_columns, keys, strict=False))  # unequal lengths: the extra columns feed nothing


def _split(value: object, path: str, ledger: Ledger) -> None:
    """Megatron's "train, valid, test" weights: mf-ds reads every document as training data."""
    parts = [p.strip() for p in str(value).replace("/", ",").split(",")]
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        raise ConfigError(path, f"expected weights such as '98, 1, 1', got {show(value)}") from None
    if any(w < 0 for w in weights) or not sum(weights):
        raise ConfigError(path, f"expected weights >= 0 with a positive sum, got {show(value)}")
    if weights[0] == sum(weights):
        ledger.dropped(path, "every document is training data, as this split says")
    else:
        ledger.differs(path, f"every document is training data here; MindFormers keeps {weights[0] / sum(weights):.0%} "
                       "for training and builds valid/test splits from the rest")


def _megatron_columns(raw: dict, config: dict) -> dict[str, str]:
    """{column: model argument} of a Megatron data set: base_trainer.py `_get_columns_with_strategy` (1.7.0)."""
    if config.get("create_compressed_eod_mask"):
        columns = [*MEGATRON_COLUMNS, "actual_seq_len"]
    elif config.get("create_attention_mask"):
        columns = [*MEGATRON_COLUMNS, "attention_mask"]
    else:
        columns = list(MEGATRON_COLUMNS)
    if "input_columns" in raw:
        columns = coerce(raw["input_columns"], list[str], "train_dataset.input_columns").value
    keys = raw.get("construct_args_key", columns)
    keys = coerce(keys, list[str], "train_dataset.construct_args_key").value
    return dict(zip(columns, keys, strict=False))


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
        elif name == "split":
            _split(config[name], path, ledger)
        elif MEGATRON_CONFIG[name] is None:
            continue  # accounted by translators/attention.py
        elif not MEGATRON_CONFIG[name]:
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
