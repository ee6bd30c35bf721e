"""Which Plan entries the runtime reads: the typed Plan handed to mf_ds's Trainer through a recording proxy.

    python -m tests.mf_ds.plan_reads OUT_JSON RUN_DIR YAML[::--set key=value...] ...

trains each YAML one or two steps in this process (one rank) and writes the sorted set of Plan paths that were read
(`run.data.shuffle`, `layers[*].full_recompute`, ...) to OUT_JSON. A path counts as read when the runtime looked
it up (`plan.run.data.shuffle`, or a key of one of the Plan's mappings, `plan.deepspeed["zero_optimization"]`);
a property of the Plan (`plan.estimate_capacity_factor`) reads the fields it reads; iterating or copying a mapping
(`dict(cfg)`, `copy.deepcopy`) reads everything below it. Used by tests/mf_ds/test_ledger_truth.py.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import sys
import types
from typing import Any


def _index(path: str, i: int) -> str:
    return f"{path}[*]"


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


class Recorded(dict):
    """A dict that records the dotted paths of the keys read from it (children are wrapped too)."""

    def __init__(self, data: dict, path: str, reads: set[str]):
        super().__init__({k: wrap(v, _join(path, k), reads) for k, v in data.items()})
        self._path, self._reads = path, reads

    def _all(self) -> None:
        self._reads.add(_join(self._path, "**") if self._path else "**")

    def __getitem__(self, key):
        self._reads.add(_join(self._path, key))
        return super().__getitem__(key)

    def get(self, key, default=None):
        if key in self:
            return self[key]
        return default

    def __iter__(self):
        self._all()
        return super().__iter__()

    def keys(self):
        self._all()
        return super().keys()

    def items(self):
        self._all()
        return super().items()

    def values(self):
        self._all()
        return super().values()

    def __deepcopy__(self, memo):
        self._all()
        return copy.deepcopy(unwrap(self), memo)

    def copy(self):
        self._all()
        return unwrap(self)


class RecordedObject:
    """A frozen dataclass of the Plan whose field reads are recorded (fields below it are wrapped too); its
    properties and methods run on the proxy, so what they read is recorded as well."""

    def __init__(self, obj: Any, path: str, reads: set[str]):
        object.__setattr__(self, "_obj", obj)
        object.__setattr__(self, "_path", path)
        object.__setattr__(self, "_reads", reads)
        object.__setattr__(self, "_fields", {f.name for f in dataclasses.fields(obj)})

    def __getattr__(self, name: str):
        obj = self._obj
        if name in self._fields:
            path = _join(self._path, name)
            self._reads.add(path)
            return wrap(getattr(obj, name), path, self._reads)
        attr = getattr(type(obj), name, None)
        if isinstance(attr, property):
            return attr.fget(self)
        if isinstance(attr, types.FunctionType):
            return types.MethodType(attr, self)
        return getattr(obj, name)

    def __setattr__(self, name: str, value: Any):
        raise dataclasses.FrozenInstanceError(name)


class _RecordedSequence:
    """Indexing or iterating a sequence of the Plan reads the sequence (its items are wrapped on their own)."""

    _path: str
    _reads: set[str]

    def __getitem__(self, i):
        self._reads.add(self._path)
        return super().__getitem__(i)

    def __iter__(self):
        self._reads.add(self._path)
        return super().__iter__()


class RecordedTuple(_RecordedSequence, tuple):
    def __new__(cls, data: tuple, path: str, reads: set[str]):
        self = super().__new__(cls, (wrap(v, _index(path, i), reads) for i, v in enumerate(data)))
        self._path, self._reads = path, reads
        return self

    def __len__(self):
        self._reads.add(self._path)
        return super().__len__()


class RecordedList(_RecordedSequence, list):
    def __init__(self, data: list, path: str, reads: set[str]):
        super().__init__(wrap(v, _index(path, i), reads) for i, v in enumerate(data))
        self._path, self._reads = path, reads

    def __deepcopy__(self, memo):
        self._reads.add(_join(self._path, "**"))
        return copy.deepcopy(unwrap(self), memo)


def wrap(value: Any, path: str, reads: set[str]) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return RecordedObject(value, path, reads)
    if isinstance(value, tuple) and any(dataclasses.is_dataclass(v) for v in value):
        return RecordedTuple(value, path, reads)
    if isinstance(value, dict):
        return Recorded(value, path, reads)
    if isinstance(value, list):
        return RecordedList(value, path, reads)
    return value


def unwrap(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: unwrap(v) for k, v in dict.items(value)}
    if isinstance(value, list):
        return [unwrap(v) for v in list.__iter__(value)]
    return value


def main(argv: list[str]) -> None:
    import deepspeed

    from mf_ds.loop import Trainer
    from mf_ds.train import _single_process_env
    from translators.plan import translate_file

    out, run_dir, specs = argv[0], argv[1], argv[2:]
    _single_process_env()
    deepspeed.init_distributed(dist_backend="gloo")
    reads: set[str] = set()
    for n, spec in enumerate(specs):
        path, *sets = spec.split("::")
        sets.append(f"output_dir={os.path.join(run_dir, str(n))}")
        plan = translate_file(path, sets, world_size=1).plan
        trainer = Trainer(wrap(plan, "", reads), max_steps=2)
        trainer.fit()
        trainer.close()
    with open(out, "w") as f:
        json.dump(sorted(reads), f, indent=0)


if __name__ == "__main__":
    main(sys.argv[1:])
