"""Data movement between ranks: the generic redistribution (forward and adjoint), process groups, and the
bucketed gradient all-reduce.

Owns `make_groups`, `exchange`, `Redistribution` and `GradSync`. Imports torch and `runtime.plan` only
(no simulator, no search, no soapflow).

Why the adjoint is explicit and not an `autograd.Function`: in backward, torch's autograd engine orders
ready nodes by local dependencies, which differ from rank to rank (each rank holds different parts), so
point-to-point sends issued from inside autograd could be reached in different orders on two ranks and
deadlock; and a rank that only *sent* a piece has no local use of it, so autograd would never run its
backward and the gradient sent back to it would never be received. The interpreter therefore runs the
adjoint itself, edge by edge in reverse graph order, the same order on every rank. The adjoint rule is
the one of DESIGN section 6: every piece's gradient goes back to the rank the piece came from and is
added there. This gives, without special cases, a reduce-scatter for the adjoint of a gather into a
partitioned consumer, a slice for a replicated consumer, and the broadcast of a partial-sum reduction.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterable, Mapping, Sequence

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


def exchange(sends: Sequence[tuple[torch.Tensor, int, int]], recvs: Sequence[tuple[torch.Tensor, int, int]],
             group: dist.ProcessGroup | None = None) -> None:
    """Point-to-point: send each (tensor, peer, tag), receive into each (buffer, peer, tag); wait for all.

    Both sides list the transfers of one exchange in the same order and with the same tags (they derive
    them from the same plan), so matching needs no negotiation.
    """
    if not sends and not recvs:
        return
    ops = [dist.P2POp(dist.isend, t, peer, group=group, tag=tag) for t, peer, tag in sends]
    ops += [dist.P2POp(dist.irecv, t, peer, group=group, tag=tag) for t, peer, tag in recvs]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


class Redistribution:
    """Moves the inputs of one consumer op (all its input edges) to its part on this rank, and back.

    `forward(outputs)` takes, per edge, this rank's part of the producer's output (None where this rank
    has none) and returns, per edge, the consumer part's input region (None where this rank has no
    part, or the part does not read the input). `backward(grads, accumulate)` takes the gradients of
    those inputs and sends every piece back to its producer part, calling `accumulate(edge, slices,
    piece)` where this rank holds that producer part.
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

    def _tag(self, slot: int, index: int) -> int:
        return slot * 1_000_003 + index

    def forward(self, outputs: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        rank = self.rank
        sends: list[tuple[torch.Tensor, int, int]] = []
        recvs: list[tuple[torch.Tensor, int, int]] = []
        received: dict[tuple[int, int], torch.Tensor] = {}
        for edge, out, dtype in zip(self.edges, outputs, self.dtypes, strict=True):
            for k, t in enumerate(edge.transfers):
                if t.src == rank and t.dst != rank:
                    frame = edge.src_regions[t.src_part]
                    sends.append((out[rel_slices(t.region, frame)].contiguous(), t.dst, self._tag(edge.slot, k)))
                elif t.dst == rank and t.src != rank:
                    buf = torch.empty(region_shape(t.region), dtype=dtype)
                    received[(edge.slot, k)] = buf
                    recvs.append((buf, t.src, self._tag(edge.slot, k)))
        exchange(sends, recvs)
        if self.my_part is None:
            return [None] * len(self.edges)
        result: list[torch.Tensor | None] = []
        for edge, out, dtype in zip(self.edges, outputs, self.dtypes, strict=True):
            want = edge.regions[self.my_part]
            if want is None:
                result.append(None)
                continue
            if edge.local:
                assert self.local_tensor is not None
                full = self.local_tensor(edge)
                result.append(full[tuple(slice(lo, hi) for lo, hi in want)])
                continue
            mine = [(k, t) for k, t in enumerate(edge.transfers) if t.dst_part == self.my_part]
            pieces = []
            for k, t in mine:
                if t.src == rank:
                    pieces.append((t.region, out[rel_slices(t.region, edge.src_regions[t.src_part])]))
                else:
                    pieces.append((t.region, received[(edge.slot, k)]))
            if len(pieces) == 1 and pieces[0][0] == want:
                # The whole region from one place: no copy (a view of the producer part, or the buffer).
                result.append(pieces[0][1])
                continue
            buf = (torch.zeros if edge.reduced else torch.empty)(region_shape(want), dtype=dtype)
            for region, piece in pieces:
                view = buf[rel_slices(region, want)]
                if edge.reduced:
                    view.add_(piece)
                else:
                    view.copy_(piece)
            result.append(buf)
        return result

    def backward(self, grads: Sequence[torch.Tensor | None],
                 accumulate: Callable[[EdgePlan, tuple[slice, ...], torch.Tensor], None]) -> None:
        """`grads[i]` is the gradient of edge i's input region on this rank (None: zeros, or no part)."""
        rank = self.rank
        sends: list[tuple[torch.Tensor, int, int]] = []
        recvs: list[tuple[EdgePlan, tuple[slice, ...], torch.Tensor, int, int]] = []
        for edge, grad, dtype in zip(self.edges, grads, self.dtypes, strict=True):
            if not edge.needs_grad or edge.local:
                continue
            want = edge.regions[self.my_part] if self.my_part is not None else None
            for k, t in enumerate(edge.transfers):
                tag = self._tag(edge.slot, k)
                if t.dst == rank:
                    assert want is not None
                    piece = (grad[rel_slices(t.region, want)] if grad is not None
                             else torch.zeros(region_shape(t.region), dtype=dtype))
                    if t.src == rank:
                        accumulate(edge, rel_slices(t.region, edge.src_regions[t.src_part]), piece)
                    else:
                        sends.append((piece.contiguous(), t.src, tag))
                elif t.src == rank:
                    buf = torch.empty(region_shape(t.region), dtype=dtype)
                    recvs.append((edge, rel_slices(t.region, edge.src_regions[t.src_part]), buf, t.dst, tag))
        exchange(sends, [(buf, peer, tag) for _, _, buf, peer, tag in recvs])
        for edge, slices, buf, _, _ in recvs:
            accumulate(edge, slices, buf)


class GradSync:
    """Bucketed, asynchronous all-reduce (sum) of replicated parameter gradients within their device sets.

    `ready(op_name)` is called after the backward of every op, in the same order on every rank; the
    entries that become final there join their group's open bucket, which is launched (async) once it
    holds `bucket_bytes`. `finish()` launches the rest, waits, and writes the sums back. Bucket contents
    are the same on every member of a group because every member walks the same plan.
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
            bucket = self.open.setdefault(key, [])
            bucket.append((e, grad))
            if sum(g.numel() * g.element_size() for _, g in bucket) >= self.bucket_bytes:
                self._launch(key)

    def _launch(self, key: tuple[tuple[int, ...], torch.dtype]) -> None:
        bucket = self.open.pop(key)
        flat = torch.cat([g.reshape(-1) for _, g in bucket])
        work = None
        if len(key[0]) > 1:
            work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.groups[key[0]], async_op=True)
        self.launched.append((work, flat, bucket))

    def finish(self) -> None:
        # Launch the remaining buckets in a fixed order (the order in which they were opened).
        for key in list(self.open):
            self._launch(key)
        for work, flat, bucket in self.launched:
            if work is not None:
                work.wait()
            offset = 0
            for e, g in bucket:
                n = g.numel()
                self.set_grad(e, flat[offset:offset + n].view_as(g))
                offset += n
        self.launched = []
