"""The Megatron-LM pipeline layout `hybrid:tp=T,pp=P,microbatches=M`: stages of consecutive ops on blocks
of devices, each data-parallel group's batch in M micro-batches (its devices repeated), and what the
lowering makes of it."""

from __future__ import annotations

import pytest

from search.baselines import BaselineNotApplicable, hybrid, parse_baseline, pipeline_stages
from soap.config import parts
from soap.lowering import lower
from soap.registry import dims_of
from soap.setup import TrainSetup
from soap.strategy import validate_strategy
from soap.topology import load_topology
from soapflow.api import capture_model


@pytest.fixture(scope="module")
def transformer():
    return capture_model("transformer", batch_size=16)[1]


def _stage_blocks(graph, strategy, tp, pp):
    """Per op that computes, the stage its parts run on (group s of tp devices in every replica)."""
    out = []
    for op in graph:
        if op.kind in ("input", "constant"):
            continue
        blocks = {d % (tp * pp) // tp for d in strategy[op.name].devices}
        assert len(blocks) == 1, f"{op.name} spans stages {blocks}"
        out.append(blocks.pop())
    return out


@pytest.mark.parametrize("tp, pp, micro, devices", [(1, 2, 4, 2), (2, 2, 2, 8), (1, 4, 2, 4), (2, 1, 2, 4)])
def test_stages_are_consecutive_blocks_and_micro_batches_repeat_each_groups_devices(transformer, tp, pp, micro,
                                                                                  devices):
    topo = load_topology(f"cpu-{devices}")
    s = parse_baseline(f"hybrid:tp={tp},pp={pp},microbatches={micro}")(transformer, topo)
    validate_strategy(transformer, s, devices)
    per_stage = devices // pp
    stages = _stage_blocks(transformer, s, tp, pp)
    assert stages == sorted(stages) and set(stages) == set(range(pp))  # consecutive, every stage used
    plain = hybrid(transformer, topo, tp_size=tp, pp=pp)
    groups = per_stage // tp
    for op in transformer:
        cfg, base = s[op.name], plain[op.name]
        sample = next((d for d in dims_of(op) if d.kind.name == "SAMPLE" and d.splittable), None)
        if op.kind in ("input", "constant") or sample is None or cfg.num_parts == base.num_parts:
            continue
        # M times the parts of the layout without micro-batches, on the same devices, each M times
        assert cfg.num_parts == micro * base.num_parts and cfg.degree(sample.name) == micro * base.degree(sample.name)
        assert sorted(cfg.devices) == sorted(base.devices * micro)
        # group g takes the g-th block of the batch, its micro-batches in order on each of its devices
        axis = [d.name for d in dims_of(op)].index(sample.name)
        last: dict[int, int] = {}
        for box, d in parts(op, cfg):
            lo = box[axis][0]
            assert d // (tp * pp) == lo * groups // sample.size  # replica g: devices g*tp*pp ...
            assert lo > last.get(d, -1)
            last[d] = lo


def test_a_pipeline_plan_runs_each_stage_micro_batch_after_micro_batch():
    graph = capture_model("mlp", batch_size=64)[1]
    s = parse_baseline("hybrid:tp=1,pp=2,microbatches=4")(graph, load_topology("cpu-2"))
    plan = lower(graph, s, TrainSetup(), 2)
    stage = pipeline_stages(graph, 2)
    crossing = [step for step in plan.edges
                if stage[plan.flow.edges[step.edge].src] != stage[plan.flow.edges[step.edge].dst]]
    assert crossing and all(len(step.exchanges) == 4 for step in crossing)
    # the forward reaches the second stage's first micro-batch before the first stage's last one
    at = {node: k for k, node in enumerate(plan.forward_order)}
    first1 = min(at[(i, 0)] for i in range(len(graph.ops)) if stage[i] == 1 and (i, 0) in at)
    last0 = max(at[(i, 3)] for i in range(len(graph.ops)) if stage[i] == 0 and (i, 3) in at)
    assert first1 < last0


def test_micro_batches_that_do_not_divide_the_batch_are_refused(transformer):
    with pytest.raises(ValueError, match="does not divide over the 1 data-parallel groups x 32 micro-batches"):
        parse_baseline("hybrid:tp=1,pp=2,microbatches=32")(transformer, load_topology("cpu-2"))


def test_ops_whose_micro_batch_does_not_split_over_the_group_split_their_sequence(transformer):
    """16 sequences in 2 groups of 4 micro-batches leave 2 per micro-batch, fewer than tp=4: the ops that
    tensor parallelism splits by sample within the group (LayerNorms, dropouts, residual adds) split their
    sequence over the group instead, so every op that computes still runs one part per device per
    micro-batch (none left whole, which would stop the pipeline), and the strategy is still two replicas."""
    from soap.lowering import Replicas, find_replicas

    topo = load_topology("cpu-8")
    s = parse_baseline("hybrid:tp=4,microbatches=4")(transformer, topo)
    validate_strategy(transformer, s, 8)
    plan = lower(transformer, s, TrainSetup(), 8)
    for op, step in zip(transformer, plan.ops, strict=True):
        if op.kind in ("input", "constant"):
            continue
        assert step.num_rounds == 4, op.name
    norm = s["blocks.0.ln_1"]
    sample = dims_of(transformer["blocks.0.ln_1"])[0].name
    assert norm.degree(sample) == 8 and len(norm.degrees) == 2 and norm.num_parts == 32
    assert find_replicas(transformer, s, 8) == Replicas(count=2, size=4)


def test_mp_with_micro_batches_pipelines_its_blocks():
    """``mp:microbatches=4``: the layer-wise blocks of mp, every op that computes in 4 micro-batches on its
    block's device (4 rounds there), simulated faster than plain mp; malformed specs are one-line errors."""
    from search.baselines import BaselineSpecError
    from simulator.engine import simulate

    graph = capture_model("mlp", batch_size=256)[1]
    topo = load_topology("cpu-2")
    plain, micro = parse_baseline("mp")(graph, topo), parse_baseline("mp:microbatches=4")(graph, topo)
    validate_strategy(graph, micro, 2)
    plan = lower(graph, micro, TrainSetup(), 2)
    for op, step in zip(graph, plan.ops, strict=True):
        if op.kind not in ("input", "constant"):
            assert step.num_rounds == 4 and set(step.devices) == set(plain[op.name].devices), op.name
    assert simulate(graph, micro, topo).iteration_time_ms < simulate(graph, plain, topo).iteration_time_ms
    for bad in ("mp:microbatches=0", "mp:pipes=2", "expert:microbatches=2", "mp:chunks=2,chunks=4"):
        with pytest.raises(BaselineSpecError, match="malformed baseline"):
            parse_baseline(bad)


@pytest.mark.parametrize("micro", [3, 32, 1000])
def test_mp_micro_batches_that_do_not_divide_the_batch_are_refused_as_hybrids_are(micro):
    """``mp:microbatches=M`` where M does not divide the batch (or exceeds it) refuses, as hybrid's
    micro-batches do, rather than train plain mp under its name."""
    batch = 16
    graph = capture_model("mlp", batch_size=batch)[1]
    topo = load_topology("cpu-2")
    with pytest.raises(BaselineNotApplicable, match=rf"batch \({batch}\) does not divide into {micro} micro-batches"):
        parse_baseline(f"mp:microbatches={micro}")(graph, topo)
    with pytest.raises(BaselineNotApplicable, match=f"x {micro} micro-batches"):
        parse_baseline(f"hybrid:tp=1,pp=2,microbatches={micro}")(graph, topo)
