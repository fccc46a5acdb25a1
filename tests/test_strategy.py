"""ParallelConfig validation, the strategy file (round trip, the recorded training setup, every bad-input
case), and the baselines."""

from __future__ import annotations

import json
import warnings

import pytest

from search.baselines import BASELINES, BaselineNotApplicable, dp, mp, tp
from soap.config import ConfigError, ParallelConfig, parts, validate
from soap.graph import Operator, OperatorGraph, ParamSpec, TensorRef, TensorSpec
from soap.setup import TrainSetup
from soap.strategy import (
    FORMAT,
    Strategy,
    StrategyError,
    load_strategy,
    recorded_setup,
    save_strategy,
    setup_differences,
    strategy_to_dict,
    validate_strategy,
)
from soap.topology import load_topology


def mlp_graph(batch: int = 8, sizes: tuple[int, ...] = (16, 32, 16)) -> OperatorGraph:
    """input -> fc0 -> relu0 -> fc1 -> loss(mse), built by hand."""
    ops = [Operator(name="input0", kind="input", outputs=(TensorSpec(shape=(batch, sizes[0])),),
                    attrs={"position": 0, "role": "input"})]
    prev = "input0"
    for i, (a, b) in enumerate(zip(sizes, sizes[1:], strict=False)):
        ops.append(Operator(name=f"fc{i}", kind="linear", inputs=(TensorRef(op=prev),),
                            outputs=(TensorSpec(shape=(batch, b)),),
                            params={"weight": ParamSpec(shape=(b, a), fqn=f"fc{i}.weight"),
                                    "bias": ParamSpec(shape=(b,), fqn=f"fc{i}.bias")},
                            fwd_flops=2.0 * batch * a * b, bwd_flops=4.0 * batch * a * b))
        prev = f"fc{i}"
        if i < len(sizes) - 2:
            ops.append(Operator(name=f"relu{i}", kind="elementwise", inputs=(TensorRef(op=prev),),
                                outputs=(TensorSpec(shape=(batch, b)),), attrs={"fn": "relu"}))
            prev = f"relu{i}"
    ops.append(Operator(name="target", kind="input", outputs=(TensorSpec(shape=(batch, sizes[-1])),),
                        attrs={"position": 1, "role": "target"}))
    ops.append(Operator(name="loss", kind="loss", inputs=(TensorRef(op=prev), TensorRef(op="target")),
                        outputs=(TensorSpec(shape=()),), attrs={"fn": "mse", "reduction": "mean"}))
    return OperatorGraph(ops, name="mlp", batch_size=batch)


@pytest.fixture
def graph() -> OperatorGraph:
    return mlp_graph()


def test_parallel_config_checks_itself():
    with pytest.raises(ValueError, match="make 4 parts but 2 devices"):
        ParallelConfig(degrees={"sample": 4}, devices=(0, 1))
    assert ParallelConfig(degrees={"sample": 2}, devices=(1, 1)).devices == (1, 1)  # micro-batches
    with pytest.raises(ValueError, match=">= 1"):
        ParallelConfig(degrees={"sample": 0}, devices=(0,))
    cfg = ParallelConfig(degrees={"sample": 2, "out_features": 1}, devices=(0, 1))
    assert dict(cfg.degrees) == {"sample": 2}
    assert cfg == ParallelConfig(degrees={"sample": 2}, devices=(0, 1))
    assert hash(cfg) == hash(ParallelConfig(degrees={"sample": 2}, devices=(0, 1)))


def test_parts_are_row_major(graph):
    cfg = ParallelConfig(degrees={"sample": 2, "out_features": 2}, devices=(3, 2, 1, 0))
    got = parts(graph["fc0"], cfg)
    assert [dev for _, dev in got] == [3, 2, 1, 0]
    assert [box[:2] for box, _ in got] == [((0, 4), (0, 16)), ((0, 4), (16, 32)),
                                           ((4, 8), (0, 16)), ((4, 8), (16, 32))]


@pytest.mark.parametrize(("degrees", "devices", "message"), [
    ({"height": 2}, (0, 1), "has no dim 'height'"),
    ({"sample": 3}, (0, 1, 2), "degree 3 does not divide dim 'sample' of size 8"),
    ({"sample": 2}, (0, 7), r"device\(s\) \[7\] not in the topology"),
])
def test_validate_names_op_and_reason(graph, degrees, devices, message):
    with pytest.raises(ConfigError, match=message) as info:
        validate(graph["fc0"], ParallelConfig(degrees=degrees, devices=devices), num_devices=2)
    assert "'fc0'" in str(info.value)


