"""One run per output directory: a lock held for the whole run, and the repair of a save a kill cut short.

Two runs writing one directory interleave their metrics.jsonl rows, prune each other's checkpoints and die on each
other's `...-stepN.tmp/` (issue 33). `acquire` takes an exclusive `fcntl.flock` on `<dir>/.mf-ds.lock` for the
output directory and, when it lies elsewhere, the checkpoint directory; a second run is refused in one line while the
first holds them. The kernel drops a flock when the process that holds it ends, however it ends (SIGKILL included),
so a killed run leaves nothing stuck; the file itself stays and means nothing.

Which ranks lock: global rank 0 only. DeepSpeed's ranks of one run share the output directory (every rank writes its
engine shard into the same checkpoint folder), and on several nodes that folder is a shared file system, where the
lock file is one file for all nodes: a lock per node would make one run's nodes refuse each other. Linux NFS clients
map flock onto NFS byte-range locks (nfs(5), "local_lock"), so the lock holds across nodes there too. Rank 0 tells
the others whether it got the lock (a broadcast), so every rank of a refused run stops with the same line.

After taking the lock, rank 0 finishes what a kill between a save's last steps left
(mf_ds/checkpoint/durable.py `recover`): nobody else is writing the directory then.
"""

from __future__ import annotations

import fcntl
import os
import socket
import sys
from pathlib import Path

import torch.distributed as dist

from mf_ds.checkpoint import durable, native
from mf_ds.errors import RunError

LOCK = ".mf-ds.lock"


class RunLock:
    """The open lock files of a run; `release()` (or the process' end) lets the next run in."""

    def __init__(self, files: list) -> None:
        self.files = files

    def release(self) -> None:
        for f in self.files:
            f.close()  # closing the last descriptor drops the flock
        self.files = []


def _lock(directory: Path) -> object:
    """The open, flocked lock file of `directory`; RunError when another process holds it."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK
    f = open(path, "a+", encoding="utf-8")  # noqa: SIM115 -- held open for the run
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read(200).strip()
        f.close()
        raise RunError(f"{directory}: another mf-ds run is using it ({holder or 'see ' + str(path)}); wait for it "
                       "to end, or give another --output_dir") from None
    except OSError as exc:  # a file system without locks: say so rather than run unprotected silently
        f.close()
        raise RunError(f"{path}: cannot lock it ({exc.strerror}); mf-ds locks its output directory so that two runs "
                       "never write one") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    return f


def _inside(path: Path, directory: Path) -> bool:
    path, directory = path.resolve(), directory.resolve()
    return path == directory or directory in path.parents


def acquire(output_dir: Path, checkpoint_dir: Path) -> RunLock:
    """Lock the run's directories (rank 0) and repair an interrupted save; every rank raises the same RunError
    when another run holds them. Collective when torch.distributed is initialized."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    files, error = [], None
    if rank == 0:
        try:
            files.append(_lock(output_dir))
            if not _inside(checkpoint_dir, output_dir):
                files.append(_lock(checkpoint_dir))
            for line in durable.recover(checkpoint_dir):
                print(f"mf-ds: note: {line}", file=sys.stderr, flush=True)
        except (RunError, native.CheckpointError) as exc:
            error = str(exc)
        except OSError as exc:
            error = f"{exc.filename or checkpoint_dir}: {exc.strerror or exc}"
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error:
        for f in files:
            f.close()
        raise RunError(error)
    return RunLock(files)
