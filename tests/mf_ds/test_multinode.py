"""Two machines, as far as one allows: two deepspeed launchers on localhost, one node each (`--no_ssh --num_nodes 2
--node_rank i`, docs/layout.md's recipe), train the losses of one launcher's two ranks (issue 33 item 15)."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import CONFIGS, CPU_ENV, ROOT, ds_launch, free_port

ARGS = ["--mf-config", str(CONFIGS / "tiny_llama.yaml"), "--max_steps", "3", "--set", "parallel_config.data_parallel=2"]


def losses(out) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.deepspeed
def test_two_nodes_on_localhost_equal_two_local_ranks(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")  # two "machines", one rank each
    port, out = free_port(), tmp_path / "two_nodes"  # output_dir: shared by both, as on a shared file system
    nodes = [subprocess.Popen(["deepspeed", "--hostfile", str(hostfile), "--no_ssh", "--num_nodes", "2",
                               "--node_rank", str(i), "--master_addr", "127.0.0.1", "--master_port", str(port),
                               str(ROOT / "mf_ds" / "train.py"), *ARGS, "--output_dir", str(out)],
                              cwd=ROOT, env=CPU_ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in (0, 1)]
    logs = [node.communicate(timeout=600)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], logs[0][-2000:] + logs[1][-2000:]
    assert "nnodes=2" in logs[0] and "node_rank=1" in logs[1]
    one = tmp_path / "one_node"
    # the reference: the two ranks one node's runner would start (the runner is the claim above, not here)
    proc = subprocess.run([*ds_launch(2), str(ROOT / "mf_ds" / "train.py"), *ARGS, "--output_dir", str(one)],
                          cwd=ROOT, env=CPU_ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert losses(out) == pytest.approx(losses(one), abs=1e-6) and len(losses(out)) == 3
