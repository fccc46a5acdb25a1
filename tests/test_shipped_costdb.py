"""Cost databases shipped for a GPU kind (`simulator.shipped`): which files a topology reads, the measured
model `cost_model_for` makes of them for a preset, an explicit database over them, and the commands'
`--no-shipped-costs` switch."""

from __future__ import annotations

import json
import tomllib
import warnings
from pathlib import Path

import pytest
from test_simulator_support import chain, data_parallel

import simulator
from simulator import AnalyticalCostModel, MeasuredCostModel, simulate
from simulator import shipped as shipped_mod
from simulator.calibration import cost_model_for
from simulator.shipped import SHIPPED_FOLDER, ShippedCostModel, shipped_costdb, shipped_report
from soap import costdb
from soap.costdb import CostDatabase, Measurement, part_key
from soap.topology import load_topology, save_topology
from soapflow.cli import build_parser, main

HUGE_MS = 1000.0


def meas(kind: str = "h100", n: int = 8, fwd_ms: float = 1.0) -> Measurement:
    return Measurement(device_kind=kind, op_kind="linear", inputs=[[n, 4]], outputs=[[n, 3]], params=[[3], [3, 4]],
                       fwd_ms=fwd_ms, bwd_ms=2 * fwd_ms, source="test")


def of_key(key: costdb.Key, fwd_ms: float, bwd_ms: float) -> Measurement:
    kind, op_kind, dtype, inputs, outputs, params, attrs, grads = key
    return Measurement(device_kind=kind, op_kind=op_kind, dtype=dtype, inputs=inputs, outputs=outputs,
                       params=params, attrs=attrs, grads=grads, fwd_ms=fwd_ms, bwd_ms=bwd_ms, source="test")


class Recording:
    """The analytical model, recording the key of every part it prices."""

    def __init__(self) -> None:
        self.base = AnalyticalCostModel()
        self.keys: list[costdb.Key] = []

    def compute_ms(self, op, box, device, grads=None):
        self.keys.append(part_key(op, box, device.kind, grads))
        return self.base.compute_ms(op, box, device, grads)

    def update_ms(self, param_bytes, device, passes):
        return self.base.update_ms(param_bytes, device, passes)

    def reduce_ms(self, nbytes, num_inputs, device):
        return self.base.reduce_ms(nbytes, num_inputs, device)


@pytest.fixture()
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty folder standing in for the shipped one."""
    path = tmp_path / "costdbs"
    path.mkdir()
    monkeypatch.setattr(shipped_mod, "SHIPPED_FOLDER", path)
    return path


@pytest.fixture(scope="module")
def tiny():
    """A two-layer chain, data parallel on h100-1x2, and the key of its first linear's part."""
    graph = chain(batch=8, width=16, depth=2)
    topology = load_topology("h100-1x2")
    strategy = data_parallel(graph, (0, 1))
    rec = Recording()
    simulate(graph, strategy, topology, rec)
    key = next(k for k in rec.keys if k[1] == "linear")
    return graph, strategy, key


def test_the_shipped_folder_is_package_data() -> None:
    assert SHIPPED_FOLDER == Path(simulator.__file__).parent / "costdbs"
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert "costdbs/*.jsonl" in pyproject["tool"]["setuptools"]["package-data"]["simulator"]


def test_shipped_costdb_reads_the_files_of_the_topology_kinds_only(tmp_path: Path) -> None:
    costdb.save(tmp_path / "h100.jsonl", [meas(n=8), meas(n=16)])
    costdb.save(tmp_path / "a100.jsonl", [meas("a100")])
    db = shipped_costdb(load_topology("h100-2x2"), folder=tmp_path)
    assert db is not None and len(db) == 2 and {m.device_kind for m in db} == {"h100"}
    db = shipped_costdb(load_topology("a100-1x2"), folder=tmp_path)
    assert db is not None and [m.device_kind for m in db] == ["a100"]
    assert shipped_costdb(load_topology("p100-1x2"), folder=tmp_path) is None
    assert shipped_costdb(load_topology("cpu-2"), folder=tmp_path) is None
    assert shipped_costdb(load_topology("h100-1x2"), folder=tmp_path / "missing") is None


