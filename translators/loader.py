"""Loading a MindFormers YAML exactly as MindFormers does, with clear errors where it would not.

MindFormers reads its YAMLs with PyYAML `safe_load` (YAML 1.1), so we do too, quirks included:
  * `1e-5` (no dot) is the *string* '1e-5', `None` is the string 'None', `yes`/`on` are booleans.
    The section schemas accept such strings where a number or null is expected, with a note.
  * anchors, aliases and `<<` merges work; `base_config:` (a path or a list, relative to the file) is loaded
    first and the file is merged over it (mindformers/tools/register/config.py, BASE_CONFIG).
What we refuse, with the file and line: malformed YAML, tags that construct Python objects (`!!python/object`),
a top level that is not a mapping, `base_config` cycles. A duplicate key takes its last value, as safe_load (and so
MindFormers) does, with a DuplicateKeyWarning naming the key and both lines.
"""

from __future__ import annotations

import copy
import os
import stat
import sys
import warnings
from typing import Any

import yaml

from translators.errors import ConfigError, join, show

BASE_CONFIG = "base_config"
# A YAML's size once its aliases are expanded, in nodes. The largest YAML of the MindFormers reference corpus has
# 563; an alias of an alias of a mapping (the mapping form of "billion laughs") reaches 10^6 with a
# 200-byte file, and walking that tree (notes for every key) took 29 s. 10^5 leaves room for any real run.
MAX_NODES = 100_000
# base_config files are read whole: a FIFO would block the read forever, /dev/zero would fill memory.
MAX_YAML_BYTES = 16 * 2**20


class DuplicateKeyWarning(UserWarning):
    """A mapping repeats a key: the last value wins (PyYAML safe_load, and so MindFormers)."""


