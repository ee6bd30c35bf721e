"""Kill tests: a run SIGKILLed at any moment resumes from its last complete checkpoint and trains on as if never hit.

Two chains of runs share an output directory each: every run but the last is killed at a chosen moment (a test-only
hook, MF_DS_TEST_KILL_AT in mf_ds/checkpoint/native.py, lands the SIGKILL exactly inside a save; one kill is sent from
outside when `<name>.tmp/` appears) and the next one starts with --resume_training. For every kill we check which
checkpoint the next run resumed from against the one that was complete at that moment, that every complete
checkpoint still matches its checksums, and at the end that metrics.jsonl and the weights equal an uninterrupted
run's. Chain B also stops once by SIGTERM, which saves a checkpoint and exits 0 (MindFormers' graceful exit).

The two chains and the reference run go in parallel threads (each run is a subprocess of ~5-9 s, mostly start-up).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mf_ds import run_lock
from mf_ds.checkpoint import native
from tests.conftest import CONFIGS, QUIET_CPU_ENV, ROOT

STEPS = 8
# Small and fast: one rank, micro batch 1 x GA 2 (so a kill can land between the micro batches), 32 tokens.
ARGS = ["--max_steps", str(STEPS),
        "--set", "callbacks=[{type: MFLossMonitor}, {type: CheckpointMonitor, prefix: t, save_checkpoint_steps: 2, "
                 "keep_checkpoint_max: 2}]",
        "--set", "runner_config.batch_size=1", "--set", "runner_config.gradient_accumulation_steps=2",
        "--set", "parallel_config.data_parallel=1", "--set", "model.model_config.seq_length=32",
        "--set", "recompute_config.recompute=False"]
ENV = QUIET_CPU_ENV


@dataclass
class Kill:
    """How one run of a chain ends, and the step of the checkpoint the next run must resume from (None: none)."""

    name: str
    hook: str | None = None        # MF_DS_TEST_KILL_AT
    tmp_step: int | None = None    # SIGKILL from outside as soon as t-step<N>.tmp/ exists
    term_after: int | None = None  # SIGTERM once metrics.jsonl holds this many rows
    expect: int | None = None      # resume step the moment implies; None with tmp_step: whatever was complete
    completed: int | None = None   # the save `latest` already named, which the next run completes and resumes from


CHAIN_A = [
    Kill("between the micro batches of step 3", hook="step.backward@3", expect=2),
    Kill("after the engine state of save 4", hook="save.engine@4", expect=2),
    Kill("after the HF weights of save 4", hook="save.weights@4", expect=2),
    Kill("after the checksums of save 4", hook="save.manifest@4", expect=2),
    Kill("after trainer_state.json of save 4", hook="save.state@4", expect=2),
    Kill("after `latest` names save 4, before its rename", hook="save.latest@4", expect=2, completed=4),
]
CHAIN_B = [
    Kill("after the rename of save 2, before pruning", hook="save.rename@2", expect=2),
    Kill("while resuming, after the engine state is loaded", hook="load.engine@2", expect=2),
    Kill("after the update of step 3, before its metrics", hook="step.update@3", expect=2),
    Kill("after the metrics of step 4, before its save", hook="step.record@4", expect=2),
    Kill("from outside, while save 4 is being written", tmp_step=4),
    Kill("SIGTERM during step 6", term_after=5),
]
KILLS = [(chain, i) for chain, kills in (("A", CHAIN_A), ("B", CHAIN_B)) for i in range(len(kills))]


@dataclass
class Run:
    kill: Kill | None
    returncode: int
    stderr: str
    complete: int | None = None  # newest complete checkpoint after the run ended
    named: int | None = None  # the step of a whole t-step<N>.tmp/ that `latest` names (the next run completes it)
    damaged: list[str] = field(default_factory=list)  # complete checkpoints that no longer verify


def _start(out: Path, resume: bool, env: dict) -> tuple[subprocess.Popen, Path]:
    log = out.parent / f"{out.name}-{time.monotonic_ns()}.log"
    cmd = [sys.executable, "-m", "mf_ds.cli", str(CONFIGS / "tiny_llama.yaml"), "--output_dir", str(out), *ARGS]
    if resume:
        cmd.append("--resume_training")
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=f)
    return proc, log


def _wait_for(proc: subprocess.Popen, ready, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, "the run ended before the moment to signal it"
        assert time.monotonic() < deadline, "the moment to signal the run never came"
        time.sleep(0.002)


def _newest_complete(root: Path) -> tuple[int | None, list[str]]:
    """The oracle: the highest step whose directory holds trainer_state.json, and which complete ones fail
    their checksums (there must be none)."""
    done = native.complete(root)
    damaged = [f"{p.name}: {problem}" for p in done if (problem := native.verify(p))]
    return (max(int(p.name.split("-step")[1]) for p in done) if done else None), damaged


def _run(out: Path, kill: Kill | None, resume: bool) -> Run:
    env = dict(ENV, **({"MF_DS_TEST_KILL_AT": kill.hook} if kill and kill.hook else {}))
    proc, log = _start(out, resume, env)
    if kill and kill.tmp_step is not None:
        _wait_for(proc, lambda: (out / "checkpoint" / f"t-step{kill.tmp_step}.tmp").exists())
        proc.send_signal(signal.SIGKILL)
    elif kill and kill.term_after is not None:
        metrics = out / "metrics.jsonl"
        _wait_for(proc, lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= kill.term_after)
        proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=300)
    complete, damaged = _newest_complete(out / "checkpoint")
    return Run(kill, proc.returncode, log.read_text(), complete=complete, damaged=damaged,
               named=_named(out / "checkpoint"))


def _named(root: Path) -> int | None:
    """The oracle of durable.py recover: `latest` names t-step<N>, which is absent, and t-step<N>.tmp/ holds
    checksums.json (written last): that save is complete but for its rename."""
    name = (root / native.LATEST).read_text().strip() if (root / native.LATEST).is_file() else ""
    whole = name and not (root / name).exists() and (root / f"{name}.tmp" / native.CHECKSUMS).is_file()
    return int(name.split("-step")[1]) if whole else None


def _chain(out: Path, kills: list[Kill]) -> list[Run]:
    runs = []
    for i, kill in enumerate([*kills, None]):
        runs.append(_run(out, kill, resume=i > 0))
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[Run]]:
    base = tmp_path_factory.mktemp("kill")
    with ThreadPoolExecutor(3) as pool:
        futures = {"ref": pool.submit(_run, base / "ref", None, False),
                   "A": pool.submit(_chain, base / "A", CHAIN_A),
                   "B": pool.submit(_chain, base / "B", CHAIN_B)}
        results = {name: future.result() for name, future in futures.items()}
    results["ref"] = [results["ref"]]
    results["dirs"] = {name: base / name for name in ("ref", "A", "B")}
    return results


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("chain, i", KILLS, ids=[f"{c}{i}-{(CHAIN_A if c == 'A' else CHAIN_B)[i].hook or 'outside'}"
                                                 for c, i in KILLS])
def test_each_kill_resumes_from_the_last_complete_checkpoint(runs, chain, i):
    victim, successor = runs[chain][i], runs[chain][i + 1]
    kill = victim.kill
    if kill.term_after is None:
        assert victim.returncode == -signal.SIGKILL, f"{kill.name}: exit {victim.returncode}\n{victim.stderr[-3000:]}"
    assert not victim.damaged, f"{kill.name}: a complete checkpoint fails its checksums: {victim.damaged}"
    if kill.expect is not None:
        assert victim.complete == kill.expect, f"{kill.name}: newest complete checkpoint {victim.complete}"
    if successor.kill and successor.kill.hook and successor.kill.hook.startswith("load."):
        return  # killed before it could say where it resumed from; its own successor is checked instead
    root = runs["dirs"][chain] / "checkpoint"
    assert victim.named == kill.completed or kill.completed is None, f"{kill.name}: {victim.named}"
    step = victim.named or victim.complete  # mf_ds/checkpoint/durable.py recover completes a whole save `latest` names
    expected = f"mf-ds: resumed from {root / f't-step{step}'} at step {step}"
    assert expected in successor.stderr, f"after '{kill.name}':\n{successor.stderr[-3000:]}"


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(runs):
    term = runs["B"][-2]
    assert term.returncode == 0, term.stderr[-3000:]
    assert "stopped by a signal at step" in term.stderr and "Traceback" not in term.stderr
    stopped = int(term.stderr.split("stopped by a signal at step ")[1].split()[0])
    assert stopped in (5, 6) and term.complete == stopped  # the step in flight when SIGTERM came, saved


@pytest.mark.parametrize("chain", ["A", "B"])
def test_losses_after_the_kills_equal_an_uninterrupted_run(runs, chain):
    last = runs[chain][-1]
    assert last.returncode == 0, last.stderr[-3000:]
    dirs = runs["dirs"]
    ref, got = _metrics(dirs["ref"]), _metrics(dirs[chain])
    assert [m["step"] for m in got] == list(range(1, STEPS + 1))
    for key in ("loss", "lr", "grad_norm", "skipped_steps"):  # bit for bit: one thread, same data, same RNG
        assert [m[key] for m in got] == [m[key] for m in ref], key
    a = load_file(str(dirs["ref"] / "checkpoint" / f"t-step{STEPS}" / "model.safetensors"))
    b = load_file(str(dirs[chain] / "checkpoint" / f"t-step{STEPS}" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def test_a_fresh_run_never_overwrites_an_earlier_runs_checkpoints(runs):
    out = runs["dirs"]["ref"]
    files = [p for p in out.rglob("*") if p.is_file() and p.suffix != ".log" and p.name != run_lock.LOCK]
    before = {p: p.read_bytes() for p in files}
    proc, log = _start(out, resume=False, env=ENV)
    assert proc.wait(timeout=300) == 2
    assert "holds checkpoints of an earlier run" in log.read_text().strip().splitlines()[-1]
    assert {p: p.read_bytes() for p in files} == before
