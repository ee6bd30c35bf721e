"""MindFormers 2.x Checkpoint 2.0 (`mindformers/checkpoint/{checkpoint,utils,metadata,reshard}.py`): read, merge
across ranks, write. No MindSpore: safetensors and JSON only; nothing is unpickled.

On disk (save_checkpoint, remove_redundancy False):
    <root>/latest_checkpointed_iteration.txt      the newest iteration, e.g. "7"
    <root>/iteration_%08d/
        [prefix-]model-%07d-%07d.safetensors      (rank, world): each rank's local slices of the network's
        [prefix-]opt-%07d-%07d.safetensors        parameters, and of the optimizer's (adam_m.*, adam_v.*,
                                                  global_step, learning_rate), under their full names
        common.json                               epoch_num, step_num, global_step, loss_scale, global_batch_size,
                                                  ckpt_status
        metadata.json                             (more than one rank) state_dict_metadata: per tensor its dtype,
                                                  global_shape, layout (MindSpore's Layout.to_dict: device_matrix,
                                                  tensor_map, alias_name, rank_list) and chunks {global_offset:
                                                  [slice id], local_shape}; storage_data: "('name', (slice id,))"
                                                  -> [{file_name, storage_rank, rank_group}]
A chunk's `global_offset` is a slice id (sharded_tensor.py `_get_global_offset_and_replica_id_from_layout`: the
row-major index of the rank's slice in the grid the layout cuts), not element offsets: where a rank's slice lies
comes from the layout (reshard.py `infer_slice_area_by_rank`), which is how MindFormers' ReshardLoader reads it.
One card writes no metadata.json: every tensor of every file is whole (metadata.py
`generate_default_metadata_from_checkpoint`).

Every slice is checked before anything is allocated: the layout is well formed, the global shape divides into it,
each slice id has one chunk of the slice's shape, each chunk's file lies in the directory and holds the tensor
with that shape and dtype. A checkpoint that fails is refused with one line naming the file (RunError).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from mf_ds.checkpoint import durable
from mf_ds.checkpoint.native import fault_point
from mf_ds.errors import RunError

TRACKER = "latest_checkpointed_iteration.txt"
COMMON = "common.json"
METADATA = "metadata.json"
_ITERATION = re.compile(r"^iteration_(\d{8})$")
_FILE = re.compile(r"^(?:.+-)?(model|opt)-(\d{7})-(\d{7})\.safetensors$")
# MindSpore dtype names (metadata "Float32") -> safetensors header dtypes
_DTYPES = {"Float32": "F32", "Float16": "F16", "BFloat16": "BF16", "Float64": "F64", "Int8": "I8", "UInt8": "U8",
           "Int16": "I16", "Int32": "I32", "Int64": "I64", "Bool": "BOOL"}
_TORCH = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64, "I8": torch.int8,
          "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool}


def read_json(file: Path, what: str = "JSON") -> object:
    """A checkpoint's JSON file, or one RunError naming it. json.loads recurses once per nesting level: a file
    nested 100k deep raised RecursionError, which is refused here like any other malformed file."""
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise RunError(f"{file}: not {what} ({type(exc).__name__}: {exc})") from None
    except RecursionError:
        raise RunError(f"{file}: not {what} (nested too deeply)") from None


def iteration_dir(path: Path) -> Path:
    """The iteration directory to read: `path` itself, or the one its tracker names."""
    tracker = path / TRACKER
    if not tracker.is_file():
        if any(_ITERATION.match(p.name) for p in path.iterdir() if p.is_dir()):
            raise RunError(f"{tracker}: missing; name one iteration_XXXXXXXX directory of {path} instead")
        return path
    try:
        iteration = int(tracker.read_text(encoding="utf-8").strip())
    except (OSError, UnicodeDecodeError, ValueError):
        raise RunError(f"{tracker}: not an iteration number") from None
    if iteration < 0:
        raise RunError(f"{tracker}: iteration {iteration} is negative")
    found = path / f"iteration_{iteration:08d}"
    if not found.is_dir():
        raise RunError(f"{tracker}: names iteration {iteration}, but {found.name}/ does not exist")
    if found.is_symlink() or found.resolve().parent != path.resolve():
        raise RunError(f"{found}: a link to {found.resolve()}, outside {path}; a checkpoint's iterations are its own "
                       "folders (a file linked out is refused the same way)")
    return found


def is_checkpoint2(path: str | os.PathLike) -> bool:
    """True for a Checkpoint 2.0 root or iteration directory (told by its files)."""
    path = Path(path)
    if not path.is_dir():
        return False
    if (path / TRACKER).is_file() or (path / METADATA).is_file() or (path / COMMON).is_file():
        return True
    return any(_FILE.match(p.name) for p in path.glob("*.safetensors")) or any(
        _ITERATION.match(p.name) and p.is_dir() for p in path.glob("iteration_*"))


@dataclass(frozen=True)
class Chunk:
    """One slice of a tensor: where it lies in the whole tensor and the file that holds it under the tensor's name."""

    area: tuple[tuple[int, int], ...]
    file: Path


