"""`search.structure` and `search.moves`: copies of repeated blocks are found, the tied, copy,
propagation and spread moves change what they say, and a chain that makes moves over several ops keeps its
evaluator in step with the strategy it holds."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest
import runtime_cases as rc
from test_search_fixtures import GRAPHS, mlp
from test_simulator_delta import accept_or_reject, propose_and_check

import search.moves as search_moves
from search.baselines import dp, parse_baseline, tp
from search.evaluate import WHOLE_SHARE, Move, SimulatorEvaluators
from search.mcmc import _Chain
from search.moves import (
    COPY_SHARE,
    MODULE_SHARE,
    PROPAGATION_SHARE,
    SPREAD_SHARE,
    STAGE_SHARE,
    TIED_SHARE,
    Moves,
    stages_of,
)
from search.space import MICROBATCH_COUNTS, ConfigSpace, cut_chunks, microbatched, split_microbatches
from search.structure import carried, copies_of, modules_of, neighbours
from simulator import AnalyticalCostModel, Simulator
from simulator.engine import simulate
from soap.config import ParallelConfig, repeat_refusal, validate
from soap.setup import TrainSetup
from soap.topology import DeviceTopology, load_topology


def test_copies_are_the_same_op_of_each_block():
    graph = rc.graph_of("transformer")  # the zoo's GPT with 2 blocks
    copies = copies_of(graph)
    classes = {members[0]: members for members in copies.classes}
    assert classes["blocks.0.attn.qkv.a"] == ("blocks.0.attn.qkv.a", "blocks.1.attn.qkv.a")
    assert classes["blocks.0.mlp.fc"] == ("blocks.0.mlp.fc", "blocks.1.mlp.fc")
    for members in copies.classes:
        ops = [graph[m] for m in members]
        assert len({op.kind for op in ops}) == 1 and len({op.outputs for op in ops}) == 1
        assert len({tuple((k, p.shape) for k, p in op.params.items()) for op in ops}) == 1
    # the ops of one block share a copy index: block 1's op of each class
    same = copies.same_copy("blocks.1.attn.qkv.a")
    assert set(same.values()) >= {"blocks.1.attn.qkv.b", "blocks.1.attn.proj", "blocks.1.mlp.fc", "blocks.1.mlp.proj"}
    assert all(copies.index[m] == copies.index["blocks.1.attn.qkv.a"] for m in same.values())
    # ops that differ in shape are no copies: the MLP's two linears (1024 -> 4096 -> 1024)
    assert copies_of(GRAPHS["mlp"]()).classes == ()


def test_neighbours_are_producers_then_consumers_without_sources():
    graph = GRAPHS["mlp"]()
    near = neighbours(graph)
    assert near["relu0"] == ["fc0", "fc1"] and near["fc0"] == ["relu0"] and near["loss"] == ["fc1"]


def test_moves_are_tied_copied_propagated_or_single_and_stay_in_the_space():
    graph, topo = rc.graph_of("transformer"), load_topology("p100-2x2")
    space = ConfigSpace(graph, topo)
    moves = Moves(graph, space)
    copies = moves.copies
    rng = random.Random(0)
    current = dp(graph, topo)
    kinds = Counter()
    for _ in range(4000):
        changes = moves.propose(rng, current)
        assert all(space.contains(m, cfg) and cfg != current[m] for m, cfg in changes.items())
        if len(changes) > 1:
            classes = {k for m in changes for k, members in enumerate(copies.classes) if m in members}
            kinds["several"] += 1
            # a tied move: one config for every copy it changes (unless it is a stage move, which gives
            # each op its own layout in one micro-batch count, or a spread move, an op and neighbours of it)
            spread = any(set(changes) <= {m, *near} for m, near in moves.near.items())
            kinds["spread"] += spread
            if len(classes) == 1 and _stage_count(space, current, changes) is None and not spread:
                assert len({cfg for cfg in changes.values()}) == 1
        else:
            kinds["one"] += 1
        if changes and rng.random() < 0.3:
            current = current.with_configs(changes)
    # tied, copy and spread moves change several ops; single and propagation moves one
    assert kinds["several"] > 0.2 * 4000 * (TIED_SHARE + COPY_SHARE) and kinds["one"] > 0.5 * 4000 * (
        1 - TIED_SHARE - COPY_SHARE - PROPAGATION_SHARE - SPREAD_SHARE)
    assert kinds["spread"] > 0.2 * 4000 * SPREAD_SHARE


def test_a_copy_move_gives_every_block_the_layout_of_one():
    graph, topo = rc.graph_of("transformer"), load_topology("p100-2x2")
    space = ConfigSpace(graph, topo)
    moves = Moves(graph, space)
    rng = random.Random(3)
    # block 0 with a layout of its own, block 1 data parallel
    current = dp(graph, topo)
    block0 = {m: space.sample(m, rng) for members in moves.copies.classes for m in members
              if moves.copies.index[m][0] == 0}
    current = current.with_configs(block0)
    for _ in range(200):
        changes = moves.propose(rng, current)
        if changes and all(moves.copies.index.get(m, (None,))[0] == 1 for m in changes) and len(changes) > 4:
            # every changed op of block 1 takes the config of its copy in block 0
            for m, cfg in changes.items():
                assert cfg == current[m.replace("blocks.1.", "blocks.0.")]
            return
    raise AssertionError("no copy move from block 0 in 200 proposals")


def test_modules_are_classes_of_the_same_module_in_each_block():
    graph = rc.graph_of("transformer")
    modules = {tuple(ops[0] for ops in cls): cls for cls in modules_of(graph)}
    attention = next(cls for cls in modules_of(graph) if graph[cls[0][0]].module.startswith("blocks.0.attn"))
    assert len(attention) == 2  # one module per block
    for block, ops in enumerate(attention):
        assert all(graph[m].module.startswith(f"blocks.{block}.attn") for m in ops)
        assert {graph[m].kind for m in ops} >= {"linear", "attention"}
    # every module holds two ops or more, and no class repeats another's ops
    assert all(len(ops) >= 2 for cls in modules.values() for ops in cls)
    assert len({ops for cls in modules.values() for ops in cls}) == sum(len(cls) for cls in modules.values())


def test_a_module_move_grafts_a_references_layout_onto_whole_modules():
    """Given references, some moves set every op of one module (or of each copy of it) to a reference's
    configs, and leave every other op as it was."""
    graph, topo = rc.graph_of("transformer"), load_topology("p100-2x2")
    space = ConfigSpace(graph, topo)
    reference = tp(graph, topo)
    moves = Moves(graph, space, [reference])
    assert Moves(graph, space).modules == []  # without references there is nothing to graft
    module_ops = {ops: cls for cls in moves.modules for ops in cls}
    rng = random.Random(1)
    current = dp(graph, topo)
    grafts = 0
    for _ in range(600):
        changes = moves.propose(rng, current)
        if len(changes) > 1 and all(cfg == reference[m] for m, cfg in changes.items()):
            after = current.with_configs(changes)
            # the modules it changed now hold the reference's layout throughout (all of a class's copies,
            # or one of them)
            grafted = [ops for ops in module_ops if all(after[m] == reference[m] for m in ops)
                       and any(m in changes for m in ops)]
            if grafted and set(changes) <= {m for ops in grafted for m in ops}:
                grafts += 1
    assert grafts > 0.2 * 600 * MODULE_SHARE


def test_a_chain_of_several_op_moves_stays_in_step_with_its_evaluator():
    """After many accepted and rejected moves over several ops, the chain's cost is the full simulation
    of the strategy it holds: a rejected move is undone op by op."""
    graph, topo = rc.graph_of("transformer"), load_topology("p100-2x2")
    evaluators = SimulatorEvaluators()
    start = dp(graph, topo)
    chain = _Chain("dp", start, evaluators(graph, topo), Moves(graph, ConfigSpace(graph, topo)), random.Random(5),
                   beta_per_ms=0.0, beta_scale=100, max_proposals=None)
    for _ in range(300):
        chain.step()
    assert chain.num_accepted > 0
    full = simulate(graph, chain.current, topo)
    assert full.iteration_time_ms == chain.cost.time_ms and max(full.peak_memory_bytes) == chain.cost.peak_memory_bytes


def test_a_move_over_two_ops_with_different_configs_costs_what_it_changes_to():
    """A two-op move (costed op by op) with a different config per op costs its strategy exactly, and a
    rejection leaves the evaluator on the strategy it started from."""
    graph, topo = rc.graph_of("transformer"), load_topology("p100-2x2")
    space = ConfigSpace(graph, topo)
    evaluator = SimulatorEvaluators()(graph, topo)
    start = dp(graph, topo)
    evaluator.start(start)
    linears = [op.name for op in graph if op.kind == "linear"]
    first, second = linears[0], linears[-1]
    cfg_first = next(c for c in space.configs(first) if c != start[first])
    cfg_second = next(c for c in space.configs(second) if c not in (start[second], cfg_first))
    move = Move(evaluator, start, {first: cfg_first, second: cfg_second})
    assert move.cost.time_ms == simulate(graph, move.strategy, topo).iteration_time_ms
    move.reject()
    assert evaluator.propose(first, start[first]).time_ms == simulate(graph, start, topo).iteration_time_ms


@pytest.mark.parametrize("which", ["linears", "most ops"])
def test_a_rejected_move_over_many_ops_leaves_the_evaluator_on_its_strategy(which):
    """A move over many ops is one delta simulation (`Simulator.propose_many`), or, over more than
    `WHOLE_SHARE` of the ops, a full simulation on the evaluator's spare simulator: rejected, the
    evaluator still describes the current strategy (a delta from it costs what the full simulation says);
    accepted, the changed one."""
    graph, topo = rc.graph_of("transformer"), load_topology("p100-2x2")
    evaluator = SimulatorEvaluators()(graph, topo)
    start = dp(graph, topo)
    evaluator.start(start)
    space = ConfigSpace(graph, topo)
    linears = [op.name for op in graph if op.kind == "linear"]
    names = linears if which == "linears" else [n for n in space.ops if space.contains(n, ParallelConfig.single(1))]
    changes = {name: ParallelConfig.single(1) for name in names}
    assert len(changes) > 2
    assert (len(changes) > WHOLE_SHARE * len(graph)) == (which == "most ops")
    move = Move(evaluator, start, changes)
    assert move.cost.time_ms == simulate(graph, move.strategy, topo).iteration_time_ms
    move.reject()
    first = linears[0]
    cfg = ParallelConfig.single(0)
    expected = simulate(graph, start.with_config(first, cfg), topo).iteration_time_ms
    assert evaluator.propose(first, cfg).time_ms == expected
    evaluator.reject()
    move = Move(evaluator, start, changes)
    move.accept()
    changed = move.strategy
    expected = simulate(graph, changed.with_config(first, cfg), topo).iteration_time_ms
    assert evaluator.propose(first, cfg).time_ms == expected
    evaluator.reject()


@pytest.mark.parametrize("which", ["linears", "most ops"])
def test_a_move_that_does_not_fit_is_decided_on_memory_and_made_only_when_accepted(which):
    """On devices that hold dp exactly, a move onto one device does not fit: its cost comes from the plans
    alone (the peak a full simulation finds, time not taken), no proposal is left pending (no task was
    made); rejected, the evaluator is on its strategy; accepted (as a chain that does not fit itself
    would), it holds the changed strategy, timed as a full simulation times it."""
    graph, base = rc.graph_of("transformer"), load_topology("p100-2x2")
    start = dp(graph, base)
    held = max(simulate(graph, start, base).peak_memory_bytes)
    topo = DeviceTopology(name="tight", devices=tuple(dataclasses.replace(d, memory_bytes=held)
                                                      for d in base.devices), links=base.links)
    space = ConfigSpace(graph, topo)
    linears = [op.name for op in graph if op.kind == "linear"]
    names = linears if which == "linears" else [n for n in space.ops if space.contains(n, ParallelConfig.single(1))]
    changes = {name: ParallelConfig.single(1) for name in names}
    assert (len(changes) > WHOLE_SHARE * len(graph)) == (which == "most ops")
    evaluator = SimulatorEvaluators()(graph, topo)
    assert evaluator.start(start).feasible
    full = simulate(graph, start.with_configs(changes), topo)
    assert not full.feasible
    for accept in (False, True):
        move = Move(evaluator, start, changes, limit_ms=1e9)
        assert not move.cost.feasible and not move.cost.exact and move.cost.time_ms == 0.0
        assert move.cost.peak_memory_bytes == max(full.peak_memory_bytes)
        assert move.cost.memory_excess_bytes == max(p - held for p in full.peak_memory_bytes)
        assert not evaluator.sim.pending and evaluator.sim.strategy == start
        if not accept:
            move.reject()
            assert evaluator.sim.strategy == start
            assert evaluator.propose_many({}).time_ms == simulate(graph, start, topo).iteration_time_ms
            evaluator.reject()
        else:
            move.accept()
            assert evaluator.sim.strategy == move.strategy and not evaluator.sim.pending
            assert evaluator.sim.iteration_time_ms == full.iteration_time_ms
            assert evaluator.sim.peak_memory_bytes == full.peak_memory_bytes


def test_a_trial_slower_than_the_limit_on_compute_alone_is_decided_from_its_plans():
    """A move over most ops whose compute on one device alone exceeds the chain's limit gets that lower bound
    (not exact) without being built; without a limit it is timed; adopted all the same, the evaluator
    holds it, timed as a full simulation times it."""
    graph, topo = rc.graph_of("transformer"), load_topology("p100-2x2")
    evaluator = SimulatorEvaluators()(graph, topo)
    start = dp(graph, topo)
    limit = evaluator.start(start).time_ms
    space = ConfigSpace(graph, topo)
    changes = {n: ParallelConfig.single(1) for n in space.ops if space.contains(n, ParallelConfig.single(1))}
    assert len(changes) > WHOLE_SHARE * len(graph)
    full = simulate(graph, start.with_configs(changes), topo)
    assert full.feasible
    move = Move(evaluator, start, changes, limit_ms=limit)
    assert not move.cost.exact and move.cost.feasible and limit < move.cost.time_ms <= full.iteration_time_ms
    assert move.cost.peak_memory_bytes == max(full.peak_memory_bytes)
    move.reject()
    assert evaluator.sim.strategy == start and not evaluator.sim.pending
    move = Move(evaluator, start, changes)
    assert move.cost.exact and move.cost.time_ms == full.iteration_time_ms
    move.reject()
    move = Move(evaluator, start, changes, limit_ms=limit)
    move.accept()
    assert evaluator.sim.strategy == move.strategy and evaluator.sim.iteration_time_ms == full.iteration_time_ms


def step_and_check(sim: Simulator, ref: Simulator, current, changes, k: int, rng: random.Random, every: int = 5):
    """Propose the move `changes` (proposal `k`) to `sim` op by op, each step checked against `ref`'s full
    simulation (`propose_and_check`), then accept or reject it at random (`accept_or_reject`); a rejected
    move over several ops is undone op by op, checked again. Returns the chain's strategy."""
    items = list(changes.items())
    peeked = sim.peek_peaks(changes)  # the whole move's memory, from the plans alone
    state = current
    for name, cfg in items[:-1]:
        state = propose_and_check(sim, ref, state, name, cfg, k, every)
        sim.accept()
    name, cfg = items[-1]
    proposed = propose_and_check(sim, ref, state, name, cfg, k, every)
    assert peeked == ref.peak_memory_bytes, f"proposal {k}: {changes}"
    if accept_or_reject(sim, ref, state, proposed, k, rng, every, check_times=True) is proposed:
        return proposed
    for name, _ in reversed(items[:-1]):
        state = propose_and_check(sim, ref, state, name, current[name], k, every)
        sim.accept()
    assert sim.strategy == current
    return current


