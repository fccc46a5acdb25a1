"""Checkpoints and failures of `soapflow.runner.run` (docs/runtime.md).

Checkpoints hold full tensors, so a run saved under one strategy resumes under another; they are written
atomically, and a broken one is skipped with a warning. A rank that raises or dies ends the run within the
process-group timeout with a one-line `LaunchError` naming the rank (and the op, when it raised in one).
The faults are injected with the runner's test hook `SOAPFLOW_TEST_FAULT=KIND:RANK:STEP`.
"""

from __future__ import annotations

import functools
import platform
import time
from pathlib import Path

import pytest
import torch

from runtime.checkpoint import (
    Checkpoint,
    assemble,
    checkpoint_path,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    shard_state,
)
from runtime.launch import LaunchError, keep_freed_memory, launch
from runtime.train import TrainOptions, time_strategies
from search.baselines import dp, tp
from soap.setup import TrainSetup
from soap.topology import load_topology
from soapflow.api import capture_model
from soapflow.runner import FAULT_ENV, build_workload, run

CASES = Path(__file__).parent / "runtime_cases.py"
SMALL_MLP = f"{CASES}:small_mlp"
SMALL_TRANSFORMER = f"{CASES}:small_transformer"


def ckpt(step: int, value: float = 1.0) -> Checkpoint:
    return Checkpoint(step=step, params={"w": torch.full((2, 3), value)}, buffers={"b": torch.zeros(3)},
                      optimizer="sgd", optimizer_state={"w": {"momentum_buffer": torch.ones(2, 3)}},
                      losses=(0.5,) * step, meta={"seed": 0})


