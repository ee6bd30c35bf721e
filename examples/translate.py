"""Translate a MindFormers YAML: the DeepSpeed JSON, the HF config and what every key became.

    python examples/translate.py configs/tiny_llama.yaml --out out/translated
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from translators import ConfigError, translate_file


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("config", nargs="?", default=str(Path(__file__).parents[1] / "configs" / "tiny_llama.yaml"))
    p.add_argument("--out", default="out/translated")
    args = p.parse_args()
    try:
        result = translate_file(args.config, world_size=1)
    except ConfigError as exc:  # a bad YAML: one line naming the key path
        raise SystemExit(f"error: {exc}") from None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ds.json").write_text(json.dumps(result.plan.deepspeed, indent=2))
    (out / "hf.json").write_text(json.dumps(result.plan.hf_config, indent=2))
    (out / "plan.json").write_text(result.to_json())
    print("\n".join(result.formative))  # MindFormers' own recompute log lines
    print("\n".join(result.ledger.explain()))  # every YAML key and what it became
    print(f"wrote {out}/ds.json, hf.json, plan.json")


if __name__ == "__main__":
    main()
