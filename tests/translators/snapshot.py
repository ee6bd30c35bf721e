"""The golden snapshot of what `mf-translate` makes of every YAML the project knows (issue 21: a refactor must not
change it): the Plan JSON (`--plan`), the ledger (`--explain`) and the Formative lines, per YAML of configs/,
tests/fixtures and the reference corpus. A YAML that is refused records its one-line error instead.

`python -m tests.translators.snapshot` rewrites tests/translators/data/plan_snapshot.json.gz (about 1.7 MB of text,
kept gzipped); regenerate it only for a change that means to alter a translation, and say so in the commit.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from tests.conftest import CONFIGS, CORPUS, ROOT, corpus_files
from translators.errors import ConfigError
from translators.plan import translate_file

SNAPSHOT = Path(__file__).resolve().parent / "data" / "plan_snapshot.json.gz"
FIXTURES = ROOT / "tests" / "fixtures"


def sources() -> dict[str, Path]:
    """Snapshot name -> YAML: configs/..., tests/fixtures/..., corpus/... (the corpus only where ../shared is)."""
    out = {f"configs/{p.name}": p for p in sorted(CONFIGS.glob("*.yaml"))}
    out.update({str(p.relative_to(ROOT)): p for p in sorted(FIXTURES.rglob("*.yaml"))})
    out.update({f"corpus/{p.name}": p for p in corpus_files()})
    return out


def plan_lines(value, path: str = "") -> list[str]:
    """The Plan as one `path = value` line per leaf, so a difference reads as the keys that changed."""
    if isinstance(value, dict) and value:
        return [line for key, item in value.items() for line in plan_lines(item, f"{path}.{key}" if path else key)]
    if isinstance(value, list) and value and any(isinstance(item, (dict, list)) for item in value):
        return [line for i, item in enumerate(value) for line in plan_lines(item, f"{path}[{i}]")]
    return [f"{path} = {json.dumps(value)}"]


def take(path: Path) -> dict[str, list[str]]:
    """What mf-translate makes of one YAML: plan lines, --explain lines, Formative lines (or the error)."""
    try:
        result = translate_file(str(path))
    except ConfigError as exc:
        return {"error": [str(exc)]}
    return {"plan": plan_lines(json.loads(result.to_json())), "explain": list(result.ledger.explain()),
            "formative": list(result.formative)}


def load() -> dict[str, dict[str, list[str]]]:
    with gzip.open(SNAPSHOT, "rt", encoding="utf-8") as f:
        return json.load(f)


def main() -> None:
    snapshot = {name: take(path) for name, path in sources().items()}
    if not any(name.startswith("corpus/") for name in snapshot):
        raise SystemExit(f"the corpus is missing ({CORPUS}): a snapshot without it would drop its entries")
    SNAPSHOT.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(snapshot, indent=0, sort_keys=True)
    with gzip.GzipFile(SNAPSHOT, "wb", mtime=0) as f:  # mtime 0: the same snapshot gives the same bytes
        f.write(text.encode("utf-8"))
    print(f"{SNAPSHOT.relative_to(ROOT)}: {len(snapshot)} YAMLs, {len(text)} characters")


if __name__ == "__main__":
    main()
