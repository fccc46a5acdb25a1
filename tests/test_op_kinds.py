"""Op kinds are complete: every registered kind defines, in its `OpDef`, the five things its consumers read.

The five (docs/op_kinds.md, "How to add an op kind"): dims, regions, a FLOPs formula (or torch's count),
the aten ops capture maps to it, and its runtime kernel. Conversely, every capture mapper and every runtime
kernel belongs to a registered kind. Regions are exercised on one small example op per kind, the ops
tests/test_registry.py checks the kernels against.
"""

from __future__ import annotations

import pytest
from test_registry import ALL_OPS

from runtime.kernels import KERNELS
from soap.capture.mappers import _MAPPERS
from soap.opdef import DimSpec, OpDef, full_box, input_shape
from soap.registry import REGISTRY

KINDS = sorted(REGISTRY)
EXAMPLES = {op.kind: op for op in reversed(ALL_OPS)}  # the first example op of each kind


def _overrides(entry: OpDef, method: str) -> bool:
    return getattr(type(entry), method) is not getattr(OpDef, method)


def test_every_kind_has_an_example():
    assert set(EXAMPLES) == set(REGISTRY)


@pytest.mark.parametrize("kind", KINDS)
def test_dims_and_regions(kind):
    entry = REGISTRY[kind]
    assert _overrides(entry, "dims") and _overrides(entry, "input_regions"), kind
    op = EXAMPLES[kind]
    dims = entry.dims(op)
    assert all(isinstance(d, DimSpec) for d in dims)
    box = full_box(dims)
    for i, out in enumerate(op.outputs):
        assert len(entry.output_region(op, box, i)) == len(out.shape), (kind, i)
    regions = entry.input_regions(op, box)
    assert len(regions) == len(op.inputs)
    for i, region in enumerate(regions):
        assert region is None or len(region) == len(input_shape(op, i)), (kind, i)
    params = entry.param_regions(op, box)
    assert set(params) == set(op.params)
    assert all(len(params[name]) == len(p.shape) for name, p in op.params.items())


@pytest.mark.parametrize("kind", KINDS)
def test_flops_formula(kind):
    entry = REGISTRY[kind]
    assert _overrides(entry, "flops"), f"{kind} declares no FLOPs formula"
    op = EXAMPLES[kind]
    fwd = entry.flops(op)
    if fwd is None:
        assert entry.flops_counted, f"{kind} has no FLOPs formula and capture does not count it"
        return
    assert isinstance(fwd, float) and fwd >= 0.0
    assert entry.backward_flops(op, fwd) >= 0.0


@pytest.mark.parametrize("kind", KINDS)
def test_capture_mapping(kind):
    entry = REGISTRY[kind]
    assert bool(entry.captured_from) != bool(entry.captured_specially), (
        f"{kind} must name the aten ops capture maps to it (captured_from) or say how capture makes it "
        f"(captured_specially), not both")
    missing = set(entry.captured_from) - set(_MAPPERS)
    assert not missing, f"{kind} is captured from {sorted(missing)}, which no capture mapper handles"


def test_every_capture_mapper_belongs_to_a_kind():
    declared = {name for entry in REGISTRY.values() for name in entry.captured_from}
    assert not set(_MAPPERS) - declared, "capture maps aten ops that no OpDef.captured_from names"


@pytest.mark.parametrize("kind", KINDS)
def test_kernel(kind):
    entry = REGISTRY[kind]
    assert bool(entry.kernel) != bool(entry.run_specially), (
        f"{kind} must name its runtime kernel (kernel) or say how the runtime runs it (run_specially), not both")
    assert not entry.kernel or entry.kernel in KERNELS, f"{kind}'s kernel {entry.kernel!r} is not in KERNELS"


def test_every_kernel_belongs_to_a_kind():
    assert set(KERNELS) == {entry.kernel for entry in REGISTRY.values() if entry.kernel}
