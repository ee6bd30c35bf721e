"""mf_ds.data.mindrecord / rows: MindRecord files written by MindSpore read as MindDataset reads them, as samples
with MindFormers' column roles, and every kind of damage named by its file. No MindSpore needed: the files and
what MindDataset(shuffle=False) read from them are committed fixtures (tests/fixtures/make_mindformers_fixtures.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import sqlite3
from pathlib import Path

import numpy as np
import pytest
import torch

from mf_ds.data import DataError, MindRecord, RowDataset, batches, build_train_dataset, mindrecord_files
from mf_ds.data.mindrecord import uncompress_int
from tests.mf_ds.test_data import plan_data

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "mindformers" / "mindrecord"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())
ALPACA = FIXTURES / "alpaca"

# (expected key, how a YAML names the data): one file, one shard of a group, a directory.
SOURCES = [("types.mindrecord", "types.mindrecord"), ("alpaca", "alpaca/alpaca.mindrecord2"), ("wiki", "wiki"),
           ("qwen", "qwen/qwen.mindrecord"), ("long", "long/long.mindrecord")]


def same_as_minddataset(value, expected: dict) -> None:
    if expected["dtype"] == "bytes":
        assert isinstance(value, bytes) and list(value) == expected["value"]
    elif expected["dtype"] == "string":
        assert value == expected["value"]
    else:
        array = np.asarray(value)
        assert array.dtype.name == expected["dtype"] and list(array.shape) == expected["shape"]
        if "sha256" in expected:
            assert hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest() == expected["sha256"]
            assert array.reshape(-1)[:8].tolist() == expected["head"]
        else:
            assert array.tolist() == expected["value"]


@pytest.mark.parametrize("key, name", SOURCES)
def test_rows_are_what_minddataset_reads(key, name):
    records = MindRecord(mindrecord_files(str(FIXTURES / name)))
    expected = EXPECTED[key]
    assert len(records) == expected["num_rows"] and list(records.columns) == expected["columns"]
    for i, row in enumerate(expected["rows"]):
        got = records.row(i)
        assert list(got) == list(row)
        for column, value in row.items():
            same_as_minddataset(got[column], value)


def test_every_schema_type_and_shape():
    columns = MindRecord([str(FIXTURES / "types.mindrecord")]).columns
    assert {n: c.describe() for n, c in columns.items()} == {
        "big": "int64[*]", "f32": "float32", "f64": "float64", "grid": "int32[2, 3]", "i32": "int32",
        "i64": "int64", "ids": "int32[*]", "mat": "float32[*, 2]", "name": "string", "raw": "bytes",
        "vec": "float64[3]"}
    assert {n for n, c in columns.items() if c.blob} == {"big", "grid", "ids", "mat", "raw", "vec"}


def test_files_are_found_as_mindformers_finds_them(tmp_path):
    shards = [str(ALPACA / f"alpaca.mindrecord{i}") for i in range(4)]
    assert mindrecord_files(str(ALPACA / "alpaca.mindrecord3")) == shards  # one file: its whole shard group
    assert mindrecord_files(str(ALPACA)) == shards  # a directory: sorted, .db files left out
    nested = mindrecord_files(str(FIXTURES))  # searched recursively
    assert len(nested) == 4 + 2 + 1 + 1 + 1 and all(not f.endswith(".db") for f in nested)
    given = [shards[2], shards[0]]
    assert mindrecord_files(dataset_files=given) == given  # dataset_files: exactly those, in that order
    assert mindrecord_files(str(ALPACA), dataset_files=given) == shards  # dataset_dir wins
    records = MindRecord(given)
    rows = EXPECTED["alpaca"]["rows"]
    first_of_shard0 = MindRecord([shards[2]]).__len__()
    same_as_minddataset(records.row(first_of_shard0)["input_ids"], rows[0]["input_ids"])
    for bad, message in ((str(tmp_path), "holds no MindRecord files"), (str(tmp_path / "x.txt"), "not a MindRecord "
                                                                        "file name"),
                         (str(tmp_path / "x.mindrecord"), "missing")):
        with pytest.raises(DataError, match=message) as info:
            mindrecord_files(bad)
        assert info.value.path == bad


def test_rows_are_memory_mapped_and_decoded_on_demand():
    records = MindRecord(mindrecord_files(str(FIXTURES / "long" / "long.mindrecord")))
    shard = records.shards[0]
    assert isinstance(shard.data, np.memmap)
    assert sorted(set(shard.page_type)) == ["BLOB_DATA", "RAW_DATA"] and shard.page_type.count("BLOB_DATA") == 2
    assert records.row(4, ["input_ids"])["input_ids"].shape == (4097,)  # a row of the second row group


@pytest.mark.parametrize("values", [[0, 1, -1, 127, -128, 128, -129, 32767, -32768, 32768, 2**31 - 1, -2**31,
                                     2**31, -2**62], [], [5]])
def test_narrowed_integers_round_trip(values):
    # ShardColumn::CompressInt's layout, built by hand for widths the fixtures already cover and the empty case.
    codes = [0 if -128 <= v < 128 else 1 if -2**15 <= v < 2**15 else 2 if -2**31 <= v < 2**31 else 3
             for v in values]
    bitmap = bytearray((len(values) + 3) // 4)
    for i, code in enumerate(codes):
        bitmap[i // 4] |= code << (2 * (3 - i % 4))
    body = b"".join(int(v).to_bytes(1 << c, "little", signed=True) for v, c in zip(values, codes, strict=True))
    assert uncompress_int(len(values).to_bytes(4, "big") + bytes(bitmap) + body).tolist() == values


def alpaca_rows() -> list[dict]:
    return [{k: np.array(v["value"]) for k, v in row.items()} for row in EXPECTED["alpaca"]["rows"]]


def test_samples_shift_inputs_and_labels_as_the_legacy_model():
    ds = build_train_dataset(plan_data(kind="mindrecord", paths=[str(ALPACA)], shuffle=False,
                                       columns={"input_ids": "input_ids", "labels": "labels"}), 16, 0, 64)
    assert isinstance(ds, RowDataset) and len(ds) == 10
    for i, row in enumerate(alpaca_rows()):
        item = ds[i]
        assert item["input_ids"].dtype == torch.long and item["input_ids"].tolist() == row["input_ids"][:-1].tolist()
        assert item["labels"].tolist() == row["labels"][1:].tolist()  # llama.py:673 labels[:, 1:]
    wiki = build_train_dataset(plan_data(kind="mindrecord", paths=[str(FIXTURES / "wiki")], shuffle=False), 16, 0, 64)
    row = EXPECTED["wiki"]["rows"][3]["input_ids"]["value"]
    assert wiki[3]["input_ids"].tolist() == row[:-1] and wiki[3]["labels"].tolist() == row[1:]  # labels = ids[1:]


def test_loss_mask_and_unshifted_rows():
    qwen = FIXTURES / "qwen" / "qwen.mindrecord"
    rows = EXPECTED["qwen"]["rows"]
    # construct_args_key [input_ids, labels, loss_mask]: attention_mask feeds loss_mask; rows cut as usual.
    ds = build_train_dataset(plan_data(kind="mindrecord", paths=[str(qwen)], shuffle=False,
                                       columns={"input_ids": "input_ids", "target_ids": "labels",
                                                "attention_mask": "loss_mask"}), 16, 0, 64)
    ids, mask = np.array(rows[1]["input_ids"]["value"]), np.array(rows[1]["attention_mask"]["value"])
    expected = np.where(mask[:-1] == 0, -100, ids[1:])
    assert ds[1]["labels"].tolist() == expected.tolist() and (expected == -100).any()
    # mcore / input_sliced_sig: the row as it is, 17 tokens for seq_length 17.
    flat = build_train_dataset(plan_data(kind="mindrecord", paths=[str(qwen)], shuffle=False, shifted=False,
                                         columns={"input_ids": "input_ids", "target_ids": "labels"}), 17, 0, 64)
    assert flat[1]["input_ids"].tolist() == ids.tolist() == flat[1]["labels"].tolist()
    with pytest.raises(DataError, match="need a column that feeds labels"):
        build_train_dataset(plan_data(kind="mindrecord", paths=[str(qwen)], shifted=False), 17, 0, 64)


def test_batches_and_shuffle():
    data = plan_data(kind="mindrecord", paths=[str(ALPACA)], columns={"input_ids": "input_ids", "labels": "labels"})
    ordered = build_train_dataset(dataclasses.replace(data, shuffle=False), 16, 0, 64)
    first = next(batches(ordered, 2, 0, 1))
    assert first["input_ids"].tolist() == [r["input_ids"][:-1].tolist() for r in alpaca_rows()[:2]]
    shuffled = build_train_dataset(data, 16, 7, 64)
    assert sorted(shuffled.pass_order(0).tolist()) == list(range(10))
    assert shuffled.pass_order(0).tolist() != shuffled.pass_order(1).tolist()


def test_bad_rows_are_named():
    data = plan_data(kind="mindrecord", paths=[str(ALPACA)], columns={"input_ids": "input_ids", "labels": "labels"})
    with pytest.raises(DataError, match=r"row 0: column 'input_ids' holds 17 tokens; the model's seq_length 32 "
                                        r"needs seq_length \+ 1") as info:
        build_train_dataset(data, 32, 0, 64)
    assert info.value.path == str(ALPACA / "alpaca.mindrecord0")
    with pytest.raises(DataError, match=r"token id \d+ outside the model's vocabulary \[0, 40\)"):
        ds = build_train_dataset(data, 16, 0, 40)
        [ds[i] for i in range(len(ds))]
    with pytest.raises(DataError, match="has no column 'labels'") as info:
        build_train_dataset(dataclasses.replace(data, paths=(str(FIXTURES / "wiki"),)), 16, 0, 64)
    with pytest.raises(DataError, match="column 'raw' is bytes"):
        build_train_dataset(plan_data(kind="mindrecord", paths=[str(FIXTURES / "types.mindrecord")],
                                      columns={"raw": "input_ids"}), 16, 0, 64)


def test_train_dataset_dir_finds_mindrecord(tmp_path):
    ds = build_train_dataset(plan_data(shuffle=False), 16, 0, 64, override_dir=str(ALPACA))
    assert isinstance(ds, RowDataset) and len(ds) == 10
    assert build_train_dataset(plan_data(shuffle=False), 16, 0, 64,
                               override_dir=str(FIXTURES / "wiki" / "wiki.mindrecord1")).__len__() == 8


@pytest.fixture
def alpaca(tmp_path) -> Path:
    shutil.copytree(ALPACA, tmp_path / "alpaca")
    return tmp_path / "alpaca"


def _damage(root: Path, how: str) -> tuple[str, str]:
    """Damage a copy of the alpaca shards; returns (the file the error must name, a phrase of it)."""
    f0, f1 = root / "alpaca.mindrecord0", root / "alpaca.mindrecord1"
    if how == "truncated page":
        f1.write_bytes(f1.read_bytes()[:-10])
        return str(f1), "truncated: page 1 ends at byte"
    if how == "not mindrecord":
        f1.write_bytes(b"\x05" + b"\x00" * 7 + b"hello" + b"\x00" * 100)
        return str(f1), "header is not JSON"
    if how == "missing shard":
        f1.unlink()
        return str(f1), "missing: shard 1 of the 4"
    if how == "missing db":
        Path(str(f1) + ".db").unlink()
        return str(f1) + ".db", "missing: the SQLite index"
    if how == "db of another file":
        shutil.copy(str(f0) + ".db", str(f1) + ".db")
        return str(f1) + ".db", "index of 'alpaca.mindrecord0'"
    if how == "db not sqlite":
        Path(str(f1) + ".db").write_bytes(b"not a database" * 100)
        return str(f1) + ".db", "not a MindRecord index"
    con = sqlite3.connect(str(f1) + ".db")
    if how == "db row missing":
        con.execute("DELETE FROM INDEXES WHERE ROW_ID = 1")
        message = "lists 2 rows, the header of alpaca.mindrecord1 3"
    else:  # "db offset"
        con.execute("UPDATE INDEXES SET PAGE_OFFSET_BLOB_END = 100000 WHERE ROW_ID = 1")
        message = "row 1 points outside the pages"
    con.commit()
    con.close()
    return str(f1) + ".db", message


@pytest.mark.parametrize("how", ["truncated page", "not mindrecord", "missing shard", "missing db",
                                 "db of another file", "db not sqlite", "db row missing", "db offset"])
def test_damaged_mindrecord_is_named(alpaca, how):
    path, message = _damage(alpaca, how)
    with pytest.raises(DataError, match=message) as info:
        MindRecord(mindrecord_files(str(alpaca / "alpaca.mindrecord0")))
    assert info.value.path == path and "\n" not in str(info.value)


def test_damaged_row_is_named_when_read(alpaca):
    f2 = alpaca / "alpaca.mindrecord2"
    data = bytearray(f2.read_bytes())
    data[16384] ^= 0x40  # the length prefix of the first blob of page 0
    f2.write_bytes(bytes(data))
    records = MindRecord(mindrecord_files(str(alpaca)))
    records.row(0)
    with pytest.raises(DataError, match="row 0: its blob entry says") as info:
        records.row(len(records.shards[0]) + len(records.shards[1]))
    assert info.value.path == str(f2)
