"""Checkpoints and failures of `soapflow.runner.run` (docs/runtime.md).

Checkpoints go through torch.distributed.checkpoint: every rank writes the boxes of the full tensors it
holds, and a run resumes under another strategy and process count, each rank reading its own pieces.
They are written atomically (a directory renamed into place) with a digest manifest, and a broken one is
skipped with a warning. A rank that raises or dies ends the run within the process-group timeout with a
one-line `LaunchError` naming the rank (and the op, when it raised in one). The faults are injected with
the runner's test hook `SOAPFLOW_TEST_FAULT=KIND:RANK:STEP`.
"""

from __future__ import annotations

import functools
import math
import platform
import random
import shutil
import time
import warnings
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.planner import SavePlan

from runtime.checkpoint import (
    CheckpointInfo,
    boxes_of,
    checkpoint_path,
    disjoint_plans,
    flat_range_boxes,
    latest_checkpoint,
    load_checkpoint,
    piece_boxes,
    read_info,
    save_checkpoint,
    saved_tensors,
    verify_checkpoint,
)
from runtime.launch import LaunchError, keep_freed_memory, launch
from runtime.materialize import chunk_of
from runtime.train import VERIFY_TOLERANCES, TrainOptions, time_strategies, train_rank
from search.baselines import dp, tp
from soap.setup import TrainSetup
from soap.topology import load_topology
from soapflow import zoo
from soapflow.api import capture_model
from soapflow.runner import FAULT_ENV, build_workload, run

CASES = Path(__file__).parent / "runtime_cases.py"
SMALL_MLP = f"{CASES}:small_mlp"
SMALL_TRANSFORMER = f"{CASES}:small_transformer"
ODD_MLP = f"{Path(__file__)}:odd_mlp"


def odd_mlp(batch_size: int = 8) -> tuple:
    """An MLP (15-22-15) whose second weight (15 x 22) tp splits by columns and fsdp in two chunks that
    cut row 7: each chunk is two boxes."""
    return zoo.ZOO["mlp"].build(batch_size, sizes=(15, 22, 15))


def _box_slices(offsets, sizes) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))


def test_a_flat_range_is_at_most_2_ndim_minus_1_contiguous_boxes():
    rng = random.Random(0)
    for _ in range(3000):
        shape = tuple(rng.randint(0, 4) for _ in range(rng.randint(0, 4)))
        numel = math.prod(shape)
        start = rng.randint(0, numel)
        stop = rng.randint(start, numel + 2)  # past the end: the padding of a last chunk
        boxes = flat_range_boxes(shape, start, stop)
        assert len(boxes) <= max(1, 2 * len(shape) - 1), (shape, start, stop, boxes)
        flat = torch.arange(numel).reshape(shape)
        covered = torch.zeros(numel, dtype=torch.int64)
        firsts = []
        for offsets, sizes in boxes:
            index = flat[_box_slices(offsets, sizes)].reshape(-1)
            assert index.numel() and torch.equal(index, torch.arange(int(index[0]), int(index[0]) + index.numel()))
            covered[index] += 1
            firsts.append(int(index[0]))
        want = torch.zeros(numel, dtype=torch.int64)
        want[start:stop] = 1
        assert torch.equal(covered, want) and firsts == sorted(firsts), (shape, start, stop, boxes)


def test_the_boxes_of_a_chunk_are_views_of_it():
    full = torch.arange(5 * 7 * 3, dtype=torch.float64).reshape(5, 7, 3)
    region = ((1, 5), (2, 7), (0, 3))  # 60 elements in 8 chunks of 8: the last one holds 4 and 4 of padding
    for j in range(8):
        chunk = chunk_of(full[1:5, 2:7], (j, 8))
        boxes = piece_boxes(region, chunk, (j, 8))
        assert sum(t.numel() for _, t in boxes) == min(8, 60 - 8 * j)
        for offsets, t in boxes:
            assert torch.equal(t, full[_box_slices(offsets, t.shape)])
            assert t.untyped_storage().data_ptr() == chunk.untyped_storage().data_ptr()


