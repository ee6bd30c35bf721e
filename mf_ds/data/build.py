"""`build_train_dataset`: the Plan's `run.data` (translators/data.py) -> a `TrainDataset`.

Where the tokens come from, in order:
  1. `override_dir` (the CLI's `--train_dataset_dir`): a directory, a `.jsonl` file or a Megatron path prefix;
     a directory holds either `.bin`/`.idx` pairs or `.jsonl` files, each read once per pass (weights by size);
  2. `kind` "megatron": `paths` and blend `weights` from `data_loader.config.data_path`;
     "json": JSON lines with a "text" field and the local tokenizer in `tokenizer_dir`;
     "builtin": the built-in corpus (text.py); "mindrecord": an error, as MindRecord needs MindSpore.
Every token id is checked against the model's vocab_size before training starts.
"""

from __future__ import annotations

import glob
import os

from mf_ds.data.gpt import TrainDataset
from mf_ds.data.indexed import DataError, IndexedDataset
from mf_ds.data.text import BUILTIN, ByteTokenizer, builtin_corpus, load_tokenizer, read_jsonl


def build_train_dataset(data: dict, seq_length: int, seed: int, vocab_size: int, tokenizer_dir: str | None = None,
                        override_dir: str | None = None) -> TrainDataset:
    """The training samples for `run.data`; `seed` (run.seed) is used when the data set names none."""
    kind, paths, weights = data["kind"], list(data["paths"]), list(data["weights"]) or None
    if override_dir:
        kind, paths = discover(override_dir)
        weights = None
    eos = None
    if kind == "builtin":
        if vocab_size < ByteTokenizer.vocab_size:
            raise DataError(BUILTIN, f"the byte-level corpus needs vocab_size >= {ByteTokenizer.vocab_size}, the "
                            f"model has {vocab_size}; give --train_dataset_dir or a larger vocab")
        sources, eos = [builtin_corpus()], ByteTokenizer.eos_token_id
    elif kind == "megatron":
        if not paths:
            raise DataError("train_dataset.data_loader.config.data_path", "no Megatron data paths given")
        sources = [IndexedDataset(path) for path in paths]
    elif kind == "json":
        tokenizer = load_tokenizer(tokenizer_dir)
        sources, eos = [read_jsonl(path, tokenizer) for path in paths], tokenizer.eos_token_id
    elif kind == "mindrecord":
        raise DataError(paths[0] if paths else "train_dataset.data_loader.dataset_dir",
                        "MindRecord files can only be read with MindSpore; convert the data to Megatron .bin/.idx "
                        "or JSON lines and pass --train_dataset_dir")
    else:
        raise DataError("run.data.kind", f"unknown data kind {kind!r}")
    if weights is not None and (len(weights) != len(sources) or sum(weights) <= 0):
        raise DataError("train_dataset.data_loader.config.data_path", f"weights {weights} do not fit "
                        f"{len(sources)} data sets (one weight each, not all zero)")
    for source in sources:
        _check_vocab(source, vocab_size)
    eod = data["eod"] if data["eod"] is not None else eos
    if data["eod_mask_loss"] and eod is None:
        raise DataError("train_dataset.data_loader.config.eod", "eod_mask_loss needs the eod token id")
    return TrainDataset(sources, weights, seq_length, data["seed"] if data["seed"] is not None else seed,
                        data["shuffle"], num_samples=data["train_samples"], eod=eod,
                        eod_mask_loss=data["eod_mask_loss"], pad=data["pad"])


def discover(path: str) -> tuple[str, list[str]]:
    """("megatron", prefixes) or ("json", files) for a --train_dataset_dir value."""
    if os.path.isdir(path):
        halves = glob.glob(os.path.join(path, "*.idx")) + glob.glob(os.path.join(path, "*.bin"))
        pairs = sorted({f[:-4] for f in halves})
        lines = sorted(glob.glob(os.path.join(path, "*.jsonl")))
        if pairs and lines:
            raise DataError(path, "holds both Megatron .bin/.idx files and .jsonl files; point at one kind")
        if pairs:
            return "megatron", pairs  # IndexedDataset names the missing half of a pair
        if lines:
            return "json", lines
        raise DataError(path, "holds no Megatron .bin/.idx pairs and no .jsonl files")
    if path.endswith((".jsonl", ".json")) and os.path.isfile(path):
        return "json", [path]
    prefix = path[:-4] if path.endswith((".bin", ".idx")) else path
    if os.path.exists(prefix + ".idx") or os.path.exists(prefix + ".bin"):
        return "megatron", [prefix]
    raise DataError(path, "not found: expected a directory, a .jsonl file or a Megatron path prefix (.bin/.idx)")


def _check_vocab(source, vocab_size: int) -> None:
    lo, hi = source.token_range()
    if hi >= vocab_size:
        raise DataError(source.token_file, f"token id {hi} >= the model's vocab_size {vocab_size}")
    if lo < 0:
        raise DataError(source.token_file, f"negative token id {lo}")
