"""Training data for mf_ds: the Plan's `run.data` -> samples of `{"input_ids", "labels"}` -> per-rank batches.

  indexed.py  Megatron's `.bin`/`.idx` format: validated memory-mapped reader, writer, `DataError`
  text.py     the built-in byte-level corpus (Python's help topics) and JSON lines with a local HF tokenizer
  mindrecord.py  MindSpore's MindRecord format (header, pages, .db index), memory-mapped, no MindSpore
  rows.py     MindRecord rows as samples, with MindFormers' column roles (labels, loss_mask) and slicing
  gpt.py      Megatron GPTDataset-style samples, weighted blending, and the deterministic batch stream
  build.py    `build_train_dataset`: which source the Plan (or --train_dataset_dir) asks for, vocab checks
  hfloader.py MindFormers' HFDataLoader: datasets.load_dataset, the handler list (handlers.py), packed columns
  writers.py  JSON lines -> Megatron .bin/.idx and MindRecord (`mf-data --to`)

Typical use by the training loop:
    dataset = build_train_dataset(plan.run.data, run.seq_length, run.seed, vocab_size, run.tokenizer_dir,
                                  args.train_dataset_dir)
    for batch in batches(dataset, micro, rank, world, start=step * gas, passes=epochs * repeat): ...
"""

from mf_ds.data.build import build_train_dataset, discover
from mf_ds.data.gpt import IGNORE, TrainDataset, batches
from mf_ds.data.indexed import DataError, IndexedDataset, write_indexed
from mf_ds.data.mindrecord import MindRecord, mindrecord_files
from mf_ds.data.rows import RowDataset
from mf_ds.data.text import ByteTokenizer, builtin_corpus, load_tokenizer, read_jsonl

__all__ = [
    "IGNORE", "ByteTokenizer", "DataError", "IndexedDataset", "MindRecord", "RowDataset", "TrainDataset", "batches",
    "build_train_dataset", "builtin_corpus", "discover", "load_tokenizer", "mindrecord_files", "read_jsonl",
    "write_indexed",
]
