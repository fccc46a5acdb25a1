"""A model whose weights plus AdamW state exceed a per-process memory cap trains under `fsdp` on two
processes: each rank builds on the meta device and materializes only its chunks, so that no rank builds
the whole model. Tensor memory is measured from the start of the rank (its build included) to the end of
training by `runtime.memory.track_peak`; the same run with the model built whole on every rank holds a
whole model's bytes more."""

from __future__ import annotations

import functools

import runtime_cases as rc

from runtime.launch import launch
from runtime.train import TrainOptions
from search.baselines import fsdp
from soap.setup import TrainSetup
from soap.topology import load_topology

# A GPT of about 14 M parameters at a tiny batch: parameters dominate its memory. Weights in float64, for
# tight verification: under AdamW a gradient that is zero in exact arithmetic (the key part of the qkv
# bias) moves by its rounding noise over the noise's own size, which in float32 differs between one
# process and two by more than the float32 tolerance.
GPT = functools.partial(rc.zoo_build, "transformer", 2, layers=3, d_model=512, heads=8, seq=16, context=None,
                        vocab=4096)
WORD = 8


@functools.cache
def runs() -> tuple[int, list, list]:
    graph = rc.capture_workload(GPT)
    params = sum(p.numel for op in graph for p in op.params.values())
    strategy = rc.configs(fsdp(graph, load_topology("cpu-2")))
    options = TrainOptions(steps=2, setup=TrainSetup(optimizer="adamw", lr=1e-3), verify=True, timeout_s=120,
                           dtype="float64")
    kwargs = dict(graph=graph.to_dict(), strategy=strategy, options=options)
    sharded = launch(rc.peak_train, 2, kwargs=dict(build=GPT, **kwargs), num_threads=1, timeout_s=120)
    whole = launch(rc.peak_train, 2, kwargs=dict(build=functools.partial(rc.built_whole, GPT), **kwargs),
                   num_threads=1, timeout_s=120)
    return params, sharded, whole


def test_a_gpt_trains_under_fsdp_built_on_the_meta_device_without_the_whole_model():
    params, sharded, whole = runs()
    assert [r["built_whole"] for r in sharded] == [None, None]
    assert all("meta device" in r["built_whole"] for r in whole)
    assert sharded[0]["verify"]["passed"] and whole[0]["verify"]["passed"], (sharded[0]["verify"],
                                                                            whole[0]["verify"])
    for s, w in zip(sharded, whole, strict=True):  # building whole costs the whole model's weights more
        assert w["peak_bytes"] - s["peak_bytes"] > 0.9 * WORD * params, (s["peak_bytes"], w["peak_bytes"])


def test_the_fsdp_peak_is_below_the_weights_plus_adamw_state():
    params, sharded, _ = runs()
    # fsdp on 2 ranks keeps 2 words per parameter (half the weights, their gradients and AdamW's two
    # moments) plus, one op at a time, its gathered weights or their gradient and the reduce-scatter's
    # output; the cap is below the weights plus AdamW state (3 words per parameter)
    cap = 5 * WORD * params // 2
    assert max(r["peak_bytes"] for r in sharded) < cap < 3 * WORD * params
