"""The proposal space: only valid configs, never a split the registry refuses, uniform, lazy."""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter

import pytest
import runtime_cases as rc
from test_search_fixtures import GRAPHS, GraphBuilder

from search.baselines import BASELINES, BaselineNotApplicable, parse_baseline
from search.space import (
    CHUNK_SHARE,
    MAX_CHUNKS,
    MICROBATCH_COUNTS,
    MICROBATCH_SHARE,
    ConfigSpace,
    cut_chunks,
    microbatched,
    sample_dim,
    split_chunks,
    split_microbatches,
)
from simulator.taskgraph import MAX_ROUNDS
from soap.config import ConfigError, ParallelConfig, parts, repeat_refusal, validate
from soap.lowering import part_rounds
from soap.registry import dims_of, op_def
from soap.topology import load_topology

TOPOLOGIES = ["cpu-2", "cpu-3", "p100-4x4", "k80-16x4"]


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("graph_name", sorted(GRAPHS))
def test_sampled_configs_are_valid(graph_name: str, topology: str):
    graph, topo = GRAPHS[graph_name](), load_topology(topology)
    space = ConfigSpace(graph, topo)
    rng = random.Random(0)
    for _ in range(3000):
        name, cfg = space.propose(rng)
        op = graph[name]
        validate(op, cfg, topo.num_devices)
        assert op_def(op.kind).check(op, cfg.degrees) is None
        assert topo.num_devices % cfg.num_parts == 0
        assert list(cfg.devices) == sorted(cfg.devices)
        assert space.contains(name, cfg)


def test_every_config_of_small_ops_is_valid_on_64_devices():
    graph, topo = GRAPHS["cnn"](), load_topology("k80-16x4")
    space = ConfigSpace(graph, topo)
    for name in ("pool0", "flatten", "fc1", "loss"):
        configs = list(space.configs(name))
        assert len(configs) == space.num_configs(name) == len(set(configs))
        for cfg in configs:
            validate(graph[name], cfg, topo.num_devices)


def _reshape_graph():
    """x[8, 3, 4] -> reshape [8, 12]: a 2-way split of the 12 cuts a row of 4 in half (not a box)."""
    b = GraphBuilder("reshape", 8)
    x = b.input("x", (8, 3, 4))
    y = b.add("flat", "reshape", [x], (8, 12), attrs={"shape": [8, 12]})
    t = b.input("target", (8, 12), role="target")
    b.loss(y, t, fn="mse")
    return b.build()


def test_never_proposes_a_split_the_registry_refuses():
    graph, topo = _reshape_graph(), load_topology("cpu-6")
    op = graph["flat"]
    # the test has teeth: the registry refuses a split that divides the dim and the device count
    assert op_def("reshape").check(op, {"d1": 2}) is not None
    space = ConfigSpace(graph, topo)
    options = {dict(d).get("d1", 1) for d in space.degree_options("flat")}
    assert options == {1, 3, 6}  # thirds are rows of [3, 4], sixths half rows: boxes; halves are not
    for degrees in space.degree_options("flat"):
        assert op_def("reshape").check(op, dict(degrees)) is None
    rng = random.Random(1)
    for _ in range(2000):
        cfg = space.sample("flat", rng)
        assert op_def("reshape").check(op, cfg.degrees) is None


def test_degree_options_are_exactly_the_allowed_combinations():
    graph, topo = GRAPHS["cnn"](), load_topology("p100-4x4")
    space = ConfigSpace(graph, topo)
    n = topo.num_devices
    for op in graph:
        dims = [d for d in dims_of(op) if d.splittable]
        expected = set()
        for combo in itertools.product(*[[g for g in range(1, n + 1) if n % g == 0 and d.size % g == 0]
                                         for d in dims]):
            if n % math.prod(combo):
                continue
            degrees = {d.name: g for d, g in zip(dims, combo, strict=True) if g > 1}
            if op_def(op.kind).check(op, degrees) is None:
                expected.add(tuple(degrees.items()))
        if op_def(op.kind).everywhere:
            continue
        assert set(space.degree_options(op.name)) == expected, op.name


