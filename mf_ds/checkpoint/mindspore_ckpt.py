"""MindSpore / MindFormers weights in: `.ckpt` files (protobuf, read by hand, streaming) and MindFormers-named
safetensors, turned into HF parameter names (translators/names.py) and loaded into an HF model.

`.ckpt` layout (mindspore/train/serialization.py `_exec_save` / `_write_parameter_data`, checkpoint.proto in
mindspore/train/checkpoint_pb2.py): the file is serialized `Checkpoint` messages back to back, one per
parameter, which protobuf reads as one message:
    Checkpoint  { repeated Value value = 1; }
    Value       { required string tag = 1; oneof { TensorProto tensor = 2; MapTensorProto maptensor = 3; } }
    TensorProto { repeated int64 dims = 1; required string tensor_type = 2; required bytes tensor_content = 3; }
A parameter larger than 512 MB is split along its first axis into several Values with the same tag and the full
dims (np.array_split). `crc_check=True` appends b"crc_num" + the crc32 of everything before it, 10 bytes
big-endian. tensor_type is MindSpore's name: Float32, Float16, BFloat16, Int32, ...

The file is memory-mapped and parsed in place: one pass records where each tensor's bytes lie, and a tensor is
copied out only when it is asked for, so a checkpoint larger than RAM loads one tensor at a time.
"""

from __future__ import annotations

import binascii
import json
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from mf_ds.checkpoint import sharded
from mf_ds.errors import RunError
from mf_ds.lora import is_adapter
from mf_ds.weights import DEFAULT_LAYOUT, WeightLayout, attach_router_bias, model_slot, to_hf
from mf_ds.zero import Writer
from translators import names

DTYPES = {"Float32": torch.float32, "Float16": torch.float16, "BFloat16": torch.bfloat16, "Float64": torch.float64,
          "Int8": torch.int8, "UInt8": torch.uint8, "Int16": torch.int16, "Int32": torch.int32, "Int64": torch.int64,
          "Bool": torch.bool}
# The numpy dtype each is read as; numpy has no bfloat16: its bits are read as uint16 and viewed by torch.
_NUMPY = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: np.uint16, torch.float64: np.float64,
          torch.int8: np.int8, torch.uint8: np.uint8, torch.int16: np.int16, torch.int32: np.int32,
          torch.int64: np.int64, torch.bool: np.bool_}
_CRC = b"crc_num"


@dataclass(frozen=True)
class Entry:
    """Where one parameter's bytes lie in the file."""

    name: str
    dtype: str  # MindSpore's tensor_type
    dims: tuple[int, ...]
    pieces: tuple[tuple[int, int], ...]  # (offset, length) of each slice, in order


