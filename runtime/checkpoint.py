"""Checkpoints: the full (unsharded) model and optimizer state, written atomically, readable under any strategy.

Owns `Checkpoint`, `save_checkpoint`, `latest_checkpoint`, `load_checkpoint`, `assemble` (full tensors from
the shards of every rank) and `shard_state` (a shard's slice of a full optimizer state). Imports torch and
the standard library only (no soap, no simulator, no search, no soapflow).

A checkpoint holds full tensors, never shards: parameters and buffers by fully qualified name, and the
optimizer state per parameter (SGD's momentum buffer, Adam's step and moments) shaped like the parameter.
So a run saved under one strategy resumes under any other (saved under tp, resumed under dp): each rank
slices what its parts hold, exactly as it slices the freshly built model.

On disk: `DIR/step-00000012.ckpt` after 12 completed steps, one line of header
`soapflow.checkpoint/1 <payload bytes> <sha256 of the payload>` followed by the payload (`torch.save` of
a dict). It is written to a temporary file in the same directory, flushed and fsynced, renamed into place
with `os.replace` and the directory fsynced: a crash at any moment leaves the previous checkpoints and
perhaps a stray temporary file, never a partial file under a checkpoint name. A file whose length or
digest does not match its header (cut short, corrupted) is skipped with a warning and the next older
checkpoint is used. The newest `keep` checkpoints are kept, older ones deleted after a successful write.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from soap.files import write_atomic

FORMAT = "soapflow.checkpoint/1"
_NAME = re.compile(r"^step-(\d{8})\.ckpt$")

Region = tuple[tuple[int, int], ...]


@dataclass(frozen=True, kw_only=True)
class Checkpoint:
    """The training state after `step` completed steps (all tensors full-size, on the CPU).

    `optimizer_state[fqn]` maps a state key to a tensor shaped like the parameter (sliced per shard on
    load) or to a scalar (copied as is); `meta` records what wrote it (model, strategy, seed, ...).
    """

    step: int
    params: Mapping[str, torch.Tensor]
    buffers: Mapping[str, torch.Tensor]
    optimizer: str
    optimizer_state: Mapping[str, Mapping[str, Any]]
    losses: tuple[float, ...] = ()
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.step < 0:
            raise ValueError(f"checkpoint step must be non-negative, got {self.step}")


def checkpoint_path(directory: str | os.PathLike, step: int) -> Path:
    return Path(directory) / f"step-{step:08d}.ckpt"


def checkpoint_step(path: str | os.PathLike) -> int:
    """The completed-step count a checkpoint file's name records."""
    m = _NAME.match(Path(path).name)
    if m is None:
        raise ValueError(f"{path} is not named like a checkpoint (step-NNNNNNNN.ckpt)")
    return int(m.group(1))


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # not every platform opens directories
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(directory: str | os.PathLike, ckpt: Checkpoint, *, keep: int = 2) -> Path:
    """Write `ckpt` atomically into `directory` (created if missing); return its path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    payload = io.BytesIO()
    torch.save({"format": FORMAT, "step": ckpt.step, "params": dict(ckpt.params), "buffers": dict(ckpt.buffers),
                "optimizer": ckpt.optimizer, "optimizer_state": {k: dict(v) for k, v in ckpt.optimizer_state.items()},
                "losses": list(ckpt.losses), "meta": dict(ckpt.meta)}, payload)
    data = payload.getvalue()
    header = f"{FORMAT} {len(data)} {hashlib.sha256(data).hexdigest()}\n".encode()
    path = checkpoint_path(directory, ckpt.step)
    write_atomic(path, header + data)
    _fsync_dir(directory)
    for old in _candidates(directory)[keep:]:
        old.unlink(missing_ok=True)
    return path


def _candidates(directory: Path) -> list[Path]:
    """Checkpoint files of `directory`, newest first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def _read_payload(path: Path) -> bytes:
    """The payload of checkpoint file `path`; ValueError when the header, length or digest is wrong."""
    with open(path, "rb") as f:
        header = f.readline(256)
        data = f.read()
    parts = header.decode("ascii", errors="replace").split()
    if len(parts) != 3 or parts[0] != FORMAT or not parts[1].isdigit():
        raise ValueError("not a soapflow checkpoint (bad header)")
    if len(data) != int(parts[1]):
        raise ValueError(f"truncated: {len(data)} of {parts[1]} payload bytes")
    if hashlib.sha256(data).hexdigest() != parts[2]:
        raise ValueError("corrupt: the payload's sha256 does not match the header")
    return data


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint in `directory` (None: none); broken ones are skipped with a warning."""
    for path in _candidates(Path(directory)):
        try:
            _read_payload(path)
        except (OSError, ValueError) as exc:
            warnings.warn(f"ignoring checkpoint {path.name}: {exc}", stacklevel=2)
            continue
        return path
    return None


def load_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Read checkpoint file `path` (ValueError when it is broken)."""
    doc = torch.load(io.BytesIO(_read_payload(Path(path))), map_location="cpu", weights_only=True)
    if doc.get("format") != FORMAT:
        raise ValueError(f"{path}: format {doc.get('format')!r}, expected {FORMAT!r}")
    return Checkpoint(step=int(doc["step"]), params=doc["params"], buffers=doc["buffers"],
                      optimizer=doc["optimizer"], optimizer_state=doc["optimizer_state"],
                      losses=tuple(doc["losses"]), meta=doc["meta"])


# ---------------------------------------------------------------------- shards <-> full tensors


def _slices(region: Region) -> tuple[slice, ...]:
    return tuple(slice(lo, hi) for lo, hi in region)


def assemble(pieces: Iterable[tuple[str, Region, torch.Tensor]], initial: Mapping[str, torch.Tensor]
             ) -> dict[str, torch.Tensor]:
    """Full tensors from shards (`fqn`, `region`, value): a copy of `initial[fqn]` with every region
    written; the first of several replicas of a region wins (replicas are equal after synchronization)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[str, Region]] = set()
    for fqn, region, value in pieces:
        if (fqn, region) in seen:
            continue
        seen.add((fqn, region))
        if fqn not in out:
            out[fqn] = initial[fqn].detach().clone().to(value.dtype)
        out[fqn][_slices(region)] = value
    return out


def shard_state(state: Mapping[str, Any], region: Region, shape: tuple[int, ...]) -> dict[str, Any]:
    """The optimizer state of the shard `region` of a parameter of `shape`, from its full state."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and tuple(value.shape) == shape and value.dim() > 0:
            out[key] = value[_slices(region)].clone()
        else:
            out[key] = value.clone() if isinstance(value, torch.Tensor) else value
    return out
