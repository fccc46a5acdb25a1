"""The SPMD interpreter: every rank walks the same OperatorGraph under the same Strategy and runs its parts.

Owns `Executor` (forward, explicit backward, gradient synchronization, the local parameter shards) and
`ExecutionError` (which names the rank, the phase and the op that failed). Imports `soap`, torch and the
other `runtime` modules only (no simulator, no search, no soapflow).

How a step runs on one rank (DESIGN section 6), with `Plan` (runtime/plan.py) saying who holds what:

- forward, op by op in graph order: move the op's input regions to its part here (`Redistribution`:
  local slices and point-to-point pieces, partial sums added), then compute the part with
  `runtime.kernels.compute_part` on detached leaf copies of the inputs and on this rank's parameter
  shards. Sources move nothing (`OpDef.everywhere`): an op reads its region of an `input` from the
  global synthetic batch every rank holds, and of a `constant` from this rank's own buffer.
- backward, op by op in reverse graph order: backpropagate the part from the gradients its consumers
  sent back (leaf gradients give the input gradients), send every input piece's gradient back to the
  rank it came from (added there), then hand the parameters that just became final to `GradSync`, which
  all-reduces replicated shards within exactly their device set, bucketed and asynchronous.

The loss is the last op: its parts hold partial sums of the global mean (or the whole loss), each
backpropagated with gradient 1; the step's loss is the sum over ranks of the local parts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from runtime import kernels
from runtime.collectives import GradSync, Redistribution, make_groups, region_shape
from runtime.plan import EdgePlan, Plan, Region, SyncEntry
from soap.graph import Operator, OperatorGraph, TensorRef
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
    """Runs `graph` under `plan` on rank `rank` (torch.distributed already initialized when the plan
    spans more than one device).

    `tensors` maps every parameter and buffer fqn of the model to its full value (every rank builds the
    whole model from the same seed and keeps only the shards its parts read). `float_dtype` is the dtype
    the run computes in (float64 for tight verification); `module` is the model, for opaque ops.
    """

    def __init__(self, graph: OperatorGraph, plan: Plan, *, rank: int, tensors: Mapping[str, torch.Tensor],
                 module: torch.nn.Module | None = None, float_dtype: torch.dtype = torch.float32,
                 bucket_bytes: int = 4 * 2**20, timeout_s: float = 60.0):
        self.graph = graph
        self.plan = plan
        self.rank = rank
        self.module = module
        self.float_dtype = float_dtype
        self.where = "setup"
        self.step = 0
        self.num_forwards = 0
        self.distributed = plan.num_devices > 1
        self.shards: dict[tuple[str, Region], torch.Tensor] = {}
        self.buffers: dict[tuple[str, Region], torch.Tensor] = {}
        self.op_params: dict[str, dict[str, torch.Tensor]] = {}
        self.op_buffers: dict[str, dict[str, torch.Tensor]] = {}
        # Outputs every rank holds whole (`OpDef.everywhere`): the buffers, and each step's global batch.
        self.sources: dict[str, torch.Tensor] = {}
        for op in graph:
            entry = op_def(op.kind)
            if op.kind == "constant":
                self.sources[op.name] = self._cast(tensors[op.attrs["fqn"]]).detach()
            p = plan.local_part(op.name, rank)
            if p is None:
                continue
            box = plan.parts[op.name][p][0]
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
        self.redists = {op.name: self._redistribution(op) for op in graph}
        # Per-op facts of the plan that every step reads (worked out once: a step is a hot loop).
        self.boxes = {op.name: plan.parts[op.name][p][0] if (p := plan.local_part(op.name, rank)) is not None
                      else None for op in graph}
        self.out_refs = {op.name: tuple(TensorRef(op=op.name, index=i) for i in range(len(op.outputs)))
                         for op in graph}
        self.grad_shapes = {ref: region_shape(edge.src_regions[j])
                            for edges in plan.edges.values() for edge in edges
                            if (ref := edge.ref) and (j := plan.local_part(ref.op, rank)) is not None}
        self.wheres = {op.name: (f"forward of op {op.name!r} ({op.kind})", f"backward of op {op.name!r} ({op.kind})")
                       for op in graph}
        # Every process group, for gradient synchronization and for the exchanges between ops, created up
        # front in the same (sorted) order on every rank.
        device_sets = set(plan.groups).union(*(r.device_sets() for r in self.redists.values()))
        groups = make_groups(sorted(device_sets), timeout_s=timeout_s) if self.distributed else {}
        for r in self.redists.values():
            r.bind(groups)
        self.sync = GradSync(plan.sync, rank=rank, groups=groups, bucket_bytes=bucket_bytes,
                             grad_of=self._grad_of, set_grad=self._set_grad)
        self.saved: dict[str, tuple[list[torch.Tensor | None], tuple[torch.Tensor, ...]]] = {}
        self.values: dict[str, tuple[torch.Tensor, ...]] = {}
        self.grads: dict[TensorRef, torch.Tensor] = {}

    # ------------------------------------------------------------------ setup helpers

    def _cast(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.float_dtype) if t.is_floating_point() else t

    def torch_dtype(self, name: str) -> torch.dtype:
        dtype = TORCH_DTYPES[name]
        return self.float_dtype if dtype == torch.float32 else dtype

    def _redistribution(self, op: Operator) -> Redistribution:
        edges = self.plan.edges[op.name]
        return Redistribution(
            edges, rank=self.rank, my_part=self.plan.local_part(op.name, self.rank),
            my_src_parts=[self.plan.local_part(e.ref.op, self.rank) for e in edges],
            dtypes=[self.torch_dtype(self.graph.tensor(e.ref).dtype) for e in edges],
            local_tensor=lambda e: self.sources[e.ref.op])

    def parameters(self) -> list[torch.Tensor]:
        """This rank's parameter shards (leaf tensors), in a fixed order: what the optimizer updates."""
        return [self.shards[k] for k in sorted(self.shards)]

    def shard_items(self) -> list[tuple[str, Region, torch.Tensor]]:
        return [(fqn, region, self.shards[(fqn, region)]) for fqn, region in sorted(self.shards)]

    # ------------------------------------------------------------------ forward

    def _local_output(self, edge: EdgePlan) -> torch.Tensor | None:
        values = self.values.get(edge.ref.op)
        return None if values is None else values[edge.ref.index]

    def _compute(self, op: Operator, box, inputs: list[torch.Tensor | None]) -> tuple[torch.Tensor, ...]:
        params = self.op_params[op.name]
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
        for op in self.graph:
            self.where = self.wheres[op.name][0]
            if op.kind == "input":
                # Every rank holds the whole global batch and reads from it what its parts need.
                self.sources[op.name] = self._cast(batch[int(op.attrs["position"])])
                continue
            if op.name in self.sources:
                continue
            edges = self.plan.edges[op.name]
            inputs = self.redists[op.name].forward([self._local_output(e) for e in edges])
            box = self.boxes[op.name]
            if box is None:
                continue
            leaves = [x.detach().requires_grad_(True) if x is not None and e.needs_grad else x
                      for e, x in zip(edges, inputs, strict=True)]
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

    def _accumulate(self, edge: EdgePlan, slices: tuple[slice, ...], piece: torch.Tensor) -> None:
        ref = edge.ref
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

    def backward(self) -> None:
        """Backpropagate the loss parts, move input gradients back to their producers, and synchronize
        replicated parameter gradients (waits for the all-reduces before returning)."""
        loss = self.saved.get(self.plan.loss_op)
        if loss is not None:
            self.grads[self.out_refs[self.plan.loss_op][0]] = torch.ones_like(loss[1][0])
        for op in reversed(self.graph.ops):
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
            self.redists[op.name].backward(in_grads, self._accumulate)
            self.sync.ready(op.name)
        self.where = "gradient synchronization"
        self.sync.finish()
        self.values.clear()
        self.grads.clear()
        self.where = "step"

    def _grad_of(self, e: SyncEntry) -> torch.Tensor:
        if e.region is not None:
            shard = self.shards[(e.fqn, e.region)]
            return shard.grad if shard.grad is not None else torch.zeros_like(shard)
        full = torch.zeros(self.plan.param_shapes[e.fqn], dtype=self.float_dtype)
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
