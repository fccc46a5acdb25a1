"""The runtime under strategies whose devices repeat (several parts of one op on one device, run one after
another: micro-batches), against single-process training and against the step plan.

A device that runs several parts of an op holds each part's input, outputs and autograd graph apart and
adds their parameter gradients into its shards; every rank walks the plan's forward and backward orders
of (op, round) and takes part in one exchange per edge, consumer round and pass
(`soap.lowering`'s rules "Rounds" and "Order"). Every case trains a few SGD steps and compares the losses
and final parameters with the unpartitioned model trained in one process (float64 masters: the tight
tolerance, as the micro-batches add the gradients in another order; a few cases in float32, whose
collective bytes are compared too), and the collectives each rank issued in its last step with the plan's
(`StepPlan.collectives`). One launch of 2 processes runs the default cases (a launch costs seconds), the
single-process cases run in this process, and `-m slow` runs random sweeps on 2 and 4 processes.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import runtime_cases as rc
from test_runtime_correctness import run_and_check

from runtime.checkpoint import checkpoint_path
from runtime.train import TrainOptions
from soap.config import ParallelConfig, validate
from soap.lowering import BACKWARD, FORWARD, lower
from soap.setup import TrainSetup
from soap.strategy import Strategy

FLOAT64 = TrainOptions(steps=3, setup=TrainSetup(lr=0.05), verify=True, dtype="float64")
FLOAT32 = TrainOptions(steps=3, setup=TrainSetup(lr=0.05), verify=True)
ONE_F_ONE_B = TrainOptions(steps=3, setup=TrainSetup(lr=0.05, schedule="1f1b"), verify=True, dtype="float64")
RANDOM_MODELS = ("mlp", "cnn", "rescnn", "rnnlm", "transformer", "llama")


def with_overrides(strategy: Strategy, graph, overrides: dict[str, ParallelConfig], num_devices: int) -> Strategy:
    out = dict(strategy.configs) | overrides
    for op in graph:
        validate(op, out[op.name], num_devices)
    return Strategy(out)


def mixed_mlp(graph) -> Strategy:
    """Ops with different round counts on 2 devices: the first linear in 4 micro-batches on device 0, the
    activation in 2 per device, the second linear split on its output features into two blocks both on
    device 1 (two parameter blocks, one device), the loss whole on device 0."""
    return with_overrides(rc.micro_dp_strategy(graph, 2, 2), graph, {
        "layers.0": ParallelConfig(degrees={"sample": 4}, devices=(0, 0, 0, 0)),
        "layers.1": ParallelConfig(degrees={"sample": 4}, devices=(0, 0, 1, 1)),
        "layers.2": ParallelConfig(degrees={"out_features": 2}, devices=(1, 1)),
        "loss": ParallelConfig.single(0),
    }, 2)


def mixed_transformer(graph) -> Strategy:
    """Data parallelism in 2 micro-batches per device, with an MLP's first linear in two column blocks on
    device 1, its second linear split 4 ways on its input features over (0, 0, 1, 1) (partial sums two
    per device, added by the next op), one attention's heads both on device 0, the LM head in 4
    micro-batches on device 1 and the loss whole on device 0."""
    return with_overrides(rc.micro_dp_strategy(graph, 2, 2), graph, {
        "blocks.0.mlp.fc": ParallelConfig(degrees={"out_features": 2}, devices=(1, 1)),
        "blocks.0.mlp.proj": ParallelConfig(degrees={"in_features": 4}, devices=(0, 0, 1, 1)),
        "blocks.1.attn.scaled_dot_product_attention": ParallelConfig(degrees={"heads": 2}, devices=(0, 0)),
        "lm_head": ParallelConfig(degrees={"sample": 4}, devices=(1, 1, 1, 1)),
        "loss": ParallelConfig.single(0),
    }, 2)


def repeated_cases(models: tuple[str, ...], count: int, nproc: int, seed: int) -> list[dict]:
    """`count` random strategies with repeated devices (`rc.repeated_strategy`) over `models`, in float64
    and float32 alternately (float32 for the Llama, whose hand-written RMS norm computes in float32 in the
    reference), every other pair under the 1F1B schedule."""
    rng = random.Random(seed)
    cases = []
    for i in range(count):
        model = models[i % len(models)]
        graph = rc.graph_of(model)
        strategy = rc.repeated_strategy(graph, nproc, rng)
        for _ in range(20):  # a small model may draw no repeated device: draw again
            if rc.repeats(strategy) > 0:
                break
            strategy = rc.repeated_strategy(graph, nproc, rng)
        assert rc.repeats(strategy) > 0
        options = FLOAT64 if i % 2 == 0 and model != "llama" else FLOAT32
        if i // 2 % 2:  # every other pair under 1F1B
            options = dataclasses.replace(options, setup=dataclasses.replace(options.setup, schedule="1f1b"))
        cases.append(rc.train_case(f"{model}/repeated{i}", model, strategy, graph, options=options))
    return cases


def case(label: str, model: str, strategy: Strategy, options: TrainOptions = FLOAT64) -> dict:
    return rc.train_case(f"{model}/{label}", model, strategy, rc.graph_of(model), options=options)


def test_the_plans_of_the_cases_repeat_devices():
    """The hand-written strategies run several parts of an op on one device, with different round counts."""
    mlp = rc.graph_of("mlp")
    plan = lower(mlp, mixed_mlp(mlp), TrainSetup(), 2)
    assert {plan.ops[i].num_rounds for i, _ in plan.forward_order} == {1, 2, 4}
    pipe = lower(mlp, rc.pipeline_strategy(mlp, 2, 4), TrainSetup(), 2)
    assert [s.devices for s in pipe.ops if s.num_rounds > 1] == [(0,) * 4, (0,) * 4, (1,) * 4, (1,) * 4]
    # one exchange per micro-batch between the stages, in GPipe's order
    assert [len(e.exchanges) for e in pipe.edges] == [0, 4, 0]
    assert pipe.forward_order[:3] == ((2, 0), (3, 0), (4, 0))
    # under 1F1B the first stage starts the first micro-batch's backward before its third forward
    one = lower(mlp, rc.pipeline_strategy(mlp, 2, 4), TrainSetup(schedule="1f1b"), 2)
    first = [s.devices[0] == 0 and s.num_rounds > 1 for s in one.ops]
    stage0 = [(phase, r) for phase, i, r in one.order if first[i]]
    assert stage0.index((BACKWARD, 0)) < stage0.index((FORWARD, 2))


def checkpoint_cases(directory: Path) -> list[dict]:
    """AdamW in float64: 2 steps under the mixed MLP layout (parameter blocks and micro-batches on one
    device) saving a checkpoint, 2 more resumed from it under the pipeline, one more resumed under plain
    data parallelism; each resumed run is verified against one process trained without interruption."""
    mlp = rc.graph_of("mlp")
    setup = TrainSetup(lr=0.01, optimizer="adamw", weight_decay=0.1)

    def options(steps: int, resume: int | None) -> TrainOptions:
        return TrainOptions(steps=steps, setup=setup, verify=True, dtype="float64", checkpoint_dir=str(directory),
                            resume_from=None if resume is None else str(checkpoint_path(directory, resume)))

    dp = rc.baseline_case("mlp", "dp", 2, options=options(5, 4))
    return [case("checkpoint-mixed", "mlp", mixed_mlp(mlp), options(2, None)),
            case("resumed-pipeline", "mlp", rc.pipeline_strategy(mlp, 2, 4), options(4, 2)),
            {**dp, "label": "mlp/resumed-dp"}]


def test_micro_batches_match_single_process(tmp_path):
    """One launch of 2 processes: a 2-stage pipeline of 4 micro-batches (GPipe and 1F1B, with and without
    recomputation), data parallelism in 2
    micro-batches per device (MLP, Transformer), ops with different round counts (with parameter blocks
    and partial sums on one device), a pipeline baseline, AdamW, bf16, checkpoints written and resumed
    across micro-batched layouts, and random strategies with repeated devices."""
    mlp, transformer = rc.graph_of("mlp"), rc.graph_of("transformer")
    cases = [
        case("pipeline-4mb", "mlp", rc.pipeline_strategy(mlp, 2, 4)),
        case("pipeline-4mb-f32", "mlp", rc.pipeline_strategy(mlp, 2, 4), FLOAT32),
        case("dp-2mb", "mlp", rc.micro_dp_strategy(mlp, 2, 2)),
        case("dp-2mb", "transformer", rc.micro_dp_strategy(transformer, 2, 2)),
        case("dp-2mb-f32", "transformer", rc.micro_dp_strategy(transformer, 2, 2), FLOAT32),
        case("mixed-rounds", "mlp", mixed_mlp(mlp)),
        case("mixed-rounds", "transformer", mixed_transformer(transformer)),
        case("pipeline-2mb", "transformer", rc.pipeline_strategy(transformer, 2, 2)),
        case("pipeline-4mb-1f1b", "mlp", rc.pipeline_strategy(mlp, 2, 4), ONE_F_ONE_B),
        case("pipeline-4mb-1f1b", "transformer", rc.pipeline_strategy(transformer, 2, 4), ONE_F_ONE_B),
        case("mixed-rounds-1f1b", "transformer", mixed_transformer(transformer), ONE_F_ONE_B),
        case("dp-2mb-adamw", "mlp", rc.micro_dp_strategy(mlp, 2, 2), TrainOptions(
            steps=3, setup=TrainSetup(lr=0.01, optimizer="adamw", weight_decay=0.01), verify=True,
            dtype="float64")),
        # bf16 against torch.autocast, compared after one step (test_runtime_correctness says why)
        case("dp-2mb-bf16", "transformer", rc.micro_dp_strategy(transformer, 2, 2), TrainOptions(
            steps=1, setup=TrainSetup(lr=0.05, precision="bf16"), verify=True)),
    ]
    for spec, options in (("hybrid:tp=1,pp=2,microbatches=2", FLOAT64),
                          ("hybrid:tp=1,pp=2,microbatches=2,recompute=full", FLOAT64),
                          ("hybrid:tp=1,pp=2,microbatches=4,recompute=full", ONE_F_ONE_B)):
        pipeline = rc.baseline_case("transformer", spec, 2, options=options)
        assert pipeline is not None, spec
        cases.append({**pipeline, "label": f"transformer/{spec}/{options.setup.schedule}"})
    cases.append(rc.baseline_case("mlp", "mp:microbatches=4", 2, options=ONE_F_ONE_B))
    cases += checkpoint_cases(tmp_path)
    cases += repeated_cases(RANDOM_MODELS, 12, 2, seed=1)
    results = {r["label"]: r for r in run_and_check(cases)}
    assert len(results["mlp/resumed-pipeline"]["losses"]) == 2 and len(results["mlp/resumed-dp"]["losses"]) == 1


def test_micro_batches_on_one_process_match():
    """One process (no collectives): every op of the MLP in 4 micro-batches, and the mixed layout of the
    Transformer folded onto device 0."""
    mlp, transformer = rc.graph_of("mlp"), rc.graph_of("transformer")
    folded = Strategy({name: cfg.replace(devices=(0,) * len(cfg.devices))
                       for name, cfg in mixed_transformer(transformer).items()})
    cases = [case("one-process-4mb", "mlp", rc.micro_dp_strategy(mlp, 1, 4)),
             case("one-process-mixed", "transformer", folded)]
    results = rc.run_one_process(cases)
    assert all(r["collectives"] == [{}] for r in results)


@pytest.mark.slow
def test_random_repeated_devices_two_processes():
    run_and_check(repeated_cases((*RANDOM_MODELS, "transformer_explicit"), 28, 2, seed=2))


@pytest.mark.slow
def test_random_repeated_devices_four_processes():
    """Random strategies with repeated devices, pipelines and micro-batched data parallelism on 4 processes."""
    cases = repeated_cases(RANDOM_MODELS, 18, 4, seed=3)
    mlp, transformer = rc.graph_of("mlp"), rc.graph_of("transformer")
    cases += [case("pipeline-4x2mb", "mlp", rc.pipeline_strategy(mlp, 4, 2)),
              case("dp-4x2mb", "mlp", rc.micro_dp_strategy(mlp, 4, 2)),
              case("pipeline-4x4mb", "transformer", rc.pipeline_strategy(transformer, 4, 4))]
    run_and_check(cases, nproc=4)
