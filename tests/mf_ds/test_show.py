"""mf-data (mf_ds/data/show.py): the description line and the first samples of MindRecord, Megatron and JSON-lines
data sets, as JSON lines; MindRecord rows equal MindSpore's own MindDataset reads (tests/fixtures)."""

from __future__ import annotations

import json

import pytest

from mf_ds.data import write_indexed
from mf_ds.data.show import cli
from tests.conftest import ROOT
from tests.mf_ds.test_mindrecord import EXPECTED, FIXTURES, SOURCES

TINY = ROOT / "tests" / "fixtures" / "mindformers" / "finetune_llama_tiny.yaml"


def run(capsys, *argv: str) -> tuple[int, list[dict], str]:
    code = cli(list(argv))
    out, err = capsys.readouterr()
    return code, [json.loads(line) for line in out.splitlines()], err


def minddataset_json(row: dict) -> dict:
    """expected.json's MindDataset row in mf-data's JSON form."""
    return {name: v["value"] for name, v in row.items()}


@pytest.mark.parametrize("key, name", [s for s in SOURCES if s[0] != "long"])
def test_mf_data_prints_what_minddataset_reads(capsys, key, name):
    code, lines, _ = run(capsys, str(FIXTURES / name), "--head", "100")
    expected = EXPECTED[key]
    assert code == 0
    assert lines[0]["format"] == "mindrecord" and lines[0]["samples"] == expected["num_rows"]
    assert list(lines[0]["columns"]) == expected["columns"]
    assert lines[1:] == [minddataset_json(row) for row in expected["rows"]]


def test_mf_data_columns_and_head(capsys):
    code, lines, _ = run(capsys, str(FIXTURES / "types.mindrecord"), "--head", "2")
    assert code == 0 and len(lines) == 3
    assert lines[0]["columns"]["mat"] == {"dtype": "float32", "shape": [-1, 2]}
    assert lines[0]["columns"]["name"] == {"dtype": "string", "shape": None}


def test_mf_data_megatron_and_jsonl(capsys, tmp_path):
    write_indexed(str(tmp_path / "corpus"), [[5, 6, 7], [8, 9]])
    code, lines, _ = run(capsys, str(tmp_path / "corpus.idx"))
    assert code == 0 and lines == [{"format": "megatron", "files": [str(tmp_path / "corpus.idx"),
                                                                    str(tmp_path / "corpus.bin")],
                                    "samples": 2, "columns": {"tokens": {"dtype": "uint16", "shape": [-1]}}},
                                   {"tokens": [5, 6, 7]}, {"tokens": [8, 9]}]
    (tmp_path / "t.jsonl").write_text('{"text": "a cat"}\n\n{"text": "b", "id": 2}\n')
    code, lines, _ = run(capsys, str(tmp_path / "t.jsonl"), "--head", "5")
    assert code == 0 and lines[0]["samples"] == 2 and lines[1:] == [{"text": "a cat"}, {"text": "b", "id": 2}]


def test_mf_data_with_the_yaml_shows_the_training_samples(capsys):
    code, lines, _ = run(capsys, "--mf-config", str(TINY), "--head", "2")
    assert code == 0 and lines[0]["samples"] == 10
    row = lines[1]
    assert row["train"]["input_ids"] == row["input_ids"][:-1] and row["train"]["labels"] == row["labels"][1:]


def test_mf_data_bad_input_is_one_line(capsys, tmp_path):
    (tmp_path / "x.mindrecord").write_bytes(b"\x00" * 4)
    code, lines, err = run(capsys, str(tmp_path / "x.mindrecord"))
    assert code == 2 and not lines
    assert err.count("\n") == 1 and err.startswith(f"mf-data: error: {tmp_path / 'x.mindrecord'}: not a MindRecord")
