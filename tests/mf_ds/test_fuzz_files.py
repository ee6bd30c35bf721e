"""Fuzzing the file readers (issue 23): MindRecord headers, MindSpore .ckpt protobufs and JSON lines, mutated at
random, end in their data, or in one DataError / RunError naming the file: never another exception, never a hang.

Each example runs under an alarm (ALARM_S) that turns a hang into a failure, and under hypothesis' deadline.
Runs are derandomized so CI sees the same cases every time (about 20 s here); `MF_DS_FUZZ_SCALE=20` explores
twenty times as many.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mf_ds.data import DataError, MindRecord
from mf_ds.errors import RunError
from tests.mf_ds.test_hostile_files import read_header, write_header
from tests.mf_ds.test_mindrecord import ALPACA
from tests.mf_ds.test_mindspore_ckpt import MF

SCALE = int(os.environ.get("MF_DS_FUZZ_SCALE", "1"))
SETTINGS = dict(deadline=5000, derandomize=SCALE == 1, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
ALARM_S = 10


class Hang(Exception):
    pass


@contextlib.contextmanager
def no_hang(seconds: int = ALARM_S):
    def fire(*_):
        raise Hang(f"no answer within {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# JSON values of every kind, the hostile ones included: huge ints, floats at the edges, deep-ish nesting.
LEAVES = (st.none() | st.booleans() | st.integers() | st.integers(min_value=2**62, max_value=2**70)
          | st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from([1e300, -1.0, 0.5, -1, 0])
          | st.text(max_size=8))
VALUES = st.recursive(LEAVES, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids,
                                                                                       max_size=4), max_leaves=12)


def _paths(tree, prefix=()):
    yield prefix
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _paths(value, prefix + (key,))
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            yield from _paths(value, prefix + (i,))


def _set(tree, path, value, delete=False):
    node = tree
    for key in path[:-1]:
        node = node[key]
    if delete and isinstance(node, dict):
        del node[path[-1]]
    elif delete:
        node.pop(path[-1])
    else:
        node[path[-1]] = value


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fuzz") / "alpaca"
    shutil.copytree(ALPACA, root)
    return root


HEADER = read_header(ALPACA / "alpaca.mindrecord1")
PATHS = [p for p in _paths(HEADER) if p]


@settings(max_examples=150 * SCALE, **SETTINGS)
@given(edits=st.lists(st.tuples(st.sampled_from(PATHS), VALUES, st.booleans()), min_size=1, max_size=3))
def test_mindrecord_header_fuzz(shards, edits):
    shard = shards / "alpaca.mindrecord1"
    shutil.copy(ALPACA / shard.name, shard)
    header = json.loads(json.dumps(HEADER))
    for path, value, delete in edits:
        try:
            _set(header, path, value, delete)
        except (KeyError, IndexError, TypeError):  # the path went away with an earlier edit
            continue
    text = json.dumps(header)
    if len(text) > HEADER["header_size"] - 8:
        return
    write_header(shard, text)
    with no_hang():
        try:
            records = MindRecord([str(shard)])
            for i in range(min(len(records), 2)):
                records.row(i)
        except DataError as exc:
            assert "\n" not in str(exc)


@settings(max_examples=100 * SCALE, **SETTINGS)
@given(data=st.data())
def test_mindrecord_header_bytes_fuzz(shards, data):
    shard = shards / "alpaca.mindrecord0"
    raw = bytearray((ALPACA / shard.name).read_bytes())
    n = int.from_bytes(raw[:8], "little")
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, n + 8 - 1))
        raw[at] = data.draw(st.integers(0, 255))
    shard.write_bytes(bytes(raw))
    with no_hang():
        try:
            MindRecord([str(shard)])
        except DataError as exc:
            assert "\n" not in str(exc)


CKPT = (MF / "llama" / "model.ckpt").read_bytes()


def _read_ckpt(path: Path) -> None:
    from mf_ds.checkpoint.mindspore_ckpt import MindSporeCheckpoint

    with no_hang():
        try:
            ckpt = MindSporeCheckpoint(path)
            for name in ckpt.names():
                ckpt.tensor(name)
        except RunError as exc:
            assert "\n" not in str(exc)


@settings(max_examples=150 * SCALE, **SETTINGS)
@given(data=st.data())
def test_ckpt_bytes_fuzz(tmp_path, data):
    raw = bytearray(CKPT)
    how = data.draw(st.sampled_from(["flip", "truncate", "splice"]))
    if how == "flip":
        for _ in range(data.draw(st.integers(1, 6))):
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    elif how == "truncate":
        raw = raw[:data.draw(st.integers(0, len(raw)))]
    else:
        at = data.draw(st.integers(0, len(raw)))
        raw[at:at] = data.draw(st.binary(max_size=16))
    path = tmp_path / "x.ckpt"
    path.write_bytes(bytes(raw))
    _read_ckpt(path)


@settings(max_examples=150 * SCALE, **SETTINGS)
@given(dims=st.lists(st.integers(0, 2**64 - 1), max_size=40),
       dtype=st.sampled_from(["Float32", "BFloat16", "Int64", "Bool", "str", "Float8", ""]),
       content=st.binary(max_size=64), name=st.text(max_size=8))
def test_ckpt_message_fuzz(tmp_path, dims, dtype, content, name):
    from tests.mf_ds.test_hostile_files import _ckpt

    _read_ckpt(_ckpt(tmp_path / "x.ckpt", name, dims, dtype, content))


JSON_LINES = (st.text(max_size=40)
              | VALUES.map(json.dumps)
              | st.dictionaries(st.just("text"), st.text(max_size=10) | VALUES, min_size=1).map(json.dumps)
              | st.integers(1, 3000).map(lambda d: "[" * d + "]" * d)
              | st.sampled_from(["NaN", '{"text": "a", "x": Infinity}', '{"text": 1' + "0" * 5000 + "}"]))


@settings(max_examples=150 * SCALE, **SETTINGS)
@given(lines=st.lists(JSON_LINES, min_size=1, max_size=4))
def test_json_lines_fuzz(tmp_path, lines):
    from mf_ds.data.show import cli
    from mf_ds.data.text import read_jsonl

    class Tokenizer:
        eos_token_id = 0

        def __call__(self, text):
            return {"input_ids": list(text.encode())}

    path = tmp_path / "x.jsonl"
    path.write_text("\n".join(line.replace("\n", " ").replace("\r", " ") for line in lines) + "\n")
    with no_hang():
        try:
            read_jsonl(str(path), Tokenizer())
        except DataError as exc:
            assert "\n" not in str(exc)
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli([str(path), "--head", "4"])
    assert code in (0, 2) and "Traceback" not in err.getvalue()
    if code == 2:
        assert err.getvalue().count("\n") == 1 and err.getvalue().startswith("mf-data: error: ")
    for line in out.getvalue().splitlines():  # strict JSON: no NaN / Infinity
        json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} printed"))
