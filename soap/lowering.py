"""The lowering: (graph, strategy, setup) -> `StepPlan`, everything one training step does.

Owns `GradFlow` (what a step needs to know about the graph whatever the strategy: which ops run a
backward, which edges carry a gradient, which ops share parameters, the gradient buckets), the per-piece
lowerings `OpStep`, `EdgeStep` and `ParamStep`, the step-wide `AllReduce` and `StepPlan`, and the
functions `lower_op`, `lower_edge`, `lower_params` and `lower`. The simulator times a plan's pieces
(re-lowering only the pieces one op's change touches, in delta simulation); the runtime executes the
plan. Neither derives communication on its own, so what is simulated is what runs.

The rules, each stated once:

- **Gradient flow.** An op *requires* a gradient when it has parameters or reads a floating tensor from
  an op that requires one (sources, `OpDef.everywhere`, never do). It *runs backward* when it requires a
  gradient and it is the loss (the last op) or a consumer that runs backward reads one of its floating
  outputs. An edge carries a gradient when its consumer runs backward, its producer requires a gradient
  and the tensor is floating point. A part's backward computes the gradients of exactly the inputs whose
  edges carry one (`GradFlow.grad_inputs`).
- **Exchanges.** For every edge (producer output -> consumer input) each consumer part reads the pieces
  of its input region from the producer parts that hold them: from every part when the producer holds
  partial sums (they are added, a gather-then-add: `EdgeStep.sums`), else from one part per piece (a
  replica on the same device first). Pieces between parts on one device are local. All the pieces of one
  edge that cross devices in one pass are ONE exchange among the devices that send or receive them (one
  all-to-all in the runtime, one exchange task in the simulator). Backward sends each piece's gradient
  back to the part it came from, again one exchange per edge; where a producer part receives overlapping
  gradients they are added (`EdgeStep.grad_sums`). Edges from sources make nothing: every device holds
  the batch and the buffers.
- **Gradient synchronization.** Parameters are identified by their fully qualified name, so ops that share
  a weight share its shards: a device holds each (parameter, region) once. A shard held on several
  devices is all-reduced over exactly those devices (when a parameter's shards overlap without being
  equal, the whole parameter, or the whole block its ops use, is all-reduced over the union of their
  devices). Ops that share parameters form one *parameter unit* (`GradFlow.units`), lowered together
  (`lower_params`).
- **Buckets.** Parameters enter buckets in backward order (a parameter when its first user in forward
  order, whose backward finishes its gradient, is reached; an op's parameters all go into the bucket
  that is open when it is reached), and a bucket closes once it holds `TrainSetup.bucket_bytes` of
  full-size parameters (the first one at 1 MiB, `FIRST_BUCKET_BYTES`, as DDP's, or less if asked for),
  whatever the strategy, so that changing one op's config touches only its own bucket. One all-reduce per
  (bucket, device group), issued once the backward of its lowest-placed member op is done
  (`AllReduce.after`).
- **Optimizer.** Each device updates each shard it holds once, after its all-reduce; it keeps the
  parameter, its gradient and `TrainSetup.optimizer_state_copies` state tensors of the shard's size.
- **Frozen parameters** (`ParamSpec.trainable` False) get no gradient: no bucket, no all-reduce, no
  update, no gradient or optimizer state (a device keeps the shard alone, and its compute-dtype copy).
  An op none of whose parameters is trainable needs a backward only for its inputs' gradients (none in a
  frozen prefix of the model); its backward is still timed by its captured `bwd_flops`, which capture
  counts without the frozen parameters' gradients. Frozen parameters are not sharded
  (`soap.config.validate`).
- **Precision.** A step runs `run_graph(graph, setup)`: the graph with every float32 activation (op
  outputs, the float batch and constants included) in the setup's compute dtype, except the loss's and a
  router's (`topk` ops and the ops read only by them: a mixture of experts' scores, whose picks would flip
  where the compute dtype rounds two scores alike; the models compute them in float32 themselves), which
  compute from float32 inputs; the parameters stay float32 masters. Everything above reads that graph,
  so exchanges move and activations take compute-dtype bytes and the cost model times ops at the compute
  dtype's peak, while gradients, buckets, all-reduces and updates stay float32. Under mixed precision a
  device also keeps a compute-dtype copy of each shard it holds (what its ops compute with, saved for
  their backward).

- **Recomputation.** An op whose config recomputes keeps none of its outputs for backward: each device
  drops its part's outputs once its consumers' forwards have read them, and runs the part's forward again
  in backward, just before the backward of op `recompute_at(P)`: its own, or a recomputing consumer's
  recomputation point if that comes earlier in backward (so a chain of recomputing ops is recomputed from
  the last tensors kept, in forward order, at the same point on every device). What a part reads from other
  devices (received pieces, partial sums) is kept as for any op, so a recomputation moves nothing and
  issues no collective; a consumer that does not recompute keeps what it reads locally from a producer
  that does (`EdgeStep.kept_bytes`). The simulator charges the forward again in the part's backward task.
- **Sharded parameters.** Under `shard` S a parameter region that R parts of the op hold is held 1/S per
  device (flattened, padded to a multiple of S) by groups of S of those devices (`OpStep.shard_groups`:
  the sorted holders cut into consecutive runs of S). Each part all-gathers its op's regions in the
  compute dtype before its forward and again before its backward (one all-gather per part and pass over
  all its parameters; a recomputing part gathers once more for its recomputation), and reduce-scatters
  their gradient in the parameters' dtype after its backward; when S < R the
  chunks are then all-reduced among the devices holding the same chunk (a `SyncEntry` per chunk over
  that group, bucketed as any other). Only ops whose parameters no other op uses shard.

Memory of a device, over the step: what it keeps — the outputs of its parts (none where the kernel
returns views of its input, `OpDef.output_is_view`) and what their kernels save for backward besides
(`OpDef.saved_bytes`), the batch regions they read (activations kept for backward; none for recomputing
parts), the input pieces it receives and its partial-sum buffers, what it keeps of a recomputing
producer's output, the parameters, gradients and optimizer state of its shards (1/S of a sharded
region) — plus the largest transient of one part: what a recomputing part recomputes, the gathered
parameters of a sharded part and their gradient, and in backward the gradients of the part's float
outputs and of the inputs it reads. The kept sum is an upper bound (no liveness analysis) with one
exception, the rounds a schedule never holds at once: an op with n parts on a device whose order holds
at most f of them in flight (forward done, backward not; f < n only under 1F1B) keeps f / n of its
parts' activations and of what its input edges keep there (`flight_savings`). The transient is the peak
of one op at a time, as the runtime frees a part's transients before the next op's.

- **Rounds.** A config's devices may repeat: part c's *round* is one more than the round of the last
  earlier part on its device (0 for its device's first), and a chunk's (rule "Carries") at least one more
  than the round of the chunk it starts from, wherever that runs (`part_rounds`). Without chunks that is
  how many earlier parts run on its device; with chunks a device's rounds may have gaps (chunks 0..3
  alternating devices 0, 1, 0, 1 run in rounds 0..3, device 0 in rounds 0 and 2), and every round
  0..n-1 of the op holds some part. The parts of one round run on distinct devices and a device runs its
  parts one after another (a sample split with repeated devices is micro-batching). Parts on one device share
  the device's parameter shards: their gradients add up locally, and the all-reduce groups are over
  distinct devices. An edge's moving pieces make one exchange per consumer round (`EdgeStep.exchanges`),
  so round r of a consumer waits only for the producer parts it reads. Repeated devices are refused with
  `shard` > 1 and for ops with running statistics (`soap.config.validate`); a recomputing part runs
  again just before its own round's backward (the recomputation rule, per part).
- **Order.** A step is one global order of items (phase, op position, round), forward and backward
  (`StepPlan.order`, `step_order`), a topological order of their dependencies: a round's forward after
  the producer rounds it reads pieces of and after the op's previous round; a round's backward after its
  forward and after the backward of the consumer rounds that read it. Without repeated devices it is the
  graph order forward, then its reverse (the ops that run a backward). With them, the setup's schedule
  (`TrainSetup.schedule`) picks it:
  - ``gpipe``: every forward, then every backward. The forward takes first, among the rounds ready, the one
    that ends earliest in its op (round r of R ends at (r + 1) / R), then the lowest op position:
    micro-batch after micro-batch through the ops; the backward is its reverse (the last micro-batch's
    first). A device keeps every round's activations until the backward.
  - ``1f1b``: a list schedule on a rough clock (an item lasts its share of its op's FLOPs and memory
    traffic): whenever a device is idle it starts, among the items ready, first those of the rounds it
    has begun (backward, then forward: a round's pass through a stage runs whole), then a new round's
    forward while the device holds fewer of its op's rounds in flight (forward started, backward not
    done) than its cap: one more than the pipeline stages after it (`pipeline_caps`; a stage boundary is
    an edge between ops on different device sets), then a new round's backward, but below the cap only
    once every forward of the op has started there (earliest round first; forwards by the lowest op,
    backwards by the op nearest the loss). On a P-stage pipeline that is 1F1B whatever the stages'
    times: stage s warms up with P - s forwards, then alternates one backward and one forward, then
    cools down, holding at most P - s micro-batches in flight. Should these rules leave nothing to run,
    the first ready item runs anyway (a forward if any). The order is that of the starts, except for a
    backward whose gradients go to other devices (`_place_exchanges`): an exchange sits in the order of
    all its devices and a receiver's next item waits for it, so the backward goes, for each receiver,
    after the pass (its run of items of one phase and round: a micro-batch's forward or backward through
    a stage) that the receiver is in when the clock has the backward end, before its next pass, where
    1F1B receives it. At its start, the receiver would wait out the whole backward in the middle of
    another micro-batch's forward.
  Every rank walks the same order and takes part in the exchanges of each round as it comes, so the ranks
  issue their collectives in one consistent order and a device two stages apart from another works on an
  earlier micro-batch while it works on a later one.
- **Carries.** A split of an op's carried dim (`soap.opdef.DimSpec.carried`: the time axis of an LSTM)
  makes chunks: part c starts from the final state of part `OpStep.carry_from[c]`, the chunk before it
  (None for a first chunk). Chunk k runs in a later round than chunk k-1 (rule "Rounds"), so after it in
  the step's order (`carry_order`), and its backward before chunk k-1's (under 1F1B too), whose final
  state then receives the gradient of chunk k's initial state. On one device the state moves nothing.
  On another device it is a transfer (`OpStep.carry_moves`): at chunk k's forward item, after the
  exchanges of its input edges, ONE exchange between the two devices moves the state's bytes
  (`OpDef.carry_bytes`) from chunk k-1's device to chunk k's (one all-to-all in the runtime, one transfer
  task in the simulator); at chunk k's backward item, after its input edges' gradients, one exchange
  moves the gradient of that state back. Every rank walks the order, so both ends issue it at the same
  position; a rank holding neither end does nothing. A chunk keeps its initial state for backward
  (`OpDef.carry_bytes`, counted in its activation bytes; a recomputing chunk keeps the state it received
  from another device, so its recomputation moves nothing). Layers of a stacked recurrence placed on
  different devices, each in chunks, make FlexFlow's wavefront: the step's order runs layer 2's chunk k
  while layer 1 runs chunk k+1; one layer's chunks on different devices hand the state from one to the
  next.
- **Replicas.** `lower(..., replicas=Replicas(count=R, size=m))` lowers only replica 0 of a strategy
  that repeats itself R times (`find_replicas`): every op that computes splits its sample dim outermost
  into a multiple of R chunks, and the parts of replica g are those of replica 0 on devices shifted by
  g x m (devices 0..m-1 hold replica 0). Replica g then computes what replica 0 computes on its own share
  of the batch: the plan keeps replica 0's parts, the exchanges among them and the updates and memory of
  its devices, with every parameter group (all-reduce, shard and cross groups) over the holders of all
  replicas. An exchange that would read another replica's parts raises `NotReplicable`. The simulator
  times such a plan exactly where no two replicas' exchanges share a link (`simulator.engine.simulate`).

Regions are in global tensor coordinates, half-open; device `d` is rank `d` of the runtime. Pure Python
with numpy: must not import torch, the simulator, the search or the runtime.
"""