def test_shipped_costdb_unites_the_kinds_of_a_mixed_topology(tmp_path: Path) -> None:
    costdb.save(tmp_path / "h100.jsonl", [meas()])
    costdb.save(tmp_path / "a100.jsonl", [meas("a100")])
    doc = load_topology("h100-1x2").to_dict()
    doc["devices"][1]["kind"] = "a100"
    path = tmp_path / "mixed.json"
    path.write_text(json.dumps(doc))
    db = shipped_costdb(load_topology(path), folder=tmp_path)
    assert db is not None and sorted(m.device_kind for m in db) == ["a100", "h100"]


def test_a_measurement_of_another_kind_in_a_shipped_file_is_left_out_with_a_warning(tmp_path: Path) -> None:
    costdb.save(tmp_path / "h100.jsonl", [meas(), meas("a100")])
    with pytest.warns(UserWarning, match="1 measurement"):
        db = shipped_costdb(load_topology("h100-1x2"), folder=tmp_path)
    assert db is not None and [m.device_kind for m in db] == ["h100"]


def test_the_default_folder_is_read(folder: Path) -> None:
    assert shipped_costdb(load_topology("h100-1x2")) is None
    costdb.save(folder / "h100.jsonl", [meas()])
    assert len(shipped_costdb(load_topology("h100-1x2"))) == 1


def test_a_preset_is_simulated_with_its_shipped_measurements(folder: Path, tiny) -> None:
    graph, strategy, key = tiny
    topology = load_topology("h100-1x2")
    analytical = simulate(graph, strategy, topology).summary()["iteration_time_ms"]
    costdb.save(folder / "h100.jsonl", [of_key(key, HUGE_MS, HUGE_MS)])

    topo, model = cost_model_for("h100-1x2")
    assert topo == topology and isinstance(model, ShippedCostModel) and isinstance(model, MeasuredCostModel)
    measured = simulate(graph, strategy, topo, model).summary()["iteration_time_ms"]
    assert model.hits > 0 and model.misses > 0  # the part it holds measured, the rest analytical
    assert measured > 2 * HUGE_MS > analytical
    assert shipped_report(model) == {"device_kinds": ["h100"], "num_parts": 1}

    topo, off = cost_model_for("h100-1x2", shipped=False)
    assert off is None and shipped_report(off) is None
    assert simulate(graph, strategy, topo, off).summary()["iteration_time_ms"] == pytest.approx(analytical)
    assert cost_model_for("a100-1x2")[1] is None  # no a100 database


def test_a_topology_file_or_profile_does_not_use_the_shipped_database(folder: Path, tmp_path: Path) -> None:
    costdb.save(folder / "h100.jsonl", [meas()])
    path = tmp_path / "h100.json"
    save_topology(path, load_topology("h100-1x2"))
    assert cost_model_for(path)[1] is None
    explicit = CostDatabase([meas(n=16)])
    model = cost_model_for(path, db=explicit)[1]
    assert type(model) is MeasuredCostModel and len(model.db) == 1
    with pytest.warns(UserWarning, match="presets only.*h100.json"):  # the switch does nothing here: said so
        assert cost_model_for(path, shipped=False)[1] is None


