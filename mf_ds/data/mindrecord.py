"""MindSpore's MindRecord format, read without MindSpore: the standard library's sqlite3, numpy and a memory map.

Layout, from mindspore/ccsrc/minddata/mindrecord (shard_header.cc, shard_writer.cc, shard_index_generator.cc,
shard_column.cc, shard_reader.cc) and checked against the files FileWriter writes (tests/fixtures/mindformers/
mindrecord, made by MindSpore 2.7.2):
  <file>     u64 LE n, then n bytes of JSON: header_size, page_size, page[...], schema[{desc, blob_fields, schema}],
             shard_addresses (the names of every shard written together), shard_id, version, compression_size, ...
             Page p starts at byte header_size + p * page_size and uses page[p]["page_size"] bytes of it (the last
             page is not padded). A BLOB_DATA page holds one row group (page_type_id): rows start_row_id..end_row_id,
             each u64 LE length + the row's blob. A RAW_DATA page holds, per row, u64 LE length + a msgpack map of
             the columns that are not blobs.
  <file>.db  SQLite: INDEXES(ROW_ID, PAGE_ID_RAW, PAGE_OFFSET_RAW, PAGE_OFFSET_RAW_END, ROW_GROUP_ID, PAGE_ID_BLOB,
             PAGE_OFFSET_BLOB, PAGE_OFFSET_BLOB_END, ...): offsets inside the page, *_OFFSET at the length prefix,
             *_END past the data. SHARD_NAME(NAME): the file's own name (ShardReader::Init refuses a mismatch).
  columns    a column with a "shape", or of type bytes, is a blob column; int32/int64/float32/float64 scalars and
             strings live in the msgpack map. A row's blob is the one blob column's bytes, or, with several, each
             of blob_fields in order as u64 BE length + bytes. From version 3.0 on, int32/int64 array columns are
             stored narrowed (ShardColumn::CompressInt): u32 BE count, 2 bits per element (MSB first: 0 int8,
             1 int16, 2 int32, 3 int64), then each value little-endian in its own width.
Row order is MindDataset's with shuffle=False: the files in the order given (one file stands for its whole shard
group, in shard_addresses order), then each file's rows by ROW_ID. Values come back as MindDataset gives them:
numpy arrays for array columns, numpy scalars for number columns, `bytes`, `str`.

Every file is memory-mapped and a row is decoded only when asked for, so a data set larger than RAM reads as
well as a small one. Damage (a truncated page, an index that disagrees with its file, a missing shard or index)
is a `DataError` naming the file. A hostile file is refused the same way (issue 23): every header number is an
int in range (checked Python ints, no numpy wrap), shard_addresses are file names in the shard's own folder, and
the .db must hold plain tables (a view can recurse forever; no trigger), with as many rows as the header says.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import struct
from dataclasses import dataclass

import numpy as np

from mf_ds.data.indexed import DataError

# MindFormers' CausalLanguageModelDataset._process_mindrecord_data: files whose name ends "mindrecord" + digits.
MINDRECORD_NAME = re.compile(r"mindrecord\d*$")
NUMBER_TYPES = {"int32": np.int32, "int64": np.int64, "float32": np.float32, "float64": np.float64}
TYPES = (*NUMBER_TYPES, "bytes", "string")
_INDEX_COLUMNS = ("ROW_ID", "ROW_GROUP_ID", "PAGE_ID_RAW", "PAGE_OFFSET_RAW", "PAGE_OFFSET_RAW_END", "PAGE_ID_BLOB",
                  "PAGE_OFFSET_BLOB", "PAGE_OFFSET_BLOB_END")
_LENGTH = 8  # the u64 length prefix of every raw and blob entry
_MAX = 2**62  # any header number past this is damage (no file or row count comes near it); int64 math stays exact
_MAX_DIMS = 32  # numpy's own limit on an array's dimensions


@dataclass(frozen=True)
class Column:
    """One schema column."""

    name: str
    dtype: str  # int32 | int64 | float32 | float64 | bytes | string
    shape: tuple[int, ...] | None  # None: a scalar (or bytes / string); -1 marks the variable dimension
    blob: bool  # stored in the blob page (arrays, bytes) rather than the msgpack map

    def describe(self) -> str:
        if self.shape is None:
            return self.dtype
        return f"{self.dtype}[{', '.join('*' if d == -1 else str(d) for d in self.shape)}]"


def mindrecord_files(dataset_dir: str | None = None, dataset_files: list[str] | str | None = None) -> list[str]:
    """The files MindFormers hands MindDataset for `data_loader.dataset_dir` / `dataset_files`.

    causal_language_model_dataset.py (_process_mindrecord_data): a directory is searched recursively for names
    ending in "mindrecord" + digits, sorted; a single file stands for its shard group (MindDataset then loads every
    shard named in its header, shard_reader.cc Init); dataset_files is taken as given. dataset_dir wins.
    """
    if dataset_dir:
        if os.path.isdir(dataset_dir):
            found = sorted(os.path.join(root, name) for root, _, names in os.walk(dataset_dir)
                           for name in names if MINDRECORD_NAME.search(name))
            if not found:
                raise DataError(dataset_dir, "holds no MindRecord files (names ending in .mindrecord or "
                                ".mindrecord<N>, searched recursively)")
            return found
        if not MINDRECORD_NAME.search(dataset_dir):
            raise DataError(dataset_dir, "not a directory and not a MindRecord file name (*.mindrecord or "
                            "*.mindrecord<N>): MindFormers would find no data here")
        if not os.path.isfile(dataset_dir):
            raise DataError(dataset_dir, "missing")
        return shard_group(dataset_dir)
    if dataset_files:
        files = [dataset_files] if isinstance(dataset_files, str) else list(dataset_files)
        for path in files:
            if not os.path.isfile(path):
                raise DataError(path, "missing (named by train_dataset.data_loader.dataset_files)")
        return files
    raise DataError("train_dataset.data_loader", "MindDataset needs dataset_dir or dataset_files")


def shard_group(path: str) -> list[str]:
    """Every shard written with `path` (its header's shard_addresses, beside it), in shard order."""
    header = _read_header(path)
    names = header.get("shard_addresses")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise DataError(path, "header has no shard_addresses list")
    for name in names:
        # MindSpore writes the shards' file names; a path (absolute, or through `..`) would read outside the data set.
        if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
            raise DataError(path, f"shard_addresses entry {name[:200]!r} is not a file name: the shards of a data "
                            "set are read from its own folder only")
    files = [os.path.join(os.path.dirname(path), name) for name in names]
    for name in files:
        if not os.path.isfile(name):
            raise DataError(name, f"missing: shard {files.index(name)} of the {len(files)} that {path} names in its "
                            "header")
    return files


class MindRecord:
    """Validated, memory-mapped MindRecord files read as one data set; `row(i)` decodes row i."""

    def __init__(self, files: list[str]) -> None:
        if not files:
            raise DataError("MindRecord", "no files given")
        self.files = [str(f) for f in files]
        self.shards = [_Shard(path) for path in self.files]
        first = self.shards[0]
        for shard in self.shards[1:]:
            if shard.schema != first.schema or shard.blob_fields != first.blob_fields:
                raise DataError(shard.path, f"schema differs from {first.path}'s: files of one data set must share "
                                "it (MindSpore refuses them too)")
        self.columns = first.columns
        self.starts = np.cumsum([0] + [len(s) for s in self.shards])
        self.prefix = self.files[0] if len(self.files) == 1 else f"{self.files[0]} (+{len(self.files) - 1} files)"

    def __len__(self) -> int:
        return int(self.starts[-1])

    def locate(self, i: int) -> tuple[_Shard, int]:
        """(file, row within it) of row i."""
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} of {len(self)}")
        k = int(np.searchsorted(self.starts, i, side="right")) - 1
        return self.shards[k], i - int(self.starts[k])

    def row(self, i: int, columns: list[str] | None = None) -> dict:
        shard, r = self.locate(i)
        return shard.row(r, columns)


