"""The one error type of the translators: a bad YAML, named by key path.

Every check in `translators/` raises `ConfigError(path, expected, got)` so the CLI can print one line
(`recompute_config.recompute[2]: expected int or bool, got 'yes'`) and exit 2 with no traceback.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable

_PLAIN_KEY = re.compile(r"[A-Za-z0-9_\-]+")


class ConfigError(ValueError):
    """A MindFormers YAML that cannot be translated: `path` is the dotted key path (or a file name)."""

    def __init__(self, path: str, message: str, hint: str | None = None, fix: dict | None = None):
        self.path = path
        self.message = message
        self.hint = hint
        # {dotted key or CLI option: value} that removes this problem, for `mf-translate` to print and then look past
        # (translators/diagnose.py); None where the fix is the user's choice
        self.fix = fix
        text = f"{path}: {message}" if path else message
        if hint:
            text += f" ({hint})"
        super().__init__(text)


def did_you_mean(name: str, choices: Iterable[str]) -> str | None:
    """`did you mean 'x'?` for the closest known name, or None when nothing is close."""
    match = difflib.get_close_matches(str(name), sorted(set(choices)), n=1, cutoff=0.75)
    return f"did you mean '{match[0]}'?" if match else None


def join(path: str, key: str | int) -> str:
    """Extend a key path: `join('a', 'b') == 'a.b'`, `join('a', 2) == 'a[2]'`."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    if not _PLAIN_KEY.fullmatch(str(key)):  # regex keys such as 'feed_forward\\.mul'
        return f"{path}[{str(key)!r}]"
    return f"{path}.{key}" if path else str(key)


def show(value: object) -> str:
    """A value as an error message shows it: strings quoted, long values cut."""
    try:
        text = repr(value)
    except ValueError:  # an int with more digits than Python prints (sys.get_int_max_str_digits())
        text = f"<an int of {value.bit_length()} bits>"
    return text if len(text) <= 60 else text[:57] + "..."
