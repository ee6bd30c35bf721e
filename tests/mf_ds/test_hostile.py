"""A checkpoint directory written by someone else (issue 23): nothing in it runs code, and a resume that cannot be
trusted says why in one line.

Every case starts from a copy of one real run (2 steps, a checkpoint each) and runs `mf_ds.train.main` in one
subprocess, as tests/mf_ds/test_damaged.py does. A payload is a pickle whose `__reduce__` creates a marker file
when it is unpickled; it is planted in the checkpoint's RNG state (an older mf-ds' rng.pt), in DeepSpeed's model
states and in its optimizer state, and checksums.json is rewritten to match (anyone who can plant a file can), or
removed and the directory trusted. The marker must never appear. The payload is live: the test unpickles a copy
the unsafe way and sees its marker.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT
from tests.mf_ds.test_damaged import ENV, LLAMA, SMALL


class Payload:
    """Unpickled, it creates `marker` (open(marker, "w")): code of the file's choosing."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def _plant(pt: Path, marker: Path) -> None:
    """Rewrite DeepSpeed's `.pt` file with the payload beside its real content (so only the payload is wrong)."""
    state = torch.load(pt, weights_only=False)  # our own file, written by the run above
    state["ds_version"] = Payload(marker)
    torch.save(state, pt)


def _rechecksum(ckpt: Path) -> None:
    from mf_ds.checkpoint.native import write_checksums

    write_checksums(ckpt)


def _cases(base: Path, run: Path) -> list[dict]:
    cases = []

    def add(name, argv, names, phrase, output, expect=2):
        cases.append({"id": name, "argv": [LLAMA, "--output_dir", str(output), "--max_steps", "3", *SMALL, *argv],
                      "names": str(names), "phrase": phrase, "expect": expect,
                      "marker": str(base / name / "MARKER")})

    def resumed(name):
        out = base / name / "out"
        shutil.copytree(run, out)
        return out, out / "checkpoint" / "t-step2", base / name / "MARKER"

    out, ckpt, marker = resumed("payload-rng")
    (ckpt / "rng.json").unlink()
    (ckpt / "rng.pt").write_bytes(pickle.dumps({"python": Payload(marker)}))
    _rechecksum(ckpt)
    add("payload-rng", ["--resume_training"], ckpt / "rng.pt", "refused", out)

    for name, pattern in (("payload-model-states", "mp_rank_00_model_states.pt"),
                          ("payload-optimizer", "*optim_states.pt")):
        out, ckpt, marker = resumed(name)
        pt = next((ckpt / "engine" / "state").glob(pattern))
        _plant(pt, marker)
        _rechecksum(ckpt)
        add(name, ["--resume_training"], pt, "refused: it asks the unpickler for io.open", out)

    out, ckpt, marker = resumed("payload-trusted")  # no checksums.json, and the user trusts the directory
    pt = ckpt / "engine" / "state" / "mp_rank_00_model_states.pt"
    _plant(pt, marker)
    (ckpt / "checksums.json").unlink()
    add("payload-trusted", ["--resume_training", "--trust_checkpoint"], pt, "refused", out)

    out, ckpt, _ = resumed("no-checksums")
    (ckpt / "checksums.json").unlink()
    add("no-checksums", ["--resume_training"], ckpt / "checksums.json", "--trust_checkpoint", out)

    out, ckpt, _ = resumed("no-checksums-trusted")
    (ckpt / "checksums.json").unlink()
    add("no-checksums-trusted", ["--resume_training", "--trust_checkpoint"], "", "", out, expect=0)

    out, ckpt, _ = resumed("file-added")
    shutil.copy(ckpt / "rng.json", ckpt / "engine" / "state" / "extra.pt")
    add("file-added", ["--resume_training"], ckpt / "engine" / "state" / "extra.pt", "not listed", out)

    out, ckpt, _ = resumed("state-step-changed")
    state = json.loads((ckpt / "trainer_state.json").read_text())
    (ckpt / "trainer_state.json").write_text(json.dumps({**state, "step": 3}, indent=2))  # same size
    add("state-step-changed", ["--resume_training"], ckpt / "trainer_state.json", "sha256 mismatch", out)

    elsewhere = base / "elsewhere"
    shutil.copytree(run / "checkpoint", elsewhere)
    for name, target in (("latest-absolute", str(elsewhere / "t-step2")),
                         ("latest-dotdot", "../../../elsewhere/t-step2")):
        out, _, _ = resumed(name)
        (out / "checkpoint" / "latest").write_text(target + "\n")
        add(name, ["--resume_training"], out / "checkpoint" / "latest", "not a checkpoint of", out)

    (base / "a-file").write_text("x")
    add("output-dir-is-a-file", [], base / "a-file", "output_dir is a file", base / "a-file")
    out = base / "checkpoint-is-a-file" / "out"
    out.mkdir(parents=True)
    (out / "checkpoint").write_text("x")
    add("checkpoint-is-a-file", [], out / "checkpoint", "checkpoint directory is a file", out)
    add("load-checkpoint-missing", ["--load_checkpoint", str(base / "nonexistent")], base / "nonexistent",
        "does not exist", base / "load-checkpoint-missing" / "out")
    return cases