class _Shard:
    """One MindRecord file and its .db index."""

    def __init__(self, path: str) -> None:
        self.path = path
        header = _read_header(path)
        try:
            self.header_size, self.page_size = _number(header, "header_size"), _number(header, "page_size")
            (schema_entry,) = header["schema"]
            self.schema, self.blob_fields = dict(schema_entry["schema"]), list(schema_entry["blob_fields"])
            if not isinstance(header["page"], list) or not all(isinstance(p, dict) for p in header["page"]):
                raise TypeError("page is not a list of page entries")
            pages = sorted(header["page"], key=lambda p: _number(p, "page_id", "page entry"))
            for page in pages:
                for key in ("page_type_id", "start_row_id", "end_row_id", "page_size"):
                    _number(page, key, f"page {page['page_id']}")
                if page["end_row_id"] < page["start_row_id"]:
                    raise ValueError(f"page {page['page_id']}: end_row_id before start_row_id")
                if not isinstance(page.get("page_type"), str):
                    raise TypeError(f"page {page['page_id']}: page_type {page.get('page_type')!r} is not a name")
            self.version = str(header["version"])
        except (KeyError, TypeError, ValueError) as exc:
            raise DataError(path, f"header is not a MindRecord header ({type(exc).__name__}: {exc})") from None
        if not all(isinstance(name, str) for name in self.blob_fields):
            raise DataError(path, "header is not a MindRecord header (blob_fields holds a non-name)")
        self.columns = _columns(path, self.schema, self.blob_fields)
        self.blob_columns = [self.columns[name] for name in self.blob_fields]
        self.compressed = self.version >= "3.0"  # shard_reader.cc Init: version < 3.0 has no int compression
        size = os.path.getsize(path)
        self.page_type, self.page_group, self.page_used = [], [], []
        self.page_rows: list[tuple[int, int]] = []
        for expect, page in enumerate(pages):
            if page.get("page_id") != expect:
                raise DataError(path, f"header lists page {page.get('page_id')} where page {expect} should be")
            used = int(page["page_size"])
            end = self.header_size + expect * self.page_size + used
            if used > self.page_size or end > size:
                raise DataError(path, f"truncated: page {expect} ends at byte {end}, the file holds {size} bytes")
            self.page_type.append(page["page_type"])
            self.page_group.append(int(page["page_type_id"]))
            self.page_used.append(used)
            self.page_rows.append((int(page["start_row_id"]), int(page["end_row_id"])))
        self.data = np.memmap(path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
        self._read_index()

    def __len__(self) -> int:
        return len(self.blob_start)

    def _read_index(self) -> None:
        db = self.path + ".db"
        if not os.path.isfile(db):
            raise DataError(db, f"missing: the SQLite index MindSpore writes beside {os.path.basename(self.path)}")
        own = os.path.basename(self.path)
        blob_pages = [p for p, kind in enumerate(self.page_type) if kind == "BLOB_DATA"]
        expected = sum(self.page_rows[p][1] - self.page_rows[p][0] for p in blob_pages)
        try:
            con = sqlite3.connect(f"file:{db}?mode=ro&immutable=1", uri=True)
            try:
                # Plain tables only: a view runs a query of the file's choosing (a recursive one never ends), and
                # nothing here should have triggers. Then no more rows are read than the header promises.
                kinds = dict(con.execute("SELECT name, type FROM sqlite_master WHERE type IN ('table', 'view') "
                                         "AND name IN ('INDEXES', 'SHARD_NAME')").fetchall())
                extra = con.execute("SELECT type, name FROM sqlite_master WHERE type IN ('view', 'trigger') "
                                    "LIMIT 1").fetchone()
                if extra or kinds.get("INDEXES") != "table" or kinds.get("SHARD_NAME") != "table":
                    what = f"a {extra[0]} ({extra[1]!r})" if extra else \
                        "no INDEXES and SHARD_NAME tables"
                    raise DataError(db, f"not a MindRecord index: it holds {what}; MindSpore writes plain tables")
                names = con.execute("SELECT NAME FROM SHARD_NAME LIMIT 2").fetchall()
                count = con.execute("SELECT COUNT(*) FROM INDEXES").fetchone()[0]
                if names and names[0][0] == own and count == expected:
                    typed = " AND ".join(f"typeof({c}) = 'integer'" for c in _INDEX_COLUMNS)
                    odd = con.execute(f"SELECT ROW_ID FROM INDEXES WHERE NOT ({typed}) LIMIT 1").fetchone()
                    if odd:
                        raise DataError(db, f"row {odd[0]!r} holds a value that is not an integer: the index does "
                                        "not match the file")
                    cursor = con.execute(f"SELECT {', '.join(_INDEX_COLUMNS)} FROM INDEXES ORDER BY ROW_ID "
                                         f"LIMIT {int(expected)}")
                    rows = np.fromiter(cursor, dtype=[(name, np.int64) for name in _INDEX_COLUMNS], count=count)
            finally:
                con.close()
        except (sqlite3.Error, ValueError, TypeError, OverflowError) as exc:
            if isinstance(exc, DataError):
                raise
            raise DataError(db, f"not a MindRecord index ({type(exc).__name__}: {exc})") from None
        if not names or names[0][0] != own:
            raise DataError(db, f"index of {names[0][0] if names else 'no file'!r}, not of {own!r} (ShardReader "
                            "refuses this pairing too)")
        if count != expected:
            raise DataError(db, f"lists {count} rows, the header of {own} {expected}: the index does not match "
                            "the file")
        rows = rows.copy()
        for name in _INDEX_COLUMNS:
            if count and (rows[name].min() <= -_MAX or rows[name].max() >= _MAX):
                raise DataError(db, f"{name} holds a value past 2^62: the index does not match {own}")
        if count and not np.array_equal(rows["ROW_ID"], np.arange(count)):
            raise DataError(db, f"row ids are not 0..{count - 1}: the index does not match {own}")
        n_pages = len(self.page_type)
        kinds = np.array([{"BLOB_DATA": 0, "RAW_DATA": 1}.get(k, 2) for k in self.page_type] + [2])
        used = np.array(self.page_used + [0], dtype=np.int64)
        group = np.array(self.page_group + [-1], dtype=np.int64)
        first = np.array([r[0] for r in self.page_rows] + [0], dtype=np.int64)
        last = np.array([r[1] for r in self.page_rows] + [0], dtype=np.int64)
        checks = []
        for kind, page, start, end in ((0, "PAGE_ID_BLOB", "PAGE_OFFSET_BLOB", "PAGE_OFFSET_BLOB_END"),
                                       (1, "PAGE_ID_RAW", "PAGE_OFFSET_RAW", "PAGE_OFFSET_RAW_END")):
            p = np.where((rows[page] >= 0) & (rows[page] < n_pages), rows[page], n_pages)
            checks.append(kinds[p] != kind)
            checks.append((rows[start] < 0) | (rows[end] < rows[start] + _LENGTH) | (rows[end] > used[p]))
        blob_page = np.where(checks[0], n_pages, rows["PAGE_ID_BLOB"])
        checks.append((group[blob_page] != rows["ROW_GROUP_ID"]) | (rows["ROW_ID"] < first[blob_page])
                      | (rows["ROW_ID"] >= last[blob_page]))
        bad = np.logical_or.reduce(checks) if count else np.zeros(0, bool)
        if bad.any():
            r = int(np.argmax(bad))
            raise DataError(db, f"row {r} points outside the pages of {own} (blob page {rows['PAGE_ID_BLOB'][r]}, "
                            f"raw page {rows['PAGE_ID_RAW'][r]}): the index does not match the file")
        base = self.header_size + _LENGTH
        self.blob_start = base + rows["PAGE_ID_BLOB"] * self.page_size + rows["PAGE_OFFSET_BLOB"]
        self.blob_len = (rows["PAGE_OFFSET_BLOB_END"] - rows["PAGE_OFFSET_BLOB"] - _LENGTH).astype(np.uint32)
        self.raw_start = base + rows["PAGE_ID_RAW"] * self.page_size + rows["PAGE_OFFSET_RAW"]
        self.raw_len = (rows["PAGE_OFFSET_RAW_END"] - rows["PAGE_OFFSET_RAW"] - _LENGTH).astype(np.uint32)

    def _entry(self, r: int, start: int, length: int, what: str) -> bytes:
        prefix = int.from_bytes(self.data[start - _LENGTH:start].tobytes(), "little")
        if prefix != length:
            raise DataError(self.path, f"row {r}: its {what} entry says {prefix} bytes where the index says "
                            f"{length} (a damaged page, or an index of another file)")
        return self.data[start:start + length].tobytes()

    def row(self, r: int, columns: list[str] | None = None) -> dict:
        names = list(self.columns) if columns is None else columns
        out = {}
        if any(not self.columns[n].blob for n in names):
            raw = self._entry(r, int(self.raw_start[r]), int(self.raw_len[r]), "raw")
            try:
                fields = _Msgpack(raw).value()
            except (ValueError, IndexError, struct.error, UnicodeDecodeError) as exc:
                raise DataError(self.path, f"row {r}: raw data is not msgpack ({exc})") from None
            if not isinstance(fields, dict):
                raise DataError(self.path, f"row {r}: raw data is not a map of columns")
        if any(self.columns[n].blob for n in names):
            blob = self._entry(r, int(self.blob_start[r]), int(self.blob_len[r]), "blob")
            parts = self._split_blob(r, blob)
        for name in names:
            column = self.columns[name]
            try:
                out[name] = _blob_value(column, parts[name], self.compressed) if column.blob else \
                    _raw_value(column, fields[name])
            except (KeyError, ValueError, IndexError, TypeError, OverflowError) as exc:
                raise DataError(self.path, f"row {r}, column {name!r}: cannot decode ({type(exc).__name__}: "
                                f"{exc})") from None
        return out

    def _split_blob(self, r: int, blob: bytes) -> dict[str, bytes]:
        if len(self.blob_fields) == 1:
            return {self.blob_fields[0]: blob}
        parts, at = {}, 0
        for name in self.blob_fields:
            if at + _LENGTH > len(blob):
                raise DataError(self.path, f"row {r}: blob ends before column {name!r}")
            n = int.from_bytes(blob[at:at + _LENGTH], "big")
            at += _LENGTH
            if at + n > len(blob):
                raise DataError(self.path, f"row {r}: column {name!r} runs {at + n - len(blob)} bytes past the blob")
            parts[name] = blob[at:at + n]
            at += n
        return parts


def _read_header(path: str) -> dict:
    if not os.path.isfile(path):
        raise DataError(path, "missing")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(_LENGTH)
        if len(head) < _LENGTH:
            raise DataError(path, f"not a MindRecord file ({size} bytes, shorter than its header length)")
        n = int.from_bytes(head, "little")
        if n > size - _LENGTH:
            raise DataError(path, f"not a MindRecord file, or truncated: the header length says {n} bytes, the file "
                            f"holds {size}")
        text = f.read(n)
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, ValueError):  # ValueError: JSONDecodeError, or an int of over 4300 digits
        raise DataError(path, "not a MindRecord file (its header is not JSON)") from None
    except RecursionError:
        raise DataError(path, "not a MindRecord file (its header is JSON nested too deeply)") from None
    if not isinstance(header, dict) or "schema" not in header or "page" not in header:
        raise DataError(path, "not a MindRecord file (its header has no schema and pages)")
    return header


