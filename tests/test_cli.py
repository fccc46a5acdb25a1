"""The `soapflow` command: --json keys that scripts rely on, the training setup flags, and one-line errors on
bad input."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from search.baselines import BASELINES, dp
from soap.files import write_json
from soap.setup import TrainSetup
from soap.strategy import save_strategy
from soap.topology import load_topology
from soapflow.api import capture_model
from soapflow.cli import build_parser, main, train_setup

SETUP_COMMANDS = (["simulate", "mlp", "-t", "cpu-2", "-s", "dp"], ["optimize", "mlp", "-t", "cpu-2"],
                  ["compare", "mlp", "-t", "cpu-2"], ["run", "mlp", "-s", "dp"], ["calibrate"],
                  ["validate", "mlp", "-t", "cpu-2"])

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
    assert doc["setup"] == TrainSetup().to_dict()
    # per device, per kind: tp exchanges activations (all-to-all), and no parameter is replicated
    assert len(doc["collectives"]) == 2
    for device in doc["collectives"]:
        assert set(device) == {"all_to_all"} and device["all_to_all"]["count"] > 0
        assert set(device["all_to_all"]) == {"count", "bytes"}


def test_simulating_a_strategy_that_does_not_fit_says_which_device_needs_what(capsys):
    """resnet101 at batch 4096 placed layer-wise on k80-16x4 needs more than a K80 die holds."""
    code, out, err = run_cli(capsys, "simulate", "resnet101", "--batch", "4096", "-t", "k80-16x4", "-s", "mp")
    assert code == 0, err
    assert "INFEASIBLE: out of memory" in out
    lines = [line for line in out.splitlines() if line.startswith("device ")]
    capacity = load_topology("k80-16x4").devices[0].memory_bytes / 2**30
    assert lines and all(" needs " in line and f" but holds {capacity:.1f} GiB" in line for line in lines), out


def test_simulate_collectives_of_data_parallel_are_the_gradient_all_reduces(capsys):
    """The mlp's two weighted layers hold 16 MiB each. Buckets fill in backward order and close once they
    hold the cap, the first at 1 MiB (as DDP's): the last layer alone closes it, the first layer fills the
    second; with 64 MiB buckets the same; with 0.5 MiB buckets each layer closes its own."""
    params = 8_393_728 * 4  # bytes of the mlp's float32 parameters
    for bucket_mb, count in (("25", 2), ("64", 2), ("0.5", 2)):
        doc = run_json(capsys, "simulate", "mlp", "-t", "cpu-2", "-s", "dp", "--bucket-mb", bucket_mb)
        assert doc["collectives"] == [{"all_reduce": {"count": count, "bytes": params}}] * 2


@pytest.mark.parametrize("argv", SETUP_COMMANDS)
def test_every_stage_command_takes_the_setup_flags(argv):
    args = build_parser().parse_args(argv)
    assert train_setup(args) == TrainSetup()  # the defaults are TrainSetup's own
    flags = ["--optimizer", "adamw", "--lr", "0.001", "--momentum", "0", "--weight-decay", "0.01",
             "--bucket-mb", "4", "--precision", "fp32"]
    args = build_parser().parse_args([*argv, *flags])
    with pytest.warns(UserWarning, match="--momentum is SGD's"):  # (AdamW does not read it)
        assert train_setup(args) == TrainSetup(optimizer="adamw", lr=0.001, momentum=0.0, weight_decay=0.01,
                                               bucket_mb=4.0, precision="fp32")


@pytest.mark.parametrize("argv", SETUP_COMMANDS)
@pytest.mark.parametrize(("flags", "message"), [
    (["--lr", "-1"], "lr must be positive, got -1.0"),
    (["--optimizer", "adam"], "unknown optimizer 'adam'"),
    (["--precision", "fp8"], "unknown precision 'fp8'"),
    (["--schedule", "interleaved"], "unknown schedule 'interleaved'; known: gpipe, 1f1b"),
    (["--momentum", "1.5"], "momentum must be in [0, 1), got 1.5"),
    (["--bucket-mb", "0"], "bucket_mb must be positive"),
])
def test_a_bad_setup_value_is_one_line(capsys, argv, flags, message):
    code, out, err = run_cli(capsys, *argv, *flags)
    lines = err.strip().splitlines()
    assert code != 0 and out == ""
    assert len(lines) == 1 and lines[0].startswith("soapflow: error:") and message in lines[0], err


def test_the_setup_reaches_the_simulation(capsys):
    """AdamW keeps two state tensors per parameter where momentum SGD keeps one: more memory, a slower update."""
    sgd = run_json(capsys, "simulate", "mlp", "-t", "p100-1x4", "-s", "dp")
    adamw = run_json(capsys, "simulate", "mlp", "-t", "p100-1x4", "-s", "dp", "--optimizer", "adamw")
    assert adamw["setup"]["optimizer"] == "adamw"
    params = 8_393_728 * 4
    assert [a - b for a, b in zip(adamw["peak_memory_bytes"], sgd["peak_memory_bytes"], strict=True)] == [params] * 4
    assert adamw["iteration_time_ms"] > sgd["iteration_time_ms"]


def test_a_strategy_file_found_for_another_setup_warns_in_one_line(capsys, tmp_path):
    _, graph = capture_model("mlp")
    path = tmp_path / "s.json"
    save_strategy(path, dp(graph, load_topology("cpu-2")), graph, topology="cpu-2", num_devices=2,
                  setup=TrainSetup())
    code, out, err = run_cli(capsys, "simulate", "mlp", "-t", "cpu-2", "-s", str(path), "--json")
    assert code == 0 and err == ""
    code, out, err = run_cli(capsys, "simulate", "mlp", "-t", "cpu-2", "-s", str(path), "--optimizer", "adamw",
                             "--json")
    lines = err.strip().splitlines()
    assert code == 0 and json.loads(out)["feasible"]
    assert len(lines) == 1 and lines[0].startswith("soapflow: warning:"), err
    assert "different training setup" in lines[0] and "optimizer 'sgd' in the file, 'adamw' here" in lines[0]


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
    (["capture", f"{USER_MODEL}:build:extra"], "has 2 colons; expected one, as in path/to/file.py:function"),
    (["capture", "mlp", "--batch", "0"], "--batch must be positive"),
    (["topology", "p100-4"], "p100-4"),
    (["topology", "tpu-2x2"], "tpu-2x2"),
    (["simulate", "mlp", "-t", "cpu-2", "-s", "nope"], "neither a baseline"),
    (["simulate", "mlp", "-t", "cpu-3", "-s", "dp"], "dp needs the batch"),
    (["optimize", "mlp", "-t", "cpu-2", "--budget", "0"], "--budget must be > 0"),
    (["optimize", "mlp", "-t", "cpu-2", "--budget", "-5"], "--budget must be > 0"),
    (["optimize", "no_such_model", "-t", "cpu-2", "--budget", "1"], "neither a zoo model"),
    (["optimize", "mlp", "-t", "tpu-2x2", "--budget", "1"], "tpu-2x2"),
    (["optimize", "mlp", "-t", "cpu-2", "--jobs", "0"], "--jobs must be at least 1"),
    (["optimize", "mlp", "-t", "cpu-2", "--confirm-runs", "-1"], "--confirm-runs must be >= 0"),
    (["optimize", "mlp", "-t", "p100-1x2", "--confirm-runs", "2", "--proposals", "5"], "--confirm-runs trains the"),
    (["compare", "mlp", "-t", "p100-4x4", "--measure"], "cpu-N"),
    (["compare", "mlp", "-t", "cpu-2", "-s", "nope"], "neither a baseline"),
    (["run", "mlp", "-s", "dp", "--steps", "0"], "--steps must be at least 1"),
    (["run", "mlp", "-s", "dp", "--resume"], "--resume needs --checkpoint-dir"),
    (["run", "mlp", "-s", "dp", "--checkpoint-every", "2"], "needs --checkpoint-dir"),
    (["run", "mlp", "-s", "dp", "--nproc", "0"], "--nproc must be positive"),
    (["run", "mlp", "-s", "dp", "--backend", "nccl"], "nccl"),
    (["run", "no_such_model", "-s", "dp"], "neither a zoo model"),
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
    ('{"format": "soapflow.strategy/1", "ops": {"layers.0": {"devices": [0, 1]}}}',
     "op 'layers.0' lists 2 devices but no degrees"),
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


def test_strategy_file_with_a_split_the_op_kind_refuses(capsys, tmp_path):
    text = json.dumps({"format": "soapflow.strategy/1",
                       "ops": {"cumsum": {"degrees": {"sample": 2}, "devices": [0, 1]}}})
    code, _, err = run_cli(capsys, "simulate", f"{USER_MODEL}:build", "--batch", "2", "-t", "cpu-2",
                           "-s", _bad_strategy(tmp_path, text))
    lines = err.strip().splitlines()
    assert code != 0 and len(lines) == 1 and "cumsum" in lines[0] and "sample" in lines[0], err


def test_optimize_json_keys_and_strategy_file(capsys, tmp_path):
    out = tmp_path / "best.json"
    doc = run_json(capsys, "optimize", "mlp", "--batch", "8", "-t", "cpu-2", "--budget", "20",
                   "--proposals", "200", "-o", str(out), "--lr", "0.05")
    assert {"best", "baselines", "speedup_vs_dp", "num_proposals", "proposals_per_s", "elapsed_s",
            "history"} <= set(doc)
    assert doc["best"]["strategy_file"] == str(out) and set(doc["baselines"]) == {"dp", "mp", "tp", "expert", "fsdp"}
    assert doc["best"]["iteration_time_ms"] <= min(ms for ms in doc["baselines"].values() if ms is not None)
    assert json.loads(out.read_text())["setup"] == doc["setup"] == TrainSetup(lr=0.05).to_dict()
    # The written file is a strategy that simulates to the reported time.
    sim = run_json(capsys, "simulate", "mlp", "--batch", "8", "-t", "cpu-2", "-s", str(out), "--lr", "0.05")
    assert sim["iteration_time_ms"] == pytest.approx(doc["best"]["iteration_time_ms"], rel=1e-9)


def test_compare_json_rows(capsys):
    doc = run_json(capsys, "compare", "mlp", "--batch", "8", "-t", "cpu-2", "-s", "tp")
    rows = {r["strategy"]: r for r in doc["rows"]}
    assert [r["strategy"] for r in doc["rows"]] == ["dp", "mp", "tp", "expert", "fsdp"]  # baselines always, once
    for r in rows.values():
        assert {"strategy", "simulated_ms", "measured_ms", "error", "speedup_vs_dp"} <= set(r)
        assert r["simulated_ms"] > 0 and r["measured_ms"] is None
    assert rows["dp"]["speedup_vs_dp"] == pytest.approx(1.0)


def test_run_json_verifies_tensor_parallel_training(capsys):
    doc = run_json(capsys, "run", "mlp", "--batch", "8", "-s", "tp", "--steps", "2", "--verify")
    assert len(doc["losses"]) == 2 and len(doc["step_time_ms"]) == 2
    assert doc["verify"]["passed"] and doc["verify"]["max_loss_rel_diff"] <= doc["verify"]["tolerance"]["loss_rtol"]
    # what runs is what the simulator lowered: the same collectives on every rank
    sim = run_json(capsys, "simulate", "mlp", "--batch", "8", "-t", "cpu-2", "-s", "tp")
    assert doc["collectives"] == sim["collectives"]


def test_run_prints_the_collectives_table(capsys):
    code, out, err = run_cli(capsys, "run", "mlp", "--batch", "8", "-s", "dp", "--steps", "1", "--optimizer",
                             "adamw", "--lr", "0.001")
    assert code == 0, err
    assert "collectives of the last step:" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:2] in (["0", "all_reduce"],
                                                                            ["1", "all_reduce"])]
    assert len(rows) == 2 and all(int(r[2]) >= 1 for r in rows)


@pytest.mark.parametrize(("argv", "message"), [
    (["calibrate", "--nproc", "1"], "--nproc must be at least 2"),
    (["calibrate", "-o", "never-written.json", "--precision", "fp16"], "recurrent op (lstm)"),
    (["validate", "mlp", "-t", "p100-4x4"], "cpu-N"),
    (["validate", "mlp", "-t", "cpu-2", "--strategies", "0"], "must be positive"),
    (["validate", "no_such_model", "-t", "cpu-2", "--strategies", "2"], "neither a zoo model"),
])
def test_calibrate_and_validate_bad_input_one_line(capsys, argv, message):
    code, _, err = run_cli(capsys, *argv)
    lines = err.strip().splitlines()
    assert code != 0 and len(lines) == 1 and lines[0].startswith("soapflow: error:"), err
    assert message in lines[0], err


def test_a_precision_a_device_does_not_run_is_one_line(capsys):
    code, out, err = run_cli(capsys, "simulate", "mlp", "-t", "k80-1x4", "-s", "dp", "--precision", "fp16")
    lines = err.strip().splitlines()
    assert code != 0 and out == "" and len(lines) == 1
    assert "precision fp16 computes in float16, which device 0 (k80) does not run" in lines[0], err


def test_progress_in_a_log_prints_a_line_per_stage(capsys):
    from soapflow.cli import Progress

    bar = Progress("validating")
    assert not bar.terminal  # pytest captures stderr: as a log file would
    bar({"elapsed_s": 0.5, "stage": "capture", "model": "mlp"})  # an early error stays one line
    for info in ({"stage": "capture", "model": "mlp"}, {"stage": "op parts", "model": "mlp", "done": 1},
                 {"stage": "op parts", "model": "mlp", "done": 2}, {"stage": "run", "model": "mlp"},
                 {"stage": "run", "model": "mlp", "strategy": "dp", "round": 1}):
        bar({"elapsed_s": 6.0, **info})
    bar.close()
    lines = capsys.readouterr().err.splitlines()
    assert [line.split()[2] for line in lines] == ["stage=capture", "stage=op", "stage=run", "stage=run"]
    assert all(line.startswith("validating") for line in lines) and "strategy=dp" in lines[-1]
    quiet = Progress("validating", enabled=False)  # --json
    quiet({"elapsed_s": 6.0, "stage": "capture"})
    assert capsys.readouterr().err == ""


def test_a_failed_verify_fails_the_command(capsys):
    # a learning rate that blows the weights up to inf and NaN: nothing can match the reference
    code, out, err = run_cli(capsys, "run", "mlp", "--batch", "8", "-s", "dp", "--steps", "3", "--lr", "1e8",
                             "--verify")
    assert code == 1
    assert "verify against single-process training: FAILED" in out
    assert "--verify failed" in err
    assert "the losses match" not in out  # (the AdamW note is for runs whose losses do match)


def _strategy_file(tmp_path, *, batch: int) -> str:
    """A data-parallel strategy file for the mlp at `batch` on cpu-2."""
    _, graph = capture_model("mlp", batch_size=batch)
    path = tmp_path / f"mlp-{batch}.json"
    save_strategy(path, dp(graph, load_topology("cpu-2")), graph, topology="cpu-2", num_devices=2,
                  setup=TrainSetup())
    return str(path)


def test_a_strategy_file_sets_the_batch_unless_batch_is_given_which_warns(capsys, tmp_path):
    default = capture_model("mlp")[0].batch_size
    made_for = default // 4
    path = _strategy_file(tmp_path, batch=made_for)
    code, out, err = run_cli(capsys, "simulate", "mlp", "-t", "cpu-2", "-s", path, "--json")
    assert code == 0 and err == "" and json.loads(out)["batch_size"] == made_for
    code, out, err = run_cli(capsys, "compare", "mlp", "-t", "cpu-2", "-s", path, "--json")
    assert code == 0 and err == "" and json.loads(out)["batch_size"] == made_for
    code, out, err = run_cli(capsys, "simulate", "mlp", "-t", "cpu-2", "-s", path, "--batch", str(default), "--json")
    lines = err.strip().splitlines()
    assert code == 0 and json.loads(out)["batch_size"] == default
    assert len(lines) == 1 and lines[0].startswith("soapflow: warning:"), err
    assert f"made for batch {made_for}, not {default}" in lines[0]
    other = _strategy_file(tmp_path, batch=made_for * 2)
    code, _, err = run_cli(capsys, "compare", "mlp", "-t", "cpu-2", "-s", path, "-s", other)
    assert code == 1 and "different batch sizes" in err and "pass --batch" in err, err


def test_run_takes_the_batch_of_the_strategy_file_and_counts_processes(capsys, tmp_path):
    made_for = capture_model("mlp")[0].batch_size // 8
    code, out, err = run_cli(capsys, "run", "mlp", "-s", _strategy_file(tmp_path, batch=made_for), "--nproc", "3",
                             "--steps", "1", "--json")
    assert code == 0, err
    assert json.loads(out)["batch_size"] == made_for
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "was made for 2 devices, this run has 3 processes" in lines[0], err


def test_the_help_of_the_commands_that_take_strategies(capsys):
    for command in ("simulate", "run"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert all(f" {name}," in text or f" {name} " in text for name in BASELINES), text
        assert "hybrid:" in text and "(default: the strategy file's, else the model's)" in text


def test_an_output_that_cannot_be_written_fails_before_the_work(capsys, tmp_path):
    blocker = tmp_path / "afile"
    blocker.write_text("")
    target = blocker / "best.json"
    code, _, err = run_cli(capsys, "optimize", "mlp", "-t", "cpu-2", "--budget", "1", "--proposals", "1",
                           "-o", str(target))
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith("soapflow: error: -o/--output"), err
    assert f"{str(blocker)!r} is not a directory" in lines[0]


def test_a_failed_write_names_the_file_asked_for(tmp_path, monkeypatch):
    def refuse(src, dst):
        raise PermissionError(errno.EACCES, "Permission denied", src)

    monkeypatch.setattr(os, "replace", refuse)
    target = tmp_path / "out.json"
    with pytest.raises(PermissionError) as info:
        write_json(target, {})
    assert str(target) in str(info.value) and ".tmp" not in str(info.value)
    assert list(tmp_path.iterdir()) == []  # no temporary file left behind


def test_model_file_that_is_a_directory_and_extra_arguments(capsys, tmp_path):
    folder = tmp_path / "models.py"
    folder.mkdir()
    code, _, err = run_cli(capsys, "capture", f"{folder}:build")
    assert code == 1 and f"model file {str(folder)!r} does not exist: it is a directory" in err, err
    with pytest.raises(SystemExit) as info:
        main(["capture", "mlp", "--json", "extra"])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert err.startswith("usage: soapflow capture") and "unrecognized arguments: extra" in err, err


def test_an_adamw_verify_reports_its_gradients_and_why_parameters_are_not_checked(capsys, monkeypatch):
    import soapflow.runner

    tol = {"loss_rtol": 1e-5, "rtol": 1e-4, "atol": 1e-6}
    verify = {"passed": True, "max_loss_rel_diff": 1e-7, "max_param_rel_diff": 0.5, "max_param_abs_diff": 1e-3,
              "worst_param": "attn.k.bias", "params_checked": False, "max_grad_rel_diff": 2e-7,
              "worst_grad": "fc.weight", "tolerance": tol, "tolerance_row": "float32", "nan_params": [],
              "params_not_held": []}
    out = {"model": "mlp", "batch_size": 8, "strategy": "dp", "nproc": 2, "backend": "gloo", "steps": 1,
           "losses": [1.0], "step_time_ms": [1.0, 1.0], "collectives": [{}, {}], "verify": verify}
    monkeypatch.setattr(soapflow.runner, "run", lambda *a, **k: out)
    code, text, err = run_cli(capsys, "run", "mlp", "-s", "dp", "--verify", "--optimizer", "adamw")
    assert code == 0 and "verify against single-process training: passed" in text, text
    assert "first step's gradients 2e-07 (allowed 1e-04; worst fc.weight)" in text, text
    assert "parameters not checked (AdamW amplifies rounding: 0.5 of an update at most, worst attn.k.bias" in text
    verify.update(passed=False, max_grad_rel_diff=0.5)
    code, text, err = run_cli(capsys, "run", "mlp", "-s", "dp", "--verify", "--optimizer", "adamw")
    assert code == 1 and "FAILED" in text and "--verify failed" in err
    verify.update(max_grad_rel_diff=None, gradients_step=0, reference_gradients_step=1)
    code, text, err = run_cli(capsys, "run", "mlp", "-s", "dp", "--verify", "--optimizer", "adamw")
    assert ("gradients not compared (the loss scaler skipped other steps: the run first updated at step 0, the "
            "reference at step 1)") in text, text
    verify.update(params_checked=True, max_param_rel_diff=2e-5, gradients_step=0, reference_gradients_step=0)
    code, text, _ = run_cli(capsys, "run", "mlp", "-s", "dp", "--verify")
    assert "largest parameter difference 2e-05 of its update" in text and "gradients" not in text, text


def test_momentum_under_adamw_warns_and_setup_defaults_hold(capsys):
    code, _, err = run_cli(capsys, "simulate", "mlp", "--batch", "8", "-t", "cpu-2", "-s", "dp", "--optimizer", "adamw",
                           "--momentum", "0.5")
    assert code == 0 and "--momentum is SGD's: adamw does not use it" in err
    code, _, err = run_cli(capsys, "simulate", "mlp", "--batch", "8", "-t", "cpu-2", "-s", "dp", "--optimizer", "adamw")
    assert code == 0 and "momentum" not in err
    doc = run_json(capsys, "simulate", "mlp", "--batch", "8", "-t", "cpu-2", "-s", "dp")
    assert doc["setup"] == TrainSetup().to_dict()  # flags not given take the dataclass's defaults


def test_resume_says_where_it_resumed_that_nothing_is_left_and_which_setup_changed(capsys, tmp_path):
    common = ("run", "mlp", "-s", "dp", "--nproc", "1", "--batch", "8", "--checkpoint-dir", str(tmp_path))
    code, text, _ = run_cli(capsys, *common, "--steps", "1")
    assert code == 0 and "resumed" not in text
    code, text, err = run_cli(capsys, *common, "--steps", "1", "--resume")
    assert code == 0 and "resumed from" in text and "step-00000001: 1 steps done before" in text, text
    assert "nothing left to run: the checkpoint holds all 1 steps asked for" in text and "nan" not in text, text
    assert "warning" not in err, err
    code, text, err = run_cli(capsys, *common, "--steps", "2", "--resume", "--lr", "0.5")
    assert code == 0 and "   1  " in text and "nothing left" not in text, text
    assert ("warning: resuming checkpoint step-00000001, saved with another training setup: lr 0.01 there, "
            "0.5 here") in err, err