def _layout_of(space, name, cfg):
    """The config `cfg` of op `name` without its micro-batches (its chunks kept: the layout a micro-batch
    move keeps)."""
    chunks = space.split_chunks(name, cfg)
    base = split_microbatches(space.graph[name], chunks.rest).base
    return base if chunks.count == 1 else cut_chunks(space.graph[name], base, chunks.dim, chunks.count)


def _stage_count(space, before, changes) -> int | None:
    """The micro-batch count where `changes` gives every op it changes that one count, each keeping its
    layout (a stage move's changes); None otherwise."""
    counts = {space.microbatch_count(m, cfg) for m, cfg in changes.items()}
    if len(counts) != 1 or None in counts or any(space.microbatch_count(m, before[m]) is None for m in changes):
        return None
    if any(_layout_of(space, m, cfg) != _layout_of(space, m, before[m]) for m, cfg in changes.items()):
        return None
    return counts.pop()


def _micro_move(graph, before, changes) -> tuple[str, int, int] | None:
    """(op, count before, count after) where `changes` is one op's micro-batch move (its base kept)."""
    if len(changes) != 1:
        return None
    [(name, cfg)] = changes.items()
    old, new = split_microbatches(graph[name], before[name]), split_microbatches(graph[name], cfg)
    return (name, old.count, new.count) if old and new and old.base == new.base else None


