"""MindFormers' HFDataLoader (mindformers/dataset/dataloader/hf_dataloader.py, 1.7.0-2.1.0) for the Plan's
`run.data.hf` (translators/hfdata.py): `datasets.<load_func>(**load)`, then the `handler` list in order, then the
samples the model trains on.

  load       `datasets.load_dataset` (or `load_from_disk`) with the YAML's arguments: local files and directories,
             the hub where the machine reaches it; cached as `datasets` caches. Without `split`, the "train" split.
  handlers   AlpacaInstructDataHandler, CodeAlpacaInstructDataHandler, PackingHandler (mf_ds/data/handlers.py);
             any other `type` is the `datasets.Dataset` method of that name (take, shuffle, rename_column, ...),
             as HFDataLoader.process_dataset falls back to them
  tokenizer  the handler's `tokenizer` section through MindFormers' build_tokenizer (use_legacy False):
             AutoTokenizer.from_pretrained(its pretrained_model_dir, else the YAML's pretrained_model_dir); the Plan
             carries the directory (`hf.tokenizer_dir`)
  samples    unpacked: the rows as they are (input_ids, labels); packed (a PackingHandler): HFDataset's columns
             (handlers.packed_columns). Item i is {"input_ids", "labels" (-100 where loss_mask is 0)} plus, when
             the YAML feeds them to the model, "position_ids" (restarting per document) and "doc_ids" (attention
             within each document: the attention_mask column or the compressed actual_seq_len)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from mf_ds.data import handlers
from mf_ds.data.indexed import DataError

WHERE = "train_dataset.data_loader"
LOAD_FUNCS = ("load_dataset", "load_from_disk")


def load(hf: Mapping[str, Any]):
    """The `datasets.Dataset` the YAML's load arguments name (one line, naming the key, when it cannot load)."""
    import datasets

    func = hf.get("load_func", "load_dataset")
    kwargs = dict(hf["load"])
    try:
        ds = getattr(datasets, func)(**kwargs)
    except (FileNotFoundError, ValueError, TypeError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(WHERE, f"datasets.{func}({_show(kwargs)}) failed: {first}") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(f"{WHERE}.split", f"not given, and the data set has no 'train' split "
                            f"(splits: {', '.join(ds)})")
        ds = ds["train"]
    if not isinstance(ds, datasets.Dataset):
        raise DataError(WHERE, f"datasets.{func} gave a {type(ds).__name__}; streaming data sets are not read")
    return ds


def override(hf: Mapping[str, Any], path: str) -> dict[str, Any]:
    """`hf` reading `path` instead (--train_dataset_dir): a .json / .jsonl file or a directory datasets can load."""
    import os

    if not os.path.exists(path):
        raise DataError(path, "not found (--train_dataset_dir)")
    load = {"path": "json", "data_files": path} if os.path.isfile(path) else {"path": path}
    return {**hf, "load_func": "load_dataset", "load": {**load, "split": "train"}}


def _show(kwargs: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


def load_tokenizer(hf: Mapping[str, Any]):
    from mf_ds.data.text import load_tokenizer as local

    if not hf.get("tokenizer_dir"):
        raise DataError(f"{WHERE}.handler", "a handler needs a tokenizer: give its tokenizer.pretrained_model_dir "
                        "or the YAML's pretrained_model_dir (a local directory with the tokenizer files)")
    return local(hf["tokenizer_dir"])


def process(ds, hf: Mapping[str, Any], progress: bool = True):
    """The handler list applied in order (HFDataLoader.process_dataset)."""
    tokenizer = None
    for i, spec in enumerate(hf.get("handlers", [])):
        spec = dict(spec)
        kind = spec.pop("type")
        where = f"{WHERE}.handler[{i}]"
        try:
            if kind in ("AlpacaInstructDataHandler", "CodeAlpacaInstructDataHandler"):
                tokenizer = tokenizer or load_tokenizer(hf)
                pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else spec.get("pad_token_id", 0)
                fn = handlers.Instruct(tokenizer, kind.startswith("Code"), int(spec["seq_length"]),
                                       bool(spec.get("padding", True)), bool(hf.get("legacy")), pad,
                                       spec.get("ignore_token_id", handlers.IGNORE))
                ds = ds.map(fn, batched=True, remove_columns=ds.column_names, desc=kind)
            elif kind == "PackingHandler":
                ds = _pack(ds, spec, bool(hf.get("mf_labels")), where)
            else:
                ds = getattr(ds, kind)(**spec)
        except DataError:
            raise
        except (KeyError, ValueError, TypeError, IndexError) as exc:
            first = str(exc).splitlines()[0] if str(exc) else ""
            raise DataError(where, f"{kind} failed: {type(exc).__name__}: {first}") from None
    return ds


def _pack(ds, spec: dict, mf_labels: bool, where: str):
    if "input_ids" not in ds.column_names or "labels" not in ds.column_names:
        raise DataError(where, "PackingHandler needs input_ids and labels columns (an instruct handler before it)")
    seq = int(spec["seq_length"])
    if spec.get("pack_strategy", "pack") == "truncate":
        return ds.map(handlers.Truncate(seq), batched=True, batch_size=handlers.TRUNCATE_BATCH,
                      remove_columns=ds.column_names, desc="Packing (truncate)")
    packed = ds.with_format("arrow").map(handlers.Pack(seq, mf_labels), batched=True, batch_size=None,
                                         remove_columns=ds.column_names, desc="Packing")
    return packed.with_format(None)


class HFSamples(Dataset):
    """The HFDataLoader's samples as training items (see the module docstring)."""

    def __init__(self, hf: Mapping[str, Any], seq_length: int, vocab_size: int, seed: int) -> None:
        self.hf, self.seq_length, self.seed = hf, seq_length, seed
        self.shuffle = bool(hf.get("shuffle"))
        ds = process(load(hf), hf)
        self.name = str(hf["load"].get("data_files") or hf["load"].get("path") or hf["load"].get("dataset_path"))
        self.packed = bool(hf.get("packed"))
        need = ["input_ids", "labels"] + (["actual_seq_len"] if self.packed else [])
        missing = [c for c in need if c not in ds.column_names]
        if missing:
            raise DataError(f"{WHERE}.handler", f"the processed data set has no {', '.join(missing)} column "
                            f"(its columns: {', '.join(ds.column_names)}); an instruct handler makes them")
        if len(ds) == 0:
            raise DataError(self.name, "no samples after the handlers")
        self.rows = ds.with_format("numpy", columns=need)
        self._check(vocab_size)
        if self.packed and hf.get("compressed"):  # HFDataset raises per sample; here before training starts
            ends = ds.data.column("actual_seq_len").combine_chunks()
            most = int(np.diff(ends.offsets.to_numpy()).max())
            if most > int(hf["compressed_length"]):
                raise DataError(f"{WHERE}.compressed_eod_mask_length", f"{hf['compressed_length']}: a packed sample "
                                f"holds {most} documents (MindFormers' HFDataset raises the same)")

    def _check(self, vocab_size: int) -> None:
        ids = self.rows[:]["input_ids"]
        lengths = {len(row) for row in ids}
        if lengths != {self.seq_length}:
            raise DataError(self.name, f"samples of {sorted(lengths)[:4]} tokens, the model's seq_length is "
                            f"{self.seq_length}: give the handlers seq_length {self.seq_length} (and padding: True "
                            "or a PackingHandler)")
        flat = np.concatenate(list(ids))
        if flat.max() >= vocab_size or flat.min() < 0:
            raise DataError(self.name, f"token id {int(flat.max())} outside the model's vocabulary [0, {vocab_size})")

    def __len__(self) -> int:
        return len(self.rows)

    def columns(self, i: int) -> dict[str, np.ndarray]:
        """Sample i's columns as HFDataLoader gives them (packed: HFDataset._iter_packed_data's, with doc_ids)."""
        row = self.rows[int(i)]
        if not self.packed:
            return {"input_ids": row["input_ids"].astype(np.int64), "labels": row["labels"].astype(np.int64)}
        length = self.hf.get("compressed_length") if self.hf.get("compressed") else None
        try:
            return handlers.packed_columns(row["input_ids"], row["labels"], row["actual_seq_len"], length)
        except ValueError as exc:
            raise DataError(f"{WHERE}.compressed_eod_mask_length", f"sample {i}: {exc}") from None

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        cols = self.columns(i)
        labels = cols["labels"].copy()
        if "loss_mask" in cols:
            labels[cols["loss_mask"] == 0] = handlers.IGNORE
        item = {"input_ids": torch.from_numpy(cols["input_ids"]), "labels": torch.from_numpy(labels)}
        if self.packed and self.hf.get("positions"):
            item["position_ids"] = torch.from_numpy(cols["position_ids"])
        if self.packed and self.hf.get("documents"):
            item["doc_ids"] = torch.from_numpy(cols["doc_ids"])
        return item

    def pass_order(self, p: int) -> np.ndarray:
        """HFDataLoader's `shuffle` (GeneratorDataset(shuffle=...), default False): a fresh seeded order per pass."""
        if not self.shuffle:
            return np.arange(len(self))
        return np.random.default_rng([self.seed, p, 3]).permutation(len(self))
