"""Every YAML of configs/, tests/fixtures and the corpus translates to the Plan, ledger and Formative lines of the
golden snapshot (tests/translators/snapshot.py writes it; issue 21: the structure changed, the translations did not).
"""

from __future__ import annotations

import difflib

import pytest

from tests.conftest import SHARED, SHARED_MISSING
from tests.translators.snapshot import load, sources, take

GOLDEN = load()
SOURCES = sources()


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_translation_matches_snapshot(name):
    assert name in GOLDEN, f"{name} is not in the snapshot: run `python -m tests.translators.snapshot`"
    now = take(SOURCES[name])
    want = GOLDEN[name]
    diffs = []
    for part in sorted(set(want) | set(now)):
        diffs += difflib.unified_diff(want.get(part, []), now.get(part, []), f"snapshot {part}", f"now {part}",
                                      n=1, lineterm="")
    assert not diffs, f"{name} translates differently from the snapshot:\n" + "\n".join(diffs[:200])


@pytest.mark.skipif(not SHARED.is_dir(), reason=SHARED_MISSING)
def test_snapshot_has_no_stale_entries():
    """A YAML removed or renamed leaves no entry behind that nothing checks."""
    assert sorted(set(GOLDEN) - set(SOURCES)) == []