def _pipelined(strategy, names) -> bool:
    """Whether both stages of a two-device pipeline run micro-batches: ops whose devices repeat on device 0
    alone and on device 1 alone."""
    repeating = {frozenset(strategy[n].devices) for n in names if len(set(strategy[n].devices)) < strategy[n].num_parts}
    return {frozenset({0}), frozenset({1})} <= repeating


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("spec", ["hybrid:tp=1,pp=2", "hybrid:tp=1,pp=2,microbatches=4"])
def test_moves_from_a_pipeline_propose_micro_batches_that_delta_simulation_times_as_full(spec: str, schedule: str):
    """The zoo's MLP in two pipeline stages on two devices: the moves give ops micro-batches, change their
    count and take them away, and delta simulation times every proposal exactly as a full simulation does
    (proposals accepted or rejected at random), pipelines with micro-batches on both stages included."""
    graph, topo = rc.graph_of("mlp"), load_topology("cpu-2")
    setup = TrainSetup(schedule=schedule)
    start = parse_baseline(spec)(graph, topo)
    space = ConfigSpace(graph, topo)
    moves = Moves(graph, space)
    sim, ref = (Simulator(graph, topo, AnalyticalCostModel(), setup=setup) for _ in range(2))
    sim.full(start)
    rng = random.Random(4)
    current, micro_moves, pipelined, stage_moves = start, Counter(), 0, 0
    for k in range(300):
        changes = moves.propose(rng, current)
        if not changes:
            continue
        stage_moves += len(changes) > 1 and _stage_count(space, current, changes) is not None
        move = _micro_move(graph, current, changes)
        if move is not None:
            micro_moves[move[1:]] += 1
        pipelined += _pipelined(current.with_configs(changes), space.ops)
        current = step_and_check(sim, ref, current, changes, k, rng)
    assert {new for _, new in micro_moves} == {1, *MICROBATCH_COUNTS}
    assert any(old == 1 for old, _ in micro_moves) and any(old > 1 and new == 1 for old, new in micro_moves)
    assert pipelined > 0 or "microbatches" not in spec
    assert stage_moves > 0  # (several ops in one proposal, stepped op by op above)
    fresh = Simulator(graph, topo, AnalyticalCostModel(), setup=setup).full(current)
    assert sim.timeline().task_times() == fresh.task_times()


