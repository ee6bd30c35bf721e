"""Data and weight files built to crash, hang or slip through mf-ds (issue 23): each is one DataError / RunError
naming the file (exit 2 from the CLIs), never a traceback or a hang, or it does what the user asked.

MindRecord headers (a page without page_size, a non-numeric page_size, a schema shape that is not a list of ints,
deep nesting, 5000-digit numbers, shard_addresses leaving the folder) and .db indexes (a recursive view, a trigger,
an offset of 1e300); JSON lines nested 100k deep or holding a 5000-digit int; `mf-data` on NaN / Infinity;
a .ckpt whose dims overflow int64; `mf-convert` with an int64 weight or NaN, in each direction, leaving no .tmp;
`--load_checkpoint` naming nothing. The files are written by the tests from the committed fixtures.
"""

from __future__ import annotations

import json
import math
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mf_ds.data import DataError, MindRecord, mindrecord_files
from mf_ds.data.show import cli as data_cli
from mf_ds.errors import RunError
from tests.conftest import CPU_ENV, ROOT
from tests.mf_ds.test_mindrecord import ALPACA

# ---------------------------------------------------------------------------------------------------------------
# MindRecord


def read_header(path: Path) -> dict:
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n])


def write_header(path: Path, header: dict | str) -> None:
    """Replace the header JSON of a MindRecord file in place (the pages stay at header_size)."""
    data = bytearray(path.read_bytes())
    old = int.from_bytes(data[:8], "little")
    text = (header if isinstance(header, str) else json.dumps(header)).encode()
    limit = read_header(path)["header_size"] - 8
    assert len(text) <= limit, "the test header must fit the header region"
    data[:8 + max(old, len(text))] = len(text).to_bytes(8, "little") + text.ljust(max(old, len(text)), b" ")
    path.write_bytes(bytes(data))


@pytest.fixture
def shard(tmp_path) -> Path:
    """A copy of one alpaca shard group; returns shard 1."""
    shutil.copytree(ALPACA, tmp_path / "alpaca")
    return tmp_path / "alpaca" / "alpaca.mindrecord1"


def _edit(header: dict, how: str) -> dict | str:
    page = header["page"][0]
    if how == "page without page_size":
        del page["page_size"]
    elif how == "page_size not a number":
        page["page_size"] = "lots"
    elif how == "page_size 1e300":
        page["page_size"] = 1e300
    elif how == "page_id a list":
        page["page_id"] = [0]
    elif how == "shape not a list":
        header["schema"][0]["schema"]["input_ids"]["shape"] = "abc"
    elif how == "shape of strings":
        header["schema"][0]["schema"]["input_ids"]["shape"] = ["x"]
    elif how == "shape nested":
        header["schema"][0]["schema"]["input_ids"]["shape"] = [[[-1]]]
    elif how == "page not a list":
        header["page"] = {"page_id": 0}
    elif how == "deep nesting":
        return json.dumps(header)[:-1] + ', "deep": ' + "[" * 5000 + "]" * 5000 + "}"
    elif how == "5000-digit number":
        return json.dumps(header)[:-1] + ', "big": 1' + "0" * 5000 + "}"
    return header


HEADER_CASES = ["page without page_size", "page_size not a number", "page_size 1e300", "page_id a list",
                "shape not a list", "shape of strings", "shape nested", "page not a list", "deep nesting",
                "5000-digit number"]


@pytest.mark.parametrize("how", HEADER_CASES)
def test_hostile_mindrecord_header_is_named(shard, how):
    write_header(shard, _edit(read_header(shard), how))
    with pytest.raises(DataError) as info:
        MindRecord([str(shard)])
    assert info.value.path == str(shard) and "\n" not in str(info.value)


@pytest.mark.parametrize("entry", ["/etc/passwd", "../outside.mindrecord0", "sub/alpaca.mindrecord1", ".."])
def test_shard_addresses_stay_in_the_folder(shard, entry):
    header = read_header(shard.with_name("alpaca.mindrecord0"))
    header["shard_addresses"][1] = entry
    write_header(shard.with_name("alpaca.mindrecord0"), header)
    (shard.parent.parent / "outside.mindrecord0").write_bytes(b"x" * 64)
    with pytest.raises(DataError, match="is not a file name: the shards of a data set are read from its own folder"):
        mindrecord_files(str(shard.with_name("alpaca.mindrecord0")))


def _db(shard: Path, *statements: str) -> Path:
    db = Path(str(shard) + ".db")
    con = sqlite3.connect(db)
    for statement in statements:
        con.execute(statement)
    con.commit()
    con.close()
    return db


