"""What `run --verify` compares (`runtime.train.compare`): a zero-gradient parameter is not a failure, a
real error still is."""

from __future__ import annotations

import torch

from runtime.train import VERIFY_TOLERANCES, compare


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