@pytest.mark.parametrize("spec", ["hybrid:tp=1,pp=2", "hybrid:tp=1,pp=2,microbatches=4"])
def test_a_chain_from_a_pipeline_makes_micro_batch_moves_in_step_with_its_evaluator(spec: str):
    """A chain that starts from a two-stage pipeline (with the baselines as references) makes micro-batch
    moves among its proposals (giving micro-batches from the plain pipeline, changing or removing them from
    the micro-batched one), and its cost is the full simulation of what it holds."""
    graph, topo = rc.graph_of("mlp"), load_topology("cpu-2")
    start = parse_baseline(spec)(graph, topo)
    space = ConfigSpace(graph, topo)
    moves = Moves(graph, space, [dp(graph, topo), tp(graph, topo)])
    assert all(space.contains(n, start[n]) for n in space.ops)
    made = []
    propose = moves.propose

    def recording(rng, current):
        changes = propose(rng, current)
        made.append(_micro_move(graph, current, changes))
        return changes

    moves.propose = recording
    # a hot chain (a proposal 1% slower is accepted with probability e^-0.01), which wanders
    chain = _Chain("pipeline", start, SimulatorEvaluators()(graph, topo), moves, random.Random(2), beta_per_ms=0.0,
                   beta_scale=1, max_proposals=None)
    held = 0
    for _ in range(300):
        chain.step()
        held += any(len(set(chain.current[n].devices)) < chain.current[n].num_parts for n in space.ops)
    micro = [m for m in made if m is not None]
    assert any(old == 1 < new for _, old, new in micro) if spec.endswith("pp=2") else \
        any(old == 4 != new for _, old, new in micro)
    assert chain.num_accepted > 0 and held > 0
    full = simulate(graph, chain.current, topo)
    assert full.iteration_time_ms == chain.cost.time_ms and max(full.peak_memory_bytes) == chain.cost.peak_memory_bytes


