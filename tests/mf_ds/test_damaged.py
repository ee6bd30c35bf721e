"""Damaged inputs: each is one clear error (exit 2) naming the file, and nothing on disk is overwritten.

Weights (`--load_checkpoint`): MindSpore .ckpt files truncated or failing their CRC; HF directories: truncated,
a flipped bit in the header, a flipped bit in the data
(caught by the checksums an mf-ds checkpoint carries, or as inf/NaN when it makes one), a missing shard, an index
that is not JSON. Checkpoints (`--resume_training`): a flipped bit in the optimizer state, truncated weights, a
broken trainer_state.json. Data: a `.bin`/`.idx` pair that does not match, empty data sets, JSON lines that are not
UTF-8, MindRecord shards that are truncated, indexed by another file's .db or missing, and tokenizer directories
that are not one.

Every case starts from a copy of one real run (2 steps, a checkpoint each). To keep the start-up cost (~5 s) to
one, the cases run through `mf_ds.train.main` one after another in a single subprocess (`_runner` below); each
checks its exit code, its last stderr line and the checksums of every file it could have touched.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import shutil
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

from mf_ds.run_lock import LOCK
from tests.conftest import CONFIGS, QUIET_CPU_ENV, ROOT

LLAMA = str(CONFIGS / "tiny_llama.yaml")
ENV = QUIET_CPU_ENV
SMALL = ["--set", "runner_config.batch_size=1", "--set", "parallel_config.data_parallel=1",
         "--set", "model.model_config.seq_length=32", "--set", "recompute_config.recompute=False",
         "--set", "callbacks=[{type: MFLossMonitor}, {type: CheckpointMonitor, prefix: t, save_checkpoint_steps: 1, "
                  "keep_checkpoint_max: 2}]"]


def _digests(*roots: Path) -> dict[str, str]:
    out = {}
    for root in roots:
        # the run's lock file (mf_ds/run_lock.py) is taken before anything is read; it holds no result
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file() and p.name != LOCK)
        out.update({str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files})
    return out


def _flip(path: Path, offset: int, mask: int = 0x10) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= mask
    path.write_bytes(bytes(data))


def _header_size(path: Path) -> int:
    return 8 + int.from_bytes(path.read_bytes()[:8], "little")


def _hf_dir(run: Path, dest: Path, checksums: bool = False) -> Path:
    """The weights of the run's newest checkpoint as a plain HF directory (with checksums.json when asked)."""
    src = run / "checkpoint" / "t-step2"
    dest.mkdir(parents=True)
    names = ["config.json", "model.safetensors"] + (["checksums.json"] if checksums else [])
    for name in names:
        shutil.copy(src / name, dest / name)
    return dest