class _Loader(yaml.SafeLoader):
    """SafeLoader that warns about duplicate keys (keeping the last value, as safe_load does)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                hash(key)
            except TypeError:
                raise yaml.constructor.ConstructorError(
                    None, None, f"a mapping key must be a scalar, got {type(key).__name__}", key_node.start_mark
                ) from None
            line = key_node.start_mark.line + 1
            if key in seen:  # safe_load keeps the last value, and so MindFormers runs the file with it
                warnings.warn(DuplicateKeyWarning(
                    f"line {line}: duplicate key {key!r} (first on line {seen[key]}): the last value is taken, as "
                    "MindFormers' yaml.safe_load does"), stacklevel=2)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)

    def construct_document(self, node: yaml.Node) -> Any:
        """Refuse a document whose aliases expand past MAX_NODES before building it (PyYAML shares an aliased
        object, but every walk of the result sees it once per alias)."""
        sizes: dict[int, int] = {}
        walking: set[int] = set()  # the nodes above this one: an alias of one of them is a cycle

        def size(n: yaml.Node, path: str = "") -> int:
            if id(n) in walking:
                # PyYAML would build a self-containing dict, on which every walk of the tree (the notes, the
                # model section, MindFormers' own MindFormerConfig) recurses without end.
                raise yaml.constructor.ConstructorError(
                    None, None, f"{path or 'the document'}: an alias of a node that contains it (a cycle); "
                    "write the values out", n.start_mark)
            if id(n) not in sizes:
                walking.add(id(n))
                if isinstance(n, yaml.SequenceNode):
                    children = [(c, join(path, i)) for i, c in enumerate(n.value)]
                elif isinstance(n, yaml.MappingNode):
                    children = [(c, join(path, k.value if isinstance(k, yaml.ScalarNode) else "?"))
                                for k, v in n.value for c in (k, v)]
                else:
                    children = []
                sizes[id(n)] = min(MAX_NODES + 1, 1 + sum(size(c, p) for c, p in children))
                walking.discard(id(n))
            return sizes[id(n)]

        if size(node) > MAX_NODES:
            raise yaml.constructor.ConstructorError(
                None, None, f"more than {MAX_NODES:,} nodes once its aliases are expanded (an alias bomb?)",
                node.start_mark)
        return super().construct_document(node)

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        try:
            value = super().construct_yaml_int(node)
            str(value)  # hex and base-60 ints convert without Python's digit limit, but could not be printed
        except ValueError:
            raise yaml.constructor.ConstructorError(
                None, None, f"an integer of more than {sys.get_int_max_str_digits()} digits", node.start_mark) from None
        return value


_Loader.add_constructor("tag:yaml.org,2002:int", _Loader.construct_yaml_int)


def parse_yaml(text: str, source: str = "<string>") -> Any:
    """Parse YAML text safely; any problem becomes a ConfigError naming `source` and the line."""
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 -- _Loader is a SafeLoader
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{source}:{mark.line + 1}" if mark else source
        problem = exc.problem or str(exc)
        if "could not determine a constructor" in problem:
            problem = f"{problem.split(' for the tag ')[-1]}: tags that construct objects are not allowed " \
                      "(MindFormers loads with safe_load too)"
        raise ConfigError(where, f"invalid YAML: {problem}") from None
    except yaml.reader.ReaderError as exc:  # a control character: PyYAML knows its offset, not its line
        line = text.count("\n", 0, exc.position) + 1
        char = exc.character if isinstance(exc.character, int) else ord(exc.character)
        raise ConfigError(f"{source}:{line}", f"invalid YAML: unacceptable character #x{char:04x}: "
                          f"{exc.reason}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(source, f"invalid YAML: {' '.join(str(exc).split())}") from None
    except RecursionError:
        raise ConfigError(source, "invalid YAML: nested too deeply") from None


def deep_merge(base: dict, over: dict) -> dict:
    """`over` merged into a copy of `base`: mappings merge key by key, anything else replaces."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def load_yaml(path: str, _chain: tuple[str, ...] = ()) -> dict:
    """Load a MindFormers YAML file, resolving `base_config` inheritance."""
    real = os.path.realpath(path)
    if real in _chain:
        raise ConfigError(path, f"{BASE_CONFIG} cycle: {' -> '.join(_chain + (real,))}")
    try:
        info = os.stat(path)  # before open(): opening a FIFO blocks until someone writes to it
        if stat.S_ISDIR(info.st_mode):
            raise IsADirectoryError
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(path, "not a regular file (a FIFO, a device or a socket); a YAML must be a file")
        if info.st_size > MAX_YAML_BYTES:
            raise ConfigError(path, f"{info.st_size:,} bytes; a MindFormers YAML is a few KiB (at most "
                              f"{MAX_YAML_BYTES:,} bytes are read)")
        with open(path, encoding="utf-8") as f:
            text = f.read(MAX_YAML_BYTES + 1)
        if len(text) > MAX_YAML_BYTES:
            raise ConfigError(path, f"more than {MAX_YAML_BYTES:,} characters; a MindFormers YAML is a few KiB")
    except FileNotFoundError:
        raise ConfigError(path, "no such file") from None
    except IsADirectoryError:
        raise ConfigError(path, "is a directory, not a YAML file") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(path, f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(path, f"cannot read: {exc.strerror}") from None
    tree = parse_yaml(text, path)
    if tree is None:
        raise ConfigError(path, "the file is empty; expected a MindFormers YAML mapping")
    if not isinstance(tree, dict):
        raise ConfigError(path, f"expected a mapping of sections at the top level, got {type(tree).__name__}")
    for key in tree:
        if not isinstance(key, str):
            raise ConfigError(path, f"top-level key {show(key)} is not a string")
    if BASE_CONFIG not in tree:
        return tree
    bases = tree.pop(BASE_CONFIG)
    if isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise ConfigError(BASE_CONFIG, f"expected a path or a list of paths, got {show(bases)}")
    merged: dict = {}
    for base in bases:
        base_path = base if os.path.isabs(base) else os.path.join(os.path.dirname(path), base)
        merged = deep_merge(merged, load_yaml(base_path, _chain + (real,)))
    return deep_merge(merged, tree)


def apply_overrides(tree: dict, overrides: list[str]) -> dict:
    """Apply `--set a.b.c=VALUE` overrides (VALUE parsed as a YAML scalar or flow value) to a copy of `tree`."""
    out = copy.deepcopy(tree)
    for item in overrides:
        if "=" not in item:
            raise ConfigError("--set", f"expected KEY.PATH=VALUE, got {show(item)}")
        dotted, raw = item.split("=", 1)
        keys = dotted.strip().split(".")
        if not all(keys):
            raise ConfigError("--set", f"empty key in {show(dotted)}")
        value = parse_yaml(raw, f"--set {dotted}")
        node = out
        path = ""
        for key in keys[:-1]:
            path = join(path, key)
            child = node.get(key)
            if child is None:
                child = node[key] = {}
            elif not isinstance(child, dict):
                raise ConfigError(path, f"--set {dotted}: {path} is a {type(child).__name__}, not a section")
            node = child
        node[keys[-1]] = value
    return out