def test_propagation_carries_micro_batches_and_drops_a_shard_they_refuse():
    """A neighbour's micro-batched layout carries over to a sharded op without the shard where repeated
    devices refuse it, and with it where they do not; a layout without repeats keeps the shard."""
    graph, topo = GRAPHS["mlp"](), load_topology("cpu-2")
    own = ParallelConfig(degrees={"sample": 2}, devices=(0, 1), shard=2)
    validate(graph["fc0"], own, topo.num_devices)
    plain = ParallelConfig(degrees={"sample": 2}, devices=(1, 0))
    assert carried(graph, "fc0", own, plain, topo.num_devices) == plain.replace(shard=2)
    micro = microbatched(graph["relu0"], ParallelConfig(degrees={"sample": 2}, devices=(0, 1)), 4)
    cfg = carried(graph, "fc0", own, micro, topo.num_devices)
    refused = repeat_refusal(graph["fc0"], micro.replace(shard=2)) is not None
    assert cfg == micro.replace(shard=1 if refused else 2)
    assert ConfigSpace(graph, topo).contains("fc0", cfg)


def test_carried_follows_the_tensor_between_a_producer_and_its_consumer():
    """A dim the op does not have by name carries over to the dim that indexes the same axis of the tensor
    between the two ops: a linear split on its output features to its loss split on that axis of its
    input (`d1`), and back; without `other_op` nothing carries it. Dims shared by name keep their names."""
    graph, topo = mlp(64, (32, 32)), load_topology("cpu-2")
    space = ConfigSpace(graph, topo)
    own = ParallelConfig(degrees={"sample": 2}, devices=(0, 1))
    column = ParallelConfig(degrees={"out_features": 2, "sample": 2}, devices=(0, 1, 0, 1))
    loss = carried(graph, "loss", own, column, topo.num_devices, other_op="fc0")
    assert loss == ParallelConfig(degrees={"d1": 2, "sample": 2}, devices=(0, 1, 0, 1))
    assert space.contains("loss", loss)
    assert carried(graph, "fc0", own, loss, topo.num_devices, other_op="loss") == column
    assert carried(graph, "loss", own, column, topo.num_devices) is None
    # the loss reads the linear's output where it is (and each device holds its half of the weight whole):
    # nothing moves, where the loss split on the sample alone needs the output gathered
    strategy = dp(graph, topo).with_configs({"fc0": column, "loss": loss})
    assert simulate(graph, strategy, topo).bytes_moved == 0
    assert simulate(graph, strategy.with_config("loss", own), topo).bytes_moved > 0


