"""`mf-data PATH [--mf-config x.yaml] [--head N]`: what is in a data set, as JSON lines on stdout.

The first line describes the data set: {"format", "files", "samples", "columns": {name: {"dtype", "shape"}}};
then come its first N samples, each column as a list (bytes as a list of byte values, strings as strings; a NaN or
infinite float as null, since JSON has no such numbers and a strict reader refuses Python's NaN / Infinity).
  MindRecord  a file (with its shards), a directory, as MindFormers' dataset_dir names them; the rows exactly as
              MindSpore's MindDataset(shuffle=False) gives them
  Megatron    a .bin/.idx path prefix (or either file): one sample per sequence, column "tokens"
  JSON lines  a .jsonl / .json file: one sample per line, the objects as written
With --mf-config, PATH defaults to the YAML's train_dataset and each sample line also carries "train": the
{"input_ids", "labels"} the model trains on, under the YAML's column roles, slicing and seq_length (-100: no
loss). The logic is in `describe` and `samples`, which the tests call; `cli` only parses and prints.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Iterator

import numpy as np

from mf_ds.data.build import discover
from mf_ds.data.indexed import DataError, IndexedDataset
from mf_ds.data.mindrecord import MindRecord, mindrecord_files
from mf_ds.data.text import parse_json_line


def open_source(path: str):
    """(format, reader) for PATH: a MindRecord, Megatron or JSON-lines data set."""
    kind, paths = discover(path)
    if kind == "mindrecord":
        return "mindrecord", MindRecord(mindrecord_files(paths[0]))
    if kind == "megatron":
        if len(paths) != 1:
            raise DataError(path, f"holds {len(paths)} Megatron data sets; name one prefix: "
                            + ", ".join(os.path.basename(p) for p in paths))
        return "megatron", IndexedDataset(paths[0])
    if len(paths) != 1:
        raise DataError(path, f"holds {len(paths)} JSON-lines files; name one")
    return "jsonl", _JsonLines(paths[0])


def describe(path: str) -> tuple[dict, object]:
    """The description line of the data set at PATH, and its reader."""
    fmt, source = open_source(path)
    if fmt == "mindrecord":
        columns = {name: {"dtype": c.dtype, "shape": None if c.shape is None else list(c.shape)}
                   for name, c in source.columns.items()}
        files = source.files
    elif fmt == "megatron":
        columns = {"tokens": {"dtype": source.dtype.name, "shape": [-1]}}
        files = [source.idx_path, source.bin_path]
    else:
        columns = source.columns
        files = [source.path]
    return {"format": fmt, "files": files, "samples": len(source), "columns": columns}, source


def samples(source, head: int) -> Iterator[dict]:
    """The first `head` samples, JSON-ready."""
    for i in range(min(head, len(source))):
        if isinstance(source, MindRecord):
            yield {name: jsonable(value) for name, value in source.row(i).items()}
        elif isinstance(source, IndexedDataset):
            yield {"tokens": source.get(i).tolist()}
        else:
            yield jsonable(source.record(i))  # a line may hold NaN / Infinity, which Python's json reads


def jsonable(value):
    """`value` as strict JSON values: bytes as byte values, arrays as lists, NaN and infinities as None (null)."""
    if isinstance(value, bytes):
        return list(value)
    if isinstance(value, (np.ndarray, np.generic)):
        value = value.tolist()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, list):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    return value


class _JsonLines:
    """A JSON-lines file: one object per non-empty line; a bad line is a DataError naming file:line."""

    def __init__(self, path: str) -> None:
        self.path, self.lines = path, []
        with open(path, "rb") as f:
            for number, raw in enumerate(f, 1):
                if raw.strip():
                    self.lines.append(number)
        self.columns = {}
        if self.lines:
            first = self.record(0)
            self.columns = {k: {"dtype": type(v).__name__, "shape": None} for k, v in first.items()}

    def __len__(self) -> int:
        return len(self.lines)

    def record(self, i: int) -> dict:
        number = self.lines[i]
        with open(self.path, "rb") as f:
            for _ in range(number - 1):
                f.readline()
            raw = f.readline()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DataError(f"{self.path}:{number}", f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        record = parse_json_line(text, f"{self.path}:{number}")
        if not isinstance(record, dict):
            raise DataError(f"{self.path}:{number}", "expected a JSON object")
        return record


def training_samples(config: str, path: str | None, head: int, overrides: list[str] = (),
                     ) -> tuple[str, list[dict]]:
    """(the data path, the first `head` samples as the model trains on them) under the YAML's settings."""
    from mf_ds.data.build import build_train_dataset
    from translators.plan import translate_file

    plan = translate_file(config, overrides).plan
    run, data = plan.run, plan.run.data
    if path is None and (data.kind == "builtin" or not data.paths):
        raise DataError(config, "names no data set (train_dataset.data_loader); give PATH")
    vocab = plan.hf_config["vocab_size"] if plan.hf_config else 2**31 - 1
    dataset = build_train_dataset(data, run.seq_length, run.seed, vocab, run.tokenizer_dir, path)
    path = path or data.paths[0]
    out = []
    for i in range(min(head, len(dataset))):
        item = dataset[i]
        out.append({"input_ids": item["input_ids"].tolist(), "labels": item["labels"].tolist()})
    return path, out


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mf-data", description="Show what is in a MindRecord, Megatron .bin/.idx "
                                     "or JSON-lines data set, as JSON lines.")
    parser.add_argument("path", nargs="?", help="data file, shard, directory or Megatron prefix")
    parser.add_argument("--mf-config", help="MindFormers YAML: its data path and the samples as trained")
    parser.add_argument("--head", type=int, default=3, help="samples to print (default 3)")
    parser.add_argument("--set", action="append", default=[], metavar="a.b.c=VALUE",
                        help="with --mf-config: override a YAML key, as mf-translate and mf-train take it")
    args = parser.parse_args(argv)
    if args.path is None and args.mf_config is None:
        parser.error("give PATH or --mf-config")
    from translators.errors import ConfigError

    try:
        trained = None
        path = args.path
        if args.mf_config:
            path, trained = training_samples(args.mf_config, args.path, args.head, args.set)
        summary, source = describe(path)
        print(json.dumps(summary, allow_nan=False))
        for i, sample in enumerate(samples(source, args.head)):
            if trained is not None and i < len(trained):
                sample = {**sample, "train": trained[i]}
            print(json.dumps(sample, ensure_ascii=False, allow_nan=False))
    except (DataError, ConfigError, OSError) as exc:
        print(f"mf-data: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    return 0


def main() -> None:
    sys.exit(cli())


if __name__ == "__main__":
    main()
