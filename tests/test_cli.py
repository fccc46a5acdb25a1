"""The `soapflow` command: --json keys that scripts rely on, and one-line errors on bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from soapflow.cli import main

USER_MODEL = str(Path(__file__).parent / "data" / "user_model.py")


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, *argv: str) -> dict:
    code, out, err = run_cli(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def test_models(capsys):
    doc = run_json(capsys, "models")
    names = {m["name"] for m in doc["models"]}
    assert {"mlp", "resnet50", "inception_v3", "nmt", "transformer"} <= names


def test_capture_json_keys(capsys):
    doc = run_json(capsys, "capture", "mlp", "--batch", "8")
    assert {"model", "batch_size", "fingerprint", "num_params", "total_gflops", "ops"} <= set(doc)
    assert doc["batch_size"] == 8 and doc["num_params"] == doc["module_params"] == 8_393_728
    op = doc["ops"][2]
    assert {"name", "kind", "output_shape", "num_params", "gflops", "dims"} <= set(op)
    assert doc["ops"][-1]["kind"] == "loss"


def test_capture_user_model_file(capsys):
    doc = run_json(capsys, "capture", f"{USER_MODEL}:build", "--batch", "2")
    kinds = [op["kind"] for op in doc["ops"]]
    assert "opaque" in kinds and "conv2d" in kinds and kinds[-1] == "loss"
    assert doc["num_params"] == 3 * 8 * 9 + 8 + 512 * 10 + 10


def test_capture_table(capsys):
    code, out, _ = run_cli(capsys, "capture", "mlp")
    assert code == 0 and "out_features:P" in out and "8,393,728 parameters" in out


def test_topology_json(capsys):
    doc = run_json(capsys, "topology", "p100-4x4")
    assert doc["num_devices"] == 16 and doc["num_nodes"] == 4
    assert doc["topology"]["format"] == "soapflow.topology/1"


def test_simulate_json_keys(capsys, tmp_path):
    trace = tmp_path / "trace.json"
    doc = run_json(capsys, "simulate", "mlp", "-t", "cpu-2", "-s", "tp", "--trace", str(trace))
    keys = {"iteration_time_ms", "compute_ms", "comm_ms", "sync_ms", "bytes_moved", "peak_memory_bytes",
            "feasible", "num_tasks"}
    assert keys <= set(doc)
    assert doc["iteration_time_ms"] > 0 and len(doc["peak_memory_bytes"]) == 2 and doc["feasible"]
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("ph") == "X" for e in events)


def _bad_strategy(tmp_path, text: str) -> str:
    path = tmp_path / "s.json"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(("argv", "message"), [
    (["capture", "no_such_model"], "neither a zoo model"),
    (["capture", "missing_file.py:build"], "does not exist"),
    (["capture", f"{USER_MODEL}:nope"], "has no function 'nope'"),
    (["capture", f"{USER_MODEL}:not_a_model"], "must return"),
    (["capture", "no.such.module:f"], "cannot import module"),
    (["capture", "mlp", "--batch", "0"], "--batch must be positive"),
    (["topology", "p100-4"], "p100-4"),
    (["topology", "tpu-2x2"], "tpu-2x2"),
    (["simulate", "mlp", "-t", "cpu-2", "-s", "nope"], "neither a baseline"),
    (["simulate", "mlp", "-t", "cpu-3", "-s", "dp"], "dp needs the batch"),
])
def test_bad_input_one_line(capsys, argv, message):
    code, out, err = run_cli(capsys, *argv)
    assert code != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("soapflow: error:"), err
    assert message in lines[0]


@pytest.mark.parametrize(("text", "message"), [
    ("{oops", "is not JSON"),
    ('{"format": "soapflow.strategy/7", "ops": {}}', "format 'soapflow.strategy/7'"),
    ('{"format": "soapflow.strategy/1", "ops": {"ghost": {"devices": [0]}}}', "op 'ghost' does not exist"),
    ('{"format": "soapflow.strategy/1", "ops": {"layers.0": {"degrees": {"sample": 3}, "devices": [0, 1, 2]}}}',
     "does not divide"),
    ('{"format": "soapflow.strategy/1", "ops": {"layers.0": {"degrees": {"sample": 2}, "devices": [0, 9]}}}',
     "not in the topology"),
])
def test_bad_strategy_file_one_line(capsys, tmp_path, text, message):
    code, _, err = run_cli(capsys, "simulate", "mlp", "-t", "cpu-2", "-s", _bad_strategy(tmp_path, text))
    lines = err.strip().splitlines()
    assert code != 0 and len(lines) == 1 and message in lines[0], err


@pytest.mark.parametrize(("doc", "message"), [
    ("[1,", "not JSON"),
    (json.dumps({"format": "soapflow.topology/1", "name": "x",
                 "devices": [{"id": 0, "kind": "tpu9", "node": 0}], "links": []}), "tpu9"),
    (json.dumps({"format": "soapflow.topology/1", "name": "x",
                 "devices": [{"id": 0, "kind": "v100", "node": 0}, {"id": 1, "kind": "v100", "node": 0}],
                 "links": [{"src": "gpu0", "dst": "gpu7", "kind": "nvlink", "bandwidth_gbps": 25,
                            "latency_us": 3}]}), "gpu7"),
])
def test_bad_topology_file_one_line(capsys, tmp_path, doc, message):
    path = tmp_path / "topo.json"
    path.write_text(doc)
    code, _, err = run_cli(capsys, "topology", str(path))
    lines = err.strip().splitlines()
    assert code != 0 and len(lines) == 1 and message in lines[0], err


def test_real_process_prints_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "soapflow", "capture", "missing.py:f"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr and proc.stderr.startswith("soapflow: error:")
