"""The cost database file (corrupt lines skipped with a warning, atomic writes, later lines win), the
measured cost model over it, and reuse of measurements by `runtime.measure.measure_parts`."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest

from simulator.costmodel import AnalyticalCostModel, MeasuredCostModel
from soap import costdb
from soap.costdb import CostDatabase, CostDatabaseError, Measurement
from soap.registry import dims_of
from soap.topology import load_topology


def meas(op_kind: str = "linear", fwd_ms: float = 1.0, bwd_ms: float = 2.0, n: int = 8) -> Measurement:
    return Measurement(device_kind="cpu", op_kind=op_kind, inputs=[[n, 4]], outputs=[[n, 3]],
                       params=[[3], [3, 4]], fwd_ms=fwd_ms, bwd_ms=bwd_ms, repeats=5, source="test")


@pytest.fixture(scope="module")
def tiny_graph():
    from soap.capture import capture
    from soapflow.models import default_loss
    from soapflow.zoo.mlp import mlp

    module, (x, target) = mlp(4, sizes=(8, 16, 4))
    return capture(module, x, target, default_loss, name="tiny", batch_size=4)


def test_round_trip_and_later_lines_win(tmp_path: Path) -> None:
    path = tmp_path / "db.jsonl"
    costdb.append(path, [meas(fwd_ms=1.0)])
    costdb.append(path, [meas(fwd_ms=3.0), meas(n=16)])
    db = costdb.load(path)
    assert len(db) == 2
    assert db.lookup(meas().key).fwd_ms == 3.0
    assert CostDatabase.load(path).lookup(meas(n=16).key) == meas(n=16)
    db.save(tmp_path / "copy.jsonl")
    assert len((tmp_path / "copy.jsonl").read_text().splitlines()) == 2


def test_corrupt_lines_are_skipped_with_a_warning(tmp_path: Path) -> None:
    path = tmp_path / "db.jsonl"
    good = json.dumps(meas().to_dict())
    bad_value = json.dumps({**meas(n=16).to_dict(), "fwd_ms": -1})
    path.write_text("\n".join([good, '{"device_kind": "cpu", "op_k', "[1, 2]", bad_value, "", "not json"]) + "\n")
    with pytest.warns(UserWarning) as caught:
        db = costdb.load(path)
    assert len(db) == 1 and db.lookup(meas().key) is not None
    skipped = [str(w.message) for w in caught if "skipped" in str(w.message)]
    assert [m.split(" line ")[1].split()[0] for m in skipped] == ["2", "3", "4", "6"]


def test_torn_last_line_stays_on_its_own_line(tmp_path: Path) -> None:
    path = tmp_path / "db.jsonl"
    path.write_text(json.dumps(meas().to_dict()) + '\n{"device_kind": "cp')  # a crashed writer
    costdb.append(path, [meas(n=16)])
    with pytest.warns(UserWarning, match="line 2 skipped"):
        db = costdb.load(path)
    assert len(db) == 2


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(CostDatabaseError, match="does not exist"):
        costdb.load(tmp_path / "none.jsonl")
    assert len(costdb.load(tmp_path / "none.jsonl", missing_ok=True)) == 0


def test_writes_are_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "db.jsonl"
    costdb.append(path, [meas()])
    before = path.read_text()

    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(costdb.os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        costdb.append(path, [meas(n=16)])
    monkeypatch.undo()
    assert path.read_text() == before  # the old file is untouched
    assert os.listdir(tmp_path) == ["db.jsonl"]  # and no temporary file is left behind


def test_measured_cost_model_reads_the_database_with_fallback(tiny_graph, tmp_path: Path) -> None:
    device = load_topology("cpu-2").devices[0]
    op = next(o for o in tiny_graph if o.kind == "linear")
    box = tuple((0, d.size) for d in dims_of(op))
    key = costdb.part_key(op, box, "cpu")
    kind, op_kind, dtype, inputs, outputs, params, attrs, grads = key
    m = Measurement(device_kind=kind, op_kind=op_kind, dtype=dtype, inputs=inputs, outputs=outputs,
                    params=params, attrs=attrs, grads=grads, fwd_ms=0.5, bwd_ms=0.75)
    model = MeasuredCostModel(CostDatabase([m]), overhead_ms=0.25)
    assert model.compute_ms(op, box, device) == (0.75, 1.0)
    half = ((0, 2),) + box[1:]
    assert model.compute_ms(op, half, device) == AnalyticalCostModel().compute_ms(op, half, device)
    assert (model.hits, model.misses) == (1, 1)
    # a whole op is priced with its solo times (the other devices wait), a split one with concurrent times
    kind, op_kind, dtype, inputs, outputs, params, attrs, grads = costdb.part_key(op, half, "cpu")
    m_half = Measurement(device_kind=kind, op_kind=op_kind, dtype=dtype, inputs=inputs, outputs=outputs,
                         params=params, attrs=attrs, grads=grads, fwd_ms=0.5, bwd_ms=0.5, solo_fwd_ms=0.25,
                         solo_bwd_ms=0.25)
    m_solo = Measurement(**{**m.to_dict(), "solo_fwd_ms": 0.125, "solo_bwd_ms": 0.375})
    assert Measurement.from_dict(m_solo.to_dict()) == m_solo
    model = MeasuredCostModel(CostDatabase([m_solo, m_half]))
    assert model.compute_ms(op, box, device) == (0.125, 0.375)
    assert model.compute_ms(op, half, device) == (0.5, 0.5)
    assert MeasuredCostModel(CostDatabase([m_solo]), solo=False).compute_ms(op, box, device) == (0.5, 0.75)
    with pytest.raises(ValueError, match="together"):
        Measurement(**{**m.to_dict(), "solo_fwd_ms": 0.125})
    # the step's factor multiplies the measured time, then the overhead is added; fallback times are untouched
    scaled = MeasuredCostModel(CostDatabase([m_solo, m_half]), overhead_ms=0.25, scale=2.0)
    assert scaled.compute_ms(op, box, device) == (0.5, 1.0)
    assert scaled.compute_ms(op, half, device) == (1.25, 1.25)
    with pytest.raises(ValueError, match="overhead_ms"):
        MeasuredCostModel(CostDatabase(), overhead_ms=-1)
    with pytest.raises(ValueError, match="scale"):
        MeasuredCostModel(CostDatabase(), scale=0.0)


def test_measure_parts_reuses_measured_keys(tiny_graph, tmp_path: Path) -> None:
    import torch

    from runtime.measure import measure_parts, part_jobs
    from search.baselines import dp
    from soap.config import ParallelConfig
    from soap.strategy import Strategy

    torch.set_num_threads(1)
    topo = load_topology("cpu-2")
    single = Strategy({op.name: ParallelConfig.single(0) for op in tiny_graph})
    jobs = part_jobs(tiny_graph, [single, dp(tiny_graph, topo), single])
    kinds = {j.op["kind"] for j in jobs}
    assert "input" not in kinds and "linear" in kinds
    keys = {costdb.part_key(j.operator(), j.box, "cpu", j.needs_grad) for j in jobs}
    assert len(keys) == len(jobs)  # each distinct part once
    path = tmp_path / "db.jsonl"
    db, timed = measure_parts(jobs[:3], os.fspath(path), warmup=1, repeats=3, device="cpu")
    assert timed == 3 and len(costdb.load(path)) == 3
    with pytest.raises(ValueError, match="nproc 1"):
        measure_parts(jobs, os.fspath(path), nproc=2, device="cuda:0")
    db, timed = measure_parts(jobs, os.fspath(path), warmup=1, repeats=3)
    assert timed == len(jobs) - 3  # the first three are not timed again
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = costdb.load(path)
    assert len(again) == len(jobs) and all(m.fwd_ms > 0 and m.source == "runtime" for m in again)
    model = MeasuredCostModel(again)
    device = topo.devices[0]
    for j in jobs:
        model.compute_ms(j.operator(), j.box, device, j.needs_grad)
    assert model.misses == 0


def test_a_part_whose_input_carries_a_gradient_is_keyed_apart() -> None:
    """An MLP whose first layer (reading the batch: no input gradient) has the shapes of a later one
    (whose backward also computes the input gradient): two parts to time, and the simulator looks each
    up with the flags the graph gives it."""
    from runtime.measure import part_jobs
    from soap.capture import capture
    from soap.config import ParallelConfig
    from soap.lowering import GradFlow
    from soap.setup import TrainSetup
    from soap.strategy import Strategy
    from soapflow.models import default_loss
    from soapflow.zoo.mlp import mlp

    module, (x, target) = mlp(8, sizes=(32, 32, 32, 32))
    graph = capture(module, x, target, default_loss, name="square", batch_size=8)
    single = Strategy({op.name: ParallelConfig.single(0) for op in graph})
    linears = [j for j in part_jobs(graph, [single]) if j.op["kind"] == "linear"]
    assert sorted(j.needs_grad for j in linears) == [(False,), (True,)]  # three layers, two keys
    facts = GradFlow(graph, TrainSetup())
    first, *rest = [op for op in graph if op.kind == "linear"]
    assert facts.grad_inputs[facts.index[first.name]] == (False,)
    assert all(facts.grad_inputs[facts.index[op.name]] == (True,) for op in rest)
    box = tuple((0, d.size) for d in dims_of(first))
    keys = {costdb.part_key(op, box, "cpu", facts.grad_inputs[facts.index[op.name]]) for op in (first, *rest)}
    assert len(keys) == 2 and {k[-1] for k in keys} == {"0", "1"}
    # priced from the matching measurement
    fast = Measurement(**dict(zip(("device_kind", "op_kind", "dtype", "inputs", "outputs", "params", "attrs", "grads"),
                                  costdb.part_key(first, box, "cpu", (False,)), strict=True)), fwd_ms=1.0, bwd_ms=1.0)
    slow = Measurement(**{**fast.to_dict(), "grads": "1", "bwd_ms": 2.0})
    model = MeasuredCostModel(CostDatabase([fast, slow]))
    device = load_topology("cpu-2").devices[0]
    assert model.compute_ms(first, box, device, (False,))[1] == 1.0
    assert model.compute_ms(rest[0], box, device, (True,))[1] == 2.0
    with pytest.raises(ValueError, match="grads"):
        Measurement(**{**fast.to_dict(), "grads": "2"})
    # a line written before keys had the flags serves any lookup that finds nothing better
    old = Measurement(**{**fast.to_dict(), "grads": "", "bwd_ms": 3.0})
    model = MeasuredCostModel(CostDatabase([old, slow]))
    assert model.compute_ms(first, box, device, (False,))[1] == 3.0
    assert model.compute_ms(rest[0], box, device, (True,))[1] == 2.0


def test_every_cost_model_pickles_and_prices_as_before(tiny_graph) -> None:
    """A search worker that starts afresh (where processes cannot fork) receives its cost model pickled:
    the analytical model with overrides, the fixed one with per-op times and the measured one (with its
    database and fallback) come back equal and price every part of the graph as before."""
    import pickle

    from simulator.costmodel import FixedCostModel
    device = load_topology("cpu-2").devices[0]
    op = next(o for o in tiny_graph if o.kind == "linear")
    box = tuple((0, d.size) for d in dims_of(op))
    kind, op_kind, dtype, inputs, outputs, params, attrs, grads = costdb.part_key(op, box, "cpu")
    m = Measurement(device_kind=kind, op_kind=op_kind, dtype=dtype, inputs=inputs, outputs=outputs,
                    params=params, attrs=attrs, grads=grads, fwd_ms=0.5, bwd_ms=0.75)
    analytical = AnalyticalCostModel(efficiency={"cpu": {"linear": 0.25}}, launch_us={"cpu": 3.0}, update_scale=2.0)
    models = [AnalyticalCostModel(), analytical, FixedCostModel(fwd_each_ms=0.5, per_op_ms={op.name: (1.0, 2.0)}),
              MeasuredCostModel(CostDatabase([m]), analytical, overhead_ms=0.25, scale=1.5)]
    for model in models:
        again = pickle.loads(pickle.dumps(model))
        assert type(again) is type(model)
        for o in tiny_graph:
            whole = tuple((0, d.size) for d in dims_of(o))
            assert again.compute_ms(o, whole, device) == model.compute_ms(o, whole, device), (model, o.name)
        assert again.update_ms(1 << 20, device, 5) == model.update_ms(1 << 20, device, 5)
    assert pickle.loads(pickle.dumps(analytical)) == analytical != AnalyticalCostModel()
    assert pickle.loads(pickle.dumps(models[3])).compute_ms(op, box, device) == (1.0, 1.375)