def test_boxes_held_by_several_ranks_are_written_once():
    """Replicas are written once, spread over their holders; a box that overlaps another in part is cut
    into what the other lacks; a buffer is written by the lowest rank holding it."""
    w = torch.zeros(4, 6)
    held = {  # rank -> key -> [(region, tensor, chunk)]
        0: {"param/w": [(((0, 4), (0, 6)), w, None)], "param/x": [(((0, 2), (0, 4)), torch.zeros(2, 4), None)],
            "param/r": [(((0, 4),), torch.zeros(4), None)], "param/s": [(((0, 4),), torch.zeros(4), None)]},
        1: {"param/w": [(((0, 4), (0, 6)), w, None)], "param/x": [(((0, 4), (0, 2)), torch.zeros(4, 2), None)],
            "param/r": [(((0, 4),), torch.zeros(4), None)], "param/s": [(((0, 4),), torch.zeros(4), None)],
            "buffer/b": [(((0, 3),), torch.zeros(3), None)]},
        2: {"param/w": [(((0, 4), (0, 3)), torch.zeros(4, 3), None)], "buffer/b": [(((0, 3),), torch.zeros(3), None)]},
    }
    shapes = {"param/w": (4, 6), "param/x": (4, 4), "param/r": (4,), "param/s": (4,), "buffer/b": (3,)}
    plans = [SavePlan([item for key, pieces in held[r].items()
                       for item in boxes_of(shapes[key], pieces).__create_write_items__(key, None)])
             for r in range(3)]
    out = disjoint_plans(plans)
    written: dict[str, list[tuple[int, tuple, tuple]]] = {}
    for r, plan in enumerate(out):
        for item in plan.items:
            c = item.tensor_data.chunk
            written.setdefault(item.index.fqn, []).append((r, tuple(c.offsets), tuple(c.sizes)))
    for key, boxes in written.items():
        count = torch.zeros(shapes[key], dtype=torch.int64)
        for r, offsets, sizes in boxes:
            count[_box_slices(offsets, sizes)] += 1
            # the writer holds the box
            assert any(all(lo <= o and o + n <= hi for (lo, hi), o, n in zip(region, offsets, sizes, strict=True))
                       for region, _, _ in held[r][key])
        union = torch.zeros(shapes[key], dtype=torch.int64)
        for pieces in held.values():
            for region, _, _ in pieces.get(key, []):
                union[tuple(slice(lo, hi) for lo, hi in region)] = 1
        assert torch.equal(count, union), (key, boxes)  # every element held is written exactly once
    assert written["param/w"] == [(0, (0, 0), (4, 6))] or written["param/w"] == [(1, (0, 0), (4, 6))]
    assert sorted(written["param/x"]) == [(0, (0, 0), (2, 4)), (1, (2, 0), (2, 2))]
    assert written["buffer/b"] == [(1, (0,), (3,))]
    assert {written["param/r"][0][0], written["param/s"][0][0]} == {0, 1}  # spread over the holders


def _info(step: int, **meta) -> CheckpointInfo:
    return CheckpointInfo(step=step, optimizer="sgd", losses=(0.5,) * step, meta={"seed": 0, **meta})


def _save_full(directory: Path, step: int, value: torch.Tensor, keep: int = 2) -> Path:
    """A checkpoint of one process holding `value` as chunks 0..2 of 3 of rows 1.. and row 0 whole, and
    the momentum of the whole as two overlapping boxes (a weight two ops read under different splits)."""
    rest = value[1:]
    momentum = value * 10
    state = {"param/w": boxes_of(value.shape, [(((1, 5), (0, 3)), chunk_of(rest, (j, 3)), (j, 3)) for j in range(3)]
                                 + [(((0, 1), (0, 3)), value[:1].clone(), None)]),
             "optimizer/w/momentum_buffer": boxes_of(value.shape, [(((0, 5), (0, 2)), momentum[:, :2].clone(), None),
                                                                   (((0, 3), (0, 3)), momentum[:3].clone(), None),
                                                                   (((3, 5), (0, 3)), momentum[3:].clone(), None)]),
             "optimizer/w/step": torch.tensor(float(step))}
    return save_checkpoint(directory, state, _info(step), keep=keep)