DB_CASES = {
    # INDEXES replaced by a view over a recursive query that never ends (it hung the reader)
    "recursive view": ("ALTER TABLE INDEXES RENAME TO REAL_INDEXES",
                       "CREATE VIEW INDEXES AS WITH RECURSIVE n(x) AS (SELECT 0 UNION ALL SELECT x + 1 FROM n) "
                       "SELECT x AS ROW_ID, 0 AS ROW_GROUP_ID, 0 AS PAGE_ID_RAW, 0 AS PAGE_OFFSET_RAW, "
                       "0 AS PAGE_OFFSET_RAW_END, 0 AS PAGE_ID_BLOB, 0 AS PAGE_OFFSET_BLOB, "
                       "0 AS PAGE_OFFSET_BLOB_END FROM n"),
    "trigger": ("CREATE TRIGGER t AFTER INSERT ON SHARD_NAME BEGIN DELETE FROM INDEXES; END",),
    "extra view": ("CREATE VIEW v AS SELECT * FROM INDEXES",),
    "offset 1e300": ("UPDATE INDEXES SET PAGE_OFFSET_BLOB = 1e300 WHERE ROW_ID = 1",),
    "offset text": ("UPDATE INDEXES SET PAGE_OFFSET_BLOB = 'x' WHERE ROW_ID = 1",),
    "offset 2^62": (f"UPDATE INDEXES SET PAGE_OFFSET_BLOB_END = {2**62} WHERE ROW_ID = 1",),
    "more rows than the header": (),  # an INSERT of every row again, written by the test from the table's columns
}


@pytest.mark.parametrize("how", list(DB_CASES))
def test_hostile_mindrecord_index_is_named(shard, how):
    statements = DB_CASES[how]
    if how == "more rows than the header":
        con = sqlite3.connect(str(shard) + ".db")
        columns = [row[1] for row in con.execute("PRAGMA table_info(INDEXES)")]
        con.close()
        statements = (f"INSERT INTO INDEXES ({', '.join(columns)}) SELECT ROW_ID + 100, "
                      f"{', '.join(columns[1:])} FROM INDEXES",)
    db = _db(shard, *statements)
    code = ("from mf_ds.data import MindRecord, DataError\n"
            f"try:\n    MindRecord([{str(shard)!r}])\nexcept DataError as exc:\n    print(exc.path)\n    print(exc)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=CPU_ENV, capture_output=True, text=True,
                          timeout=60)  # a hang fails here, not the suite
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    path, message = proc.stdout.strip().splitlines()
    assert path == str(db), message


# ---------------------------------------------------------------------------------------------------------------
# JSON lines and mf-data


@pytest.mark.parametrize("line, phrase", [("[" * 100_000 + "]" * 100_000, "nested too deeply"),
                                          ('{"text": "a", "n": 1' + "0" * 5000 + "}", "digits"),
                                          ('{"text": "a", "n": [1, 2', "not JSON")])
