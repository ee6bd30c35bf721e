"""Saves that no kill can lose: fsync helpers and the repair of a save cut short, for both checkpoint formats.

Both formats save the same way (native.py `save`, sharded.py `write`): the checkpoint is written
whole into `<name>.tmp/` and fsynced; the pointer (`latest`, or Checkpoint 2.0's `latest_checkpointed_iteration.txt`)
is replaced atomically to name it; then the folder is renamed into place. A checkpoint of the same step saved again
(a run restarted from an earlier checkpoint) is first renamed aside to `<name>.replaced/` and removed only after the
new one is in place. So at every moment either the pointer names a complete `<name>/`, or it names a `<name>` whose
complete data sits in `<name>.tmp/` (killed between the pointer and the rename) or `<name>.replaced/` (killed between
setting the old one aside and the rename). `recover` moves that folder into place; the next run calls it (rank 0,
under the run's lock: mf_ds/run_lock.py) before it looks for a checkpoint. A kill before the pointer names the new
checkpoint leaves the pointer on the previous one, untouched.

What marks a `.tmp/` complete is the file each format writes last into it: checksums.json (legacy) or common.json
(Checkpoint 2.0). Nothing here deletes a checkpoint but a set-aside copy whose replacement is in place.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

REPLACED = ".replaced"
TMP = ".tmp"
# the pointer file, its names, and the file written last into a complete checkpoint, per format
_FORMATS = (("latest", re.compile(r"^.+-step\d+$"), "checksums.json"),
            ("latest_checkpointed_iteration.txt", re.compile(r"^iteration_\d{8}$"), "common.json"))


def fsync_dir(directory: Path) -> None:
    """Make a rename or a new file in `directory` durable (POSIX: fsync the folder itself)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(directory: Path) -> None:
    """fsync every file under `directory`, then its folders: the data is on disk before a rename names it (a power
    cut after the rename would otherwise find empty files under the new name)."""
    folders = [directory]
    for path in directory.rglob("*"):
        if path.is_symlink():
            continue
        if path.is_dir():
            folders.append(path)
        elif path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    for folder in folders:
        fsync_dir(folder)


def atomic_write(path: Path, text: str) -> None:
    """Replace `path` with `text` in one step, durable once it returns."""
    tmp = path.with_name(path.name + TMP)
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _named(root: Path, pointer: str, pattern: re.Pattern) -> str | None:
    """The checkpoint folder name the pointer names (an iteration number for Checkpoint 2.0), or None."""
    try:
        text = (root / pointer).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    if pointer.endswith(".txt"):
        text = f"iteration_{int(text):08d}" if text.isdigit() and len(text) <= 8 else ""
    return text if pattern.match(text) and "/" not in text else None


def recover(root: Path) -> list[str]:
    """Finish the save a kill cut short in checkpoint directory `root` (see the module doc); returns what it did,
    one line each. Call it on one rank, with no other process writing `root`."""
    done: list[str] = []
    if not root.is_dir() or root.is_symlink():
        return done
    for pointer, pattern, last in _FORMATS:
        name = _named(root, pointer, pattern)
        if name is None or os.path.lexists(root / name):
            continue
        tmp, old = root / f"{name}{TMP}", root / f"{name}{REPLACED}"
        for source in (tmp, old):  # the newer save first: the pointer already names it
            if not source.is_symlink() and (source / last).is_file():
                os.replace(source, root / name)
                fsync_dir(root)
                done.append(f"{root / name}: completed from {source.name}/ (a save was stopped before its rename)")
                break
    for old in root.glob(f"*{REPLACED}"):
        if (root / old.name[: -len(REPLACED)]).is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
    return done