def test_reduction_splits_are_in_the_space():
    graph, topo = GRAPHS["mlp"](), load_topology("p100-4x4")
    space = ConfigSpace(graph, topo)
    degrees = [dict(d) for d in space.degree_options("fc1")]
    assert {"in_features": 16} in degrees
    assert {"sample": 2, "out_features": 2, "in_features": 4} in degrees


def test_device_sets_are_contiguous_or_node_aligned():
    topo = load_topology("k80-16x4")
    space = ConfigSpace(GRAPHS["mlp"](), topo)
    sixteen = set(space.device_sets(16))
    assert tuple(range(16)) in sixteen and tuple(range(48, 64)) in sixteen
    assert tuple(range(0, 64, 4)) in sixteen and tuple(range(3, 64, 4)) in sixteen  # one per node
    assert tuple(d for n in range(8) for d in (4 * n, 4 * n + 1)) in sixteen  # two per node, 8 nodes
    assert len(sixteen) == len(space.device_sets(16))
    for devices in sixteen:
        contiguous = devices == tuple(range(devices[0], devices[0] + 16))
        nodes = sorted({d // 4 for d in devices})
        locals_ = {tuple(d % 4 for d in devices if d // 4 == n) for n in nodes}
        aligned = len(locals_) == 1 and nodes == list(range(nodes[0], nodes[-1] + 1))
        assert contiguous or aligned, devices
    assert space.device_sets(64) == (tuple(range(64)),)
    assert len(space.device_sets(1)) == 64
    # a single node has no node-aligned sets beyond the contiguous ones
    assert len(ConfigSpace(GRAPHS["mlp"](), load_topology("cpu-4")).device_sets(2)) == 3


def test_sampling_is_uniform():
    graph, topo = GRAPHS["mlp"](), load_topology("cpu-4")
    space = ConfigSpace(graph, topo)
    configs = list(space.configs("fc0"))
    rng = random.Random(7)
    draws = 200 * len(configs)
    counts = Counter(space.sample("fc0", rng) for _ in range(draws))
    assert set(counts) == set(configs)
    # each count is Binomial(draws, 1/k): mean 200, sd ~14; 6 sd either way
    assert all(110 < c < 290 for c in counts.values()), counts


def test_space_is_lazy():
    graph, topo = GRAPHS["cnn"](), load_topology("k80-16x4")
    space = ConfigSpace(graph, topo)
    assert space.ops and not space._degrees and not space._device_sets
    space.sample("fc1", random.Random(0))
    assert list(space._degrees) == [space._kind("fc1")] and set(space._kinds) == {"fc1"}


@pytest.mark.parametrize("topology", ["cpu-2", "p100-4x4", "k80-16x4"])
@pytest.mark.parametrize("graph_name", sorted(GRAPHS))
def test_baselines_lie_in_the_space(graph_name: str, topology: str):
    """Chains start from baselines; their configs must be states the chain can return to, the time chunks
    of `mp` and `expert` included (an LSTM split along its carried dim and the ops that follow it chunk by
    chunk, their devices repeating)."""
    graph, topo = GRAPHS[graph_name](), load_topology(topology)
    space = ConfigSpace(graph, topo)
    chunked = 0
    for name, make in BASELINES.items():
        try:
            strategy = make(graph, topo)
        except BaselineNotApplicable:
            continue
        for op in space.ops:
            cfg = strategy[op]
            chunked += len(set(cfg.devices)) < len(cfg.devices)
            assert space.contains(op, cfg), (name, op, cfg)
    # the recurrent graph's baselines hold chunks: the check covers them
    assert chunked > 0 or graph_name != "rnn"


def test_random_strategy_and_single_device():
    graph = GRAPHS["rnn"]()
    topo = load_topology("p100-4x4")
    space = ConfigSpace(graph, topo)
    base = BASELINES["expert"](graph, topo)
    strategy = space.random_strategy(random.Random(3), base)
    assert list(strategy) == [op.name for op in graph]
    for op in graph:
        validate(op, strategy[op.name], topo.num_devices)
    one = ConfigSpace(graph, load_topology("cpu-1"))
    # on one device the only choice left is recomputation
    assert set(one.ops) == {op.name for op in graph if op.kind not in ("input", "constant")}
    assert list(one.configs("embed")) == [ParallelConfig.single(0), ParallelConfig.single(0).replace(recompute=True)]


def test_random_strategy_redraws_only_the_ops_asked_for():
    graph = GRAPHS["rnn"]()
    topo = load_topology("p100-4x4")
    space = ConfigSpace(graph, topo)
    base = BASELINES["dp"](graph, topo)
    some = space.ops[::2]
    strategy = space.random_strategy(random.Random(5), base, ops=some)
    assert list(strategy) == [op.name for op in graph]
    assert all(strategy[name] == base[name] for name in strategy if name not in some)
    assert any(strategy[name] != base[name] for name in some)
    # the draws are the ones a full redraw makes for the same ops in the same order
    rng = random.Random(5)
    assert [strategy[name] for name in some] == [space.sample(name, rng) for name in some]


# -- micro-batches -----------------------------------------------------------------------------------------


def _microbatch_draws(graph, topo, current, draws: int, seed: int):
    """(op, config) for `draws` proposals of `propose_for` from `current`, over every proposal target."""
    space = ConfigSpace(graph, topo)
    rng = random.Random(seed)
    return space, [(name, space.propose_for(name, rng, current)) for name in space.ops for _ in range(draws)]


def _check_microbatches(op, cfg: ParallelConfig, num_devices: int) -> int:
    """Check that `cfg` is its base with each device's part cut into consecutive micro-batches, run in
    order as the device's rounds (or, laid out as a hybrid baseline does, every micro-batch over all the
    base's devices); return the count."""
    validate(op, cfg, num_devices)
    assert repeat_refusal(op, cfg) is None
    split = split_microbatches(op, cfg)
    assert split is not None and split.count in MICROBATCH_COUNTS and split.count <= MAX_ROUNDS
    count, base = split.count, split.base
    assert len(set(base.devices)) == base.num_parts and cfg.num_parts == count * base.num_parts
    sample = sample_dim(op)
    assert cfg.degree(sample) == count * base.degree(sample)
    rounds = part_rounds(cfg.devices)
    assert max(rounds) + 1 == count
    assert Counter(zip(cfg.devices, rounds, strict=True)) == Counter({(d, r): 1 for d in base.devices
                                                                       for r in range(count)})
    if split.inner == 1:
        axis = [d.name for d in dims_of(op)].index(sample)
        for box, device in parts(op, base):
            mine = sorted((r, b) for (b, d), r in zip(parts(op, cfg), rounds, strict=True) if d == device)
            # the device's parts, in round order, are its base part cut along the sample dim in order
            cuts = [b[axis] for _, b in mine]
            assert cuts[0][0] == box[axis][0] and cuts[-1][1] == box[axis][1]
            assert all(a[1] == b[0] for a, b in itertools.pairwise(cuts))
            assert all(b[:axis] + b[axis + 1:] == box[:axis] + box[axis + 1:] for _, b in mine)
    return count


@pytest.mark.parametrize("topology", ["cpu-2", "p100-2x2"])
@pytest.mark.parametrize("graph_name", sorted(GRAPHS))
def test_microbatch_proposals_are_valid_with_their_rounds_and_can_be_removed(graph_name: str, topology: str):
    graph, topo = GRAPHS[graph_name](), load_topology(topology)
    current = BASELINES["dp"](graph, topo)
    space, draws = _microbatch_draws(graph, topo, current, 400, seed=11)
    counts = Counter()
    for name, cfg in draws:
        op = graph[name]
        validate(op, cfg, topo.num_devices)
        assert space.contains(name, cfg)
        if len(set(cfg.devices)) == cfg.num_parts or space.split_chunks(name, cfg).count > 1:
            continue  # (time chunks, the chunk move's: test_chunk_moves_add_change_and_remove_chunks)
        counts[_check_microbatches(op, cfg, topo.num_devices)] += 1
        # from the micro-batched config the move takes them away again (back to dp's config) or changes
        # their count, and from each of those it comes back
        options = space.microbatch_options(name, cfg)
        assert options[0] == current[name]
        assert sorted(split_microbatches(op, o).count for o in options[1:]) == \
            sorted(set(counts_of(op, current[name], topo.num_devices)) - {split_microbatches(op, cfg).count})
        for other in options[1:]:
            assert split_microbatches(op, other).base == current[name]
            _check_microbatches(op, other, topo.num_devices)
            assert cfg in space.microbatch_options(name, other)
    assert set(counts) == set(MICROBATCH_COUNTS)
    # the move is drawn MICROBATCH_SHARE of the time for ops that take micro-batches (binomial, 5 sd)
    takers = [name for name in space.ops if space.microbatch_options(name, current[name])]
    n, p = 400 * len(takers), MICROBATCH_SHARE
    assert abs(sum(counts.values()) - n * p) < 5 * math.sqrt(n * p * (1 - p))


def counts_of(op, base: ParallelConfig, num_devices: int) -> list[int]:
    """The micro-batch counts of the space that `validate` accepts for `base`, found by trying each."""
    out = []
    for m in MICROBATCH_COUNTS:
        try:
            validate(op, microbatched(op, base, m), num_devices)
        except ConfigError:
            continue
        out.append(m)
    return out


def test_ops_that_refuse_repeated_devices_never_get_micro_batches():
    """Whatever `soap.config.repeat_refusal` refuses (batchnorm's running statistics, recomputing or sharded
    configs, as far as it refuses them) the move never offers, although the sample dim would divide, and
    no proposal repeats those ops' devices; the others keep their recompute and shard choices."""
    graph, topo = rc.graph_of("bncnn"), load_topology("cpu-2")
    space = ConfigSpace(graph, topo)
    current = BASELINES["dp"](graph, topo)
    for i, name in enumerate(space.ops):  # every other op recomputes where it can, else shards where it can
        degrees = tuple(current[name].degrees.items())
        if i % 2 and True in space.recompute_options(name):
            current = current.with_config(name, current[name].replace(recompute=True))
        elif space.shard_options(name, degrees)[-1] > 1 and graph[name].kind != "batchnorm":
            current = current.with_config(name, current[name].replace(shard=space.shard_options(name, degrees)[-1]))
    assert any(current[n].recompute for n in space.ops) and any(current[n].shard > 1 for n in space.ops)
    refusing = {name for name in space.ops
                if repeat_refusal(graph[name], microbatched(graph[name], current[name], 2)) is not None}
    assert {name for name in space.ops if graph[name].kind == "batchnorm"} <= refusing != set(space.ops)
    for name in space.ops:
        op, options = graph[name], space.microbatch_options(name, current[name])
        if name in refusing:
            assert options == ()
            # only the refusal stands in the way: the sample dim divides
            assert op.outputs[0].shape[0] % microbatched(op, current[name], 2).degree(sample_dim(op)) == 0
        else:
            assert options and all((o.recompute, o.shard) == (current[name].recompute, current[name].shard)
                                   for o in options)
    space, draws = _microbatch_draws(graph, topo, current, 400, seed=5)
    repeated = set()
    for name, cfg in draws:
        validate(graph[name], cfg, topo.num_devices)
        assert space.contains(name, cfg)
        if len(set(cfg.devices)) < cfg.num_parts:
            repeated.add(name)
            _check_microbatches(graph[name], cfg, topo.num_devices)
    assert repeated and not repeated & refusing


@pytest.mark.parametrize("spec", ["hybrid:tp=1,pp=2,microbatches=4", "hybrid:tp=1,microbatches=2",
                                  "hybrid:tp=2,microbatches=2", "hybrid:tp=2,pp=2,microbatches=8"])
@pytest.mark.parametrize("graph_name", sorted(GRAPHS))
def test_baselines_with_micro_batches_lie_in_the_space_and_are_proposed_again(graph_name: str, spec: str):
    """A chain may start from a pipeline with micro-batches: its configs are in the space, the move takes
    each op's micro-batches away or changes their count, and comes back to them from there."""
    graph, topo = GRAPHS[graph_name](), load_topology("p100-2x2")
    try:
        strategy = parse_baseline(spec)(graph, topo)
    except BaselineNotApplicable:
        pytest.skip(f"{spec} does not apply to {graph_name}")
    space = ConfigSpace(graph, topo)
    micro = [name for name in space.ops if len(set(strategy[name].devices)) < strategy[name].num_parts]
    assert micro
    for name in space.ops:
        cfg, op = strategy[name], graph[name]
        assert space.contains(name, cfg), (name, cfg)
        if name not in micro:
            continue
        _check_microbatches(op, cfg, topo.num_devices)
        options = space.microbatch_options(name, cfg)
        base = options[0]
        assert len(set(base.devices)) == base.num_parts and space.contains(name, base)
        assert all(split_microbatches(op, o).base == base for o in options[1:])
        for other in options[1:]:  # (from the base, the move cuts each device's part: `inner` 1)
            assert space.contains(name, other) and cfg in space.microbatch_options(name, other)
        # the recompute and shard redraw keeps the micro-batches: only the choices valid with them
        redraws = space.memory_options(name, cfg)
        assert cfg in redraws and {o.key()[:2] for o in redraws} == {cfg.key()[:2]}
        shards = space.shard_options(name, tuple(base.degrees.items()))
        assert {(o.recompute, o.shard) for o in redraws} == {
            (r, s) for r in space.recompute_options(name) for s in shards
            if repeat_refusal(op, cfg.replace(recompute=r, shard=s)) is None}
    # proposals from it are valid configs of the space
    _, draws = _microbatch_draws(graph, topo, strategy, 200, seed=3)
    for name, cfg in draws:
        validate(graph[name], cfg, topo.num_devices)
        assert space.contains(name, cfg)


def test_the_space_holds_only_micro_batches_of_its_configs():
    """Repeated devices that are no micro-batches of a config of the space are not in it: a count outside
    `MICROBATCH_COUNTS`, devices used unevenly, repeats along another dim than the sample dim, micro-batches
    of a placement the space does not have."""
    graph, topo = GRAPHS["mlp"](), load_topology("p100-2x2")
    space = ConfigSpace(graph, topo)
    op = graph["fc0"]
    base = ParallelConfig(degrees={"sample": 2}, devices=(0, 1))
    assert space.contains("fc0", microbatched(op, base, 4))
    outside = [
        microbatched(op, base, 16),  # 16 rounds: a count the space does not have
        ParallelConfig(degrees={"sample": 4}, devices=(0, 0, 0, 1)),  # unevenly
        ParallelConfig(degrees={"out_features": 4}, devices=(0, 0, 1, 1)),  # along a parameter dim
        microbatched(op, ParallelConfig(degrees={"sample": 2}, devices=(0, 3)), 2),  # (0, 3): no such set
    ]
    for cfg in outside:
        validate(op, cfg, topo.num_devices)  # valid configs, only not in the space
        assert not space.contains("fc0", cfg), cfg


# -- time chunks -------------------------------------------------------------------------------------------


def _check_chunks(op, cfg: ParallelConfig, dim: str, num_devices: int) -> int:
    """Check that `cfg` cuts each part of a config that leaves `dim` whole into consecutive pieces along
    `dim`, all on the part's device and run there in order (its rounds in part order); return the count."""
    validate(op, cfg, num_devices)
    count = cfg.degree(dim)
    assert count > 1
    axis = [d.name for d in dims_of(op)].index(dim)
    rounds = part_rounds(cfg.devices)
    runs: dict[tuple, list[tuple[int, int, tuple]]] = {}
    for (box, device), r in zip(parts(op, cfg), rounds, strict=True):
        runs.setdefault(box[:axis] + box[axis + 1:], []).append((device, r, box[axis]))
    for pieces in runs.values():
        assert len(pieces) == count and len({device for device, _, _ in pieces}) == 1
        cuts = [c for _, _, c in sorted(pieces, key=lambda p: p[1])]  # in round order: along the dim
        size = next(d.size for d in dims_of(op) if d.name == dim)
        assert cuts[0][0] == 0 and cuts[-1][1] == size and all(a[1] == b[0] for a, b in itertools.pairwise(cuts))
    return count


@pytest.mark.parametrize("topology", ["cpu-2", "p100-2x2"])
@pytest.mark.parametrize("graph_name", ["rnnlm", "rnn"])
def test_chunked_configs_are_valid_and_in_the_space(graph_name: str, topology: str):
    """Every config of an LSTM, cut along its carried dim into each count of the space, is a valid config of
    the space with each sample range's chunks on its device; the counts are the divisors of the time steps up
    to `MAX_CHUNKS`; a split of the time steps over distinct devices is not in the space."""
    graph = rc.graph_of("rnnlm") if graph_name == "rnnlm" else GRAPHS["rnn"]()
    topo = load_topology(topology)
    space = ConfigSpace(graph, topo)
    lstms = [op.name for op in graph if op.kind == "lstm"]
    assert lstms
    for name in lstms:
        op = graph[name]
        seq = next(d for d in dims_of(op) if d.carried)
        assert space.chunk_dim(name) == seq.name
        assert set(space.chunk_counts(name)) == {k for k in range(2, MAX_CHUNKS + 1) if seq.size % k == 0}
        seen = Counter()
        for base in space.configs(name):
            for count in space.chunk_counts(name):
                cfg = cut_chunks(op, base, seq.name, count)
                if repeat_refusal(op, cfg) is not None:  # (sharded parameters: one part per device)
                    assert base.shard > 1 and not space.contains(name, cfg)
                    continue
                seen[_check_chunks(op, cfg, seq.name, topo.num_devices)] += 1
                assert space.contains(name, cfg)
                found = split_chunks(op, cfg, seq.name)
                assert (found.rest, found.count) == (base, count)
        assert set(seen) == set(space.chunk_counts(name))
        # chunks of one sample range on two devices (valid: the state moves) are not chunks of the space
        across = ParallelConfig(degrees={seq.name: 2}, devices=(0, 1))
        assert not space.contains(name, across)
        # a count outside the space's (more chunks than MAX_CHUNKS or not dividing) is not in it
        assert not space.contains(name, cut_chunks(op, ParallelConfig.single(0), seq.name, seq.size * 2))


@pytest.mark.parametrize("topology", ["cpu-2", "p100-2x2"])
def test_chunk_moves_add_change_and_remove_chunks(topology: str):
    """From dp on the zoo's RNN LM, `CHUNK_SHARE` of an LSTM's proposals cut it into chunks (every count of
    the space); from a chunked config the move removes them or changes their count, and comes back; the
    micro-batch move and the recompute redraw keep the chunks."""
    graph, topo = rc.graph_of("rnnlm"), load_topology(topology)
    space = ConfigSpace(graph, topo)
    current = BASELINES["dp"](graph, topo)
    rng = random.Random(2)
    name = "lstms.0"
    op, dim = graph[name], space.chunk_dim(name)
    draws = 2000
    chunked = Counter()
    for _ in range(draws):
        cfg = space.propose_for(name, rng, current)
        assert space.contains(name, cfg)
        if len(set(cfg.devices)) < cfg.num_parts and space.split_chunks(name, cfg).count > 1:
            found = space.split_chunks(name, cfg)
            assert found.rest == current[name]
            chunked[_check_chunks(op, cfg, dim, topo.num_devices)] += 1
    assert set(chunked) == set(space.chunk_counts(name))
    n, p = draws, CHUNK_SHARE
    assert abs(sum(chunked.values()) - n * p) < 5 * math.sqrt(n * p * (1 - p))
    for count in space.chunk_counts(name):
        cfg = cut_chunks(op, current[name], dim, count)
        options = space.chunk_options(name, cfg)
        assert options[0] == current[name]  # removes the chunks
        assert sorted(space.split_chunks(name, o).count for o in options[1:]) == \
            sorted(set(space.chunk_counts(name)) - {count})
        for other in options[1:]:
            assert cfg in space.chunk_options(name, other)
        # micro-batches under the chunks: each option keeps them (the count of chunks), is valid and in the
        # space, within MAX_ROUNDS rounds per device
        micro = space.microbatch_options(name, cfg)
        assert sorted(space.microbatch_count(name, o) for o in micro) == \
            counts_of(op, current[name], topo.num_devices)
        for o in micro:
            assert space.split_chunks(name, o).count == count and space.contains(name, o)
            validate(op, o, topo.num_devices)
            assert max(Counter(o.devices).values()) <= MAX_ROUNDS
            assert split_microbatches(op, space.split_chunks(name, o).rest).count > 1
        # and the chunk move from a micro-batched, chunked config keeps the micro-batches
        for o in space.chunk_options(name, micro[0]) if micro else ():
            assert split_microbatches(op, space.split_chunks(name, o).rest).count == \
                split_microbatches(op, space.split_chunks(name, micro[0]).rest).count
        redraws = space.memory_options(name, cfg)
        assert cfg.replace(recompute=True) in redraws
        assert all(space.split_chunks(name, o).count == count and space.contains(name, o) for o in redraws)


@pytest.mark.parametrize("topology", ["cpu-2", "p100-2x2"])
def test_a_uniform_draw_keeps_the_micro_batch_and_chunk_counts(topology: str):
    """From a config in M micro-batches and K chunks (an LSTM of the zoo's RNN LM), the uniform draw of
    `propose_for` keeps M and K wherever the drawn layout takes them (`keeping_rounds`): it changes the
    layout (a base other than the current one) in M micro-batches and K chunks, and every config it keeps
    them for is in the space. A config without either is drawn as it is."""
    graph, topo = rc.graph_of("rnnlm"), load_topology(topology)
    space = ConfigSpace(graph, topo)
    name = "lstms.0"
    op, dim = graph[name], space.chunk_dim(name)
    # (the batch is 4: data parallel over 2 devices leaves 2 micro-batches)
    plain = next(c for c in space.configs(name) if dict(c.degrees) == {"sample": 2} and not c.recompute)
    for m, k in ((2, 1), (1, 4), (2, 2)):
        cfg = microbatched(op, plain, m) if m > 1 else plain
        cfg = cut_chunks(op, cfg, dim, k) if k > 1 else cfg
        assert space.contains(name, cfg)
        kept = 0
        for drawn in space.configs(name):
            got = space.keeping_rounds(name, cfg, drawn)
            if got == drawn:
                continue
            kept += 1
            assert space.contains(name, got)
            assert space.split_chunks(name, got).count == k and space.microbatch_count(name, got) == m
            assert split_microbatches(op, space.split_chunks(name, got).rest).base == drawn
        assert kept > 1
        assert all(space.keeping_rounds(name, plain, drawn) == drawn for drawn in space.configs(name))
    # and `propose_for` draws such layouts: other bases, still in 2 micro-batches
    current = BASELINES["dp"](graph, topo).with_config(name, microbatched(op, plain, 2))
    rng = random.Random(0)
    moved = Counter()
    for _ in range(400):
        cfg = space.propose_for(name, rng, current)
        split = split_microbatches(op, space.split_chunks(name, cfg).rest)
        moved[split.count] += split.base != plain
    assert moved[2] > 0


@pytest.mark.parametrize("topology", ["cpu-2", "cpu-3", "p100-2x2", "p100-4x4"])
@pytest.mark.parametrize("model", ["rnnlm", "nmt"])
def test_chunked_baselines_of_the_zoo_lie_in_the_space(model: str, topology: str):
    """`mp` and `expert` in time chunks (default and other counts) on the zoo's recurrent models: every op's
    config, the chunked LSTMs and the ops that follow them chunk by chunk included, is in the space, and the
    chunk move can take each chunked op's chunks away."""
    graph, topo = rc.graph_of(model), load_topology(topology)
    space = ConfigSpace(graph, topo)
    followers = set()
    for spec in ("mp", "expert", "mp:chunks=2", "expert:chunks=2"):
        strategy = parse_baseline(spec)(graph, topo)
        for name in space.ops:
            cfg = strategy[name]
            assert space.contains(name, cfg), (spec, name, cfg)
            if space.split_chunks(name, cfg).count > 1:
                assert space.chunk_options(name, cfg)[0] == space.split_chunks(name, cfg).rest
                if graph[name].kind != "lstm":
                    followers.add(name)
    assert followers or topology == "cpu-3" or model == "rnnlm" and topology == "cpu-2"


@pytest.mark.parametrize(("model", "topology", "count", "reference"), [
    ("transformer", "a100-2x4", 2, "hybrid:tp=2"), ("transformer", "a100-2x4", 4, "hybrid:tp=2"),
    ("rnnlm", "p100-2x2", 2, "dp"), ("mlp", "p100-4x4", 4, "hybrid:tp=4")])
def test_a_space_of_replicas_holds_only_and_every_layout_of_its_replicas(model, topology, count, reference):
    """Every config the space of replicas draws or offers (micro-batch, memory, chunk options) lays the op
    out as those replicas and is valid; every config of the space without replicas that does so (and
    whose replica 0 is laid out as the space lays it out) is in it; references made of the replicas lie in
    it."""
    from soap.lowering import Replicas, repeats

    graph, topo = rc.graph_of(model), load_topology(topology)
    replicas = Replicas(count=count, size=topo.num_devices // count)
    space, every = ConfigSpace(graph, topo, replicas), ConfigSpace(graph, topo)
    rng = random.Random(f"replica-space/{model}")
    for name in space.ops:
        op = graph[name]
        for _ in range(5):
            cfg = space.sample(name, rng)
            assert repeats(op, cfg, replicas) and space.contains(name, cfg), (name, cfg)
            validate(op, cfg, topo.num_devices)
            offered = (space.microbatch_options(name, cfg) + space.memory_options(name, cfg)
                       + space.chunk_options(name, cfg))
            for other in offered:
                assert repeats(op, other, replicas) and space.contains(name, other), (name, other)
                validate(op, other, topo.num_devices)
        for cfg in itertools.islice(every.configs(name), 400):
            inside = repeats(op, cfg, replicas) and cfg.devices[:cfg.num_parts // count] in \
                [s[:len(s) // count] for s in space.device_sets(cfg.num_parts)]
            assert space.contains(name, cfg) == inside, (name, cfg)
    ref = parse_baseline(reference)(graph, topo)
    assert space.holds(ref) and all(space.contains(n, ref[n]) for n in space.ops)
    assert not space.holds(parse_baseline("mp")(graph, topo))


def test_ops_alike_share_their_options():
    graph, topo = rc.graph_of("transformer"), load_topology("a100-2x4")
    space = ConfigSpace(graph, topo)
    linears = [op.name for op in graph if op.kind == "linear"]
    kinds = {space._kind(name) for name in linears}
    for name in linears:
        space.num_configs(name)
    assert len(space._degrees) == len(space._cumulative) == len(kinds) < len(linears)


def test_a_space_of_replicas_needs_a_sample_dim_everywhere_and_replicas_that_make_the_devices():
    from soap.lowering import Replicas

    graph, topo = rc.graph_of("mlp"), load_topology("p100-2x2")
    with pytest.raises(ValueError, match="do not make the topology's 4 devices"):
        ConfigSpace(graph, topo, Replicas(count=3, size=1))
    # an op whose sample dim does not split among the replicas (the batch, or a position table of batch 1)
    # is refused up front, naming it, rather than left without a config to draw
    from soapflow.api import capture_model

    small = capture_model("mlp", batch_size=2)[1]
    with pytest.raises(ValueError, match="op 'layers.0' .* cannot be laid out as 4 replicas .* of size 2"):
        ConfigSpace(small, topo, Replicas(count=4, size=1))
    space = ConfigSpace(graph, topo, Replicas(count=4, size=1))  # batch 8 splits 4 ways: every op draws
    assert all(space.holds(space.random_strategy(random.Random(i), BASELINES["dp"](graph, topo))) for i in range(3))


def test_ops_without_a_sample_dim_get_no_micro_batches():
    """A loss with arithmetic after the cross entropy (a scaled loss plus a regulariser) leaves scalar ops
    with no sample dim: the micro-batch move offers them nothing, and a search from dp proposes only valid
    configs."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from soap.capture import capture

    def loss_fn(out, target):
        return 0.5 * F.cross_entropy(out, target) + 1e-3 * out.pow(2).mean()

    module = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    graph = capture(module, torch.empty(8, 16, device="meta"), torch.empty(8, dtype=torch.long, device="meta"),
                    loss_fn)
    scalar = [op.name for op in graph.ops if sample_dim(op) is None]
    assert scalar, "the loss arithmetic should leave ops without a sample dim"
    topo = load_topology("cpu-2")
    current = BASELINES["dp"](graph, topo)
    space = ConfigSpace(graph, topo)
    for name in scalar:
        assert space.microbatch_options(name, current[name]) == ()
    rng = random.Random(3)
    for _ in range(2000):
        name = rng.choice(space.ops)
        cfg = space.propose_for(name, rng, current)
        validate(graph[name], cfg, topo.num_devices)
        assert space.contains(name, cfg)
