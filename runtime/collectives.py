"""Data movement between ranks: the generic redistribution (forward and adjoint), process groups, and the
bucketed gradient all-reduce.

Owns `make_groups`, `Exchange`, `exchange`, `Redistribution` and `GradSync`. Imports torch and `runtime.plan` only
(no simulator, no search, no soapflow).

Why the adjoint is explicit and not an `autograd.Function`: in backward, torch's autograd engine orders
ready nodes by local dependencies, which differ from rank to rank (each rank holds different parts), so
exchanges issued from inside autograd could be reached in different orders on two ranks and deadlock; and
a rank that only *sent* a piece has no local use of it, so autograd would never run its backward and the
gradient sent back to it would never be received. The interpreter therefore runs the adjoint itself, edge
by edge in reverse graph order, the same order on every rank. The adjoint rule is the one of DESIGN
section 6: every piece's gradient goes back to the rank the piece came from and is added there. This
gives, without special cases, a reduce-scatter for the adjoint of a gather into a partitioned consumer, a
slice for a replicated consumer, and the broadcast of a partial-sum reduction.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from runtime.plan import EdgePlan, Region, SyncEntry


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


@dataclass(frozen=True, slots=True, kw_only=True)
class Exchange:
    """One step of data movement among `ranks` (a process group), known from the plan on every rank.

    `dtypes` are the dtypes that move (one all-to-all each, in this order); every member calls them all,
    with empty splits where it has nothing of a dtype, so the collectives match.
    """

    ranks: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...]


def exchange(plan: Exchange | None, group: dist.ProcessGroup | None,
             sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[tuple[int, ...], torch.dtype, int]]
             ) -> list[torch.Tensor]:
    """Send each (tensor, peer) and receive each (shape, dtype, peer); returns the received tensors.

    Both sides list the pieces between two ranks in the same order (they derive them from the same plan),
    so the pieces travel packed, one `all_to_all_single` per dtype over the exchange's group. A collective
    rather than point-to-point sends: gloo's isend/irecv hand every message to its event-loop thread,
    which on a busy machine waits for the scheduler (milliseconds per message), while its collectives run
    in the calling worker. Received tensors are views of the packed buffer (no copy out).
    """
    if plan is None:
        assert not sends and not recvs
        return []
    position = {r: i for i, r in enumerate(plan.ranks)}
    received: list[torch.Tensor | None] = [None] * len(recvs)
    for dtype in plan.dtypes:
        wire = torch.uint8 if dtype == torch.bool else dtype
        outgoing: list[list[torch.Tensor]] = [[] for _ in plan.ranks]
        for t, peer in sends:
            if t.dtype == dtype:
                outgoing[position[peer]].append(t.reshape(-1).view(wire))
        in_splits = [sum(t.numel() for t in ts) for ts in outgoing]
        flat_in = torch.cat([t for ts in outgoing for t in ts]) if sum(in_splits) else torch.empty(0, dtype=wire)
        incoming: list[list[int]] = [[] for _ in plan.ranks]
        for j, (_, dt, peer) in enumerate(recvs):
            if dt == dtype:
                incoming[position[peer]].append(j)
        out_splits = [sum(_numel(recvs[j][0]) for j in js) for js in incoming]
        flat_out = torch.empty(sum(out_splits), dtype=wire)
        dist.all_to_all_single(flat_out, flat_in, output_split_sizes=out_splits, input_split_sizes=in_splits,
                               group=group)
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


def _exchange_plan(edges: Sequence[EdgePlan], dtypes: Sequence[torch.dtype]) -> Exchange | None:
    ranks = sorted({r for e in edges for t in e.transfers if t.src != t.dst for r in (t.src, t.dst)})
    if not ranks:
        return None
    moving = {dt for e, dt in zip(edges, dtypes, strict=True) if any(t.src != t.dst for t in e.transfers)}
    return Exchange(ranks=tuple(ranks), dtypes=tuple(sorted(moving, key=str)))


class Redistribution:
    """Moves the inputs of one consumer op (all its input edges) to its part on this rank, and back.

    `forward(outputs)` takes, per edge, this rank's part of the producer's output (None where this rank
    has none) and returns, per edge, the consumer part's input region (None where this rank has no
    part, or the part does not read the input). `backward(grads, accumulate)` takes the gradients of
    those inputs and sends every piece back to its producer part, calling `accumulate(edge, slices,
    piece)` where this rank holds that producer part.

    What this rank sends, receives and assembles depends on the plan only, so it is worked out once here
    (index slices, shapes, the ranks and dtypes of each exchange); a step only moves tensors. The process
    groups of the exchanges (`device_sets()`) are bound with `bind(groups)` before the first step.
    """

    def __init__(self, edges: Sequence[EdgePlan], *, rank: int, my_part: int | None,
                 my_src_parts: Sequence[int | None], dtypes: Sequence[torch.dtype],
                 local_tensor: Callable[[EdgePlan], torch.Tensor] | None = None):
        self.edges = tuple(edges)
        self.rank = rank
        self.my_part = my_part
        self.my_src_parts = tuple(my_src_parts)
        self.dtypes = tuple(dtypes)
        self.local_tensor = local_tensor
        self.fwd_exchange = _exchange_plan(self.edges, self.dtypes)
        grad_edges = [(e, dt) for e, dt in zip(self.edges, self.dtypes, strict=True) if e.needs_grad and not e.local]
        self.bwd_exchange = _exchange_plan([e for e, _ in grad_edges], [dt for _, dt in grad_edges])
        self.fwd_group: dist.ProcessGroup | None = None
        self.bwd_group: dist.ProcessGroup | None = None
        # forward: sends (edge, slices of the producer part, peer); receives (edge, k, shape, peer)
        self._sends: list[tuple[int, tuple[slice, ...], int]] = []
        self._recvs: list[tuple[int, int, tuple[int, ...], int]] = []
        # per edge, how the consumer part's input is made: None (not read here), ("local", slices of the
        # constant or batch), ("whole", k, slices of the producer part or None for a received piece), or
        # ("build", shape, [(k, slices of the producer part or None, slices of the input)])
        self._inputs: list[tuple | None] = []
        # backward, per edge: ("add", grad slices, shape, producer slices), ("send", grad slices, shape,
        # peer) or ("recv", producer slices, shape, peer)
        self._grads: list[list[tuple]] = []
        for i, edge in enumerate(self.edges):
            for k, t in enumerate(edge.transfers):
                if t.src == rank and t.dst != rank:
                    self._sends.append((i, rel_slices(t.region, edge.src_regions[t.src_part]), t.dst))
                elif t.dst == rank and t.src != rank:
                    self._recvs.append((i, k, region_shape(t.region), t.src))
            want = edge.regions[my_part] if my_part is not None else None
            self._inputs.append(None if want is None else self._assembly(edge, want))
            grads: list[tuple] = []
            if edge.needs_grad and not edge.local:
                for t in edge.transfers:
                    shape = region_shape(t.region)
                    if t.dst == rank:
                        assert want is not None
                        if t.src == rank:
                            grads.append(("add", rel_slices(t.region, want), shape,
                                          rel_slices(t.region, edge.src_regions[t.src_part])))
                        else:
                            grads.append(("send", rel_slices(t.region, want), shape, t.src))
                    elif t.src == rank:
                        grads.append(("recv", rel_slices(t.region, edge.src_regions[t.src_part]), shape, t.dst))
            self._grads.append(grads)

    def device_sets(self) -> set[tuple[int, ...]]:
        """The rank sets this redistribution exchanges data within (each needs a process group)."""
        return {x.ranks for x in (self.fwd_exchange, self.bwd_exchange) if x is not None}

    def bind(self, groups: Mapping[tuple[int, ...], dist.ProcessGroup | None]) -> None:
        if self.fwd_exchange is not None:
            self.fwd_group = groups.get(self.fwd_exchange.ranks)
        if self.bwd_exchange is not None:
            self.bwd_group = groups.get(self.bwd_exchange.ranks)

    def _takes_part(self, x: Exchange | None) -> bool:
        return x is not None and self.rank in x.ranks

    def _assembly(self, edge: EdgePlan, want: Region) -> tuple:
        if edge.local:
            return ("local", tuple(slice(lo, hi) for lo, hi in want))
        pieces = [(k, rel_slices(t.region, edge.src_regions[t.src_part]) if t.src == self.rank else None,
                   rel_slices(t.region, want))
                  for k, t in enumerate(edge.transfers) if t.dst_part == self.my_part]
        if len(pieces) == 1 and edge.transfers[pieces[0][0]].region == want:
            # The whole region from one place: no copy (a view of the producer part, or the buffer).
            return ("whole", pieces[0][0], pieces[0][1])
        return ("build", region_shape(want), pieces)

    def forward(self, outputs: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        received: dict[tuple[int, int], torch.Tensor] = {}
        if self._takes_part(self.fwd_exchange):
            sends = [(outputs[i][slices], peer) for i, slices, peer in self._sends]
            recvs = [(shape, self.dtypes[i], peer) for i, _, shape, peer in self._recvs]
            got = exchange(self.fwd_exchange, self.fwd_group, sends, recvs)
            received = {(i, k): t for (i, k, _, _), t in zip(self._recvs, got, strict=True)}
        result: list[torch.Tensor | None] = []
        for i, how in enumerate(self._inputs):
            if how is None:
                result.append(None)
            elif how[0] == "local":
                assert self.local_tensor is not None
                result.append(self.local_tensor(self.edges[i])[how[1]])
            elif how[0] == "whole":
                _, k, src = how
                result.append(received[(i, k)] if src is None else outputs[i][src])
            else:
                _, shape, pieces = how
                reduced = self.edges[i].reduced
                buf = (torch.zeros if reduced else torch.empty)(shape, dtype=self.dtypes[i])
                for k, src, dst in pieces:
                    piece = received[(i, k)] if src is None else outputs[i][src]
                    if reduced:
                        buf[dst].add_(piece)
                    else:
                        buf[dst].copy_(piece)
                result.append(buf)
        return result

    def backward(self, grads: Sequence[torch.Tensor | None],
                 accumulate: Callable[[EdgePlan, tuple[slice, ...], torch.Tensor], None]) -> None:
        """`grads[i]` is the gradient of edge i's input region on this rank (None: zeros, or no part)."""
        sends: list[tuple[torch.Tensor, int]] = []
        recvs: list[tuple[tuple[int, ...], torch.dtype, int]] = []
        targets: list[tuple[EdgePlan, tuple[slice, ...]]] = []
        for i, todo in enumerate(self._grads):
            if not todo:
                continue
            edge, grad, dtype = self.edges[i], grads[i], self.dtypes[i]
            for how in todo:
                if how[0] == "recv":
                    _, src, shape, peer = how
                    recvs.append((shape, dtype, peer))
                    targets.append((edge, src))
                    continue
                piece = grad[how[1]] if grad is not None else torch.zeros(how[2], dtype=dtype)
                if how[0] == "add":
                    accumulate(edge, how[3], piece)
                else:
                    sends.append((piece, how[3]))
        if self._takes_part(self.bwd_exchange):
            got = exchange(self.bwd_exchange, self.bwd_group, sends, recvs)
            for (edge, slices), buf in zip(targets, got, strict=True):
                accumulate(edge, slices, buf)


