"""mf-train's progress bar: on a terminal a bar with the steps and the time left, as the HF Trainer shows; none in a
log file, where its redraws would be noise (issue 33 item 14)."""

from __future__ import annotations

import fcntl
import os
import re
import struct
import subprocess
import sys
import termios

from tests.conftest import CONFIGS, CPU_ENV, ROOT

LLAMA = str(CONFIGS / "tiny_llama.yaml")


def mf_train(tmp_path, stderr) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mf_ds.cli", LLAMA, "--output_dir", str(tmp_path),
                           "--max_steps", "3"], cwd=ROOT, env=CPU_ENV, stdout=subprocess.DEVNULL, stderr=stderr,
                          timeout=600)


def test_a_terminal_gets_a_bar_with_the_time_left(tmp_path):
    main, child = os.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 160, 0, 0))  # a 160-column terminal
    proc = mf_train(tmp_path / "tty", child)
    os.close(child)
    chunks = []
    while True:
        try:
            chunk = os.read(main, 1 << 16)
        except OSError:  # the terminal's other end is closed: all read
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(main)
    text = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == 0, text[-2000:]
    # tqdm: "3/3 [00:02<00:00, 1.2step/s, loss=..., ...]": steps done of the total, elapsed<left
    assert re.search(r"3/3 \[\d\d:\d\d<\d\d:\d\d", text), text[-2000:]
    assert "loss=" in text


def test_a_log_file_gets_no_bar(tmp_path):
    log = tmp_path / "log.txt"
    with open(log, "w") as f:
        assert mf_train(tmp_path / "file", f).returncode == 0
    text = log.read_text()
    assert "step:[    3/    3]" in text and not re.search(r"\d/3 \[\d\d:\d\d<", text)
