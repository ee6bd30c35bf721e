"""`train_dataset.data_loader.type: HFDataLoader` -> the Plan's `run.data` (kind "hf", `run.data.hf`).

MindFormers 1.7.0-2.1.0 (mindformers/dataset/dataloader/hf_dataloader.py): `process_legacy_args` (the old
`packing` / `adaptor_config` keys), `_build_config` (create_attention_mask, create_compressed_eod_mask,
compressed_eod_mask_length, use_broadcast_data, handler, shuffle; the rest are `datasets.<load_func>` arguments),
then `load_dataset`, `process_dataset` (handler types: mindformers.dataset.handler's classes, else a
`datasets.Dataset` method) and HFDataset (packed when a PackingHandler is listed, or create_attention_mask).
The data is built by mf_ds/data/hfloader.py; here: the keys' ledger, the tokenizer's directory, and which packed
columns reach the model (input_columns / construct_args_key, as MindFormers' DataOrderWrapperCell feeds them):
  attention within each document   the attention_mask column (create_compressed_eod_mask False) or actual_seq_len
                                   (True) feeds the model
  restarted position ids           position_ids feeds an mcore model with use_eod_reset (gpt_model.py: GPTModel
                                   discards position_ids otherwise)
"""

from __future__ import annotations

from typing import Any

from translators.errors import ConfigError, join, show
from translators.notes import Ledger
from translators.schema import coerce

BASE = "train_dataset.data_loader"
HANDLERS = ("AlpacaInstructDataHandler", "CodeAlpacaInstructDataHandler", "PackingHandler")
# datasets.Dataset methods a YAML may list (HFDataLoader's fallback): transforms whose arguments a YAML can spell.
# Others (save_to_disk, push_to_hub, to_json, map / filter without a function, ...) are refused.
SOURCE_METHODS = ("take", "skip", "shuffle", "select", "select_columns", "remove_columns", "rename_column",
                  "rename_columns", "sort", "flatten", "flatten_indices")
LOADER_KEYS = {
    "type": None, "handler": None, "packing": None, "adaptor_config": None, "load_func": None,
    "shuffle": "run.data.hf.shuffle (GeneratorDataset's shuffle; default False)",
    "create_attention_mask": None, "create_compressed_eod_mask": None, "compressed_eod_mask_length": None,
    "use_broadcast_data": "dropped",
    "dataset_dir": "dropped", "column_names": "dropped",  # _build_config drops them ("invalid parameters")
    "streaming": None, "size": None, "dataset_state_dir": None, "save_step": None, "resume_step": None,
    "batch_size": "dropped",
}
HANDLER_KEYS = {"AlpacaInstructDataHandler": {"type", "seq_length", "tokenizer", "padding", "is_dynamic",
                                              "pad_token_id", "ignore_token_id"},
                "CodeAlpacaInstructDataHandler": {"type", "seq_length", "tokenizer", "padding", "is_dynamic",
                                                  "pad_token_id", "ignore_token_id"},
                "PackingHandler": {"type", "seq_length", "pack_strategy", "tokenizer"}}


