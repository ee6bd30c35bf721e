"""The Plan's JSON both ways (translators/plan_types.py): each dataclass a JSON object with its fields in declaration
order, tuples as lists; `from_json` reads it back against the dataclasses' type hints, an unknown key an error naming
its path."""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping
from dataclasses import MISSING, fields, is_dataclass
from typing import Any


def to_json(value: Any) -> Any:
    if is_dataclass(value):
        return {f.name: to_json(getattr(value, f.name)) for f in fields(value)
                if not (f.metadata.get("omit_none") and getattr(value, f.name) is None)}
    if isinstance(value, (list, tuple)):
        return [to_json(item) for item in value]
    if isinstance(value, Mapping):
        return {key: to_json(item) for key, item in value.items()}
    return value


def from_json(hint: Any, value: Any, path: str, partial: bool = False) -> Any:
    """`value` (JSON) as the type `hint`, checked against the dataclasses' fields; raises ValueError naming the path."""
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        if value is None:
            return None
        inner = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        if len(inner) > 1:  # dataclasses told apart by their `type` (Optimizer | MuonOptimizer)
            kind = value.type if is_dataclass(value) else value.get("type")
            chosen = [arg for arg in inner if dict((f.name, f.default) for f in fields(arg)).get("type") == kind]
            inner = chosen or inner[:1]
        return from_json(inner[0], value, path, partial)
    if isinstance(hint, type) and is_dataclass(hint):
        if isinstance(value, hint):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"{path}: expected a mapping, got {type(value).__name__}")
        hints = typing.get_type_hints(hint)
        known = {f.name for f in fields(hint)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"{path}: unknown entries {unknown} (a {hint.__name__} has {sorted(known)})")
        kwargs = {}
        for f in fields(hint):
            if f.name in value:
                kwargs[f.name] = from_json(hints[f.name], value[f.name], f"{path}.{f.name}", partial)
            elif not partial and not f.metadata.get("omit_none"):
                raise ValueError(f"{path}.{f.name}: missing")
            elif f.default is MISSING and f.default_factory is MISSING:
                raise ValueError(f"{path}.{f.name}: missing (no default)")
        return hint(**kwargs)
    if origin is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(from_json(args[0], item, f"{path}[{i}]", partial) for i, item in enumerate(value))
        return tuple(value)
    if origin is Mapping or hint is Mapping:
        return dict(value)
    return value