def test_a_spread_move_gives_the_neighbours_the_drawn_layout(monkeypatch):
    """A spread move draws a config for one op and gives each neighbour that config's layout along the
    tensor between them (`carried`): the linear split on its output features and its loss on that axis,
    in one proposal, about `SPREAD_SHARE` of the time."""
    graph, topo = mlp(64, (32, 32)), load_topology("cpu-2")
    for share in ("TIED_SHARE", "COPY_SHARE", "PROPAGATION_SHARE", "MODULE_SHARE", "STAGE_SHARE"):
        monkeypatch.setattr(search_moves, share, 0.0)  # spread and single moves only
    space = ConfigSpace(graph, topo)
    moves = Moves(graph, space)
    rng = random.Random(0)
    current = dp(graph, topo)
    n, spread = 4000, 0
    for _ in range(n):
        changes = moves.propose(rng, current)
        if {"fc0", "loss"} <= set(changes):
            spread += 1
            # one of them drawn, the other carried from it
            assert changes["loss"] == carried(graph, "loss", current["loss"], changes["fc0"], topo.num_devices,
                                              other_op="fc0") or \
                changes["fc0"] == carried(graph, "fc0", current["fc0"], changes["loss"], topo.num_devices,
                                          other_op="loss")
            assert all(space.contains(m, cfg) for m, cfg in changes.items())
    # the linear and the loss are each other's only neighbour in the space; most draws carry over
    assert 0.1 * n * SPREAD_SHARE < spread <= n * SPREAD_SHARE + 5 * (n * SPREAD_SHARE) ** 0.5


