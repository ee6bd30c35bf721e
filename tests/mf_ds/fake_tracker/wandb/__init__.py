"""A stand-in for the `wandb` package (tests only; put its folder on PYTHONPATH): what transformers' WandbCallback
calls, each call written as a JSON line to $FAKE_WANDB_LOG so a test reads what was reported."""

import json
import os
from unittest.mock import MagicMock

run = None  # transformers checks hasattr(wandb, "run") to call it installed
config = MagicMock()


def _write(entry: dict) -> None:
    with open(os.environ["FAKE_WANDB_LOG"], "a", encoding="utf-8") as f:
        f.write(json.dumps(entry, default=str) + "\n")


def init(*args, **kwargs):
    global run
    run = MagicMock()
    _write({"init": sorted(kwargs)})
    return run


def log(data, *args, **kwargs):
    _write({"log": data})


def __getattr__(name):  # termwarn, define_metric, Settings, ...: accepted and ignored
    return MagicMock()
