"""How a refusal reads under a launcher: once, from rank 0, in the words of the command that was run.

Under `deepspeed mf_ds/train.py` every rank translates the same YAML and meets the same refusal: printed by each it
came once per rank among the launcher's own lines. A refusal of the input (ConfigError, DataError: the same YAML and
data on every rank) is printed by rank 0 only; one that may be a rank's own (a checkpoint shard, a lost peer) by the
rank that met it. mf-translate's `--world-size` is the launcher's number of ranks here (train.py takes no such
flag): the line says so.
"""

from __future__ import annotations

import os

from translators.errors import ConfigError


def error_line(prog: str, exc: BaseException) -> str | None:
    """The one line this rank prints for `exc`, or None where rank 0 says it."""
    from mf_ds.data import DataError

    rank = int(os.environ.get("RANK", "0") or 0)
    if rank != 0 and isinstance(exc, (ConfigError, DataError)):
        return None
    text = (str(exc).splitlines() or [type(exc).__name__])[0]
    if isinstance(exc, ConfigError) and exc.path == "--world-size":
        world = os.environ.get("WORLD_SIZE", "1")
        text = f"the {world} ranks the launcher started{text[len('--world-size'):]}"
    return f"{prog}: error: {text}"
