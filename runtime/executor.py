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

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from runtime import kernels
from runtime.collectives import CollectiveLog, EdgeMover, GradSync, make_groups
from soap.graph import Operator, OperatorGraph, TensorRef
from soap.lowering import StepPlan, SyncEntry
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


class Executor:
    """Runs `graph` under the step plan `plan` on rank `rank` (torch.distributed already initialized when
    the plan spans more than one device).

    `tensors` maps every parameter and buffer fqn of the model to its full value (every rank builds the
    whole model from the same seed and keeps only the shards its parts read). `float_dtype` is the dtype
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
        self.param_shapes = {p.fqn: p.shape for op in graph for p in op.params.values()}
        # Outputs every rank holds whole (`OpDef.everywhere`): the buffers, and each step's global batch.
        self.sources: dict[str, torch.Tensor] = {}
        # Per op position, the part on this rank (None: none) and its box.
        self.parts = [step.part_on(rank) for step in plan.ops]
        self.boxes = [step.boxes[p] if p is not None else None for step, p in zip(plan.ops, self.parts, strict=True)]
        for i, op in enumerate(graph):
            entry = op_def(op.kind)
            if op.kind == "constant":
                value = kernels.constant_value(op, tensors, cast=self._cast)
                self.sources[op.name] = self._as_output(value, op).detach()
            box = self.boxes[i]
            if box is None:
                continue
            params = {}
            for name, region in entry.param_regions(op, box).items():
                fqn = op.params[name].fqn
                key = (fqn, tuple(tuple(r) for r in region))
                if key not in self.shards:
                    value = tensors[fqn][as_slices(key[1])]
                    self.shards[key] = self._cast(value).detach().clone().requires_grad_(True)
                params[name] = self.shards[key]
            self.op_params[op.name] = params
            buffers = {}
            for name, region in entry.buffer_regions(op, box).items():
                fqn = op.attrs[name]
                key = (fqn, tuple(tuple(r) for r in region))
                if key not in self.buffers:
                    self.buffers[key] = self._cast(tensors[fqn][as_slices(key[1])]).detach().clone()
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
        groups = make_groups(plan.process_groups(), timeout_s=timeout_s) if self.distributed else {}
        for mover in self.movers:
            mover.bind(groups)
        self.sync = GradSync(plan.all_reduces, rank=rank, groups=groups, grad_of=self._grad_of,
                             set_grad=self._set_grad, log=self.log)
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

    def parameters(self) -> list[torch.Tensor]:
        """This rank's parameter shards (leaf tensors), in a fixed order: what the optimizer updates."""
        return [self.shards[k] for k in sorted(self.shards)]

    def shard_items(self) -> list[tuple[str, Region, torch.Tensor]]:
        return [(fqn, region, self.shards[(fqn, region)]) for fqn, region in sorted(self.shards)]

    # ------------------------------------------------------------------ forward

    def _inputs(self, i: int, op: Operator) -> list[torch.Tensor | None]:
        """The input regions of op position `i`'s part here (None where it has none or does not read
        one), every edge's exchange taken part in whether or not this rank has a part."""
        box_part = self.parts[i]
        reads = self.plan.ops[i].reads
        out: list[torch.Tensor | None] = []
        for slot, eid in enumerate(self.flow.slot_edges[i]):
            if eid is None:
                # a source: every rank holds it whole and slices what its part reads
                want = reads[slot][box_part] if box_part is not None else None
                out.append(None if want is None else self.sources[op.inputs[slot].op][as_slices(want)])
                continue
            e = self.flow.edges[eid]
            values = self.values.get(self.flow.ops[e.src].name)
            out.append(self.movers[eid].forward(None if values is None else values[e.out]))
        return out

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
            if box is None:
                continue
            leaves = [x.detach().requires_grad_(True) if x is not None and grad else x
                      for grad, x in zip(self.flow.grad_inputs[i], inputs, strict=True)]
            if fail:
                raise RuntimeError("injected fault (test hook)")
            outs = self._compute(op, box, leaves)
            self.saved[op.name] = (leaves, outs)
            self.values[op.name] = tuple(o.detach() for o in outs)
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
        loss = self.saved.get(self.plan.loss_op)
        if loss is not None:
            self.grads[self.out_refs[self.plan.loss_op][0]] = torch.full_like(loss[1][0], loss_scale)
        flow = self.flow
        for i in range(len(self.graph.ops) - 1, -1, -1):
            op = self.graph.ops[i]
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
                if pairs:
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                in_grads = [x.grad if x is not None and x.requires_grad else None for x in leaves]
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
