"""What `run --verify` compares (`runtime.train.compare`): a zero-gradient parameter is not a failure, a
real error still is; dropout draws the runtime's masks in the reference, so a dropout model verifies."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import runtime_cases as rc
import torch
from torch import nn

from runtime.kernels import compute_chunk
from runtime.launch import launch
from runtime.train import VERIFY_TOLERANCES, TrainOptions, _RuntimeDropout, compare
from search.baselines import parse_baseline, split
from soap.config import ParallelConfig
from soap.graph import OperatorGraph
from soap.registry import dims_of
from soap.setup import TrainSetup
from soap.topology import load_topology
from soapflow.api import capture_model
from soapflow.runner import build_workload


def _params(**values: torch.Tensor) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in values.items()}


def test_a_parameter_with_a_zero_gradient_is_not_a_failure():
    """An attention key's bias: zero in exact arithmetic, rounding noise in both runs. Relative to its
    value (about 1e-9) the noise is a 100% difference; relative to the floor it is nothing."""
    init = _params(w=torch.ones(4, 4), key_bias=torch.zeros(4))
    ref = _params(w=init["w"] - 0.01, key_bias=torch.full((4,), 1e-9))
    run = _params(w=ref["w"] + 1e-9, key_bias=torch.full((4,), -2e-9))
    v = compare([1.0, 0.9], run, [1.0, 0.9], ref, init)
    assert v["passed"], v
    assert 2e-9 < v["max_param_abs_diff"] < 4e-9
    assert v["max_param_rel_diff"] <= VERIFY_TOLERANCES["float32"]["rtol"]


def test_a_wrong_gradient_fails_even_on_a_parameter_that_should_not_move():
    """The same key bias, moved by a step's size (a wrong, nonzero gradient): a failure, named."""
    init = _params(w=torch.ones(4, 4), key_bias=torch.zeros(4))
    ref = _params(w=init["w"] - 0.01, key_bias=torch.zeros(4))
    run = _params(w=ref["w"].clone(), key_bias=torch.full((4,), 5e-4))
    v = compare([1.0], run, [1.0], ref, init)
    assert not v["passed"] and v["worst_param"] == "key_bias", v


def test_an_error_is_measured_against_the_update_not_the_value():
    """A weight of size 1 that training moved by 0.01: an error of 1% of the update (1e-4 of the value,
    which a value-relative check at 1e-5 would also catch) fails; one of 1e-6 of the update passes."""
    init = _params(w=torch.ones(8, dtype=torch.float64))  # float64 holds the 1e-8 exactly enough
    ref = _params(w=init["w"] - 0.01)
    assert not compare([1.0], _params(w=ref["w"] + 1e-4), [1.0], ref, init)["passed"]
    ok = compare([1.0], _params(w=ref["w"] + 1e-8), [1.0], ref, init)
    assert ok["passed"] and abs(ok["max_param_rel_diff"] - 1e-6) < 1e-7, ok


def test_losses_nan_and_parameters_no_rank_holds_fail():
    init = _params(w=torch.ones(2))
    ref = _params(w=torch.zeros(2))
    assert not compare([1.001], ref, [1.0], ref, init)["passed"]  # loss 1e-3 off
    nan = compare([1.0], _params(w=torch.tensor([0.0, float("nan")])), [1.0], ref, init)
    assert not nan["passed"] and nan["nan_params"] == ["w"]
    missing = compare([1.0], {}, [1.0], ref, init)
    assert not missing["passed"] and missing["params_not_held"] == ["w"]


def test_float64_runs_are_held_to_float64_tolerances():
    init = _params(w=torch.ones(8, dtype=torch.float64))
    ref = _params(w=init["w"] - 0.01)
    run = _params(w=ref["w"] + 1e-9)  # fine in float32, far too much in float64
    assert compare([1.0], run, [1.0], ref, init, dtype="float32")["passed"]
    assert not compare([1.0], run, [1.0], ref, init, dtype="float64")["passed"]


DROPOUT_MLP = '''
import torch
import torch.nn.functional as F
from torch import nn


def model(batch_size=8):
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 16), nn.ReLU(),
                           nn.Dropout(0.3), nn.Linear(16, 4))
    return module, (torch.randn(batch_size, 6), torch.randint(0, 4, (batch_size,))), F.cross_entropy
'''


def _dropout_mlp(tmp_path: Path) -> str:
    path = tmp_path / "dropout_mlp.py"
    path.write_text(DROPOUT_MLP)
    return f"{path}:model"


def _split(graph: OperatorGraph, dims: dict[str, str]) -> dict[str, dict]:
    """Each op split over devices 0 and 1 along the first of its dims `dims` names by kind; others on 0."""
    configs = {}
    for op in graph:
        names = {d.name: d for d in dims_of(op)}
        wanted = dims.get(op.kind)
        cfg = split(op, names.get(wanted), (0, 1)) if wanted in names else ParallelConfig.single(0)
        configs[op.name] = (cfg or ParallelConfig.single(0)).to_dict()
    return configs