# -- time chunks and stage moves ---------------------------------------------------------------------------


def test_propagation_carries_a_chunked_layout_to_a_dropout_and_back():
    """An LSTM's time chunks carry over to the dropout after it (its `seq` to the dropout's `d1`, the same
    output axis) as a valid config of the space, chunk by chunk on the LSTM's devices; and a chunked
    dropout's layout carries back to an LSTM. Matching dims by name alone carries nothing."""
    graph, topo = rc.graph_of("rnnlm"), load_topology("p100-2x2")
    space = ConfigSpace(graph, topo)
    current = dp(graph, topo)
    lstm = graph["lstms.0"]
    chunked = cut_chunks(lstm, ParallelConfig(degrees={"sample": 2}, devices=(1, 3)), "seq", 4)
    current = current.with_config("lstms.0", chunked)
    for drop in ("drops.0", "drops.1"):  # before and after the LSTM
        cfg = carried(graph, drop, current[drop], chunked, topo.num_devices, other_op="lstms.0")
        assert cfg is not None and dict(cfg.degrees) == {"sample": 2, "d1": 4} and cfg.devices == chunked.devices
        validate(graph[drop], cfg, topo.num_devices)
        assert space.contains(drop, cfg) and space.split_chunks(drop, cfg).count == 4
        assert carried(graph, drop, current[drop], chunked, topo.num_devices) is None
        back = carried(graph, "lstms.1", current["lstms.1"], cfg, topo.num_devices, other_op=drop)
        assert back == chunked and space.contains("lstms.1", back)
    # the propagation move makes that change (it is in the space, so not dropped)
    moves = Moves(graph, space)
    rng = random.Random(0)
    made = set()
    for _ in range(3000):
        changes = moves.propose(rng, current)
        if set(changes) <= {"drops.0", "drops.1"} and changes and all(
                cfg.devices == chunked.devices and space.split_chunks(m, cfg).count == 4 for m, cfg in changes.items()):
            made |= set(changes)
    assert made == {"drops.0", "drops.1"}


def test_stages_are_maximal_runs_of_ops_on_one_device_set():
    graph, topo = rc.graph_of("mlp"), load_topology("cpu-2")
    space = ConfigSpace(graph, topo)
    start = parse_baseline("hybrid:tp=1,pp=2")(graph, topo)
    stages = stages_of(space.ops, start)
    assert [m for members in stages for m in members] == list(space.ops)
    assert len(stages) == 2
    for members in stages:
        assert len({frozenset(start[m].devices) for m in members}) == 1
    assert {frozenset(start[s[0]].devices) for s in stages} == {frozenset({0}), frozenset({1})}
    # micro-batches do not change a stage; another device set in the middle of one splits it in three
    micro = start.with_configs({m: microbatched(graph[m], start[m], 2) for m in stages[0][:1]})
    assert stages_of(space.ops, micro) == stages
    first = stages[0]
    if len(first) >= 3:
        split = start.with_config(first[1], ParallelConfig.single(1))
        assert stages_of(space.ops, split)[:3] == [first[:1], first[1:2], first[2:]]


