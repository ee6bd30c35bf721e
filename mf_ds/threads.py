"""torch's CPU threads: this process's share of the cores it may run on.

torch starts one intra-op thread per core whatever else runs: two ranks on two cores ran four threads, and a
single-process mf-train on a busy two-core machine ran at 35 tokens/s against 2,600 with OMP_NUM_THREADS=1 (issue 33).
Each process takes the cores it may run on (sched_getaffinity: a cgroup or taskset limit counts) that other work does
not already keep busy, divided by the ranks the launcher started on this machine (LOCAL_WORLD_SIZE from torchrun,
LOCAL_SIZE from deepspeed), as `deepspeed --bind_cores_to_rank` and torchrun's OMP_NUM_THREADS divide them.
OMP_NUM_THREADS, when set, is the user's choice and is kept. Measured on this 2-core machine under a load of 13
(tiny_llama, 20 steps, median tokens/s): 701 with torch's 2 threads, 7,003 with 1.
"""

from __future__ import annotations

import math
import os


def share() -> int:
    """The threads one process here should use: the cores not already busy (the 1-minute load average of the
    machine, taken before this run loads it), split over the local ranks; at most cores // local ranks, at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    local = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or "1"
    try:
        ranks = max(int(local), 1)
    except ValueError:
        ranks = 1
    try:
        busy = min(os.getloadavg()[0], cores)
    except OSError:  # no load average here
        busy = 0.0
    free = math.ceil((cores - busy) / ranks)
    return max(min(cores // ranks, free), 1)


def configure() -> str | None:
    """Set torch's intra-op threads to share() on CPU unless OMP_NUM_THREADS says otherwise; returns the line that
    says so (None when nothing was changed)."""
    import torch

    if torch.cuda.is_available() or os.environ.get("OMP_NUM_THREADS"):
        return None
    threads = share()
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return f"mf-ds: {threads} CPU thread(s) per process (free cores // local ranks; OMP_NUM_THREADS overrides)"
