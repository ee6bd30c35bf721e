"""YAMLs built to hang or exhaust `mf-translate` (issue 23): each ends in exit 2 and one line, in well under a second.

The mapping form of "billion laughs" (10^6 leaves from 300 bytes: took 29 s before the node bound), a `base_config`
naming a FIFO (open() blocked forever), /dev/zero (memory grew without bound) or a file too large to be a YAML,
and a vocab_size no embedding can have (translated with exit 0, then a traceback in torch.empty).
"""

from __future__ import annotations

import os
import time

import pytest

from tests.conftest import CONFIGS
from translators.cli import run
from translators.loader import MAX_NODES, MAX_YAML_BYTES

LLAMA = str(CONFIGS / "tiny_llama.yaml")


def _laughs(kind: str, levels: int = 6) -> str:
    """Each level aliases the one below ten times: 10^levels leaves."""
    if kind == "mapping":
        lines = ["a0: &a0 {" + ", ".join(f"k{j}: 1" for j in range(10)) + "}"]
        lines += [f"a{i}: &a{i} {{" + ", ".join(f"k{j}: *a{i - 1}" for j in range(10)) + "}" for i in range(1, levels)]
    else:
        lines = ["a0: &a0 [" + ", ".join("1" for _ in range(10)) + "]"]
        lines += [f"a{i}: &a{i} [" + ", ".join(f"*a{i - 1}" for _ in range(10)) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def _one_error(capsys, argv: list[str], expected: str, budget_s: float = 5.0) -> str:
    start = time.monotonic()
    assert run(argv) == 2
    elapsed = time.monotonic() - start
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("mf-translate: error: ") and expected in last, last
    assert elapsed < budget_s, f"{elapsed:.1f} s"
    return last


@pytest.mark.parametrize("kind", ["mapping", "list"])
def test_alias_bomb_is_refused_fast(kind, tmp_path, capsys):
    path = tmp_path / f"laughs_{kind}.yaml"
    path.write_text(_laughs(kind))
    last = _one_error(capsys, [str(path)], f"more than {MAX_NODES:,} nodes once its aliases are expanded")
    assert str(path) in last


def test_aliases_below_the_bound_still_work(tmp_path, capsys):
    path = tmp_path / "shared.yaml"
    path.write_text(f"base_config: {LLAMA}\n" + _laughs("mapping", levels=3))  # 10^3 leaves
    assert run([str(path)]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("target", ["fifo", "/dev/zero"])
def test_base_config_must_be_a_regular_file(target, tmp_path, capsys):
    if target == "fifo":
        target = str(tmp_path / "pipe")
        os.mkfifo(target)
    path = tmp_path / "x.yaml"
    path.write_text(f"base_config: {target}\nseed: 1\n")
    last = _one_error(capsys, [str(path)], "not a regular file")
    assert target in last


def test_base_config_too_large(tmp_path, capsys):
    big = tmp_path / "big.yaml"
    with open(big, "wb") as f:
        f.truncate(MAX_YAML_BYTES + 1)  # sparse: no disk used
    path = tmp_path / "x.yaml"
    path.write_text(f"base_config: {big}\nseed: 1\n")
    last = _one_error(capsys, [str(path)], "a MindFormers YAML is a few KiB")
    assert str(big) in last


@pytest.mark.parametrize("value", ["99999999999999999999", str(2**24 + 1)])
def test_absurd_vocab_size_is_refused_at_translation(value, capsys):
    _one_error(capsys, [LLAMA, "--set", f"model.model_config.vocab_size={value}"],
               f"model.model_config.vocab_size: expected a positive int of at most {2**24:,}")


def test_largest_real_vocab_size_translates(capsys):
    assert run([LLAMA, "--set", "model.model_config.vocab_size=262144"]) == 0, capsys.readouterr().err
