"""The shape of an op-registry entry: iteration dims, boxes, regions, FLOPs, capture mapping and kernel.

The registry (`soap/registry.py`) holds one entry (`OpDef`) per op kind, the one place where a kind is
defined (docs/op_kinds.md, "How to add an op kind"). An entry names the op's *iteration dims*
(`DimSpec`): the output dims plus any reduction dims, each with its SOAP kind. A part of an op is a
`Box`: one half-open index range per iteration dim, aligned with `dims(op)`. For a box the entry returns

- `output_region(op, box, i)`: the part of output `i` the box produces (a `Region`: one range per tensor
  axis). When the box covers only part of a dim whose `out_axis` is None, the part holds partial sums of
  that region, which consumers must add up;
  it may be empty (a chunk of an LSTM but the last holds none of the final state `h_n`), and
  consumers then read that output from the parts that hold it;
- `input_regions(op, box)`: the part of each input it reads, halos included, clipped to the tensor;
- `param_regions(op, box)`: the part of each parameter it reads.

The simulator derives communication from these regions; the runtime's kernels compute a part from exactly
these regions. One definition, two users. The entry also gives the op's forward FLOPs by formula (`flops`,
`backward_flops`, or `flops_counted` where capture counts them with torch), names the aten ops capture
maps to the kind (`captured_from`) and the runtime kernel that computes a part (`kernel`). Pure Python:
this module must not import torch, the simulator, the search or the runtime, which is why the kernel is
named here and held in `runtime.kernels.KERNELS`.

The helpers below the classes (`input_shape`, `pair`, `window_range`, `clip_range`, `part_boxes`,
`carry_sources`) are
shared by the registry entries, capture and the runtime kernels, so that all of them read attributes and
derive halos and part boxes the same way.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from soap.graph import DTYPE_BYTES, Operator

Range = tuple[int, int]
Box = tuple[Range, ...]
Region = tuple[Range, ...]


class DimKind(StrEnum):
    SAMPLE = "sample"
    ATTRIBUTE = "attribute"
    PARAMETER = "parameter"
    REDUCTION = "reduction"


@dataclass(frozen=True, slots=True, kw_only=True)
class DimSpec:
    """One iteration dim of an op.

    `out_axis` is the axis of output 0 this dim indexes, or None when splitting it leaves partial sums
    (a reduction dim, or the sample dim of a loss). `splittable` is False where the op kind cannot be
    split along the dim into parts that run at once (the normalized axis of a softmax, the hidden
    features of an LSTM).

    `carried` marks the axis a recurrence runs along (the time axis of an LSTM): the op may be split
    along it into *chunks*, not into parts that run at once. Chunk k (the part covering [t0, t1) of the
    dim, and given ranges of the other dims) starts from the final state of chunk k-1 (the part covering
    the same ranges of the other dims and the range before [t0, t1)), which the kind's kernel returns
    after its outputs (`OpDef.carry_shapes` and `OpDef.carry_bytes` say how large it is); its gradient
    flows back from chunk k to chunk k-1. Chunk k runs in a later round than chunk k-1 (`soap.lowering`);
    on another device the state moves to it, and its gradient back (`soap.lowering`'s rule "Carries"). A
    carried dim is not
    `splittable`: a search that places parts on distinct devices leaves it alone, and `OpDef.check`
    allows any degree on it.
    """

    name: str
    kind: DimKind
    size: int
    out_axis: int | None
    splittable: bool = True
    carried: bool = False

    def __post_init__(self) -> None:
        if self.size < 0:
            raise ValueError(f"dim {self.name!r} has negative size {self.size}")


def full_region(shape: tuple[int, ...]) -> Region:
    return tuple((0, s) for s in shape)


def full_box(dims: tuple[DimSpec, ...]) -> Box:
    return tuple((0, d.size) for d in dims)


def region_numel(region: Region) -> int:
    return math.prod(hi - lo for lo, hi in region)


def intersect(a: Region, b: Region) -> Region | None:
    """The overlap of two regions of the same tensor, or None when they do not overlap."""
    out = []
    for (alo, ahi), (blo, bhi) in zip(a, b, strict=True):
        lo, hi = max(alo, blo), min(ahi, bhi)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def split_range(size: int, degree: int, index: int) -> Range:
    """The `index`-th of `degree` equal chunks of [0, size); `degree` divides `size`."""
    step = size // degree
    return (index * step, (index + 1) * step)


class OpDef:
    """Base of all registry entries: everything soapflow knows about one op kind.

    A subclass sets `kind` and declares the five facts every consumer reads (tests/test_op_kinds.py
    checks each registered kind for all of them):

    1. dims: `dims` (and `check` where some degrees of splittable dims are not allowed);
    2. regions: `input_regions` (and `output_region`, `param_regions`, `buffer_regions` where the
       defaults do not fit);
    3. FLOPs: `flops` (and `backward_flops` where the default rule does not fit), or `flops_counted`;
    4. capture mapping: `captured_from`, or `captured_specially`;
    5. kernel: `kernel`, or `run_specially`.

    The region defaults cover ops whose output 0 is indexed by the dims with an `out_axis`, and whose other
    outputs (if any) the subclass maps itself.
    """

    kind: str = ""
    doc: str = ""
    # True where the op's output exists on every device at no cost: buffers each process holds, and the
    # batch, which each process's data loader reads where its consumers need it.
    everywhere: bool = False
    # The aten ops capture turns into this kind, by overload-packet name with trailing underscores dropped
    # (``conv2d``, ``max_pool2d_with_indices``, ``_softmax``); each has a mapper in
    # soap/capture/mappers.py, which may still leave a call opaque when its arguments do not fit the kind.
    # Empty only for the kinds capture makes itself, and then `captured_specially` says how.
    captured_from: tuple[str, ...] = ()
    captured_specially: str = ""
    # The entry of `runtime.kernels.KERNELS` that computes a part of an op of this kind (soap must not
    # import the runtime, so the kind names its kernel and the runtime's table holds it). Empty only for
    # the kinds the runtime runs without a part kernel, and then `run_specially` says how.
    kernel: str = ""
    run_specially: str = ""
    # True where capture takes an op's forward and backward FLOPs from torch's FlopCounterMode running
    # its aten call on fake tensors (the counter knows convolutions, matrix products and attention);
    # `flops` is then only the fallback where the counter counts no forward FLOPs.
    flops_counted: bool = False

    def flops(self, op: Operator) -> float | None:
        """Forward FLOPs of the whole `op` by formula (a multiply-add is 2 FLOPs).

        Capture records it for the kinds that are not `flops_counted`, and for the counted ones where the
        counter counts no forward FLOPs; None (counted kinds only) means there is no formula and the
        counter's figures stand (zero where it fails).
        """
        raise NotImplementedError(f"op kind {self.kind!r} declares no FLOPs formula")

    def backward_flops(self, op: Operator, fwd_flops: float) -> float:
        """Backward FLOPs of `op` given the forward FLOPs `flops` gave: twice the forward for an op with
        parameters (the gradients of its inputs and of its parameters), once for the others."""
        return (2.0 if op.params else 1.0) * fwd_flops

    def dims(self, op: Operator) -> tuple[DimSpec, ...]:
        raise NotImplementedError

    def check(self, op: Operator, degrees: Mapping[str, int]) -> str | None:
        """Why this combination of degrees is not allowed for `op`, or None when it is.

        The default allows any degree on a splittable dim; entries whose regions stop being boxes for
        some degrees (reshape) override it. Degrees must already divide their dims.
        """
        dims = {d.name: d for d in self.dims(op)}
        for name, degree in degrees.items():
            if degree > 1 and not (dims[name].splittable or dims[name].carried):
                return f"{self.kind} cannot be split along {name!r}"
        return None

    def output_region(self, op: Operator, box: Box, index: int = 0) -> Region:
        if index != 0:
            raise NotImplementedError(f"{self.kind} has no output {index}")
        region = list(full_region(op.outputs[0].shape))
        for d, rng in zip(self.dims(op), box, strict=True):
            if d.out_axis is not None:
                region[d.out_axis] = rng
        return tuple(region)

    def input_regions(self, op: Operator, box: Box) -> tuple[Region | None, ...]:
        raise NotImplementedError

    def param_regions(self, op: Operator, box: Box) -> dict[str, Region]:
        return {name: full_region(p.shape) for name, p in op.params.items()}

    def buffer_regions(self, op: Operator, box: Box) -> dict[str, Region]:
        """The part of each buffer (running statistics) the part reads and updates, keyed by local name."""
        return {}

    # Memory facts (the memory model of `soap.lowering` reads them; the defaults fit most kinds).

    def output_is_view(self, op: Operator) -> bool:
        """Whether the kernel returns views of its input 0 (a reshape, a split's pieces): the outputs take
        no memory of their own, and the memory model counts none for them."""
        return False

    def saved_bytes(self, op: Operator, box: Box) -> int:
        """Bytes a part's kernel keeps for backward besides the op's inputs, outputs and parameters (a max
        pool's indices, a cross entropy's log-probabilities), in the dtypes of `op` as run."""
        return 0

    def carry_shapes(self, op: Operator, box: Box) -> tuple[tuple[int, ...], ...]:
        """The shapes of the tensors of the state a part hands to the next chunk along the kind's carried
        dim (`DimSpec.carried`), in the order its kernel returns them; empty for kinds without one. The
        state is in the dtype of output 0 as run."""
        return ()

    def carry_bytes(self, op: Operator, box: Box) -> int:
        """Bytes of the state a part hands to the next chunk along the kind's carried dim (`carry_shapes`),
        in the dtypes of `op` as run; 0 for kinds without one."""
        return sum(math.prod(shape) for shape in self.carry_shapes(op, box)) * DTYPE_BYTES[op.outputs[0].dtype]

    def reduced(self, op: Operator, box: Box) -> bool:
        """Whether the part holds partial sums (it covers a proper subrange of a dim with no out_axis)."""
        return any(d.out_axis is None and (hi - lo) != d.size
                   for d, (lo, hi) in zip(self.dims(op), box, strict=True))


def input_shape(op: Operator, index: int) -> tuple[int, ...]:
    """The shape of tensor input `index`, from the ``input_shapes`` attr capture records on every op."""
    shapes = op.attrs.get("input_shapes")
    if shapes is None or index >= len(shapes):
        raise ValueError(f"op {op.name!r} ({op.kind}) lacks attr 'input_shapes' for input {index}; "
                         f"capture records one shape per tensor input")
    return tuple(int(s) for s in shapes[index])


def pair(value: int | Sequence[int]) -> tuple[int, int]:
    """A spatial attribute (kernel, stride, padding, dilation) as ``(h, w)``.

    Accepts what torch's conv and pooling functions accept and what capture writes: an int for both axes,
    or a sequence of one (both axes) or two ints.
    """
    if isinstance(value, int):
        return (value, value)
    values = [int(v) for v in value]
    if len(values) == 1:
        return (values[0], values[0])
    if len(values) != 2:
        raise ValueError(f"a spatial pair needs one or two ints, got {list(value)}")
    return (values[0], values[1])


def window_range(out_range: Range, *, kernel: int, stride: int, padding: int, dilation: int = 1) -> Range:
    """The input rows a sliding window (convolution, pooling) reads for output rows `out_range`.

    Not clipped: it runs from -padding up to past the end where the window overlaps the padding.
    """
    lo, hi = out_range
    if hi <= lo:
        return (lo * stride - padding, lo * stride - padding)
    return (lo * stride - padding, (hi - 1) * stride - padding + (kernel - 1) * dilation + 1)


def clip_range(rng: Range, size: int) -> Range:
    """`rng` clipped to [0, size); an empty result keeps lo <= hi."""
    lo = min(max(rng[0], 0), size)
    return (lo, max(min(rng[1], size), lo))


def carry_sources(dims: tuple[DimSpec, ...], degrees: Mapping[str, int]) -> tuple[int | None, ...]:
    """Per part (row-major part order, as `part_boxes`), the part whose final state it starts from: the
    chunk before it along the carried dim (`DimSpec.carried`), None for the first chunk, or for every part
    when no carried dim is split."""
    counts = [degrees.get(d.name, 1) for d in dims]
    stride = math.prod(counts)
    out: list[int | None] = [None] * stride
    for d, g in zip(dims, counts, strict=True):
        stride //= g
        if d.carried and g > 1:
            for c in range(len(out)):
                if (c // stride) % g:
                    out[c] = c - stride
    return tuple(out)


def part_boxes(dims: tuple[DimSpec, ...], degrees: Mapping[str, int]) -> list[Box]:
    """The boxes of all parts for `degrees` (a degree per dim name, missing = 1), in row-major part order."""
    counts = [degrees.get(d.name, 1) for d in dims]
    return [tuple(split_range(d.size, g, i) for d, g, i in zip(dims, counts, idx, strict=True))
            for idx in itertools.product(*(range(g) for g in counts))]
