"""One run per output directory (mf_ds/run_lock.py, issue 33 item 20), and the whole-run cases of items 18 and 19.

In-process: the lock refuses a second holder in one line naming the directory and the holder; a holder SIGKILLed
leaves nothing stuck. End to end with mf-train (each a subprocess on tiny_llama):
  - a second run on the directory of a running one (frozen by SIGSTOP while the second starts, so the machine's
    speed cannot end it first) is refused in one line (exit 2) and writes nothing there; the first trains on, its
    metrics.jsonl holding each step once;
  - `--resume_training` on a run already at its last step trains nothing and leaves the checkpoint it resumed from
    as it was (it saved that step again in place);
  - Checkpoint 2.0: a run killed after its tracker names iteration 4, before the rename, resumes from iteration 4
    (durable.py recover); a root whose tracker is gone is refused on resume (it trained from step 0), and a
    fresh run there is refused as beside any earlier run's checkpoints.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from mf_ds import run_lock
from mf_ds.checkpoint import sharded
from mf_ds.errors import RunError
from tests.conftest import CONFIGS, QUIET_CPU_ENV, ROOT

SMALL = ["--set", "runner_config.batch_size=1", "--set", "runner_config.gradient_accumulation_steps=1",
         "--set", "parallel_config.data_parallel=1", "--set", "model.model_config.seq_length=32",
         "--set", "recompute_config.recompute=False"]


STEPS = 30


def _callbacks(every: int, legacy: bool = True) -> list[str]:
    return ["--set", "callbacks=[{type: MFLossMonitor}, {type: CheckpointMonitor, prefix: t, save_checkpoint_steps: "
            f"{every}, keep_checkpoint_max: 2, use_legacy_format: {legacy}}}]"]


def _start(out: Path, *args: str, env: dict | None = None) -> tuple[subprocess.Popen, Path]:
    log = out.parent / f"{out.name}-{time.monotonic_ns()}.log"
    cmd = [sys.executable, "-m", "mf_ds.cli", str(CONFIGS / "tiny_llama.yaml"), "--output_dir", str(out), *SMALL,
           *args]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**QUIET_CPU_ENV, **(env or {})}, stdout=subprocess.DEVNULL,
                                stderr=f)
    return proc, log


def _finish(out: Path, *args: str, env: dict | None = None) -> tuple[int, str]:
    proc, log = _start(out, *args, env=env)
    return proc.wait(timeout=600), log.read_text()


def _rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _last_line(err: str) -> str:
    assert "Traceback" not in err, err[-3000:]
    return err.strip().splitlines()[-1]


# --- in-process -------------------------------------------------------------------------------------------------


def test_a_second_holder_is_refused_and_a_release_lets_it_in(tmp_path):
    first = run_lock.acquire(tmp_path / "out", tmp_path / "out" / "checkpoint")
    with pytest.raises(RunError) as info:
        run_lock.acquire(tmp_path / "out", tmp_path / "out" / "checkpoint")
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{tmp_path / 'out'}: another mf-ds run is using it (pid ")
    first.release()
    run_lock.acquire(tmp_path / "out", tmp_path / "out" / "checkpoint").release()


def test_a_checkpoint_folder_outside_the_output_dir_is_locked_too(tmp_path):
    held = run_lock.acquire(tmp_path / "a", tmp_path / "shared")
    with pytest.raises(RunError, match=f"{tmp_path / 'shared'}: another mf-ds run"):
        run_lock.acquire(tmp_path / "b", tmp_path / "shared")
    held.release()


def test_a_killed_holder_leaves_no_lock(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from mf_ds import run_lock; p = Path(sys.argv[1]); held = run_lock.acquire(p, p); "
                               "print('held', flush=True); time.sleep(600)", str(tmp_path)],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunError, match=f"pid {holder.pid} on "):
            run_lock.acquire(tmp_path, tmp_path)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    run_lock.acquire(tmp_path, tmp_path).release()


# --- mf-train ---------------------------------------------------------------------------------------------------


def _wait_stopped(pid: int) -> None:
    """Until every thread of `pid` is stopped: kill(2) returns before the signal is delivered, and a thread that
    has not stopped yet may still write a file (a metrics row, a log line) after the snapshot."""
    deadline = time.monotonic() + 60
    while True:
        states = [(task / "stat").read_text().rsplit(")", 1)[1].split()[0]
                  for task in Path(f"/proc/{pid}/task").iterdir()]
        if all(s in "Tt" for s in states):
            return
        assert time.monotonic() < deadline, f"pid {pid} did not stop after SIGSTOP: {states}"
        time.sleep(0.01)


def _mtimes(out: Path) -> dict[Path, int]:
    return {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}


def _two_runs_then_resume_at_the_end(base: Path) -> dict:
    """Run A trains; at its first step it is frozen (SIGSTOP: it holds its lock, as a running run does, however slow
    the machine); B starts on its directory and must be refused; A goes on to its last step; C resumes A there."""
    out = base / "shared"
    sets = ["--max_steps", str(STEPS), *_callbacks(10**6)]  # saves at the last step only
    a, a_log = _start(out, *sets)
    deadline = time.monotonic() + 400
    while not _rows(out):
        assert a.poll() is None and time.monotonic() < deadline, a_log.read_text()[-3000:]
        time.sleep(0.02)
    a.send_signal(signal.SIGSTOP)
    _wait_stopped(a.pid)
    files = _mtimes(out)
    try:
        b_code, b_err = _finish(out, "--resume_training", *sets)
        now = _mtimes(out)
        changed = sorted(str(p) for p in set(files) | set(now) if files.get(p) != now.get(p))
        a_running = a.poll() is None
    finally:
        a.send_signal(signal.SIGCONT)
    a_code = a.wait(timeout=600)
    ckpt = out / "checkpoint" / f"t-step{STEPS}"
    before = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in ckpt.rglob("*")}
    c_code, c_err = _finish(out, "--resume_training", *sets)
    after = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in ckpt.rglob("*")} if ckpt.is_dir() else {}
    return {"out": out, "b": (b_code, b_err), "changed": changed, "a_running": a_running,
            "a": (a_code, a_log.read_text()), "c": (c_code, c_err), "before": before, "after": after}


def _checkpoint2_kill_and_lost_tracker(base: Path) -> dict:
    out = base / "ck2"
    sets = ["--max_steps", "4", *_callbacks(2, legacy=False)]
    killed = _finish(out, *sets, env={"MF_DS_TEST_KILL_AT": "save2.tracker@4"})
    root = out / "checkpoint"
    state = sorted(p.name for p in root.iterdir())
    tmp = root / "iteration_00000004.tmp"
    files = {p.relative_to(tmp): (p.stat().st_ino, p.stat().st_mtime_ns) for p in tmp.rglob("*")}
    resumed = _finish(out, "--resume_training", *sets)  # at its last step: completes iteration 4, trains nothing
    final = root / "iteration_00000004"
    kept = {p.relative_to(final): (p.stat().st_ino, p.stat().st_mtime_ns) for p in final.rglob("*")} == files
    (root / sharded.TRACKER).unlink()
    lost = _finish(out, "--resume_training", "--max_steps", "6", *_callbacks(2, legacy=False))
    fresh = _finish(out, "--max_steps", "6", *_callbacks(2, legacy=False))
    return {"root": root, "killed": killed, "state": state, "resumed": resumed, "lost": lost, "fresh": fresh,
            "rows": _rows(out), "kept": kept}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("lock")
    with ThreadPoolExecutor(2) as pool:
        two = pool.submit(_two_runs_then_resume_at_the_end, base)
        ck2 = pool.submit(_checkpoint2_kill_and_lost_tracker, base)
        return {"two": two.result(), "ck2": ck2.result()}


def test_a_second_run_on_a_running_runs_directory_is_refused(runs):
    r = runs["two"]
    code, err = r["b"]
    assert r["a_running"], "run A ended before run B was refused: the test proves nothing"
    last = _last_line(err)
    assert code == 2 and f"{r['out']}: another mf-ds run is using it (pid " in last, last
    assert last.endswith("); wait for it to end, or give another --output_dir"), last
    assert not r["changed"], f"the refused run changed files of the running one: {r['changed']}"
    a_code, a_err = r["a"]
    assert a_code == 0, a_err[-3000:]
    assert [row["step"] for row in _rows(r["out"])] == list(range(1, STEPS + 1))


def test_resume_at_the_last_step_never_rewrites_its_checkpoint(runs):
    r = runs["two"]
    code, err = r["c"]
    assert code == 0, err[-3000:]
    assert f"resumed from {r['out'] / 'checkpoint' / f't-step{STEPS}'} at step {STEPS}" in err
    assert r["before"] and r["after"] == r["before"], "the checkpoint resumed from was written again"
    assert [row["step"] for row in _rows(r["out"])] == list(range(1, STEPS + 1))


def test_checkpoint2_kill_between_tracker_and_rename_resumes_from_it(runs):
    r = runs["ck2"]
    code, err = r["killed"]
    assert code == -signal.SIGKILL, err[-3000:]
    assert "iteration_00000004.tmp" in r["state"] and "iteration_00000004" not in r["state"], r["state"]
    code, err = r["resumed"]
    assert code == 0, err[-3000:]
    assert f"{r['root'] / 'iteration_00000004'}: completed from iteration_00000004.tmp/" in err
    assert "(Checkpoint 2.0: weights, optimizer state, LR schedule) at step 4" in err
    assert r["kept"], "the iteration resumed from at the last step was written again"


def test_checkpoint2_root_without_its_tracker_is_refused_not_restarted(runs):
    r = runs["ck2"]
    code, err = r["lost"]
    assert code == 2 and "latest_checkpointed_iteration.txt: missing; name one iteration_XXXXXXXX" in \
        _last_line(err), err[-3000:]
    code, err = r["fresh"]
    assert code == 2 and "holds checkpoints of an earlier run" in _last_line(err), err[-3000:]
    assert [row["step"] for row in r["rows"]] == [1, 2, 3, 4], "a refused run wrote metrics"


@pytest.mark.deepspeed
def test_every_rank_of_a_refused_two_rank_run_stops_with_the_line(tmp_path):
    """Rank 0 takes the lock for the run; it tells rank 1, and both stop with the same line (rank 1 would otherwise
    wait in its first collective for a rank 0 that left)."""
    from tests.mf_ds.test_faults import finish, start_ranks

    out = tmp_path / "run"
    held = run_lock.acquire(out, out / "checkpoint")
    try:
        ranks = start_ranks(out)
        codes = finish(ranks, timeout=600)
    finally:
        held.release()
    for (_, log), code in zip(ranks, codes, strict=True):
        last = _last_line(log.read_text())
        assert code == 2 and f"{out}: another mf-ds run is using it (pid " in last, last
    assert not (out / "metrics.jsonl").exists()
