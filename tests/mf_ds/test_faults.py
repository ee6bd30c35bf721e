"""Distributed faults: when one of two CPU ranks dies or freezes, the other stops with one clear line, in bounded
time, and the run resumes from its last complete checkpoint.

The ranks are started by hand (RANK, WORLD_SIZE, MASTER_ADDR/PORT, as a launcher would set them) and no launcher
watches them, so nothing but mf_ds itself can end the survivor: a SIGKILLed rank closes its sockets and the
survivor's next collective fails at once; a frozen one (SIGSTOP) is noticed after `--dist_timeout` (default 600 s,
15 s here) by the process group's timeout or by mf_ds' watchdog, whichever the survivor is waiting in.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import CONFIGS, QUIET_CPU_ENV, ROOT, free_port

pytestmark = pytest.mark.deepspeed

STEPS = 8
ARGS = ["--max_steps", str(STEPS),
        "--set", "callbacks=[{type: MFLossMonitor}, {type: CheckpointMonitor, prefix: t, save_checkpoint_steps: 2, "
                 "keep_checkpoint_max: 2}]",
        "--set", "runner_config.batch_size=1", "--set", "model.model_config.seq_length=32",
        "--set", "recompute_config.recompute=False"]
ENV = QUIET_CPU_ENV


def start_ranks(out: Path, *extra: str) -> list[tuple[subprocess.Popen, Path]]:
    port = free_port()
    ranks = []
    for rank in (0, 1):
        env = dict(ENV, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        log = out.parent / f"{out.name}-rank{rank}-{time.monotonic_ns()}.log"
        with open(log, "w") as f:
            cmd = [sys.executable, str(ROOT / "mf_ds" / "train.py"), "--mf-config", str(CONFIGS / "tiny_llama.yaml"),
                   "--output_dir", str(out), *ARGS, *extra]
            ranks.append((subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=f), log))
    return ranks


def rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for_rows(out: Path, n: int, ranks, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while len(rows(out)) < n:
        assert all(p.poll() is None for p, _ in ranks), [log.read_text()[-2000:] for _, log in ranks]
        assert time.monotonic() < deadline, "the run never got that far"
        time.sleep(0.02)


def finish(ranks, timeout: float = 300) -> list[int]:
    return [p.wait(timeout=timeout) for p, _ in ranks]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same YAML on one rank (twice the accumulation, the same global batch): the two-rank run's losses
    (tests/mf_ds/test_train.py)."""
    out = tmp_path_factory.mktemp("one_rank")
    proc = subprocess.run([sys.executable, "-m", "mf_ds.cli", str(CONFIGS / "tiny_llama.yaml"), "--output_dir",
                           str(out), *ARGS],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [r["loss"] for r in rows(out)]


def test_a_killed_rank_stops_the_other_at_once_and_the_run_resumes(tmp_path, reference):
    out = tmp_path / "run"
    ranks = start_ranks(out)
    wait_for_rows(out, 5, ranks)
    ranks[1][0].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    code = ranks[0][0].wait(timeout=120)
    stopped_after = time.monotonic() - killed
    finish(ranks)
    err = ranks[0][1].read_text()
    assert code == 2 and "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("mf_ds/train.py: error: rank 0: lost contact with another rank"), last
    assert "--resume_training" in last
    assert stopped_after < 30, f"rank 0 needed {stopped_after:.1f} s to notice"

    # The last complete checkpoint is where the two ranks start again; the losses go on as in one rank's run.
    steps = [int(p.name.split("step")[1]) for p in (out / "checkpoint").glob("t-step*")
             if (p / "trainer_state.json").is_file()]
    ranks = start_ranks(out, "--resume_training")
    assert finish(ranks) == [0, 0], ranks[0][1].read_text()[-3000:]
    assert f"resumed from {out / 'checkpoint' / f't-step{max(steps)}'} at step {max(steps)}" in ranks[0][1].read_text()
    assert [r["step"] for r in rows(out)] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in rows(out)] == pytest.approx(reference, rel=1e-5)


def test_a_frozen_rank_times_the_other_out(tmp_path):
    out = tmp_path / "run"
    ranks = start_ranks(out, "--dist_timeout", "15")
    wait_for_rows(out, 3, ranks)
    ranks[1][0].send_signal(signal.SIGSTOP)
    frozen = time.monotonic()
    try:
        code = ranks[0][0].wait(timeout=120)
        waited = time.monotonic() - frozen
    finally:
        ranks[1][0].send_signal(signal.SIGKILL)
        finish(ranks)
    err = ranks[0][1].read_text()
    assert code == 2 and "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.split(": error: ")[1].startswith("rank 0: lost contact with another rank"), last
    assert "Timed out" in last or "no progress for" in last, last
    assert 10 < waited < 60, f"rank 0 gave up after {waited:.1f} s with a 15 s timeout"
