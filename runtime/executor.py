"""The SPMD interpreter: every rank walks the same OperatorGraph under the same Strategy and runs its parts.

Owns `Executor` (forward, explicit backward, gradient synchronization, the local parameter shards) and
`ExecutionError` (which names the rank, the phase and the op that failed). Imports `soap`, torch and the
other `runtime` modules only (no simulator, no search, no soapflow).

How a step runs on one rank, with the step plan (`soap.lowering.StepPlan`) saying who holds what and
what moves where. A rank may hold several parts of one op (its rounds, `OpStep.rounds`: micro-batches);
each has its own input, outputs, autograd graph and output gradients, and they share the rank's
parameter shards, so autograd adds their parameter gradients up.

A step (`run_step`) walks the plan's order (`StepPlan.order`: items (phase, op, round); every forward
before any backward under GPipe and without repeated devices, interleaved under 1F1B):
- a forward item: take part in each input edge's exchange of that round and assemble the input of this
  rank's part of the round, edge by edge (`EdgeMover`: local slices of the producer parts here, one
  exchange per edge and consumer round, partial sums added), then compute the part with
  `runtime.kernels.compute_part` on detached leaf copies of the inputs and on this rank's parameter
  shards. A rank without a part in the round still sends what its producer parts owe the exchange (they
  are computed: the order is topological). Sources move nothing (`OpDef.everywhere`): an op reads its
  region of an `input` from the global synthetic batch every rank holds, and of a `constant` from this
  rank's own buffer (or the value its recipe computes from the buffers, once, at setup).
  A chunk along a carried dim (an LSTM split in time, `soap.lowering`'s rule "Carries") starts from
  the final state of the chunk before it, which ran earlier (in an earlier round): a leaf copy of it. When
  that chunk ran on another rank, the two ranks exchange the state at this item, after the input edges'
  exchanges (`OpStep.carry_moves`: one exchange per carry; the sender goes on, `Outbox`), and the chunk
  starts from a leaf copy of what arrived (kept for a recomputation).
- a backward item: backpropagate this rank's part of the round from the gradients its consumers sent
  back (leaf gradients give the input gradients), send every input piece's gradient back through the
  same round's exchange to the part it came from (added there; a producer part on this rank gets it
  added locally), hand the gradient of a chunk's initial state to the chunk before it (added to the
  gradient of its final state when its own backward runs, later in the order; on another rank, sent
  there through one exchange after the input edges' gradients), and once it is the op's
  last backward item (`StepPlan.done_at`) tell `GradSync`: it launches the plan's all-reduces whose
  gradients just became final, within exactly their device set, asynchronous.

Every rank walks the same order and, at each item, the same edges in slot order, so the collectives of
the step are issued in one order on every rank.

`collectives` counts what this rank issued in the last step (`CollectiveLog`), in the shape of
`StepPlan.collectives`, so a run can show that it did what the plan says.

The loss is the last op: its parts hold partial sums of the global mean (or the whole loss), each
backpropagated with gradient 1; a rank's share is the sum of its loss parts, the step's loss the sum over
ranks.
"""

from __future__ import annotations

import bisect
import contextlib
import math
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist

from runtime import kernels
from runtime.collectives import CollectiveLog, EdgeMover, GradSync, Outbox, exchange, make_groups
from runtime.materialize import PieceKey, take_piece
from soap.config import param_pieces
from soap.graph import Operator, OperatorGraph, TensorRef
from soap.lowering import (
    ALL_GATHER,
    FORWARD,
    REDUCE_SCATTER,
    StepPlan,
    SyncEntry,
    chunk_numel,
    full_precision,
)
from soap.opdef import Region
from soap.registry import counts_targets, op_def

TORCH_DTYPES = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32, "int16": torch.int16,
    "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}


class ExecutionError(RuntimeError):
    """An exception raised while a rank executed one op; the message names the rank, phase and op."""


def as_slices(region: Region) -> tuple[slice, ...]:
    return tuple(slice(lo, hi) for lo, hi in region)


def pieces_needed(plan: StepPlan, rank: int) -> list[PieceKey]:
    """The parameter pieces (fqn, region, chunk) the parts of `rank` hold under `plan`, each once: what an
    `Executor` reads from its `tensors` (a sharded part's chunk of each region, else the region), buffers
    aside."""
    out = []
    for step, op in zip(plan.ops, plan.flow.graph, strict=True):
        for p in step.parts_on(rank):
            groups = step.shard_groups
            group = groups[p] if groups is not None else (rank,)
            chunk = (group.index(rank), len(group)) if len(group) > 1 else None
            for fqn, region in param_pieces(op, step.boxes[p]).values():
                out.append((fqn, region, chunk))
    return list(dict.fromkeys(out))


def recurrent_kinds(graph: OperatorGraph) -> list[str]:
    """The kinds of `graph`'s recurrent ops (a dim carried from step to step), sorted: their CPU kernels
    have no float16 form, so an fp16 step with one of them cannot run on CPU processes."""
    return sorted({op.kind for op in graph if any(d.carried for d in op_def(op.kind).dims(op))})


