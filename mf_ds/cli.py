"""`mf-train CONFIG`: the main job in one process, no launcher needed (the same flags as mf_ds/train.py)."""

from __future__ import annotations

import sys


def main() -> None:
    from mf_ds.train import finish
    from mf_ds.train import main as train_main

    sys.exit(finish(train_main(sys.argv[1:], prog="mf-train", positional=True)))


if __name__ == "__main__":
    main()