def test_validate_refuses_unsplittable_dim():
    x = Operator(name="x", kind="input", outputs=(TensorSpec(shape=(4, 6)),),
                 attrs={"position": 0, "role": "input"})
    sm = Operator(name="sm", kind="softmax", inputs=(TensorRef(op="x"),), outputs=(TensorSpec(shape=(4, 6)),),
                  attrs={"axis": 1, "log": False})
    graph = OperatorGraph([x, sm])
    with pytest.raises(ConfigError, match="'sm'.*'d1'"):
        validate(graph["sm"], ParallelConfig(degrees={"d1": 2}, devices=(0, 1)), num_devices=2)


@pytest.mark.parametrize("topo_name", ["cpu-2", "p100-4x4"])
@pytest.mark.parametrize("baseline", sorted(BASELINES))
def test_baselines_round_trip_through_file(tmp_path, topo_name, baseline):
    graph = mlp_graph(batch=32)
    topo = load_topology(topo_name)
    strategy = BASELINES[baseline](graph, topo)
    validate_strategy(graph, strategy, topo.num_devices)
    path = tmp_path / "s.json"
    save_strategy(path, strategy, graph, topology=topo_name, num_devices=topo.num_devices, setup=TrainSetup(),
                  predicted_ms=1.5)
    doc = json.loads(path.read_text())
    assert doc["format"] == FORMAT and doc["fingerprint"] == graph.fingerprint
    assert doc["predicted_iteration_time_ms"] == 1.5
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_strategy(path, graph, topo.num_devices, setup=TrainSetup()) == strategy


def test_baselines_do_what_they_say(graph):
    topo = load_topology("cpu-2")
    s = dp(graph, topo)
    assert all(s[op.name].degrees == {"sample": 2} for op in graph)
    s = mp(graph, topo)
    assert all(s[op.name].num_parts == 1 for op in graph)
    assert {s[op.name].devices[0] for op in graph} == {0, 1}
    s = tp(graph, topo)
    assert dict(s["fc0"].degrees) == {"out_features": 2}
    assert dict(s["relu0"].degrees) == {"d1": 2}
    assert dict(s["fc1"].degrees) == {"in_features": 2}


def test_dp_not_applicable_when_batch_too_small():
    with pytest.raises(BaselineNotApplicable, match="batch"):
        dp(mlp_graph(batch=8), load_topology("p100-4x4"))


def _write(tmp_path, doc) -> str:
    path = tmp_path / "bad.json"
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(path)


def _doc(graph, **ops) -> dict:
    base = strategy_to_dict(dp(graph, load_topology("cpu-2")), graph, topology="cpu-2", num_devices=2,
                            setup=TrainSetup())
    base["ops"].update(ops)
    return base


@pytest.mark.parametrize(("make", "message"), [
    (lambda g: "{not json", "is not JSON"),
    (lambda g: {**_doc(g), "format": "soapflow.strategy/9"}, "has format 'soapflow.strategy/9'"),
    (lambda g: _doc(g, nope={"degrees": {}, "devices": [0]}), "op 'nope' does not exist"),
    (lambda g: _doc(g, fc0={"degrees": {"sample": 3}, "devices": [0, 1, 2]}), "degree 3 does not divide"),
    (lambda g: _doc(g, fc0={"degrees": {"sample": 2}, "devices": [0]}), "make 2 parts but 1 devices"),
    (lambda g: _doc(g, fc0={"degrees": {"sample": 2}, "devices": [0, 5]}), r"device\(s\) \[5\]"),
    (lambda g: _doc(g, loss={"degrees": {"sample": 2, "d1": 2}, "devices": [0, 1]}), "make 4 parts"),
    (lambda g: _doc(g, fc0={"degrees": {"sample": "2"}, "devices": [0, 1]}), "expected {dim: integer}"),
    (lambda g: _doc(g, fc0=[0, 1]), "needs {'degrees'"),
    (lambda g: {**_doc(g), "setup": {"optimizer": "adam"}}, "setup: unknown optimizer 'adam'"),
    (lambda g: {**_doc(g), "setup": {"lr": 0.1, "beta": 0.5}}, "setup: unknown training setup key"),
    (lambda g: {**_doc(g), "setup": "sgd"}, "'setup' must be an object"),
])
def test_bad_strategy_files(tmp_path, graph, make, message):
    with pytest.raises(StrategyError, match=message):
        load_strategy(_write(tmp_path, make(graph)), graph, 2)