class Executor:
    """Runs `graph` under the step plan `plan` on rank `rank` (torch.distributed already initialized when
    the plan spans more than one device).

    `tensors` maps every parameter and buffer fqn of the model to its full value, or is the
    `runtime.materialize.Pieces` of `pieces_needed` (the rank built the model on the meta device and
    materialized only those); the executor copies the pieces its parts hold. `float_dtype` is the dtype
    of the parameters (the master weights, float64 for tight verification) and, under fp32, of the
    computation; under mixed precision the executor runs the plan's `run_graph`: each op computes in the
    setup's compute dtype on a cast copy of its parameters (autograd carries the gradient back to the
    master shard in its own dtype), the float batch and constants are cast to it, and the loss op
    computes in `float_dtype`. `module` is the model, for opaque ops.
    """

    def __init__(self, graph: OperatorGraph, plan: StepPlan, *, rank: int, tensors: Mapping[str, torch.Tensor],
                 module: torch.nn.Module | None = None, float_dtype: torch.dtype = torch.float32,
                 timeout_s: float = 60.0, device: torch.device | str = "cpu"):
        assert plan.flow.source is graph, "the plan is not the graph's"
        self.graph = graph = plan.flow.graph  # the graph as run: activations in the compute dtype
        self.full_precision = full_precision(graph)  # (ops that compute in float32 under mixed precision)
        self.plan = plan
        self.flow = plan.flow
        self.rank = rank
        self.module = module
        self.float_dtype = float_dtype
        self.device = torch.device(device)
        mixed = plan.flow.setup.compute_dtype != "float32"
        self.compute_dtype = TORCH_DTYPES[plan.flow.setup.compute_dtype] if mixed else float_dtype
        recurrent = recurrent_kinds(graph)
        if self.compute_dtype == torch.float16 and recurrent and self.device.type == "cpu":
            raise ValueError(f"precision fp16 cannot run a recurrent op ({', '.join(recurrent)}) on a CPU (its "
                             "kernel has no float16 form); use bf16")
        self.where = "setup"
        self.step = 0
        self.counted: dict[str, int | float] = {}  # per cross-entropy mean, its step's count (`run_step`)
        self.num_forwards = 0
        self.distributed = plan.num_devices > 1
        self.log = CollectiveLog()
        self.shards: dict[tuple[str, Region], torch.Tensor] = {}
        self.buffers: dict[tuple[str, Region], torch.Tensor] = {}
        # per (op position, part) here, its parameters by local name (the parts of one op on this rank
        # share the shard tensors of the regions they have in common); per op name, its buffers
        self.op_params: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self.op_buffers: dict[str, dict[str, torch.Tensor]] = {}
        self.param_shapes = {p.fqn: p.full_shape for op in graph for p in op.params.values()}
        # Outputs every rank holds whole (`OpDef.everywhere`): the buffers, and each step's global batch.
        self.sources: dict[str, torch.Tensor] = {}
        # Per op position, the parts on this rank (in round order) and, by round, the part of that round.
        self.parts = [step.parts_on(rank) for step in plan.ops]
        self.round_part = [{step.rounds[c]: c for c in mine} for step, mine in zip(plan.ops, self.parts, strict=True)]
        # sharded parts: per op position, (shard group, [(local name, key, numel, chunk numel, shape)]);
        # per key of a chunk, (its index in the group, the group's size)
        self.gathers: dict[int, tuple[tuple[int, ...], list[tuple[str, tuple, int, int, tuple[int, ...]]]]] = {}
        self.chunks: dict[tuple[str, Region], tuple[int, int]] = {}
        for i, op in enumerate(graph):
            entry = op_def(op.kind)
            if op.kind == "constant":
                value = kernels.constant_value(op, tensors, cast=self._cast)
                self.sources[op.name] = self._as_output(value, op).detach().to(self.device)
            mine = self.parts[i]
            if not mine:
                continue
            step = plan.ops[i]
            groups = step.shard_groups
            sharded = groups is not None and len(groups[mine[0]]) > 1
            if sharded:
                assert len(mine) == 1, f"{op.name}: a sharded op runs one part per device"
                self._chunk_params(i, op, groups[mine[0]], tensors)
            buffers = {}
            for c in mine:
                box = step.boxes[c]
                params = {}
                for name, key in ({} if sharded else param_pieces(op, box)).items():
                    fqn = key[0]
                    if key not in self.shards:
                        value = take_piece(tensors, fqn, key[1])
                        self.shards[key] = self._cast(value).detach().to(self.device, copy=True).requires_grad_(
                            op.params[name].trainable)
                    params[name] = self.shards[key]
                if not sharded:
                    self.op_params[(i, c)] = params
                for name, region in entry.buffer_regions(op, box).items():
                    assert len(mine) == 1, f"{op.name}: an op with running statistics runs one part per device"
                    fqn = op.attrs[name]
                    key = (fqn, tuple(tuple(r) for r in region))
                    if key not in self.buffers:
                        self.buffers[key] = self._cast(take_piece(tensors, fqn, key[1])).detach().to(
                            self.device, copy=True)
                    buffers[name] = self.buffers[key]
            self.op_buffers[op.name] = buffers
        flow = self.flow
        # per (edge id, consumer round), the mover of that round's pieces
        self.movers: dict[tuple[int, int], EdgeMover] = {}
        self.outbox = Outbox()  # the exchanges this rank only sends in, in flight until the step ends
        for step in plan.edges:
            e = flow.edges[step.edge]
            dtype = self.torch_dtype(graph.tensor(e.ref).dtype)
            for r in range(plan.ops[e.dst].num_rounds):
                self.movers[(e.id, r)] = EdgeMover(step, e, plan.ops[e.src], plan.ops[e.dst], rank=rank, dtype=dtype,
                                                   log=self.log, round=r, outbox=self.outbox, device=self.device)
        self.out_refs = {op.name: tuple(TensorRef(op=op.name, index=i) for i in range(len(op.outputs)))
                         for op in graph}
        # the shape of each part here of every output a gradient flows back to, by (output, part)
        self.grad_shapes: dict[tuple[TensorRef, int], tuple[int, ...]] = {}
        for e in flow.edges:
            for p in self.parts[e.src]:
                self.grad_shapes[(e.ref, p)] = tuple(int(hi - lo) for lo, hi in plan.ops[e.src].out_regions[e.out][p])
        self.wheres = {op.name: (f"forward of op {op.name!r} ({op.kind})", f"backward of op {op.name!r} ({op.kind})")
                       for op in graph}
        # Every process group, for the exchanges and the all-reduces, created up front in the same (sorted)
        # order on every rank.
        groups = self.groups = make_groups(plan.process_groups(), timeout_s=timeout_s) if self.distributed else {}
        # per (op position, round), the carries between ranks this rank takes part in (`OpStep.carry_moves`):
        # (chunk, the part it starts from, the source's rank, the chunk's rank, the state's shapes)
        self.carry_moves: dict[tuple[int, int], list[tuple[int, int, int, int, tuple[tuple[int, ...], ...]]]] = {}
        for i, step in enumerate(plan.ops):
            for c, p, _ in step.carry_moves:
                src, dst = step.devices[p], step.devices[c]
                if rank in (src, dst):
                    shapes = op_def(graph.ops[i].kind).carry_shapes(graph.ops[i], step.boxes[c])
                    self.carry_moves.setdefault((i, step.rounds[c]), []).append((c, p, src, dst, shapes))
        for mover in self.movers.values():
            mover.bind(groups)
        self.sync = GradSync(plan.all_reduces, rank=rank, groups=groups, grad_of=self._grad_of,
                             set_grad=self._set_grad, log=self.log)
        # recomputation (`soap.lowering`'s rule, per part): per position in the order, the parts here
        # recomputed just before that backward item (in forward order), at the same place on every rank;
        # what recomputing parts received in forward is kept per (edge, round)
        self.recompute = [step.recompute for step in plan.ops]
        order = plan.order
        at = {item: k for k, item in enumerate(order)}
        self.recompute_before: dict[int, list[tuple[int, int]]] = {}
        for k, parts in plan.recompute_before().items():
            mine = [(j, c) for j, c in parts if plan.ops[j].devices[c] == rank]
            if mine:
                self.recompute_before[k] = mine
        # a recomputing part's outputs are dropped after the forward of the last consumer round reading them
        ends: dict[tuple[int, int], int] = {}
        for step in plan.edges:
            e = flow.edges[step.edge]
            if self.recompute[e.src] and e.src != len(graph.ops) - 1:
                for p, c, _, _ in step.pieces:
                    if plan.ops[e.src].devices[p] == rank:
                        k = at[(FORWARD, e.dst, plan.ops[e.dst].rounds[c])]
                        ends[(e.src, p)] = max(ends.get((e.src, p), -1), k)
        self.drop_after: dict[int, list[tuple[int, int]]] = {}
        for part, k in ends.items():
            self.drop_after.setdefault(k, []).append(part)
        # An op that runs no backward lets its outputs go once every item of the ops after it is done (the
        # graph order's point in backward without repeated devices): before order position k.
        self.release_before: dict[int, list[int]] = {}
        lowest = [0] * len(order)  # minus the highest op position at order position k or later: ascending
        for k in range(len(order) - 1, -1, -1):
            lowest[k] = min(lowest[k + 1] if k + 1 < len(order) else 0, -order[k][1])
        for j in range(len(graph.ops)):
            if not flow.needs_bwd[j] and not flow.everywhere[j]:
                self.release_before.setdefault(bisect.bisect_left(lowest, -j), []).append(j)
        self.kept: dict[tuple[int, int], dict[int, torch.Tensor]] = {}
        # per (op position, part) here: (input leaves, outputs) kept for backward, and detached outputs
        self.saved: dict[tuple[int, int], tuple[list[torch.Tensor | None], tuple[torch.Tensor, ...]]] = {}
        self.values: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        # per (output, producer part here): the gradient consumers sent back so far
        self.grads: dict[tuple[TensorRef, int], torch.Tensor] = {}
        # per (op position, part) here of a chunk along a carried dim: (its initial state as leaves, or
        # None, and its final state), and the gradient of its final state from the chunk after it
        self.carry: dict[tuple[int, int], tuple[tuple[torch.Tensor, ...] | None, tuple[torch.Tensor, ...]]] = {}
        self.carry_grads: dict[tuple[int, int], tuple[torch.Tensor | None, ...]] = {}
        # per chunk here whose state came from another rank: that state as received, and the gradient of
        # its initial state to send back
        self.carry_in: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        self.carry_back: dict[tuple[int, int], tuple[torch.Tensor | None, ...]] = {}
        self.collectives: dict[str, dict[str, int]] = {}

    # ------------------------------------------------------------------ setup helpers

    def _cast(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.float_dtype) if t.is_floating_point() else t

    def _as_output(self, t: torch.Tensor, op: Operator) -> torch.Tensor:
        """Source value `t` in the dtype of `op`'s output as run (the compute dtype for float data)."""
        return t.to(self.torch_dtype(op.outputs[0].dtype)) if t.is_floating_point() else t

    def torch_dtype(self, name: str) -> torch.dtype:
        dtype = TORCH_DTYPES[name]
        return self.float_dtype if dtype == torch.float32 else dtype

    def _chunk_params(self, i: int, op: Operator, group: tuple[int, ...], tensors: Mapping[str, torch.Tensor]) -> None:
        """Keep this rank's chunk of each parameter region of op position `i`'s part (sharded over
        `group`): the region flattened, padded to a multiple of the group's size, cut in equal chunks."""
        size, j = len(group), group.index(self.rank)
        layout = []
        c = self.parts[i][0]
        for name, key in param_pieces(op, self.plan.ops[i].boxes[c]).items():
            fqn = key[0]
            shape = tuple(hi - lo for lo, hi in key[1])
            numel = math.prod(shape)
            value = self._cast(take_piece(tensors, fqn, key[1], (j, size))).detach()
            self.shards[key] = value.to(self.device, copy=True).requires_grad_(True)
            self.chunks[key] = (j, size)
            layout.append((name, key, numel, chunk_numel(numel, size), shape))
        self.gathers[i] = (group, layout)
        self.op_params[(i, c)] = {}

    def _gather(self, i: int, op: Operator) -> None:
        """All-gather op position `i`'s sharded parameters into fresh leaf tensors its part computes with
        (in the compute dtype; an op with running statistics keeps the master dtype)."""
        group, layout = self.gathers[i]
        dtype = self.float_dtype if self.op_buffers[op.name] else self.compute_dtype
        flat = torch.cat([self.shards[key].detach().to(dtype) for _, key, _, _, _ in layout])
        out = torch.empty(len(group) * flat.numel(), dtype=dtype, device=self.device)
        dist.all_gather_single(out, flat, group=self.groups[group])
        self.log.record(ALL_GATHER, out.numel() * out.element_size())
        rows = out.view(len(group), flat.numel())
        params, offset = {}, 0
        for name, _, numel, chunk, shape in layout:
            # a copy, or a view of `out` when the layout has one parameter; detached, so that it is not a
            # view (a view holds its base, and `_release` could not free the gathered data)
            value = rows[:, offset:offset + chunk].reshape(-1)[:numel].reshape(shape).detach()
            params[name] = value.requires_grad_(True)
            offset += chunk
        self.op_params[(i, self.parts[i][0])] = params

    def _gather_into(self, i: int, op: Operator) -> None:
        """Gather op position `i`'s sharded parameters again into the tensors its autograd graph holds."""
        key = (i, self.parts[i][0])
        held = self.op_params[key]
        self._gather(i, op)
        for name, w in self.op_params[key].items():
            held[name].data = w.detach()
        self.op_params[key] = held

    def _param_hooks(self, i: int) -> tuple[Any, Any]:
        """Saved-tensor hooks that store a tensor on a gathered parameter's storage as (parameter, view)."""
        by_storage = {w.untyped_storage().data_ptr(): w for w in self.op_params[(i, self.parts[i][0])].values()}

        def pack(t: torch.Tensor) -> Any:
            w = by_storage.get(t.untyped_storage().data_ptr()) if t.device.type != "meta" else None
            if w is None:
                return t
            return w, tuple(t.size()), tuple(t.stride()), t.storage_offset() - w.storage_offset()

        def unpack(saved: Any) -> torch.Tensor:
            if isinstance(saved, torch.Tensor):
                return saved
            w, size, stride, offset = saved
            return w.as_strided(size, stride, w.storage_offset() + offset)

        return pack, unpack

    def _release(self, i: int) -> None:
        """Free a sharded part's gathered parameters (autograd keeps the tensors, not their data)."""
        for w in self.op_params[(i, self.parts[i][0])].values():
            w.data = torch.empty(0, dtype=w.dtype, device=self.device)
            w.grad = None

    def _scatter_grads(self, i: int, grads: dict[str, torch.Tensor | None]) -> None:
        """Reduce-scatter `grads`, the gradients of op position `i`'s gathered parameters by local name,
        into this rank's chunks. `grads` is emptied as each gradient is copied into the reduce-scatter's
        input, so that (the caller keeping no other reference) one copy of the op's gradients lives."""
        group, layout = self.gathers[i]
        size = len(group)
        total = sum(chunk for _, _, _, chunk, _ in layout)
        single = grads.get(layout[0][0]) if len(layout) == 1 and layout[0][2] == size * total else None
        if single is not None and single.dtype == self.float_dtype and single.is_contiguous():
            buf = single.view(size, total)  # one parameter and no padding: its gradient is the input
        else:
            buf = torch.empty(size, total, dtype=self.float_dtype, device=self.device)
            offset = 0
            for name, _, numel, chunk, _ in layout:
                dst = buf[:, offset:offset + chunk]
                offset += chunk
                grad = grads.pop(name, None)
                if grad is None:
                    dst.zero_()
                    continue
                # the gradient flattened into rows of `chunk`, the padding of the last row zero
                flat, full = grad.reshape(-1), numel // chunk
                dst[:full].copy_(flat[:full * chunk].view(full, chunk))
                if full < size:
                    rest = numel - full * chunk
                    dst[full, :rest].copy_(flat[full * chunk:])
                    dst[full, rest:].zero_()
                    dst[full + 1:].zero_()
        del single
        grads.clear()
        out = torch.empty(total, dtype=self.float_dtype, device=self.device)
        dist.reduce_scatter_single(out, buf.view(-1), group=self.groups[group])
        self.log.record(REDUCE_SCATTER, buf.numel() * buf.element_size())
        del buf
        offset = 0
        for _, key, _, chunk, _ in layout:
            shard = self.shards[key]
            piece = out[offset:offset + chunk]  # `out` is fresh per call and its pieces are disjoint
            shard.grad = piece if shard.grad is None else shard.grad + piece
            offset += chunk

    def parameters(self) -> list[torch.Tensor]:
        """This rank's shards of trainable parameters (leaf tensors), in a fixed order: what the optimizer
        updates (a frozen parameter's shards do not require grad)."""
        return [self.shards[k] for k in sorted(self.shards) if self.shards[k].requires_grad]

    def shard_items(self) -> list[tuple[str, Region, torch.Tensor, tuple[int, int] | None]]:
        """(fqn, region, tensor, chunk) per shard: `chunk` is None where the tensor is the region, else
        (index, count): the tensor is that chunk of the region flattened and padded (a sharded op's)."""
        return [(fqn, region, self.shards[(fqn, region)], self.chunks.get((fqn, region)))
                for fqn, region in sorted(self.shards)]

    # ------------------------------------------------------------------ forward

    def _outputs(self, eid: int, parts: Sequence[int]) -> dict[int, torch.Tensor]:
        """The output edge `eid` reads of each of the producer `parts` here, by part."""
        e = self.flow.edges[eid]
        out = {}
        for p in parts:
            values = self.values.get((e.src, p))
            assert values is not None, f"{self.flow.ops[e.src].name} part {p} is neither kept nor recomputed"
            out[p] = values[e.out]
        return out

    def _inputs(self, i: int, r: int, op: Operator) -> list[torch.Tensor | None]:
        """The input regions of op position `i`'s part of round `r` here (None where it has none or does
        not read one), every edge's exchange of the round taken part in whether or not this rank has a
        part."""
        part = self.round_part[i].get(r)
        out: list[torch.Tensor | None] = []
        for slot, eid in enumerate(self.flow.slot_edges[i]):
            if eid is None:
                out.append(self._source_input(i, part, op, slot))
                continue
            mover = self.movers[(eid, r)]
            outputs = self._outputs(eid, mover.forward_parts)
            received = mover.receive(outputs)
            if self.recompute[i] and part is not None:
                self.kept[(eid, r)] = received  # what a recomputation reads again (nothing moves twice)
            out.append(mover.assemble(outputs, received))
        return out

    def _source_input(self, i: int, part: int | None, op: Operator, slot: int) -> torch.Tensor | None:
        """Input `slot` of op position `i`'s `part` here, read from a source: every rank holds it whole and
        slices what its part reads (None: no part, or it does not read the input)."""
        want = self.plan.ops[i].reads[slot][part] if part is not None else None
        return None if want is None else self.sources[op.inputs[slot].op][as_slices(want)]

    def _recompute(self, i: int, c: int) -> None:
        """Run op position `i`'s part `c` here forward again, from the outputs kept here, the pieces its
        round received in forward and the recomputed outputs of recomputing producers (recomputed before
        it)."""
        op = self.graph.ops[i]
        r = self.plan.ops[i].rounds[c]
        inputs: list[torch.Tensor | None] = []
        for slot, eid in enumerate(self.flow.slot_edges[i]):
            if eid is None:
                inputs.append(self._source_input(i, c, op, slot))
                continue
            mover = self.movers[(eid, r)]
            inputs.append(mover.assemble(self._outputs(eid, mover.local_parts), self.kept.get((eid, r), {})))
        self._run_part(i, c, op, inputs, keep=True)

    def _run_part(self, i: int, c: int, op: Operator, inputs: list[torch.Tensor | None], *, keep: bool) -> None:
        """Compute op position `i`'s part `c` on `inputs`; with `keep`, keep its autograd graph for backward."""
        if i in self.gathers:
            self._gather(i, op)
        leaves = [x.detach().requires_grad_(True) if x is not None and grad and keep else x
                  for grad, x in zip(self.flow.grad_inputs[i], inputs, strict=True)]
        if not keep:
            context: AbstractContextManager = torch.no_grad()
        elif i in self.gathers:
            # What autograd saves of the gathered parameters (views of them, as a linear saves its weight
            # transposed) would keep their data alive after `_release`: save a recipe instead, which
            # reads the parameter again once backward has gathered it back (`_gather_into`).
            context = torch.autograd.graph.saved_tensors_hooks(*self._param_hooks(i))
        else:
            context = contextlib.nullcontext()
        # a chunk along a carried dim starts from the final state of the chunk before it, on this rank
        # (`soap.lowering`'s rule "Carries"): a leaf copy, whose gradient backward hands back to that chunk
        prev = self.plan.ops[i].carry_from[c]
        state = None
        if prev is not None:
            given = self.carry_in.get((i, c))  # received from another rank (`_move_state`)
            source = given if given is not None else self.carry[(i, prev)][1]
            state = tuple(x.detach().requires_grad_(keep) for x in source)
        with context:
            outs, final = self._compute(op, self.op_params[(i, c)], self.plan.ops[i].boxes[c], leaves, state)
        if final:
            self.carry[(i, c)] = (state, final)
        if keep:
            self.saved[(i, c)] = (leaves, outs)
        self.values[(i, c)] = tuple(o.detach() for o in outs)
        if i in self.gathers:
            self._release(i)

    def _compute(self, op: Operator, params: Mapping[str, torch.Tensor], box, inputs: list[torch.Tensor | None],
                 state: tuple[torch.Tensor, ...] | None = None
                 ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """The part's outputs and its final state along a carried dim (empty for kinds without one),
        starting from `state` (`runtime.kernels.compute_chunk`)."""
        if self.compute_dtype != self.float_dtype:
            if op.name in self.full_precision:  # the loss and a router compute in the master dtype
                inputs = [x.to(self.float_dtype) if x is not None and x.is_floating_point() else x for x in inputs]
            elif not self.op_buffers[op.name]:
                # an op with running statistics (batch norm) keeps its float32 weights, as torch.autocast
                # does: the kernel takes compute-dtype input with float32 weight and statistics
                params = {k: v.to(self.compute_dtype) for k, v in params.items()}
        if op.kind != "opaque":
            return kernels.compute_chunk(op, box, inputs, params, state=state, training=True,
                                         buffers=self.op_buffers[op.name], step=self.step,
                                         check=self.num_forwards == 0, counted=self.counted.get(op.name),
                                         dtype=self.compute_dtype)
        target = None
        if op.attrs.get("target", "module") == "module":
            assert self.module is not None, "opaque ops need the model"
            sub = self.module.get_submodule(op.module)
            # Call the module with this rank's parameter tensors in place of its own, so that
            # gradients reach the shards the optimizer updates.
            def target(*args, **kwargs):
                return torch.func.functional_call(sub, dict(params), args, kwargs, strict=False)
        return kernels.run_opaque(op, target, inputs, params), ()

    def run_step(self, batch: Sequence[torch.Tensor], *, step: int = 0, fail: bool = False,
                 loss_scale: float = 1.0) -> torch.Tensor:
        """Run one step's forward and backward on the full synthetic batch `batch` (one tensor per `input`
        position), item by item in the plan's order (`StepPlan.order`: every forward before any backward
        under GPipe, interleaved under 1F1B), backpropagating the loss parts times `loss_scale` and
        synchronizing replicated parameter gradients (waits for the all-reduces before returning); returns
        this rank's share of the loss (a 0-dim tensor: the sum of its loss parts, zero when it holds none).

        `fail` (a test hook) raises in the first op this rank computes, as a failing kernel would."""
        self.step = step
        self.saved.clear()
        self.values.clear()
        self.grads.clear()
        self.log.reset()
        self.carry.clear()
        self.carry_grads.clear()
        self.carry_in.clear()
        self.carry_back.clear()
        for op in self.graph:
            if op.kind == "input":
                # Every rank holds the whole global batch and reads from it what its parts need.
                self.sources[op.name] = self._as_output(batch[int(op.attrs["position"])].to(self.device), op)
        # a cross-entropy mean divides by the targets not ignored over the whole batch, which each part is handed
        self.counted = {op.name: kernels.counted_targets(self.graph, op, self.sources, step=step)
                        for op in self.graph if counts_targets(op)}
        last = len(self.graph.ops) - 1
        losses: list[torch.Tensor] = []
        order = self.plan.order
        for k, (phase, i, r) in enumerate(order):
            for j in self.release_before.get(k, ()):
                self._release_outputs(j)
            if phase == FORWARD:
                self._forward_item(k, i, r, fail)
                c = self.round_part[i].get(r)
                if i == last and c is not None:
                    losses.append(self.values[(last, c)][0].reshape(()))
            else:
                self._backward_item(k, i, r, loss_scale)
        for j in self.release_before.get(len(order), ()):
            self._release_outputs(j)
        self.num_forwards += 1
        self.where = "the step's sends"
        self.outbox.drain()
        self.where = "gradient synchronization"
        self.sync.finish()
        self.collectives = self.log.snapshot()
        self.values.clear()
        self.saved.clear()
        self.grads.clear()
        self.kept.clear()
        self.carry.clear()
        self.carry_grads.clear()
        self.carry_in.clear()
        self.carry_back.clear()
        self.where = "step"
        if not losses:
            return torch.zeros((), dtype=self.float_dtype, device=self.device)
        total = losses[0]
        for part in losses[1:]:
            total = total + part
        return total

    def _forward_item(self, k: int, i: int, r: int, fail: bool) -> None:
        """The forward of round `r` of op position `i` (order position `k`): its exchanges, then this rank's
        part of the round if it has one."""
        op = self.graph.ops[i]
        self.where = self._where(i, r, 0)
        inputs = self._inputs(i, r, op)
        for move in self.carry_moves.get((i, r), ()):
            self._move_state(i, *move)
        c = self.round_part[i].get(r)
        if c is not None:
            if fail:
                raise RuntimeError("injected fault (test hook)")
            self._run_part(i, c, op, inputs, keep=not self.recompute[i])
        for j, p in self.drop_after.get(k, ()):
            self.values.pop((j, p), None)

    def _move_state(self, i: int, c: int, p: int, src: int, dst: int, shapes: tuple[tuple[int, ...], ...]) -> None:
        """Forward of a carry between ranks (`OpStep.carry_moves`): the rank of part `p` sends the final state
        of `p`, the rank of chunk `c` receives it as the state `c` starts from."""
        ranks = (min(src, dst), max(src, dst))
        dtype = self.torch_dtype(self.graph.ops[i].outputs[0].dtype)
        if self.rank == src:
            sends = [(x.detach(), dst) for x in self.carry[(i, p)][1]]
            exchange(ranks, self.groups[ranks], sends, [], dtype, self.log, self.outbox, self.device)
        else:
            got = exchange(ranks, self.groups[ranks], [], [(shape, src) for shape in shapes], dtype, self.log,
                           self.outbox, self.device)
            self.carry_in[(i, c)] = tuple(got)

    def _move_state_grad(self, i: int, c: int, p: int, src: int, dst: int, shapes: tuple[tuple[int, ...], ...]
                         ) -> None:
        """Backward of a carry between ranks: the rank of chunk `c` sends the gradient of its initial state,
        the rank of part `p` receives it as the gradient of `p`'s final state (added in `p`'s backward)."""
        ranks = (min(src, dst), max(src, dst))
        dtype = self.torch_dtype(self.graph.ops[i].outputs[0].dtype)
        if self.rank == dst:
            self.carry_in.pop((i, c), None)
            grads = self.carry_back.pop((i, c), (None,) * len(shapes))
            sends = [(g if g is not None else torch.zeros(shape, dtype=dtype, device=self.device), src)
                     for g, shape in zip(grads, shapes, strict=True)]
            exchange(ranks, self.groups[ranks], sends, [], dtype, self.log, self.outbox, self.device)
        else:
            got = exchange(ranks, self.groups[ranks], [], [(shape, dst) for shape in shapes], dtype, self.log,
                           self.outbox, self.device)
            self.carry_grads[(i, p)] = tuple(got)

    def _where(self, i: int, r: int, phase: int) -> str:
        """What the rank does at round `r` of op position `i` (phase 0: forward, 1: backward), for errors."""
        where = self.wheres[self.graph.ops[i].name][phase]
        return where if self.plan.ops[i].num_rounds == 1 else f"{where}, round {r}"

    # ------------------------------------------------------------------ backward

    def _accumulate(self, key: tuple[TensorRef, int], slices: tuple[slice, ...], piece: torch.Tensor) -> None:
        """Add `piece` into the gradient of (output, producer part) `key` at `slices`."""
        buf = self.grads.get(key)
        if buf is None:
            shape = self.grad_shapes[key]
            if tuple(piece.shape) == shape:
                # The first contribution covers the whole output part: keep it, add later ones into it.
                # It is a gradient buffer nothing else reads (a leaf's .grad or a received buffer).
                self.grads[key] = piece
                return
            buf = self.grads[key] = torch.zeros(shape, dtype=piece.dtype, device=piece.device)
        buf[slices].add_(piece)

    def _release_outputs(self, j: int) -> None:
        for c in self.parts[j]:
            self.values.pop((j, c), None)
            self.saved.pop((j, c), None)

    def _backward_item(self, k: int, i: int, r: int, loss_scale: float) -> None:
        """The backward of round `r` of op position `i` (order position `k`): the recomputations due before
        it, this rank's part of the round if it has one, its input gradients sent back through the
        round's exchanges, and the all-reduces that become ready once it is the op's last."""
        for j, p in self.recompute_before.get(k, ()):
            self.where = f"recomputation of op {self.graph.ops[j].name!r} ({self.graph.ops[j].kind})"
            self._recompute(j, p)
        op = self.graph.ops[i]
        self.where = self._where(i, r, 1)
        c = self.round_part[i].get(r)
        in_grads: list[torch.Tensor | None] = [None] * len(op.inputs)
        if c is not None:
            # Its consumers are done with the output: let it go now, as autograd frees activations during
            # backward (holding every activation to the end costs memory and fresh pages every step).
            self.values.pop((i, c), None)
            saved = self.saved.pop((i, c), None)
            if saved is not None:
                last = len(self.graph.ops) - 1
                in_grads = self._backward_part(i, c, op, saved, loss_scale if i == last else None)
        flow = self.flow
        for slot, eid in enumerate(flow.slot_edges[i]):
            if eid is not None:
                ref = flow.edges[eid].ref
                self.movers[(eid, r)].backward(
                    in_grads[slot], lambda p, sl, piece, ref=ref: self._accumulate((ref, p), sl, piece))
        for move in self.carry_moves.get((i, r), ()):
            self._move_state_grad(i, *move)
        if self.plan.done_at[i] == k:
            self.sync.ready(i)

    def _backward_part(self, i: int, c: int, op: Operator,
                       saved: tuple[list[torch.Tensor | None], tuple[torch.Tensor, ...]], loss_scale: float | None
                       ) -> list[torch.Tensor | None]:
        """Backpropagate part `c` of op position `i` (its `saved` leaves and outputs) from the gradients
        its outputs received (the loss part: `loss_scale`); returns its input gradients."""
        leaves, outs = saved
        if loss_scale is not None:
            pairs = [(outs[0], torch.full_like(outs[0], loss_scale))]
        else:
            pairs = [(o, self.grads.pop((ref, c))) for o, ref in zip(outs, self.out_refs[op.name], strict=True)
                     if (ref, c) in self.grads]
        state, final = self.carry.pop((i, c), (None, ()))
        pairs += zip(final, self.carry_grads.pop((i, c), ()), strict=False)  # from the chunk after it
        pairs = [(o, g) for o, g in pairs if o.requires_grad and g is not None]
        sharded = i in self.gathers
        if sharded:
            self._gather_into(i, op)
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        in_grads = [x.grad if x is not None and x.requires_grad else None for x in leaves]
        prev = self.plan.ops[i].carry_from[c]
        if prev is not None:
            grads = tuple(x.grad for x in state)
            if (i, c) in self.carry_in:
                self.carry_back[(i, c)] = grads  # sent back to the source's rank (`_move_state_grad`)
            else:
                self.carry_grads[(i, prev)] = grads
        if sharded:
            # the gathered weights are done with: free them before the reduce-scatter's buffers
            grads = {name: w.grad for name, w in self.op_params[(i, c)].items()}
            self._release(i)
            self._scatter_grads(i, grads)
        return in_grads

    def _grad_of(self, e: SyncEntry) -> torch.Tensor:
        if e.region is not None:
            shard = self.shards[(e.fqn, e.region)]
            return shard.grad if shard.grad is not None else torch.zeros_like(shard)
        full = torch.zeros(tuple(hi - lo for lo, hi in e.box), dtype=self.float_dtype, device=self.device)
        for region, shard in self._in_box(e):
            if shard.grad is not None:
                full[as_slices(region)].add_(shard.grad)
        return full

    def _in_box(self, e: SyncEntry) -> list[tuple[Region, torch.Tensor]]:
        """The shards of `e`'s parameter within its box (`SyncEntry`), each with its region relative to the
        box."""
        out = []
        for (fqn, region), shard in self.shards.items():
            if fqn != e.fqn:
                continue
            pairs = list(zip(region, e.box, strict=True))
            if all(blo <= lo and hi <= bhi for (lo, hi), (blo, bhi) in pairs):
                out.append((tuple((lo - blo, hi - blo) for (lo, hi), (blo, _) in pairs), shard))
        return out

    def _set_grad(self, e: SyncEntry, value: torch.Tensor) -> None:
        if e.region is not None:
            # `value` is this gradient's own reduced buffer (or a slice of a bucket used once): no copy.
            self.shards[(e.fqn, e.region)].grad = value
            return
        for region, shard in self._in_box(e):
            shard.grad = value[as_slices(region)].clone()

    def zero_grad(self) -> None:
        for shard in self.shards.values():
            shard.grad = None

    def all_reduce_loss(self, local: torch.Tensor) -> float:
        """The step's loss: the sum over ranks of their loss parts."""
        if not self.distributed:
            return float(local)
        total = local.detach().clone().reshape(1)
        dist.all_reduce(total)
        return float(total[0])