def test_checkpoints_round_trip_and_keep_the_newest(tmp_path):
    for step in (2, 4, 6):
        save_checkpoint(tmp_path, ckpt(step, float(step)), keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004.ckpt", "step-00000006.ckpt"]
    loaded = load_checkpoint(latest_checkpoint(tmp_path))
    assert loaded.step == 6 and torch.equal(loaded.params["w"], torch.full((2, 3), 6.0))
    assert torch.equal(loaded.optimizer_state["w"]["momentum_buffer"], torch.ones(2, 3))
    assert loaded.losses == (0.5,) * 6 and loaded.meta == {"seed": 0}
    assert latest_checkpoint(tmp_path / "missing") is None


@pytest.mark.parametrize("damage", ["truncate", "flip", "header"])
def test_a_broken_checkpoint_is_skipped_with_a_warning(tmp_path, damage):
    save_checkpoint(tmp_path, ckpt(2))
    newest = save_checkpoint(tmp_path, ckpt(4))
    data = newest.read_bytes()
    if damage == "truncate":  # a copy cut short
        newest.write_bytes(data[:-10])
    elif damage == "flip":  # one corrupted byte in the payload
        newest.write_bytes(data[:-5] + bytes([data[-5] ^ 0xFF]) + data[-4:])
    else:
        newest.write_bytes(b"garbage\n" + data)
    # A crash before os.replace leaves only a temporary file, which is never a candidate.
    (tmp_path / ".step-00000006.ckpt.x.tmp").write_bytes(data[: len(data) // 2])
    with pytest.warns(UserWarning, match="ignoring checkpoint step-00000004.ckpt"):
        found = latest_checkpoint(tmp_path)
    assert found == checkpoint_path(tmp_path, 2)
    with pytest.raises(ValueError):
        load_checkpoint(newest)


def test_shards_assemble_into_full_tensors_and_slice_back():
    full = torch.arange(12.0).reshape(3, 4)
    pieces = [("w", ((0, 3), (0, 2)), full[:, :2]), ("w", ((0, 3), (2, 4)), full[:, 2:]),
              ("w", ((0, 3), (2, 4)), torch.zeros(3, 2))]  # a second replica: the first one wins
    out = assemble(pieces, {"w": torch.zeros(3, 4), "unused": torch.ones(1)})
    assert torch.equal(out["w"], full) and set(out) == {"w"}
    state = shard_state({"exp_avg": full, "step": torch.tensor(3.0)}, ((1, 3), (0, 4)), (3, 4))
    assert torch.equal(state["exp_avg"], full[1:]) and float(state["step"]) == 3.0


def test_killed_rank_resumes_under_another_strategy(tmp_path, monkeypatch):
    """Train under tp with checkpoints every 2 steps; rank 1 SIGKILLs itself at step 3; the run fails
    naming it; resuming under dp from the step-2 checkpoint ends where uninterrupted training ends."""
    common = dict(nproc=2, steps=5, setup=TrainSetup(lr=0.05, momentum=0.9), checkpoint_dir=tmp_path, num_threads=1,
                  timeout_s=30)
    monkeypatch.setenv(FAULT_ENV, "kill:1:3")
    start = time.monotonic()
    with pytest.raises(LaunchError, match=r"^rank 1 was killed by the operating system \(SIGKILL\), most likely "
                                          r"out of memory: the memory model estimates") as info:
        run(SMALL_MLP, "tp", checkpoint_every=2, **common)
    assert "\n" not in str(info.value) and time.monotonic() - start < 30
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 2)
    monkeypatch.delenv(FAULT_ENV)
    out = run(SMALL_MLP, "dp", resume=True, verify=True, **common)
    assert out["first_step"] == 2 and len(out["losses"]) == 3
    v = out["verify"]
    # verify compares with one process trained for all 5 steps without interruption.
    assert v["passed"] and not v["params_not_held"], v
    assert out["checkpoint"] == str(checkpoint_path(tmp_path, 5))


def test_a_rank_that_raises_stops_the_run_naming_rank_and_op(monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "raise:1:1")
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        run(SMALL_MLP, "tp", nproc=2, steps=3, num_threads=1, timeout_s=20)
    message = str(info.value)
    assert message.startswith("rank 1: ExecutionError: step 1, forward of op ") and "injected fault" in message
    assert "\n" not in message and isinstance(info.value, RuntimeError)
    assert info.value.rank == 1 and info.value.detail.startswith("Traceback") and "injected fault" in info.value.detail
    assert time.monotonic() - start < 20


def test_resume_without_a_checkpoint_warns_and_bad_options_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match="need checkpoint_dir"):
        run(SMALL_MLP, "dp", resume=True)
    with pytest.raises(ValueError, match="nccl"):
        run(SMALL_MLP, "dp", backend="nccl")
    with pytest.warns(UserWarning, match="no complete checkpoint"):
        out = run(SMALL_MLP, "dp", nproc=1, steps=1, resume=True, checkpoint_dir=tmp_path)
    assert out["first_step"] == 0 and out["checkpoint"] == str(checkpoint_path(tmp_path, 1))


@pytest.mark.slow
def test_adam_checkpoint_moves_between_strategies_and_process_counts(tmp_path):
    """AdamW state (step count and both moments) saved from 2 ranks under expert, resumed on 4 under tp,
    then on 1 process under mp. In float64: Adam divides by the root of the squared gradients, which turns
    float32 rounding noise in gradients that are zero in exact arithmetic (an attention key's bias) into
    full-size steps."""
    common = dict(setup=TrainSetup(lr=0.01, optimizer="adamw"), dtype="float64", checkpoint_dir=tmp_path,
                  num_threads=1, timeout_s=60)
    first = run(SMALL_TRANSFORMER, "expert", nproc=2, steps=2, **common)
    assert first["checkpoint"] == str(checkpoint_path(tmp_path, 2))
    second = run(SMALL_TRANSFORMER, "tp", nproc=4, steps=4, resume=True, verify=True, **common)
    assert second["first_step"] == 2 and second["verify"]["max_param_rel_diff"] < 1e-10, second["verify"]
    third = run(SMALL_TRANSFORMER, "mp", nproc=1, steps=5, resume=True, verify=True, **common)
    assert third["first_step"] == 4 and third["verify"]["max_param_rel_diff"] < 1e-10, third["verify"]
    assert third["verify"]["max_loss_rel_diff"] < 1e-10


def test_ranks_keep_freed_memory_where_the_allocator_allows():
    # glibc takes the setting (every rank calls it on start); elsewhere it is reported as not applied.
    assert keep_freed_memory() == (platform.libc_ver()[0] == "glibc")


def _timing_job(strategies: dict, *, timeout_s: float, rounds: int = 1) -> dict:
    _, graph = capture_model(SMALL_MLP)
    topology = load_topology("cpu-1")
    return {"build": functools.partial(build_workload, SMALL_MLP, graph.batch_size), "graph": graph.to_dict(),
            "strategies": {name: {n: c.to_dict() for n, c in make(graph, topology).items()}
                           for name, make in strategies.items()},
            "steps": 1, "rounds": rounds, "options": TrainOptions(timeout_s=timeout_s)}


def test_a_timed_step_over_the_timeout_fails_naming_the_strategy():
    """`time_strategies` (validate's runs) limits each step, not the whole job."""
    kwargs = _timing_job({"slowpoke": dp}, timeout_s=1e-6)
    with pytest.raises(LaunchError, match=r"^rank 0: StrategyFailed: strategy 'slowpoke', step 0: the step took "
                                          r"\S+ s, more than the per-step timeout of 1e-06 s$"):
        launch(time_strategies, 1, kwargs=kwargs, num_threads=1)


def test_timed_runs_report_each_strategy_turn_as_it_ends():
    seen = []
    out = launch(time_strategies, 1, kwargs=_timing_job({"dp": dp, "tp": tp}, timeout_s=60, rounds=2),
                 num_threads=1, progress=seen.append)[0]
    assert set(out) == {"dp", "tp"} and all(len(v) == 2 for v in out.values())
    assert [(r["strategy"], r["round"], r["rounds"]) for r in seen] == [("dp", 1, 2), ("tp", 1, 2), ("dp", 2, 2),
                                                                         ("tp", 2, 2)]
    assert all(r["step_ms"] > 0 for r in seen)