from __future__ import annotations

import bisect
import copy
import dataclasses
import heapq
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from math import gcd

import numpy as np

from soap.config import ParallelConfig, param_keys, param_pieces, parts
from soap.graph import DTYPE_BYTES, Operator, OperatorGraph, TensorRef
from soap.opdef import DimKind, Region, carry_sources, intersect, region_numel
from soap.registry import dims_of, op_def
from soap.setup import TrainSetup
from soap.strategy import Strategy

FLOAT_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16"})
# The first gradient bucket closes at 1 MiB, as DDP's does, so that the reduction of the last layers'
# gradients starts early instead of waiting for a full bucket; the later ones at `TrainSetup.bucket_mb`.
FIRST_BUCKET_BYTES = 2**20

# The kinds of collective a step issues, as `StepPlan.collectives` and the runtime report them.
ALL_TO_ALL = "all_to_all"
ALL_REDUCE = "all_reduce"
ALL_GATHER = "all_gather"
REDUCE_SCATTER = "reduce_scatter"


class NotReplicable(ValueError):
    """A strategy lowered by replicas reads, in some exchange, parts of another replica."""


@dataclasses.dataclass(frozen=True, slots=True)
class Replicas:
    """`count` copies of one replica of `size` devices (module docstring): replica g is devices
    g x size .. (g + 1) x size - 1."""

    count: int
    size: int

    def expand(self, devices) -> tuple[int, ...]:
        """The devices of every replica that correspond to `devices` of replica 0, sorted."""
        return tuple(sorted(d + g * self.size for g in range(self.count) for d in devices))

    def spread(self, per_device: Sequence) -> list:
        """A per-device list whose entries for replica 0 are right, with every device given its
        counterpart's entry in replica 0."""
        return [per_device[d % self.size] for d in range(self.count * self.size)]


