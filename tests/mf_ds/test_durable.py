"""No kill at any point of any save loses the last complete checkpoint (mf_ds/checkpoint/durable.py, issue 33 item 19).

Each case is a subprocess (tests/mf_ds/save_under_kill.py) that saves a checkpoint, then saves another, or the same
step again, and is SIGKILLed by the test-only hook MF_DS_TEST_KILL_AT at one point of that second save. The test then
does what the next run does first (durable.recover, under the run's lock) and reads the checkpoint a resume would
take: it must be complete (checksums verified / every tensor readable) and be the second save from the moment the
pointer names it, else the first. Both formats: the legacy mf-ds checkpoint with a real one-rank DeepSpeed engine,
and Checkpoint 2.0 as mf_ds/checkpoint/sharded.py writes it. tests/mf_ds/test_kill.py kills whole training runs.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from mf_ds.checkpoint import durable, native, sharded
from mf_ds.errors import RunError
from tests.conftest import QUIET_CPU_ENV, ROOT, free_port

LEGACY_POINTS = ["save.engine", "save.weights", "save.state", "save.manifest", "save.latest", "save.aside",
                 "save.rename"]
CK2_POINTS = ["save2.model", "save2.optimizer", "save2.common", "save2.tracker", "save2.aside", "save2.rename"]
# (format, point, first step, second step) -> which save a resume finds: 1 (the earlier) or 2 (the one killed)
CASES = {}
for p in LEGACY_POINTS:  # the same step saved again; test_kill.py kills fresh saves inside training runs
    CASES[("legacy", p, 4, 4)] = 2 if p in ("save.aside", "save.rename") else 1
for p in CK2_POINTS:
    if p != "save2.aside":  # a fresh iteration has nothing to set aside
        CASES[("checkpoint2", p, 2, 4)] = 2 if p in ("save2.tracker", "save2.rename") else 1
    CASES[("checkpoint2", p, 4, 4)] = 2 if p in ("save2.aside", "save2.rename") else 1


def _run(base: Path, case: tuple) -> tuple[int, str, Path]:
    kind, point, first, second = case
    root = base / f"{kind}-{point}-{first}-{second}"
    proc = subprocess.run([sys.executable, "-m", "tests.mf_ds.save_under_kill", kind, str(root), point, str(first),
                           str(second), str(free_port())], cwd=ROOT, env=QUIET_CPU_ENV, capture_output=True,
                          text=True, timeout=600)
    return proc.returncode, proc.stderr, root


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> dict[tuple, tuple[int, str, Path]]:
    base = tmp_path_factory.mktemp("durable")
    with ThreadPoolExecutor(3) as pool:
        return dict(zip(CASES, pool.map(lambda case: _run(base, case), CASES), strict=True))


def _survivor(kind: str, root: Path, step: int) -> int:
    """Which save the checkpoint a resume takes holds, after recover; asserts it is complete and at `step`."""
    if kind == "legacy":
        path = native.latest(root)
        assert path is not None and path.name == f"t-step{step}", path
        assert native.verify(path, required=True) is None
        return json.loads((path / native.STATE).read_text())["save"]
    ckpt = sharded.Checkpoint2(root)
    assert ckpt.iteration == step
    tensors = {name: ckpt.tensor(name) for name in ckpt.names()}
    save = ckpt.common["save"]
    assert torch.equal(tensors["embedding.word_embeddings.weight"], torch.full((8, 4), float(save)))
    assert torch.equal(tensors["adam_m.output_layer.weight"], torch.full((8, 4), float(save)))
    return save


@pytest.mark.parametrize("case", list(CASES), ids=["-".join(map(str, c)) for c in CASES])
def test_a_kill_inside_a_save_leaves_a_complete_checkpoint(killed, case):
    code, err, root = killed[case]
    kind, point, first, second = case
    assert code == -signal.SIGKILL, f"{case}: exit {code}\n{err[-3000:]}"
    durable.recover(root)
    expected = CASES[case]
    assert _survivor(kind, root, second if expected == 2 else first) == expected
    assert not list(root.glob("*.replaced")), "a set-aside copy outlived its replacement"


def test_recover_touches_nothing_when_every_save_finished(tmp_path):
    sharded.write(tmp_path, iter({"w": torch.ones(2)}.items()), iteration=3)
    before = sorted(p.name for p in tmp_path.iterdir())
    assert durable.recover(tmp_path) == [] and sorted(p.name for p in tmp_path.iterdir()) == before


def test_checkpoint2_write_never_moves_a_runs_tracker_back(tmp_path):
    """mf-convert into a run's Checkpoint 2.0 folder wrote iteration_00000000 and set the tracker to 0 (item 18)."""
    sharded.write(tmp_path, iter({"w": torch.ones(2)}.items()), iteration=6)
    with pytest.raises(RunError, match=r"names iteration 6\); writing iteration 0 there would move its tracker"):
        sharded.write(tmp_path, iter({"w": torch.zeros(2)}.items()), iteration=0)
    assert (tmp_path / sharded.TRACKER).read_text() == "6" and not (tmp_path / "iteration_00000000").exists()
