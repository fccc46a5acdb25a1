"""Cost databases measured on a GPU kind and shipped with soapflow, used for the presets of that kind.

Owns the shipped folder (`SHIPPED_FOLDER`, ``simulator/costdbs/``, package data of the wheel),
`shipped_costdb` (the measurements of a topology's device kinds) and `ShippedCostModel` (the measured
model over them, which says what it was built from for the commands' reports).

The folder holds one cost database (`soap.costdb`'s JSON lines) per device kind, named
``<device_kind>.jsonl`` (``h100.jsonl``): op parts timed on a machine of that kind by the runtime's part
timing (`runtime.measure`), every dtype they were timed in. A file holds the measurements of its own kind
only; lines of another kind are left out with a warning. `simulator.calibration.cost_model_for` prices
a preset topology (``h100-1x8``, not a topology file or a machine profile) with the union of its kinds'
files, analytical where they have no entry (docs/architecture.md, "The simulator"). Nothing is cached:
the files are read each time a cost model is made, once per command.

Must import only `soap` and the other `simulator` modules (no torch, runtime or search).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from simulator.costmodel import CostModel, MeasuredCostModel
from soap import costdb
from soap.topology import DeviceTopology

SHIPPED_FOLDER = Path(__file__).parent / "costdbs"


def shipped_costdb(topology: DeviceTopology, *, folder: str | os.PathLike | None = None
                   ) -> costdb.CostDatabase | None:
    """The union of the shipped cost databases of the device kinds in `topology` (``<kind>.jsonl`` in
    `folder`, None: `SHIPPED_FOLDER`), or None when none of its kinds has a measurement there."""
    folder = Path(SHIPPED_FOLDER if folder is None else folder)
    union = costdb.CostDatabase()
    for kind in sorted({d.kind for d in topology.devices}):
        path = folder / f"{kind}.jsonl"
        if not path.is_file():
            continue
        db = costdb.load(path)
        others = sum(1 for m in db if m.device_kind != kind)
        if others:
            warnings.warn(f"shipped cost database {os.fspath(path)!r}: {others} measurement(s) of other device "
                          f"kinds than {kind!r} left out", stacklevel=2)
        for m in db:
            if m.device_kind == kind:
                union.add(m)
    return union if len(union) else None


class ShippedCostModel(MeasuredCostModel):
    """A `MeasuredCostModel` whose database holds a shipped one (and possibly the caller's measurements
    over it): `device_kinds` and `num_shipped` (the shipped measurements) are for reports only."""

    __slots__ = ("device_kinds", "num_shipped")

    def __init__(self, db: costdb.CostDatabase, *, shipped: costdb.CostDatabase,
                 fallback: CostModel | None = None):
        super().__init__(db, fallback)
        self.device_kinds = tuple(sorted({m.device_kind for m in shipped}))
        self.num_shipped = len(shipped)


def shipped_report(cost_model: object) -> dict[str, object] | None:
    """What a command reports of a shipped database in its cost model: {device_kinds, num_parts}, or None
    when the model uses none."""
    if not isinstance(cost_model, ShippedCostModel):
        return None
    return {"device_kinds": list(cost_model.device_kinds), "num_parts": cost_model.num_shipped}


__all__ = ["SHIPPED_FOLDER", "ShippedCostModel", "shipped_costdb", "shipped_report"]