def _columns(path: str, schema: dict, blob_fields: list[str]) -> dict[str, Column]:
    unknown = [name for name in blob_fields if name not in schema]
    if unknown:
        raise DataError(path, f"blob_fields names {unknown[0][:100]!r}, which the schema does not have")
    columns = {}
    for name, spec in schema.items():
        kind = spec.get("type") if isinstance(spec, dict) else None
        if kind not in TYPES:
            raise DataError(path, f"column {name!r}: unknown type {kind!r} (MindRecord has {', '.join(TYPES)})")
        shape = spec.get("shape")
        if shape is not None:
            if not isinstance(shape, list) or len(shape) > _MAX_DIMS or not all(
                    isinstance(d, int) and not isinstance(d, bool) and (d == -1 or 0 < d < 2**31) for d in shape) \
                    or shape.count(-1) > 1:
                raise DataError(path, f"column {name!r}: shape {str(shape)[:200]} is not a list of sizes (positive "
                                "ints, at most one -1)")
            shape = tuple(shape)
        blob = name in blob_fields
        if blob != (shape is not None or kind == "bytes"):
            raise DataError(path, f"column {name!r}: blob_fields disagrees with the schema")
        columns[name] = Column(name, kind, shape, blob)
    return columns


def _number(entry: dict, key: str, where: str = "header") -> int:
    """entry[key] as a non-negative int below _MAX (a float, a string or 1e300 is damage, not a size)."""
    value = entry[key]
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _MAX:
        raise ValueError(f"{where}: {key} {str(value)[:50]!r} is not a size")
    return value