@dataclass(frozen=True)
class Entry:
    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors' name: F32, BF16, ...
    chunks: tuple[Chunk, ...]


def _ints(value, what: str, where: Path, lowest: int = 0) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(type(v) is int and v >= lowest for v in value):
        raise RunError(f"{where}: {what} must be a list of integers >= {lowest}, got {str(value)[:80]}")
    return tuple(value)


def _grid(layout: dict | None, shape: tuple[int, ...], name: str, where: Path) -> tuple[dict[int, tuple], dict]:
    """({slice id: area}, {slice id: the ranks that hold it}) for a tensor of `shape` under `layout`, as
    reshard.py infer_slice_area_by_rank and sharded_tensor.py _rank_id_with_slice_id compute them."""
    whole = tuple((0, n) for n in shape)
    if layout is None:  # no layout: whole on every rank that stores it
        return {0: whole}, {0: None}
    if not isinstance(layout, dict):
        raise RunError(f"{where}: {name}: layout is not a mapping")
    if layout.get("interleaved_parallel"):
        raise RunError(f"{where}: {name}: interleaved_parallel layouts are not read by mf-ds")
    matrix = _ints(layout.get("device_matrix"), f"{name}: device_matrix", where, 1)
    ranks = _ints(layout.get("rank_list"), f"{name}: rank_list", where)
    tensor_map = layout.get("tensor_map")
    if len(ranks) != math.prod(matrix) or len(set(ranks)) != len(ranks):
        raise RunError(f"{where}: {name}: rank_list {list(ranks)[:8]} is not {math.prod(matrix)} distinct ranks "
                       f"(device_matrix {list(matrix)})")
    if not isinstance(tensor_map, list) or len(tensor_map) != len(shape):
        raise RunError(f"{where}: {name}: tensor_map {str(tensor_map)[:60]} does not give each of the "
                       f"{len(shape)} dimensions of global_shape {list(shape)} a device axis")
    axes = [m if isinstance(m, list) else [m] for m in tensor_map]
    used = [a for m in axes for a in m if a != -1]
    if not all(type(a) is int and -1 <= a < len(matrix) for m in axes for a in m) or len(used) != len(set(used)):
        raise RunError(f"{where}: {name}: tensor_map {tensor_map} names device axes outside device_matrix "
                       f"{list(matrix)} or one twice")
    splits = [math.prod(matrix[-a - 1] for a in m if a != -1) for m in axes]
    if any(n % s for n, s in zip(shape, splits, strict=True)):
        raise RunError(f"{where}: {name}: global_shape {list(shape)} does not divide into {splits} slices")
    areas, holders = {}, {}
    for inner, rank in enumerate(ranks):
        coords, rest = [0] * len(matrix), inner
        for d in range(len(matrix) - 1, -1, -1):
            coords[d], rest = rest % matrix[d], rest // matrix[d]
        index = []
        for m in axes:  # along one dimension the last device axis varies fastest (infer_slice_area_by_rank)
            i = 0
            for a in m:
                if a != -1:
                    i = i * matrix[-a - 1] + coords[-a - 1]
            index.append(i)
        slice_id = 0
        for i, s in zip(index, splits, strict=True):  # row-major over the grid of slices
            slice_id = slice_id * s + i
        size = [n // s for n, s in zip(shape, splits, strict=True)]
        areas[slice_id] = tuple((i * z, (i + 1) * z) for i, z in zip(index, size, strict=True))
        holders.setdefault(slice_id, []).append(rank)
    return areas, holders


def _file_in(directory: Path, file_name, where: Path) -> Path:
    if not isinstance(file_name, str) or not file_name.endswith(".safetensors") or "/" in file_name \
            or "\\" in file_name or file_name.startswith("."):
        raise RunError(f"{where}: file_name {str(file_name)[:80]!r} is not a .safetensors file of {directory}")
    file = directory / file_name
    if file.resolve().parent != directory.resolve():
        raise RunError(f"{where}: {file_name} lies outside {directory} (a link?)")
    if not file.is_file():
        raise RunError(f"{file}: missing (named by {where.name})")
    return file


class Checkpoint2:
    """An iteration of a Checkpoint 2.0 directory, checked; `tensor(name)` assembles one tensor whole."""

    def __init__(self, path: str | os.PathLike) -> None:
        root = Path(path)
        if not root.is_dir():
            raise RunError(f"{root}: not a directory")
        self.directory = iteration_dir(root)
        self.common = self._common()
        self._headers: dict[Path, dict] = {}
        meta = self.directory / METADATA
        self.entries = self._from_metadata(meta) if meta.is_file() else self._from_files()
        if not self.entries:
            raise RunError(f"{self.directory}: holds no tensors")
        for entry in self.entries.values():
            for chunk in entry.chunks:
                self._check_chunk(entry, chunk)

    def _common(self) -> dict:
        file = self.directory / COMMON
        if not file.is_file():
            return {}
        data = read_json(file)
        if not isinstance(data, dict):
            raise RunError(f"{file}: not a mapping")
        return data

    def _header(self, file: Path) -> dict:
        if file not in self._headers:
            try:
                with safe_open(str(file), framework="pt") as f:
                    self._headers[file] = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype())
                                           for k in f.keys()}
            except (OSError, SafetensorError) as exc:
                raise RunError(f"{file}: not a readable safetensors file ({exc}); truncated or damaged?") from None
        return self._headers[file]

    def _files(self) -> list[Path]:
        files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            raise RunError(f"{self.directory}: holds no .safetensors files (a Checkpoint 2.0 iteration directory?)")
        return files

    def _from_files(self) -> dict[str, Entry]:
        """One card: every tensor of every file whole (no metadata.json)."""
        entries: dict[str, Entry] = {}
        for file in self._files():
            _file_in(self.directory, file.name, self.directory)
            for name, (shape, dtype) in self._header(file).items():
                if name in entries:
                    raise RunError(f"{file}: {name} is also in {entries[name].chunks[0].file.name}, and there is no "
                                   f"{METADATA} to say how they fit")
                entries[name] = Entry(name, shape, dtype, (Chunk(tuple((0, n) for n in shape), file),))
        return entries

    def _from_metadata(self, meta: Path) -> dict[str, Entry]:
        data = read_json(meta, "Checkpoint 2.0 metadata")
        try:
            tensors, storage = data["state_dict_metadata"], data["storage_data"]
            if not isinstance(tensors, dict) or not isinstance(storage, dict):
                raise TypeError("state_dict_metadata and storage_data must be mappings")
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
            raise RunError(f"{meta}: not Checkpoint 2.0 metadata ({type(exc).__name__}: {exc})") from None
        entries = {}
        for name, info in tensors.items():
            if not isinstance(info, dict) or not isinstance(info.get("properties"), dict):
                raise RunError(f"{meta}: {name}: not a tensor record")
            shape = _ints(info.get("global_shape"), f"{name}: global_shape", meta)
            kind = info["properties"].get("dtype")
            if kind not in _DTYPES:
                raise RunError(f"{meta}: {name}: dtype {str(kind)[:40]!r} is not one mf-ds reads")
            areas, holders = _grid(info.get("layout"), shape, name, meta)
            chunks, seen = [], set()
            for chunk in info.get("chunk") if isinstance(info.get("chunk"), list) else [None]:
                if not isinstance(chunk, dict):
                    raise RunError(f"{meta}: {name}: chunk must be a list of {{global_offset, local_shape}}")
                offset = _ints(chunk.get("global_offset"), f"{name}: global_offset", meta)
                local = _ints(chunk.get("local_shape"), f"{name}: local_shape", meta)
                slice_id = offset[0] if len(offset) == 1 else None
                if slice_id not in areas:
                    raise RunError(f"{meta}: {name}: chunk global_offset {list(offset)} is out of range (its layout "
                                   f"cuts {len(areas)} slices)")
                if slice_id in seen:
                    raise RunError(f"{meta}: {name}: two chunks at global_offset {list(offset)} (overlapping)")
                seen.add(slice_id)
                area = areas[slice_id]
                if local != tuple(b - a for a, b in area):
                    raise RunError(f"{meta}: {name}: chunk {list(offset)} has local_shape {list(local)}; global_shape "
                                   f"{list(shape)} under its layout gives {[b - a for a, b in area]}")
                stored = storage.get(str((name, offset)))
                if not isinstance(stored, list) or not stored or not all(isinstance(s, dict) for s in stored):
                    raise RunError(f"{meta}: {name}: no storage_data for chunk {list(offset)}")
                for where in stored:
                    _file_in(self.directory, where.get("file_name"), meta)
                    if holders[slice_id] is not None and where.get("storage_rank") not in holders[slice_id]:
                        raise RunError(f"{meta}: {name}: chunk {list(offset)} is said to be stored by rank "
                                       f"{where.get('storage_rank')!r}, which holds another slice")
                chunks.append(Chunk(area, _file_in(self.directory, stored[0]["file_name"], meta)))
            missing = sorted(set(areas) - seen)
            if missing:
                raise RunError(f"{meta}: {name}: no chunk at global_offset [{missing[0]}] ({len(missing)} of "
                               f"{len(areas)} slices missing)")
            entries[name] = Entry(name, shape, _DTYPES[kind], tuple(chunks))
        return entries

    def _check_chunk(self, entry: Entry, chunk: Chunk) -> None:
        held = self._header(chunk.file).get(entry.name)
        want = tuple(b - a for a, b in chunk.area)
        if held is None:
            raise RunError(f"{chunk.file}: lacks {entry.name}, which {METADATA} places there")
        if held != (want, entry.dtype):
            raise RunError(f"{chunk.file}: {entry.name} is {held[1]}{list(held[0])}; the checkpoint's metadata says "
                           f"{entry.dtype}{list(want)}")

    def names(self) -> list[str]:
        return list(self.entries)

    def files(self) -> list[Path]:
        return sorted({c.file for e in self.entries.values() for c in e.chunks})

    @property
    def iteration(self) -> int | None:
        m = _ITERATION.match(self.directory.name)
        return int(m.group(1)) if m else None

    def tensor(self, name: str) -> torch.Tensor:
        entry = self.entries[name]
        if len(entry.chunks) == 1 and all(a == 0 and b == n for (a, b), n in zip(entry.chunks[0].area, entry.shape,
                                                                                   strict=True)):
            with safe_open(str(entry.chunks[0].file), framework="pt") as f:
                return f.get_tensor(name)
        out = torch.empty(entry.shape, dtype=_TORCH[entry.dtype])
        for chunk in entry.chunks:  # the slices tile the tensor (_grid): every element is written once
            with safe_open(str(chunk.file), framework="pt") as f:
                out[tuple(slice(a, b) for a, b in chunk.area)] = f.get_tensor(name)
        return out


