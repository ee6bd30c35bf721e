"""DeepSpeed's C++ op builds and their lock: a lock left by a killed build is reported, not waited on forever.

DeepSpeed builds its CPU ops (the shared-memory communication op `deepspeed_shm_comm`, CPU Adam) at first use with
torch.utils.cpp_extension, into `$TORCH_EXTENSIONS_DIR` (by default ~/.cache/torch_extensions/py311_cpu/<op>/).
The build holds `<op>/lock` (torch's FileBaton); every other process waits, polling, until the file is gone. A
build killed mid-way leaves the lock behind, and every later run on the machine then waits forever, printing
nothing (issue 23). A build takes about 80 s on this project's 2-core CI machine (README), so a lock older than
BUILD_LIMIT_S (600 s, `$MF_DS_BUILD_LOCK_TIMEOUT`) is one nobody will release: `check()` refuses it before the run
starts, and `watch()` ends a run that finds one while it waits (a lock that aged past the limit mid-wait).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mf_ds.errors import RunError

BUILD_LIMIT_S = 600.0
LIMIT_ENV = "MF_DS_BUILD_LOCK_TIMEOUT"


def extensions_root() -> Path:
    """Where torch.utils.cpp_extension builds (its _get_build_directory without the op name)."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root)
    if torch.version.hip is not None:
        accelerator = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        accelerator = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{python}_{accelerator}"


def limit() -> float:
    try:
        return float(os.environ.get(LIMIT_ENV, BUILD_LIMIT_S))
    except ValueError:
        raise RunError(f"${LIMIT_ENV}: {os.environ[LIMIT_ENV]!r} is not a number of seconds") from None


def stale_lock(root: Path | None = None, max_age: float | None = None) -> tuple[Path, float] | None:
    """The first op build lock under `root` older than `max_age` seconds, and its age; None when there is none."""
    root = extensions_root() if root is None else root
    max_age = limit() if max_age is None else max_age
    now = time.time()
    try:
        locks = sorted(root.glob("*/lock"))
    except OSError:
        return None
    for lock in locks:
        try:
            age = now - lock.stat().st_mtime
        except OSError:  # released between the listing and the stat
            continue
        if age > max_age:
            return lock, age
    return None


def message(lock: Path, age: float) -> str:
    return (f"{lock}: DeepSpeed's build lock of op {lock.parent.name} is {age:.0f} s old (a build takes about 80 s; "
            f"limit {limit():g} s, ${LIMIT_ENV}): the build that took it was killed and every run would wait on it "
            f"forever. Delete it (rm {lock}) and run again")


def check() -> None:
    """RunError naming a stale op build lock, before anything waits on it."""
    found = stale_lock()
    if found:
        raise RunError(message(*found))


@contextmanager
def watch(poll_s: float = 5.0) -> Iterator[None]:
    """While the body runs (DeepSpeed's start-up, which builds its ops), end the process with one line (exit 2)
    if a lock grows older than the limit: the main thread is then inside torch's wait loop, which never ends."""
    done = threading.Event()

    def _watch() -> None:
        while not done.wait(poll_s):
            found = stale_lock()
            if found:
                print(f"mf-ds: error: {message(*found)}", file=sys.stderr, flush=True)
                os._exit(2)

    threading.Thread(target=_watch, name="mf-ds-build-lock", daemon=True).start()
    try:
        yield
    finally:
        done.set()
