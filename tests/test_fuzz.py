"""No tracebacks, ever: bad and odd input to the `soapflow` command gives one line and a non-zero exit.

Every case runs `soapflow.cli.main` in this process (a few run the real `python -m soapflow`) and checks
that stderr holds one error line (`soapflow: error: ...`, or argparse's usage error, whose last line is
the error) after at most some one-line warnings, and no traceback. The inputs: model files that return
the wrong things, strategy and topology files malformed in every field, infeasible strategies, huge
device counts, zero or negative sizes, missing files, directories given as files, and a run whose rank is
killed (the runner's test hook `SOAPFLOW_TEST_FAULT`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from soapflow.cli import main
from soapflow.runner import FAULT_ENV

# A small model (input -> fc1 -> act -> fc2 -> loss) and the ways a model file goes wrong.
MODELS = '''
import torch
from torch import nn


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(32, 16)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def good(batch_size: int = 8):
    return Tiny(), (torch.randn(batch_size, 16), torch.randn(batch_size, 16))


def not_a_tuple(batch_size: int = 8):
    return [Tiny(), (torch.randn(batch_size, 16), torch.randn(batch_size, 16))]


def four_things(batch_size: int = 8):
    return Tiny(), torch.randn(batch_size, 16), torch.randn(batch_size, 16), None


def not_a_module(batch_size: int = 8):
    return "Tiny", (torch.randn(batch_size, 16), torch.randn(batch_size, 16))


def example_not_a_pair(batch_size: int = 8):
    return Tiny(), torch.randn(batch_size, 16)


def inputs_not_tensors(batch_size: int = 8):
    return Tiny(), ([[1.0] * 16] * batch_size, torch.randn(batch_size, 16))


def no_inputs(batch_size: int = 8):
    return Tiny(), ((), torch.randn(batch_size, 16))


def scalar_input(batch_size: int = 8):
    return Tiny(), (torch.tensor(1.0), torch.randn(batch_size, 16))


def wrong_batch(batch_size: int = 8):
    return Tiny(), (torch.randn(batch_size + 1, 16), torch.randn(batch_size + 1, 16))


def empty_batch(batch_size: int = 8):
    return Tiny(), (torch.randn(0, 16), torch.randn(0, 16))


def target_wrong_shape(batch_size: int = 8):
    return Tiny(), (torch.randn(batch_size, 16), torch.randn(batch_size, 3))


def integer_inputs(batch_size: int = 8):
    return Tiny(), (torch.ones(batch_size, 16, dtype=torch.int64), torch.randn(batch_size, 16))


def complex_inputs(batch_size: int = 8):
    return Tiny(), (torch.randn(batch_size, 16, dtype=torch.complex64), torch.randn(batch_size, 16))


def raises(batch_size: int = 8):
    raise RuntimeError("the model function raised")


def forward_fails(batch_size: int = 8):
    return Tiny(), (torch.randn(batch_size, 7), torch.randn(batch_size, 16))


class ReturnsNone(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        self.fc(x)


def forward_returns_none(batch_size: int = 8):
    return ReturnsNone(), (torch.randn(batch_size, 16), torch.randn(batch_size, 16))


class RaisesInForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        raise ValueError("forward refuses")


def forward_raises(batch_size: int = 8):
    return RaisesInForward(), (torch.randn(batch_size, 16), torch.randn(batch_size, 16))


def loss_not_callable(batch_size: int = 8):
    return Tiny(), (torch.randn(batch_size, 16), torch.randn(batch_size, 16)), "mse"


def loss_not_scalar(batch_size: int = 8):
    return Tiny(), (torch.randn(batch_size, 16), torch.randn(batch_size, 16)), lambda out, y: out - y


def loss_raises(batch_size: int = 8):
    def loss(out, y):
        raise RuntimeError("the loss raised")
    return Tiny(), (torch.randn(batch_size, 16), torch.randn(batch_size, 16)), loss


def no_parameters(batch_size: int = 8):
    return nn.ReLU(), (torch.randn(batch_size, 16), torch.randn(batch_size, 16))


def no_default_batch(batch_size):
    return good(batch_size)


def takes_nothing():
    return good(8)


not_callable = 42
'''

OPS = {"fc1": "linear", "act": "elementwise", "fc2": "linear"}


def strategy(ops: Any, **extra: Any) -> dict[str, Any]:
    return {"format": "soapflow.strategy/2", **extra, "ops": ops}


# name -> the content of a strategy file for `good` at batch 8 on cpu-2 (a str is written as it is).
STRATEGIES: dict[str, Any] = {
    "not_json": "{oops",
    "empty": "",
    "a_list": [1, 2],
    "null": None,
    "no_format": {"ops": {}},
    "wrong_format": strategy({}, format="soapflow.strategy/9"),
    "format_not_a_string": strategy({}, format=2),
    "ops_missing": {"format": "soapflow.strategy/2"},
    "ops_a_list": strategy([{"fc1": {}}]),
    "entry_not_an_object": strategy({"fc1": 5}),
    "unknown_op": strategy({"ghost": {"degrees": {}, "devices": [0]}}),
    "devices_missing": strategy({"fc1": {"degrees": {"sample": 2}}}),
    "devices_a_string": strategy({"fc1": {"degrees": {}, "devices": "0"}}),
    "devices_strings": strategy({"fc1": {"degrees": {"sample": 2}, "devices": ["a", "b"]}}),
    "devices_floats": strategy({"fc1": {"degrees": {"sample": 2}, "devices": [0.5, 1.5]}}),
    "devices_booleans": strategy({"fc1": {"degrees": {"sample": 2}, "devices": [False, True]}}),
    "devices_empty": strategy({"fc1": {"degrees": {}, "devices": []}}),
    "devices_out_of_range": strategy({"fc1": {"degrees": {"sample": 2}, "devices": [0, 7]}}),
    "devices_negative": strategy({"fc1": {"degrees": {}, "devices": [-1]}}),
    "devices_huge": strategy({"fc1": {"degrees": {}, "devices": [10**30]}}),
    "devices_repeat_shard": strategy({"fc1": {"degrees": {"sample": 2}, "devices": [1, 1], "shard": 2}}),
    "devices_count_mismatch": strategy({"fc1": {"degrees": {"sample": 2}, "devices": [0]}}),
    "degrees_a_list": strategy({"fc1": {"degrees": [2], "devices": [0, 1]}}),
    "degrees_a_number": strategy({"fc1": {"degrees": 2, "devices": [0, 1]}}),
    "degree_zero": strategy({"fc1": {"degrees": {"sample": 0}, "devices": [0]}}),
    "degree_negative": strategy({"fc1": {"degrees": {"sample": -2}, "devices": [0, 1]}}),
    "degree_float": strategy({"fc1": {"degrees": {"sample": 1.5}, "devices": [0, 1]}}),
    "degree_string": strategy({"fc1": {"degrees": {"sample": "2"}, "devices": [0, 1]}}),
    "degree_boolean": strategy({"fc1": {"degrees": {"sample": True}, "devices": [0]}}),
    "degree_huge": strategy({"fc1": {"degrees": {"sample": 2**70}, "devices": [0]}}),
    "degree_not_dividing": strategy({"fc1": {"degrees": {"sample": 3}, "devices": [0, 1, 2]}}),
    "unknown_dim": strategy({"fc1": {"degrees": {"heads": 2}, "devices": [0, 1]}}),
    "setup_not_an_object": strategy({}, setup=[1]),
    "setup_unknown_key": strategy({}, setup={"optimiser": "sgd"}),
    "setup_bad_optimizer": strategy({}, setup={"optimizer": "adam"}),
    "setup_lr_a_string": strategy({}, setup={"lr": "fast"}),
    "setup_lr_null": strategy({}, setup={"lr": None}),
    "setup_lr_negative": strategy({}, setup={"lr": -0.1}),
    "setup_momentum_too_big": strategy({}, setup={"momentum": 2}),
    "setup_bucket_zero": strategy({}, setup={"bucket_mb": 0}),
    "setup_bucket_a_list": strategy({}, setup={"bucket_mb": [25]}),
    "four_devices": strategy({name: {"degrees": {"sample": 4}, "devices": [0, 1, 2, 3]} for name in OPS},
                             num_devices=4),
}


def topology(devices: Any = None, links: Any = None, **extra: Any) -> dict[str, Any]:
    doc = {"format": "soapflow.topology/1", "name": "fuzz",
           "devices": [{"id": 0, "kind": "v100", "node": 0}, {"id": 1, "kind": "v100", "node": 0}]
           if devices is None else devices,
           "links": [{"src": "gpu0", "dst": "gpu1", "kind": "nvlink", "spec": "nvlink2"}] if links is None else links}
    return {**doc, **extra}


def link(**fields: Any) -> list[dict[str, Any]]:
    return [{"src": "gpu0", "dst": "gpu1", "kind": "nvlink", "bandwidth_gbps": 25, "latency_us": 3, **fields}]


def v100(i: int, **fields: Any) -> dict[str, Any]:
    return {"id": i, "kind": "v100", "node": 0, **fields}


# name -> the content of a topology file (a str is written as it is).
TOPOLOGIES: dict[str, Any] = {
    "not_json": "[1,",
    "a_list": [],
    "wrong_format": topology(format="soapflow.topology/0"),
    "name_empty": topology(name=""),
    "devices_missing": {"format": "soapflow.topology/1", "name": "x", "links": []},
    "devices_empty": topology(devices=[], links=[]),
    "devices_an_object": topology(devices={"0": "v100"}),
    "device_not_an_object": topology(devices=[3]),
    "device_missing_kind": topology(devices=[{"id": 0, "node": 0}], links=[]),
    "device_unknown_kind": topology(devices=[{"id": 0, "kind": "tpu9", "node": 0}], links=[]),
    "device_id_a_string": topology(devices=[{"id": "0", "kind": "v100", "node": 0}], links=[]),
    "device_id_negative": topology(devices=[v100(-1)], links=[]),
    "device_ids_duplicate": topology(devices=[v100(0), v100(0)], links=[]),
    "device_ids_gap": topology(devices=[v100(0), v100(2)], links=[]),
    "device_node_gap": topology(devices=[v100(0), {"id": 1, "kind": "v100", "node": 3}]),
    "device_unknown_key": topology(devices=[v100(0, colour="red")], links=[]),
    "device_memory_negative": topology(devices=[v100(0, memory_gb=-16)], links=[]),
    "device_memory_a_string": topology(devices=[v100(0, memory_gb="16GB")], links=[]),
    "device_peaks_a_number": topology(devices=[v100(0, peak_tflops=15)], links=[]),
    "device_peak_unknown_dtype": topology(devices=[v100(0, peak_tflops={"int4": 100})], links=[]),
    "device_peak_zero": topology(devices=[v100(0, peak_tflops={"float32": 0})], links=[]),
    "links_an_object": topology(links={"a": 1}),
    "link_not_an_object": topology(links=["gpu0-gpu1"]),
    "link_to_unknown_device": topology(links=link(dst="gpu7")),
    "link_to_unknown_switch": topology(links=link(dst="node0.swtich")),
    "link_to_itself": topology(links=link(dst="gpu0")),
    "link_missing_src": topology(links=[{"dst": "gpu1", "kind": "nvlink", "bandwidth_gbps": 25, "latency_us": 3}]),
    "link_unknown_kind": topology(links=link(kind="carrier-pigeon")),
    "link_bandwidth_negative": topology(links=link(bandwidth_gbps=-25)),
    "link_bandwidth_zero": topology(links=link(bandwidth_gbps=0)),
    "link_bandwidth_a_string": topology(links=link(bandwidth_gbps="fast")),
    "link_latency_negative": topology(links=link(latency_us=-1)),
    "link_missing_bandwidth": topology(links=[{"src": "gpu0", "dst": "gpu1", "kind": "nvlink", "latency_us": 3}]),
    "link_bidirectional_a_string": topology(links=link(bidirectional="yes")),
    "link_duplicate": topology(links=link() + link()),
    "unreachable": topology(links=[]),
}

# name -> the `calibration` key of a machine profile (a topology file of 2 cpu devices with one).
PROFILES: dict[str, Any] = {
    "not_an_object": [1],
    "wrong_format": {"format": "soapflow.calibration/0"},
    "efficiency_a_list": {"efficiency": [0.5]},
    "efficiency_of_a_kind_a_string": {"efficiency": {"linear": "high"}},
    "efficiency_not_a_number": {"efficiency": {"linear": {"float32": "high"}}},
    "efficiency_negative": {"efficiency": {"linear": {"float32": -0.5}}},
    "bandwidth_efficiency_not_a_number": {"bandwidth_efficiency": {"loopback": None}},
    "launch_us_a_number": {"launch_us": 5},
    "overhead_negative": {"overhead_us": -1},
    "compute_scale_zero": {"compute_scale": 0},
    "comm_overhead_a_list": {"comm_overhead": [1]},
    "update_scale_a_string": {"update_scale": "x"},
}
PROFILE_MESSAGES = {
    "not_an_object": "calibration must be an object", "wrong_format": "calibration format",
    "efficiency_a_list": "calibration.efficiency must be an object",
    "efficiency_of_a_kind_a_string": "calibration.efficiency.linear must be an object",
    "efficiency_not_a_number": "calibration.efficiency.linear.float32 must be a number",
    "efficiency_negative": "efficiencies must be in (0, 1]",
    "bandwidth_efficiency_not_a_number": "calibration.bandwidth_efficiency.loopback must be a number",
    "launch_us_a_number": "calibration.launch_us must be an object", "overhead_negative": "overhead_us",
    "compute_scale_zero": "compute_scale", "comm_overhead_a_list": "comm_overhead",
    "update_scale_a_string": "update_scale",
}


def profile(calibration: Any) -> dict[str, Any]:
    cpus = [{"id": i, "kind": "cpu", "node": 0} for i in range(2)]
    loopback = [{"src": f"cpu{i}", "dst": "node0.loopback", "kind": "loopback", "spec": "loopback"} for i in range(2)]
    if isinstance(calibration, dict):
        calibration = {"format": "soapflow.calibration/1", **calibration}
    return topology(devices=cpus, links=loopback, calibration=calibration)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("fuzz")
    (root / "models.py").write_text(MODELS)
    (root / "syntax_error.py").write_text("def build(batch_size=8):\n    return (\n")
    (root / "import_error.py").write_text("import no_such_module_anywhere\n")
    (root / "import_raises.py").write_text("raise SystemExit('a model file that exits on import')\n")
    (root / "a_directory.py").mkdir()
    (root / "a_directory.json").mkdir()
    (root / "strategies").mkdir()
    (root / "topologies").mkdir()
    paths = {"root": str(root), "models": str(root / "models.py"), "model": f"{root / 'models.py'}:good"}
    # Numbered, so that an expected message cannot match the file's name.
    (root / "profiles").mkdir()
    profiles = {name: profile(cal) for name, cal in PROFILES.items()}
    for folder, docs in (("strategies", STRATEGIES), ("topologies", TOPOLOGIES), ("profiles", profiles)):
        for k, (name, doc) in enumerate(docs.items()):
            path = root / folder / f"{k}.json"
            path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
            paths[f"{folder}/{name}"] = str(path)
    return paths


def call(capsys, argv: list[str]) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


_ERROR = re.compile(r"^soapflow(?: [a-z]+)?: error: \S")


def assert_one_line_error(code: Any, err: str, *, expect: str = "") -> str:
    """The error line: a non-zero exit, no traceback, one error line after one-line warnings only (or
    argparse's usage message ending in its error line)."""
    assert "Traceback" not in err, err
    assert code not in (0, None), err
    lines = err.strip().splitlines()
    assert lines and _ERROR.match(lines[-1]), err
    if not (code == 2 and lines[0].startswith("usage:")):
        assert all(line.startswith("soapflow: warning: ") for line in lines[:-1]), err
    assert expect.lower() in lines[-1].lower(), err
    return lines[-1]


# ------------------------------------------------------------------------------------------- model files

MODEL_CASES = [
    ("not_a_tuple", "must return"),
    ("four_things", "must return"),
    ("not_a_module", "not an nn.Module"),
    ("example_not_a_pair", "(inputs, target)"),
    ("inputs_not_tensors", "must be tensors"),
    ("no_inputs", "input"),
    ("scalar_input", "batch"),
    ("wrong_batch", "batch"),
    ("empty_batch", "batch"),
    ("target_wrong_shape", ""),
    ("integer_inputs", ""),
    ("complex_inputs", ""),
    ("raises", "the model function raised"),
    ("forward_fails", "cannot capture"),
    ("forward_returns_none", ""),
    ("forward_raises", "forward refuses"),
    ("loss_not_callable", "callable"),
    ("loss_not_scalar", "must be a scalar"),
    ("loss_raises", "the loss raised"),
    ("no_parameters", ""),
    ("no_default_batch", "--batch"),
    ("takes_nothing", ""),
    ("not_callable", "no function"),
    ("missing_function", "no function 'missing_function'"),
]


# Odd but capturable (capture may accept them; running them is another matter, see below).
MAY_CAPTURE = {"no_parameters", "integer_inputs", "target_wrong_shape"}


@pytest.mark.parametrize(("function", "message"), MODEL_CASES, ids=[c[0] for c in MODEL_CASES])
def test_a_model_function_that_goes_wrong(capsys, files, function, message):
    code, _, err = call(capsys, ["capture", f"{files['models']}:{function}"])
    if function in MAY_CAPTURE and code == 0:
        assert err == ""
        return
    assert_one_line_error(code, err, expect=message)


@pytest.mark.parametrize(("ref", "message"), [
    ("syntax_error.py:build", "SyntaxError"),
    ("import_error.py:build", "no_such_module_anywhere"),
    ("import_raises.py:build", "exits on import"),
    ("missing.py:build", "does not exist"),
    ("a_directory.py:build", "does not exist"),
    ("models.py", "neither a zoo model"),
    ("models.py:", "neither a zoo model"),
    (":good", "neither a zoo model"),
])
def test_a_model_file_that_cannot_be_loaded(capsys, files, ref, message):
    code, _, err = call(capsys, ["capture", str(Path(files["root"]) / ref) if ref[0] != ":" else ref])
    assert_one_line_error(code, err, expect=message)


# ------------------------------------------------------------------------------------- strategy files

STRATEGY_MESSAGES = {
    "not_json": "is not JSON", "empty": "is not JSON", "a_list": "JSON object", "null": "JSON object",
    "no_format": "format", "wrong_format": "format", "format_not_a_string": "format", "ops_missing": "'ops'",
    "ops_a_list": "'ops'", "entry_not_an_object": "'fc1'", "unknown_op": "'ghost'", "devices_missing": "'fc1'",
    "devices_a_string": "'fc1'", "devices_strings": "devices", "devices_floats": "devices",
    "devices_booleans": "devices", "devices_empty": "device", "devices_out_of_range": "not in the topology",
    "devices_negative": "not in the topology", "devices_huge": "not in the topology",
    "devices_repeat_shard": "repeat", "devices_count_mismatch": "2 parts", "degrees_a_list": "degrees",
    "degrees_a_number": "degrees", "degree_zero": ">= 1", "degree_negative": ">= 1", "degree_float": "degrees",
    "degree_string": "degrees", "degree_boolean": "degrees", "degree_huge": "parts",
    "degree_not_dividing": "does not divide", "unknown_dim": "no dim 'heads'", "setup_not_an_object": "setup",
    "setup_unknown_key": "optimiser", "setup_bad_optimizer": "adam", "setup_lr_a_string": "lr",
    "setup_lr_null": "lr", "setup_lr_negative": "lr", "setup_momentum_too_big": "momentum",
    "setup_bucket_zero": "bucket_mb", "setup_bucket_a_list": "bucket_mb", "four_devices": "not in the topology",
}


@pytest.mark.parametrize("name", list(STRATEGY_MESSAGES))
def test_a_malformed_strategy_file(capsys, files, name):
    path = files[f"strategies/{name}"]
    code, _, err = call(capsys, ["simulate", files["model"], "-t", "cpu-2", "-s", path])
    assert_one_line_error(code, err, expect=STRATEGY_MESSAGES[name])


# ------------------------------------------------------------------------------------- topology files

TOPOLOGY_MESSAGES = {
    "not_json": "not JSON", "a_list": "JSON object", "wrong_format": "format", "name_empty": "name",
    "devices_missing": "'devices'", "devices_empty": "'devices'", "devices_an_object": "'devices'",
    "device_not_an_object": "device entry 0", "device_missing_kind": "'kind'", "device_unknown_kind": "tpu9",
    "device_id_a_string": "id", "device_id_negative": "id", "device_ids_duplicate": "duplicate",
    "device_ids_gap": "0..1", "device_node_gap": "node", "device_unknown_key": "colour",
    "device_memory_negative": "memory_gb", "device_memory_a_string": "memory_gb",
    "device_peaks_a_number": "peak_tflops", "device_peak_unknown_dtype": "int4", "device_peak_zero": "peak_tflops",
    "links_an_object": "'links'", "link_not_an_object": "link entry 0", "link_to_unknown_device": "gpu7",
    "link_to_unknown_switch": "node0.swtich", "link_to_itself": "endpoints", "link_missing_src": "'src'",
    "link_unknown_kind": "carrier-pigeon", "link_bandwidth_negative": "bandwidth_gbps",
    "link_bandwidth_zero": "bandwidth_gbps", "link_bandwidth_a_string": "bandwidth_gbps",
    "link_latency_negative": "latency_us", "link_missing_bandwidth": "bandwidth_gbps",
    "link_bidirectional_a_string": "bidirectional", "link_duplicate": "both go", "unreachable": "reach",
}


@pytest.mark.parametrize("name", list(TOPOLOGY_MESSAGES))
def test_a_malformed_topology_file(capsys, files, name):
    path = files[f"topologies/{name}"]
    code, _, err = call(capsys, ["topology", path])
    assert_one_line_error(code, err, expect=TOPOLOGY_MESSAGES[name])


@pytest.mark.parametrize("name", list(PROFILE_MESSAGES))
def test_a_malformed_machine_profile(capsys, files, name):
    code, _, err = call(capsys, ["simulate", files["model"], "-t", files[f"profiles/{name}"], "-s", "dp"])
    assert_one_line_error(code, err, expect=PROFILE_MESSAGES[name])


def test_a_malformed_topology_file_is_one_line_in_every_command_that_reads_one(capsys, files):
    path = files["topologies/link_bandwidth_negative"]
    for argv in (["simulate", files["model"], "-s", "dp"], ["optimize", files["model"], "--budget", "1"],
                 ["compare", files["model"]], ["validate", files["model"]]):
        code, _, err = call(capsys, [*argv, "-t", path])
        assert_one_line_error(code, err, expect="bandwidth_gbps")


# ---------------------------------------------------------------------- sizes, counts, paths, infeasible


SIZE_CASES = [
    (["capture", "MODEL", "--batch", "0"], "--batch must be positive"),
    (["capture", "MODEL", "--batch", "-3"], "--batch must be positive"),
    (["simulate", "MODEL", "-t", "cpu-2", "-s", "dp", "--batch", "-3"], "--batch must be positive"),
    (["simulate", "MODEL", "-t", "cpu-2", "-s", "dp", "--bucket-mb", "0"], "bucket_mb"),
    (["simulate", "MODEL", "-t", "cpu-2", "-s", "dp", "--bucket-mb", "inf"], "bucket_mb"),
    (["simulate", "MODEL", "-t", "cpu-2", "-s", "dp", "--lr", "nan"], "lr"),
    (["simulate", "MODEL", "-t", "cpu-2", "-s", "dp", "--lr", "inf"], "lr"),
    (["simulate", "MODEL", "-t", "cpu-2", "-s", "dp", "--weight-decay", "nan"], "weight_decay"),
    (["simulate", "MODEL", "-t", "cpu-2", "-s", "dp", "--batch", "nine"], ""),
    (["optimize", "MODEL", "-t", "cpu-2", "--budget", "-1"], "--budget"),
    (["optimize", "MODEL", "-t", "cpu-2", "--budget", "nan"], "--budget"),
    (["optimize", "MODEL", "-t", "cpu-2", "--proposals", "0"], "proposal budget"),
    (["optimize", "MODEL", "-t", "cpu-2", "--proposals", "-4"], "proposal budget"),
    (["optimize", "MODEL", "-t", "cpu-2", "--measure-rounds", "-1"], "--measure-rounds"),
    (["compare", "MODEL", "-t", "cpu-2", "--steps", "0", "--measure"], "--steps"),
    (["compare", "MODEL", "-t", "cpu-2", "--repeats", "0"], "--repeats"),
    (["run", "MODEL", "-s", "dp", "--steps", "0"], "--steps"),
    (["run", "MODEL", "-s", "dp", "--steps", "-1"], "--steps"),
    (["run", "MODEL", "-s", "dp", "--nproc", "0"], "--nproc"),
    (["run", "MODEL", "-s", "dp", "--nproc", "-2"], "--nproc"),
    (["run", "MODEL", "-s", "dp", "--batch", "0"], "--batch"),
    (["run", "MODEL", "-s", "dp", "--checkpoint-dir", "ROOT", "--checkpoint-every", "-1"], "checkpoint_every"),
    (["calibrate", "--nproc", "0"], "--nproc"),
    (["validate", "MODEL", "-t", "cpu-2", "--steps", "0"], "must be positive"),
    (["validate", "MODEL", "-t", "cpu-2", "--strategies", "-1"], "must be positive"),
    (["validate", "MODEL", "-t", "cpu-2", "--timeout", "0"], "--timeout"),
    (["validate", "MODEL", "-t", "cpu-2", "--timeout", "-5"], "--timeout"),
    (["validate", "MODEL", "-t", "cpu-2", "--timeout", "nan"], "--timeout"),
]


@pytest.mark.parametrize(("argv", "message"), SIZE_CASES, ids=[" ".join(a) for a, _ in SIZE_CASES])
def test_zero_negative_and_non_finite_sizes(capsys, files, argv, message):
    code, _, err = call(capsys, [{"MODEL": files["model"], "ROOT": files["root"]}.get(a, a) for a in argv])
    assert_one_line_error(code, err, expect=message)


@pytest.mark.parametrize(("preset", "message"), [
    ("cpu-100000", "at most"),
    ("cpu-0", "at least 1"),
    ("p100-1000x1000", "at most 8"),
    ("k80-100000x8", "at most"),
    ("p100-0x4", "at least 1"),
    ("cpu-99999999999999999999999", "at most"),
])
def test_huge_and_empty_device_counts(capsys, files, preset, message):
    for argv in (["topology", preset], ["simulate", files["model"], "-t", preset, "-s", "mp"]):
        code, _, err = call(capsys, argv)
        assert_one_line_error(code, err, expect=message)


PATH_CASES = [
    (["simulate", "MODEL", "-t", "cpu-2", "-s", "ROOT/missing.json"], "neither a baseline"),
    (["simulate", "MODEL", "-t", "cpu-2", "-s", "DIR"], "directory"),
    (["topology", "ROOT/missing.json"], "not found"),
    (["topology", "DIR"], "directory"),
    (["simulate", "MODEL", "-t", "DIR", "-s", "dp"], "directory"),
    (["simulate", "MODEL", "-t", "cpu-2", "-s", "dp", "--trace", "DIR"], "directory"),
    (["simulate", "MODEL", "-t", "cpu-2", "-s", "dp", "--costdb", "DIR"], "directory"),
    (["simulate", "MODEL", "-t", "cpu-2", "-s", "dp", "--costdb", "ROOT/missing.jsonl"], "missing.jsonl"),
    (["optimize", "MODEL", "-t", "cpu-2", "--proposals", "5", "-o", "DIR"], "directory"),
    (["optimize", "MODEL", "-t", "cpu-2", "--proposals", "5", "-o", "ROOT/best.json", "--plot", "DIR"], "directory"),
    (["compare", "MODEL", "-t", "cpu-2", "--plot", "DIR"], "directory"),
    (["run", "MODEL", "-s", "DIR"], "directory"),
    (["run", "MODEL", "-s", "dp", "--nproc", "1", "--steps", "1", "--checkpoint-dir", "FILE"], "not a directory"),
    (["run", "MODEL", "-s", "dp", "--resume", "--checkpoint-dir", "FILE"], "not a directory"),
    (["calibrate", "-o", "DIR", "--nproc", "2"], "directory"),
    (["validate", "MODEL", "-t", "cpu-2", "--plot", "DIR"], "directory"),
]


@pytest.mark.parametrize(("argv", "message"), PATH_CASES, ids=[" ".join(a) for a, _ in PATH_CASES])
def test_missing_files_and_directories_given_as_files(capsys, files, argv, message):
    root = files["root"]
    names = {"MODEL": files["model"], "DIR": f"{root}/a_directory.json", "FILE": files["models"]}
    code, _, err = call(capsys, [names.get(a, a.replace("ROOT", root)) for a in argv])
    assert_one_line_error(code, err, expect=message)


def test_infeasible_strategies(capsys, files):
    four = files["strategies/four_devices"]
    # a strategy over 4 devices run on 2 processes
    code, _, err = call(capsys, ["run", files["model"], "-s", four, "--nproc", "2"])
    assert_one_line_error(code, err, expect="not in the topology")
    # the same strategy simulated on a 2-device topology
    code, _, err = call(capsys, ["simulate", files["model"], "-t", "cpu-2", "-s",
                                 four])
    assert_one_line_error(code, err, expect="not in the topology")
    # a baseline that does not apply
    code, _, err = call(capsys, ["simulate", files["model"], "-t", "cpu-3", "-s", "dp"])
    assert_one_line_error(code, err, expect="dp needs the batch")


def test_a_strategy_that_does_not_fit_simulates_and_says_so(capsys):
    """Not an error: simulate reports an infeasible strategy (exit 0) with the devices that overflow."""
    code, out, err = call(capsys, ["simulate", "mlp", "--batch", "1048576", "-t", "k80-1x2", "-s", "mp"])
    assert code == 0 and "Traceback" not in err and "INFEASIBLE" in out


def test_argparse_errors_are_usage_lines(capsys, files):
    for argv in (["nope"], ["simulate", files["model"]], ["run", files["model"], "-s", "dp", "--steps", "x"],
                 ["run", files["model"], "-s", "dp", "--backend", "mpi"], []):
        code, _, err = call(capsys, argv)
        assert code == 2 and "Traceback" not in err and _ERROR.match(err.strip().splitlines()[-1]), err


# ------------------------------------------------------------------------------------ interrupted runs


def test_a_rank_killed_by_the_os_is_reported_as_probably_out_of_memory(capsys, files, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "kill:1:1")
    code, _, err = call(capsys, ["run", files["model"], "-s", "dp", "--nproc", "2", "--steps", "3"])
    line = assert_one_line_error(code, err, expect="rank 1 was killed by the operating system (SIGKILL)")
    assert "most likely out of memory" in line and "the memory model estimates" in line, line
    assert re.search(r"estimates \d[\d.]* [KMGT]?i?B per process", line), line
    assert "try a smaller --batch" in line, line


def test_a_rank_that_raises_is_one_line_naming_rank_and_op(capsys, files, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "raise:0:1")
    code, _, err = call(capsys, ["run", files["model"], "-s", "tp", "--nproc", "2", "--steps", "2"])
    assert_one_line_error(code, err, expect="rank 0: ExecutionError: step 1")


def test_a_model_that_captures_but_fails_to_run_is_one_line_naming_the_op(capsys, files):
    code, _, err = call(capsys, ["run", f"{files['models']}:integer_inputs", "-s", "tp", "--nproc", "2",
                                 "--steps", "1"])
    assert_one_line_error(code, err, expect="forward of op 'fc1'")


def test_a_bad_fault_hook_is_one_line(capsys, files, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "kill:one:1")
    code, _, err = call(capsys, ["run", files["model"], "-s", "dp", "--nproc", "1", "--steps", "1"])
    assert_one_line_error(code, err, expect=FAULT_ENV)


# ---------------------------------------------------------------------------------- real processes


def test_real_processes_print_no_traceback(files):
    """As a user sees it: the command's stderr is one line, also from the worker processes of a run whose
    rank dies (they share the terminal)."""
    root = Path(files["root"])
    cases = [
        (["capture", f"{root / 'syntax_error.py'}:build"], {}),
        (["simulate", files["model"], "-t", "cpu-2", "-s", files["strategies/degree_zero"]], {}),
        (["topology", files["topologies/link_to_unknown_device"]], {}),
        (["run", files["model"], "-s", "dp", "--batch", "-3"], {}),
        (["run", files["model"], "-s", "tp", "--nproc", "2", "--steps", "2"], {FAULT_ENV: "kill:1:1"}),
    ]
    procs = [subprocess.Popen([sys.executable, "-m", "soapflow", *argv], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, **env})
             for argv, env in cases]
    for (argv, _), proc in zip(cases, procs, strict=True):
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 1 and out == "", (argv, err)
        assert_one_line_error(proc.returncode, err)
        assert len(err.strip().splitlines()) == 1, err


def test_a_closed_pipe_ends_quietly():
    """`soapflow ... | head -1`: the reader leaves before the output is written; no traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "soapflow", "topology", "p100-2x4"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and err == "", err