def parse_hf(loader: dict, data: dict, mcore: bool, ledger: Ledger) -> None:
    """data["kind"] = "hf" and data["hf"]: the load arguments, the handler list, packed or not."""
    if not mcore:
        raise ConfigError(join(BASE, "type"), "HFDataLoader with a legacy model (use_legacy: True): the instruct "
                          "handlers shift the labels and the legacy model shifts them again; mf-ds reads "
                          "HFDataLoader data for mcore models (use_legacy: False), as the 1.8-2.1 YAMLs use it")
    if loader.get("streaming"):
        raise ConfigError(join(BASE, "streaming"), "streaming HFDataLoader data sets are not read by mf-ds; "
                          "drop streaming (the data is prepared once and cached by datasets)")
    handler = loader.get("handler") or []
    if isinstance(handler, dict):
        handler = [handler]
    if not isinstance(handler, list) or not all(isinstance(h, dict) and isinstance(h.get("type"), str)
                                                 for h in handler):
        raise ConfigError(join(BASE, "handler"), f"expected a list of mappings with a 'type', got {show(handler)}")
    handler = _legacy_args(loader, [dict(h) for h in handler])
    for i, spec in enumerate(handler):
        _check_handler(spec, join(join(BASE, "handler"), i), ledger)
    func = loader.get("load_func", "load_dataset")
    if func not in ("load_dataset", "load_from_disk"):
        raise ConfigError(join(BASE, "load_func"), f"{show(func)}: mf-ds loads with datasets.load_dataset or "
                          "datasets.load_from_disk")
    load = {k: v for k, v in loader.items() if k not in LOADER_KEYS}
    if not (load.get("path") or load.get("dataset_path") or load.get("data_files")):
        raise ConfigError(join(BASE, "path"), "HFDataLoader names no data set (path / data_files)")
    packing = any(h["type"] == "PackingHandler" for h in handler)
    compressed = bool(coerce(loader.get("create_compressed_eod_mask", False), bool,
                             join(BASE, "create_compressed_eod_mask")).value)
    adaptor = loader.get("adaptor_config") if isinstance(loader.get("adaptor_config"), dict) else {}
    compressed = compressed or bool(adaptor.get("compress_mask", False))
    length = coerce(loader.get("compressed_eod_mask_length", adaptor.get("eod_pad_length", 128)), int,
                    join(BASE, "compressed_eod_mask_length")).value
    packed = packing or bool(loader.get("create_attention_mask", False))  # _is_pack_mode
    if packed and not packing:
        raise ConfigError(join(BASE, "create_attention_mask"), "True without a PackingHandler: MindFormers' "
                          "HFDataset then reads an actual_seq_len column the handlers never made")
    if not packed and any(h.get("padding") is False for h in handler if "Instruct" in h["type"]):
        raise ConfigError(join(BASE, "handler"), "an instruct handler with padding: False and no PackingHandler "
                          "gives rows of varying length; set padding: True or add a PackingHandler")
    data.update(kind="hf", paths=[str(load.get("data_files") or load.get("path") or load.get("dataset_path"))])
    data["hf"] = {"load_func": func, "load": load, "handlers": handler, "packed": packed, "compressed": compressed,
                  "compressed_length": length, "shuffle": bool(loader.get("shuffle", False)), "legacy": False,
                  "mf_labels": False, "tokenizer_dir": None, "documents": False, "positions": False}
    _ledger(loader, load, packed, compressed, ledger)


def _legacy_args(loader: dict, handler: list[dict]) -> list[dict]:
    """process_legacy_args (hf_dataloader.py): `packing` turns padding off and sets the pack strategy."""
    packing = loader.get("packing")
    for spec in handler:
        if spec["type"] == "AlpacaInstructDataHandler" and (packing or spec.get("is_dynamic", False)):
            spec["padding"] = False
        if spec["type"] == "PackingHandler":
            spec.setdefault("pack_strategy", packing or "pack")
            spec.pop("tokenizer", None)  # rebuilt without it: its pad id is 0
    return handler


def _check_handler(spec: dict, path: str, ledger: Ledger) -> None:
    kind = spec["type"]
    if kind in HANDLERS:
        for key in spec:
            if key not in HANDLER_KEYS[kind]:
                ledger.unknown(join(path, key), f"not a {kind} argument; ignored")
            elif key == "tokenizer" and isinstance(spec[key], dict):
                for name, value in spec[key].items():
                    where = join(join(path, key), name)
                    if name == "pretrained_model_dir":
                        ledger.runtime(where, "the tokenizer's directory (run.data.hf.tokenizer_dir)")
                    elif name == "trust_remote_code" and value:
                        ledger.differs(where, "True: mf-ds loads the tokenizer's files only and runs no code "
                                       "from its directory (a tokenizer.json loads without it)")
                    else:
                        ledger.dropped(where, "AutoTokenizer setting with no effect on the handler's ids")
            elif key != "type":
                ledger.runtime(join(path, key), f"{kind} argument (mf_ds/data/handlers.py)")
        spec["seq_length"] = coerce(spec.get("seq_length"), int, join(path, "seq_length")).value
        if kind == "PackingHandler" and spec.get("pack_strategy") not in ("pack", "truncate"):
            raise ConfigError(join(path, "pack_strategy"), f"expected 'pack' or 'truncate', got "
                              f"{show(spec.get('pack_strategy'))}")
        ledger.runtime(join(path, "type"), f"{kind} (mf_ds/data/handlers.py)")
    elif kind in SOURCE_METHODS:
        ledger.runtime(join(path, "type"), f"datasets.Dataset.{kind}({', '.join(k for k in spec if k != 'type')})")
        for key in spec:
            if key != "type":
                ledger.runtime(join(path, key), f"datasets.Dataset.{kind} argument")
    else:
        raise ConfigError(join(path, "type"), f"{show(kind)}: not a MindFormers handler ({', '.join(HANDLERS)}) "
                          f"nor a datasets.Dataset method mf-ds applies ({', '.join(SOURCE_METHODS)})")


