"""torch's CPU threads: the free cores split over the local ranks, unless OMP_NUM_THREADS says (issue 33 item 13)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mf_ds import threads
from tests.conftest import ROOT


@pytest.mark.parametrize("cores,load,env,expected", [
    (8, 0.0, {}, 8),                               # an idle machine, one process: every core
    (8, 0.0, {"LOCAL_SIZE": "2"}, 4),              # deepspeed, 2 ranks here
    (8, 0.0, {"LOCAL_WORLD_SIZE": "3"}, 2),        # torchrun, 3 ranks: 8 // 3
    (2, 13.0, {}, 1),                              # the busy 2-core machine of the issue
    (16, 6.0, {"LOCAL_SIZE": "2"}, 5),             # 10 free cores over 2 ranks
    (2, 0.0, {"LOCAL_SIZE": "4"}, 1),              # more ranks than cores
])
def test_share(monkeypatch, cores, load, env, expected):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert threads.share() == expected


def _threads_after_configure(env: dict) -> int:
    code = "import torch; from mf_ds.threads import configure; configure(); print(torch.get_num_threads())"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    return int(out.stdout.strip())


def test_configure_sets_torch_unless_omp_num_threads_is_set():
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(LOCAL_SIZE=str(2 * (os.cpu_count() or 1)))  # more ranks than cores: 1 thread each
    assert _threads_after_configure(env) == 1
    if (os.cpu_count() or 1) >= 2:
        assert _threads_after_configure({**env, "OMP_NUM_THREADS": "2"}) == 2  # the user's choice stands
