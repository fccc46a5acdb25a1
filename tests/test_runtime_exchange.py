"""The exchange's sends that need not wait (`runtime.collectives.Outbox`) and the threads every rank runs
with (`runtime.launch.threads_per_rank`).

A rank that only sends in an exchange posts its part and goes on; the test shows it by an order that
deadlocks unless the send returns before its receiver arrives (no wall-clock assertion: a blocking send
would end in the process group's timeout). The pipeline cases of `test_runtime_microbatch.py` check the
values such exchanges carry against single-process training.
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist

from runtime.collectives import CollectiveLog, Outbox, exchange
from runtime.launch import launch, threads_per_rank
from soap.lowering import ALL_TO_ALL


class _Work:
    def __init__(self, name: str, waited: list[str]) -> None:
        self.name, self.waited = name, waited

    def wait(self) -> bool:
        self.waited.append(self.name)
        return True


def test_outbox_waits_for_the_oldest_beyond_its_bound_and_drains_in_order():
    waited: list[str] = []
    box = Outbox(max_in_flight=2)
    for name in "abc":
        box.post(_Work(name, waited), torch.zeros(1))
    assert waited == ["a"] and len(box) == 2
    box.drain()
    assert waited == ["a", "b", "c"] and len(box) == 0
    with pytest.raises(ValueError, match="max_in_flight"):
        Outbox(max_in_flight=0)


def test_threads_per_rank_shares_the_cores_out():
    cores = len(os.sched_getaffinity(0))
    assert threads_per_rank(1) == cores
    assert threads_per_rank(2) == max(1, cores // 2)
    assert threads_per_rank(4 * cores) == 1


def _send_first(rank: int, world_size: int) -> dict:
    """Rank 0 sends a piece to rank 1 in an exchange of group A, then takes part in an exchange of group B
    that rank 1 issues first: only a send that does not wait for its receiver lets both finish."""
    group_a, group_b = (dist.new_group([0, 1], timeout=datetime.timedelta(seconds=20)) for _ in range(2))
    log = CollectiveLog()
    box = Outbox()
    piece = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    if rank == 0:
        got = exchange((0, 1), group_a, [(piece, 1)], [], torch.float32, log, box)
        assert got == [] and len(box) == 1
        token = exchange((0, 1), group_b, [], [((1,), 1)], torch.float32, log, box)[0]
        box.drain()
        received = None
    else:
        exchange((0, 1), group_b, [(torch.ones(1), 0)], [], torch.float32, log)
        received = exchange((0, 1), group_a, [], [((2, 3), 0)], torch.float32, log, box)[0]
        token = None
    return {"received": received, "token": token, "threads": torch.get_num_threads(),
            "log": log.snapshot()}


def test_a_rank_that_only_sends_does_not_wait_for_its_receiver():
    results = launch(_send_first, 2, timeout_s=20, wall_timeout_s=120)
    assert torch.equal(results[1]["received"], torch.arange(6, dtype=torch.float32).reshape(2, 3))
    assert torch.equal(results[0]["token"], torch.ones(1))
    # every exchange is counted where it is issued, waited for or not
    assert results[0]["log"][ALL_TO_ALL] == {"count": 2, "bytes": 24}
    # the launcher shares the cores out among the ranks
    assert [r["threads"] for r in results] == [threads_per_rank(2)] * 2