class MindSporeCheckpoint:
    """A `.ckpt` file, parsed once; `tensor(name)` copies one parameter out as a torch tensor."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = str(path)
        if not os.path.isfile(self.path):
            raise RunError(f"{self.path}: missing")
        size = os.path.getsize(self.path)
        self.data = np.memmap(self.path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
        end = size
        if size >= len(_CRC) + 10 and self.data[size - 17:size - 10].tobytes() == _CRC:
            end = size - 17
            stored = int.from_bytes(self.data[size - 10:].tobytes(), "big")
            actual = 0
            for start in range(0, end, 1 << 26):
                actual = binascii.crc32(self.data[start:min(end, start + (1 << 26))], actual)
            if stored != actual:
                raise RunError(f"{self.path}: crc32 {actual} does not match the {stored} saved with it (damaged)")
        try:
            self.entries = self._parse(end)
        except (ValueError, IndexError, UnicodeDecodeError) as exc:
            raise RunError(f"{self.path}: not a MindSpore checkpoint, or truncated ({exc})") from None
        if not self.entries:
            raise RunError(f"{self.path}: holds no parameters")

    def _varint(self, at: int, end: int) -> tuple[int, int]:
        result = shift = 0
        while True:
            if at >= end:
                raise ValueError(f"varint runs past byte {end}")
            byte = int(self.data[at])
            at += 1
            result |= (byte & 0x7F) << shift
            if byte < 0x80:
                return result, at
            shift += 7
            if shift > 63:
                raise ValueError(f"varint too long at byte {at}")

    def _fields(self, at: int, end: int) -> Iterator[tuple[int, int, int, int]]:
        """(field number, wire type, value or offset, length) of each field in [at, end)."""
        while at < end:
            key, at = self._varint(at, end)
            field, wire = key >> 3, key & 7
            if wire == 0:
                value, at = self._varint(at, end)
                yield field, wire, value, 0
            elif wire == 2:
                length, at = self._varint(at, end)
                if at + length > end:
                    raise ValueError(f"field {field} at byte {at} runs {at + length - end} bytes past its message")
                yield field, wire, at, length
                at += length
            elif wire in (1, 5):
                at += 8 if wire == 1 else 4
                if at > end:
                    raise ValueError("fixed-width field runs past its message")
            else:
                raise ValueError(f"unexpected wire type {wire} at byte {at}")

    def _text(self, at: int, length: int) -> str:
        return self.data[at:at + length].tobytes().decode("utf-8")

    def _parse(self, end: int) -> dict[str, Entry]:
        entries: dict[str, Entry] = {}
        for field, wire, at, length in self._fields(0, end):
            if field != 1 or wire != 2:
                raise ValueError(f"field {field} (wire {wire}) where Checkpoint has only `value = 1`")
            tag, tensor = None, None
            for f, w, a, n in self._fields(at, at + length):
                if f == 1 and w == 2:
                    tag = self._text(a, n)
                elif f == 2 and w == 2:
                    tensor = (a, n)
                # f == 3: a MapTensor (embedding hash tables), not an HF weight; skipped
            if tag is None:
                raise ValueError(f"a value without a tag at byte {at}")
            if not tag.isprintable():  # no parameter name has control characters; they would split our messages
                raise ValueError(f"parameter name {tag[:100]!r} at byte {at} holds control characters")
            if tensor is None:
                continue
            dims, dtype, content = [], None, None
            for f, w, a, n in self._fields(tensor[0], tensor[0] + tensor[1]):
                if f == 1 and w == 0:
                    dims.append(a)
                elif f == 1 and w == 2:  # packed dims
                    p = a
                    while p < a + n:
                        d, p = self._varint(p, a + n)
                        dims.append(d)
                elif f == 2 and w == 2:
                    dtype = self._text(a, n)
                elif f == 3 and w == 2:
                    content = (a, n)
            if dtype is None or content is None:
                raise ValueError(f"tensor {tag!r} lacks its tensor_type or tensor_content")
            old = entries.get(tag)
            if old is not None:  # a slice of a parameter larger than 512 MB
                entries[tag] = Entry(tag, dtype, old.dims, old.pieces + (content,))
            else:
                entries[tag] = Entry(tag, dtype, tuple(dims), (content,))
        return entries

    def names(self) -> list[str]:
        return list(self.entries)

    def tensor(self, name: str) -> torch.Tensor:
        entry = self.entries[name]
        if entry.dtype == "str":
            raise RunError(f"{self.path}: {name} is a string, not a tensor")
        if entry.dtype not in DTYPES:
            raise RunError(f"{self.path}: {name} has tensor_type {entry.dtype!r}, which mf-ds cannot read")
        dtype = DTYPES[entry.dtype]
        itemsize = torch.empty((), dtype=dtype).element_size()
        # Python ints: np.prod wraps at 2^63 (dims whose product wrapped to the stored size passed this check).
        if len(entry.dims) > 32 or any(d >= 2**62 for d in entry.dims):
            raise RunError(f"{self.path}: {name} has shape {list(entry.dims)[:40]}, which no tensor has (damaged)")
        count = math.prod(entry.dims)
        total = sum(n for _, n in entry.pieces)
        if total != count * itemsize:
            raise RunError(f"{self.path}: {name} holds {total} bytes; {entry.dtype}{list(entry.dims)} needs "
                           f"{count * itemsize} (damaged)")
        raw = np.concatenate([self.data[a:a + n] for a, n in entry.pieces]) if len(entry.pieces) > 1 else \
            np.array(self.data[entry.pieces[0][0]:entry.pieces[0][0] + entry.pieces[0][1]])
        return torch.from_numpy(raw.view(_NUMPY[dtype])).view(dtype).reshape(entry.dims)


def mindformers_weights(path: str | os.PathLike) -> Iterator[tuple[str, str, object]]:
    """(MindFormers name, file, loader) for every tensor of a MindFormers checkpoint: a .ckpt file, a directory
    holding rank_0/*.ckpt (a single-rank run) or *.ckpt, a MindFormers-named .safetensors file, or a directory of
    them (unified / merged safetensors, with or without their param_name_map.json index), or a MindFormers 2.x
    Checkpoint 2.0 directory (mf_ds/checkpoint/sharded.py: its ranks' slices merged)."""
    path = Path(path)
    if sharded.is_checkpoint2(path):
        yield from sharded.mindformers_weights(path)
        return
    files = _checkpoint_files(path)
    for file in files:
        if file.suffix == ".ckpt":
            ckpt = MindSporeCheckpoint(file)
            for name in ckpt.names():
                yield name, str(file), (lambda c=ckpt, n=name: c.tensor(n))
        else:
            try:
                handle = safe_open(str(file), framework="pt")
                keys = list(handle.keys())
            except (OSError, SafetensorError) as exc:
                raise RunError(f"{file}: not a readable safetensors file ({exc}); truncated or damaged?") from None
            for name in keys:
                yield name, str(file), (lambda h=handle, n=name: h.get_tensor(n))


SHARDED = ("merge it into one checkpoint first: MindFormers' toolkit/safetensors/unified_safetensors.py "
           "--mindspore_ckpt_dir DIR --src_strategy_dirs STRATEGY_DIR --output_dir OUT (a unified safetensors "
           "directory with param_name_map.json, which load_checkpoint takes), or mindformers/tools/ckpt_transform/"
           "transform_checkpoint.py --src_checkpoint DIR --src_strategy STRATEGY --dst_checkpoint_dir OUT without "
           "--dst_strategy (a complete .ckpt)")
INDEX = "param_name_map.json"  # mindspore.parallel.unified_safetensors' index (and MindFormers' converted HF dirs')


def _checkpoint_files(path: Path) -> list[Path]:
    if path.is_file():
        if path.suffix not in (".ckpt", ".safetensors"):
            raise RunError(f"{path}: load_checkpoint must be a .ckpt or .safetensors file, or a directory")
        return [path]
    if not path.is_dir():
        raise RunError(f"{path}: load_checkpoint does not exist")
    if sharded.is_checkpoint2(path):
        return sharded.Checkpoint2(path).files()
    rank0 = path / "rank_0"
    if rank0.is_dir():
        ckpts = sorted(rank0.glob("*.ckpt")) or sorted(rank0.glob("*.safetensors"))
        others = sorted(p.name for p in path.glob("rank_*") if p.name != "rank_0")
        if others:
            raise RunError(f"{path}: a checkpoint sharded over {len(others) + 1} ranks (rank_0..{others[-1]}); "
                           + SHARDED)
        if len(ckpts) != 1:
            raise RunError(f"{rank0}: expected one .ckpt or .safetensors file, found {len(ckpts)}"
                           + (f" ({', '.join(p.name for p in ckpts)}): name the file" if ckpts else ""))
        return ckpts
    if (path / INDEX).is_file():
        return _indexed_files(path / INDEX)
    ckpts, tensors = sorted(path.glob("*.ckpt")), sorted(path.glob("*.safetensors"))
    if len(ckpts) > 1:
        raise RunError(f"{path}: holds {len(ckpts)} .ckpt files; name the one to load")
    if ckpts and tensors:
        raise RunError(f"{path}: holds both .ckpt and .safetensors files; name the one to load")
    if not ckpts and not tensors:
        raise RunError(f"{path}: holds no .ckpt or .safetensors weights")
    return ckpts or tensors


def _indexed_files(index: Path) -> list[Path]:
    """The files of a unified / merged safetensors directory, checked against its index: every file it names
    exists and holds the tensors it places there. The index is {"weight_map": {name: file}} (unified_safetensors)
    or {name: file} (MindFormers' _convert_index_json)."""
    try:
        data = json.loads(index.read_text())
        weight_map = data["weight_map"] if "weight_map" in data else data
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError("not a {tensor name: file} map")
    except (OSError, ValueError, TypeError) as exc:
        raise RunError(f"{index}: not a safetensors index ({type(exc).__name__}: {exc})") from None
    files = sorted(set(weight_map.values()))
    for name in files:
        file = index.parent / name
        if not file.is_file():
            raise RunError(f"{file}: missing (named by {index.name})")
        try:
            with safe_open(str(file), framework="pt") as f:
                held = set(f.keys())
        except (OSError, SafetensorError) as exc:
            raise RunError(f"{file}: not a readable safetensors file ({exc}); truncated or damaged?") from None
        lacking = sorted(t for t, owner in weight_map.items() if owner == name and t not in held)
        if lacking:
            raise RunError(f"{file}: lacks {lacking[0]}" + (f" and {len(lacking) - 1} more tensors" if len(lacking) > 1
                                                             else "") + f", which {index.name} places there")
    return [index.parent / name for name in files]


def load_into(model: torch.nn.Module, path: str | os.PathLike, family: str,
              write: Callable[[str, torch.Tensor], None] | None = None, layout: WeightLayout = DEFAULT_LAYOUT,
              progress: Callable[[int], None] | None = None, adapters: bool = False) -> dict[str, int]:
    """Copy a MindFormers checkpoint into `model` one tensor at a time; returns counts for the report.

    `family` is a key of translators/names.py (names.table_key). Every model parameter must come from the checkpoint
    (tied embeddings aside), every model weight in the checkpoint must find its place, of the same shape; optimizer
    state and counters are skipped. With `write`, each checked tensor goes to write(hf_name, tensor) under its HF
    checkpoint name instead (the layout save_pretrained writes), and `model` may live on the meta device.
    `progress(nbytes)` is called after each MindFormers tensor. LoRA adapters (`...mindpet_delta_lora_a`, mf_ds/lora.py)
    are skipped with `adapters` (the run loads them into its PEFT model) and refused without.
    """
    try:
        names.name_map(family)
    except KeyError as exc:
        raise RunError(f"{path}: {exc.args[0]}") from None
    state = model.state_dict()
    writer = None
    if write is None and any(hasattr(p, "ds_id") for p in model.parameters()):
        # ZeRO-3 shards (mf_ds/zero.py): check against the whole shapes, assemble and write one parameter at a time
        writer = Writer(model)
        state = writer.shapes
        write = writer
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    filled: dict[str, int] = {}  # parameter -> elements written
    partial: dict[str, tuple[torch.Tensor, int]] = {}  # HF tensor assembled from parts (write mode): buffer, filled
    loaded, skipped, mtp = 0, 0, 0
    mtp_built = getattr(model.config, "mtp_variant", None) is not None
    for mf_name, file, load in mindformers_weights(path):
        if not names.is_weight(mf_name, family):  # optimizer state, counters: not read
            skipped += 1
            continue
        if is_adapter(mf_name):
            if not adapters:
                raise RunError(f"{file}: {mf_name} is a LoRA adapter; set model.model_config.pet_config (or "
                               "lora_config) to train with it, or convert the checkpoint with its adapters merged")
            skipped += 1
            continue
        if names.mtp_layer(mf_name, family, model.config.num_hidden_layers) and not mtp_built:
            mtp += 1  # no MTP layers built for this YAML (mf_ds/mtp.py builds the research variant's)
            continue
        tensor = load()
        for piece in to_hf(mf_name, tensor, family, model.config, layout):
            slot = model_slot(piece.name, state)
            if slot is None and (bias := attach_router_bias(model, piece.name, piece.tensor)) is not None:
                state[bias] = model.get_buffer(bias)  # a router bias the HF class lacks: now a buffer of the model
                if writer is not None:
                    writer.tensors[bias] = state[bias]
                slot = (bias, ())
            if slot is None:
                if piece.name in tied:
                    continue
                raise RunError(f"{file}: {mf_name} ({piece.name}) is not a weight of this {family} model; is it a "
                               "checkpoint of another model?")
            param, index = slot
            whole = state[param][index] if index else state[param]
            region = whole.reshape(piece.view)[piece.index] if piece.view else whole
            if tuple(piece.tensor.shape) != tuple(region.shape) or (piece.view and math.prod(piece.view)
                                                                    != whole.numel()):
                raise RunError(f"{file}: {mf_name} gives {piece.name} the shape {list(piece.tensor.shape)}, the "
                               f"model {list(region.shape)}; does model_config match the checkpoint?")
            if piece.tensor.is_floating_point() != whole.is_floating_point():
                raise RunError(f"{file}: weight {mf_name} is {str(piece.tensor.dtype).removeprefix('torch.')}, the "
                               f"model's {piece.name} {str(whole.dtype).removeprefix('torch.')} (a damaged file?)")
            if piece.tensor.is_floating_point() and not torch.isfinite(piece.tensor).all():
                raise RunError(f"{file}: weight {mf_name} holds inf/NaN (a damaged file?)")
            if write is not None and piece.view:
                buffer, done = partial.get(piece.name) or (torch.empty(whole.shape, dtype=piece.tensor.dtype), 0)
                buffer.view(piece.view)[piece.index] = piece.tensor
                done += piece.tensor.numel()
                partial[piece.name] = (buffer, done)
                if done == buffer.numel():
                    write(piece.name, partial.pop(piece.name)[0])
            elif write is not None:
                if write(piece.name, piece.tensor) is False:
                    raise RunError(f"{file}: {mf_name} ({piece.name}) has no place in this model")
            else:
                with torch.no_grad():
                    (whole.view(piece.view)[piece.index] if piece.view else whole).copy_(piece.tensor)
            filled[param] = filled.get(param, 0) + piece.tensor.numel()
            loaded += 1
        if progress is not None:
            progress(tensor.numel() * tensor.element_size())
        del tensor
    missing = sorted(p for p in set(state) - tied if filled.get(p, 0) < state[p].numel()
                     and not p.endswith("rotary_emb.inv_freq"))
    if missing:
        raise RunError(f"{path}: {len(missing)} weights of the model are not (or not wholly) in the checkpoint "
                       f"(first: {missing[0]}, MindFormers name {names.hf_to_mf(missing[0], family)}); is it a "
                       "checkpoint of another model?")
    return {"loaded": loaded, "skipped": skipped} | ({"mtp_skipped": mtp} if mtp else {})


def write_ckpt(path: str | os.PathLike, tensors: Iterator[tuple[str, torch.Tensor]]) -> int:
    """Write a MindSpore .ckpt as mindspore.save_checkpoint does (one Checkpoint message per parameter, fields in
    number order, dims unpacked as proto2 writes them, parameters over 512 MB split: along axis 0, BFloat16 in
    512 MB byte chunks); atomically,
    one tensor in memory at a time. Returns the number of parameters."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        count = _write_ckpt(path, tmp, tensors)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a refused tensor, a full disk, Ctrl-C: no half-written file left behind
        raise
    os.replace(tmp, path)
    return count


def _write_ckpt(path: Path, tmp: Path, tensors: Iterator[tuple[str, torch.Tensor]]) -> int:
    count = 0
    with open(tmp, "wb") as f:
        for name, tensor in tensors:
            kind = next((k for k, v in DTYPES.items() if v == tensor.dtype), None)
            if kind is None:
                raise RunError(f"{path}: {name} has dtype {tensor.dtype}, which a MindSpore checkpoint cannot hold")
            array = tensor.detach().contiguous().cpu()
            array = (array.view(torch.uint16) if tensor.dtype == torch.bfloat16 else array).numpy()
            if tensor.dtype == torch.bfloat16:  # a Tensor, not numpy: _write_parameter_bytes_data's byte chunks
                raw = memoryview(np.ascontiguousarray(array).reshape(-1)).cast("B")
                slices = [raw[i:i + _SLICE] for i in range(0, max(len(raw), 1), _SLICE)]
            else:  # _write_parameter_data: np.array_split along axis 0
                parts = np.array_split(array, -(-array.nbytes // _SLICE)) if array.nbytes > _SLICE else [array]
                slices = [memoryview(np.ascontiguousarray(p).reshape(-1)).cast("B") for p in parts]
            for content in slices:
                tensor_head = b"".join(_key(1, 0) + _varint(d) for d in array.shape) + _bytes_field(2, kind.encode())
                tensor_len = len(tensor_head) + len(_key(3, 2)) + len(_varint(len(content))) + len(content)
                value_head = _bytes_field(1, name.encode()) + _key(2, 2) + _varint(tensor_len)
                value_len = len(value_head) + tensor_len
                f.write(_key(1, 2) + _varint(value_len) + value_head + tensor_head + _key(3, 2)
                        + _varint(len(content)))
                f.write(content)
            count += 1
        f.flush()
        os.fsync(f.fileno())
    return count


_SLICE = 512 * 1024 * 1024  # serialization.py SLICE_SIZE (512 * 1024 KB)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _key(field: int, wire: int) -> bytes:
    return _varint(field << 3 | wire)


def _bytes_field(field: int, payload: bytes) -> bytes:
    return _key(field, 2) + _varint(len(payload)) + payload
