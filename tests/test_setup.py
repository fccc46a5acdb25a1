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
    ({"precision": "bf16"}, "precision 'bf16' is not supported"),
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
