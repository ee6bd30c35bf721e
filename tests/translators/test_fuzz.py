"""Fuzzing the translator: mutated corpus YAMLs end in a translation or one clear error, never a traceback.

Every MindFormers YAML of the reference corpus and of configs/ is mutated the ways hand-edited files go wrong:
keys dropped or renamed (unicode included), values of the wrong type, out-of-range and huge numbers, random
strings, deep nesting, non-string keys, and, at the text level, raw tokens pasted into the YAML and the tags
PyYAML knows (`!!python/object/apply`, `!!binary`, `!!set`, `!!timestamp`, ...). Each case must end like the CLI
promises (translators/cli.py): exit 0 with a JSON-serialisable Plan, or exit 2 with one line
`mf-translate: error: <key path or file>: <what was expected>`. Any other exception is a bug (exit 1).

The tree mutations call `translate` directly (about 8 ms a case); the text mutations go through
`translators.cli.run([file])`, the `mf-translate` entry point itself. Runs are derandomized so CI sees the same
cases every time; `MF_DS_FUZZ_SCALE=20 pytest tests/translators/test_fuzz.py` explores twenty times as many.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import CONFIGS, corpus_files
from translators.cli import run
from translators.errors import ConfigError
from translators.loader import load_yaml
from translators.plan import translate

FILES = [*corpus_files(), *sorted(CONFIGS.glob("*.yaml"))]  # configs/ alone in a clone without ../shared
TREES = {path.name: load_yaml(str(path)) for path in FILES}
TEXTS = {path.name: path.read_text(encoding="utf-8") for path in FILES}
SCALE = int(os.environ.get("MF_DS_FUZZ_SCALE", "1"))
CASES = {"tree": 2400 * SCALE, "text": 800 * SCALE, "tags": 200 * SCALE}  # 3,400 in CI, ~30 s
SETTINGS = dict(deadline=None, derandomize=SCALE == 1, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
# `mf-translate: error: <where>: <what>`, where is a key path (`a.b[2]`, `a['regex\\.key']`) or the file (`x.yaml:12`)
KEY_PATH = re.compile(r"(?:[A-Za-z_][\w\-]*|\[[^\]]*\])(?:\.[\w\-]+|\[[^\]]*\])*: \S")


def _paths(tree: Any, prefix: tuple = ()) -> list[tuple]:
    """Every node below the root, as a tuple of keys and list indices."""
    out = []
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    for key, value in items:
        out.append(prefix + (key,))
        out.extend(_paths(value, prefix + (key,)))
    return out


PATHS = {name: _paths(tree) for name, tree in TREES.items()}


def _parent(tree: Any, path: tuple) -> Any:
    for key in path[:-1]:
        tree = tree[key]
    return tree


# Values a hand-edited YAML holds where something else was expected.
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.sampled_from(["", "None", "none", "null", "1e-5", "1.e-8", "-1", "0x10", "yes", "off", "inf", "nan",
                     "float32", "bfloat16", "True", "ﾃｽﾄ", "e\u0301", "\u202e", "\x00", " " * 3]))
numbers = st.one_of(
    st.sampled_from([0, -1, 1, 2, 3, 7, -(2**31), 2**31, 2**31 - 1, 2**63, 10**30, 10**400, 0.5, -0.5, 1e-30,
                     1e308, -1e308, 0.999999999, 1.0000001]),
    st.integers(min_value=-(10**6), max_value=10**6), st.floats(min_value=-1e6, max_value=1e6))
values = st.one_of(
    scalars, numbers,
    st.lists(st.one_of(scalars, numbers), max_size=4),
    st.dictionaries(st.text(max_size=6), scalars, max_size=3),
    st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                       max_size=3), max_leaves=8))
keys = st.one_of(st.text(min_size=1, max_size=12), st.integers(-3, 3), st.none(), st.booleans(),
                 st.sampled_from(["type", "batch_size", "num_layers", "recompute", "ペア", "Ø", "x" * 200]))


def _nested(depth: int, dicts: bool, leaf: Any) -> Any:
    for _ in range(depth):
        leaf = {"a": leaf} if dicts else [leaf]
    return leaf


@st.composite
def mutated_trees(draw) -> tuple[str, dict, str]:
    """(file name, a mutated copy of its tree, what was done): one to three mutations."""
    name = draw(st.sampled_from(sorted(TREES)))
    tree = copy.deepcopy(TREES[name])
    done = []
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(tree)
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent, last = _parent(tree, path), path[-1]
        op = draw(st.sampled_from(["drop", "drop", "value", "value", "number", "scale", "rename", "nest",
                                   "section"]))
        if op == "drop":
            del parent[last]
        elif op == "value":
            parent[last] = draw(values)
        elif op == "number":
            parent[last] = draw(numbers)
        elif op == "scale":  # the same kind of number, off by sign or orders of magnitude
            old = parent[last]
            if isinstance(old, (int, float)) and not isinstance(old, bool):
                factor = draw(st.sampled_from([-1, 0, 2, 1000, 10**12, 10**40]))
                parent[last] = old * factor if isinstance(old, int) or factor < 10**40 else old * 1e300
        elif op == "rename" and isinstance(parent, dict):
            parent[draw(keys)] = parent.pop(last)
        elif op == "nest":
            parent[last] = _nested(draw(st.integers(2, 120)), draw(st.booleans()), parent[last])
        elif op == "section":  # a whole top-level section replaced
            tree[path[0]] = draw(values)
        done.append(f"{op} {path}")
    return name, tree, "; ".join(done)


def _check_error(exc: ConfigError) -> None:
    """A ConfigError the CLI prints as one useful line: a key path or file, then what was expected."""
    line = str(exc)
    assert exc.path, f"no key path or file named: {line!r}"
    assert line.startswith(f"{exc.path}: ") and len(line) > len(exc.path) + 4, line
    assert "\n" not in line, line


@settings(max_examples=CASES["tree"], **SETTINGS)
@given(case=mutated_trees())
def test_mutated_trees_translate_or_name_the_key(case):
    name, tree, done = case
    try:
        plan = translate(tree).json
    except ConfigError as exc:
        _check_error(exc)
        return
    json.dumps(plan, allow_nan=False)  # the Plan and the DeepSpeed JSON stay valid JSON


# --- the YAML text itself: raw tokens pasted in, tags, the loader's own checks -----------------------------------

_SCALAR_LINE = re.compile(r"^(?P<head>\s*(?:- )?[A-Za-z_][\w.]*:\s+)(?P<value>[^\s#&*|>!{\[][^#]*?)\s*$")
LINES = {name: [i for i, line in enumerate(text.splitlines()) if _SCALAR_LINE.match(line)]
         for name, text in TEXTS.items()}
raw_tokens = st.one_of(
    st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\n\r"), max_size=20),
    st.sampled_from(["1e-5", "1.e-5", "0o17", "0x1F", "1_000", "0b101", ".inf", "-.inf", ".nan", "~", "Null",
                     "2001-12-14", "2001-12-14t21:59:43.10-05:00", "12:30:45", "190:20:30", "yes", "No", "ON",
                     "=", "<<", "'unterminated", '"esc \\x"', "[1, [2, {3: 4}]]", "{a: 1, a: 2}", "&x 1", "*x",
                     "*undefined", "? a", "|\n  text", "- item", "1" * 400, "9" * 5000, "-" + "9" * 50 + ".5e999",
                     "\u0085", "\ufeff", "\u2028"]))
TAGS = ["!!python/object/apply:os.system ['touch {marker}']", "!!python/object/new:os.system ['touch {marker}']",
        "!!python/object:__main__.Anything {{}}", "!!python/name:os.system", "!!python/module:os",
        "!!python/tuple [1, 2]", "!!python/unicode x", "!!binary aGVsbG8=", "!!set {{a, b}}", "!!omap [a: 1]",
        "!!pairs [a: 1, a: 2]", "!!timestamp 2001-12-14", "!!float 1", "!!int '7'", "!!bool yes", "!!str 12",
        "!!null ''", "!!seq [1]", "!!map {{a: 1}}", "!custom 1", "!<tag:example.com,2000:x> 1", "!!merge 1",
        "!!value 1", "!!yaml 1"]


def _cli(path: Path) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = run([str(path)])
    return code, out.getvalue(), err.getvalue()


def _check_cli(code: int, out: str, err: str, path: Path) -> None:
    if code == 0:
        json.loads(out, parse_constant=lambda c: pytest.fail(f"{c} in the DeepSpeed JSON"))
        return
    assert code == 2, err
    lines = err.strip().split("\n")  # a terminal's lines (str.splitlines also splits at U+2028 and friends)
    assert out == "" and lines, err
    prefix = "mf-translate: error: "
    assert lines[-1].startswith(prefix), lines[-1]
    where = lines[-1][len(prefix):]
    assert re.match(re.escape(str(path)) + r"(:\d+)?: \S", where) or KEY_PATH.match(where), lines[-1]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


@settings(max_examples=CASES["text"], **SETTINGS)
@given(data=st.data())
def test_raw_text_pasted_into_a_yaml(data, workdir):
    name = data.draw(st.sampled_from(sorted(n for n in TEXTS if LINES[n])))
    lines = TEXTS[name].splitlines()
    for _ in range(data.draw(st.integers(1, 2))):
        i = data.draw(st.sampled_from(LINES[name]))
        match = _SCALAR_LINE.match(lines[i])
        if match:
            lines[i] = match["head"] + data.draw(raw_tokens)
    path = workdir / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    _check_cli(*_cli(path), path)


@settings(max_examples=CASES["tags"], **SETTINGS)
@given(data=st.data())
def test_tags_never_construct_objects(data, workdir):
    """Python tags are refused with the file and line; the safe tags' values (bytes, sets, dates) are checked."""
    name = data.draw(st.sampled_from(sorted(n for n in TEXTS if LINES[n])))
    lines = TEXTS[name].splitlines()
    i = data.draw(st.sampled_from(LINES[name]))
    marker = workdir / "constructed"
    tag = data.draw(st.sampled_from(TAGS))
    lines[i] = _SCALAR_LINE.match(lines[i])["head"] + tag.format(marker=marker)
    path = workdir / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    code, out, err = _cli(path)
    _check_cli(code, out, err, path)
    assert not marker.exists(), "a YAML tag ran os.system"
    if tag.startswith("!!python"):
        assert code == 2 and f"{name}:{i + 1}: invalid YAML" in err and "not allowed" in err, err


@pytest.mark.parametrize("depth", [50, 300, 2000])
@pytest.mark.parametrize("dicts", [False, True])
def test_deep_nesting_in_the_text(depth, dicts, workdir, capsys):
    value = "{a: " * depth + "1" + "}" * depth if dicts else "[" * depth + "1" + "]" * depth
    path = workdir / "deep.yaml"
    path.write_text(TEXTS["tiny_llama.yaml"] + "\nmf_ds:\n  zero_stage: " + value + "\n")
    code = run([str(path)])
    out, err = capsys.readouterr()
    _check_cli(code, out, err, path)
    assert code == 2 and ("mf_ds.zero_stage" in err or "nested too deeply" in err), err
