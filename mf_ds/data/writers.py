"""JSON lines -> the formats a YAML may name: Megatron `.bin`/`.idx` and MindRecord (`mf-data --to ...`).

  megatron    one document per line: the "text" tokenised (+ eos), written by indexed.write_indexed, as Megatron's
              preprocess_data.py writes them (BlendedMegatronDatasetDataLoader reads the prefix)
  mindrecord  the documents concatenated (each closed by eos) and cut into rows of `row_length` tokens (the last,
              shorter, dropped), one int32 column "input_ids" [-1], as MindFormers' pretraining MindRecords hold
              them (a legacy model's rows are seq_length + 1 tokens). Written without MindSpore, in the layout
              mindrecord.py reads (MindSpore 2.7.2's FileWriter, version 3.0: one shard, a BLOB_DATA page with one
              row group, a RAW_DATA page with one {"id": 0} map per row, as FileWriter writes for array-only
              schemas; int arrays narrowed as ShardColumn::CompressInt does; the `.db` SQLite index). MindSpore's
              own MindDataset reads it (tests/fixtures/make_hfdata_golden.py `mindrecord PATH`, checked when made).
"""

from __future__ import annotations

import json
import os
import sqlite3
import struct

import numpy as np

from mf_ds.data.indexed import DataError, write_indexed
from mf_ds.data.text import load_tokenizer, read_jsonl

HEADER_SIZE = 1 << 14  # FileWriter's set_header_size as MindFormers' tools call it
MIN_PAGE, MAX_PAGE = 1 << 15, 1 << 28  # FileWriter's page size range (32 KB .. 256 MB)
_RAW_ROW = b"\x81\xa2id\x00"  # msgpack {"id": 0}: FileWriter's raw entry for a row with no scalar column
_WIDTHS = ((np.int8, 0), (np.int16, 1), (np.int32, 2), (np.int64, 3))


