"""The runtime under recurrent ops split in time (chunks: `soap.lowering`'s rule "Carries"), against
single-process training and against the step plan.

Chunk k of an LSTM starts from the final (h, c) of chunk k-1, on the same rank or moved from another
(one exchange each way), and the gradient of its initial state flows back into chunk k-1's backward.
Layers on different ranks, each in chunks, make FlexFlow's wavefront. Every case trains a few SGD steps
and compares losses and final parameters with the unpartitioned model trained in one process (float64
masters, a few float32 cases whose collective bytes are compared too), and the collectives each rank
issued with the plan's. One launch of 2 processes runs the default cases; `-m slow` runs a random sweep
on 4 processes.
"""

from __future__ import annotations

import random

import pytest
import runtime_cases as rc
from test_runtime_correctness import run_and_check

from runtime.train import TrainOptions
from soap.config import ParallelConfig
from soap.lowering import lower
from soap.setup import TrainSetup
from soap.strategy import Strategy

FLOAT64 = TrainOptions(steps=3, setup=TrainSetup(lr=0.05), verify=True, dtype="float64")
FLOAT32 = TrainOptions(steps=3, setup=TrainSetup(lr=0.05), verify=True)
BF16 = TrainOptions(steps=3, setup=TrainSetup(lr=0.05, precision="bf16"), verify=True)
ONE_F_ONE_B = TrainOptions(steps=3, setup=TrainSetup(lr=0.05, schedule="1f1b"), verify=True, dtype="float64")


def case(label: str, strategy: Strategy, options: TrainOptions = FLOAT64, model: str = "rnnlm") -> dict:
    return rc.train_case(f"{model}/{label}", model, strategy, rc.graph_of(model), options=options)


def chunked_cases(count: int, nproc: int, seed: int) -> list[dict]:
    """`count` random strategies whose LSTMs run in chunks (`rc.chunked_strategy`), float64 and float32
    alternately, one in three under 1F1B."""
    rng = random.Random(seed)
    graph = rc.graph_of("rnnlm")
    return [case(f"chunked{i}", rc.chunked_strategy(graph, nproc, rng),
                 ONE_F_ONE_B if i % 3 == 2 else FLOAT64 if i % 2 == 0 else FLOAT32)
            for i in range(count)]


def test_the_chunked_baselines_chunk_and_run_layers_apart():
    """`expert` and `mp` run the recurrent layers (LSTM, GRU, RNN) of the test models (4 steps) in 4 chunks
    (8 asked, 4 divide), `expert:chunks=2` in 2; each sample range's chunks on one device, layers on
    different devices (but mp's on the plain RNN LM)."""
    from search.baselines import parse_baseline
    from soap.topology import load_topology

    for model in ("rnnlm", "nmt", "grulm", "rnnlm_tanh"):
        graph = rc.graph_of(model)
        for name, chunks in (("expert", 4), ("expert:chunks=2", 2), ("mp", 4)):
            strategy = parse_baseline(name)(graph, load_topology("cpu-2"))
            layers = [strategy[op.name] for op in graph if op.kind in ("lstm", "gru", "rnn")]
            assert len(layers) >= 2, model
            assert all(cfg.degree("seq") == chunks for cfg in layers), (model, name)
            # (mp balances compute: the plain RNN's two layers weigh less than its decoder, and share a block)
            assert len({cfg.devices for cfg in layers}) == (1 if (model, name) == ("rnnlm_tanh", "mp") else 2), \
                (model, name)


def test_the_wavefront_plan_alternates_layers():
    """Layer 1's chunks on device 0, layer 2's on device 1: the step's order runs layer 2's chunk k right
    after layer 1's, so device 0 runs chunk k + 1 while device 1 runs chunk k; each chunk after the first
    starts from the chunk before it, and the dropout between them moves one chunk per exchange."""
    graph = rc.graph_of("rnnlm")
    plan = lower(graph, rc.wavefront_strategy(graph, 2, 4), TrainSetup(), 2)
    index = plan.flow.index
    l1, l2 = index["lstms.0"], index["lstms.1"]
    assert plan.ops[l1].carry_from == (None, 0, 1, 2) and plan.ops[l2].devices == (1, 1, 1, 1)
    lstm_order = [node for node in plan.forward_order if node[0] in (l1, l2)]
    assert lstm_order == [(l1, 0), (l2, 0), (l1, 1), (l2, 1), (l1, 2), (l2, 2), (l1, 3), (l2, 3)]
    assert [node for node in plan.backward_order if node[0] in (l1, l2)] == lstm_order[::-1]
    into_l2 = [e for e in plan.edges if plan.flow.edges[e.edge].dst == l2][0]
    assert [r for r, _, _ in into_l2.exchanges] == [0, 1, 2, 3]


def recomputing_lstms(strategy: Strategy) -> Strategy:
    return Strategy({name: c.replace(recompute=True) if name.startswith("lstms") else c
                     for name, c in strategy.items()})


