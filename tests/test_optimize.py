"""`soapflow.optimize` and `soapflow.report`: the optimize and compare reports, their text, and bad input
(the plots and CSV files: `tests/test_tables_and_plots.py`).

Small models on small topologies with proposal budgets, so every test runs in seconds and its result
depends on the seed alone.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from search.baselines import BASELINES
from search.bound import lower_bound
from search.mcmc import NoFeasibleStrategy
from simulator.engine import simulate
from soap.setup import TrainSetup
from soap.strategy import load_strategy
from soap.topology import load_topology
from soapflow.api import capture_model
from soapflow.optimize import compare, optimize
from soapflow.report import compare_text, optimize_text

OPTIMIZE_KEYS = {"best", "baselines", "speedup_vs_dp", "num_proposals", "proposals_per_s", "elapsed_s", "history"}


def _optimize(tmp_path, **kw):
    kw.setdefault("batch", 8)
    kw.setdefault("max_proposals", 300)
    kw.setdefault("budget_s", None)
    return optimize(kw.pop("model", "mlp"), kw.pop("topology", "cpu-2"), out_path=tmp_path / "best.json", **kw)


def test_optimize_and_compare_simulate_with_the_setup_given(tmp_path):
    """One setup for the search, the file it writes, the report's summary and compare's simulations."""
    setup = TrainSetup(optimizer="adamw", lr=1e-3, bucket_mb=4.0)
    out = _optimize(tmp_path, setup=setup, max_proposals=100)
    path = out["best"]["strategy_file"]
    assert out["setup"] == setup.to_dict() and json.loads(Path(path).read_text())["setup"] == setup.to_dict()
    _, graph = capture_model("mlp", batch_size=8)
    topology = load_topology("cpu-2")
    strategy = load_strategy(path, graph, 2, setup=setup)
    best = out["best"]["iteration_time_ms"]
    assert simulate(graph, strategy, topology, setup=setup).iteration_time_ms == pytest.approx(best, rel=1e-12)
    assert out["strategy"]["iteration_time_ms"] == pytest.approx(best, rel=1e-12)
    rows = {r["strategy"]: r for r in compare("mlp", "cpu-2", strategies=[path], batch=8, setup=setup)["rows"]}
    dp_ms = simulate(graph, BASELINES["dp"](graph, topology), topology, setup=setup).iteration_time_ms
    assert rows["dp"]["simulated_ms"] == pytest.approx(dp_ms, rel=1e-12)
    assert rows[path]["simulated_ms"] == pytest.approx(best, rel=1e-12)
    assert dp_ms != simulate(graph, BASELINES["dp"](graph, topology), topology).iteration_time_ms
    with pytest.warns(UserWarning, match="optimizer 'adamw' in the file, 'sgd' here"):
        compare("mlp", "cpu-2", strategies=[path], batch=8, baselines=False)


def test_optimize_report_keys_table_and_strategy_file(tmp_path):
    seen = []
    out = _optimize(tmp_path, progress=seen.append)
    assert OPTIMIZE_KEYS <= set(out)
    assert set(out["best"]) >= {"iteration_time_ms", "strategy_file"}
    assert set(out["baselines"]) == {"dp", "mp", "tp", "expert", "fsdp"}
    best = out["best"]["iteration_time_ms"]
    assert best <= min(ms for ms in out["baselines"].values() if ms is not None)
    assert out["speedup_vs_dp"] == pytest.approx(out["baselines"]["dp"] / best)
    assert out["num_proposals"] > 0 and out["proposals_per_s"] > 0 and out["elapsed_s"] > 0
    assert out["history"][0][0] == 0 and out["history"][-1][2] == best
    # the table: the best first, then every baseline, with time, speed-up over dp and peak memory
    table = out["table"]
    assert [r["strategy"] for r in table] == ["best", "dp", "mp", "tp", "expert", "fsdp"]
    assert all(r["peak_memory_bytes"] > 0 for r in table)
    assert next(r for r in table if r["strategy"] == "dp")["speedup_vs_dp"] == pytest.approx(1.0)
    # the strategy file holds the best strategy, which simulates to the reported time
    _, graph = capture_model("mlp", batch_size=8)
    topology = load_topology("cpu-2")
    strategy = load_strategy(out["best"]["strategy_file"], graph, 2)
    assert simulate(graph, strategy, topology).iteration_time_ms == pytest.approx(best, rel=1e-12)
    written = json.loads((tmp_path / "best.json").read_text())
    assert written["format"] == "soapflow.strategy/2" and written["setup"] == out["setup"] == TrainSetup().to_dict()
    # progress: proposals per second and the best so far, the best never rising
    assert seen and all({"proposals", "proposals_per_s", "best_ms", "elapsed_s"} <= set(p) for p in seen)
    assert seen[-1]["best_ms"] >= best
    # a summary of what the strategy does
    assert out["strategy"]["description"] and out["strategy"]["groups"]
    # the lower bound on any strategy (`search.bound`) and the best's gap to it
    bound = lower_bound(graph, topology)
    found = dict(out["lower_bound"])
    assert 0 <= found.pop("elapsed_s") <= out["elapsed_s"]  # (how long the bound took, counted in the whole)
    assert found == {"time_ms": bound.time_ms, "work_ms": bound.work_ms, "path_ms": bound.path_ms,
                     "gap": best / bound.time_ms - 1.0}
    assert 0 < bound.time_ms <= best
    json.dumps(out)  # JSON-able as it is


def test_optimize_text_has_the_table_and_the_summary(tmp_path):
    out = _optimize(tmp_path)
    text = optimize_text(out)
    for word in ("best", "dp", "mp", "tp", "expert", "vs dp", "peak memory", "proposals", "what the best",
                 "no strategy can beat", f"{100 * out['lower_bound']['gap']:.0f}% above it"):
        assert word in text
    assert out["best"]["strategy_file"] in text
    # a time budget mostly spent before the chains ran says so; a proposal budget, or chains that had most
    # of the time, does not
    hint = "a larger --budget searches more"
    assert hint not in text
    short = {**out, "max_proposals": None, "budget_s": 10.0, "search_s": 1.0}
    assert hint in optimize_text(short)
    assert hint not in optimize_text({**short, "search_s": 9.0})
    # many devices: the range of their peak memory, not one figure each
    peaks = [float(i) * 1e9 for i in range(1, 65)]
    many = optimize_text({**out, "strategy": {**out["strategy"], "peak_memory_bytes": peaks}})
    assert "peak memory per device (GB): 1 to 64 over 64 devices, median 32.5" in many


def test_optimize_beats_data_parallel_on_the_mlp(tmp_path):
    out = _optimize(tmp_path, batch=64)
    assert out["speedup_vs_dp"] > 1.2
    assert any("shard" in line for line in out["strategy"]["description"])


def test_same_seed_same_strategy(tmp_path):
    a = _optimize(tmp_path, seed=3)
    first = (tmp_path / "best.json").read_text()
    b = _optimize(tmp_path, seed=3)
    assert a["best"]["iteration_time_ms"] == b["best"]["iteration_time_ms"]
    assert (tmp_path / "best.json").read_text() == first


@pytest.mark.parametrize("kw, match", [
    ({"budget_s": 0}, "budget must be > 0"),
    ({"budget_s": -3.0}, "budget must be > 0"),
    ({"budget_s": None, "max_proposals": 0}, "proposal budget must be > 0"),
    ({"budget_s": None, "max_proposals": None}, "needs a time budget"),
    ({"budget_s": 5, "jobs": 0}, "jobs"),
])
def test_bad_budgets_fail_fast_with_one_line(tmp_path, kw, match):
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=match) as info:
        optimize("mlp", "cpu-2", out_path=tmp_path / "x.json", **kw)
    assert "\n" not in str(info.value)
    assert time.monotonic() - t0 < 1.0  # before capturing the model
    assert not (tmp_path / "x.json").exists()


def test_unknown_model_and_topology(tmp_path):
    with pytest.raises(ValueError, match="neither a zoo model") as info:
        _optimize(tmp_path, model="no_such_model")
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="unknown topology") as info:
        _optimize(tmp_path, topology="tpu-9x9")
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="unknown topology"):
        compare("mlp", "tpu-9x9", batch=8)


def test_more_devices_than_the_batch_allows_for_dp(tmp_path):
    """Batch 3 on 2 devices: dp is not defined; the search still runs, dp is reported as null."""
    out = _optimize(tmp_path, batch=3)
    assert out["baselines"]["dp"] is None and out["speedup_vs_dp"] is None
    assert "dp" in out["baseline_notes"] and "batch" in out["baseline_notes"]["dp"]
    assert out["best"]["iteration_time_ms"] > 0
    assert json.loads(json.dumps(out))["baselines"]["dp"] is None
    assert "dp" in optimize_text(out)
    rows = {r["strategy"]: r for r in compare("mlp", "cpu-2", batch=3)["rows"]}
    assert rows["dp"]["simulated_ms"] is None and "not applicable" in rows["dp"]["note"]
    assert rows["tp"]["simulated_ms"] > 0 and rows["tp"]["speedup_vs_dp"] is None


def _tiny_topology(tmp_path, memory_gb: float) -> str:
    doc = {"format": "soapflow.topology/1", "name": "tiny",
           "devices": [{"id": i, "kind": "p100", "node": 0, "memory_gb": memory_gb} for i in range(2)],
           "links": [{"src": "gpu0", "dst": "gpu1", "kind": "nvlink", "spec": "nvlink1"}]}
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(doc))
    return str(path)


def test_no_feasible_strategy_names_the_smallest_need(tmp_path):
    with pytest.raises(NoFeasibleStrategy, match=r"smallest peak memory need .* is [0-9.]+ [MGk]?B") as info:
        _optimize(tmp_path, topology=_tiny_topology(tmp_path, 1e-5), max_proposals=100)
    assert isinstance(info.value, ValueError) and "\n" not in str(info.value)
    assert not (tmp_path / "best.json").exists()


def test_compare_simulated_rows_and_text(tmp_path):
    found = _optimize(tmp_path)["best"]["strategy_file"]
    out = compare("mlp", "cpu-2", strategies=["dp", "tp", found], batch=8)
    rows = {r["strategy"]: r for r in out["rows"]}
    assert list(rows) == ["dp", "mp", "tp", "expert", "fsdp", found]
    for r in rows.values():
        assert {"strategy", "simulated_ms", "measured_ms", "error", "speedup_vs_dp"} <= set(r)
        assert r["simulated_ms"] > 0 and r["measured_ms"] is None and r["error"] is None
    assert rows["dp"]["speedup_vs_dp"] == pytest.approx(1.0)
    assert rows[found]["speedup_vs_dp"] == pytest.approx(rows["dp"]["simulated_ms"] / rows[found]["simulated_ms"])
    text = compare_text(out)
    assert "simulated" in text and "best.json" in text
    assert [r["strategy"] for r in compare("mlp", "cpu-2", batch=8)["rows"]] == ["dp", "mp", "tp", "expert", "fsdp"]


def test_compare_measure_needs_this_machine():
    with pytest.raises(ValueError, match="cpu-N"):
        compare("mlp", "p100-4x4", batch=16, measure=True)
    with pytest.raises(ValueError, match="steps"):
        compare("mlp", "cpu-2", batch=8, measure=True, steps=0)


def test_compare_measures_on_this_machine(tmp_path):
    out = compare("mlp", "cpu-2", strategies=["dp", "tp"], baselines=False, batch=8, measure=True, steps=2)
    rows = {r["strategy"]: r for r in out["rows"]}
    for r in rows.values():
        assert r["measured_ms"] > 0 and len(r["measured_runs_ms"]) == 1
        assert r["error"] == pytest.approx((r["simulated_ms"] - r["measured_ms"]) / r["measured_ms"])
    assert rows["dp"]["speedup_vs_dp"] == pytest.approx(1.0)
    assert rows["tp"]["speedup_vs_dp"] == pytest.approx(rows["dp"]["measured_ms"] / rows["tp"]["measured_ms"])
    assert "measured" in compare_text(out)


def _empty_profile(tmp_path):
    """A machine profile of cpu-2 (preset figures) with an empty cost database beside it."""
    from simulator.calibration import MachineProfile, write_profile

    (tmp_path / "machine.costdb.jsonl").write_text("")
    path = tmp_path / "machine.json"
    write_profile(path, MachineProfile(topology=load_topology("cpu-2"), efficiency={}, bandwidth_efficiency={},
                                       launch_us={}, costdb="machine.costdb.jsonl"))
    return path


def test_measure_rounds_need_a_profile_of_this_machine(tmp_path):
    for topology in ("cpu-2", "p100-1x2"):
        with pytest.raises(ValueError, match="machine profile"):
            optimize("mlp", topology, max_proposals=10, budget_s=None, out_path=tmp_path / "s.json",
                     measure_rounds=1)
    with pytest.raises(ValueError, match="no --costdb"):
        optimize("mlp", str(_empty_profile(tmp_path)), max_proposals=10, budget_s=None,
                 out_path=tmp_path / "s.json", measure_rounds=1, cost_model=str(tmp_path / "machine.costdb.jsonl"))


@pytest.mark.slow
def test_measure_rounds_price_the_best_from_measurements(tmp_path):
    """Round 1 times the parts of the best and the baselines (the database starts empty) and searches
    again; the next round finds them measured (or times the new best's parts), and the report says how many
    parts of the final best lack a measurement."""
    profile = _empty_profile(tmp_path)
    out = optimize("tests/data/user_model.py:build", str(profile), max_proposals=60, budget_s=None,
                   out_path=tmp_path / "s.json", measure_rounds=3)
    m = out["measured"]
    assert m["parts_timed"] > 0 and m["rounds"] >= 1
    lines = (tmp_path / "machine.costdb.jsonl").read_text().splitlines()
    assert len(lines) == m["parts_timed"]
    assert m["best_parts_unmeasured"] == 0 or m["rounds"] == 3
    assert "op part(s) timed" in optimize_text(out)


def test_confirm_runs_needs_this_machine_and_a_non_negative_count(tmp_path):
    with pytest.raises(ValueError, match="--confirm-runs trains the candidates on this machine"):
        optimize("mlp", "p100-1x2", max_proposals=10, budget_s=None, out_path=tmp_path / "s.json", confirm_runs=1)
    with pytest.raises(ValueError, match="--confirm-runs must be >= 0"):
        optimize("mlp", "cpu-2", max_proposals=10, budget_s=None, out_path=tmp_path / "s.json", confirm_runs=-1)


@pytest.mark.parametrize("fastest", ["dp", "search"])
def test_confirm_runs_writes_the_candidate_that_measured_fastest(tmp_path, monkeypatch, fastest):
    """The measured runs are faked (no processes): whichever candidate has the lowest median is written,
    the report lists every candidate's runs, and a baseline that wins becomes the best of the report."""
    import soapflow.optimize as opt

    calls = {}

    def fake_compare(model_ref, topology_ref, *, strategies, repeats, baselines, measure, **kw):
        calls.update(strategies=list(strategies), repeats=repeats, baselines=baselines, measure=measure)
        rows = []
        for i, ref in enumerate(strategies):
            name = "search" if ref.endswith(".json") else ref
            base = 10.0 if name == fastest else 20.0 + i
            # as compare does: measured_ms is the median of the runs
            rows.append({"strategy": ref, "measured_ms": base + 1, "measured_runs_ms": [base + 1, base, base + 2]})
        return {"rows": rows}

    monkeypatch.setattr(opt, "compare", fake_compare)
    path = tmp_path / "s.json"
    out = optimize("mlp", "cpu-2", max_proposals=40, budget_s=None, out_path=path, confirm_runs=3)
    v = out["confirmed"]
    assert calls["repeats"] == 3 and calls["measure"] and not calls["baselines"]
    assert calls["strategies"][0] == str(path) and "search" in v["measured_ms"]
    assert v["chosen"] == fastest and v["measured_ms"][fastest] == 11.0
    assert min(v["measured_ms"].values()) == v["measured_ms"][v["chosen"]]
    _, graph = capture_model("mlp")
    written = load_strategy(path, graph, 2)
    if fastest == "dp":
        assert written == BASELINES["dp"](graph, load_topology("cpu-2"))
        assert out["best"]["source"].startswith("the dp baseline")
        assert out["best"]["iteration_time_ms"] == out["baselines"]["dp"]
    else:
        assert out["best"]["source"] != "" and not out["best"]["source"].startswith("the dp baseline")
    assert "confirmed on this machine" in optimize_text(out)


@pytest.mark.slow
def test_confirm_runs_trains_the_candidates_for_real(tmp_path):
    out = optimize("tests/data/user_model.py:build", "cpu-2", max_proposals=40, budget_s=None,
                   out_path=tmp_path / "s.json", confirm_runs=1, confirm_steps=3)
    v = out["confirmed"]
    assert "search" in v["measured_ms"] and len(v["measured_ms"]) >= 2
    assert all(ms > 0 for ms in v["measured_ms"].values())
    assert v["measured_ms"][v["chosen"]] == min(v["measured_ms"].values())


def test_optimize_reports_the_replica_phase_and_the_command_turns_it_off(tmp_path, capsys):
    """Where no baseline fits, `optimize` searches one replica per device first: the report says how many
    replicas and how many of the proposals were theirs, and so does the text; `--no-replica-phase`
    searches without it."""
    from test_search_simulated import tight_transformer_case

    from soapflow.cli import main

    tight_transformer_case(tmp_path)
    model, topology = f"{Path(__file__).parent / 'runtime_cases.py'}:small_transformer", str(tmp_path / "small.json")
    out = _optimize(tmp_path, model=model, topology=topology, batch=4, max_proposals=150)
    assert out["replica_phase"] == 4 and 0 < out["replica_phase_proposals"] < out["num_proposals"] <= 150
    assert all(ms is None for ms in out["baselines"].values())  # (none fits)
    assert (f"{out['replica_phase_proposals']:,} of them first among strategies of 4 replicas"
            in optimize_text(out))
    assert main(["optimize", model, "-t", topology, "--batch", "4", "--proposals", "60", "--no-replica-phase",
                 "--json", "-o", str(tmp_path / "off.json")]) == 0
    off = json.loads(capsys.readouterr().out)
    assert off["replica_phase"] == 0 and off["replica_phase_proposals"] == 0
