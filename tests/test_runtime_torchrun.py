"""`soapflow run` as a torchrun job: one node with 2 processes, and 2 "nodes" (two torchrun launches on
this machine, rendezvous over loopback). Every rank runs the command; rank 0 prints the JSON result."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from runtime.launch import free_port

COMMAND = ["-m", "soapflow", "run", "mlp", "-s", "tp", "--steps", "2", "--batch", "16", "--verify", "--json"]


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def check(stdout: str) -> None:
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, stdout  # rank 0 speaks for the job
    out = json.loads(lines[0])
    assert out["nproc"] == 2 and out["rank"] == 0 and len(out["losses"]) == 2
    assert len(out["step_time_ms"]) == 2 and out["iteration_time_ms"] > 0
    assert out["verify"]["passed"], out["verify"]


@pytest.mark.slow
def test_torchrun_one_node_two_processes():
    port = free_port()
    proc = subprocess.run(torchrun("--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
                                   str(port), *COMMAND),
                          capture_output=True, text=True, timeout=240, env=env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    check(proc.stdout)


@pytest.mark.slow
def test_torchrun_two_nodes_on_one_machine():
    port = free_port()
    procs = [subprocess.Popen(torchrun("--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node),
                                       "--master-addr", "127.0.0.1", "--master-port", str(port), *COMMAND),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
             for node in (0, 1)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=240))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], outputs[0][1][-3000:] + outputs[1][1][-3000:]
    check(outputs[0][0])
    assert not [line for line in outputs[1][0].splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_torchrun_rank_failure_is_one_line_error(tmp_path):
    """Rank 1 raises in step 1: every rank exits non-zero within the timeout, the failing rank's own
    message (`soapflow: error: rank 1: ...`) names the op."""
    port = free_port()
    proc = subprocess.run(torchrun("--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
                                   str(port), *COMMAND[:-2], "--json"),
                          capture_output=True, text=True, timeout=240,
                          env={**env(), "SOAPFLOW_TEST_FAULT": "raise:1:1"})
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "soapflow: error: rank 1: ExecutionError" in line]
    assert errors and "forward of op" in errors[0], proc.stderr[-3000:]
