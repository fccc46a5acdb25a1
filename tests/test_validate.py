"""Validation: the metrics (Spearman, errors) on synthetic data, strategy picking, the text; (slow) a tiny
validation run end to end. The plot and the CSV rows: `tests/test_tables_and_plots.py`."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from soapflow.validate import metrics, pick_strategies, ranks, spearman, validate_text


def test_ranks_average_ties() -> None:
    assert ranks([10, 30, 20, 20]) == [1.0, 4.0, 2.5, 2.5]


def test_spearman_known_values() -> None:
    assert spearman([1, 2, 3, 4], [10, 20, 30, 400]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3], [1, 3, 2]) == pytest.approx(0.5)
    assert spearman([1], [2]) is None
    assert spearman([1, 1, 1], [1, 2, 3]) is None


def test_spearman_matches_scipy() -> None:
    from scipy.stats import spearmanr

    rng = random.Random(0)
    for _ in range(20):
        xs = [rng.randint(0, 9) for _ in range(12)]
        ys = [x + rng.gauss(0, 3) for x in xs]
        assert spearman(xs, ys) == pytest.approx(spearmanr(xs, ys).statistic)


def test_metrics_relative_errors() -> None:
    m = metrics([110.0, 90.0, 300.0], [100.0, 100.0, 200.0])
    assert m["median_abs_error"] == pytest.approx(0.1)
    assert m["max_abs_error"] == pytest.approx(0.5)
    assert m["spearman"] == pytest.approx(3 ** 0.5 / 2)  # measured ties share rank 1.5


def synthetic_report() -> dict:
    rows = [{"model": model, "strategy": s, "predicted_ms": p, "measured_ms": m, "error": (p - m) / m,
             "uncal_ms": p / 2, "uncal_error": (p / 2 - m) / m}
            for model, s, p, m in (("mlp", "dp", 10.0, 11.0), ("mlp", "mp", 20.0, 19.0), ("cnn", "dp", 5.0, 5.0))]
    from soapflow.validate import _summary

    return {"topology": "machine", "nproc": 2, "steps": 3, "calibrated": True, "rows": rows,
            **_summary(rows, "predicted_ms"), "extra": {"uncal": _summary(rows, "uncal_ms")}}


def test_text() -> None:
    report = synthetic_report()
    assert report["per_model"]["mlp"]["spearman"] == pytest.approx(1.0)
    assert report["per_model"]["cnn"]["spearman"] is None
    text = validate_text(report)
    assert "overall" in text and "uncal" in text and "mlp" in text
    row = next(line.split() for line in text.splitlines() if line.startswith("mlp") and " mp " in line)
    assert row == ["mlp", "mp", "20.00", "19.00", "+5.3%", "10.00", "-47.4%"]


def test_pick_strategies_distinct_and_valid() -> None:
    from soap.capture import capture
    from soap.setup import TrainSetup
    from soap.strategy import validate_strategy
    from soap.topology import load_topology
    from soapflow.models import default_loss
    from soapflow.zoo.mlp import mlp

    module, (x, target) = mlp(8, sizes=(16, 32, 8))
    graph = capture(module, x, target, default_loss, name="tiny", batch_size=8)
    topo = load_topology("cpu-2")
    picked = pick_strategies(graph, topo, count=6, setup=TrainSetup(), seed=1, search_budget_s=None)
    assert len(picked) == 6
    assert [n for n, _ in picked][:2] == ["dp", "mp"]
    for i, (_, s) in enumerate(picked):
        validate_strategy(graph, s, 2)
        assert all(s != t for _, t in picked[:i])
    assert picked == pick_strategies(graph, topo, count=6, setup=TrainSetup(), seed=1, search_budget_s=None)


@pytest.mark.slow
def test_validate_smoke(tmp_path: Path) -> None:
    from soapflow.validate import validate

    report = validate(["mlp"], "cpu-2", strategies=3, steps=2, batch=8, search_budget_s=None,
                      extra={"again": "cpu-2"})
    assert len(report["rows"]) == 3
    for r in report["rows"]:
        assert r["measured_ms"] > 0 and r["predicted_ms"] > 0 and r["again_ms"] == r["predicted_ms"]
    assert set(report) >= {"rows", "median_abs_error", "max_abs_error", "spearman", "per_model"}
    with pytest.raises(ValueError, match="cpu-N"):
        validate(["mlp"], "p100-1x2")
