"""`mf-data --to megatron|mindrecord` (mf_ds/data/writers.py): JSON lines -> the formats a YAML may name. The
MindRecord file is the one MindSpore's own MindDataset read (tests/fixtures/hfdata/written/read_by_mindspore.json,
made by tests/fixtures/make_hfdata_golden.py): the writer must still write it byte for byte."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mf_ds.data import IndexedDataset, MindRecord
from mf_ds.data.mindrecord import uncompress_int
from mf_ds.data.show import cli
from mf_ds.data.text import load_tokenizer
from mf_ds.data.writers import compress_int

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "hfdata"
WRITTEN = FIX / "written"


def table(path: Path) -> list[tuple]:
    db = sqlite3.connect(path)
    try:
        return list(db.execute("SELECT * FROM INDEXES ORDER BY ROW_ID")) + list(db.execute("SELECT * FROM SHARD_NAME"))
    finally:
        db.close()


def test_mindrecord_is_the_file_mindspore_read(tmp_path, capsys):
    out = tmp_path / "text.mindrecord"
    assert cli([str(WRITTEN / "text.jsonl"), "--to", "mindrecord", "--out", str(out), "--tokenizer",
                str(FIX / "tokenizer"), "--row-length", "33"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == 8
    assert out.read_bytes() == (WRITTEN / "text.mindrecord").read_bytes()
    assert table(Path(str(out) + ".db")) == table(WRITTEN / "text.mindrecord.db")
    mindspore = json.loads((WRITTEN / "read_by_mindspore.json").read_text())
    ours = MindRecord([str(out)])
    assert [ours.row(i)["input_ids"].tolist() for i in range(len(ours))] == [r["input_ids"] for r in mindspore]
    tok = load_tokenizer(str(FIX / "tokenizer"))
    ids = []
    for line in (WRITTEN / "text.jsonl").read_text().splitlines():
        ids += tok(json.loads(line)["text"])["input_ids"] + [tok.eos_token_id]
    assert sum((r["input_ids"] for r in mindspore), []) == ids[: 8 * 33]


def test_megatron_holds_one_document_per_line(tmp_path, capsys):
    prefix = tmp_path / "text_document"
    assert cli([str(WRITTEN / "text.jsonl"), "--to", "megatron", "--out", str(prefix), "--tokenizer",
                str(FIX / "tokenizer")]) == 0
    assert json.loads(capsys.readouterr().out)["documents"] == 11
    data = IndexedDataset(str(prefix))
    tok = load_tokenizer(str(FIX / "tokenizer"))
    first = json.loads((WRITTEN / "text.jsonl").read_text().splitlines()[0])["text"]
    assert data.get(0, 0, int(data.sequence_lengths[0])).tolist() == tok(first)["input_ids"] + [tok.eos_token_id]


def test_bad_conversions_are_one_line(tmp_path, capsys):
    assert cli([str(WRITTEN / "text.jsonl"), "--to", "mindrecord", "--out", str(tmp_path / "x"), "--tokenizer",
                str(FIX / "tokenizer")]) == 2
    assert "--row-length" in capsys.readouterr().err
    assert cli([str(FIX / "alpaca.json"), "--to", "megatron", "--out", str(tmp_path / "y"), "--tokenizer",
                str(FIX / "tokenizer")]) == 2
    assert "alpaca.json:1: not JSON" in capsys.readouterr().err  # a JSON array, not JSON lines


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-2**63, 2**63 - 1), max_size=40))
def test_compress_int_round_trips(values):
    assert uncompress_int(compress_int(np.array(values, dtype=np.int64))).tolist() == values


@pytest.mark.parametrize("value, width", [(-128, 1), (127, 1), (300, 2), (-70000, 4), (2**40, 8)])
def test_compress_int_picks_the_narrowest_width(value, width):
    assert len(compress_int(np.array([value]))) == 4 + 1 + width  # count, one code byte, the value
