"""mf-report: valid PNGs whose plotted data follow metrics.jsonl."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from mf_ds.report import main, plot_run


def write_metrics(path, moe: bool, estimate: bool = True, steps: int = 10) -> list[dict]:
    rows = []
    for step in range(1, steps + 1):
        row = {"step": step, "epoch": 1, "loss": 6.0 - 0.3 * step, "lr": 1e-3 * step / 10, "grad_norm": 1.0 / step,
               "tokens_per_s": 1000.0 + step}
        if moe:
            row["moe"] = {str(layer): {"drop_rate": 0.01 * layer * step,
                                       "drop_rate_estimate": 0.02 * step if estimate else None,
                                       "expert_load": [0.5, 0.25, 0.25, 0.0] if layer == 1 else [0.25] * 4}
                          for layer in (1, 3)}
        rows.append(row)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


@pytest.mark.parametrize("moe", [False, True])
def test_plots_follow_the_metrics(tmp_path, moe):
    rows = write_metrics(tmp_path / "metrics.jsonl", moe)
    plotted = plot_run(tmp_path)
    expected = {"loss.png", "throughput.png", "grad_norm.png"} | ({"drop_rate.png", "expert_load.png"} if moe
                                                                 else set())
    assert set(plotted) == expected
    assert plotted["loss.png"]["loss"] == [r["loss"] for r in rows]
    assert plotted["loss.png"]["lr"] == [r["lr"] for r in rows]
    assert plotted["throughput.png"]["tokens_per_s"] == [r["tokens_per_s"] for r in rows]
    assert plotted["throughput.png"]["ylim"][0] == 0  # rates of 1001-1010 drawn from 0, not from 1001
    assert plotted["grad_norm.png"]["grad_norm"] == [r["grad_norm"] for r in rows]
    if moe:
        assert plotted["drop_rate.png"]["drop_rate"]["3"] == [r["moe"]["3"]["drop_rate"] for r in rows]
        assert plotted["expert_load.png"]["layers"] == ["1", "3"]
        assert plotted["expert_load.png"]["load"][0] == pytest.approx([0.5, 0.25, 0.25, 0.0])
    for name in expected:
        path = tmp_path / "report" / name
        assert path.stat().st_size > 1000
        with Image.open(path) as image:
            image.verify()
        with Image.open(path) as image:
            assert image.format == "PNG" and image.size[0] >= 400
            # not a blank canvas: a plotted line leaves more than one colour
            assert len(image.convert("RGB").getcolors(maxcolors=1 << 16) or []) > 10


@pytest.mark.parametrize("estimate", [False, True])
def test_drop_rate_plot_draws_the_estimate_only_when_there_is_one(tmp_path, estimate):
    """No MindFormers estimate (use_gmm, mcore, no expert loss): no dashed lines and a title that promises none;
    the step axis has integer ticks even for a 3-step run."""
    rows = write_metrics(tmp_path / "metrics.jsonl", moe=True, estimate=estimate, steps=3)
    plotted = plot_run(tmp_path)["drop_rate.png"]
    assert ("dashed" in plotted["title"]) == estimate
    assert plotted["estimate"] == ({"1": [r["moe"]["1"]["drop_rate_estimate"] for r in rows],
                                    "3": [r["moe"]["3"]["drop_rate_estimate"] for r in rows]} if estimate else {})
    assert plotted["xticks"] and all(tick == int(tick) for tick in plotted["xticks"])


def test_cli_errors(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert "metrics.jsonl: no such file" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1}\nnot json\n')
    assert main([str(tmp_path)]) == 2
    assert "metrics.jsonl:2: not JSON" in capsys.readouterr().err


def test_a_resume_is_marked(tmp_path):
    """The monitor marks the first row after a resume; every plot over steps draws it (issue 33 item 14)."""
    from mf_ds.monitor import Monitor

    rows = write_metrics(tmp_path / "metrics.jsonl", moe=False, steps=6)
    monitor = Monitor(tmp_path, resume_step=4)  # a resume from step 4: rows 5 and 6 are dropped, then written again
    for row in rows[4:]:
        monitor.record(row)
    written = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in written] == [1, 2, 3, 4, 5, 6]
    assert [r.get("resumed_from") for r in written] == [None, None, None, None, 4, None]
    plotted = monitor.close()
    assert "grad_norm.png" in plotted
    drawn = plot_run(tmp_path)
    assert drawn["loss.png"]["resumes"] == drawn["throughput.png"]["resumes"] == drawn["grad_norm.png"]["resumes"] \
        == [5]
