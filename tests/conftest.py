"""Shared test helpers: where the MindFormers reference corpus lives (../shared beside the repository), and the
environment of the tests that start processes.

../shared is the only thing outside the repository a test may read. A clone alone passes: the tests that need the
corpus are skipped, naming the missing folder (`needs_shared`, `corpus_params`). Where ../shared is present (CI) a
missing corpus inside it is an error, never a skip.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import socket
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
CORPUS = SHARED / "reference" / "mindformers" / "corpus"
CONFIGS = ROOT / "configs"
DATA = Path(__file__).resolve().parent / "translators" / "data"
# DeepSpeed builds its CPU ops (shm comm, Adam) at first use into TORCH_EXTENSIONS_DIR, by default one folder per
# Python version for every environment of the user. Each environment's build file names its own torch headers, so
# two venvs running tests at once rebuild the op (40-100 s on 2 cores) each time the other has used it (seen here:
# five rebuilds of the shm op in eight minutes). One folder per environment instead, unless the caller chose one
# (.ci/run does).
_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(
    _CACHE / "torch_extensions" / f"venv-{hashlib.sha256(sys.prefix.encode()).hexdigest()[:12]}"))
# The environment of tests that start mf-train / DeepSpeed in a subprocess: DeepSpeed's CPU accelerator, logs
# flushed line by line, one OpenMP thread unless the caller set a number. The test models are tiny, and OpenMP's
# threads spin-wait on cores that other processes hold: tiny_llama's 150 steps took 221 s with two threads and 28 s
# with one, back to back on this 2-core machine while other processes kept its load at 5. QUIET_CPU_ENV pins one
# thread whatever the caller set, for tests that run several processes at once.
CPU_ENV = {"OMP_NUM_THREADS": "1", **os.environ, "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
QUIET_CPU_ENV = {**CPU_ENV, "OMP_NUM_THREADS": "1"}

SHARED_MISSING = f"{SHARED} is missing (../shared beside the repository: the MindFormers reference corpus, {CORPUS})"
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason=SHARED_MISSING)


def free_port() -> int:
    """A TCP port nobody listens on now, for a torch.distributed rendezvous: fixed ports collide when two test runs
    share the machine (seen here: EADDRINUSE on 29621 while another venv's suite ran)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ds_launch(ranks: int, port: int | None = None) -> list[str]:
    """The command the `deepspeed` runner execs on one node (deepspeed/launcher/runner.py: deepspeed.launcher.launch
    with the world base64-encoded), less the runner's own Python, which imports torch and DeepSpeed only to exec it:
    ~2.5 s a multi-rank launch on 2 loaded cores (6.3 s against 3.6 s for 2 ranks of an empty script, measured here).
    For tests whose claim is the run, not the launcher; the runner itself stays covered (test_train's 2-rank run,
    test_multinode, test_launch_errors)."""
    world = base64.urlsafe_b64encode(json.dumps({"localhost": list(range(ranks))}).encode()).decode()
    return [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world}",
            "--master_addr=127.0.0.1", f"--master_port={port or free_port()}"]


def corpus_files() -> list[Path]:
    """The corpus YAMLs; none in a clone without ../shared."""
    if not SHARED.is_dir():
        return []
    files = sorted(CORPUS.glob("*.yaml"))
    assert files, f"the MindFormers reference corpus is missing: {CORPUS}"
    return files


def corpus_params(*more: Path) -> list:
    """`parametrize` values: the corpus YAMLs, then `more` (the repository's own files, which always run). Without
    ../shared one skipped entry, "corpus", stands for the corpus, so the run says what it did not check and why."""
    corpus = corpus_files() or [pytest.param(CORPUS, id="corpus", marks=pytest.mark.skip(reason=SHARED_MISSING))]
    return [*corpus, *more]


@pytest.fixture(autouse=True)
def _restore_torch_linear():
    """A ZeRO-3 engine built in the test process replaces torch.nn.functional.linear with DeepSpeed's
    zero3_linear_wrap for the rest of the process (partition_parameters.py _enable_mem_efficient_linear: "This will
    persist unless manually reset"); a later test then counts another autograd graph (test_recompute's FLOP counts
    failed after test_optim_state's or test_zero's ZeRO-3 engines). Each test gets the function it started with."""
    functional = sys.modules.get("torch.nn.functional")  # translator tests never import torch
    linear = functional.linear if functional else None
    yield
    if linear is not None:
        functional.linear = linear