def test_missing_ops_default_to_dp_with_warning(tmp_path, graph):
    topo = load_topology("cpu-2")
    doc = _doc(graph)
    del doc["ops"]["fc1"]
    with pytest.warns(UserWarning, match="no config for 1 op"):
        s = load_strategy(_write(tmp_path, doc), graph, 2, default=dp(graph, topo))
    assert s["fc1"] == dp(graph, topo)["fc1"]
    with pytest.raises(StrategyError, match="no config for op"):
        load_strategy(_write(tmp_path, doc), graph, 2)


def test_fingerprint_mismatch_warns_but_applies(tmp_path, graph):
    doc = _doc(graph)
    doc["fingerprint"] = "0" * 64
    with pytest.warns(UserWarning, match="fingerprint mismatch"):
        s = load_strategy(_write(tmp_path, doc), graph, 2)
    assert len(s) == len(graph)


def test_strategy_is_immutable(graph):
    s = dp(graph, load_topology("cpu-2"))
    s2 = s.with_config("fc0", ParallelConfig.single(1))
    assert s["fc0"].num_parts == 2 and s2["fc0"].devices == (1,)
    assert isinstance(s2, Strategy) and s2 != s


def test_strategy_file_with_refused_split(tmp_path):
    x = Operator(name="x", kind="input", outputs=(TensorSpec(shape=(4, 6)),),
                 attrs={"position": 0, "role": "input"})
    sm = Operator(name="sm", kind="softmax", inputs=(TensorRef(op="x"),), outputs=(TensorSpec(shape=(4, 6)),),
                  attrs={"axis": 1, "log": False})
    graph = OperatorGraph([x, sm], name="tiny", batch_size=4)
    doc = {"format": FORMAT, "ops": {"x": {"degrees": {}, "devices": [0]},
                                     "sm": {"degrees": {"d1": 2}, "devices": [0, 1]}}}
    with pytest.raises(StrategyError, match="op 'sm': softmax cannot be split along 'd1'"):
        load_strategy(_write(tmp_path, doc), graph, 2)


def test_strategy_file_records_the_setup_and_round_trips(tmp_path, graph):
    setup = TrainSetup(optimizer="adamw", lr=3e-4, weight_decay=0.1, bucket_mb=8.0)
    strategy = tp(graph, load_topology("cpu-2"))
    path = tmp_path / "s.json"
    save_strategy(path, strategy, graph, topology="cpu-2", num_devices=2, setup=setup)
    doc = json.loads(path.read_text())
    assert doc["format"] == "soapflow.strategy/2" and doc["setup"] == setup.to_dict()
    assert recorded_setup(doc) == setup
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same setup: no warning
        assert load_strategy(path, graph, 2, setup=setup) == strategy
        assert load_strategy(path, graph, 2) == strategy  # a reader that does not say its setup: no check


def test_version_1_strategy_files_are_still_read(tmp_path, graph):
    doc = _doc(graph)
    del doc["setup"]
    doc["format"] = "soapflow.strategy/1"
    assert recorded_setup(doc) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no setup recorded: nothing to compare
        s = load_strategy(_write(tmp_path, doc), graph, 2, setup=TrainSetup(optimizer="adamw"))
    assert s == dp(graph, load_topology("cpu-2"))


def test_a_setup_mismatch_warns_naming_the_fields_and_applies(tmp_path, graph):
    path = _write(tmp_path, _doc(graph))  # recorded: TrainSetup()
    with pytest.warns(UserWarning) as caught:
        s = load_strategy(path, graph, 2, setup=TrainSetup(optimizer="adamw", lr=0.1))
    assert s == dp(graph, load_topology("cpu-2"))
    (warning,) = [w for w in caught if "training setup" in str(w.message)]
    message = str(warning.message)
    assert "\n" not in message and "optimizer 'sgd' in the file, 'adamw' here" in message
    assert "lr 0.01 in the file, 0.1 here" in message and "momentum" not in message
    assert setup_differences(TrainSetup(), TrainSetup(bucket_mb=4.0)) == ["bucket_mb 25.0 in the file, 4.0 here"]
