"""Every baseline, for every zoo model, on the paper's 16-device cluster and on `cpu-2`: the strategy
validates and survives a round trip through the strategy file unchanged."""

from __future__ import annotations

import warnings

import pytest

from search.baselines import BASELINES, BaselineNotApplicable
from soap.setup import TrainSetup
from soap.strategy import load_strategy, save_strategy, validate_strategy
from soap.topology import load_topology
from soapflow import zoo
from soapflow.api import capture_model

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