def _shard(hf: Path) -> None:
    """Split model.safetensors into three shards with an index, as save_pretrained(max_shard_size=...) does."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(hf / "model.safetensors"))
    (hf / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for i in range(3):
        shard = f"model-{i + 1:05d}-of-00003.safetensors"
        part = {n: tensors[n] for n in names[i::3]}
        save_file(part, str(hf / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _nan_weight(hf: Path) -> str:
    """Turn the first float of one tensor into NaN (exponent all ones), leaving the file well-formed."""
    path = hf / "model.safetensors"
    header = json.loads(path.read_bytes()[8:_header_size(path)])
    name = "model.norm.weight"
    start = _header_size(path) + header[name]["data_offsets"][0]
    data = bytearray(path.read_bytes())
    data[start:start + 4] = b"\x00\x00\xc0\x7f"  # float32 NaN, little-endian
    path.write_bytes(bytes(data))
    return name


def _tokenizer(directory: Path) -> None:
    from tests.mf_ds.test_data import save_tokenizer

    save_tokenizer(directory)


def _cases(base: Path, run: Path) -> list[dict]:
    """Build every damaged input under `base`; returns the cases: argv, what the error names, what to watch."""
    from mf_ds.data import write_indexed

    cases = []

    def add(name, argv, names, watch, output=None, phrase=""):
        out = output or base / name / "out"
        cases.append({"id": name, "argv": [LLAMA, "--output_dir", str(out), "--max_steps", "3", *SMALL, *argv],
                      "names": str(names), "phrase": phrase, "watch": [str(w) for w in [*watch, out]]})

    def resumed(name):  # a copy of the run to resume, damaged by the caller
        out = base / name / "out"
        shutil.copytree(run, out)
        return out

    def weights(name, **kw):
        return _hf_dir(run, base / name / "hf", **kw)

    hf = weights("hf-truncated")
    data = (hf / "model.safetensors").read_bytes()
    (hf / "model.safetensors").write_bytes(data[: len(data) // 2])
    add("hf-truncated", ["--load_checkpoint", str(hf)], hf / "model.safetensors", [hf], phrase="truncated")

    hf = weights("hf-header-bit")
    _flip(hf / "model.safetensors", 20, 0x40)
    add("hf-header-bit", ["--load_checkpoint", str(hf)], hf / "model.safetensors", [hf])

    hf = weights("hf-data-bit", checksums=True)
    _flip(hf / "model.safetensors", _header_size(hf / "model.safetensors") + 1000, 0x01)
    add("hf-data-bit", ["--load_checkpoint", str(hf)], hf / "model.safetensors", [hf], phrase="sha256 mismatch")

    hf = weights("hf-nan")
    tensor = _nan_weight(hf)
    add("hf-nan", ["--load_checkpoint", str(hf)], hf / "model.safetensors", [hf], phrase=f"{tensor} holds inf/NaN")

    hf = weights("hf-missing-shard")
    _shard(hf)
    (hf / "model-00002-of-00003.safetensors").unlink()
    add("hf-missing-shard", ["--load_checkpoint", str(hf)], hf / "model-00002-of-00003.safetensors", [hf],
        phrase="missing")

    hf = weights("hf-bad-index")
    _shard(hf)
    (hf / "model.safetensors.index.json").write_text('{"weight_map": ')
    add("hf-bad-index", ["--load_checkpoint", str(hf)], hf / "model.safetensors.index.json", [hf])

    out = resumed("resume-optimizer-bit")
    state = next((out / "checkpoint" / "t-step2" / "engine" / "state").glob("*optim_states.pt"))
    _flip(state, state.stat().st_size // 2)
    add("resume-optimizer-bit", ["--resume_training"], state, [], output=out, phrase="sha256 mismatch")

    out = resumed("resume-truncated-weights")
    weights_file = out / "checkpoint" / "t-step2" / "model.safetensors"
    weights_file.write_bytes(weights_file.read_bytes()[:1000])
    add("resume-truncated-weights", ["--resume_training"], weights_file, [], output=out, phrase="truncated")

    out = resumed("resume-bad-state")
    state = out / "checkpoint" / "t-step2" / "trainer_state.json"
    state.write_text('{"step": ')
    add("resume-bad-state", ["--resume_training"], state, [], output=out, phrase="unreadable")

    data_dir = base / "data"
    data_dir.mkdir()
    docs = [[3 + (i * 7 + j) % 250 for j in range(40 + i)] for i in range(40)]
    write_indexed(str(data_dir / "a"), docs)
    write_indexed(str(data_dir / "b"), docs[:20])
    mismatch = data_dir / "mismatch"
    mismatch.mkdir()
    shutil.copy(data_dir / "a.idx", mismatch / "corpus.idx")
    shutil.copy(data_dir / "b.bin", mismatch / "corpus.bin")  # another data set's tokens
    add("data-pair-mismatch", ["--resume_training", "--train_dataset_dir", str(mismatch / "corpus")],
        mismatch / "corpus.bin", [mismatch], output=resumed("data-pair-mismatch"), phrase="does not match")

    write_indexed(str(data_dir / "empty"), [])
    add("data-empty-megatron", ["--resume_training", "--train_dataset_dir", str(data_dir / "empty")],
        data_dir / "empty", [data_dir / "empty.bin"], output=resumed("data-empty-megatron"), phrase="empty dataset")

    empty_dir = data_dir / "nothing"
    empty_dir.mkdir()
    add("data-empty-dir", ["--resume_training", "--train_dataset_dir", str(empty_dir)], empty_dir, [empty_dir],
        output=resumed("data-empty-dir"), phrase="no Megatron")

    tok = base / "tokenizer"
    _tokenizer(tok)
    (data_dir / "empty.jsonl").write_text("\n\n")
    add("data-empty-jsonl", ["--train_dataset_dir", str(data_dir / "empty.jsonl"), "--set",
                             f"mf_ds.tokenizer_dir={tok}"], data_dir / "empty.jsonl", [tok], phrase="empty dataset")

    (data_dir / "latin1.jsonl").write_bytes('{"text": "the cat"}\n{"text": "caf\xe9"}\n'.encode("latin-1"))
    add("data-jsonl-not-utf8", ["--train_dataset_dir", str(data_dir / "latin1.jsonl"), "--set",
                                f"mf_ds.tokenizer_dir={tok}"], f"{data_dir / 'latin1.jsonl'}:2", [],
        phrase="not UTF-8")

    from tests.mf_ds.test_mindrecord import ALPACA, _damage

    for how, case in (("truncated page", "data-mindrecord-truncated"), ("db of another file", "data-mindrecord-db"),
                      ("missing shard", "data-mindrecord-missing-shard")):
        shards = base / case / "alpaca"
        shutil.copytree(ALPACA, shards)
        path, phrase = _damage(shards, how)
        add(case, ["--train_dataset_dir", str(shards / "alpaca.mindrecord0")], path, [shards], phrase=phrase)

    from tests.mf_ds.test_mindspore_ckpt import MF

    for case, how in (("ckpt-truncated", "truncated"), ("ckpt-crc", "crc")):
        ckpt = base / case / "model.ckpt"
        ckpt.parent.mkdir(parents=True)
        data = bytearray((MF / "llama" / ("model_crc.ckpt" if how == "crc" else "model.ckpt")).read_bytes())
        if how == "crc":
            data[len(data) // 2] ^= 0x01
        ckpt.write_bytes(bytes(data if how == "crc" else data[: len(data) // 2]))
        add(case, ["--load_checkpoint", str(ckpt)], ckpt, [ckpt.parent],
            phrase="truncated" if how == "truncated" else "does not match")

    not_tok = base / "not-a-tokenizer"
    not_tok.mkdir()
    (not_tok / "README.md").write_text("weights only\n")
    (data_dir / "ok.jsonl").write_text('{"text": "the cat sat on a mat"}\n' * 50)
    add("tokenizer-missing-files", ["--train_dataset_dir", str(data_dir / "ok.jsonl"), "--set",
                                    f"mf_ds.tokenizer_dir={not_tok}"], not_tok, [not_tok], phrase="no tokenizer.json")

    bad_tok = base / "bad-tokenizer"
    shutil.copytree(tok, bad_tok)
    (bad_tok / "tokenizer.json").write_text("garbage")
    add("tokenizer-garbage", ["--train_dataset_dir", str(data_dir / "ok.jsonl"), "--set",
                              f"mf_ds.tokenizer_dir={bad_tok}"], bad_tok, [bad_tok],
        phrase="cannot load the tokenizer")
    return cases


def _runner(spec: str, results: str) -> None:
    """In the subprocess: run each case through mf-train's main and record its exit code and stderr."""
    from mf_ds.train import main

    out = {}
    for case in json.loads(Path(spec).read_text()):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                code = main(case["argv"], prog="mf-train", positional=True)
            except Exception:  # a traceback: what the CLI would end with (exit 1)
                traceback.print_exc(file=err)
                code = 1
        out[case["id"]] = {"code": code, "stderr": err.getvalue()}
    Path(results).write_text(json.dumps(out))


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    base = tmp_path_factory.mktemp("damaged")
    run = base / "run"
    proc = subprocess.run([sys.executable, "-m", "mf_ds.cli", LLAMA, "--output_dir", str(run), "--max_steps", "2",
                           *SMALL], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cases = _cases(base, run)
    before = {case["id"]: _digests(*map(Path, case["watch"])) for case in cases}
    spec = base / "cases.json"
    spec.write_text(json.dumps(cases))
    code = (f"from tests.mf_ds.test_damaged import _runner; _runner({str(spec)!r}, {str(base / 'results.json')!r})")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((base / "results.json").read_text())
    after = {case["id"]: _digests(*map(Path, case["watch"])) for case in cases}
    return {case["id"]: (case, results[case["id"]], before[case["id"]], after[case["id"]]) for case in cases}


CASE_IDS = ["hf-truncated", "hf-header-bit", "hf-data-bit", "hf-nan", "hf-missing-shard", "hf-bad-index",
            "ckpt-truncated", "ckpt-crc",
            "resume-optimizer-bit", "resume-truncated-weights", "resume-bad-state", "data-pair-mismatch",
            "data-empty-megatron", "data-empty-dir", "data-empty-jsonl", "data-jsonl-not-utf8",
            "data-mindrecord-truncated", "data-mindrecord-db", "data-mindrecord-missing-shard",
            "tokenizer-missing-files", "tokenizer-garbage"]


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_damaged_input_is_one_error_naming_the_file(outcomes, case_id):
    case, result, before, after = outcomes[case_id]
    err = result["stderr"]
    assert result["code"] == 2 and "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("mf-train: error: ") and case["names"] in last, last
    assert case["phrase"] in last, last
    assert after == before, "files changed: " + ", ".join(sorted(k for k in before.keys() | after.keys()
                                                                 if before.get(k) != after.get(k)))