def test_the_runtime_draws_the_references_dropout_masks_on_every_split(tmp_path):
    """The reference's dropouts (`runtime.train._RuntimeDropout`) equal the runtime's kernel run part by
    part: the two dropout ops of an MLP, each split in two along each axis, give the reference's outputs."""
    original = torch.nn.functional.dropout
    spec, graph = capture_model(_dropout_mlp(tmp_path), batch_size=8)
    module = spec.module.train()
    drops = [op for op in graph if op.kind == "dropout"]
    assert [op.attrs["seed"] for op in drops] == [0, 1] and all(op.attrs["p"] == 0.3 for op in drops)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    hooks = [m.register_forward_hook(lambda m, args, out: seen.append((args[0], out)))
             for m in module if isinstance(m, nn.Dropout)]
    step = 3
    with torch.no_grad(), _RuntimeDropout(num_ops=len(drops), masked=True, step=step):
        module(spec.inputs[0])
    for h in hooks:
        h.remove()
    assert torch.nn.functional.dropout is original
    assert len(seen) == len(drops)
    for op, (x, ref) in zip(drops, seen, strict=True):
        assert 0 < int((ref == 0).sum()) < ref.numel()  # a real mask: some dropped, some kept
        rows, cols = x.shape
        for box in (((0, rows // 2), (0, cols)), ((rows // 2, rows), (0, cols)),
                    ((0, rows), (0, cols // 2)), ((0, rows), (cols // 2, cols))):
            part = x[tuple(slice(lo, hi) for lo, hi in box)]
            (out,), _ = compute_chunk(op, box, [part], {}, step=step)
            assert torch.equal(out, ref[tuple(slice(lo, hi) for lo, hi in box)]), (op.name, box)
    # a forward whose dropout calls are not the graph's dropout ops cannot be matched: a clear error ...
    with pytest.raises(ValueError, match="cannot reproduce the dropout masks.* 2 times where the graph has 1"):
        with torch.no_grad(), _RuntimeDropout(num_ops=1, masked=True, step=step):
            module(spec.inputs[0])
    assert torch.nn.functional.dropout is original
    # ... unless no mask matters: in eval mode every dropout is the identity, whatever the count
    with torch.no_grad():
        plain = module.eval()(spec.inputs[0])
        with _RuntimeDropout(num_ops=0, masked=False, step=step):
            assert torch.equal(module(spec.inputs[0]), plain)


def test_verification_passes_with_dropout_under_dp_and_a_split(tmp_path):
    """One launch, two processes: the dropout MLP under dp (samples split) and under a split of the features
    (linears by output features, activations and dropouts by their second axis) verifies against one
    process."""
    ref = _dropout_mlp(tmp_path)
    spec, graph = capture_model(ref, batch_size=8)
    build = functools.partial(build_workload, ref, spec.batch_size)
    options = TrainOptions(steps=2, setup=TrainSetup(lr=0.05), verify=True)
    cases = [{"label": label, "kind": "train", "build": build, "graph": graph.to_dict(), "strategy": strategy,
              "options": options}
             for label, strategy in (
                 ("dp", {name: cfg.to_dict() for name, cfg in parse_baseline("dp")(
                     graph, load_topology("cpu-2")).items()}),
                 ("split", _split(graph, {"linear": "out_features", "elementwise": "d1", "dropout": "d1"})))]
    split_graph = OperatorGraph.from_dict(cases[1]["graph"])
    assert all(cases[1]["strategy"][op.name]["degrees"] == {"d1": 2} for op in split_graph if op.kind == "dropout")
    results = launch(rc.run_cases, 2, kwargs={"cases": cases}, timeout_s=60, wall_timeout_s=300, num_threads=1)
    for r in results[0]:
        assert r["verify"]["passed"], (r["label"], r["verify"])


def test_under_adamw_gradients_and_losses_are_checked_and_parameters_only_in_float64():
    """AdamW steps an element whose gradient is rounding noise by about the learning rate either way, so
    below float64 its final parameters are reported, not checked (`check_params`), while the first step's
    gradients are: within the row of their own size, plus the margin times their rounding error; a
    gradient at rounding level of the model's largest is no failure, a wrong one is."""
    from runtime.train import ROUNDING_MARGIN, verify_dtype

    def row(**setup) -> str:
        dtype = setup.pop("dtype", "float32")
        return verify_dtype(TrainOptions(steps=1, dtype=dtype, setup=TrainSetup(**setup)))

    assert row(optimizer="adamw") == "float32" and row(optimizer="adamw", dtype="float64") == "float64"
    assert row(optimizer="adamw", precision="bf16") == "bfloat16"
    init = _params(w=torch.ones(4, 4), key_bias=torch.zeros(4))
    ref = _params(w=init["w"] - 0.03, key_bias=torch.full((4,), 0.03))
    flipped = _params(w=ref["w"], key_bias=-ref["key_bias"])  # the noise step, the other way
    ref_grads = _params(w=torch.full((4, 4), 2.0), key_bias=torch.full((4,), 1e-9))
    grads = _params(w=ref_grads["w"] + 1e-5, key_bias=-ref_grads["key_bias"])
    rtol = VERIFY_TOLERANCES["float32"]["rtol"]
    v = compare([1.0], flipped, [1.0], ref, init, grads=grads, ref_grads=ref_grads, check_params=False)
    assert v["passed"] and not v["params_checked"] and v["max_param_rel_diff"] > 1, v
    assert v["max_grad_rel_diff"] == pytest.approx(1e-5 / 2.0, rel=1e-2) and v["worst_grad"] == "w", v
    assert not compare([1.0], flipped, [1.0], ref, init, grads=grads, ref_grads=ref_grads)["passed"]
    # a gradient off by 1e-3 of its size fails, unless its rounding error allows it
    off = _params(w=ref_grads["w"] * (1 + 1e-3), key_bias=ref_grads["key_bias"])
    bad = compare([1.0], ref, [1.0], ref, init, grads=off, ref_grads=ref_grads, check_params=False)
    assert not bad["passed"] and bad["worst_grad"] == "w" and bad["max_grad_rel_diff"] > rtol, bad
    noisy = compare([1.0], ref, [1.0], ref, init, grads=off, ref_grads=ref_grads, check_params=False,
                    rounding={"w": 2e-3 / ROUNDING_MARGIN})
    assert noisy["passed"], noisy
    # losses are checked whatever the parameters
    assert not compare([1.001], ref, [1.0], ref, init, grads=ref_grads, ref_grads=ref_grads,
                       check_params=False)["passed"]


def test_adamw_verification_catches_a_wrong_gradient_that_its_steps_would_hide(monkeypatch):
    """In one process, AdamW on the mlp verifies (its gradients within the float32 row). With one
    parameter's gradient scaled by 1.5 after every backward, AdamW steps it almost exactly as before (its
    step is the gradient over its own RMS), so only the gradient check sees the error, and names it."""
    from runtime.executor import Executor

    graph = rc.graph_of("mlp")
    strategy = {op.name: ParallelConfig.single(0).to_dict() for op in graph}
    options = TrainOptions(steps=3, setup=TrainSetup(optimizer="adamw"), verify=True)
    case = {"label": "adamw", "kind": "train", "build": rc.MODELS["mlp"], "graph": graph.to_dict(),
            "strategy": strategy, "options": options}
    ok = rc.run_cases(0, 1, cases=[case])[0]["verify"]
    assert ok["passed"] and not ok["params_checked"] and ok["max_grad_rel_diff"] < 1e-5, ok
    target = next(p.fqn for op in graph for p in op.params.values())
    run_step = Executor.run_step

    def wrong(self, *args, **kwargs):
        out = run_step(self, *args, **kwargs)
        for fqn, _, t, _ in self.shard_items():
            if fqn == target and t.grad is not None:
                t.grad.mul_(1.5)
        return out

    monkeypatch.setattr(Executor, "run_step", wrong)
    bad = rc.run_cases(0, 1, cases=[case])[0]["verify"]
    assert not bad["passed"] and bad["worst_grad"] == target, bad
    assert bad["max_grad_rel_diff"] == pytest.approx(0.5, rel=5e-2), bad  # (its rounding allowed besides)
    assert bad["max_param_rel_diff"] < 1e-2, bad  # AdamW's steps barely moved: the parameters alone would pass


def test_adamw_verifies_in_float32_and_bf16_across_strategies():
    """One launch, two processes: the small GPT (attention key biases, whose exact gradient is zero) under
    AdamW, in float32 and bf16, under dp, tp and fsdp, verifies: its first step's gradients within the row
    and every loss; the final parameters are reported, not checked."""
    cases = []
    for precision in ("fp32", "bf16"):
        options = TrainOptions(steps=3, setup=TrainSetup(optimizer="adamw", precision=precision), verify=True)
        for name in ("dp", "tp", "fsdp"):
            case = rc.baseline_case("transformer", name, 2, options=options)
            case["label"] += f"/{precision}"
            cases.append(case)
    results = launch(rc.run_cases, 2, kwargs={"cases": cases}, timeout_s=120, wall_timeout_s=600, num_threads=1)
    for r in results[0]:
        v = r["verify"]
        assert v["passed"] and not v["params_checked"], (r["label"], v)
        assert v["gradients_step"] == v["reference_gradients_step"] == 0 and v["max_grad_rel_diff"] is not None
