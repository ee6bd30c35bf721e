"""`build_train_dataset`: the Plan's `run.data` (translators/data.py) -> a `TrainDataset`.

Where the tokens come from, in order:
  1. `override_dir` (the CLI's `--train_dataset_dir`): a directory, a `.jsonl` file or a Megatron path prefix
     (an HFDataLoader YAML: the files its handlers read, through datasets.load_dataset);
     a directory holds either `.bin`/`.idx` pairs or `.jsonl` files, each read once per pass (weights by size);
  2. `kind` "megatron": `paths` and blend `weights` from `data_loader.config.data_path`;
     "json": JSON lines with a "text" field and the local tokenizer in `tokenizer_dir`;
     "builtin": the built-in corpus (text.py); "mindrecord": MindRecord rows (mindrecord.py, rows.py), one
     sample each, from `dataset_dir` (a directory or one file with its shards) or the `dataset_files` as given;
     "hf": MindFormers' HFDataLoader (hfloader.py: datasets.load_dataset and the handlers);
     `refused` (a loader mf-ds does not read): a DataError, unless `override_dir` names other data.
Every token id is checked against the model's vocab_size: before training starts, or, for MindRecord (one row at
a time, decoded on demand), as each row is read.
"""

from __future__ import annotations

import glob
import os

from mf_ds.data.gpt import TrainDataset
from mf_ds.data.indexed import DataError, IndexedDataset
from mf_ds.data.mindrecord import MINDRECORD_NAME, MindRecord, mindrecord_files
from mf_ds.data.rows import RowDataset
from mf_ds.data.text import BUILTIN, ByteTokenizer, builtin_corpus, load_tokenizer, read_jsonl
from translators.plan_types import Data


def build_train_dataset(data: Data, seq_length: int, seed: int, vocab_size: int, tokenizer_dir: str | None = None,
                        override_dir: str | None = None) -> TrainDataset | RowDataset:
    """The training samples for `run.data`; `seed` (run.seed) is used when the data set names none."""
    kind, paths, weights = data.kind, list(data.paths), list(data.weights) or None
    files_as_given = data.files_as_given
    if override_dir and kind == "hf":  # the YAML's handlers on other files: datasets reads them
        from mf_ds.data.hfloader import HFSamples, override

        return HFSamples(override(data.hf, override_dir), seq_length, vocab_size,
                         data.seed if data.seed is not None else seed)
    if override_dir:
        kind, paths = discover(override_dir)
        weights = None
        files_as_given = False
    elif data.refused:
        raise DataError(data.refused.split(":")[0], f"{data.refused.split(': ', 1)[-1]}; give --train_dataset_dir, "
                        "or --set mf_ds.builtin_corpus=true to train on the built-in corpus")
    elif kind == "hf":
        from mf_ds.data.hfloader import HFSamples

        return HFSamples(data.hf, seq_length, vocab_size, data.seed if data.seed is not None else seed)
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
        if files_as_given:
            files = mindrecord_files(dataset_files=paths)
        else:
            files = mindrecord_files(dataset_dir=paths[0] if paths else None)
        columns = dict(data.columns) or {"input_ids": "input_ids"}
        return RowDataset(MindRecord(files), columns, data.shifted, seq_length, vocab_size,
                          data.seed if data.seed is not None else seed, data.shuffle)
    else:
        raise DataError("run.data.kind", f"unknown data kind {kind!r}")
    if weights is not None and (len(weights) != len(sources) or sum(weights) <= 0):
        raise DataError("train_dataset.data_loader.config.data_path", f"weights {weights} do not fit "
                        f"{len(sources)} data sets (one weight each, not all zero)")
    for source in sources:
        _check_vocab(source, vocab_size)
    eod = data.eod if data.eod is not None else eos
    if data.eod_mask_loss and eod is None:
        raise DataError("train_dataset.data_loader.config.eod", "eod_mask_loss needs the eod token id")
    return TrainDataset(sources, weights, seq_length, data.seed if data.seed is not None else seed,
                        data.shuffle, num_samples=data.train_samples, eod=eod,
                        eod_mask_loss=data.eod_mask_loss, pad=data.pad,
                        loss_mask=kind != "megatron" or not data.columns or "loss_mask" in data.columns.values())


def discover(path: str) -> tuple[str, list[str]]:
    """("megatron", prefixes), ("json", files) or ("mindrecord", [path]) for a --train_dataset_dir value."""
    if os.path.isdir(path):
        if any(MINDRECORD_NAME.search(name) for _, _, names in os.walk(path) for name in names):
            return "mindrecord", [path]
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
    if MINDRECORD_NAME.search(path) and os.path.isfile(path):
        return "mindrecord", [path]
    prefix = path[:-4] if path.endswith((".bin", ".idx")) else path
    if os.path.exists(prefix + ".idx") or os.path.exists(prefix + ".bin"):
        return "megatron", [prefix]
    raise DataError(path, "not found: expected a directory, a MindRecord file, a .jsonl file or a Megatron path "
                    "prefix (.bin/.idx)")


def _check_vocab(source, vocab_size: int) -> None:
    lo, hi = source.token_range()
    if hi >= vocab_size:
        raise DataError(source.token_file, f"token id {hi} >= the model's vocab_size {vocab_size}")
    if lo < 0:
        raise DataError(source.token_file, f"negative token id {lo}")
