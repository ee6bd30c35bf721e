"""MindFormers' HFDataLoader samples (mf_ds/data/handlers.py, hfloader.py) against MindFormers 1.7.0's own run on the
same local files and tokenizer (tests/fixtures/make_hfdata_golden.py -> tests/fixtures/hfdata/golden.json)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest

from mf_ds.data import handlers, hfloader
from mf_ds.data.indexed import DataError

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "hfdata"
GOLDEN = json.loads((FIX / "golden.json").read_text())
SEQ = GOLDEN["seq_length"]


def hf_of(case: dict, mf_labels: bool = True, **extra) -> dict:
    return {"load_func": "load_dataset", "load": {"path": "json", "data_files": str(FIX / case["data"]),
                                                  "split": "train"},
            "handlers": copy.deepcopy(case["handler"]), "tokenizer_dir": str(FIX / "tokenizer"),
            "mf_labels": mf_labels, "packed": "actual_seq_len" in case["columns"],
            "compressed": case["create_compressed_eod_mask"],
            "compressed_length": case["compressed_eod_mask_length"], **extra}


def columns_of(case: dict, mf_labels: bool = True) -> list[dict]:
    hf = hf_of(case, mf_labels)
    ds = hfloader.process(hfloader.load(hf), hf)
    if not hf["packed"]:
        return [{k: np.asarray(v).tolist() for k, v in row.items()} for row in ds]
    return [{k: v.tolist() for k, v in handlers.packed_columns(row["input_ids"], row["labels"],
                                                               row["actual_seq_len"], 16).items()} for row in ds]


@pytest.mark.parametrize("name", [n for n in GOLDEN["cases"] if n != "alpaca_truncate"])
def test_samples_equal_mindformers(name):
    """Token ids, labels, loss positions, packed positions and document ends: MindFormers' samples exactly
    (with mf_ds.mindformers_packing_labels, for the packed cases)."""
    case = GOLDEN["cases"][name]
    assert case["error"] is None and case["samples"]
    got = columns_of(case)
    assert len(got) == len(case["samples"])
    for mine, want in zip(got, case["samples"], strict=True):
        for column in case["columns"]:
            assert mine[column] == want[column], (name, column)


def test_truncate_equals_mindformers_but_its_boundaries():
    """truncate: tokens, labels and loss mask as MindFormers; MindFormers' actual_seq_len holds each piece's
    document lengths (read as ends, its position_ids then have more than seq_length entries); here the ends."""
    case = GOLDEN["cases"]["alpaca_truncate"]
    got = columns_of(case)
    assert len(got) == len(case["samples"])
    for mine, want in zip(got, case["samples"], strict=True):
        for column in ("input_ids", "labels", "loss_mask"):
            assert mine[column] == want[column]
        assert len(want["position_ids"]) != SEQ or want["actual_seq_len"][1] == SEQ  # MindFormers' defect
        ends = np.cumsum(want["actual_seq_len"])
        ends = ends[ends <= SEQ].tolist()
        assert [e for e in mine["actual_seq_len"] if e < SEQ] == [e for e in ends if e < SEQ]
        assert len(mine["position_ids"]) == SEQ and mine["position_ids"][0] == 0


def test_packed_labels_default_train_the_next_token():
    """mf-ds' default: each packed document's labels are the unpacked handler's (the next token, -100 on the
    prompt and on the last position); MindFormers' shifts them again and trains each document's end on id 0."""
    packed = GOLDEN["cases"]["alpaca_packed"]
    unpacked = GOLDEN["cases"]["alpaca_unpacked_nopad"]["samples"]  # the first six documents, unpadded
    hf = hf_of(packed, mf_labels=False)
    rows = hfloader.process(hfloader.load(hf), hf)
    docs = iter(unpacked)
    checked = 0
    for row, theirs in zip(rows, packed["samples"], strict=True):
        sample = handlers.packed_columns(row["input_ids"], row["labels"], row["actual_seq_len"])
        start = 0
        for end in row["actual_seq_len"]:
            doc = next(docs, None)
            if doc is None:
                break
            assert sample["input_ids"][start:end].tolist() == doc["input_ids"]
            assert sample["labels"][start:end].tolist() == doc["labels"]  # the next token where not -100
            for i in range(start, end - 1):
                if sample["labels"][i] != -100:
                    assert sample["labels"][i] == sample["input_ids"][i + 1]
            assert theirs["labels"][end - 1] == 0 and sample["labels"][end - 1] == -100
            assert sample["position_ids"][start:end].tolist() == list(range(end - start))
            start, checked = end, checked + 1
    assert checked == len(unpacked)


def test_training_items_carry_documents_and_positions():
    case = GOLDEN["cases"]["alpaca_packed"]
    hf = hf_of(case, mf_labels=False, documents=True, positions=True)
    ds = hfloader.HFSamples(hf, SEQ, 700, seed=1)
    item = ds[0]
    cols = ds.columns(0)
    assert set(item) == {"input_ids", "labels", "position_ids", "doc_ids"}
    assert (item["labels"].numpy()[cols["loss_mask"] == 0] == -100).all()
    first = case["samples"][0]["actual_seq_len"][0]
    assert item["doc_ids"][first - 1] == 0 and item["doc_ids"][first] == 1 and item["position_ids"][first] == 0
    plain = hfloader.HFSamples(hf_of(case, mf_labels=False), SEQ, 700, seed=1)[0]
    assert set(plain) == {"input_ids", "labels"}


def test_cache_is_read_the_second_time(tmp_path):
    """datasets' cache: the same handlers on the same file are not recomputed (same cache files, no map run)."""
    import datasets

    case = GOLDEN["cases"]["alpaca_packed"]
    hf = hf_of(case)
    hf["load"]["cache_dir"] = str(tmp_path / "cache")
    first = hfloader.process(hfloader.load(hf), hf)
    files = sorted(f["filename"] for f in first.cache_files)
    assert files and any("cache-" in Path(f).name for f in files)
    stamp = {f: Path(f).stat().st_mtime_ns for f in files}
    datasets.disable_progress_bars()
    second = hfloader.process(hfloader.load(hf), hf)
    assert sorted(f["filename"] for f in second.cache_files) == files
    assert {f: Path(f).stat().st_mtime_ns for f in files} == stamp
    assert second[:]["input_ids"] == first[:]["input_ids"]


def test_bad_inputs_are_one_line_errors(tmp_path):
    case = GOLDEN["cases"]["alpaca_unpacked"]
    missing = hf_of(case)
    missing["load"]["data_files"] = str(tmp_path / "nope.json")
    with pytest.raises(DataError, match="nope.json"):
        hfloader.load(missing)
    no_tok = hf_of(case, tokenizer_dir=None)
    with pytest.raises(DataError, match="pretrained_model_dir"):
        hfloader.process(hfloader.load(no_tok), no_tok)
    short = hf_of(case)
    with pytest.raises(DataError, match="seq_length"):
        hfloader.HFSamples(short, SEQ * 2, 700, seed=0)
    with pytest.raises(DataError, match="vocabulary"):
        hfloader.HFSamples(short, SEQ, 10, seed=0)


def test_too_many_documents_for_the_compressed_mask_is_refused_up_front():
    case = GOLDEN["cases"]["code_alpaca_packed"]  # 4 documents in its first packed sample
    hf = hf_of(case, mf_labels=False, compressed_length=3)
    with pytest.raises(DataError, match="compressed_eod_mask_length.*holds 4 documents"):
        hfloader.HFSamples(hf, SEQ, 700, seed=0)
