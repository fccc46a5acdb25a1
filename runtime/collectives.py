"""Data movement between ranks: process groups, the exchange of one edge (forward and adjoint), the
bucketed gradient all-reduce, and the count of the collectives a step issues.

Owns `make_groups`, `CollectiveLog`, `Outbox`, `exchange`, `EdgeMover` and `GradSync`. What moves is decided by the
step plan (`soap.lowering`): one exchange per edge, consumer round and pass among that exchange's ranks
(one per edge and pass without repeated devices), one all-reduce per bucket and device group; this module
only executes it. Imports torch and `soap` only (no simulator, no search, no soapflow).

Why the adjoint is explicit and not an `autograd.Function`: in backward, torch's autograd engine orders
ready nodes by local dependencies, which differ from rank to rank (each rank holds different parts), so
exchanges issued from inside autograd could be reached in different orders on two ranks and deadlock; and
a rank that only *sent* a piece has no local use of it, so autograd would never run its backward and the
gradient sent back to it would never be received. The interpreter therefore runs the adjoint itself, edge
by edge and round by round in the plan's backward order, the same order on every rank. The adjoint rule is the one of
`docs/architecture.md` ("the runtime"): every piece's gradient goes back to the rank the piece came from
and is added there. This gives, without special cases, a reduce-scatter for the adjoint of a gather into
a partitioned consumer, a slice for a replicated consumer, and the broadcast of a partial-sum reduction.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist

from soap.lowering import ALL_REDUCE, ALL_TO_ALL, AllReduce, Edge, EdgeStep, OpStep, SyncEntry
from soap.opdef import Region


def rel_slices(piece: Region, frame: Region) -> tuple[slice, ...]:
    """Index of global region `piece` inside a tensor holding global region `frame`."""
    return tuple(slice(lo - flo, hi - flo) for (lo, hi), (flo, _) in zip(piece, frame, strict=True))


def region_shape(region: Region) -> tuple[int, ...]:
    return tuple(hi - lo for lo, hi in region)


def make_groups(device_sets: Iterable[tuple[int, ...]], *, timeout_s: float,
                backend: str | None = None) -> dict[tuple[int, ...], dist.ProcessGroup | None]:
    """One process group per device set, created in the given order on every rank (torch requires
    every rank to take part in every `new_group` call, member or not). Non-members get None."""
    rank = dist.get_rank()
    out: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
    for ranks in device_sets:
        group = dist.new_group(ranks=list(ranks), timeout=datetime.timedelta(seconds=timeout_s),
                               backend=backend)
        out[tuple(ranks)] = group if rank in ranks else None
    return out


class CollectiveLog:
    """Per kind, the count and bytes of the collectives this rank issued since the last `reset` (the
    shape of `soap.lowering.StepPlan.collectives`, one rank's entry): ``all_to_all`` counts the bytes this
    rank sends to other ranks, ``all_reduce`` the bytes of the buffer it reduces."""

    def __init__(self) -> None:
        self.counts: dict[str, dict[str, int]] = {}

    def record(self, kind: str, nbytes: int) -> None:
        slot = self.counts.setdefault(kind, {"count": 0, "bytes": 0})
        slot["count"] += 1
        slot["bytes"] += nbytes

    def reset(self) -> None:
        self.counts = {}

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {k: dict(v) for k, v in sorted(self.counts.items())}


class Outbox:
    """The exchanges this rank only sends in, still in flight (`exchange` with an outbox).

    A rank that receives nothing in an exchange need not wait for its receivers: its part of the
    all-to-all is issued asynchronously (gloo runs every collective on its own worker threads anyway) and
    it goes on computing. Waiting would tie the stages of a pipeline together at each micro-batch: the
    producer could not start micro-batch m + 1 before the consumer arrived for micro-batch m, so a stall
    of either one stalls both. (Measured on cpu-2, two stages of the zoo's MLP in 4 micro-batches: the
    consumer's time waiting in exchanges falls by a quarter to a third; the step time, bounded by the
    stages' compute, stays within noise.) The packed send buffer is the exchange's own copy, so nothing
    the rank does next can change what is sent.

    `drain()` waits for them all (the executor drains before its step ends, so a step leaves nothing in
    flight); posting more than `max_in_flight` waits for the oldest first, which bounds the memory held by
    send buffers and waits only for a receiver that is already due. Every rank still issues every
    collective in the plan's order, so the order-matching of the collectives (and deadlock freedom) is
    that of the blocking exchanges.
    """

    def __init__(self, max_in_flight: int = 8) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be positive, got {max_in_flight}")
        self.max_in_flight = max_in_flight
        self._works: list[tuple[dist.Work, torch.Tensor]] = []

    def post(self, work: dist.Work, buffer: torch.Tensor) -> None:
        while len(self._works) >= self.max_in_flight:
            self._works.pop(0)[0].wait()
        self._works.append((work, buffer))

    def drain(self) -> None:
        works, self._works = self._works, []
        for work, _ in works:
            work.wait()

    def __len__(self) -> int:
        return len(self._works)


def exchange(ranks: tuple[int, ...], group: dist.ProcessGroup | None, sends: Sequence[tuple[torch.Tensor, int]],
             recvs: Sequence[tuple[tuple[int, ...], int]], dtype: torch.dtype, log: CollectiveLog,
             outbox: Outbox | None = None, device: torch.device | None = None) -> list[torch.Tensor]:
    """Send each (tensor, peer) and receive each (shape, peer) among `ranks`; returns the received tensors
    (on `device`, the rank's compute device: CPU when not given).

    Both sides list the pieces between two ranks in the same order (they derive them from the same plan),
    so the pieces travel packed in one `all_to_all_single` over the exchange's group. A collective rather
    than point-to-point sends: gloo's isend/irecv hand every message to its event-loop thread, which on a
    busy machine waits for the scheduler (milliseconds per message). Received tensors are views of the
    packed buffer (no copy out). With an `outbox`, a rank that receives nothing does not wait for the
    exchange to complete (`Outbox`).
    """
    position = {r: i for i, r in enumerate(ranks)}
    wire = torch.uint8 if dtype == torch.bool else dtype
    outgoing: list[list[torch.Tensor]] = [[] for _ in ranks]
    for t, peer in sends:
        outgoing[position[peer]].append(t.reshape(-1).view(wire))
    in_splits = [sum(t.numel() for t in ts) for ts in outgoing]
    flat_in = (torch.cat([t for ts in outgoing for t in ts]) if sum(in_splits)
               else torch.empty(0, dtype=wire, device=device))
    incoming: list[list[int]] = [[] for _ in ranks]
    for j, (_, peer) in enumerate(recvs):
        incoming[position[peer]].append(j)
    out_splits = [sum(_numel(recvs[j][0]) for j in js) for js in incoming]
    flat_out = torch.empty(sum(out_splits), dtype=wire, device=device)
    send_only = outbox is not None and not recvs
    work = dist.all_to_all_single(flat_out, flat_in, output_split_sizes=out_splits, input_split_sizes=in_splits,
                                  group=group, async_op=send_only)
    log.record(ALL_TO_ALL, flat_in.numel() * flat_in.element_size())
    if send_only:
        outbox.post(work, flat_in)
        return []
    received: list[torch.Tensor | None] = [None] * len(recvs)
    offset = 0
    for js in incoming:
        for j in js:
            shape = recvs[j][0]
            n = _numel(shape)
            received[j] = flat_out[offset:offset + n].view(dtype).view(shape)
            offset += n
    return received  # type: ignore[return-value]


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class EdgeMover:
    """Moves one edge's tensor (`soap.lowering.EdgeStep`) into the consumer part of one round on this rank
    (`round`: the consumer parts of that round, `OpStep.rounds`), and its gradient back.

    The pieces it handles are those the consumer parts of its round read: local ones (producer and
    consumer part on one device) are sliced from the producer part's output, the moving ones travel in
    that round's exchange (`EdgeStep.exchanges`: one all-to-all per pass among its ranks; none where the
    round receives nothing). Producer outputs are passed by producer part (`outputs[p]`), as a device may
    hold several parts of the producer. `forward(outputs)` returns the consumer part's input region here
    (None where this rank has no part in the round, or the part does not read the input);
    `backward(grad, accumulate)` takes the gradient of that input and sends every piece back to its
    producer part, calling `accumulate(p, slices, piece)` where this rank holds producer part `p`. What
    this rank sends, receives and assembles depends on the plan only, so it is worked out once here; a
    step only moves tensors. `bind(groups)` hands it the process group of its exchange.
    """

    def __init__(self, step: EdgeStep, edge: Edge, prod: OpStep, cons: OpStep, *, rank: int, dtype: torch.dtype,
                 log: CollectiveLog, round: int = 0, outbox: Outbox | None = None,
                 device: torch.device | None = None):
        self.step = step
        self.rank = rank
        self.dtype = dtype
        self.device = device
        self.log = log
        self.outbox = outbox
        self.round = round
        self.group: dist.ProcessGroup | None = None
        found = [(ranks, moving) for r, ranks, moving in step.exchanges if r == round]
        self.ranks, moving = found[0] if found else ((), ())
        self.member = rank in self.ranks
        pdev, cdev, rounds = prod.devices, cons.devices, cons.rounds
        mine = [c for c in cons.parts_on(rank) if rounds[c] == round]
        my_part = self.part = mine[0] if mine else None
        # the region of the tensor each producer part holds (what a piece's slices are relative to)
        frames = prod.out_regions[edge.out].tolist()
        self._src_frame = {p: tuple(map(tuple, frames[p])) for p in {piece[0] for piece in step.pieces}}
        # forward: sends (producer part, its slices, peer); receives (piece index, shape, peer), in piece order
        self._sends: list[tuple[int, tuple[slice, ...], int]] = []
        self._recvs: list[tuple[int, tuple[int, ...], int]] = []
        for k in moving:
            p, c, _, region = step.pieces[k]
            if pdev[p] == rank:
                self._sends.append((p, rel_slices(region, self._src_frame[p]), cdev[c]))
            elif cdev[c] == rank:
                self._recvs.append((k, region_shape(region), pdev[p]))
        want = cons.reads[edge.slot][my_part] if my_part is not None else None
        # how the consumer part's input is made: None (not read here), ("whole", k, producer part or None
        # for a received piece, its slices), or ("build", shape, [(k, producer part or None, its slices,
        # input slices)])
        self._input: tuple | None = None
        local: set[int] = set()
        if want is not None:
            pieces = []
            for k, (p, c, _, region) in enumerate(step.pieces):
                if c != my_part:
                    continue
                here = pdev[p] == rank
                if here:
                    local.add(p)
                pieces.append((k, p if here else None, rel_slices(region, self._src_frame[p]) if here else None,
                               rel_slices(region, want)))
            if len(pieces) == 1 and step.pieces[pieces[0][0]][3] == want:
                self._input = ("whole", *pieces[0][:3])
            else:
                self._input = ("build", region_shape(want), pieces)
        # the producer parts on this rank whose output the assembly reads, and those the exchange reads
        self.local_parts = tuple(sorted(local))
        self.forward_parts = tuple(sorted(local | {p for p, _, _ in self._sends}))
        # backward: ("add", grad slices, shape, producer part, its slices), ("send", grad slices, shape,
        # peer) or ("recv", producer part, its slices, shape, peer), in piece order
        self._grads: list[tuple] = []
        if step.grad:
            for p, c, _, region in step.pieces:
                if rounds[c] != round:
                    continue
                shape = region_shape(region)
                if cdev[c] == rank:
                    if pdev[p] == rank:
                        self._grads.append(("add", rel_slices(region, want), shape, p,
                                            rel_slices(region, self._src_frame[p])))
                    else:
                        self._grads.append(("send", rel_slices(region, want), shape, pdev[p]))
                elif pdev[p] == rank:
                    self._grads.append(("recv", p, rel_slices(region, self._src_frame[p]), shape, cdev[c]))

    def bind(self, groups: Mapping[tuple[int, ...], dist.ProcessGroup | None]) -> None:
        if self.member:
            self.group = groups.get(self.ranks)

    def forward(self, outputs: Mapping[int, torch.Tensor]) -> torch.Tensor | None:
        return self.assemble(outputs, self.receive(outputs))

    def receive(self, outputs: Mapping[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Take part in the round's forward exchange: send this rank's pieces of the producer parts'
        `outputs` (by producer part: at least `forward_parts`), return the received ones by piece index."""
        if not self.member:
            return {}
        sends = [(outputs[p][slices], peer) for p, slices, peer in self._sends]
        got = exchange(self.ranks, self.group, sends, [(shape, peer) for _, shape, peer in self._recvs],
                       self.dtype, self.log, self.outbox, self.device)
        return {k: t for (k, _, _), t in zip(self._recvs, got, strict=True)}

    def assemble(self, outputs: Mapping[int, torch.Tensor], received: Mapping[int, torch.Tensor]
                 ) -> torch.Tensor | None:
        """The consumer part's input here from this rank's producer parts' `outputs` (read only for
        `local_parts`) and the `received` pieces (adding partial sums); no communication."""
        how = self._input
        if how is None:
            return None
        if how[0] == "whole":
            _, k, p, src = how
            return received[k] if p is None else outputs[p][src]
        _, shape, pieces = how
        reduced = self.step.reduced
        buf = (torch.zeros if reduced else torch.empty)(shape, dtype=self.dtype, device=self.device)
        for k, p, src, dst in pieces:
            piece = received[k] if p is None else outputs[p][src]
            if reduced:
                buf[dst].add_(piece)
            else:
                buf[dst].copy_(piece)
        return buf

    def backward(self, grad: torch.Tensor | None,
                 accumulate: Callable[[int, tuple[slice, ...], torch.Tensor], None]) -> None:
        """`grad` is the gradient of the input region of the round's consumer part on this rank (None:
        zeros, or no part)."""
        if not self.step.grad:
            return
        sends: list[tuple[torch.Tensor, int]] = []
        recvs: list[tuple[tuple[int, ...], int]] = []
        targets: list[tuple[int, tuple[slice, ...]]] = []
        for how in self._grads:
            if how[0] == "recv":
                _, p, src, shape, peer = how
                recvs.append((shape, peer))
                targets.append((p, src))
                continue
            piece = grad[how[1]] if grad is not None else torch.zeros(how[2], dtype=self.dtype, device=self.device)
            if how[0] == "add":
                accumulate(how[3], how[4], piece)
            else:
                sends.append((piece, how[3]))
        if self.member:
            got = exchange(self.ranks, self.group, sends, recvs, self.dtype, self.log, self.outbox, self.device)
            for (p, slices), buf in zip(targets, got, strict=True):
                accumulate(p, slices, buf)


class GradSync:
    """The step plan's gradient all-reduces (`soap.lowering.AllReduce`, sum) on this rank, asynchronous.

    `ready(op)` is called once the backward of an op position is done (all its rounds), in the same order
    on every rank; the all-reduces whose last gradient that op finished (`AllReduce.after`: the parts of
    one device add their gradients into its shards first) are launched there, in the plan's order, so
    they overlap the backward of the ops before it (as DDP's buckets do); a shard's gradient is from then
    on its view of the bucket, which the all-reduce sums in place. `finish()` waits for them (and writes
    back the sums of whole parameters). An all-reduce over one rank (overlapping shards of one parameter
    on that rank) adds them locally and issues no collective. Only the members of a group take part: a
    parameter replicated on devices (1, 2) of 4 never involves ranks 0 and 3.
    """

    def __init__(self, all_reduces: Sequence[AllReduce], *, rank: int,
                 groups: Mapping[tuple[int, ...], dist.ProcessGroup | None],
                 grad_of: Callable[[SyncEntry], torch.Tensor],
                 set_grad: Callable[[SyncEntry, torch.Tensor], None], log: CollectiveLog):
        self.rank = rank
        self.groups = groups
        self.grad_of = grad_of
        self.set_grad = set_grad
        self.log = log
        self.by_op: dict[int, list[AllReduce]] = {}
        for a in all_reduces:
            if rank in a.group:
                self.by_op.setdefault(a.after, []).append(a)
        self.launched: list[tuple[dist.Work | None, list[tuple[SyncEntry, torch.Tensor]]]] = []

    def ready(self, op: int) -> None:
        for a in self.by_op.get(op, ()):
            bucket = [(e, self.grad_of(e)) for e in a.entries]
            if len(bucket) == 1 and bucket[0][1].is_contiguous():
                # A bucket of one gradient is reduced in place: no copy in, no copy out.
                flat = bucket[0][1].view(-1)
                views = bucket
            else:
                flat = torch.cat([g.reshape(-1) for _, g in bucket])
                views, offset = [], 0
                for e, g in bucket:
                    views.append((e, flat[offset:offset + g.numel()].view_as(g)))
                    offset += g.numel()
            del bucket
            # A shard's own gradient becomes its view of the bucket now (the all-reduce sums in place), so
            # that its copy is freed at once; a whole parameter's (its overlapping shards added up) is
            # written back to the shards once the sum is done.
            pending = []
            for e, g in views:
                if e.region is not None:
                    self.set_grad(e, g)
                else:
                    pending.append((e, g))
            work = None
            if len(a.group) > 1:
                work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.groups[a.group], async_op=True)
                self.log.record(ALL_REDUCE, flat.numel() * flat.element_size())
            self.launched.append((work, pending))

    def finish(self) -> None:
        for work, pending in self.launched:
            if work is not None:
                work.wait()
            for e, g in pending:
                self.set_grad(e, g)
        self.launched = []