def mindformers_weights(path: str | os.PathLike) -> Iterator[tuple[str, str, object]]:
    """(name, file, loader) for every tensor of a Checkpoint 2.0 directory (mf_ds/ckpt.py mindformers_weights);
    the file named is the first that holds a slice of it."""
    ckpt = Checkpoint2(path)
    for name in ckpt.names():
        yield name, str(ckpt.entries[name].chunks[0].file), (lambda n=name: ckpt.tensor(n))


def write(root: str | os.PathLike, tensors: Iterator[tuple[str, torch.Tensor]], iteration: int = 0,
          common: dict | None = None, optimizer: Iterator[tuple[str, torch.Tensor]] | None = None) -> int:
    """A one-card Checkpoint 2.0 as MindFormers' save_checkpoint writes it (model-0000000-0000001.safetensors with
    {"format": "ms"}, opt-... when optimizer state is given, common.json, no metadata.json, then the tracker);
    MindFormers' load_checkpoint reshards it onto any layout. Returns the number of model tensors.

    Written as durable.py says: whole into iteration_N.tmp/ and fsynced, the tracker then names it, then the
    rename (an earlier iteration_N set aside until the new one is in place). A root whose tracker names a later
    iteration holds a run's checkpoints: writing there would move its tracker back, and is refused."""
    root = Path(root)
    newer = _tracked(root)
    if newer is not None and newer > iteration:
        raise RunError(f"{root}: holds a run's checkpoints ({TRACKER} names iteration {newer}); writing iteration "
                       f"{iteration} there would move its tracker back: write into another directory")
    final = root / f"iteration_{iteration:08d}"
    tmp = final.with_name(final.name + durable.TMP)
    model = {name: t.contiguous() for name, t in tensors}  # every tensor built (and checked) before a file is made
    if tmp.exists():
        shutil.rmtree(tmp)  # left by an interrupted save
    tmp.mkdir(parents=True)
    save_file(model, str(tmp / "model-0000000-0000001.safetensors"), metadata={"format": "ms"})
    fault_point("save2.model", iteration)
    if optimizer is not None:
        save_file({name: t.contiguous() for name, t in optimizer}, str(tmp / "opt-0000000-0000001.safetensors"),
                  metadata={"format": "ms"})
        fault_point("save2.optimizer", iteration)
    info = {"epoch_num": 0, "step_num": iteration, "global_step": iteration, "loss_scale": 1.0,
            "global_batch_size": None, "ckpt_status": 0, **(common or {})}
    durable.atomic_write(tmp / COMMON, json.dumps(info, indent=4))  # last into tmp/: it marks it whole
    durable.fsync_tree(tmp)
    fault_point("save2.common", iteration)
    durable.atomic_write(root / TRACKER, str(iteration))  # names it before the rename: durable.recover completes it
    fault_point("save2.tracker", iteration)
    old = final.with_name(final.name + durable.REPLACED)
    if final.exists():  # the same iteration saved again: the old one stays until the new one is in place
        shutil.rmtree(old, ignore_errors=True)  # (a stale copy: `final` is whole)
        os.replace(final, old)
        fault_point("save2.aside", iteration)
    os.replace(tmp, final)
    durable.fsync_dir(root)
    fault_point("save2.rename", iteration)
    shutil.rmtree(old, ignore_errors=True)
    return len(model)


def _tracked(root: Path) -> int | None:
    """The iteration `root`'s tracker names, if it names one."""
    try:
        text = (root / TRACKER).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() and len(text) <= 8 else None
