"""The SPMD interpreter: every rank walks the same OperatorGraph under the same Strategy and runs its parts.

Owns `Executor` (forward, explicit backward, gradient synchronization, the local parameter shards) and
`ExecutionError` (which names the rank, the phase and the op that failed). Imports `soap`, torch and the
other `runtime` modules only (no simulator, no search, no soapflow).

How a step runs on one rank, with the step plan (`soap.lowering.StepPlan`) saying who holds what and
what moves where:

- forward, op by op in graph order: move the op's input regions to its part here, edge by edge
  (`EdgeMover`: local slices and one exchange per edge, partial sums added), then compute the part with
  `runtime.kernels.compute_part` on detached leaf copies of the inputs and on this rank's parameter
  shards. Sources move nothing (`OpDef.everywhere`): an op reads its region of an `input` from the
  global synthetic batch every rank holds, and of a `constant` from this rank's own buffer (or the value
  its recipe computes from the buffers, once, at setup).
- backward, op by op in reverse graph order: backpropagate the part from the gradients its consumers
  sent back (leaf gradients give the input gradients), send every input piece's gradient back to the
  rank it came from (added there), then tell `GradSync` the op is done: it launches the plan's
  all-reduces whose gradients just became final, within exactly their device set, asynchronous.

`collectives` counts what this rank issued in the last step (`CollectiveLog`), in the shape of
`StepPlan.collectives`, so a run can show that it did what the plan says.

The loss is the last op: its parts hold partial sums of the global mean (or the whole loss), each
backpropagated with gradient 1; the step's loss is the sum over ranks of the local parts.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist

from runtime import kernels
from runtime.collectives import CollectiveLog, EdgeMover, GradSync, make_groups
from runtime.materialize import PieceKey, take_piece
from soap.config import param_pieces
from soap.graph import Operator, OperatorGraph, TensorRef
from soap.lowering import ALL_GATHER, REDUCE_SCATTER, StepPlan, SyncEntry, chunk_numel, recompute_points
from soap.opdef import Region
from soap.registry import op_def

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
    """The parameter pieces (fqn, region, chunk) the parts of `rank` hold under `plan`: what an `Executor`
    reads from its `tensors` (a sharded part's chunk of each region, else the region), buffers aside."""
    out = []
    for step, op in zip(plan.ops, plan.flow.graph, strict=True):
        p = step.part_on(rank)
        if p is None:
            continue
        groups = step.shard_groups
        group = groups[p] if groups is not None else (rank,)
        chunk = (group.index(rank), len(group)) if len(group) > 1 else None
        for fqn, region in param_pieces(op, step.boxes[p]).values():
            out.append((fqn, region, chunk))
    return out


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
                 timeout_s: float = 60.0):
        assert plan.flow.source is graph, "the plan is not the graph's"
        self.graph = graph = plan.flow.graph  # the graph as run: activations in the compute dtype
        self.plan = plan
        self.flow = plan.flow
        self.rank = rank
        self.module = module
        self.float_dtype = float_dtype
        mixed = plan.flow.setup.compute_dtype != "float32"
        self.compute_dtype = TORCH_DTYPES[plan.flow.setup.compute_dtype] if mixed else float_dtype
        if self.compute_dtype == torch.float16 and any(op.kind == "lstm" for op in graph):
            raise ValueError("precision fp16 cannot run an LSTM on a CPU (its kernel has no float16 form); "
                             "use bf16")
        self.where = "setup"
        self.step = 0
        self.num_forwards = 0
        self.distributed = plan.num_devices > 1
        self.log = CollectiveLog()
        self.shards: dict[tuple[str, Region], torch.Tensor] = {}
        self.buffers: dict[tuple[str, Region], torch.Tensor] = {}
        self.op_params: dict[str, dict[str, torch.Tensor]] = {}
        self.op_buffers: dict[str, dict[str, torch.Tensor]] = {}
        self.param_shapes = {p.fqn: p.full_shape for op in graph for p in op.params.values()}
        # Outputs every rank holds whole (`OpDef.everywhere`): the buffers, and each step's global batch.
        self.sources: dict[str, torch.Tensor] = {}
        # Per op position, the part on this rank (None: none) and its box.
        self.parts = [step.part_on(rank) for step in plan.ops]
        self.boxes = [step.boxes[p] if p is not None else None for step, p in zip(plan.ops, self.parts, strict=True)]
        # sharded parts: per op position, (shard group, [(local name, key, numel, chunk numel, shape)]);
        # per key of a chunk, (its index in the group, the group's size)
        self.gathers: dict[int, tuple[tuple[int, ...], list[tuple[str, tuple, int, int, tuple[int, ...]]]]] = {}
        self.chunks: dict[tuple[str, Region], tuple[int, int]] = {}
        for i, op in enumerate(graph):
            entry = op_def(op.kind)
            if op.kind == "constant":
                value = kernels.constant_value(op, tensors, cast=self._cast)
                self.sources[op.name] = self._as_output(value, op).detach()
            box = self.boxes[i]
            if box is None:
                continue
            groups = plan.ops[i].shard_groups
            sharded = groups is not None and len(groups[self.parts[i]]) > 1
            if sharded:
                self._chunk_params(i, op, groups[self.parts[i]], tensors)
            params = {}
            for name, key in ({} if sharded else param_pieces(op, box)).items():
                fqn = key[0]
                if key not in self.shards:
                    value = take_piece(tensors, fqn, key[1])
                    self.shards[key] = self._cast(value).detach().clone().requires_grad_(True)
                params[name] = self.shards[key]
            if not sharded:
                self.op_params[op.name] = params
            buffers = {}
            for name, region in entry.buffer_regions(op, box).items():
                fqn = op.attrs[name]
                key = (fqn, tuple(tuple(r) for r in region))
                if key not in self.buffers:
                    self.buffers[key] = self._cast(take_piece(tensors, fqn, key[1])).detach().clone()
                buffers[name] = self.buffers[key]
            self.op_buffers[op.name] = buffers
        flow = self.flow
        self.movers = [EdgeMover(step, flow.edges[step.edge], plan.ops[flow.edges[step.edge].src],
                                 plan.ops[flow.edges[step.edge].dst], rank=rank,
                                 dtype=self.torch_dtype(graph.tensor(flow.edges[step.edge].ref).dtype), log=self.log)
                       for step in plan.edges]
        self.out_refs = {op.name: tuple(TensorRef(op=op.name, index=i) for i in range(len(op.outputs)))
                         for op in graph}
        # the shape of this rank's part of every output a gradient flows back to
        self.grad_shapes = {}
        for e in flow.edges:
            p = self.parts[e.src]
            if p is not None:
                self.grad_shapes[e.ref] = tuple(int(hi - lo) for lo, hi in plan.ops[e.src].out_regions[e.out][p])
        self.wheres = {op.name: (f"forward of op {op.name!r} ({op.kind})", f"backward of op {op.name!r} ({op.kind})")
                       for op in graph}
        # Every process group, for the exchanges and the all-reduces, created up front in the same (sorted)
        # order on every rank.
        groups = self.groups = make_groups(plan.process_groups(), timeout_s=timeout_s) if self.distributed else {}
        for mover in self.movers:
            mover.bind(groups)
        self.sync = GradSync(plan.all_reduces, rank=rank, groups=groups, grad_of=self._grad_of,
                             set_grad=self._set_grad, log=self.log)
        # recomputation (`soap.lowering`'s rule): per op position, where it is recomputed; per backward
        # position, the ops recomputed there (ascending); what recomputing parts received in forward
        self.recompute = [step.recompute for step in plan.ops]
        at = recompute_points(flow, self.recompute)
        self.recompute_before: dict[int, list[int]] = {}
        for j, point in enumerate(at):
            if point is not None:
                self.recompute_before.setdefault(point, []).append(j)
        # a recomputing op's output is dropped after the forward of its last consumer
        self.drop_after: dict[int, list[int]] = {}
        for j, edges in enumerate(flow.out_edges):
            if self.recompute[j] and edges and j != len(graph.ops) - 1:
                self.drop_after.setdefault(max(flow.edges[e].dst for e in edges), []).append(j)
        self.kept: dict[int, dict[int, torch.Tensor]] = {}
        self.saved: dict[str, tuple[list[torch.Tensor | None], tuple[torch.Tensor, ...]]] = {}
        self.values: dict[str, tuple[torch.Tensor, ...]] = {}
        self.grads: dict[TensorRef, torch.Tensor] = {}
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
        for name, key in param_pieces(op, self.boxes[i]).items():
            fqn = key[0]
            shape = tuple(hi - lo for lo, hi in key[1])
            numel = math.prod(shape)
            value = self._cast(take_piece(tensors, fqn, key[1], (j, size))).detach()
            self.shards[key] = value.clone().requires_grad_(True)
            self.chunks[key] = (j, size)
            layout.append((name, key, numel, chunk_numel(numel, size), shape))
        self.gathers[i] = (group, layout)
        self.op_params[op.name] = {}

    def _gather(self, i: int, op: Operator) -> None:
        """All-gather op position `i`'s sharded parameters into fresh leaf tensors its part computes with
        (in the compute dtype; an op with running statistics keeps the master dtype)."""
        group, layout = self.gathers[i]
        dtype = self.float_dtype if self.op_buffers[op.name] else self.compute_dtype
        flat = torch.cat([self.shards[key].detach().to(dtype) for _, key, _, _, _ in layout])
        out = torch.empty(len(group) * flat.numel(), dtype=dtype)
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
        self.op_params[op.name] = params

    def _gather_into(self, i: int, op: Operator) -> None:
        """Gather op position `i`'s sharded parameters again into the tensors its autograd graph holds."""
        held = self.op_params[op.name]
        self._gather(i, op)
        for name, w in self.op_params[op.name].items():
            held[name].data = w.detach()
        self.op_params[op.name] = held

    def _param_hooks(self, op: Operator) -> tuple[Any, Any]:
        """Saved-tensor hooks that store a tensor on a gathered parameter's storage as (parameter, view)."""
        by_storage = {w.untyped_storage().data_ptr(): w for w in self.op_params[op.name].values()}

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

    def _release(self, op: Operator) -> None:
        """Free a sharded part's gathered parameters (autograd keeps the tensors, not their data)."""
        for w in self.op_params[op.name].values():
            w.data = torch.empty(0, dtype=w.dtype)
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
            buf = torch.empty(size, total, dtype=self.float_dtype)
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
        out = torch.empty(total, dtype=self.float_dtype)
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
        """This rank's parameter shards (leaf tensors), in a fixed order: what the optimizer updates."""
        return [self.shards[k] for k in sorted(self.shards)]

    def shard_items(self) -> list[tuple[str, Region, torch.Tensor, tuple[int, int] | None]]:
        """(fqn, region, tensor, chunk) per shard: `chunk` is None where the tensor is the region, else
        (index, count): the tensor is that chunk of the region flattened and padded (a sharded op's)."""
        return [(fqn, region, self.shards[(fqn, region)], self.chunks.get((fqn, region)))
                for fqn, region in sorted(self.shards)]

    # ------------------------------------------------------------------ forward

    def _inputs(self, i: int, op: Operator) -> list[torch.Tensor | None]:
        """The input regions of op position `i`'s part here (None where it has none or does not read
        one), every edge's exchange taken part in whether or not this rank has a part."""
        box_part = self.parts[i]
        out: list[torch.Tensor | None] = []
        for slot, eid in enumerate(self.flow.slot_edges[i]):
            if eid is None:
                out.append(self._source_input(i, op, slot))
                continue
            e = self.flow.edges[eid]
            values = self.values.get(self.flow.ops[e.src].name)
            output = None if values is None else values[e.out]
            mover = self.movers[eid]
            received = mover.receive(output)
            if self.recompute[i] and box_part is not None:
                self.kept[eid] = received  # what a recomputation reads again (nothing moves twice)
            out.append(mover.assemble(output, received))
        return out

    def _source_input(self, i: int, op: Operator, slot: int) -> torch.Tensor | None:
        """Input `slot` of op position `i`'s part here, read from a source: every rank holds it whole and
        slices what its part reads (None: no part here, or it does not read the input)."""
        part = self.parts[i]
        want = self.plan.ops[i].reads[slot][part] if part is not None else None
        return None if want is None else self.sources[op.inputs[slot].op][as_slices(want)]

    def _recompute(self, i: int) -> None:
        """Run op position `i`'s part forward again, from the outputs kept here, the pieces it received in
        forward and the recomputed outputs of recomputing producers (recomputed before it)."""
        op = self.graph.ops[i]
        if self.parts[i] is None:
            return
        inputs: list[torch.Tensor | None] = []
        for slot, eid in enumerate(self.flow.slot_edges[i]):
            if eid is None:
                inputs.append(self._source_input(i, op, slot))
                continue
            e = self.flow.edges[eid]
            mover = self.movers[eid]
            output = None
            if mover.reads_local:
                values = self.values.get(self.flow.ops[e.src].name)
                assert values is not None, f"{self.flow.ops[e.src].name} is neither kept nor recomputed"
                output = values[e.out]
            inputs.append(mover.assemble(output, self.kept.get(eid, {})))
        self._run_part(i, op, inputs, keep=True)

    def _run_part(self, i: int, op: Operator, inputs: list[torch.Tensor | None], *, keep: bool) -> None:
        """Compute op position `i`'s part on `inputs`; with `keep`, keep its autograd graph for backward."""
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
            context = torch.autograd.graph.saved_tensors_hooks(*self._param_hooks(op))
        else:
            context = contextlib.nullcontext()
        with context:
            outs = self._compute(op, self.boxes[i], leaves)
        if keep:
            self.saved[op.name] = (leaves, outs)
        self.values[op.name] = tuple(o.detach() for o in outs)
        if i in self.gathers:
            self._release(op)

    def _compute(self, op: Operator, box, inputs: list[torch.Tensor | None]) -> tuple[torch.Tensor, ...]:
        params = self.op_params[op.name]
        if self.compute_dtype != self.float_dtype:
            if op.name == self.plan.loss_op:  # the loss computes in the master dtype
                inputs = [x.to(self.float_dtype) if x is not None and x.is_floating_point() else x for x in inputs]
            elif not self.op_buffers[op.name]:
                # an op with running statistics (batch norm) keeps its float32 weights, as torch.autocast
                # does: the kernel takes compute-dtype input with float32 weight and statistics
                params = {k: v.to(self.compute_dtype) for k, v in params.items()}
        if op.kind != "opaque":
            return kernels.compute_part(op, box, inputs, params, training=True,
                                        buffers=self.op_buffers[op.name], step=self.step,
                                        check=self.num_forwards == 0)
        target = None
        if op.attrs.get("target", "module") == "module":
            assert self.module is not None, "opaque ops need the model"
            sub = self.module.get_submodule(op.module)
            # Call the module with this rank's parameter tensors in place of its own, so that
            # gradients reach the shards the optimizer updates.
            def target(*args, **kwargs):
                return torch.func.functional_call(sub, dict(params), args, kwargs, strict=False)
        return kernels.run_opaque(op, target, inputs, params)

    def forward(self, batch: Sequence[torch.Tensor], *, step: int = 0, fail: bool = False) -> torch.Tensor:
        """Run the forward pass on the full synthetic batch `batch` (one tensor per `input` position);
        returns this rank's share of the loss (a 0-dim tensor, zero when it holds no loss part).

        `fail` (a test hook) raises in the first op this rank computes, as a failing kernel would."""
        self.step = step
        self.saved.clear()
        self.values.clear()
        self.grads.clear()
        self.log.reset()
        for i, op in enumerate(self.graph):
            self.where = self.wheres[op.name][0]
            if op.kind == "input":
                # Every rank holds the whole global batch and reads from it what its parts need.
                self.sources[op.name] = self._as_output(batch[int(op.attrs["position"])], op)
                continue
            if op.name in self.sources:
                continue
            inputs = self._inputs(i, op)
            box = self.boxes[i]
            if box is not None:
                if fail:
                    raise RuntimeError("injected fault (test hook)")
                self._run_part(i, op, inputs, keep=not self.recompute[i])
            for j in self.drop_after.get(i, ()):
                self.values.pop(self.graph.ops[j].name, None)
        self.where = "loss"
        self.num_forwards += 1
        loss_part = self.values.get(self.plan.loss_op)
        if loss_part is None:
            return torch.zeros((), dtype=self.float_dtype)
        return loss_part[0].reshape(())

    # ------------------------------------------------------------------ backward

    def _accumulate(self, ref: TensorRef, slices: tuple[slice, ...], piece: torch.Tensor) -> None:
        buf = self.grads.get(ref)
        if buf is None:
            shape = self.grad_shapes[ref]
            if tuple(piece.shape) == shape:
                # The first contribution covers the whole output part: keep it, add later ones into it.
                # It is a gradient buffer nothing else reads (a leaf's .grad or a received buffer).
                self.grads[ref] = piece
                return
            buf = self.grads[ref] = torch.zeros(shape, dtype=piece.dtype)
        buf[slices].add_(piece)

    def backward(self, *, loss_scale: float = 1.0) -> None:
        """Backpropagate the loss parts (times `loss_scale`), move input gradients back to their producers,
        and synchronize replicated parameter gradients (waits for the all-reduces before returning)."""
        last = len(self.graph.ops) - 1
        for j in self.recompute_before.get(last, ()):
            self.where = f"recomputation of op {self.graph.ops[j].name!r} ({self.graph.ops[j].kind})"
            self._recompute(j)
        loss = self.saved.get(self.plan.loss_op)
        if loss is not None:
            self.grads[self.out_refs[self.plan.loss_op][0]] = torch.full_like(loss[1][0], loss_scale)
        flow = self.flow
        for i in range(len(self.graph.ops) - 1, -1, -1):
            op = self.graph.ops[i]
            if i < last:
                for j in self.recompute_before.get(i, ()):
                    self.where = f"recomputation of op {self.graph.ops[j].name!r} ({self.graph.ops[j].kind})"
                    self._recompute(j)
            self.where = self.wheres[op.name][1]
            if op.name in self.sources:
                continue
            in_grads: list[torch.Tensor | None] = [None] * len(op.inputs)
            # Its consumers are done with the output: let it go now, as autograd frees activations during
            # backward (holding every activation to the end costs memory and fresh pages every step).
            self.values.pop(op.name, None)
            saved = self.saved.pop(op.name, None)
            if saved is not None:
                leaves, outs = saved
                pairs = [(o, self.grads.pop(ref)) for o, ref in zip(outs, self.out_refs[op.name], strict=True)
                         if ref in self.grads]
                pairs = [(o, g) for o, g in pairs if o.requires_grad]
                sharded = i in self.gathers
                if sharded:
                    self._gather_into(i, op)
                if pairs:
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                in_grads = [x.grad if x is not None and x.requires_grad else None for x in leaves]
                if sharded:
                    # the gathered weights are done with: free them before the reduce-scatter's buffers
                    grads = {name: w.grad for name, w in self.op_params[op.name].items()}
                    self._release(op)
                    self._scatter_grads(i, grads)
            for slot, eid in enumerate(flow.slot_edges[i]):
                if eid is not None:
                    ref = flow.edges[eid].ref
                    self.movers[eid].backward(in_grads[slot],
                                              lambda sl, piece, ref=ref: self._accumulate(ref, sl, piece))
            self.sync.ready(i)
        self.where = "gradient synchronization"
        self.sync.finish()
        self.collectives = self.log.snapshot()
        self.values.clear()
        self.grads.clear()
        self.kept.clear()
        self.where = "step"

    def _grad_of(self, e: SyncEntry) -> torch.Tensor:
        if e.region is not None:
            shard = self.shards[(e.fqn, e.region)]
            return shard.grad if shard.grad is not None else torch.zeros_like(shard)
        full = torch.zeros(self.param_shapes[e.fqn], dtype=self.float_dtype)
        for (fqn, region), shard in self.shards.items():
            if fqn == e.fqn and shard.grad is not None:
                full[as_slices(region)].add_(shard.grad)
        return full

    def _set_grad(self, e: SyncEntry, value: torch.Tensor) -> None:
        if e.region is not None:
            # `value` is this gradient's own reduced buffer (or a slice of a bucket used once): no copy.
            self.shards[(e.fqn, e.region)].grad = value
            return
        for (fqn, region), shard in self.shards.items():
            if fqn == e.fqn:
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