def _ledger(loader: dict, load: dict, packed: bool, compressed: bool, ledger: Ledger) -> None:
    for name in loader:
        path = join(BASE, name)
        how = LOADER_KEYS.get(name, "load")
        if how == "load":
            ledger.runtime(path, f"datasets.load_dataset argument {name}")
        elif how == "dropped":
            ledger.dropped(path, "MindSpore pipeline / broadcast setting; mf-ds builds the data on every rank")
        elif how:
            ledger.runtime(path, how)
    if "load_func" in loader:
        ledger.runtime(join(BASE, "load_func"), f"datasets.{loader['load_func']}")
    for name in ("packing", "adaptor_config"):
        if name in loader:
            ledger.runtime(join(BASE, name), "MindFormers' legacy argument, converted as process_legacy_args does")
    if "create_attention_mask" in loader:
        ledger.runtime(join(BASE, "create_attention_mask"), f"packed samples: {packed}")
    for name in ("create_compressed_eod_mask", "compressed_eod_mask_length"):
        if name in loader and not packed:
            ledger.dropped(join(BASE, name), "the samples are not packed (no PackingHandler)")
        elif name in loader and name == "compressed_eod_mask_length":
            ledger.runtime(join(BASE, name), "at most this many documents per packed sample with "
                           "create_compressed_eod_mask (HFDataset raises past it; so does mf-ds)")


def finish(data: dict, tree: dict, extra: Any, ledger: Ledger) -> None:
    """After the columns are known: the tokenizer's directory, the packing-labels choice, what feeds the model."""
    if extra.builtin_corpus:
        named = data.get("refused") or (data["kind"] != "builtin" and f"{data['kind']} data")
        data.update(kind="builtin", paths=[], weights=[], hf=None, refused=None, columns={})
        ledger.runtime("mf_ds.builtin_corpus", "the built-in corpus" + (f" instead of the YAML's {named}"
                                                                        if named else ""))
        return
    hf = data.get("hf")
    if hf is None:
        return
    hf["mf_labels"] = bool(extra.mindformers_packing_labels)
    hf["tokenizer_dir"] = _tokenizer_dir(hf, tree, extra)
    fed = set(data["columns"].values())
    hf["documents"] = hf["packed"] and ("actual_seq_len" if hf["compressed"] else "attention_mask") in fed
    model = ((tree.get("model") or {}).get("model_config") or {}) if isinstance(tree.get("model"), dict) else {}
    hf["positions"] = hf["packed"] and "position_ids" in fed and bool(model.get("use_eod_reset", False))
    cp = (tree.get("parallel_config") or {}).get("context_parallel", 1) if isinstance(tree.get("parallel_config"),
                                                                                      dict) else 1
    if (hf["documents"] or hf["positions"]) and isinstance(cp, int) and cp > 1:
        raise ConfigError("parallel_config.context_parallel", f"{cp} (DeepSpeed Ulysses) cannot run the packed "
                          "samples' per-document attention or positions: its attention is plain causal",
                          "drop the attention_mask / actual_seq_len column from input_columns, or context_parallel")
    if hf["packed"]:
        seen = "attention within each document" if hf["documents"] else \
            "causal attention across the packed documents (no attention_mask / actual_seq_len column feeds it)"
        ledger.runtime(join(BASE, "create_compressed_eod_mask"), f"{hf['compressed']}: the model sees {seen}; "
                       "position ids " + ("restart per document" if hf["positions"] else
                                          "0..S-1 (GPTModel reads position_ids only with use_eod_reset)"))
        where = join(join(BASE, "handler"), next(i for i, h in enumerate(hf["handlers"])
                                                 if h["type"] == "PackingHandler"))
        if not hf["mf_labels"]:
            ledger.differs(join(where, "type"), "PackingHandler: each packed document trains on the next token, "
                           "as the instruct handler's labels say; MindFormers shifts them once more (labels[1:] + "
                           "[0]: the token two ahead, each document's last position on id 0); "
                           "mf_ds.mindformers_packing_labels: true reproduces that")
        else:
            ledger.runtime("mf_ds.mindformers_packing_labels", "packed labels as MindFormers' PackingHandler makes "
                           "them (labels[1:] + [0] per document)")


def _tokenizer_dir(hf: dict, tree: dict, extra: Any) -> str | None:
    """mf_ds.tokenizer_dir, else the handler's tokenizer.pretrained_model_dir, else the YAML's pretrained_model_dir
    (build_tokenizer with use_legacy False: models/build_tokenizer.py)."""
    if extra.tokenizer_dir:
        return extra.tokenizer_dir
    for spec in hf["handlers"]:
        section = spec.get("tokenizer")
        if isinstance(section, dict) and section.get("pretrained_model_dir"):
            return str(section["pretrained_model_dir"])
    top = tree.get("pretrained_model_dir")
    return str(top) if top else None