class GradSync:
    """Bucketed, asynchronous all-reduce (sum) of replicated parameter gradients within their device sets.

    `ready(op_name)` is called after the backward of every op, in the same order on every rank; the
    entries that become final there join their group's open bucket, which is launched (async) once it
    holds `bucket_bytes`, so the reduction overlaps the backward of the ops before it (as DDP's buckets
    do); a gradient of `bucket_bytes` or more is reduced alone, in place. `finish()` launches the rest,
    waits, and writes the sums back. Bucket contents are the same on every member of a group because
    every member walks the same plan. Only the members of a group take part in its all-reduce: a
    parameter replicated on devices (1, 2) of 4 never involves ranks 0 and 3.
    """

    def __init__(self, entries: Sequence[SyncEntry], *, rank: int,
                 groups: Mapping[tuple[int, ...], dist.ProcessGroup | None], bucket_bytes: int,
                 grad_of: Callable[[SyncEntry], torch.Tensor],
                 set_grad: Callable[[SyncEntry, torch.Tensor], None]):
        self.rank = rank
        self.groups = groups
        self.bucket_bytes = bucket_bytes
        self.grad_of = grad_of
        self.set_grad = set_grad
        self.by_op: dict[str, list[SyncEntry]] = {}
        for e in entries:
            if rank in e.group:
                self.by_op.setdefault(e.ready_after, []).append(e)
        self.open: dict[tuple[tuple[int, ...], torch.dtype], list[tuple[SyncEntry, torch.Tensor]]] = {}
        self.launched: list[tuple[dist.Work | None, torch.Tensor, list[tuple[SyncEntry, torch.Tensor]]]] = []

    def ready(self, op_name: str) -> None:
        for e in self.by_op.get(op_name, ()):
            grad = self.grad_of(e)
            key = (e.group, grad.dtype)
            if grad.numel() * grad.element_size() >= self.bucket_bytes:
                # A gradient that fills a bucket alone is reduced alone, in place: copying it into a
                # fresh flat buffer would cost more than the few extra all-reduce calls it saves. (The
                # choice depends on sizes only, so every member of the group makes the same buckets.)
                self._launch(e.group, [(e, grad)])
                continue
            bucket = self.open.setdefault(key, [])
            bucket.append((e, grad))
            if sum(g.numel() * g.element_size() for _, g in bucket) >= self.bucket_bytes:
                self._launch(e.group, self.open.pop(key))

    def _launch(self, group: tuple[int, ...], bucket: list[tuple[SyncEntry, torch.Tensor]]) -> None:
        if len(bucket) == 1 and bucket[0][1].is_contiguous():
            # A bucket of one gradient is reduced in place: no copy in, no copy out.
            flat = bucket[0][1].view(-1)
        else:
            flat = torch.cat([g.reshape(-1) for _, g in bucket])
        work = None
        if len(group) > 1:
            work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.groups[group], async_op=True)
        self.launched.append((work, flat, bucket))

    def finish(self) -> None:
        # Launch the remaining buckets in a fixed order (the order in which they were opened).
        for key in list(self.open):
            self._launch(key[0], self.open.pop(key))
        for work, flat, bucket in self.launched:
            if work is not None:
                work.wait()
            if len(bucket) == 1 and flat.data_ptr() == bucket[0][1].data_ptr():
                e, g = bucket[0]
                self.set_grad(e, g)
                continue
            offset = 0
            for e, g in bucket:
                n = g.numel()
                self.set_grad(e, flat[offset:offset + n].view_as(g))
                offset += n
        self.launched = []