def test_checkpoints_round_trip_into_other_pieces_and_keep_the_newest(tmp_path):
    full = torch.arange(15.0, dtype=torch.float64).reshape(5, 3)
    for step in (2, 4, 6):
        _save_full(tmp_path, step, full + step)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004", "step-00000006"]
    newest = latest_checkpoint(tmp_path)
    assert newest == checkpoint_path(tmp_path, 6)
    assert read_info(newest) == _info(6)
    assert saved_tensors(newest) == {"param/w": ((5, 3), torch.float64),
                                     "optimizer/w/momentum_buffer": ((5, 3), torch.float64),
                                     "optimizer/w/step": ((), torch.float32)}
    # read back as columns, and as chunk 1 of 2 of rows 2..5 in float32
    cols = torch.zeros(5, 2, dtype=torch.float64), torch.zeros(5, 1, dtype=torch.float64)
    chunk = torch.zeros(5, dtype=torch.float32)
    momentum, step = torch.zeros(5, 3, dtype=torch.float64), torch.tensor(0.0)
    load_checkpoint(newest, {
        "param/w": boxes_of((5, 3), [(((0, 5), (0, 2)), cols[0], None), (((0, 5), (2, 3)), cols[1], None),
                                     (((2, 5), (0, 3)), chunk, (1, 2))]),
        "optimizer/w/momentum_buffer": boxes_of((5, 3), [(((0, 5), (0, 3)), momentum, None)]),
        "optimizer/w/step": step})
    assert torch.equal(torch.cat(cols, dim=1), full + 6)
    assert torch.equal(chunk, chunk_of((full + 6)[2:].float(), (1, 2)))
    assert torch.equal(momentum, (full + 6) * 10) and float(step) == 6.0
    assert latest_checkpoint(tmp_path / "missing") is None


@pytest.mark.parametrize("damage", ["truncate", "flip", "missing", "manifest"])
def test_a_broken_checkpoint_is_skipped_with_a_warning(tmp_path, damage):
    full = torch.arange(15.0).reshape(5, 3)
    _save_full(tmp_path, 2, full)
    newest = _save_full(tmp_path, 4, full)
    data = newest / "__0_0.distcp"
    raw = data.read_bytes()
    if damage == "truncate":  # a copy cut short
        data.write_bytes(raw[:-10])
    elif damage == "flip":  # one corrupted byte
        data.write_bytes(raw[:-5] + bytes([raw[-5] ^ 0xFF]) + raw[-4:])
    elif damage == "missing":
        (newest / ".metadata").unlink()
    else:
        (newest / "manifest.json").unlink()
    # A crash before the rename leaves only a temporary directory, which is never a candidate.
    (tmp_path / ".step-00000006.tmp").mkdir()
    with pytest.warns(UserWarning, match="ignoring checkpoint step-00000004: "):
        found = latest_checkpoint(tmp_path)
    assert found == checkpoint_path(tmp_path, 2)
    with pytest.raises(ValueError):
        verify_checkpoint(newest)


def test_resuming_a_checkpoint_of_another_model_or_optimizer_is_one_line(tmp_path):
    _, graph = capture_model(SMALL_MLP)
    save_checkpoint(tmp_path, {"param/w": torch.zeros(2)}, _info(1, graph="other", fingerprint="0" * 64))
    with pytest.raises(ValueError, match=r"^checkpoint \S+step-00000001 was saved for another model: graph "
                                         r"'other' \(fingerprint 000000000000\), this run trains"):
        run(SMALL_MLP, "dp", nproc=2, steps=2, resume=True, checkpoint_dir=tmp_path)
    save_checkpoint(tmp_path, {"param/w": torch.zeros(2)}, _info(2, graph=graph.name, fingerprint=graph.fingerprint))
    with pytest.raises(ValueError, match="was saved with optimizer sgd, this run uses adamw$"):
        run(SMALL_MLP, "dp", nproc=2, steps=3, resume=True, checkpoint_dir=tmp_path,
            setup=TrainSetup(optimizer="adamw"))


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
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002", "step-00000005"]


