"""`mf-report OUTPUT_DIR`: PNG plots of a run from its metrics.jsonl (also written at the end of training).

    loss.png        loss over steps (and the eval loss where do_eval evaluated), learning rate on a second axis
    throughput.png  tokens/s over steps (the axis from 0)
    grad_norm.png   the global gradient norm over steps (before clipping)
    drop_rate.png   MoE runs: measured drop rate per MoE layer over steps (MindFormers' estimate dashed, where
                    MindFormers has one)
    expert_load.png MoE runs: mean expert load per layer as a heat map (1/E is balanced)

Each plot over steps marks where the run was resumed (a dotted line at the first step after it: the row the monitor
marks `resumed_from`). `plot_run()` returns the data it plotted, so tests check what is drawn, not only that files
exist.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; no display is needed or wanted
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

REPORT_DIR = "report"


class ReportError(ValueError):
    """metrics.jsonl missing or unreadable, named by path."""


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise ReportError(f"{path}: no such file (a run writes it into its output_dir)")
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ReportError(f"{path}:{n}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict) or "step" not in row:
            raise ReportError(f"{path}:{n}: expected an object with a 'step'")
        rows.append(row)
    if not rows:
        raise ReportError(f"{path}: empty")
    return rows


def _moe_layers(rows: list[dict]) -> list[str]:
    """Global MoE layer ids found in the rows (`moe: {"3": {...}}`), in numeric order."""
    layers = {key for row in rows for key in (row.get("moe") or {})}
    return sorted(layers, key=int)


def plot_run(output_dir: str | Path) -> dict[str, Any]:
    """Write the PNGs into <output_dir>/report/ and return {file: plotted data}."""
    output_dir = Path(output_dir)
    rows = read_metrics(output_dir / "metrics.jsonl")
    out = output_dir / REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)
    steps = [row["step"] for row in rows]
    resumes = [row["step"] for row in rows if "resumed_from" in row]
    plotted: dict[str, Any] = {}

    def mark_resumes(ax) -> None:
        for i, step in enumerate(resumes):
            ax.axvline(step, color="grey", linestyle=":", label="resumed" if i == 0 else None)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    loss = [row.get("loss") for row in rows]
    ax.plot(steps, loss, color="tab:blue", label="loss")
    # do_eval (mf_ds/evaluation.py): the eval loss at the steps evaluated
    evaluated = [(row["step"], row["eval_loss"]) for row in rows if row.get("eval_loss") is not None]
    if evaluated:
        ax.plot(*zip(*evaluated, strict=True), "o--", color="tab:red", label="eval loss")
        ax.legend(loc="upper right")
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("loss", color="tab:blue")
    mark_resumes(ax)
    lr_ax = ax.twinx()
    lr = [row.get("lr") for row in rows]
    lr_ax.plot(steps, lr, color="tab:orange", label="learning rate")
    lr_ax.set_ylabel("learning rate", color="tab:orange")
    ax.set_title("loss and learning rate")
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=100)
    plt.close(fig)
    plotted["loss.png"] = {"step": steps, "loss": loss, "lr": lr, "resumes": resumes,
                           **({"eval_step": [e[0] for e in evaluated], "eval_loss": [e[1] for e in evaluated]}
                              if evaluated else {})}

    fig, ax = plt.subplots(figsize=(8, 4.5))
    rate = [row.get("tokens_per_s") for row in rows]
    ax.plot(steps, rate, color="tab:green")
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("tokens / s")
    ax.set_ylim(bottom=0)  # from 0: a dip reads as its real size
    mark_resumes(ax)
    ax.set_title("throughput")
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=100)
    plotted["throughput.png"] = {"step": steps, "tokens_per_s": rate, "ylim": [float(v) for v in ax.get_ylim()],
                                 "resumes": resumes}
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    norm = [row.get("grad_norm") for row in rows]
    ax.plot(steps, [float("nan") if v is None else v for v in norm], color="tab:red")
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("global gradient norm")
    ax.set_ylim(bottom=0)
    mark_resumes(ax)
    ax.set_title("gradient norm (before clipping)")
    fig.tight_layout()
    fig.savefig(out / "grad_norm.png", dpi=100)
    plt.close(fig)
    plotted["grad_norm.png"] = {"step": steps, "grad_norm": norm, "resumes": resumes}

    layers = _moe_layers(rows)
    if layers:
        plotted.update(_plot_moe(rows, steps, layers, out))
    return plotted


def _plot_moe(rows: list[dict], steps: list, layers: list[str], out: Path) -> dict[str, Any]:
    """drop_rate.png and expert_load.png of an MoE run; returns {file: plotted data}."""
    plotted: dict[str, Any] = {}
    fig, ax = plt.subplots(figsize=(8, 4.5))
    drop: dict[str, list] = {}
    estimates: dict[str, list] = {}
    for layer in layers:
        measured = [(row.get("moe") or {}).get(layer, {}).get("drop_rate") for row in rows]
        estimate = [(row.get("moe") or {}).get(layer, {}).get("drop_rate_estimate") for row in rows]
        line = ax.plot(steps, measured, label=f"layer {layer}")[0]
        if any(v is not None for v in estimate):  # MindFormers prints one only for MoEV2 with an expert loss
            ax.plot(steps, [float("nan") if v is None else v for v in estimate], linestyle="--",
                    color=line.get_color(), alpha=0.6)
            estimates[layer] = estimate
        drop[layer] = measured
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("dropped (token, choice) pairs")
    title = "MoE drop rate per layer (measured" + ("; dashed: MindFormers' estimate)" if estimates else ")")
    ax.set_title(title)
    ax.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    fig.savefig(out / "drop_rate.png", dpi=100)
    plt.close(fig)
    plotted["drop_rate.png"] = {"step": steps, "drop_rate": drop, "estimate": estimates, "title": title,
                                "xticks": [float(t) for t in ax.get_xticks()]}

    loads = []
    for layer in layers:
        per_step = [(row.get("moe") or {}).get(layer, {}).get("expert_load") for row in rows]
        per_step = [load for load in per_step if load]
        width = max(len(load) for load in per_step) if per_step else 0
        loads.append([sum(load[e] for load in per_step) / len(per_step) for e in range(width)] if per_step
                     else [])
    width = max((len(row) for row in loads), default=0)
    grid = [row + [float("nan")] * (width - len(row)) for row in loads]
    fig, ax = plt.subplots(figsize=(max(6, width * 0.3), max(3, len(layers) * 0.4)))
    image = ax.imshow(grid, aspect="auto", cmap="viridis")
    ax.set_yticks(range(len(layers)), [f"layer {layer}" for layer in layers])
    ax.set_xlabel("expert")
    ax.set_title("mean expert load (fraction of routed pairs)")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(out / "expert_load.png", dpi=100)
    plt.close(fig)
    plotted["expert_load.png"] = {"layers": layers, "load": grid}
    return plotted


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mf-report", description="Plot a run's metrics.jsonl as PNGs.")
    p.add_argument("output_dir", help="the run's output_dir (holds metrics.jsonl)")
    args = p.parse_args(argv)
    try:
        plotted = plot_run(args.output_dir)
    except ReportError as exc:
        print(f"mf-report: error: {exc}", file=sys.stderr)
        return 2
    for name in plotted:
        print(Path(args.output_dir) / REPORT_DIR / name)
    return 0


def cli() -> None:
    sys.exit(main())


if __name__ == "__main__":
    cli()
