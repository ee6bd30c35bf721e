"""Typed section schemas: frozen dataclasses whose fields carry MindFormers' defaults, checked against the YAML.

A section is declared once, as a table of fields:

    @dataclass(frozen=True)
    class RunnerConfig(Section):
        PATH = "runner_config"
        STRICT = True                       # MindFormers' template rejects unknown keys here
        batch_size: int = key(1, "per-device batch per micro step", check=at_least(1))

`RunnerConfig.parse(tree, ledger)` returns the instance with the YAML's values (converted and checked, every error
naming the key path) and MindFormers' defaults for the rest. Unknown keys are a ConfigError with a did-you-mean in
STRICT sections and an `unknown` note elsewhere, as MindFormers itself only warns there.

The PyYAML quirks (loader.py) are handled here: a float field given the string '1e-5' takes 1e-05 and a nullable
field given 'None' takes None, each with a note, since MindFormers would hand the string on unchanged.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable
from typing import Any, ClassVar, Literal, Union

from translators.errors import ConfigError, did_you_mean, join, show
from translators.notes import Ledger

Check = Callable[[Any], "str | None"]  # returns what was expected, or None when the value is fine


def key(default: Any, doc: str, *, check: Check | None = None, alias: str | None = None) -> Any:
    """A section field: MindFormers' default, a one-line meaning, an optional value check, an optional YAML alias."""
    meta = {"doc": doc, "check": check, "alias": alias}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: _copy(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _copy(value: Any) -> Any:
    if isinstance(value, list):
        return [_copy(v) for v in value]
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    return value


def at_least(low: float) -> Check:
    return lambda v: None if v is None or v >= low else f"a number >= {low:g}"


def above(low: float) -> Check:
    return lambda v: None if v is None or v > low else f"a number > {low:g}"


def between(low: float, high: float) -> Check:
    return lambda v: None if v is None or low <= v <= high else f"a number in [{low:g}, {high:g}]"


def one_of(*choices: Any) -> Check:
    return lambda v: None if v is None or v in choices else "one of " + ", ".join(repr(c) for c in choices)


MAX_INT = 2**31 - 1  # MindSpore's int32; larger counts are typos, not configurations


class _Coerced(typing.NamedTuple):
    value: Any
    quirk: str | None = None  # a note when a PyYAML string was read as a number or null


def _fail(path: str, expected: str, value: Any) -> ConfigError:
    return ConfigError(path, f"expected {expected}, got {show(value)}")


def coerce(value: Any, hint: Any, path: str) -> _Coerced:
    """Check `value` against a type hint (int, float, bool, str, Optional, list[...], dict, Literal, Any)."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any:
        return _Coerced(value)
    if origin in (Union, types.UnionType):
        if value is None or value == "None":
            if type(None) in args:
                return _Coerced(None, "the string 'None' (PyYAML) read as null" if value == "None" else None)
        errors = []
        for arm in args:
            if arm is type(None):
                continue
            try:
                return coerce(value, arm, path)
            except ConfigError as exc:
                errors.append(exc)
        expected = " or ".join(_name(a) for a in args)
        raise _fail(path, expected, value)
    if origin is Literal:
        if value in args and type(value) is type(args[args.index(value)]):
            return _Coerced(value)
        raise _fail(path, "one of " + ", ".join(repr(a) for a in args), value)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise _fail(path, _name(hint), value)
        (item_hint,) = args
        out, quirk = [], None
        for i, item in enumerate(value):
            c = coerce(item, item_hint, join(path, i))
            out.append(c.value)
            quirk = quirk or c.quirk
        return _Coerced(out, quirk)
    if hint is bool:
        if isinstance(value, bool):
            return _Coerced(value)
        raise _fail(path, "true or false", value)
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _fail(path, "an int", value)
        if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
            raise _fail(path, "an int", value)
        if abs(value) > MAX_INT:
            raise _fail(path, f"an int within +-{MAX_INT}", value)
        return _Coerced(int(value))
    if hint is float:
        if isinstance(value, bool):
            raise _fail(path, "a number", value)
        if isinstance(value, (int, float)):
            number = float(value) if abs(value) < 1e308 else math.inf
            if not math.isfinite(number):
                raise _fail(path, "a finite number", value)
            return _Coerced(number)
        if isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                raise _fail(path, "a number", value) from None
            if math.isfinite(number):
                return _Coerced(number, f"the string {value!r} (PyYAML reads 1e-5 without a dot as a string) "
                                        f"taken as the number {number!r}")
        raise _fail(path, "a finite number", value)
    if hint is str:
        if isinstance(value, str):
            return _Coerced(value)
        raise _fail(path, "a string", value)
    if hint is dict:
        if isinstance(value, dict):
            return _Coerced(value)
        raise _fail(path, "a mapping", value)
    raise TypeError(f"schema hint {hint!r} at {path} is not supported")  # a bug in a schema, not in the YAML


def _name(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is list:
        return f"a list of {_name(typing.get_args(hint)[0])}"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    return {int: "an int", float: "a number", bool: "true or false", str: "a string", dict: "a mapping",
            type(None): "null"}.get(hint, str(hint))


class Section:
    """Base of the section dataclasses. Subclasses set PATH (dotted YAML path) and STRICT."""

    PATH: ClassVar[str] = ""
    STRICT: ClassVar[bool] = False
    # Keys MindFormers knows in this section that are not fields (handled elsewhere or dropped), key -> reason.
    EXTRA: ClassVar[dict[str, str]] = {}

    @classmethod
    def fields(cls) -> dict[str, dataclasses.Field]:
        return {f.name: f for f in dataclasses.fields(cls)}

    @classmethod
    def parse(cls, raw: Any, ledger: Ledger | None = None) -> Section:
        """Build the section from its YAML mapping (None when absent): values checked, defaults filled."""
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise ConfigError(cls.PATH, f"expected a mapping, got {show(raw)}")
        hints = typing.get_type_hints(cls)
        fields = cls.fields()
        names = {f.metadata.get("alias") or name: name for name, f in fields.items()}
        known = set(names) | set(cls.EXTRA)
        values: dict[str, Any] = {}
        for yaml_key, value in raw.items():
            path = join(cls.PATH, yaml_key)
            if yaml_key not in names:
                if yaml_key in cls.EXTRA:
                    continue
                hint = did_you_mean(yaml_key, known)
                if cls.STRICT:
                    raise ConfigError(path, f"unknown key in {cls.PATH} (MindFormers rejects it too)", hint)
                if ledger is not None:
                    ledger.unknown(path, "not a key of this section; ignored" + (f" ({hint})" if hint else ""))
                continue
            name = names[yaml_key]
            coerced = coerce(value, hints[name], path)
            check = fields[name].metadata.get("check")
            problem = check(coerced.value) if check else None
            if problem:
                raise _fail(path, problem, value)
            if coerced.quirk and ledger is not None:
                ledger.differs(path, coerced.quirk)
            values[name] = coerced.value
        return cls(**values)

    def given(self, raw: Any, name: str) -> bool:
        """True when the YAML itself set field `name` (not the default)."""
        alias = self.fields()[name].metadata.get("alias") or name
        return isinstance(raw, dict) and alias in raw
