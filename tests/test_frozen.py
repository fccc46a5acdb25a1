"""Frozen parameters (``requires_grad`` False): captured as such, given no gradient, synchronization, update
or optimizer state by the lowering, never sharded, and timed without their weight gradients. That the
runtime keeps them as they were is checked against single-process training in
tests/test_runtime_correctness.py (the `*_frozen` models of runtime_cases)."""

from __future__ import annotations

import dataclasses

import pytest
import runtime_cases as rc
import torch
from torch import nn

from search.baselines import parse_baseline
from search.space import ConfigSpace
from soap.capture import capture
from soap.config import ConfigError, validate
from soap.graph import OperatorGraph
from soap.lowering import GradFlow, lower
from soap.setup import TrainSetup
from soap.topology import load_topology

FROZEN = ("wpe.", "blocks.0.mlp.", "blocks.1.attn.")  # runtime_cases' transformer_frozen


def _frozen_fqn(fqn: str) -> bool:
    return fqn.startswith(FROZEN)


def test_capture_marks_frozen_parameters_and_the_graph_keeps_them():
    frozen, plain = rc.graph_of("transformer_frozen"), rc.graph_of("transformer")
    specs = [(op.name, spec) for op in frozen for spec in op.params.values()]
    assert {spec.fqn for _, spec in specs if not spec.trainable} == {
        spec.fqn for _, spec in specs if _frozen_fqn(spec.fqn)}
    assert any(spec.offset and not spec.trainable for _, spec in specs), "the fused qkv's blocks are frozen too"
    assert all(spec.trainable for op in plain for spec in op.params.values())
    again = OperatorGraph.from_dict(frozen.to_dict())
    assert [dict(op.params) for op in again] == [dict(op.params) for op in frozen]
    assert again.fingerprint == frozen.fingerprint != plain.fingerprint


def _mlp(freeze_middle: bool) -> OperatorGraph:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    if freeze_middle:
        module[2].requires_grad_(False)
    return capture(module, torch.empty(8, 16, device="meta"), torch.empty(8, dtype=torch.long, device="meta"))


def test_a_frozen_op_is_timed_without_its_weight_gradient():
    frozen, plain = _mlp(True), _mlp(False)
    middle = [op.name for op in frozen if any(not p.trainable for p in op.params.values())]
    assert len(middle) == 1
    for a, b in zip(frozen, plain, strict=True):
        assert a.fwd_flops == b.fwd_flops
        if a.name in middle:
            assert 0 < a.bwd_flops < b.bwd_flops  # the input's gradient, not the weight's
        else:
            assert a.bwd_flops == b.bwd_flops


def test_frozen_parameters_get_no_gradient_sync_update_or_optimizer_state():
    setup = TrainSetup(optimizer="adamw")
    for model in ("mlp_frozen", "transformer_frozen"):
        graph = rc.graph_of(model)
        flow = GradFlow(graph, setup)
        keys = {spec.key: spec for op in graph for spec in op.params.values()}
        assert flow.frozen == {k for k, spec in keys.items() if not spec.trainable} != set()
        assert all(flow.param_bucket[k] is None for k in flow.frozen)
        assert all(flow.param_bucket[k] is not None for k in keys.keys() - flow.frozen)
        plan = lower(graph, parse_baseline("dp")(graph, load_topology("cpu-2")), setup, 2)
        synced = {e.fqn for p in plan.params for e in p.sync}
        assert synced == {keys[k].fqn for k in keys.keys() - flow.frozen}
        # what a device keeps: each trainable parameter with its gradient and optimizer state, a frozen one alone
        per_byte = {k: (1 if k in flow.frozen else 2 + setup.optimizer_state_copies) for k in keys}
        assert [sum(p.memory_bytes.get(d, 0) for p in plan.params) for d in range(2)] == \
            [sum(keys[k].nbytes * n for k, n in per_byte.items())] * 2
        assert [sum(p.update_bytes.get(d, 0) for p in plan.params) for d in range(2)] == \
            [sum(keys[k].nbytes for k in keys.keys() - flow.frozen)] * 2


def test_a_frozen_prefix_runs_no_backward():
    graph = rc.graph_of("mlp_frozen")
    flow = GradFlow(graph, TrainSetup())
    first = next(i for i, op in enumerate(graph.ops) if op.params)
    assert not any(p.trainable for p in graph.ops[first].params.values())
    assert not flow.needs_bwd[first] and flow.needs_bwd[len(graph.ops) - 1]


def test_frozen_parameters_are_never_sharded():
    graph, topo = rc.graph_of("transformer_frozen"), load_topology("cpu-2")
    space = ConfigSpace(graph, topo)
    fsdp = parse_baseline("fsdp")(graph, topo)
    dp = parse_baseline("dp")(graph, topo)
    held = [op for op in graph if op.params]
    for op in held:
        frozen = any(not p.trainable for p in op.params.values())
        degrees = tuple(sorted(dp[op.name].degrees.items()))
        if frozen:
            assert space.shard_options(op.name, degrees) == (1,)
            assert fsdp[op.name].shard == 1
            with pytest.raises(ConfigError, match="frozen"):
                validate(op, dataclasses.replace(dp[op.name], shard=2), 2)
    assert any(fsdp[op.name].shard > 1 for op in held), "the trainable ops are still sharded"


def test_a_frozen_op_is_measured_under_its_own_key():
    from soap.costdb import Measurement, part_key
    from soap.opdef import full_box
    from soap.registry import dims_of

    frozen, plain = _mlp(True), _mlp(False)
    name = next(op.name for op in frozen if any(not p.trainable for p in op.params.values()))
    box = full_box(dims_of(frozen[name]))
    a, b = part_key(frozen[name], box, "cpu", [True]), part_key(plain[name], box, "cpu", [True])
    assert a != b and a[:-1] == b[:-1]
    # the key's flags survive a database line
    row = Measurement(device_kind="cpu", op_kind=a[1], dtype=a[2], inputs=a[3], outputs=a[4], params=a[5],
                      attrs=a[6], grads=a[7], fwd_ms=1.0, bwd_ms=1.0)
    assert Measurement.from_dict(row.to_dict()).key == a
