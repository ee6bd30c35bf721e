"""The ledger: every YAML key and what it became, or why it does not apply here.

Nothing in the YAML is silently lost (DESIGN.md). Each translator step accounts for the keys it reads; an account
at a path covers every key below it (`context` as a whole is Ascend-only). Keys nobody accounted for end up as
`unknown` notes. The ledger becomes the Plan's `notes` and the `--explain` listing.

Kinds:
  mapped   became a DeepSpeed or HF config value
  runtime  carried in the Plan for the mf_ds runtime (run, layers, moe, kernels)
  dropped  understood, and deliberately not carried (with the reason)
  differs  carried, but the behaviour here differs from MindFormers' (a warning)
  unknown  not a key this translator knows; ignored (a warning)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from translators.errors import join

KINDS = ("mapped", "runtime", "dropped", "differs", "unknown")
WARNING_KINDS = ("differs", "unknown")


@dataclass(frozen=True)
class Note:
    """One account: the YAML key path (empty for a note about the run as a whole), its kind and what happened."""

    key: str
    kind: str
    message: str

    def line(self) -> str:
        return f"{self.key or '(run)'}: [{self.kind}] {self.message}"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 70 else text[:67] + "..."


def leaves(tree: Any, path: str = "") -> dict[str, Any]:
    """Every leaf key path of a loaded YAML: dicts are walked, lists only when they hold dicts (`callbacks[0].type`)."""
    out: dict[str, Any] = {}
    if isinstance(tree, dict) and tree:
        for key, value in tree.items():
            out.update(leaves(value, join(path, key)))
    elif isinstance(tree, list) and any(isinstance(item, dict) for item in tree):
        for i, item in enumerate(tree):
            out.update(leaves(item, join(path, i)))
    elif path:
        out[path] = tree
    return out


def _covers(prefix: str, path: str) -> bool:
    return path == prefix or path.startswith(prefix + ".") or path.startswith(prefix + "[")


class _Kinds:
    """One method per note kind, each `add(key, kind, message)`."""

    def add(self, key: str, kind: str, message: str) -> None:
        raise NotImplementedError

    def mapped(self, key: str, message: str) -> None:
        self.add(key, "mapped", message)

    def runtime(self, key: str, message: str) -> None:
        self.add(key, "runtime", message)

    def dropped(self, key: str, message: str) -> None:
        self.add(key, "dropped", message)

    def differs(self, key: str, message: str) -> None:
        self.add(key, "differs", message)

    def unknown(self, key: str, message: str) -> None:
        self.add(key, "unknown", message)


class Ledger(_Kinds):
    """Collects notes while a YAML is translated; `finish()` adds `unknown` notes for keys nobody accounted for."""

    def __init__(self, tree: dict):
        self.values = leaves(tree)
        self._notes: list[Note] = []

    def add(self, key: str, kind: str, message: str) -> None:
        assert kind in KINDS, kind
        self._notes.append(Note(key, kind, message))

    def present(self, key: str) -> bool:
        """True when the YAML holds this key (or keys below it)."""
        return any(_covers(key, path) for path in self.values)

    def accounted(self, path: str) -> bool:
        return any(note.key and _covers(note.key, path) for note in self._notes)

    def finish(self) -> list[Note]:
        for path in self.values:
            if not self.accounted(path):
                self.unknown(path, "not a key this translator knows; ignored")
        return list(self._notes)

    def warnings(self) -> list[Note]:
        return [note for note in self._notes if note.kind in WARNING_KINDS]

    def explain(self) -> list[str]:
        """One line per YAML leaf key (its most specific accounts), then the notes on keys the YAML does not hold."""
        lines = []
        for path, value in self.values.items():
            covering = [note for note in self._notes if note.key and _covers(note.key, path)]
            if not covering:
                continue
            longest = max(len(note.key) for note in covering)
            for note in covering:
                if len(note.key) == longest:
                    lines.append(f"{path} = {_short(value)}: [{note.kind}] {note.message}")
        for note in self._notes:
            if not note.key or not self.present(note.key):
                lines.append(note.line())
        return lines

    def view(self, paths: dict[str, str], words: dict[str, str] | None = None) -> LedgerView:
        """This ledger seen through a path map (`{"model.model_config": "model"}`): code written for one schema's
        paths notes the keys of another (the PyNative schema's flat `model`, translators/pynative.py). `words`:
        key paths that the notes' messages name, replaced in them too."""
        return LedgerView(self, paths, words or {})


class LedgerView(_Kinds):
    """A Ledger whose keys are renamed on the way in: the longest matching prefix of `paths` is replaced (and each
    of `words` in the message)."""

    def __init__(self, ledger: Ledger, paths: dict[str, str], words: dict[str, str]):
        self.ledger = ledger
        self.paths = sorted(paths.items(), key=lambda item: -len(item[0]))
        self.words = words

    def path(self, key: str) -> str:
        for old, new in self.paths:
            if _covers(old, key):
                return new + key[len(old):]
        return key

    @property
    def values(self) -> dict[str, Any]:
        return self.ledger.values

    def add(self, key: str, kind: str, message: str) -> None:
        for old, new in self.words.items():
            message = message.replace(old, new)
        self.ledger.add(self.path(key), kind, message)

    def present(self, key: str) -> bool:
        return self.ledger.present(self.path(key))

    def accounted(self, path: str) -> bool:
        return self.ledger.accounted(self.path(path))

    def warnings(self) -> list[Note]:
        return self.ledger.warnings()