def find_replicas(graph: OperatorGraph, strategy: Strategy, num_devices: int) -> Replicas | None:
    """The largest `Replicas` that `strategy` is (module docstring), None when it is not one of two or
    more: every op that computes splits a dim of kind sample that comes first among its split dims, its
    part p + g x (parts / R) runs on device(p) + g x (devices / R) and replica 0 runs on devices below
    devices / R (`repeats`)."""
    count = 0
    ops = []
    for op in graph:
        if op_def(op.kind).everywhere:
            continue
        cfg = strategy[op.name]
        first = _first_split(op, cfg)
        if first is None:
            return None
        count = gcd(count, cfg.degree(first.name))
        ops.append((op, cfg))
    for r in range(count, 1, -1):  # every divisor of the common count, the largest first
        if count % r == 0 and num_devices % r == 0:
            replicas = Replicas(count=r, size=num_devices // r)
            if all(repeats(op, cfg, replicas) for op, cfg in ops):
                return replicas
    return None


def repeats(op: Operator, cfg: ParallelConfig, replicas: Replicas) -> bool:
    """Whether `cfg` lays `op` out as `replicas` (module docstring): its first split dim is of kind sample,
    split evenly into a multiple of `replicas.count` chunks, part p + g x (parts / R) runs on
    device(p) + g x size, replica 0 on devices below size, and, where it shards its parameters, every
    chunk's all-reduce has a device in replica 0."""
    first = _first_split(op, cfg)
    if first is None or cfg.degree(first.name) % replicas.count:
        return False
    devices = cfg.devices
    per = len(devices) // replicas.count
    head = devices[:per]
    if not (all(d < replicas.size for d in head) and all(
            devices[g * per + p] == head[p] + g * replicas.size for g in range(1, replicas.count) for p in range(per))):
        return False
    if cfg.shard == 1 or not op.params:
        return True
    holders: dict[tuple, list[int]] = {}
    for box, d in parts(op, cfg, per):
        holders.setdefault(param_keys(op, box), []).append(d)
    return not _orphan_chunks([replicas.expand(v) for v in holders.values()], cfg.shard, replicas)


def _orphan_chunks(holders, shard: int, replicas: Replicas) -> bool:
    """Whether, among the holders (every replica's, sorted) of each parameter region sharded over `shard`
    of them, some chunk's all-reduce among its holders (a cross group) has no device in replica 0, which
    replica 0's plan would leave out."""
    return any(len(v[r::shard]) > 1 and all(d >= replicas.size for d in v[r::shard])
               for v in holders for r in range(shard))


def _first_split(op: Operator, cfg: ParallelConfig):
    """The op's first dim that `cfg` splits where it is of kind sample and split evenly, else None
    (uneven sample chunks make replicas of different sizes)."""
    split = [d for d in dims_of(op) if cfg.degree(d.name) > 1]
    if not split or split[0].kind != DimKind.SAMPLE or split[0].size % cfg.degree(split[0].name):
        return None
    return split[0]


class Edge:
    """One use of output `out` of op `src` by input `slot` of op `dst` (op positions in the graph).

    `use` numbers the uses of `src`'s outputs (the graph's consumer order); `grad` says a gradient flows
    back along it; `elem` is the tensor's element size in bytes."""

    __slots__ = ("id", "src", "out", "dst", "slot", "use", "grad", "elem", "ref")

    def __init__(self, id: int, src: int, out: int, dst: int, slot: int, use: int, grad: bool, elem: int,
                 ref: TensorRef):
        self.id, self.src, self.out, self.dst, self.slot, self.use = id, src, out, dst, slot, use
        self.grad, self.elem, self.ref = grad, elem, ref


class GradFlow:
    """What a step needs to know about a graph whatever the strategy (the module docstring's rules).

    Per op position i: `everywhere[i]`, `requires_grad[i]`, `needs_bwd[i]`, `grad_inputs[i]` (one flag per
    input), `in_edges[i]` and `out_edges[i]` (edge ids; edges from sources are not edges),
    `slot_edges[i]` (per input slot its edge id, None for a source), `unit[i]`
    (its parameter unit, -1 without parameters). Per unit u: `units[u]` (op positions, ascending),
    `unit_fqns[u]` (its parameters' `ParamSpec.key`s: an fqn, or an fqn and a block), `unit_first[u]` (its
    lowest op position). Per parameter key: `param_bucket[key]` (None when it gets no gradient) and
    `first_user[key]`; `frozen`, the keys of frozen parameters (`ParamSpec.trainable` False). Per bucket b:
    `bucket_first_op[b]` (the lowest first-user position in it: its backward ends the bucket).
    """

    def __init__(self, graph: OperatorGraph, setup: TrainSetup):
        self.source = graph
        graph = self.graph = run_graph(graph, setup)
        self.setup = setup
        ops = self.ops = graph.ops
        n = self.num_ops = len(ops)
        self.index = {op.name: i for i, op in enumerate(ops)}
        self.everywhere = [op_def(op.kind).everywhere for op in ops]
        tensor_float = [[spec.dtype in FLOAT_DTYPES for spec in op.outputs] for op in ops]
        requires = [False] * n
        for i, op in enumerate(ops):
            if not self.everywhere[i]:
                requires[i] = any(p.trainable for p in op.params.values()) or any(
                    requires[self.index[r.op]] and tensor_float[self.index[r.op]][r.index] for r in op.inputs)
        self.requires_grad = requires
        uses = {op.name: graph.consumers(op.name) for op in ops}
        needs = [False] * n
        for i in range(n - 1, -1, -1):
            if requires[i]:
                needs[i] = i == n - 1 or any(needs[self.index[c]] and tensor_float[i][o]
                                             for c, _, o in uses[ops[i].name])
        self.needs_bwd = needs
        self.edges: list[Edge] = []
        self.in_edges: list[list[int]] = [[] for _ in range(n)]
        self.out_edges: list[list[int]] = [[] for _ in range(n)]
        grad_inputs = []
        self.slot_edges: list[list[int | None]] = []
        for k, op in enumerate(ops):
            flags = []
            self.slot_edges.append([])
            for slot, ref in enumerate(op.inputs):
                j = self.index[ref.op]
                grad = needs[k] and requires[j] and tensor_float[j][ref.index]
                flags.append(grad)
                if self.everywhere[j]:
                    self.slot_edges[k].append(None)
                    continue  # sources exist on every device: no transfer, no dependency
                use = uses[ref.op].index((op.name, slot, ref.index))
                e = Edge(len(self.edges), j, ref.index, k, slot, use, grad,
                         DTYPE_BYTES[ops[j].outputs[ref.index].dtype], ref)
                self.edges.append(e)
                self.slot_edges[k].append(e.id)
                self.in_edges[k].append(e.id)
                self.out_edges[j].append(e.id)
            grad_inputs.append(tuple(flags))
        self.grad_inputs = grad_inputs
        self._units(ops)
        self._buckets(setup.bucket_bytes)
        self.op_class, self.edge_class = self._copy_classes()

    def _copy_classes(self) -> tuple[list[int], list[int]]:
        """Per op position and per edge, a class. Two ops of one class are the same computation at the same
        kind of place in the step: kind, attributes, input tensors (and whether each comes from the batch),
        output tensors, parameters (shapes, dtypes, blocks, which of them share a name), FLOPs and bytes, and
        the gradient flags; so `lower_op` lowers them alike under any config (but for `OpStep.op`) and a
        cost model that prices by computation prices them alike (the copies of a repeated block). Two
        edges of one class carry the same output of ops of one class into the same input slot of ops of
        one class, so `lower_edge` lowers them alike (but for `EdgeStep.edge`)."""
        found: dict[tuple, int] = {}
        op_class = []
        for i, op in enumerate(self.ops):
            fqns = [spec.fqn for spec in op.params.values()]
            inputs = tuple((self.ops[self.index[r.op]].outputs[r.index], self.ops[self.index[r.op]].kind == "input")
                           for r in op.inputs)
            params = tuple((k, spec.shape, spec.dtype, spec.offset, spec.whole_shape, fqns.index(spec.fqn),
                            spec.trainable) for k, spec in op.params.items())
            key = (op.kind, repr(sorted(op.attrs.items())), inputs, tuple(op.outputs), params, op.fwd_flops,
                   op.bwd_flops, op.fwd_bytes, op.bwd_bytes, self.everywhere[i], self.requires_grad[i],
                   self.needs_bwd[i], tuple(self.grad_inputs[i]))
            op_class.append(found.setdefault(key, len(found)))
        edges: dict[tuple, int] = {}
        edge_class = [edges.setdefault((op_class[e.src], op_class[e.dst], e.out, e.slot, e.grad, e.elem), len(edges))
                      for e in self.edges]
        return op_class, edge_class

    def _units(self, ops) -> None:
        """Parameter units: connected components of ops that share a parameter (union-find)."""
        parent = list(range(len(ops)))

        def find(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        owner: dict[str, int] = {}
        self.param_bytes: dict[str, int] = {}
        self.first_user: dict[str, int] = {}
        for i, op in enumerate(ops):
            for spec in op.params.values():
                self.param_bytes[spec.key] = spec.nbytes
                self.first_user.setdefault(spec.key, i)
                if spec.key in owner:
                    a, b = find(owner[spec.key]), find(i)
                    parent[max(a, b)] = min(a, b)
                else:
                    owner[spec.key] = i
        roots: dict[int, int] = {}
        self.unit = [-1] * len(ops)
        self.units: list[tuple[int, ...]] = []
        for i, op in enumerate(ops):
            if op.params:
                r = find(i)
                if r not in roots:
                    roots[r] = len(self.units)
                    self.units.append(())
                u = self.unit[i] = roots[r]
                self.units[u] = (*self.units[u], i)
        self.unit_first = [members[0] for members in self.units]
        self.unit_fqns = [tuple(dict.fromkeys(p.key for i in members for p in ops[i].params.values()))
                          for members in self.units]

    def _buckets(self, cap: int) -> None:
        users: dict[str, list[int]] = {}
        self.frozen = {spec.key for op in self.ops for spec in op.params.values() if not spec.trainable}
        for i, op in enumerate(self.ops):
            for spec in op.params.values():
                users.setdefault(spec.key, []).append(i)
        self.param_bucket: dict[str, int | None] = {}
        first_op: list[int] = []
        filled = 0  # bytes in the open bucket
        limit = min(FIRST_BUCKET_BYTES, cap)
        for i in range(self.num_ops - 1, -1, -1):
            mine = [f for f in dict.fromkeys(p.key for p in self.ops[i].params.values()) if self.first_user[f] == i]
            # no gradient reaches a frozen parameter, nor one none of whose users runs backward: nothing to
            # synchronize or update
            live = [f for f in mine if f not in self.frozen and any(self.needs_bwd[u] for u in users[f])]
            self.param_bucket.update(dict.fromkeys(mine))
            if not live:
                continue
            # an op's parameters go into one bucket, so each bucket's lowest op is its own
            if not first_op or filled >= limit:
                if first_op:
                    limit = cap
                first_op.append(i)
                filled = 0
            first_op[-1] = i
            for f in live:
                self.param_bucket[f] = len(first_op) - 1
                filled += self.param_bytes[f]
        self.bucket_first_op = first_op


def _regions(rows: list, num_parts: int, ndim: int) -> np.ndarray:
    return np.asarray(rows, dtype=np.int64).reshape(num_parts, ndim, 2)


def _overlap_matrix(regions: np.ndarray) -> np.ndarray:
    """(P, P) bool: do the regions of parts p1 != p2 overlap (diagonal False)."""
    lo = np.maximum(regions[:, None, :, 0], regions[None, :, :, 0])
    hi = np.minimum(regions[:, None, :, 1], regions[None, :, :, 1])
    nonempty = (regions[:, :, 1] > regions[:, :, 0]).all(axis=1)
    out = (hi > lo).all(axis=2) & nonempty[:, None] & nonempty[None, :]
    np.fill_diagonal(out, False)
    return out


def run_graph(graph: OperatorGraph, setup: TrainSetup) -> OperatorGraph:
    """`graph` as a step under `setup` runs it (the module docstring's precision rule): `graph` itself
    under fp32, else a copy whose float32 op outputs are in the compute dtype but those of `full_precision`."""
    dtype = setup.compute_dtype
    if dtype == "float32":
        return graph
    kept = full_precision(graph)
    ops = [op if op.name in kept or not any(t.dtype == "float32" for t in op.outputs) else dataclasses.replace(
        op, outputs=tuple(dataclasses.replace(t, dtype=dtype) if t.dtype == "float32" else t for t in op.outputs))
        for op in graph.ops]
    return OperatorGraph(ops, name=graph.name, batch_size=graph.batch_size)


def full_precision(graph: OperatorGraph) -> set[str]:
    """The ops that compute in float32 under mixed precision (the module docstring's precision rule): the
    loss (the last op), every `topk` and every op whose outputs only `topk` ops read."""
    kept = {graph.ops[-1].name} if graph.ops else set()
    for op in graph.ops:
        readers = graph.consumers(op.name)
        if op.kind == "topk" or (readers and all(graph[name].kind == "topk" for name, _, _ in readers)):
            kept.add(op.name)
    return kept


def recompute_points(flow: GradFlow, recompute: Sequence[bool]) -> list[int | None]:
    """Per op position P, the op position before whose backward P is recomputed (the module docstring's
    rule; None: P does not recompute, or nothing needs its recomputation), given each op's flag."""
    at: list[int | None] = [None] * flow.num_ops
    for i in range(flow.num_ops - 1, -1, -1):
        if not recompute[i]:
            continue
        points = [i] if flow.needs_bwd[i] else []
        points += [at[flow.edges[e].dst] for e in flow.out_edges[i] if at[flow.edges[e].dst] is not None]
        at[i] = max(points) if points else None
    return at


class OpStep:
    """One op under one config: its parts and what each reads and holds.

    `devices[c]` and `boxes[c]` per part c; `out_regions[o]` and `in_regions[s]` are (parts, axes, 2)
    arrays of output o's and input slot s's regions (an input a part does not read is an empty region;
    `reads[s][c]` is its region or None); `reduced`: the parts hold partial sums; `runs_bwd`: the parts
    run a backward; `activation_bytes[c]`: what part c keeps for backward (its outputs, unless it
    recomputes, and the batch regions it reads); `recompute` and `shard`: the config's; under `shard` > 1
    `shard_groups[c]` and `cross_groups[c]` are part c's shard group and the devices holding the same
    chunk as its device (module docstring), else None; `gather_bytes[c]` and `scatter_bytes[c]`: the
    buffer bytes of part c's all-gather (each pass) and reduce-scatter (0 when none);
    `transient_bytes[c]`: what part c holds only while it runs (recomputed outputs, gathered parameters
    and their gradient); `carry_from[c]`: the part whose final state part c starts from (module
    docstring, "Carries"; None: it starts from zeros); `carry_moves`: (chunk, the part it starts from,
    bytes of the state) per chunk whose source runs on another device, in part order: the state moves in
    the chunk's forward item and its gradient back in its backward item.
    """

    __slots__ = ("op", "devices", "boxes", "rounds", "num_rounds", "carry_from", "carry_moves", "out_regions",
                 "in_regions", "reads",
                 "reduced", "runs_bwd", "activation_bytes", "recompute", "shard", "shard_groups", "cross_groups",
                 "gather_bytes", "scatter_bytes", "transient_bytes", "_in_overlap", "_out_overlap")

    def __init__(self) -> None:
        self._in_overlap: dict[int, np.ndarray] = {}
        self._out_overlap: dict[int, bool] = {}

    @property
    def num_parts(self) -> int:
        return len(self.devices)

    def for_op(self, i: int) -> OpStep:
        """This lowering as op position `i`'s (an op of the same `GradFlow.op_class`): a shallow copy."""
        twin = copy.copy(self)
        twin.op = i
        return twin

    def input_overlap(self, slot: int) -> np.ndarray:
        """(P, P) bool: do parts' regions of input `slot` overlap."""
        found = self._in_overlap.get(slot)
        if found is None:
            found = self._in_overlap[slot] = _overlap_matrix(self.in_regions[slot])
        return found

    def outputs_overlap(self, index: int) -> bool:
        """Whether two parts' regions of output `index` overlap (replicas, or partial sums)."""
        found = self._out_overlap.get(index)
        if found is None:
            found = self._out_overlap[index] = bool(_overlap_matrix(self.out_regions[index]).any())
        return found

    def parts_on(self, device: int) -> list[int]:
        """The parts that run on `device`, in part order (= round order; none, one, or one per round)."""
        return [c for c, d in enumerate(self.devices) if d == device]

    def part_on(self, device: int) -> int | None:
        """The one part that runs on `device`, if any (for ops whose devices do not repeat)."""
        found = self.parts_on(device)
        assert len(found) <= 1, f"op position {self.op}: {len(found)} parts on device {device}"
        return found[0] if found else None

    def round_parts(self, r: int) -> list[int]:
        """The parts of round `r` (on distinct devices), in part order."""
        return [c for c, k in enumerate(self.rounds) if k == r]


def part_rounds(devices: Sequence[int], carry_from: Sequence[int | None] | None = None) -> tuple[int, ...]:
    """Per part, its round (module docstring, "Rounds"): one more than the round of the last earlier part
    on its device (0 for the first), and, for a chunk, at least one more than the round of the chunk it
    starts from (`carry_from[c]`, an earlier part). Without chunks: how many earlier parts run on the same
    device."""
    last: dict[int, int] = {}
    out: list[int] = []
    for c, d in enumerate(devices):
        r = last.get(d, -1) + 1
        prev = carry_from[c] if carry_from is not None else None
        if prev is not None:
            r = max(r, out[prev] + 1)
        out.append(r)
        last[d] = r
    return tuple(out)


def lower_op(flow: GradFlow, i: int, cfg: ParallelConfig, replicas: Replicas | None = None) -> OpStep:
    op = flow.ops[i]
    entry = op_def(op.kind)
    step = OpStep()
    step.op = i
    keep = None if replicas is None or flow.everywhere[i] else cfg.num_parts // replicas.count
    boxes_devices = parts(op, cfg, keep)
    boxes = step.boxes = tuple(b for b, _ in boxes_devices)
    step.devices = cfg.devices if keep is None else cfg.devices[:keep]
    step.carry_from = carry_sources(entry.dims(op), cfg.degrees)[:len(boxes)]
    step.rounds = part_rounds(step.devices, step.carry_from)
    step.num_rounds = max(step.rounds) + 1
    step.carry_moves = tuple((c, p, entry.carry_bytes(op, boxes[c])) for c, p in enumerate(step.carry_from)
                             if p is not None and step.devices[p] != step.devices[c])
    n = len(boxes)
    step.out_regions = [_regions([entry.output_region(op, b, o) for b in boxes], n, spec.ndim)
                        for o, spec in enumerate(op.outputs)]
    slots = len(op.inputs)
    reads: list[list[Region | None]] = [[] for _ in range(slots)]
    rows: list[list] = [[] for _ in range(slots)]
    for b in boxes:
        regions = entry.input_regions(op, b)
        for s in range(slots):
            r = regions[s] if s < len(regions) else None
            r = None if r is None else tuple((int(lo), int(hi)) for lo, hi in r)
            ndim = len(op.attrs["input_shapes"][s]) if "input_shapes" in op.attrs else len(r or ())
            reads[s].append(r)
            rows[s].append(r if r is not None else ((0, 0),) * ndim)
    step.reads = tuple(tuple(r) for r in reads)
    step.in_regions = [_regions(rows[s], n, len(rows[s][0]) if rows[s] else 0) for s in range(slots)]
    flags = [entry.reduced(op, b) for b in boxes]
    assert all(flags) == any(flags), f"{op.name}: some parts hold partial sums and some do not"
    step.reduced = flags[0] if flags else False
    step.runs_bwd = flow.needs_bwd[i]
    step.recompute = cfg.recompute
    step.shard = cfg.shard
    act = [0] * n
    transient = [0] * n
    if not flow.everywhere[i]:
        view = entry.output_is_view(op)
        in_items = [DTYPE_BYTES[flow.ops[flow.index[ref.op]].outputs[ref.index].dtype] for ref in op.inputs]
        for c, b in enumerate(boxes):
            out_bytes = [region_numel(entry.output_region(op, b, o)) * DTYPE_BYTES[spec.dtype]
                         for o, spec in enumerate(op.outputs)]
            kept = (0 if view else sum(out_bytes)) + entry.saved_bytes(op, b)
            if step.carry_from[c] is not None:
                kept += entry.carry_bytes(op, b)  # its initial state, the chunk before's final one
            if cfg.recompute:
                transient[c] = kept
                if step.carry_from[c] is not None and step.devices[step.carry_from[c]] != step.devices[c]:
                    act[c] = entry.carry_bytes(op, b)  # received: kept for the recomputation
            else:
                act[c] = kept
            if step.runs_bwd:
                # its backward holds the gradients of its float outputs and of the inputs it reads
                transient[c] += sum(nb for nb, spec in zip(out_bytes, op.outputs, strict=True)
                                    if spec.dtype in FLOAT_DTYPES)
                transient[c] += sum(region_numel(rows[s][c]) * in_items[s]
                                    for s, grad in enumerate(flow.grad_inputs[i]) if grad)
        for s, ref in enumerate(op.inputs):
            # The batch moves nothing, but each device's loader holds what it reads.
            src = flow.ops[flow.index[ref.op]]
            if src.kind == "input":
                for c, r in enumerate(rows[s]):
                    act[c] += region_numel(r) * in_items[s]
    step.activation_bytes = tuple(act)
    _lower_shards(flow, op, step, cfg.shard, replicas)
    step.transient_bytes = tuple(t + g + r for t, g, r in zip(transient, step.gather_bytes, step.scatter_bytes,
                                                             strict=True))
    return step


def chunk_numel(numel: int, shard: int) -> int:
    """Elements of one device's chunk of a region of `numel` elements sharded over `shard` devices."""
    return -(-numel // shard)


def _lower_shards(flow: GradFlow, op, step: OpStep, shard: int, replicas: Replicas | None = None) -> None:
    """The shard groups, cross groups and collective bytes of `step` (module docstring)."""
    n = step.num_parts
    step.shard_groups = step.cross_groups = None
    step.gather_bytes = step.scatter_bytes = (0,) * n
    if shard == 1 or not op.params:
        return
    keys = [param_keys(op, b) for b in step.boxes]
    holders: dict[tuple, list[int]] = {}
    for k, d in zip(keys, step.devices, strict=True):
        holders.setdefault(k, []).append(d)
    if replicas is not None:
        holders = {k: list(replicas.expand(v)) for k, v in holders.items()}
        if _orphan_chunks(holders.values(), shard, replicas):
            raise NotReplicable(f"{op.name}: a chunk held by no device of replica 0")
    shard_groups, cross_groups, gather, scatter = [], [], [], []
    compute = DTYPE_BYTES[flow.setup.compute_dtype]
    specs = {p.fqn: p for p in op.params.values()}
    # per parameter, bytes per element as gathered (the compute dtype for float ones) and as reduced
    gathered = {f: compute if p.dtype in FLOAT_DTYPES else DTYPE_BYTES[p.dtype] for f, p in specs.items()}
    for k, d in zip(keys, step.devices, strict=True):
        group = sorted(holders[k])
        j = group.index(d)
        start = j - j % shard
        shard_groups.append(tuple(group[start:start + shard]))
        cross_groups.append(tuple(group[j % shard::shard]))
        padded = [(f, shard * chunk_numel(region_numel(region), shard)) for f, region in k]
        gather.append(sum(m * gathered[f] for f, m in padded))
        scatter.append(sum(m * DTYPE_BYTES[specs[f].dtype] for f, m in padded) if step.runs_bwd else 0)
    step.shard_groups, step.cross_groups = tuple(shard_groups), tuple(cross_groups)
    step.gather_bytes, step.scatter_bytes = tuple(gather), tuple(scatter)


class EdgeStep:
    """One edge under (producer config, consumer config).

    `pieces`: (producer part, consumer part, bytes, region) for every piece a consumer part reads (local and
    moving alike; region in the tensor's global coordinates); `round_pairs` the sorted (producer round,
    consumer round) pairs of those pieces (the step's order: a consumer round after each). `moving` lists the
    pieces that cross devices, as indices into `pieces`; `exchanges` lists the edge's exchanges, one per
    consumer round that receives a moving piece: (round, sorted devices that send or receive its pieces,
    indices into `pieces` of its moving pieces); `receivers` per exchange (the devices of its consumer parts,
    those of its producer parts): who receives in its forward and in its gradient; `ranks` is the sorted union
    of their devices (empty: nothing moves). `sums` lists (consumer part, contributions, bytes of its input
    region) where a consumer adds two or more partial sums; `grad_sums` (producer part, contributions, bytes
    of its output region) where a producer part adds overlapping gradients. `recv_bytes` maps a device to the
    bytes it receives and adds up; `kept_bytes` maps a device to the bytes a consumer part that does not
    recompute keeps of a recomputing producer's output it reads locally; `mem_bytes` is their sum per device
    (the edge's memory); `moved_bytes` counts bytes crossing devices, both passes.
    """

    __slots__ = ("edge", "pieces", "moving", "exchanges", "ranks", "sums", "grad_sums", "recv_bytes",
                 "kept_bytes", "mem_bytes", "moved_bytes", "reduced", "grad", "round_pairs", "receivers")

    def for_edge(self, eid: int) -> EdgeStep:
        """This lowering as edge `eid`'s (an edge of the same `GradFlow.edge_class`): a shallow copy."""
        twin = copy.copy(self)
        twin.edge = eid
        return twin


def _piece_pairs(prod: OpStep, cons: OpStep, out: np.ndarray, inp: np.ndarray, same: bool
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every (producer part, consumer part) whose regions intersect: part arrays, lo and hi arrays."""
    if same:
        k = np.arange(cons.num_parts)
        nonempty = (inp[:, :, 1] > inp[:, :, 0]).all(axis=1) if inp.shape[1] else np.ones(len(k), bool)
        k = k[nonempty]
        return k, k, inp[k, :, 0], inp[k, :, 1]
    lo = np.maximum(out[:, None, :, 0], inp[None, :, :, 0])
    hi = np.minimum(out[:, None, :, 1], inp[None, :, :, 1])
    hit = (hi > lo).all(axis=2)
    if inp.shape[1]:
        hit &= (inp[None, :, :, 1] > inp[None, :, :, 0]).all(axis=2)
    ps, cs = np.nonzero(hit)
    return ps, cs, lo[ps, cs], hi[ps, cs]


def lower_edge(flow: GradFlow, eid: int, prod: OpStep, cons: OpStep, replicas: Replicas | None = None) -> EdgeStep:
    edge = flow.edges[eid]
    out = prod.out_regions[edge.out]
    inp = cons.in_regions[edge.slot]
    if replicas is not None and prod.reduced:
        _within_replica(flow, edge, prod, inp)
    step = EdgeStep()
    step.edge = eid
    step.reduced = prod.reduced
    step.grad = edge.grad
    pdev, cdev = prod.devices, cons.devices
    # part k reads exactly what part k holds, on its own device; not for partial sums, which every
    # consumer part reads from every producer part
    same = not prod.reduced and pdev == cdev and out.shape == inp.shape and np.array_equal(out, inp)
    ps, cs, lo, hi = _piece_pairs(prod, cons, out, inp, same)
    numel = (hi - lo).prod(axis=1) if lo.shape[1] else np.ones(len(ps), np.int64)
    ps_l, cs_l, numel_l = ps.tolist(), cs.tolist(), numel.tolist()
    # each piece's region, ((lo, hi) per axis): the pairs of one axis at a time, then across axes
    regions = (list(zip(*map(zip, lo.T.tolist(), hi.T.tolist()), strict=True)) if lo.shape[1]
               else [()] * len(ps_l))
    keep = range(len(ps_l))
    if not prod.reduced and not same and prod.outputs_overlap(edge.out):
        # Identical pieces of a value several parts hold (replicas, not partial sums): read one, a local
        # replica first. Its gradient goes back to that replica only; the replicas' other contributions
        # meet in the parameter all-reduce and the input gradients.
        chosen: dict[tuple[int, Region], int] = {}
        for k in keep:
            key = (cs_l[k], regions[k])
            j = chosen.get(key)
            if j is None or (pdev[ps_l[k]] == cdev[cs_l[k]] and pdev[ps_l[j]] != cdev[cs_l[j]]):
                chosen[key] = k
        keep = sorted(chosen.values())
    elem = edge.elem
    step.pieces = tuple((ps_l[k], cs_l[k], numel_l[k] * elem, regions[k]) for k in keep)
    if not prod.reduced:
        covered = [0] * cons.num_parts
        for _, c, nbytes, _ in step.pieces:
            covered[c] += nbytes
        want = np.clip(inp[:, :, 1] - inp[:, :, 0], 0, None).prod(axis=1) * elem if inp.shape[1] else None
        if replicas is not None and want is not None and covered != want.tolist():
            raise NotReplicable(f"{flow.ops[edge.dst].name} input {edge.slot} reads another replica's parts")
        assert want is None or covered == want.tolist(), (
            f"{flow.ops[edge.dst].name} input {edge.slot}: producer parts cover {covered} bytes of {want.tolist()}")
    step.moving = tuple(k for k, (p, c, _, _) in enumerate(step.pieces) if pdev[p] != cdev[c])
    pr, cr = prod.rounds, cons.rounds
    step.round_pairs = tuple(sorted({(pr[p], cr[c]) for p, c, _, _ in step.pieces}))
    recv: dict[int, int] = {}
    ranks: set[int] = set()
    moved = 0
    for k in step.moving:
        p, c, nbytes, _ = step.pieces[k]
        ranks.add(pdev[p])
        ranks.add(cdev[c])
        recv[cdev[c]] = recv.get(cdev[c], 0) + nbytes
        moved += nbytes
    step.ranks = tuple(sorted(ranks))
    by_round: dict[int, list[int]] = {}
    for k in step.moving:
        by_round.setdefault(cons.rounds[step.pieces[k][1]], []).append(k)
    groups = sorted(by_round.items())
    step.receivers = tuple((frozenset(cdev[step.pieces[k][1]] for k in ks),
                            frozenset(pdev[step.pieces[k][0]] for k in ks)) for _, ks in groups)
    step.exchanges = tuple((r, tuple(sorted(consumers | producers)), tuple(ks))
                           for (r, ks), (consumers, producers) in zip(groups, step.receivers, strict=True))
    sums = []
    if prod.reduced:
        counts: dict[int, int] = {}
        for _, c, _, _ in step.pieces:
            counts[c] = counts.get(c, 0) + 1
        inp_bytes = (np.clip(inp[:, :, 1] - inp[:, :, 0], 0, None).prod(axis=1) * elem).tolist()
        for c in sorted(counts):
            if counts[c] >= 2:
                sums.append((c, counts[c], inp_bytes[c]))
                recv[cdev[c]] = recv.get(cdev[c], 0) + inp_bytes[c]
    step.sums = tuple(sums)
    grad_sums = []
    if edge.grad:
        moved *= 2
        senders: dict[int, list[int]] = {}
        for p, c, _, _ in step.pieces:
            senders.setdefault(p, []).append(c)
        multi = [p for p in sorted(senders) if len(senders[p]) >= 2]
        if multi:
            overlap = cons.input_overlap(edge.slot)
            out_bytes = (np.clip(out[:, :, 1] - out[:, :, 0], 0, None).prod(axis=1) * elem).tolist()
            for p in multi:
                cs_p = senders[p]
                if overlap[np.ix_(cs_p, cs_p)].any():
                    grad_sums.append((p, len(cs_p), out_bytes[p]))
    step.grad_sums = tuple(grad_sums)
    step.recv_bytes = recv
    kept: dict[int, int] = {}
    if prod.recompute and not cons.recompute and cons.runs_bwd:
        moving_set = set(step.moving)
        for k, (_, c, nbytes, _) in enumerate(step.pieces):
            if k not in moving_set:
                kept[cdev[c]] = kept.get(cdev[c], 0) + nbytes
    step.kept_bytes = kept
    mem = dict(recv)
    for d, nbytes in kept.items():
        mem[d] = mem.get(d, 0) + nbytes
    step.mem_bytes = mem
    step.moved_bytes = moved
    return step


def _within_replica(flow: GradFlow, edge: Edge, prod: OpStep, inp: np.ndarray) -> None:
    """Raise `NotReplicable` unless replica 0's consumer parts read partial sums only from replica 0's
    producer parts: the producer's sample dim has an output axis and what they read along it lies within
    the range replica 0's producer parts cover (the other replicas' parts hold the ranges after it)."""
    op = flow.ops[edge.src]
    sample = next((d for d in dims_of(op) if d.kind == DimKind.SAMPLE and d.out_axis is not None), None)
    out = prod.out_regions[edge.out]
    if sample is None or not inp.shape[1]:
        raise NotReplicable(f"{op.name}: partial sums without a sample axis")
    a = sample.out_axis
    lo, hi = int(out[:, a, 0].min()), int(out[:, a, 1].max())
    reads = inp[:, a][inp[:, a, 1] > inp[:, a, 0]]
    if len(reads) and (int(reads[:, 0].min()) < lo or int(reads[:, 1].max()) > hi):
        raise NotReplicable(f"{flow.ops[edge.dst].name} reads partial sums of another replica")


class SyncEntry:
    """A parameter gradient to all-reduce: shard `region` of `fqn` over the sorted devices `group`, in
    bucket `bucket`; or, `region` None, the box `box` of `fqn` (the whole parameter, or the block the
    holders use), its shards overlapping without being equal, added up over the box. `holders` are the (op
    position, part) pairs whose backward contributes to it."""

    __slots__ = ("fqn", "region", "group", "bucket", "numel", "nbytes", "holders", "box")

    def __init__(self, fqn: str, region: Region | None, group: tuple[int, ...], bucket: int, numel: int,
                 nbytes: int, holders: tuple[tuple[int, int], ...], box: Region | None = None):
        self.fqn, self.region, self.group, self.bucket = fqn, region, group, bucket
        self.numel, self.nbytes, self.holders = numel, nbytes, holders
        self.box = box


class ParamStep:
    """The parameters of one unit under its ops' configs.

    `shards[(fqn, region)]`: the sorted devices holding it; `sync`: the `SyncEntry`s (groups of two or
    more devices, or an overlap to add up); `update_bytes[d]`: bytes of shards device d updates (shards
    that get a gradient); `memory_bytes[d]`: parameters, gradients and optimizer state it keeps.
    """

    __slots__ = ("unit", "shards", "sync", "update_bytes", "memory_bytes")


def _pairwise_equal_or_disjoint(regions: Sequence[Region]) -> bool:
    return all(a == b or intersect(a, b) is None for i, a in enumerate(regions) for b in regions[i + 1:])


def lower_params(flow: GradFlow, unit: int, steps: Mapping[int, OpStep], replicas: Replicas | None = None
                 ) -> ParamStep:
    """Lower unit `unit`'s parameters from its ops' `OpStep`s (`steps[i]` for every op i of the unit;
    under `replicas`, replica 0's, the holders of all replicas)."""
    out = ParamStep()
    out.unit = unit
    holders: dict[tuple[str, Region], list[tuple[int, int]]] = {}
    devices: dict[tuple[str, Region], set[int]] = {}
    specs = {}
    param_of: dict[tuple[str, Region], str] = {}  # piece -> the `ParamSpec.key` it belongs to
    for i in flow.units[unit]:
        op = flow.ops[i]
        step = steps[i]
        for c, (b, d) in enumerate(zip(step.boxes, step.devices, strict=True)):
            for name, key in param_pieces(op, b).items():
                spec = op.params[name]
                specs[spec.key] = spec
                param_of[key] = spec.key
                holders.setdefault(key, []).append((i, c))
                devices.setdefault(key, set()).add(d)
    out.shards = {k: replicas.expand(v) if replicas is not None else tuple(sorted(v))
                  for k, v in sorted(devices.items())}
    members = flow.units[unit]
    shard = steps[members[0]].shard if len(members) == 1 else 1
    assert shard == 1 or steps[members[0]].shard_groups is not None
    assert all(steps[i].shard == 1 for i in members) or len(members) == 1, "shared parameters do not shard"
    copies = flow.setup.optimizer_state_copies
    compute_itemsize = DTYPE_BYTES[flow.setup.compute_dtype]
    update: dict[int, int] = {}
    memory: dict[int, int] = {}
    sync: list[SyncEntry] = []
    for pkey in flow.unit_fqns[unit]:
        spec = specs[pkey]
        fqn = spec.fqn
        keys = [k for k in out.shards if param_of[k] == pkey]
        bucket = flow.param_bucket[pkey]
        itemsize = DTYPE_BYTES[spec.dtype]
        copy = compute_itemsize if spec.dtype != flow.setup.compute_dtype and spec.dtype in FLOAT_DTYPES else 0
        for key in keys:
            numel = chunk_numel(region_numel(key[1]), shard)
            nbytes = numel * itemsize
            for d in out.shards[key]:
                if replicas is not None and d >= replicas.size:
                    continue  # another replica's device: the same as its counterpart in replica 0
                memory[d] = memory.get(d, 0) + nbytes * (1 + (0 if bucket is None else 1 + copies)) + numel * copy
                if bucket is not None:
                    update[d] = update.get(d, 0) + nbytes
        if bucket is None:
            continue
        regions = [k[1] for k in keys]
        if shard > 1:
            # each chunk is all-reduced among the devices holding the same chunk (hybrid sharding)
            step = steps[members[0]]
            for key in keys:
                numel = chunk_numel(region_numel(key[1]), shard)
                cross = {step.cross_groups[c] for _, c in holders[key] if len(step.cross_groups[c]) > 1}
                for group in sorted(cross):
                    mine = tuple(sorted(h for h in holders[key] if step.devices[h[1]] in group))
                    sync.append(SyncEntry(fqn, key[1], group, bucket, numel, numel * itemsize, mine))
        elif _pairwise_equal_or_disjoint(regions):
            for key in keys:
                group = out.shards[key]
                if len(group) > 1:
                    numel = region_numel(key[1])
                    sync.append(SyncEntry(fqn, key[1], group, bucket, numel, numel * itemsize,
                                          tuple(sorted(holders[key]))))
        else:
            # Overlapping shards (a tied weight, or one block of a parameter, read whole by one op and split
            # by another): every holder contributes a gradient of the whole box, even two shards on one
            # device must see each other's.
            group = tuple(sorted(set().union(*(set(out.shards[k]) for k in keys))))
            numel = spec.numel
            sync.append(SyncEntry(fqn, None, group, bucket, numel, numel * itemsize,
                                  tuple(sorted({h for k in keys for h in holders[k]})), spec.box))
    out.sync = tuple(sync)
    out.update_bytes = update
    out.memory_bytes = memory
    return out


class AllReduce:
    """One all-reduce of a step: the `entries` of bucket `bucket` over devices `group`, `nbytes` in all,
    issued once the backward of op position `after` is done: of the ops holding any of them, the one whose
    backward (every round of it) completes last in the step's backward order."""

    __slots__ = ("bucket", "group", "entries", "nbytes", "after")

    def __init__(self, bucket: int, group: tuple[int, ...], entries: tuple[SyncEntry, ...], after: int):
        self.bucket, self.group, self.entries, self.after = bucket, group, entries, after
        self.nbytes = sum(e.nbytes for e in entries)


def all_reduces(entries: Sequence[SyncEntry], done_at: Sequence[int] | None = None) -> list[AllReduce]:
    """The step's all-reduces from its sync entries, in the order every member issues them: by the
    backward walk (when their `after` op's backward completes), then bucket, then group. `done_at[i]` is
    the position in the backward order at which op i's backward completes (`StepPlan.done_at`; by default
    the reverse graph order). An entry over one device (an overlap on one device) is an all-reduce over one
    device: no collective, its sum is local."""
    def done(i: int) -> int:
        return -i if done_at is None else done_at[i]

    grouped: dict[tuple[int, tuple[int, ...]], list[SyncEntry]] = {}
    for e in entries:
        grouped.setdefault((e.bucket, e.group), []).append(e)
    out = [AllReduce(b, g, tuple(es), max((i for e in es for i, _ in e.holders), key=lambda i: (done(i), -i)))
           for (b, g), es in grouped.items()]
    out.sort(key=lambda a: (done(a.after), a.bucket, a.group))
    return out


FORWARD, BACKWARD = 0, 1  # the phases of a step's order items (phase, op position, round)
Item = tuple[int, int, int]


def carry_order(ops: Sequence[OpStep], live: Sequence[int], after: dict[tuple[int, int], set[tuple[int, int]]]
                ) -> None:
    """Add to `after` (round -> the rounds that wait for it) that each chunk of an op runs after the chunk
    whose state it starts from (module docstring, "Carries"; its round is later, on any device)."""
    for i in live:
        step = ops[i]
        for c, prev in enumerate(step.carry_from):
            if prev is not None:
                after.setdefault((i, step.rounds[prev]), set()).add((i, step.rounds[c]))


def interleaves(setup: TrainSetup) -> bool:
    """Whether `setup`'s schedule may run some rounds' backward before other rounds' forward (1F1B); every
    other schedule runs every forward of a step before any backward, so its order saves nothing in flight
    (`flight_savings` is empty)."""
    return setup.schedule == "1f1b"


def step_order(flow: GradFlow, ops: Sequence[OpStep], edges: Sequence[EdgeStep]) -> tuple[Item, ...]:
    """The order of a step (module docstring, "Order"): (phase, op position, round) for the forward of every
    round of every op that is not a source and the backward of those that run one, under the setup's
    schedule."""
    live = [i for i in range(flow.num_ops) if not flow.everywhere[i]]
    if all(ops[i].num_rounds == 1 for i in live):
        fwd: list[tuple[int, int]] = [(i, 0) for i in live]
    else:
        after = _round_deps(flow, ops, edges, live)
        if interleaves(flow.setup):
            return _one_f_one_b(flow, ops, edges, live, after)
        fwd = _gpipe_forward(ops, live, after)
    return tuple((FORWARD, i, r) for i, r in fwd) + tuple(
        (BACKWARD, i, r) for i, r in reversed(fwd) if flow.needs_bwd[i])


def _gpipe_forward(ops: Sequence[OpStep], live: Sequence[int],
                   after: Mapping[tuple[int, int], set[tuple[int, int]]]) -> list[tuple[int, int]]:
    """GPipe's forward (module docstring, "Order"): a topological order of the rounds that takes first the
    ready round ending earliest in its op, then the lowest op position."""
    waiting: dict[tuple[int, int], int] = {}
    for succ in after.values():
        for n in succ:
            waiting[n] = waiting.get(n, 0) + 1

    share = _round_share(ops, live)

    def key(node: tuple[int, int]) -> tuple[int, int]:
        return share(*node), node[0]

    ready = [(key(n), n) for i in live for n in [(i, 0)] if not waiting.get(n)]
    heapq.heapify(ready)
    fwd = []
    while ready:
        _, node = heapq.heappop(ready)
        fwd.append(node)
        for n in after.get(node, ()):
            waiting[n] -= 1
            if not waiting[n]:
                heapq.heappush(ready, (key(n), n))
    assert len(fwd) == sum(ops[i].num_rounds for i in live), "the rounds of a step form a cycle"
    return fwd


def _round_share(ops: Sequence[OpStep], live: Sequence[int]):
    """(op, round) -> where the round ends in its op, (round + 1) / rounds, as an exact integer on a common
    scale (the least common multiple of the live ops' round counts): the orders compare these."""
    scale = math.lcm(*(ops[i].num_rounds for i in live)) if live else 1
    per = {n: scale // n for n in {ops[i].num_rounds for i in live}}
    return lambda i, r: (r + 1) * per[ops[i].num_rounds]


def _round_deps(flow: GradFlow, ops: Sequence[OpStep], edges: Sequence[EdgeStep], live: Sequence[int]
                ) -> dict[tuple[int, int], set[tuple[int, int]]]:
    """The forward dependencies between rounds, (op, round) -> the (op, round)s that need it: an edge's
    pieces, and the rounds of one op in turn."""
    after: dict[tuple[int, int], set[tuple[int, int]]] = {}
    for step in edges:
        e = flow.edges[step.edge]
        for p, c in step.round_pairs:
            after.setdefault((e.src, p), set()).add((e.dst, c))
    for i in live:
        for r in range(1, ops[i].num_rounds):
            after.setdefault((i, r - 1), set()).add((i, r))
    carry_order(ops, live, after)
    return after


def pipeline_caps(flow: GradFlow, ops: Sequence[OpStep], live: Sequence[int]) -> dict[int, int]:
    """Per device that runs an op in several rounds, how many of that op's rounds 1F1B lets it hold in
    flight: one more than its op's pipeline stages after it (the most over its ops), where a stage
    boundary is an edge between ops on different device sets (module docstring, "Order")."""
    devset = {i: frozenset(ops[i].devices) for i in live}
    depth: dict[int, int] = {}
    for i in reversed(live):
        depth[i] = max((depth[j] + (devset[j] != devset[i]) for j in (flow.edges[e].dst for e in flow.out_edges[i])
                        if j in depth), default=0)
    caps: dict[int, int] = {}
    for i in live:
        if ops[i].num_rounds > 1:
            for d in devset[i]:
                caps[d] = max(caps.get(d, 1), depth[i] + 1)
    return caps


# 1F1B's list schedule times an item by its op's FLOPs plus its memory traffic at this many FLOPs per byte
# (about the ridge point of a roofline) plus a fixed cost per part, split evenly over the op's parts: a
# rough clock, the same for every device kind, so the order runs a device's items about when its data
# arrives (the exchanges of a round sit in the order of both ends).
_RIDGE_FLOPS_PER_BYTE = 50.0
_PART_OVERHEAD_FLOPS = 1e6


def _one_f_one_b(flow: GradFlow, ops: Sequence[OpStep], edges: Sequence[EdgeStep], live: Sequence[int],
                 after: Mapping[tuple[int, int], set[tuple[int, int]]]) -> tuple[Item, ...]:
    """The 1F1B order (module docstring, "Order"): a list schedule on a rough clock (`_RIDGE_FLOPS_PER_BYTE`),
    then its items placed so that a backward's gradients reach the devices that receive them where the
    clock has them arrive (`_place_exchanges`).

    Whenever a device is idle it starts, among the items ready: first the rounds it has begun (backward,
    then forward), then a new round's forward while it holds fewer of the op's rounds in flight than its
    cap (`pipeline_caps`), then a new round's backward, below the cap only once the op has no forward
    left to start there (each by earliest round, forwards by lowest op, backwards by the op nearest the
    loss); an item of several devices starts when all are idle. A device thus runs one backward at its
    cap, then one forward, as 1F1B does, and waits for that forward rather than run another backward. If
    nothing runs and nothing can start, the first ready item (a forward if any) starts anyway, so the
    schedule always completes."""
    graph, needs_bwd = flow.graph, flow.needs_bwd
    caps = pipeline_caps(flow, ops, live)
    succ: dict[Item, list[Item]] = {}
    waiting: dict[Item, int] = {}

    def dep(a: Item, b: Item) -> None:
        succ.setdefault(a, []).append(b)
        waiting[b] = waiting.get(b, 0) + 1

    for (i, r), users in after.items():
        for j, rj in users:
            dep((FORWARD, i, r), (FORWARD, j, rj))
            if needs_bwd[i] and needs_bwd[j] and j != i:
                dep((BACKWARD, j, rj), (BACKWARD, i, r))
    for i in live:
        if needs_bwd[i]:
            step = ops[i]
            carried = any(prev is not None for prev in step.carry_from)
            for r in range(step.num_rounds):
                dep((FORWARD, i, r), (BACKWARD, i, r))
                if r and not carried:
                    dep((BACKWARD, i, r - 1), (BACKWARD, i, r))
            for c, prev in enumerate(step.carry_from):  # a chunk's backward before the one it started from
                if prev is not None:
                    dep((BACKWARD, i, step.rounds[c]), (BACKWARD, i, step.rounds[prev]))
    where: dict[tuple[int, int], tuple[int, ...]] = {}

    def devices(i: int, r: int) -> tuple[int, ...]:
        found = where.get((i, r))
        if found is None:
            found = where[(i, r)] = tuple(ops[i].devices[c] for c in ops[i].round_parts(r))
        return found

    def duration(phase: int, i: int) -> float:
        op = graph.ops[i]
        work = (op.fwd_flops + _RIDGE_FLOPS_PER_BYTE * op.fwd_bytes if phase == FORWARD
                else op.bwd_flops + _RIDGE_FLOPS_PER_BYTE * op.bwd_bytes)
        return work / ops[i].num_parts + _PART_OVERHEAD_FLOPS

    begun: set[tuple[int, int, int]] = set()  # (phase, device, round) that has started there
    share = _round_share(ops, live)

    def prio(item: Item) -> tuple:
        phase, i, r = item
        going = all((phase, d, r) in begun for d in devices(i, r))
        if phase == BACKWARD:
            return (0 if going else 3, share(i, r), -i)
        return (1 if going else 2, share(i, r), i)

    held: dict[tuple[int, int], int] = {}  # (op, device) -> its rounds in flight there
    counted = {i for i in live if ops[i].num_rounds > 1 and needs_bwd[i]}
    ready = sorted((prio(n), n) for i in live for n in [(FORWARD, i, 0)] if not waiting.get(n))
    total = sum(ops[i].num_rounds * (1 + needs_bwd[i]) for i in live)
    free_at: dict[int, float] = {}
    running: list[tuple[float, int, Item]] = []  # (end, start count, item): a heap
    timed: list[tuple[Item, float, float]] = []  # (item, start, end) in the order of the starts
    now = 0.0

    left = {(i, d): ops[i].devices.count(d) for i in counted for d in set(ops[i].devices)}  # forwards to start

    def start(item: Item) -> None:
        phase, i, r = item
        end = now + duration(phase, i)
        for d in devices(i, r):
            free_at[d] = end
            begun.add((phase, d, r))
            if phase == FORWARD and i in counted:
                held[(i, d)] = held.get((i, d), 0) + 1
                left[(i, d)] -= 1
        heapq.heappush(running, (end, len(timed), item))
        timed.append((item, now, end))

    def waits(item: Item) -> bool:
        """Whether a ready item waits for the cap: a new forward at it, a new backward below it while
        forwards are left."""
        phase, i, r = item
        if i not in counted:
            return False
        ds = devices(i, r)
        if phase == FORWARD:
            return any(held.get((i, d), 0) >= caps[d] for d in ds)
        return not all((BACKWARD, d, r) in begun for d in ds) and any(
            held[(i, d)] < caps[d] and left[(i, d)] for d in ds)

    while ready or running:
        rest = []
        for entry in ready:
            item = entry[1]
            if any(free_at.get(d, 0.0) > now for d in devices(*item[1:])) or waits(item):
                rest.append(entry)
            else:
                start(item)
        ready = rest
        if not running:
            first = next((e for e in ready if e[1][0] == FORWARD), ready[0])
            ready.remove(first)
            start(first[1])
        now = running[0][0]
        released = []
        while running and running[0][0] <= now:
            _, _, (phase, i, r) = heapq.heappop(running)
            if phase == BACKWARD and i in counted:
                for d in devices(i, r):
                    held[(i, d)] -= 1
            for n in succ.get((phase, i, r), ()):
                waiting[n] -= 1
                if not waiting[n]:
                    released.append((prio(n), n))
        ready = sorted([(prio(e[1]), e[1]) for e in ready] + released)
    assert len(timed) == total, "the rounds of a step form a cycle"
    return _place_exchanges(flow, ops, edges, set(live), timed, succ, devices)


def _place_exchanges(flow: GradFlow, ops: Sequence[OpStep], edges: Sequence[EdgeStep], live: set[int],
                     timed: Sequence[tuple[Item, float, float]], succ: Mapping[Item, list[Item]],
                     devices: Callable[[int, int], tuple[int, ...]]) -> tuple[Item, ...]:
    """1F1B's order from its list schedule `timed` ((item, start, end) in the order of the starts): a
    topological order of the dependencies `succ` and of each device's items in the order they start that
    takes first the item that started first, with each backward's gradients (its edges' exchanges and its
    chunks' states, which come after its part) placed, for each device that receives them without running
    the item, after the pass (a run of its items of one phase and round) it is in when the backward ends
    on the clock, before its next pass. Every rank walks the order and a receiver's next item waits for
    an exchange (`simulator.roundwalk`): at the backward's start, they would hold the receiver for the
    whole backward though it had other items to run (a stage's forward of another micro-batch), and in
    the middle of a pass wherever the clock runs ahead. Where these places contradict one another (a
    cycle: devices that send gradients both ways, a pass that waits for the gradient), the first started
    item whose dependencies and device predecessors are placed goes next."""
    at = {item: k for k, (item, _, _) in enumerate(timed)}
    mine: dict[int, list[int]] = {}  # device -> its items, in the order they start
    for k, (item, _, _) in enumerate(timed):
        for d in devices(*item[1:]):
            mine.setdefault(d, []).append(k)
    hard: list[list[int]] = [[] for _ in timed]  # dependencies and each device's items in turn
    for item, k in at.items():
        hard[k] += [at[n] for n in succ.get(item, ())]
    for ks in mine.values():
        for a, b in itertools.pairwise(ks):
            hard[a].append(b)
    receivers: dict[int, set[int]] = {}  # backward item -> the devices it sends gradients to
    for e in edges:
        edge = flow.edges[e.edge]
        if edge.grad and edge.dst in live and edge.src in live:
            # per exchange (consumer round c), the devices that receive its gradient (`EdgeStep.receivers`)
            for (c, _, _), (_, producers) in zip(e.exchanges, e.receivers, strict=True):
                k = at.get((BACKWARD, edge.dst, c))
                if k is not None:
                    receivers.setdefault(k, set()).update(producers.difference(devices(edge.dst, c)))
    for i in live:
        step = ops[i]
        for c, prev in enumerate(step.carry_from):
            k = at.get((BACKWARD, i, step.rounds[c]))
            if prev is not None and k is not None and step.devices[prev] != step.devices[c]:
                receivers.setdefault(k, set()).add(step.devices[prev])
    soft: list[list[int]] = [[] for _ in timed]  # where the gradients meet their receivers

    def pass_of(n: int) -> tuple[int, int]:
        phase, _, r = timed[n][0]
        return phase, r

    for k, ds in receivers.items():
        for d in ds:
            ks = mine[d]
            q = bisect.bisect_left(ks, timed[k][2], key=lambda n: timed[n][1])  # d's first start at the end
            while 0 < q < len(ks) and pass_of(ks[q]) == pass_of(ks[q - 1]):
                q += 1
            if q < len(ks):
                soft[k].append(ks[q])
            if q:
                soft[ks[q - 1]].append(k)
    return tuple(timed[k][0] for k in _first_started_topological(hard, soft))


def _first_started_topological(hard: Sequence[list[int]], soft: Sequence[list[int]]) -> list[int]:
    """A topological order of nodes 0..n-1 under edges `hard` and `soft` (node -> the nodes after it) that
    takes first the lowest node ready; where the soft edges close a cycle, the lowest node whose hard
    predecessors are all placed."""
    n = len(hard)
    need_hard, need_soft = [0] * n, [0] * n
    for outs, need in ((hard, need_hard), (soft, need_soft)):
        for out in outs:
            for b in out:
                need[b] += 1
    ready = [k for k in range(n) if not need_hard[k] and not need_soft[k]]
    loose = [k for k in range(n) if not need_hard[k]]  # hard predecessors placed: a heap, lazily pruned
    heapq.heapify(ready)
    heapq.heapify(loose)
    placed = [False] * n
    out: list[int] = []
    while len(out) < n:
        if ready:
            k = heapq.heappop(ready)
        else:
            k = heapq.heappop(loose)
            while placed[k]:
                k = heapq.heappop(loose)
        if placed[k]:
            continue
        placed[k] = True
        out.append(k)
        for b in hard[k]:
            need_hard[b] -= 1
            if not need_hard[b]:
                heapq.heappush(loose, b)
                if not need_soft[b]:
                    heapq.heappush(ready, b)
        for b in soft[k]:
            need_soft[b] -= 1
            if not need_soft[b] and not need_hard[b]:
                heapq.heappush(ready, b)
    return out


def flight_savings(flow: GradFlow, ops: Sequence[OpStep], edges: Sequence[EdgeStep], order: Sequence[Item]
                   ) -> dict[int, int]:
    """Per device, the kept bytes (module docstring, memory) it does not hold at once because `order`
    finishes some rounds' backward before it runs other rounds' forward: for an op with n parts on a
    device that holds at most f of them in flight (forward done, backward not), (n - f) / n of its parts'
    activation bytes and of what its input edges keep there. Empty under GPipe (every round in flight)."""
    first_bwd = next((k for k, item in enumerate(order) if item[0] == BACKWARD), len(order))
    if all(item[0] == BACKWARD for item in order[first_bwd:]):
        return {}  # every forward before any backward: every op holds all its rounds at once
    by_round: dict[int, list[list[int]]] = {}
    held: dict[tuple[int, int], int] = {}
    most: dict[tuple[int, int], int] = {}
    for phase, i, r in order:
        step = ops[i]
        if step.num_rounds == 1 or not step.runs_bwd:
            continue
        rounds = by_round.get(i)
        if rounds is None:
            rounds = by_round[i] = [[] for _ in range(step.num_rounds)]
            for c, k in enumerate(step.rounds):
                rounds[k].append(step.devices[c])
        for d in rounds[r]:
            n = held[(i, d)] = held.get((i, d), 0) + (1 if phase == FORWARD else -1)
            if n > most.get((i, d), 0):
                most[(i, d)] = n
    out: dict[int, int] = {}
    for (i, d), f in most.items():
        step = ops[i]
        n = step.devices.count(d)
        if f >= n:
            continue
        kept = sum(b for c, b in enumerate(step.activation_bytes) if step.devices[c] == d)
        kept += sum(edges[e].mem_bytes.get(d, 0) for e in flow.in_edges[i])
        out[d] = out.get(d, 0) + kept * (n - f) // n
    return out


class StepPlan:
    """Everything one training step does, for every device (see the module docstring).

    `ops[i]`, `edges[e]`, `params[u]` are the lowerings of op position i, edge id e and parameter unit u;
    `order` the step's (phase, op position, round) items in order (`step_order`), `forward_order` and
    `backward_order` its (op position, round)s of each phase, and `done_at[i]` the position in `order` of
    op i's last backward item (-1: it runs no backward);
    `all_reduces` the step's gradient all-reduces in issue order.
    """

    def __init__(self, flow: GradFlow, strategy: Strategy, num_devices: int, ops: Sequence[OpStep],
                 edges: Sequence[EdgeStep], params: Sequence[ParamStep]):
        self.flow = flow
        self.graph = flow.graph
        self.setup = flow.setup
        self.strategy = strategy
        self.num_devices = num_devices
        self.ops = tuple(ops)
        self.edges = tuple(edges)
        self.params = tuple(params)
        self.order = step_order(flow, self.ops, self.edges)
        self.forward_order = tuple((i, r) for phase, i, r in self.order if phase == FORWARD)
        self.backward_order = tuple((i, r) for phase, i, r in self.order if phase == BACKWARD)
        done_at = [-1] * flow.num_ops
        for k, (phase, i, _) in enumerate(self.order):
            if phase == BACKWARD:
                done_at[i] = k
        self.done_at = tuple(done_at)
        self.all_reduces = tuple(all_reduces([e for p in self.params for e in p.sync], self.done_at))
        self.loss_op = self.graph.ops[-1].name

    def recompute_before(self) -> dict[int, list[tuple[int, int]]]:
        """Per position k in `order`, the (op position, part) recomputed just before that backward item, in
        forward order (the module docstring's recomputation rule, per part: a recomputing part is
        recomputed before its own backward, or before the recomputation of a recomputing consumer part
        that reads it if that comes earlier; every part of a sharded op at the earliest of its parts'
        points, so that its shard groups gather together)."""
        flow, ops = self.flow, self.ops
        at_node = {(i, r): k for k, (phase, i, r) in enumerate(self.order) if phase == BACKWARD}
        point: dict[tuple[int, int], int] = {}
        for j in range(flow.num_ops - 1, -1, -1):
            step = ops[j]
            if not step.recompute:
                continue
            for c in range(step.num_parts):
                points = [at_node[(j, step.rounds[c])]] if flow.needs_bwd[j] else []
                for eid in flow.out_edges[j]:
                    k = flow.edges[eid].dst
                    if ops[k].recompute:
                        points += [point[(k, cc)] for p, cc, _, _ in self.edges[eid].pieces
                                   if p == c and (k, cc) in point]
                if points:
                    point[(j, c)] = min(points)
            if step.shard_groups and any((j, c) in point for c in range(step.num_parts)):
                # a sharded part gathers its parameters to recompute (a collective of its shard group):
                # every part of the op recomputes at the op's earliest point
                first = min(point[(j, c)] for c in range(step.num_parts) if (j, c) in point)
                point.update({(j, c): first for c in range(step.num_parts)})
        at_fwd = {node: k for k, node in enumerate(self.forward_order)}
        out: dict[int, list[tuple[int, int]]] = {}
        for (j, c), k in sorted(point.items(), key=lambda item: at_fwd[item[0][0], ops[item[0][0]].rounds[item[0][1]]]):
            out.setdefault(k, []).append((j, c))
        return out

    def process_groups(self) -> list[tuple[int, ...]]:
        """Every device set a collective runs within (the exchanges', the all-reduces'), sorted: the runtime
        creates one group each."""
        groups = {ranks for step in self.edges for _, ranks, _ in step.exchanges}
        groups |= {tuple(sorted((step.devices[p], step.devices[c]))) for step in self.ops
                   for c, p, _ in step.carry_moves}
        groups |= {a.group for a in self.all_reduces if len(a.group) > 1}
        groups |= {g for step in self.ops if step.shard_groups for g in step.shard_groups if len(g) > 1}
        return sorted(groups)

    def collectives(self) -> list[dict[str, dict[str, int]]]:
        """Per device, per kind, the count and bytes of the collectives one step issues.

        ``all_to_all``: one per exchange (edge, consumer round) and pass a device takes part in, and one
        per carry between devices (`OpStep.carry_moves`) and pass on both its devices, bytes it sends to
        other devices;
        ``all_reduce``: one per all-reduce over two or more devices, bytes of the buffer reduced;
        ``all_gather`` and ``reduce_scatter`` (sharded parts): one per part and pass, bytes of the whole
        (gathered or reduced) buffer."""
        out: list[dict[str, dict[str, int]]] = [{} for _ in range(self.num_devices)]

        def add(device: int, kind: str, nbytes: int) -> None:
            slot = out[device].setdefault(kind, {"count": 0, "bytes": 0})
            slot["count"] += 1
            slot["bytes"] += nbytes

        for step in self.edges:
            prod = self.ops[self.flow.edges[step.edge].src]
            cons = self.ops[self.flow.edges[step.edge].dst]
            # (devices of the sending parts, which end of a piece sends) per pass
            passes = [(prod.devices, 0)] + ([(cons.devices, 1)] if step.grad else [])
            for _, ranks, moving in step.exchanges:
                for src_dev, si in passes:
                    sent = dict.fromkeys(ranks, 0)
                    for k in moving:
                        piece = step.pieces[k]
                        sent[src_dev[piece[si]]] += piece[2]
                    for d in ranks:
                        add(d, ALL_TO_ALL, sent[d])
        for step in self.ops:
            for c, p, nbytes in step.carry_moves:
                # forward: the state from the source chunk's device; backward: its gradient back
                src, dst = step.devices[p], step.devices[c]
                for sender, receiver in [(src, dst)] + ([(dst, src)] if step.runs_bwd else []):
                    add(sender, ALL_TO_ALL, nbytes)
                    add(receiver, ALL_TO_ALL, 0)
        for a in self.all_reduces:
            if len(a.group) > 1:
                for d in a.group:
                    add(d, ALL_REDUCE, a.nbytes)
        for step in self.ops:
            if not step.shard_groups:
                continue
            for c, d in enumerate(step.devices):
                if len(step.shard_groups[c]) < 2:
                    continue
                add(d, ALL_GATHER, step.gather_bytes[c])
                if step.runs_bwd:
                    if step.recompute:
                        add(d, ALL_GATHER, step.gather_bytes[c])
                    add(d, ALL_GATHER, step.gather_bytes[c])
                    add(d, REDUCE_SCATTER, step.scatter_bytes[c])
        return out

    def memory_bytes(self) -> list[int]:
        """Per device, the step's memory (module docstring: what it keeps, an upper bound, plus its largest
        transient)."""
        mem = [0] * self.num_devices
        peak = [0] * self.num_devices
        for step in self.ops:
            for d, nbytes, extra in zip(step.devices, step.activation_bytes, step.transient_bytes, strict=True):
                mem[d] += nbytes
                peak[d] = max(peak[d], extra)
        for step in self.edges:
            for d, nbytes in step.mem_bytes.items():
                mem[d] += nbytes
        for step in self.params:
            for d, nbytes in step.memory_bytes.items():
                mem[d] += nbytes
        for d, nbytes in flight_savings(self.flow, self.ops, self.edges, self.order).items():
            mem[d] -= nbytes
        return [m + p for m, p in zip(mem, peak, strict=True)]


def lower(graph: OperatorGraph, strategy: Strategy, setup: TrainSetup, num_devices: int, *,
          flow: GradFlow | None = None, replicas: Replicas | None = None) -> StepPlan:
    """The `StepPlan` of one step of `graph` under `strategy` (already validated) on `num_devices`.

    `flow` may pass a `GradFlow` of the same graph and setup already built; `replicas` lowers replica 0
    only (module docstring)."""
    if flow is None:
        flow = GradFlow(graph, setup)
    assert flow.source is graph and flow.setup == setup
    graph = flow.graph
    loss = graph.ops[-1]
    assert loss.outputs[0].numel == 1, f"the last op {loss.name!r} must be the scalar loss"
    ops = [lower_op(flow, i, strategy[op.name], replicas) for i, op in enumerate(graph.ops)]
    edges = [lower_edge(flow, e.id, ops[e.src], ops[e.dst], replicas) for e in flow.edges]
    params = [lower_params(flow, u, {i: ops[i] for i in members}, replicas) for u, members in enumerate(flow.units)]
    return StepPlan(flow, strategy, num_devices, ops, edges, params)


__all__ = ["ALL_GATHER", "ALL_REDUCE", "ALL_TO_ALL", "AllReduce", "BACKWARD", "Edge", "EdgeStep", "FLOAT_DTYPES",
           "FORWARD", "GradFlow", "Item", "NotReplicable", "OpStep", "ParamStep", "REDUCE_SCATTER", "Replicas",
           "StepPlan", "SyncEntry", "all_reduces", "carry_order", "chunk_numel", "find_replicas", "flight_savings",
           "lower", "lower_edge", "lower_op", "lower_params", "part_rounds", "pipeline_caps", "recompute_points",
           "repeats", "run_graph", "step_order"]