def _raw_value(column: Column, value):
    if column.dtype == "string":
        if not isinstance(value, str):
            raise TypeError(f"expected a string, got {type(value).__name__}")
        return value
    return NUMBER_TYPES[column.dtype](value)


def _blob_value(column: Column, data: bytes, compressed: bool):
    if column.dtype == "bytes":
        return data
    dtype = np.dtype(NUMBER_TYPES[column.dtype])
    if compressed and column.dtype in ("int32", "int64"):
        values = uncompress_int(data).astype(dtype)
    else:
        if len(data) % dtype.itemsize:
            raise ValueError(f"{len(data)} bytes is not a whole number of {dtype.name}")
        values = np.frombuffer(data, dtype=dtype.newbyteorder("<")).astype(dtype)
    return values.reshape(column.shape)


def uncompress_int(data: bytes) -> np.ndarray:
    """ShardColumn::UncompressInt: u32 BE count, 2-bit width codes (MSB first), values LE in 1/2/4/8 bytes."""
    if len(data) < 4:
        raise ValueError("compressed integers shorter than their count")
    n = int.from_bytes(data[:4], "big")
    n_map = (n + 3) // 4
    if 4 + n_map > len(data):
        raise ValueError(f"{n} compressed integers need a {n_map}-byte width map, {len(data) - 4} bytes left")
    bitmap = np.frombuffer(data, np.uint8, n_map, 4)
    codes = ((bitmap[:, None] >> np.array([6, 4, 2, 0], np.uint8)) & 3).reshape(-1)[:n]
    widths = (1 << codes.astype(np.int64))
    ends = np.cumsum(widths)
    if 4 + n_map + (int(ends[-1]) if n else 0) != len(data):
        raise ValueError(f"{n} compressed integers of the mapped widths do not fill the {len(data)} bytes")
    raw = np.frombuffer(data, np.uint8, len(data) - 4 - n_map, 4 + n_map)
    out = np.empty(n, np.int64)
    starts = ends - widths
    for code, dtype in enumerate(("<i1", "<i2", "<i4", "<i8")):
        pick = codes == code
        if pick.any():
            width = 1 << code
            gather = starts[pick][:, None] + np.arange(width)
            out[pick] = raw[gather].copy().view(dtype).reshape(-1)
    return out