@pytest.mark.parametrize("spec", ["hybrid:tp=1,pp=2", "hybrid:tp=1,pp=2,microbatches=4"])
def test_a_stage_move_gives_one_micro_batch_count_to_a_whole_stage(spec: str):
    """The stage move draws an op and a count among its micro-batch move's, and gives that count to every
    op of the op's stage that takes it, each keeping its layout; it is drawn about `STAGE_SHARE` of the time."""
    graph, topo = rc.graph_of("mlp"), load_topology("cpu-2")
    space = ConfigSpace(graph, topo)
    moves = Moves(graph, space)
    current = parse_baseline(spec)(graph, topo)
    rng = random.Random(6)
    counts = Counter()
    for _ in range(200):
        changes = moves._stage_move(rng, current)
        if not changes:
            continue
        count = _stage_count(space, current, changes)
        assert count is not None
        stage = next(s for s in stages_of(space.ops, current) if set(changes) <= set(s))
        after = current.with_configs(changes)
        takers = {m for m in stage if space.with_microbatches(m, current[m], count) is not None}
        assert len(takers) > 1
        assert {m for m in stage if space.microbatch_count(m, after[m]) == count} == takers
        assert all(space.contains(m, cfg) for m, cfg in changes.items())
        counts[count] += 1
        current = after
    assert set(counts) == {1, *MICROBATCH_COUNTS}
    # among all moves (single-op micro-batch moves aside: those change one op)
    start = parse_baseline(spec)(graph, topo)
    n = 3000
    stage_moves = sum(len(changes) > 1 and _stage_count(space, start, changes) is not None
                      for changes in (moves.propose(rng, start) for _ in range(n)))
    assert 0.5 * n * STAGE_SHARE < stage_moves <= n * STAGE_SHARE + 5 * (n * STAGE_SHARE) ** 0.5


@pytest.mark.parametrize("spec, topology", [("expert", "p100-2x2"), ("mp", "cpu-2"), ("dp", "cpu-2")])
def test_moves_on_the_rnn_lm_with_chunks_and_stages_are_timed_by_delta_as_by_full(spec: str, topology: str):
    """The zoo's RNN LM: the moves (baselines as references) add, change and remove LSTM time chunks, carry
    chunked layouts to dropouts and give whole stages micro-batch counts, and delta simulation times every
    step of every proposal exactly as a full simulation does (accepted or rejected at random)."""
    graph, topo = rc.graph_of("rnnlm"), load_topology(topology)
    space = ConfigSpace(graph, topo)
    references = [parse_baseline(b)(graph, topo) for b in ("dp", "expert", "mp")]
    moves = Moves(graph, space, references)
    start = parse_baseline(spec)(graph, topo)
    sim, ref = (Simulator(graph, topo, AnalyticalCostModel()) for _ in range(2))
    sim.full(start)
    rng = random.Random(3)
    current, seen = start, Counter()
    for k in range(400):
        changes = moves.propose(rng, current)
        if not changes:
            continue
        for m, cfg in changes.items():
            before, after = space.split_chunks(m, current[m]).count, space.split_chunks(m, cfg).count
            if before != after and graph[m].kind == "lstm":
                seen["add" if before == 1 else "remove" if after == 1 else "change"] += 1
            if after > 1 and graph[m].kind == "dropout" and before == 1:
                seen["dropout chunked"] += 1
        if len(changes) > 1 and _stage_count(space, current, changes) is not None:
            seen["stage"] += 1
        current = step_and_check(sim, ref, current, changes, k, rng)
    assert {"add", "change", "remove", "stage"} <= set(seen), seen
    assert seen["dropout chunked"] > 0 or spec == "dp", seen
    fresh = Simulator(graph, topo, AnalyticalCostModel()).full(current)
    assert sim.timeline().task_times() == fresh.task_times()
