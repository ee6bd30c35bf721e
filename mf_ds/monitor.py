"""Where a run's numbers go: metrics.jsonl (one object per optimizer step) and TensorBoard event files.

Rank 0 writes both. TensorBoard gets every scalar of the row (`train/loss`, `train/lr`, `train/grad_norm`,
`train/tokens_per_s`, `moe/layer_3/drop_rate`, ...) under <output_dir>/tensorboard, since that is where people
look; DeepSpeed's own monitor logs only lr and samples (deepspeed-and-hf.md §1.10), so the runtime writes its own.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class Monitor:
    def __init__(self, output_dir: Path, enabled: bool = True, resume_step: int = 0, report_to: list[str] | None = None,
                 total_steps: int = 0):
        self.enabled = enabled
        self._reporters = None  # W&B, MLflow, ... through transformers' reporters (mf_ds/reporters.py)
        self.path = output_dir / "metrics.jsonl"
        self._writer = None
        self._resumed_from = resume_step or None  # marks the first row after a resume (mf-report draws it)
        if not enabled:
            return
        output_dir.mkdir(parents=True, exist_ok=True)
        self._truncate(resume_step)
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # tensorboard is a dependency; a broken install should not stop training
            SummaryWriter = None
        if SummaryWriter is not None:
            self._writer = SummaryWriter(str(output_dir / "tensorboard"), purge_step=resume_step + 1)
        if report_to:
            from mf_ds.reporters import Reporters

            self._reporters = Reporters(report_to, output_dir, total_steps)

    def _truncate(self, step: int) -> None:
        """On resume, drop the rows of steps after the checkpoint so metrics.jsonl reads as one run."""
        if not self.path.exists():
            return
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a row torn by a kill mid-write
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
                kept.append(line)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, self.path)  # a kill here leaves the old file whole

    def record(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self._resumed_from is not None:
            row = {**row, "resumed_from": self._resumed_from}
            self._resumed_from = None
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        if self._reporters is not None:
            self._reporters.log(row)
        if self._writer is None:
            return
        step = row["step"]
        for name, value in row.items():
            if name not in ("step", "resumed_from") and isinstance(value, (int, float)):
                tag = f"eval/{name[5:]}" if name.startswith("eval_") else f"train/{name}"  # do_eval's eval_loss, ...
                self._writer.add_scalar(tag, value, step)
        for layer, stats in (row.get("moe") or {}).items():
            for name, value in stats.items():
                if isinstance(value, (int, float)):
                    self._writer.add_scalar(f"moe/layer_{layer}/{name}", value, step)

    def close(self, plots: bool = True) -> list[str]:
        """Flush TensorBoard and write the PNG report; returns the report's file names."""
        if not self.enabled:
            return []
        if self._writer is not None:
            self._writer.close()
        if self._reporters is not None:
            self._reporters.close()
        if not plots or not self.path.exists():
            return []
        from mf_ds.report import plot_run

        return list(plot_run(self.path.parent))
