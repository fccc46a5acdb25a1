"""`Timeline`: the result of one simulation, and its export as a summary and as a Chrome trace.

Owns the read-only record of a simulated iteration: start and end of every task (integer ns inside,
milliseconds outside), the iteration time, the critical path split into compute, communication and
synchronization, bytes moved, memory per device and feasibility. The simulator (`simulator.engine`)
fills it in; nothing here simulates. Must import only `soap` and the stdlib.

Chrome trace (the JSON object format of the Trace Event Format; open it in https://ui.perfetto.dev or
chrome://tracing): process 0 is "devices" with one thread row per device, process 1 is "links" with one
row per link; a transfer or all-reduce appears on every link it occupies. Times are microseconds.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from simulator.taskgraph import CATEGORY_NAMES


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskRecord:
    """One simulated task: `resources` are device ids (`devices`) and link ids (`links`)."""

    key: int
    name: str
    category: str
    devices: tuple[int, ...]
    links: tuple[int, ...]
    start_ms: float
    end_ms: float
    nbytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class OutOfMemory:
    """A device whose simulated peak exceeds its capacity."""

    device: int
    need_bytes: int
    capacity_bytes: int

    def __iter__(self):  # unpacks as (device, need, capacity)
        return iter((self.device, self.need_bytes, self.capacity_bytes))


class Timeline:
    """A simulated training iteration (forward, backward, gradient all-reduces, optimizer updates).

    `compute_ms + comm_ms + sync_ms == iteration_time_ms` up to float rounding: they split the critical
    path (from the last task to finish back to time 0, each step through the predecessor or the previous
    task on a shared resource that ended exactly when it started) by task category.
    """

    def __init__(self, *, name: str, num_devices: int, link_names: Sequence[str], iteration_ns: int,
                 path_ns: tuple[int, int, int], bytes_moved: int, peak_memory: Sequence[int],
                 capacity: Sequence[int], order: list[int], keys: list[int], cats: list[int],
                 res: list[tuple[int, ...]], start: list[int], end: list[int], nbytes: list[int],
                 namer: Callable[[int], str], critical_path: list[int], replicas: int = 1):
        self.name = name
        # >1: the simulation timed replica 0 of this many identical replicas (`simulator.engine.simulate`);
        # its tasks are replica 0's, the figures (time, memory per device, bytes moved) the whole step's
        self.replicas = replicas
        self.num_devices = num_devices
        self._link_names = tuple(link_names)
        self._iteration_ns = iteration_ns
        self._path_ns = path_ns
        self.bytes_moved = int(bytes_moved)
        self.peak_memory_bytes = tuple(int(b) for b in peak_memory)
        self.memory_capacity_bytes = tuple(int(b) for b in capacity)
        self.oom = tuple(OutOfMemory(device=d, need_bytes=need, capacity_bytes=cap)
                         for d, (need, cap) in enumerate(zip(self.peak_memory_bytes, self.memory_capacity_bytes,
                                                             strict=True)) if need > cap)
        self._order, self._keys, self._cats, self._res = order, keys, cats, res
        self._start, self._end, self._nbytes = start, end, nbytes
        self._namer = namer
        self._critical = critical_path

    # -- headline figures ----------------------------------------------------------------------------

    @property
    def iteration_time_ms(self) -> float:
        return self._iteration_ns / 1e6

    @property
    def iteration_time_ns(self) -> int:
        return self._iteration_ns

    @property
    def compute_ms(self) -> float:
        return self._path_ns[0] / 1e6

    @property
    def comm_ms(self) -> float:
        return self._path_ns[1] / 1e6

    @property
    def sync_ms(self) -> float:
        return self._path_ns[2] / 1e6

    @property
    def feasible(self) -> bool:
        return not self.oom

    @property
    def num_tasks(self) -> int:
        return len(self._order)

    @property
    def device_busy_ms(self) -> tuple[float, ...]:
        """Per device, the summed duration of the tasks it ran."""
        busy = [0] * self.num_devices
        d_max = self.num_devices
        for t in self._order:
            for x in self._res[t]:
                if x < d_max:
                    busy[x] += self._end[t] - self._start[t]
        return tuple(b / 1e6 for b in busy)

    def summary(self) -> dict[str, Any]:
        """The keys of ``soapflow simulate --json`` that scripts may rely on (README), plus `oom`."""
        return {
            "iteration_time_ms": self.iteration_time_ms,
            "compute_ms": self.compute_ms,
            "comm_ms": self.comm_ms,
            "sync_ms": self.sync_ms,
            "bytes_moved": self.bytes_moved,
            "peak_memory_bytes": list(self.peak_memory_bytes),
            "feasible": self.feasible,
            "num_tasks": self.num_tasks,
            "oom": [{"device": o.device, "need_bytes": o.need_bytes, "capacity_bytes": o.capacity_bytes}
                    for o in self.oom],
        }

    # -- tasks ---------------------------------------------------------------------------------------

    def task_times(self) -> dict[int, tuple[int, int]]:
        """Static task key -> (start ns, end ns); equal between full and delta simulation."""
        return {self._keys[t]: (self._start[t], self._end[t]) for t in self._order}

    def _record(self, t: int) -> TaskRecord:
        res = self._res[t]
        return TaskRecord(key=self._keys[t], name=self._namer(self._keys[t]), category=CATEGORY_NAMES[self._cats[t]],
                          devices=tuple(x for x in res if x < self.num_devices),
                          links=tuple(x - self.num_devices for x in res if x >= self.num_devices),
                          start_ms=self._start[t] / 1e6, end_ms=self._end[t] / 1e6, nbytes=self._nbytes[t])

    def tasks(self) -> list[TaskRecord]:
        """Every task, in the order the simulation started them."""
        return [self._record(t) for t in self._order]

    def critical_path(self) -> list[TaskRecord]:
        """The critical path, first task first."""
        return [self._record(t) for t in reversed(self._critical)]

    # -- trace ---------------------------------------------------------------------------------------

    def to_chrome_trace(self) -> dict[str, Any]:
        """Chrome trace JSON (see the module docstring)."""
        events: list[dict[str, Any]] = [
            {"ph": "M", "pid": 0, "name": "process_name", "args": {"name": "devices"}},
            {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "links"}},
            {"ph": "M", "pid": 0, "name": "process_sort_index", "args": {"sort_index": 0}},
            {"ph": "M", "pid": 1, "name": "process_sort_index", "args": {"sort_index": 1}},
        ]
        for d in range(self.num_devices):
            events.append({"ph": "M", "pid": 0, "tid": d, "name": "thread_name", "args": {"name": f"device {d}"}})
        for i, label in enumerate(self._link_names):
            events.append({"ph": "M", "pid": 1, "tid": i, "name": "thread_name", "args": {"name": label}})
        d_max = self.num_devices
        for t in self._order:
            start, end = self._start[t], self._end[t]
            name = self._namer(self._keys[t])
            cat = CATEGORY_NAMES[self._cats[t]]
            args = {"bytes": self._nbytes[t]} if self._nbytes[t] else {}
            for x in self._res[t]:
                pid, tid = (0, x) if x < d_max else (1, x - d_max)
                events.append({"ph": "X", "pid": pid, "tid": tid, "name": name, "cat": cat,
                               "ts": start / 1e3, "dur": (end - start) / 1e3, "args": args})
        return {"traceEvents": events, "displayTimeUnit": "ms",
                "otherData": {"model": self.name, "iteration_time_ms": self.iteration_time_ms}}

    def write_chrome_trace(self, path: str | os.PathLike) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_chrome_trace()))

    def __repr__(self) -> str:
        return (f"Timeline({self.name!r}, iteration_time_ms={self.iteration_time_ms:.3f}, "
                f"num_tasks={self.num_tasks}, feasible={self.feasible})")