def test_hostile_json_lines_are_named(tmp_path, line, phrase, capsys):
    from mf_ds.data.text import read_jsonl

    class Tokenizer:
        eos_token_id = 0

        def __call__(self, text):
            return {"input_ids": list(text.encode())}

    path = tmp_path / "x.jsonl"
    path.write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(DataError, match=phrase) as info:
        read_jsonl(str(path), Tokenizer())
    assert info.value.path == f"{path}:2" and "\n" not in str(info.value)
    assert data_cli([str(path), "--head", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mf-data: error: {path}:2: ") and phrase in err and err.count("\n") == 1, err


def test_mf_data_never_prints_nan_or_infinity(tmp_path, capsys):
    path = tmp_path / "x.jsonl"
    path.write_text('{"text": "a", "x": NaN, "y": [Infinity, -Infinity, 1.5]}\n')
    assert data_cli([str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()

    def strict(text):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} printed as JSON"))

    assert strict(lines[1]) == {"text": "a", "x": None, "y": [None, None, 1.5]}


def test_mf_data_nan_in_a_mindrecord_float_column(tmp_path):
    from mf_ds.data.show import jsonable

    assert jsonable(np.array([[np.nan, 1.0], [np.inf, -np.inf]], np.float32)) == [[None, 1.0], [None, None]]
    assert jsonable(np.float64("nan")) is None and jsonable(np.int64(3)) == 3


# ---------------------------------------------------------------------------------------------------------------
# MindSpore .ckpt and mf-convert


def _ckpt(path: Path, name: str, dims: list[int], dtype: str, content: bytes) -> Path:
    """One Checkpoint message as mindspore.save_checkpoint writes it, with the dims and bytes given."""
    from mf_ds.checkpoint.mindspore_ckpt import _bytes_field, _key, _varint

    tensor = b"".join(_key(1, 0) + _varint(d) for d in dims) + _bytes_field(2, dtype.encode()) + \
        _bytes_field(3, content)
    value = _bytes_field(1, name.encode()) + _bytes_field(2, tensor)
    path.write_bytes(_bytes_field(1, value))
    return path


@pytest.mark.parametrize("dims", [[2**32, 2**32, 4], [2**62, 4], [2**63 - 1, 2**63 - 1, 2], [0, 2**64 - 1]])
def test_ckpt_dims_that_overflow_are_named(tmp_path, dims):
    from mf_ds.checkpoint.mindspore_ckpt import MindSporeCheckpoint

    path = _ckpt(tmp_path / "x.ckpt", "w", dims, "Float32", b"")
    with pytest.raises(RunError, match=f"{path}: w ") as info:
        MindSporeCheckpoint(path).tensor("w")
    assert "\n" not in str(info.value)


def _llama():
    from tests.mf_ds.test_mindspore_ckpt import MF, TINY

    return MF / "llama" / "model.ckpt", TINY


def _rewrite_ckpt(dst: Path, change) -> Path:
    from mf_ds.checkpoint.mindspore_ckpt import MindSporeCheckpoint, write_ckpt

    src, _ = _llama()
    ckpt = MindSporeCheckpoint(src)
    write_ckpt(dst, ((name, change(name, ckpt.tensor(name))) for name in ckpt.names()))
    return dst


def _convert(capsys, *argv: str) -> tuple[int, str]:
    from mf_ds.convert import cli

    code = cli(["--mf-config", str(_llama()[1]), *argv])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return code, captured.err


EMBED = "model.tok_embeddings.embedding_weight"


def test_convert_refuses_an_integer_weight_from_mindformers(tmp_path, capsys):
    bad = _rewrite_ckpt(tmp_path / "int.ckpt", lambda n, t: t.to(torch.int64) if n == EMBED else t)
    code, err = _convert(capsys, str(bad), str(tmp_path / "hf"))
    assert code == 2 and err == (f"mf-convert: error: {bad}: weight {EMBED} is int64, the model's "
                                 "model.embed_tokens.weight float32 (a damaged file?)\n"), err


def test_convert_refuses_nan_and_integers_to_mindformers_and_leaves_no_tmp(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    src, _ = _llama()
    assert _convert(capsys, str(src), str(tmp_path / "hf"))[0] == 0
    good = load_file(str(tmp_path / "hf" / "model.safetensors"))
    for case, change in (("nan", lambda t: t.index_fill(0, torch.tensor([0]), math.nan)),
                         ("int", lambda t: t.to(torch.int64))):
        hf = tmp_path / f"hf-{case}"
        shutil.copytree(tmp_path / "hf", hf)
        save_file({**good, "model.norm.weight": change(good["model.norm.weight"])}, str(hf / "model.safetensors"),
                  metadata={"format": "pt"})
        (tmp_path / case).mkdir()
        for out in ("back.ckpt", "back.safetensors"):
            code, err = _convert(capsys, str(hf), str(tmp_path / case / out))
            phrase = "holds inf/NaN" if case == "nan" else "is I64, not floating point"
            assert code == 2 and err.startswith(f"mf-convert: error: {hf / 'model.safetensors'}: weight "
                                                "model.norm.weight ") and phrase in err, err
            assert not list((tmp_path / case).iterdir()), "a file was left behind"


def test_convert_failing_mid_write_leaves_no_tmp(tmp_path):
    from mf_ds.checkpoint.mindspore_ckpt import write_ckpt

    def tensors():
        yield "a", torch.ones(3)
        yield "b", torch.ones(2, dtype=torch.complex64)  # no MindSpore dtype: refused after "a" was written

    with pytest.raises(RunError, match="complex64"):
        write_ckpt(tmp_path / "x.ckpt", tensors())
    assert list(tmp_path.iterdir()) == []


def test_integer_weights_are_refused_before_training(tmp_path):
    from safetensors.torch import save_file

    from mf_ds.model import weight_files

    save_file({"model.embed_tokens.weight": torch.zeros(4, 2, dtype=torch.int64)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(RunError, match="weight model.embed_tokens.weight is I64, not floating point"):
        weight_files(tmp_path)


@pytest.mark.parametrize("target", ["nonexistent", "a-file.txt"])
def test_load_checkpoint_that_is_not_there_says_so(tmp_path, target):
    from mf_ds.model import weight_files

    path = tmp_path / target
    if target.endswith(".txt"):
        path.write_text("x")
    with pytest.raises(RunError, match="does not exist" if target == "nonexistent" else "must be a .ckpt"):
        weight_files(path)