class _Msgpack:
    """The msgpack subset MindSpore's raw pages use (nlohmann json::to_msgpack of a map of scalars and strings)."""

    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    def take(self, n: int) -> bytes:
        if self.at + n > len(self.data):
            raise ValueError("msgpack data ends early")
        out = self.data[self.at:self.at + n]
        self.at += n
        return out

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def value(self):
        b = self.take(1)[0]
        if b <= 0x7F:
            return b
        if b >= 0xE0:
            return b - 0x100
        if 0x80 <= b <= 0x8F:
            return self.map(b & 0x0F)
        if 0x90 <= b <= 0x9F:
            return [self.value() for _ in range(b & 0x0F)]
        if 0xA0 <= b <= 0xBF:
            return self.take(b & 0x1F).decode("utf-8")
        simple = {0xC0: None, 0xC2: False, 0xC3: True}
        if b in simple:
            return simple[b]
        fixed = {0xCA: ">f", 0xCB: ">d", 0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q", 0xD0: ">b", 0xD1: ">h",
                 0xD2: ">i", 0xD3: ">q"}
        if b in fixed:
            return self.unpack(fixed[b])
        sized = {0xD9: ">B", 0xDA: ">H", 0xDB: ">I", 0xC4: ">B", 0xC5: ">H", 0xC6: ">I"}
        if b in sized:
            raw = self.take(self.unpack(sized[b]))
            return raw.decode("utf-8") if b >= 0xD9 else raw
        if b in (0xDC, 0xDD):
            return [self.value() for _ in range(self.unpack(">H" if b == 0xDC else ">I"))]
        if b in (0xDE, 0xDF):
            return self.map(self.unpack(">H" if b == 0xDE else ">I"))
        raise ValueError(f"unsupported msgpack byte 0x{b:02x}")

    def map(self, n: int) -> dict:
        return {self.value(): self.value() for _ in range(n)}
