"""Every baseline, for every zoo model, on the paper's 16-device cluster and on `cpu-2`: the strategy
validates and survives a round trip through the strategy file unchanged; where a baseline would not be what
its name says (every op on one device of several), it refuses, and the command line says why."""

from __future__ import annotations

import json
import warnings

import pytest

from search.baselines import BASELINES, BaselineNotApplicable, expert, fsdp, parse_baseline, tp
from soap.setup import TrainSetup
from soap.strategy import load_strategy, save_strategy, validate_strategy
from soap.topology import load_topology
from soapflow import zoo
from soapflow.api import capture_model
from soapflow.cli import main

TOPOLOGIES = ("cpu-2", "p100-4x4")


@pytest.fixture(scope="module", params=sorted(zoo.ZOO))
def zoo_graph(request):
    # Batch 64 is divisible by both device counts, so every baseline is applicable.
    _, graph = capture_model(request.param, batch_size=64)
    return graph


@pytest.mark.parametrize("topo_name", TOPOLOGIES)
def test_every_baseline_round_trips_for_every_zoo_model(tmp_path, zoo_graph, topo_name):
    topo = load_topology(topo_name)
    for name, make in BASELINES.items():
        try:
            strategy = make(zoo_graph, topo)
        except BaselineNotApplicable as exc:  # pragma: no cover - a failure, with the reason
            pytest.fail(f"{name} not applicable to {zoo_graph.name} on {topo_name}: {exc}")
        assert set(strategy) == {op.name for op in zoo_graph}, name
        validate_strategy(zoo_graph, strategy, topo.num_devices)
        path = tmp_path / f"{name}.json"
        save_strategy(path, strategy, zoo_graph, topology=topo_name, num_devices=topo.num_devices,
                      setup=TrainSetup(), model=zoo_graph.name)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert load_strategy(path, zoo_graph, topo.num_devices, setup=TrainSetup()) == strategy, name
        used = strategy.devices_used()
        assert used <= set(range(topo.num_devices)), name


def test_tp_and_expert_refuse_to_run_every_op_on_one_device_of_several():
    """On 3 devices no weight dim and not the batch (16) of the mlp divide by 3: tp and expert would leave
    every op whole on one device under their name, so they refuse. Where the batch divides, tp splits it
    (it is dp) and runs; recurrent layers placed on different devices are still expert."""
    topo = load_topology("cpu-3")
    graph = capture_model("mlp", batch_size=16)[1]
    with pytest.raises(BaselineNotApplicable, match="^tp needs .* over the 3 devices"):
        tp(graph, topo)
    with pytest.raises(BaselineNotApplicable, match="^expert needs .* over the 3 devices"):
        expert(graph, topo)
    with pytest.raises(BaselineNotApplicable, match="^hybrid: tp=3 needs .* over a group of 3 devices"):
        parse_baseline("hybrid:tp=3")(graph, topo)
    divisible = capture_model("mlp", batch_size=3 * 16)[1]
    assert tp(divisible, topo).devices_used() == set(range(topo.num_devices))
    assert parse_baseline("hybrid:tp=3")(divisible, topo).devices_used() == set(range(topo.num_devices))
    assert len(expert(capture_model("rnnlm", batch_size=16)[1], topo).devices_used()) > 1


def test_fsdp_refusal_names_fsdp():
    graph = capture_model("mlp", batch_size=16)[1]
    with pytest.raises(BaselineNotApplicable, match="^fsdp needs the batch"):
        fsdp(graph, load_topology("cpu-3"))


def test_refused_baselines_are_one_line_errors_and_compare_notes(capsys):
    for name in ("tp", "expert"):
        code = main(["simulate", "mlp", "--batch", "16", "-t", "cpu-3", "-s", name])
        lines = capsys.readouterr().err.strip().splitlines()
        assert code != 0 and len(lines) == 1 and lines[0].startswith(f"soapflow: error: {name} needs"), lines
    assert main(["compare", "mlp", "--batch", "16", "-t", "cpu-3", "--json"]) == 0
    rows = {r["strategy"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    for name in ("dp", "tp", "expert", "fsdp"):
        assert rows[name]["simulated_ms"] is None
        assert rows[name]["note"].startswith(f"not applicable: {name} needs"), rows[name]["note"]