def test_resume_under_the_same_and_other_strategies_ends_where_uninterrupted_training_ends(tmp_path):
    """AdamW in float64 on 2 processes: 2 steps under tp, then one step each resumed under tp again, dp,
    fsdp (parameters and moments sharded in chunks of two boxes), dp, and finally in this process without
    a process group under one device. Each resumed run's parameters equal those of one process trained without
    interruption (verify, relative to the update), and its losses those of an uninterrupted 2-process run."""
    setup = TrainSetup(lr=0.01, optimizer="adamw", weight_decay=0.1)
    common = dict(nproc=2, setup=setup, dtype="float64", num_threads=1, timeout_s=30)
    losses = run(ODD_MLP, "tp", steps=7, **common)["losses"]
    run(ODD_MLP, "tp", steps=2, checkpoint_dir=tmp_path, **common)
    for steps, strategy in enumerate(("tp", "dp", "fsdp", "dp"), start=3):
        out = run(ODD_MLP, strategy, steps=steps, checkpoint_dir=tmp_path, resume=True, verify=True, **common)
        assert out["first_step"] == steps - 1, strategy
        assert out["verify"]["max_param_rel_diff"] < 1e-10, (strategy, out["verify"])
        assert out["losses"] == pytest.approx(losses[steps - 1:steps], rel=1e-12), strategy
    _, graph = capture_model(ODD_MLP)
    whole = {op.name: {"degrees": {}, "devices": [0]} for op in graph}
    out = train_rank(0, 1, build=functools.partial(build_workload, ODD_MLP, graph.batch_size),
                     graph=graph.to_dict(), strategy=whole,
                     options=TrainOptions(steps=7, setup=setup, dtype="float64", verify=True,
                                          checkpoint_dir=str(tmp_path), resume_from=str(checkpoint_path(tmp_path, 6))))
    assert out["first_step"] == 6 and out["verify"]["max_param_rel_diff"] < 1e-10, out["verify"]
    assert out["losses"] == pytest.approx(losses[6:], rel=1e-12)
    # the newest checkpoint, written without a process group, records every loss since step 0
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 7)
    assert read_info(checkpoint_path(tmp_path, 7)).losses == pytest.approx(losses, rel=1e-12)


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
    if not torch.cuda.is_available():  # on a GPU machine nccl runs (tests/test_device_runtime.py)
        with pytest.raises(ValueError, match="nccl computes on CUDA GPUs"):
            run(SMALL_MLP, "dp", backend="nccl")
    (tmp_path / "afile").write_text("")
    with pytest.raises(ValueError, match=r"^cannot write checkpoints in '\S+/sub': '\S+/afile' is not a directory$"):
        run(SMALL_MLP, "dp", checkpoint_dir=tmp_path / "afile" / "sub")
    absent = tmp_path / "absent"
    with pytest.warns(UserWarning, match="no checkpoint in"):
        out = run(SMALL_MLP, "dp", nproc=1, steps=1, resume=True, checkpoint_dir=absent)
    assert out["first_step"] == 0 and out["checkpoint"] == str(checkpoint_path(absent, 1))


def test_resume_refuses_broken_checkpoints_only_and_another_seed(tmp_path):
    """A directory whose checkpoints are all broken is an error naming each and what is wrong, not a
    silent start from step 0; so is a checkpoint saved with another seed (another stream of batches)."""
    full = torch.arange(15.0).reshape(5, 3)
    (_save_full(tmp_path / "cut", 2, full) / "__0_0.distcp").write_bytes(b"short")
    (_save_full(tmp_path / "bare", 2, full) / "manifest.json").unlink()
    for name, problem in (("cut", r"__0_0\.distcp has 5 bytes"), ("bare", r"no manifest\.json")):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the error says it all: no warning before it
            with pytest.raises(ValueError, match=rf"^cannot resume: \S+{name} holds no complete checkpoint "
                                                 rf"\(step-00000002: {problem}"):
                run(SMALL_MLP, "dp", nproc=1, steps=3, resume=True, checkpoint_dir=tmp_path / name)
    _, graph = capture_model(SMALL_MLP)
    save_checkpoint(tmp_path / "seeded", {"param/w": torch.zeros(2)},
                    _info(2, graph=graph.name, fingerprint=graph.fingerprint, seed=0))
    with pytest.raises(ValueError, match="was saved by a run with seed 0, this run has seed 7"):
        run(SMALL_MLP, "dp", nproc=1, steps=3, resume=True, checkpoint_dir=tmp_path / "seeded", seed=7)


