"""Megatron's indexed data set: a `.bin` of token ids and an `.idx` that says where each sequence starts.

Layout, as written by Megatron-LM's `megatron/core/datasets/indexed_dataset.py` (`_IndexWriter.write`,
`IndexedDatasetBuilder`), all little-endian:
  .idx  b"MMIDIDX\\x00\\x00"            9-byte magic
        <Q version                     always 1
        <B dtype code                  1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
        <Q S                           sequence count
        <Q D                           document-index count (= documents + 1: the builder starts it with 0)
        int32[S] sequence lengths (tokens)
        int64[S] sequence byte offsets into the .bin
        int64[D] document indices (sequence index where each document starts, then S)
        int8[S]  sequence modes        only in multimodal sets; not read here
  .bin  the token ids of every sequence, back to back, in the dtype above

Megatron's GPTDataset treats each sequence as a document (preprocess_data.py writes one per JSON line unless
--split-sentences), so the reader exposes sequences. Every way the pair can be damaged is a `DataError` naming
the file; numpy and struct never raise past this module.
"""

from __future__ import annotations

import os
import struct

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
HEADER = struct.Struct("<9sQBQQ")  # 34 bytes: magic, version, dtype code, S, D
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
          8: np.uint16}
CODES = {np.dtype(dtype): code for code, dtype in DTYPES.items()}


class DataError(ValueError):
    """A data set that cannot be used as it is; `.path` names the file (or directory, or setting) at fault."""

    def __init__(self, path: str, message: str) -> None:
        self.path = str(path)
        super().__init__(f"{path}: {message}")


class TokenSequences:
    """Sequences laid end to end in one token array: `starts` and `sequence_lengths` index `tokens`."""

    starts: np.ndarray
    sequence_lengths: np.ndarray
    tokens: np.ndarray

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence i."""
        start = int(self.starts[i]) + offset
        stop = int(self.starts[i]) + (int(self.sequence_lengths[i]) if length is None else offset + length)
        return self.tokens[start:stop]


class IndexedDataset(TokenSequences):
    """A validated, memory-mapped Megatron `.bin`/`.idx` pair; `get(i)` returns sequence i's token ids."""

    def __init__(self, path_prefix: str) -> None:
        self.prefix = str(path_prefix)
        self.idx_path, self.bin_path = self.prefix + ".idx", self.prefix + ".bin"
        self.token_file = self.bin_path  # the file a bad token id is reported against
        for path in (self.idx_path, self.bin_path):
            if not os.path.isfile(path):
                raise DataError(path, "missing (a Megatron data set needs both the .bin and the .idx file)")
        self.dtype, lengths, pointers, self.document_indices = _read_index(self.idx_path)
        self.sequence_lengths = lengths.astype(np.int64)
        itemsize = self.dtype.itemsize
        total = int(self.sequence_lengths.sum())
        if len(lengths) == 0 or total == 0:
            raise DataError(self.prefix, f"empty dataset ({len(lengths)} sequences, {total} tokens)")
        size = os.path.getsize(self.bin_path)
        if size != total * itemsize:
            raise DataError(self.bin_path, f".bin size {size} bytes does not match the index (expects "
                            f"{total * itemsize}: {total} tokens of {self.dtype.name})")
        ends = pointers + self.sequence_lengths * itemsize
        if (pointers < 0).any() or (ends > size).any() or (pointers % itemsize).any():
            raise DataError(self.idx_path, "sequence offsets point outside the .bin or between tokens")
        self.starts = pointers // itemsize  # token offsets: the whole .bin is mapped as one array
        self.tokens = np.memmap(self.bin_path, dtype=self.dtype, mode="r")

    def token_range(self) -> tuple[int, int]:
        """(smallest, largest) token id in the .bin; one pass over the file."""
        if self.dtype.kind == "f":
            raise DataError(self.idx_path, f"dtype {self.dtype.name}: token ids must be integers")
        return int(self.tokens.min()), int(self.tokens.max())


def _read_index(path: str) -> tuple[np.dtype, np.ndarray, np.ndarray, np.ndarray]:
    size = os.path.getsize(path)
    if size < HEADER.size:
        raise DataError(path, f"truncated: {size} bytes, shorter than the {HEADER.size}-byte Megatron header")
    with open(path, "rb") as f:
        magic, version, code, n_seq, n_doc = HEADER.unpack(f.read(HEADER.size))
    if magic != MAGIC:
        raise DataError(path, f"not a Megatron index (bad magic {magic!r}, expected {MAGIC!r})")
    if version != 1:
        raise DataError(path, f"unsupported index version {version} (Megatron writes 1)")
    if code not in DTYPES:
        raise DataError(path, f"unknown dtype code {code} (Megatron's codes are 1-8)")
    expected = HEADER.size + 4 * n_seq + 8 * n_seq + 8 * n_doc
    if size < expected:
        holds = max(0, (size - HEADER.size) // 12)
        raise DataError(path, f"truncated: header says {n_seq} sequences and {max(n_doc - 1, 0)} documents "
                        f"({expected} bytes), file holds {size} bytes (at most {holds} sequences)")
    if size not in (expected, expected + n_seq):  # + n_seq: the int8 sequence modes of a multimodal set
        raise DataError(path, f"size {size} bytes does not match the header (expects {expected})")
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    lengths = np.frombuffer(raw, np.int32, n_seq, HEADER.size)
    pointers = np.frombuffer(raw, np.int64, n_seq, HEADER.size + 4 * n_seq)
    documents = np.frombuffer(raw, np.int64, n_doc, HEADER.size + 12 * n_seq)
    if (lengths < 0).any():
        raise DataError(path, "negative sequence length")
    if n_doc == 0 or documents[0] != 0 or documents[-1] != n_seq or (np.diff(documents) < 0).any():
        raise DataError(path, f"corrupt document index (must rise from 0 to the sequence count {n_seq})")
    return np.dtype(DTYPES[code]), lengths, pointers, documents


def write_indexed(path_prefix: str, documents: list[list[int]], dtype: type = np.uint16) -> None:
    """Write `documents` (one sequence each) as `path_prefix.bin` / `.idx`, byte for byte as Megatron would."""
    dtype = np.dtype(dtype)
    if dtype not in CODES:
        raise ValueError(f"dtype {dtype.name} has no Megatron code (use one of {sorted(d.name for d in CODES)})")
    arrays = [np.asarray(doc, dtype=np.int64) for doc in documents]
    info = np.iinfo(dtype) if dtype.kind in "iu" else np.finfo(dtype)
    for i, arr in enumerate(arrays):
        if arr.size and (arr.min() < info.min or arr.max() > info.max):
            raise ValueError(f"document {i}: token ids outside the range of {dtype.name}")
    lengths = np.array([arr.size for arr in arrays], dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(lengths.astype(np.int64) * dtype.itemsize)[:-1]]).astype(np.int64)
    os.makedirs(os.path.dirname(os.path.abspath(path_prefix)), exist_ok=True)
    with open(path_prefix + ".bin", "wb") as f:
        for arr in arrays:
            f.write(arr.astype(dtype).tobytes())
    with open(path_prefix + ".idx", "wb") as f:
        f.write(HEADER.pack(MAGIC, 1, CODES[dtype], len(arrays), len(arrays) + 1))
        f.write(lengths.tobytes())
        f.write(pointers[: len(arrays)].tobytes())
        f.write(np.arange(len(arrays) + 1, dtype=np.int64).tobytes())
