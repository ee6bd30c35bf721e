"""mf_ds.build_lock: a DeepSpeed op build lock left by a killed build is one line naming it, not a silent hang.

The lock is torch's FileBaton file in the op's build folder (TORCH_EXTENSIONS_DIR/<op>/lock), written by the
tests into a folder of their own: mf-train refuses an old one before start-up, and a wait that outlives the limit
(torch's own FileBaton.wait, the loop a run sits in) ends with one line and exit 2.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tests.conftest import CONFIGS, CPU_ENV, ROOT


def _lock(root, age_s: float):
    lock = root / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.write_text("")
    os.utime(lock, (time.time() - age_s, time.time() - age_s))
    return lock


def test_mf_train_names_a_stale_lock_and_exits_2(tmp_path):
    lock = _lock(tmp_path / "ext", age_s=3600)
    env = {**CPU_ENV, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "mf_ds.cli", str(CONFIGS / "tiny_llama.yaml"), "--output_dir",
                           str(tmp_path / "out"), "--max_steps", "1"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"mf-train: error: {lock}: DeepSpeed's build lock of op deepspeed_shm_comm is 36") and \
        f"rm {lock}" in last, last
    assert time.monotonic() - start < 120


def test_a_wait_that_outlives_the_limit_ends_in_one_line(tmp_path):
    lock = _lock(tmp_path / "ext", age_s=0)  # young: check() lets it pass, then it ages while torch waits
    code = ("import os\n"
            "from mf_ds import build_lock\n"
            "from torch.utils.file_baton import FileBaton\n"
            f"os.utime({str(lock)!r})\n"  # taken just now (the imports take longer than the 1 s limit)
            "build_lock.check()\n"
            f"with build_lock.watch(poll_s=0.2):\n    FileBaton({str(lock)!r}).wait()\n")
    env = {**CPU_ENV, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "MF_DS_BUILD_LOCK_TIMEOUT": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(f"mf-ds: error: {lock}: DeepSpeed's build lock")


def test_a_fresh_lock_or_none_passes(tmp_path):
    from mf_ds import build_lock

    assert build_lock.stale_lock(tmp_path / "none", max_age=600) is None
    _lock(tmp_path / "ext", age_s=10)
    assert build_lock.stale_lock(tmp_path / "ext", max_age=600) is None
    found = build_lock.stale_lock(tmp_path / "ext", max_age=5)
    assert found and found[0].name == "lock" and found[1] >= 10