def test_a_broken_checkpoint_newer_than_the_one_resumed_warns_once(tmp_path):
    common = dict(nproc=1, checkpoint_dir=tmp_path, num_threads=1, timeout_s=30)
    run(SMALL_MLP, "dp", steps=1, **common)
    broken = checkpoint_path(tmp_path, 4)
    shutil.copytree(checkpoint_path(tmp_path, 1), broken)
    (broken / "manifest.json").unlink()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = run(SMALL_MLP, "dp", steps=2, resume=True, **common)
    assert [str(w.message) for w in caught] == ["ignoring checkpoint step-00000004: no manifest.json"]
    assert out["first_step"] == 1 and out["checkpoint"] == str(checkpoint_path(tmp_path, 2))


@pytest.mark.slow
def test_adam_checkpoint_moves_between_strategies_and_process_counts(tmp_path):
    """AdamW state (step count and both moments) saved from 2 ranks under expert, resumed on 4 under tp,
    then on 1 process under mp. In float64: Adam divides by the root of the squared gradients, which turns
    float32 rounding noise in gradients that are zero in exact arithmetic (an attention key's bias) into
    full-size steps. Within the runtime's own float64 tolerances (`VERIFY_TOLERANCES`): in float64 that
    noise still leaves relative differences of about 1e-10 after 5 Adam steps."""
    tol = VERIFY_TOLERANCES["float64"]
    common = dict(setup=TrainSetup(lr=0.01, optimizer="adamw"), dtype="float64", checkpoint_dir=tmp_path,
                  num_threads=1, timeout_s=60)
    first = run(SMALL_TRANSFORMER, "expert", nproc=2, steps=2, **common)
    assert first["checkpoint"] == str(checkpoint_path(tmp_path, 2))
    second = run(SMALL_TRANSFORMER, "tp", nproc=4, steps=4, resume=True, verify=True, **common)
    assert second["first_step"] == 2 and second["verify"]["max_param_rel_diff"] < tol["rtol"], second["verify"]
    third = run(SMALL_TRANSFORMER, "mp", nproc=1, steps=5, resume=True, verify=True, **common)
    assert third["first_step"] == 4 and third["verify"]["max_param_rel_diff"] < tol["rtol"], third["verify"]
    assert third["verify"]["max_loss_rel_diff"] < tol["loss_rtol"], third["verify"]


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


def test_an_fp16_run_resumes_at_the_loss_scale_it_saved(tmp_path, monkeypatch):
    """In one process: fp16 training whose updates overflow at the scaler's starting scale (a gradient
    made inf while the scale is 2^16: step 0 is skipped and the scale halved) saves the scale it reached
    with its checkpoint, and a run resumed from it goes on at that scale: the same losses and no skipped
    step, as the uninterrupted run, where a scale reset to its start would skip again."""
    import runtime.train as train

    class Overflowing(train.LossScaler):
        def unscale(self, params):
            if self.scale == 2.0**16:
                next(p for p in params if p.grad is not None).grad.view(-1)[0] = float("inf")
            return super().unscale(params)

    monkeypatch.setattr(train, "LossScaler", Overflowing)
    _, graph = capture_model(ODD_MLP)
    whole = {op.name: {"degrees": {}, "devices": [0]} for op in graph}
    build = functools.partial(build_workload, ODD_MLP, graph.batch_size)

    def go(steps: int, directory: Path, resume: bool) -> dict:
        latest = latest_checkpoint(directory) if resume else None
        return train_rank(0, 1, build=build, graph=graph.to_dict(), strategy=whole,
                          options=TrainOptions(steps=steps, setup=TrainSetup(precision="fp16"),
                                               checkpoint_dir=str(directory),
                                               resume_from=None if latest is None else str(latest)))

    straight = go(4, tmp_path / "straight", False)
    assert straight["skipped_steps"] == [0], straight["skipped_steps"]
    go(2, tmp_path / "cut", False)
    assert read_info(checkpoint_path(tmp_path / "cut", 2)).meta["loss_scale"] == {"scale": 2.0**15, "good": 1}
    resumed = go(4, tmp_path / "cut", True)
    assert resumed["first_step"] == 2 and resumed["skipped_steps"] == [], resumed["skipped_steps"]
    assert resumed["losses"] == straight["losses"][2:]