def compress_int(values: np.ndarray) -> bytes:
    """ShardColumn::CompressInt: u32 BE count, 2 bits per element (MSB first) naming its width, then the values
    little-endian, each in the narrowest of int8/16/32/64 that holds it."""
    values = np.asarray(values, dtype=np.int64)
    codes = np.full(len(values), 3, dtype=np.uint8)
    for dtype, code in reversed(_WIDTHS):
        info = np.iinfo(dtype)
        codes[(values >= info.min) & (values <= info.max)] = code
    packed = np.zeros((len(values) + 3) // 4, dtype=np.uint8)
    for k in range(4):
        part = codes[k::4]
        packed[: len(part)] |= part << (6 - 2 * k)
    body = b"".join(int(v).to_bytes(1 << int(c), "little", signed=True) for v, c in zip(values, codes, strict=True))
    return struct.pack(">I", len(values)) + packed.tobytes() + body


def write_mindrecord(path: str, rows: list[np.ndarray], column: str = "input_ids", desc: str = "mf-data") -> None:
    """Rows of int32 token ids as a one-shard MindRecord `path` (+ `path.db`)."""
    blobs, raws, saved = [], [], 0
    for row in rows:
        data = compress_int(row)
        saved += 4 * len(row) - len(data)
        blobs.append(struct.pack("<Q", len(data)) + data)  # one blob column: its bytes alone (no BE length)
        raws.append(struct.pack("<Q", len(_RAW_ROW)) + _RAW_ROW)
    blob_page, raw_page = b"".join(blobs), b"".join(raws)
    page_size = MIN_PAGE
    while page_size < max(len(blob_page), len(raw_page)):
        page_size *= 2
    if page_size > MAX_PAGE:
        raise DataError(path, f"{len(blob_page)} bytes of rows exceed one {MAX_PAGE >> 20} MB page: write fewer "
                        "rows per file")
    name = os.path.basename(path)
    header = {"header_size": HEADER_SIZE, "index_fields": None, "page": [
        {"end_row_id": len(rows), "page_id": 0, "page_size": len(blob_page), "page_type": "BLOB_DATA",
         "page_type_id": 0, "row_group_ids": [{"id": 0, "offset": 0}], "shard_id": 0, "start_row_id": 0},
        {"end_row_id": 0, "page_id": 1, "page_size": len(raw_page), "page_type": "RAW_DATA", "page_type_id": 0,
         "row_group_ids": [{"id": 0, "offset": 0}], "shard_id": 0, "start_row_id": 0}],
        "page_size": page_size, "compression_size": saved,
        "schema": [{"blob_fields": [column], "desc": desc, "schema": {column: {"shape": [-1], "type": "int32"}}}],
        "shard_addresses": [name], "shard_id": 0, "statistics": None, "version": "3.0"}
    text = json.dumps(header, separators=(",", ":")).encode()
    if 8 + len(text) > HEADER_SIZE:
        raise DataError(path, "MindRecord header too large")
    for stale in (path, path + ".db"):
        if os.path.exists(stale):
            os.remove(stale)
    with open(path, "wb") as f:
        f.write((struct.pack("<Q", len(text)) + text).ljust(HEADER_SIZE, b"\0"))
        f.write(blob_page.ljust(page_size, b"\0"))
        f.write(raw_page)
    _write_index(path + ".db", name, blobs, raws)


def _write_index(path: str, name: str, blobs: list[bytes], raws: list[bytes]) -> None:
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE INDEXES(  ROW_ID               INT  NOT NULL, PAGE_ID_RAW          INT  NOT NULL, "
               "PAGE_OFFSET_RAW      INT  NOT NULL, PAGE_OFFSET_RAW_END  INT  NOT NULL, ROW_GROUP_ID         INT  NOT "
               "NULL, PAGE_ID_BLOB         INT  NOT NULL, PAGE_OFFSET_BLOB     INT  NOT NULL, PAGE_OFFSET_BLOB_END "
               "INT  NOT NULL, PRIMARY KEY(ROW_ID))")
    db.execute("CREATE TABLE SHARD_NAME(NAME TEXT NOT NULL)")
    blob_at, raw_at, entries = 0, 0, []
    for r, (blob, raw) in enumerate(zip(blobs, raws, strict=True)):
        entries.append((r, 1, raw_at, raw_at + len(raw), 0, 0, blob_at, blob_at + len(blob)))
        blob_at, raw_at = blob_at + len(blob), raw_at + len(raw)
    db.executemany("INSERT INTO INDEXES VALUES (?, ?, ?, ?, ?, ?, ?, ?)", entries)
    db.execute("INSERT INTO SHARD_NAME VALUES (?)", (name,))
    db.commit()
    db.close()


def convert(source: str, to: str, out: str, tokenizer_dir: str | None, row_length: int | None = None) -> dict:
    """`source` (JSON lines with "text") -> `out` in format `to`; returns a summary for the CLI."""
    tokenizer = load_tokenizer(tokenizer_dir)
    docs = read_jsonl(source, tokenizer)
    if to == "megatron":
        documents = [docs.tokens[s:s + n].tolist() for s, n in zip(docs.starts, docs.sequence_lengths, strict=True)]
        top = int(docs.tokens.max())
        write_indexed(out, documents, np.uint16 if top < 65500 else np.int32)
        return {"format": "megatron", "files": [out + ".bin", out + ".idx"], "documents": len(documents)}
    if to != "mindrecord":
        raise DataError("--to", f"{to!r}: expected megatron or mindrecord")
    if not row_length or row_length < 2:
        raise DataError("--row-length", "MindRecord rows need a length (seq_length, or seq_length + 1 for a "
                        "legacy model)")
    n = len(docs.tokens) // row_length
    if n == 0:
        raise DataError(source, f"{len(docs.tokens)} tokens make no row of {row_length}")
    rows = [docs.tokens[i * row_length:(i + 1) * row_length].astype(np.int32) for i in range(n)]
    write_mindrecord(out, rows)
    return {"format": "mindrecord", "files": [out, out + ".db"], "rows": n, "row_length": row_length}
