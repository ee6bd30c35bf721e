"""translators/ is pure Python: it imports with torch, deepspeed, transformers, triton and numpy blocked, and
`mf-translate` is fast because of it."""

from __future__ import annotations

import resource
import subprocess
import sys

from tests.conftest import CONFIGS, ROOT, corpus_files

FILES = [*corpus_files(), *sorted(CONFIGS.glob("*.yaml"))]  # configs/ alone in a clone without ../shared

BLOCK = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {'torch', 'deepspeed', 'transformers', 'triton', 'numpy', 'accelerate',
                                  'safetensors', 'mf_ds'}:
            raise ImportError(f'translators must not import {name}')
sys.meta_path.insert(0, Block())
"""


def test_translators_import_and_run_with_heavy_modules_blocked():
    code = BLOCK + f"""
import pkgutil, importlib, translators
for m in pkgutil.iter_modules(translators.__path__):
    importlib.import_module('translators.' + m.name)
from translators.errors import ConfigError
from translators.plan import translate_file
for path in {[str(p) for p in FILES]!r}:
    try:
        translate_file(path)
    except ConfigError:  # a refused YAML (test_corpus.py REFUSED) has run all the same
        pass
print('ok')
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_mf_translate_is_under_half_a_second_per_file():
    """CPU seconds of the child processes (user + system), not wall time: a box shared with other jobs stretches the
    wall clock, not the work `mf-translate` does."""
    files = FILES[:8]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    for path in files:
        proc = subprocess.run([sys.executable, "-m", "translators.cli", str(path)], cwd=ROOT, capture_output=True,
                              timeout=60)
        assert proc.returncode in (0, 2), proc.stderr  # 2: a refused YAML (test_corpus.py REFUSED)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    per_file = (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) / len(files)
    assert per_file < 0.5, f"{per_file:.3f} CPU s per file"
