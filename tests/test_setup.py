"""`TrainSetup`: it checks itself, round trips through a dict, and derives what the step depends on."""

from __future__ import annotations

import dataclasses

import pytest

from soap.setup import TrainSetup


@pytest.mark.parametrize(("changes", "message"), [
    ({"optimizer": "adam"}, "unknown optimizer 'adam'"),
    ({"optimizer": "SGD"}, "unknown optimizer 'SGD'"),
    ({"lr": -1.0}, "lr must be positive, got -1.0"),
    ({"lr": 0.0}, "lr must be positive, got 0.0"),
    ({"lr": float("nan")}, "lr must be a finite number, got nan"),
    ({"lr": float("inf")}, "lr must be a finite number, got inf"),
    ({"lr": "0.1"}, "lr must be a finite number, got '0.1'"),
    ({"bucket_mb": True}, "bucket_mb must be a finite number, got True"),
    ({"weight_decay": float("nan")}, "weight_decay must be a finite number, got nan"),
    ({"precision": "fp8"}, "unknown precision 'fp8'; known: fp32, bf16, fp16"),
    ({"precision": "bfloat16"}, "unknown precision 'bfloat16'"),
    ({"schedule": "1F1B"}, "unknown schedule '1F1B'; known: gpipe, 1f1b"),
    ({"momentum": 1.0}, r"momentum must be in \[0, 1\), got 1.0"),
    ({"momentum": -0.1}, "momentum must be in"),
    ({"weight_decay": -0.01}, "weight_decay must be non-negative, got -0.01"),
    ({"bucket_mb": 0.0}, "bucket_mb must be positive, got 0.0"),
])
def test_bad_values_are_value_errors_naming_the_value(changes, message):
    with pytest.raises(ValueError, match=message):
        TrainSetup(**changes)


def test_it_is_a_frozen_keyword_only_value():
    setup = TrainSetup()
    with pytest.raises(dataclasses.FrozenInstanceError):
        setup.lr = 0.1  # type: ignore[misc]
    with pytest.raises(TypeError):
        TrainSetup("sgd")  # type: ignore[misc]
    assert TrainSetup(lr=0.1) == TrainSetup(lr=0.1) and hash(TrainSetup(lr=0.1)) == hash(TrainSetup(lr=0.1))


def test_dict_round_trip_and_unknown_keys():
    setup = TrainSetup(optimizer="adamw", lr=1e-3, weight_decay=0.01, bucket_mb=4.0)
    assert TrainSetup.from_dict(setup.to_dict()) == setup
    assert TrainSetup.from_dict({}) == TrainSetup()  # missing keys take the defaults
    with pytest.raises(ValueError, match="unknown training setup key.*betas"):
        TrainSetup.from_dict({"betas": [0.9, 0.999]})


def test_derived_figures():
    assert TrainSetup(bucket_mb=1.0).bucket_bytes == 1 << 20
    assert TrainSetup(momentum=0.0).optimizer_state_copies == 0
    assert TrainSetup(momentum=0.9).optimizer_state_copies == 1
    assert TrainSetup(optimizer="adamw").optimizer_state_copies == 2
    assert [TrainSetup(momentum=0.0).update_passes, TrainSetup().update_passes,
            TrainSetup(optimizer="adamw").update_passes] == [3, 5, 7]
    # fp16's loss scaler reads and writes every gradient once more before the update; bf16 has none
    assert [TrainSetup(optimizer="adamw", precision=p).update_passes for p in ("bf16", "fp16")] == [7, 9]


def test_mixed_precision_lowers_to_compute_dtype_activations_and_float32_masters():
    """bf16: exchanges move half the bytes, the loss stays float32, the cost model times ops at the compute
    dtype's peak, parameters keep float32 masters plus a bf16 copy; fp16 on a device without float16 is a
    clear error."""
    from test_simulator_support import mlp

    from search.baselines import tp
    from simulator.engine import Simulator
    from soap.lowering import lower, run_graph
    from soap.topology import load_topology

    graph = mlp(batch=64)
    fp32, bf16 = TrainSetup(), TrainSetup(precision="bf16")
    assert run_graph(graph, fp32) is graph
    run = run_graph(graph, bf16)
    assert [t.dtype for op in run.ops[:-1] for t in op.outputs if t.dtype.startswith(("float", "bfloat"))] == [
        "bfloat16"] * sum(1 for op in graph.ops[:-1] for t in op.outputs if t.dtype == "float32")
    assert run.ops[-1].outputs[0].dtype == "float32"
    assert all(p.dtype == "float32" for op in run for p in op.params.values())
    topo = load_topology("a100-1x2")
    strategy = tp(graph, topo)
    plans = {s.precision: lower(graph, strategy, s, 2) for s in (fp32, bf16)}
    edges = {k: sum(sum(e.recv_bytes.values()) for e in p.edges) for k, p in plans.items()}
    assert edges["bf16"] * 2 == edges["fp32"] > 0
    all_reduced = {k: sum(a.nbytes for a in p.all_reduces) for k, p in plans.items()}
    assert all_reduced["bf16"] == all_reduced["fp32"]  # gradients are reduced in float32
    params = graph.num_params
    param_mem = {k: sum(sum(s.memory_bytes.values()) for s in p.params) for k, p in plans.items()}
    assert param_mem["bf16"] - param_mem["fp32"] == params * 2  # the bf16 copy of every parameter
    times = {}
    for s in (fp32, bf16):
        sim = Simulator(graph, topo, setup=s)
        sim.full(strategy)
        times[s.precision] = sim.iteration_time_ms
    assert times["bf16"] < times["fp32"]  # an A100 runs bfloat16 at 16x its float32 peak
    with pytest.raises(ValueError, match=r"precision fp16 computes in float16, which device 0 \(k80\)"):
        Simulator(graph, load_topology("k80-1x2"), setup=TrainSetup(precision="fp16"))


def test_the_loss_scaler_divides_finite_gradients_and_skips_an_overflowing_step():
    """One process: finite gradients are divided by the scale and the step goes on; an inf or a NaN in any
    gradient skips the step and halves the scale; `growth_interval` good steps double it."""
    import torch

    from runtime.train import LossScaler

    scaler = LossScaler(scale=8.0, growth_interval=2, across_ranks=False)
    params = [torch.zeros(3, requires_grad=True), torch.zeros(2, requires_grad=True), torch.zeros(1)]
    params[0].grad, params[1].grad = torch.tensor([8.0, 16.0, -4.0]), torch.tensor([2.0, 0.0])
    assert scaler.unscale(params) and scaler.scale == 8.0
    assert params[0].grad.tolist() == [1.0, 2.0, -0.5] and params[1].grad.tolist() == [0.25, 0.0]
    for bad in (float("inf"), float("nan")):
        params[1].grad = torch.tensor([1.0, bad])
        before = scaler.scale
        assert not scaler.unscale(params) and scaler.scale == before / 2
    params[1].grad = torch.ones(2)
    assert scaler.unscale(params) and scaler.unscale(params) and scaler.scale == 4.0  # 2 good steps: doubled
    assert scaler.unscale([torch.zeros(1)])  # no gradient at all: nothing overflowed
    assert scaler.skipped == [1, 2]  # the calls that skipped, which a run reports as its skipped steps