def _runner(spec: str, results: str) -> None:
    from tests.mf_ds.test_damaged import _runner as run_cases

    run_cases(spec, results)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    base = tmp_path_factory.mktemp("hostile")
    run = base / "run"
    proc = subprocess.run([sys.executable, "-m", "mf_ds.cli", LLAMA, "--output_dir", str(run), "--max_steps", "2",
                           *SMALL], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cases = _cases(base, run)
    spec = base / "cases.json"
    spec.write_text(json.dumps(cases))
    code = f"from tests.mf_ds.test_hostile import _runner; _runner({str(spec)!r}, {str(base / 'results.json')!r})"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((base / "results.json").read_text())
    return {case["id"]: (case, results[case["id"]]) for case in cases}


CASE_IDS = ["payload-rng", "payload-model-states", "payload-optimizer", "payload-trusted", "no-checksums",
            "no-checksums-trusted", "file-added", "state-step-changed", "latest-absolute", "latest-dotdot",
            "output-dir-is-a-file", "checkpoint-is-a-file", "load-checkpoint-missing"]


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_hostile_checkpoint_is_refused_in_one_line_and_runs_nothing(outcomes, case_id):
    case, result = outcomes[case_id]
    err = result["stderr"]
    assert result["code"] == case["expect"] and "Traceback" not in err, err[-3000:]
    assert not os.path.exists(case["marker"]), "the payload ran"
    if case["expect"] == 2:
        last = err.strip().splitlines()[-1]
        assert last.startswith("mf-train: error: ") and case["names"] in last and case["phrase"] in last, last
    else:
        assert "resumed from" in err and "at step 2" in err, err[-2000:]


def test_the_payload_is_live(tmp_path):
    """What the refusals above prevent: the unsafe unpickler runs the payload."""
    marker = tmp_path / "MARKER"
    pt = tmp_path / "x.pt"
    torch.save({"ds_version": Payload(marker)}, pt)
    torch.load(pt, weights_only=False)
    assert marker.exists()


# ---------------------------------------------------------------------------------------------------------------
# The HF Trainer path (mf_ds.hf.MFTrainer): the same refusals, through transformers' resume_from_checkpoint.

HF_SCRIPT = """
import os, sys, json
os.environ.update(DS_ACCELERATOR="cpu", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=sys.argv[1])
from transformers import TrainerCallback
from mf_ds.checkpoint.native import CheckpointError
from mf_ds.hf import from_mf_yaml

class Begin(TrainerCallback):
    def on_train_begin(self, args, state, control, **kwargs):
        print("BEGIN", state.global_step)
yaml, steps, trust = sys.argv[2], int(sys.argv[3]), sys.argv[4] == "trust"
callbacks = [{"type": "MFLossMonitor"}, {"type": "CheckpointMonitor", "save_checkpoint_steps": 1,
                                         "keep_checkpoint_max": 2}]
for out in sys.argv[5:]:
    setup = from_mf_yaml(yaml, output_dir=out, max_steps=steps, callbacks=callbacks,
                         **{"runner_config.batch_size": 1, "model.model_config.seq_length": 32,
                            "runner_config.gradient_accumulation_steps": 1, "recompute_config.recompute": False})
    try:
        trainer = setup.trainer(trust_checkpoint=trust)
        trainer.add_callback(Begin())
        trainer.train(resume_from_checkpoint=steps > 2)
        print("RESULT", out, "trained")
    except CheckpointError as exc:
        print("RESULT", out, "error:", str(exc).splitlines()[0])
"""


def _hf(*argv: str, begins: list | None = None) -> dict[str, str]:
    from tests.conftest import free_port

    proc = subprocess.run([sys.executable, "-c", HF_SCRIPT, str(free_port()), LLAMA, *argv], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    results = [line.split(" ", 2)[1:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if begins is not None:
        begins += [int(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("BEGIN ")]
    return dict(results)


def test_hf_trainer_resume_refuses_what_mf_train_refuses(tmp_path):
    run = tmp_path / "run"
    assert _hf("2", "-", str(run)) == {str(run): "trained"}
    ckpt = run / "checkpoint-2"
    assert (ckpt / "checksums.json").is_file() and "trainer_state.json" in (ckpt / "checksums.json").read_text()

    def copy(name):
        shutil.copytree(run, tmp_path / name)
        return tmp_path / name / "checkpoint-2"

    marker = tmp_path / "MARKER"
    payload = copy("payload")
    _plant(payload / "global_step2" / "mp_rank_00_model_states.pt", marker)
    _rechecksum(payload)
    (copy("no-checksums") / "checksums.json").unlink()
    (copy("latest") / "latest").write_text(str(ckpt / "global_step2"))
    (copy("added") / "extra.bin").write_bytes(b"x")
    trusted = copy("trusted")
    (trusted / "checksums.json").unlink()
    names = ["latest", "no-checksums", "added", "payload"]
    got = _hf("3", "-", *(str(tmp_path / n) for n in names))
    assert not marker.exists(), "the payload ran"
    expected = {"latest": f"{tmp_path / 'latest' / 'checkpoint-2' / 'latest'}: names",
                "no-checksums": f"{tmp_path / 'no-checksums' / 'checkpoint-2' / 'checksums.json'}: missing",
                "added": f"{tmp_path / 'added' / 'checkpoint-2' / 'extra.bin'}: not listed",
                "payload": f"{payload / 'global_step2' / 'mp_rank_00_model_states.pt'}: refused: it asks the "
                           "unpickler for io.open"}
    for name in names:
        assert got[str(tmp_path / name)].startswith(f"error: {expected[name]}"), got
    # trusted without checksums: DeepSpeed's state still loads, through the weights-only unpickler
    begins = []
    assert _hf("3", "trust", str(tmp_path / "trusted"), begins=begins) == {str(tmp_path / "trusted"): "trained"}
    assert begins == [2]  # it resumed at step 2, not from scratch
    state = json.loads((tmp_path / "trusted" / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["global_step"] == 3


# ---------------------------------------------------------------------------------------------------------------
# The RNG state without pickle


def _draws() -> list:
    import random

    import numpy as np

    return [random.random(), random.gauss(0, 1), float(np.random.rand()), float(np.random.randn()),
            float(torch.rand(1))]


def test_rng_state_round_trips_through_json(tmp_path):
    from mf_ds.checkpoint.native import RNG, _load_rng, rng_state

    torch.manual_seed(3)
    _draws()  # leave a cached gaussian in numpy's state
    (tmp_path / RNG).write_text(json.dumps(rng_state()))
    expected = _draws()
    _draws()
    _load_rng(tmp_path)
    assert _draws() == expected


def test_an_older_checkpoints_rng_pt_is_read_weights_only(tmp_path):
    import random

    import numpy as np

    from mf_ds.checkpoint.native import _load_rng

    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
               tmp_path / "rng.pt")  # what mf-ds wrote before
    expected = _draws()
    _load_rng(tmp_path)
    assert _draws() == expected


@pytest.mark.parametrize("text", ["/etc", "../x-step1", "a/t-step1", "..", "t-step1\x00"])
def test_latest_outside_the_directory_is_refused(tmp_path, text):
    from mf_ds.checkpoint.native import CheckpointError, latest

    (tmp_path / "latest").write_text(text + "\n")
    with pytest.raises(CheckpointError, match="a resume reads only checkpoints inside its checkpoint directory"):
        latest(tmp_path)


@pytest.mark.parametrize("universal", [False, True])
def test_safe_loading_on_the_engine(tmp_path, universal):
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    from mf_ds.checkpoint.native import CheckpointError, install_safe_loading

    class Engine:
        checkpoint_engine = TorchCheckpointEngine()

        def load_universal_checkpoint(self):
            return universal

    engine = Engine()
    if universal:  # ZeRO-3 unpickles universal checkpoints itself, with weights_only=False
        with pytest.raises(CheckpointError, match="load_universal"):
            install_safe_loading(engine)
        return
    install_safe_loading(engine)
    assert isinstance(engine.checkpoint_engine, TorchCheckpointEngine)
    good, bad, marker = tmp_path / "good.pt", tmp_path / "bad.pt", tmp_path / "MARKER"
    torch.save({"module": {"w": torch.ones(2)}, "ds_version": "0.19.8"}, good)
    assert torch.equal(engine.checkpoint_engine.load(str(good))["module"]["w"], torch.ones(2))
    torch.save({"module": {}, "ds_version": Payload(marker)}, bad)
    with pytest.raises(CheckpointError, match=f"{bad}: refused: it asks the unpickler for io.open"):
        engine.checkpoint_engine.load(str(bad))
    assert not marker.exists()