def test_chunks_match_single_process():
    """One launch of 2 processes: the wavefront of the two LSTM layers in 4 and 2 chunks (also under 1F1B and
    recomputing the LSTMs), with 2 sample
    ranges on different ranks, in float32, the chunks of both layers on one rank, the chunked expert and
    mp baselines of the RNN LM and the NMT, and random chunked strategies. Chunks on different ranks: each
    layer's 4 chunks alternating ranks (0, 1, 0, 1 and 1, 0, 1, 0; under GPipe and 1F1B, recomputing, in
    float32, under bf16 against autocast, with 2 sample ranges) and the wavefront whose layers change rank
    halfway (one carry each)."""
    graph = rc.graph_of("rnnlm")
    both_on_one = Strategy({**rc.wavefront_strategy(graph, 2, 2).configs,
                            "lstms.1": rc.chunked(graph["lstms.1"], (0,), 2)})
    alternate = rc.wavefront_strategy(graph, 2, 4, hand_over=1)
    assert alternate["lstms.0"].devices == (0, 1, 0, 1) and alternate["lstms.1"].devices == (1, 0, 1, 0)
    halfway = rc.wavefront_strategy(graph, 2, 4, hand_over=2)
    cases = [
        case("alternate-4", alternate),
        case("alternate-4-1f1b", alternate, ONE_F_ONE_B),
        case("alternate-4-recompute", recomputing_lstms(alternate)),
        case("alternate-4-f32", alternate, FLOAT32),
        case("alternate-4-bf16", alternate, BF16),
        case("alternate-4x2samples", rc.wavefront_strategy(graph, 2, 4, samples=2, hand_over=1)),
        case("halfway-4", halfway),
        case("halfway-4-1f1b", halfway, ONE_F_ONE_B),
        case("halfway-4-1f1b-recompute", recomputing_lstms(halfway), ONE_F_ONE_B),
        case("wavefront-4", rc.wavefront_strategy(graph, 2, 4)),
        case("wavefront-4-1f1b", rc.wavefront_strategy(graph, 2, 4), ONE_F_ONE_B),
        case("wavefront-4-recompute", recomputing_lstms(rc.wavefront_strategy(graph, 2, 4))),
        case("wavefront-2-f32", rc.wavefront_strategy(graph, 2, 2), FLOAT32),
        case("wavefront-4x2samples", rc.wavefront_strategy(graph, 2, 4, samples=2)),
        case("one-rank-2", both_on_one),
        case("mixed", Strategy({**rc.micro_dp_strategy(graph, 2, 2).configs,
                                "lstms.0": ParallelConfig(degrees={"sample": 2, "seq": 2}, devices=(1, 1, 0, 0))})),
    ]
    cases += [rc.baseline_case(model, name, 2, options=FLOAT64)
              for model in ("rnnlm", "nmt") for name in ("expert", "expert:chunks=2", "mp")]
    cases += chunked_cases(8, 2, seed=1)
    run_and_check(cases)


def test_gru_and_rnn_chunks_match_single_process():
    """One launch of 2 processes: the RNN LM with GRU layers and with tanh and relu RNN layers (their state is
    h alone) against single-process training: data parallel unchunked, layers apart unchunked, both layers
    in 4 chunks on rank 0, each layer's 4 chunks alternating ranks (0, 1, 0, 1 and 1, 0, 1, 0: h moves
    between them, its gradient back), the wavefront of the two layers (also under 1F1B, and with 2 sample
    ranges), and the chunked expert baseline."""
    cases = []
    for model, layer, kind in (("grulm", "grus", "gru"), ("rnnlm_tanh", "rnns", "rnn")):
        graph = rc.graph_of(model)
        assert [op.kind for op in graph if op.name.startswith(f"{layer}.")] == [kind, kind]
        on_rank0 = Strategy({**{op.name: ParallelConfig.single(0) for op in graph},
                             f"{layer}.0": rc.chunked(graph[f"{layer}.0"], (0,), 4),
                             f"{layer}.1": rc.chunked(graph[f"{layer}.1"], (0,), 4)})
        alternate = rc.wavefront_strategy(graph, 2, 4, hand_over=1)
        assert alternate[f"{layer}.0"].devices == (0, 1, 0, 1) and alternate[f"{layer}.1"].devices == (1, 0, 1, 0)
        cases += [
            rc.baseline_case(model, "dp", 2, options=FLOAT64),
            case("apart-unchunked", rc.wavefront_strategy(graph, 2, 1), model=model),
            case("one-rank-4", on_rank0, model=model),
            case("alternate-4", alternate, model=model),
            case("alternate-4-f32", alternate, FLOAT32, model=model),
            case("wavefront-4", rc.wavefront_strategy(graph, 2, 4), model=model),
            case("wavefront-4-1f1b", rc.wavefront_strategy(graph, 2, 4), ONE_F_ONE_B, model=model),
            case("wavefront-4x2samples", rc.wavefront_strategy(graph, 2, 4, samples=2), model=model),
            rc.baseline_case(model, "expert", 2, options=FLOAT64),
        ]
    relu = rc.graph_of("rnnlm_relu")
    cases += [case("alternate-4", rc.wavefront_strategy(relu, 2, 4, hand_over=1), model="rnnlm_relu"),
              case("wavefront-2", rc.wavefront_strategy(relu, 2, 2), model="rnnlm_relu")]
    run_and_check(cases)


def test_chunks_on_one_process_match():
    """One process (no collectives): both layers in 4 chunks on device 0."""
    graph = rc.graph_of("rnnlm")
    folded = Strategy({name: cfg.replace(devices=(0,) * len(cfg.devices))
                       for name, cfg in rc.wavefront_strategy(graph, 2, 4).items()})
    cases = [case("one-process-4", folded)]
    rc.run_one_process(cases)


@pytest.mark.slow
def test_random_chunks_four_processes():
    cases = chunked_cases(12, 4, seed=3)
    graph = rc.graph_of("rnnlm")
    cases += [case("wavefront-4x4", rc.wavefront_strategy(graph, 4, 4)),
              case("wavefront-2x2samples", rc.wavefront_strategy(graph, 4, 2, samples=2))]
    cases += [rc.baseline_case(model, name, 4, options=FLOAT64)
              for model in ("rnnlm", "nmt") for name in ("expert", "mp")]
    run_and_check(cases, nproc=4)