def test_the_switch_with_a_topology_file_is_said_to_change_nothing(tmp_path: Path, capsys) -> None:
    path = tmp_path / "mine.json"
    save_topology(path, load_topology("h100-1x2"))
    assert main(["simulate", "mlp", "--batch", "8", "-t", str(path), "-s", "dp", "--no-shipped-costs"]) == 0
    err = capsys.readouterr().err
    assert "soapflow: warning: shipped cost databases price presets only" in err and "mine.json" in err
    assert main(["simulate", "mlp", "--batch", "8", "-t", str(path), "-s", "dp"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_an_explicit_database_wins_over_the_shipped_one(folder: Path, tmp_path: Path) -> None:
    shipped_only, both = meas(n=8, fwd_ms=1.0), meas(n=16, fwd_ms=HUGE_MS)
    costdb.save(folder / "h100.jsonl", [shipped_only, both])
    explicit = CostDatabase([meas(n=16, fwd_ms=2.0), meas(n=32, fwd_ms=3.0)])
    path = tmp_path / "mine.jsonl"
    costdb.save(path, explicit)
    for db in (explicit, str(path)):
        _, model = cost_model_for("h100-2x8", db=db)
        assert isinstance(model, ShippedCostModel) and len(model.db) == 3 and model.num_shipped == 2
        assert model.db.lookup(both.key).fwd_ms == 2.0
        assert model.db.lookup(shipped_only.key).fwd_ms == 1.0
        assert model.db.lookup(meas(n=32).key).fwd_ms == 3.0
    _, model = cost_model_for("h100-2x8", db=explicit, shipped=False)
    assert type(model) is MeasuredCostModel and model.db.lookup(both.key).fwd_ms == 2.0
    assert model.db.lookup(shipped_only.key) is None


@pytest.mark.parametrize("argv", [["simulate", "mlp", "-t", "h100-1x2", "-s", "dp"],
                                  ["optimize", "mlp", "-t", "h100-1x2"], ["compare", "mlp", "-t", "h100-1x2"]])
def test_every_command_that_simulates_takes_the_switch(argv: list[str]) -> None:
    parser = build_parser()
    assert parser.parse_args(argv).no_shipped_costs is False
    assert parser.parse_args([*argv, "--no-shipped-costs"]).no_shipped_costs is True


@pytest.mark.parametrize(("command", "module", "function"), [("optimize", "soapflow.optimize", "optimize"),
                                                             ("compare", "soapflow.optimize", "compare")])
def test_the_switch_reaches_the_api(monkeypatch: pytest.MonkeyPatch, capsys, command, module, function) -> None:
    import importlib

    seen = []

    def fake(*args, **kwargs):
        seen.append(kwargs["shipped_costs"])
        raise ValueError("stop here")

    monkeypatch.setattr(importlib.import_module(module), function, fake)
    assert main([command, "mlp", "-t", "h100-1x2"]) == 1
    assert main([command, "mlp", "-t", "h100-1x2", "--no-shipped-costs"]) == 1
    assert seen == [True, False]
    assert "stop here" in capsys.readouterr().err


def test_the_switch_reaches_cost_model_for(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    import simulator.calibration as calibration

    seen = []
    real = calibration.cost_model_for

    def spy(ref, **kwargs):
        seen.append(kwargs["shipped"])
        return real(ref, **kwargs)

    monkeypatch.setattr(calibration, "cost_model_for", spy)
    for extra in ([], ["--no-shipped-costs"]):
        assert main(["compare", "mlp", "--batch", "8", "-t", "h100-1x2", "-s", "dp", "--json", *extra]) == 0
    assert seen == [True, False]
    capsys.readouterr()


def test_simulate_says_when_a_shipped_database_priced_it(folder: Path, capsys) -> None:
    costdb.save(folder / "h100.jsonl", [meas(), meas(n=16)])
    argv = ["simulate", "mlp", "--batch", "8", "-t", "h100-1x2", "-s", "dp"]
    assert main(argv) == 0
    assert "op costs: measured on h100 (shipped database, 2 parts; analytical for the rest)" in capsys.readouterr().out
    assert main([*argv, "--no-shipped-costs"]) == 0
    assert "op costs" not in capsys.readouterr().out
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["shipped_costs"] == {"device_kinds": ["h100"], "num_parts": 2}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert main([*argv, "--json", "--no-shipped-costs"]) == 0
    assert json.loads(capsys.readouterr().out)["shipped_costs"] is None


def test_compare_says_when_a_shipped_database_priced_it(folder: Path, capsys) -> None:
    costdb.save(folder / "h100.jsonl", [meas()])
    assert main(["compare", "mlp", "--batch", "8", "-t", "h100-1x2", "-s", "dp"]) == 0
    assert "op costs: measured on h100 (shipped database, 1 parts" in capsys.readouterr().out
