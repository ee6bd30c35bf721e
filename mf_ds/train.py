"""The main job: `deepspeed mf_ds/train.py --mf-config x.yaml` (any number of ranks) or `mf-train x.yaml`.

YAML -> translators.translate (at the real world size) -> Plan -> HF model + recompute plan -> DeepSpeed engine
-> steps with MindFormers' semantics -> metrics.jsonl, HF-layout checkpoints. With no GPU it takes DeepSpeed's CPU
accelerator and gloo by itself.

Exit codes: 0 trained (or stopped by SIGTERM after saving a checkpoint, as MindFormers' graceful exit does);
2 a one-line error: bad YAML, damaged checkpoint or data, a loss that stays NaN, or a rank that died or froze (the
run resumes with --resume_training from its last checkpoint); 1 a bug, with its traceback.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file by the deepspeed launcher
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

if not torch.cuda.is_available():
    # DeepSpeed picks its accelerator when it is first imported.
    os.environ.setdefault("DS_ACCELERATOR", "cpu")


def parser(prog: str = "mf_ds/train.py", positional: bool = False) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Train a MindFormers YAML run with DeepSpeed.")
    if positional:
        p.add_argument("mf_config", metavar="CONFIG", help="MindFormers YAML")
    else:
        p.add_argument("--mf-config", "--mf_config", dest="mf_config", required=True, help="MindFormers YAML")
    p.add_argument("--set", action="append", default=[], metavar="a.b.c=VALUE", help="override a YAML key")
    p.add_argument("--max_steps", type=int, help="stop after N optimizer steps (N >= 1)")
    p.add_argument("--output_dir", help="override output_dir")
    p.add_argument("--load_checkpoint", help="weights: a MindSpore .ckpt, MindFormers safetensors, an HF "
                   "safetensors directory or an mf-ds checkpoint")
    resume = p.add_mutually_exclusive_group()
    resume.add_argument("--resume_training", action="store_true",
                        help="continue from the newest checkpoint of --output_dir (an error when there is none)")
    resume.add_argument("--resume_if_any", action="store_true",
                        help="continue from the newest checkpoint of --output_dir if there is one, else start from "
                             "step 0 (for restart scripts)")
    p.add_argument("--trust_checkpoint", action="store_true",
                   help="resume from a checkpoint that has no checksums.json (one copied without it, or from an "
                        "older mf-ds); its files still load as data only, never as code")
    p.add_argument("--train_dataset_dir", help="Megatron .bin/.idx prefix or directory, or JSON-lines data")
    p.add_argument("--fused_loss", choices=("on", "off"),
                   help="the loss without the whole [tokens, vocab] logits (mf_ds.fused_loss; default: on where exact)")
    p.add_argument("--gradient_accumulation_steps", type=int, help="override the gradient accumulation")
    p.add_argument("--compile_layers", action="store_true",
                   help="torch.compile each decoder layer (the same as --set mf_ds.compile_layers=true)")
    p.add_argument("--report_to", nargs="+", metavar="NAME", help="also report each step to these trackers (wandb, "
                   "mlflow, ...: transformers' reporters, as the HF Trainer's report_to; the package must be "
                   "installed)")
    p.add_argument("--dist_timeout", type=float, metavar="SECONDS",
                   default=float(os.environ.get("MF_DS_DIST_TIMEOUT", 600)),
                   help="how long a collective waits for the other ranks before the run stops with an error "
                        "(default: $MF_DS_DIST_TIMEOUT or 600; raise it when saving a big checkpoint takes longer)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)),
                   help="set by the deepspeed launcher")
    return p


def _single_process_env() -> None:
    """mf-train runs one process without a launcher: give torch.distributed a one-rank world."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def lost_rank(exc: BaseException) -> str | None:
    """The one-line story of a collective that failed because another rank died or froze, else None."""
    import torch.distributed as dist

    text = str(exc)
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return None
    if not (isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and re.search(
            r"gloo|NCCL|Connection (reset|closed)|Timed out|Broken pipe", text))):
        return None
    detail = re.sub(r"^\[[^\]]*\]\s*", "", text.strip().splitlines()[0] if text.strip() else type(exc).__name__)
    detail = detail.split(". This is typically")[0]  # gloo's advice names the other rank's logs, as we do
    rank = dist.get_rank() if dist.is_initialized() else os.environ.get("RANK", "?")
    return (f"rank {rank}: lost contact with another rank ({detail}): it died, froze or was killed; see its log. "
            "Resume the run with --resume_training: it starts from the last complete checkpoint")


def main(argv: list[str] | None = None, prog: str = "mf_ds/train.py", positional: bool = False) -> int:
    args = parser(prog, positional).parse_args(argv)
    if args.compile_layers:
        args.set.append("mf_ds.compile_layers=true")
    stop = {"signal": None}

    def on_signal(signum, _frame):  # SIGTERM: save and exit cleanly, as MindFormers' graceful exit does
        stop["signal"] = signum

    signal.signal(signal.SIGTERM, on_signal)  # before the slow start-up, so an early SIGTERM is not fatal
    from mf_ds.checkpoint import CheckpointError
    from mf_ds.data import DataError
    from mf_ds.errors import RunError
    from translators.errors import ConfigError

    try:
        from mf_ds.startup import max_steps

        args.max_steps = max_steps(args.max_steps)  # before anything starts: 0 is refused, not read as "all"
        _single_process_env()
        from mf_ds import build_lock
        from mf_ds.loop import Trainer

        build_lock.check()  # a lock left by a killed build of DeepSpeed's ops would hold start-up forever
        with build_lock.watch():
            trainer = Trainer.from_args(args)
        trainer.fit(should_stop=lambda: stop["signal"] is not None)
        trainer.close()
    except (ConfigError, CheckpointError, RunError, DataError) as exc:
        from mf_ds.launch_errors import error_line

        line = error_line(prog, exc)  # once, from rank 0, for a refusal of the input (mf_ds/launch_errors.py)
        if line:
            print(line, file=sys.stderr)
        return 2
    except Exception as exc:
        story = lost_rank(exc)
        if story is None:
            raise
        print(f"{prog}: error: {story}", file=sys.stderr)
        return 2
    return 0


def finish(code: int) -> int:
    """The process' last step: the process group destroyed before the interpreter exits, so the backend's threads
    are joined here and not in static destructors (a gloo rank once died there after its run: "terminate called
    without an active exception"). Process entry points only: a test that runs `main` twice in one process keeps
    its group. Only after a clean run (every rank passed close()'s barrier): a rank whose peer died exits at once."""
    import torch.distributed as dist

    if code == 0 and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(finish(main()))
