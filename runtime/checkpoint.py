"""Checkpoints: every rank writes and reads only the pieces it holds (torch.distributed.checkpoint, DCP).

Owns the checkpoint directory (`save_checkpoint`, `load_checkpoint`, `latest_checkpoint`, `find_checkpoints`,
`verify_checkpoint`, `checkpoint_path`, `checkpoint_step`, `read_info`, `check_resumable`, `saved_tensors`),
`CheckpointInfo` (what a checkpoint records besides tensors), `Boxes` and `boxes_of` (a tensor's pieces on
this rank, as DCP sees them), `piece_boxes` and `flat_range_boxes` (a piece cut into boxes),
`disjoint_plans` (the boxes every rank offers, made disjoint) and the state-dict keys (`param_key`,
`buffer_key`, `optimizer_key`). Imports `soap`, torch and the standard library only (no runtime, no
simulator, no search, no soapflow): the training loop (`runtime.train`) says what a rank holds.

What a rank holds of a tensor (a parameter, a buffer, or an optimizer state tensor shaped like its
parameter: SGD's momentum, AdamW's moments) are pieces `(region, tensor, chunk)`: a box `region` of the
full tensor (`((lo, hi), ...)` per dim) and either the box itself (`chunk` None) or chunk (index, count)
of it: the box flattened row-major, zero-padded to a multiple of count and cut in count equal chunks
(a sharded op's layout, `soap.lowering`). A chunk is a contiguous range of the flattened box, and such a
range is a union of at most 2 ndim - 1 boxes, each contiguous in the chunk (`flat_range_boxes`; the
padding belongs to none). So every piece is a list of boxes of the full tensor, each a view of the rank's
own tensor, and `Boxes` offers them to DCP through its checkpointable protocol (`__create_write_items__`,
`__create_chunk_list__`, `__get_tensor_shard__`, as DTensor does): DCP records each box with its offsets
in the full shape, and on load reads every box a rank asks for from the saved boxes that overlap it, so
a checkpoint saved under one strategy loads under any other and any process count, and no rank ever
holds a full tensor. Scalars (AdamW's step count, one per parameter) are plain 0-dim tensors that every
holder of the parameter saves; DCP keeps one.

DCP wants the saved boxes of a tensor disjoint. Boxes held by several ranks (replicas), and boxes that
overlap only in part (a weight two ops read under different splits), are made disjoint on the
coordinator (`_SavePlanner`): every distinct box minus the boxes accepted before it (larger first) is
written once, by the holder with the fewest bytes to write so far (DCP's own balancing), except that a
buffer's box is written by the lowest rank holding it: replicas of a buffer can differ (the running
statistics of a batch norm split on samples are each rank's own), and a checkpoint keeps rank 0's, as
DDP does when it broadcasts buffers.

On disk: `DIR/step-00000012/` after 12 completed steps holds DCP's files (`.metadata`, where every box
lies; `__R_0.distcp`, what rank R wrote), `train.json` (`CheckpointInfo`: the step count, the optimizer,
the losses so far, the writer's metadata such as the graph's fingerprint) and `manifest.json` (the size
and sha256 of every other file), written last. Every rank writes into `DIR/.step-00000012.tmp/`; after
all have finished, rank 0 writes the manifest, renames the directory into place (an older directory of
that name is moved aside first) and fsyncs DIR, and only then do the ranks go on (a barrier): a crash at
any moment leaves the previous checkpoints and perhaps a stray temporary directory, never a partial
checkpoint under a checkpoint name. A checkpoint whose manifest is missing, or a file of which is
missing, cut short or corrupted, is skipped by `latest_checkpoint` with a warning naming it, and the next
older one is used (`find_checkpoints` returns the skipped ones instead, for a caller to decide). The
newest `keep` checkpoints are kept, older ones deleted after a successful write.
Without a process group (a single process) DCP runs in one process (its `no_dist`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from soap.files import write_atomic
from soap.opdef import Region

FORMAT = "soapflow.checkpoint/2"
INFO_FILE = "train.json"
MANIFEST_FILE = "manifest.json"
_NAME = re.compile(r"^step-(\d{8})$")
_BUFFER = "buffer/"
# DCP warns whenever it runs without a process group, which a single process intends.
_NO_DIST = "torch.distributed is disabled"

# (offsets, sizes) of a box of a full tensor
Box = tuple[tuple[int, ...], tuple[int, ...]]


def param_key(fqn: str) -> str:
    return f"param/{fqn}"


def buffer_key(fqn: str) -> str:
    return f"{_BUFFER}{fqn}"


def optimizer_key(fqn: str, name: str) -> str:
    """The key of optimizer state `name` (`exp_avg`, `step`, ...) of parameter `fqn`."""
    return f"optimizer/{fqn}/{name}"


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointInfo:
    """What a checkpoint records besides tensors: `step` completed steps, trained with `optimizer`
    (`TrainSetup.optimizer`), their `losses`, and `meta` (what wrote it: graph name and fingerprint, seed,
    process count, training setup and dtype)."""

    step: int
    optimizer: str
    losses: tuple[float, ...] = ()
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.step < 0:
            raise ValueError(f"checkpoint step must be non-negative, got {self.step}")


# ---------------------------------------------------------------------- pieces as boxes


def flat_range_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """The elements [start, stop) of a tensor of `shape` flattened row-major, as at most 2 ndim - 1
    disjoint boxes (offsets, sizes) in increasing flat order; each box is itself contiguous in the
    flattening (a fixed index on the leading dims, a range on one dim, whole trailing dims)."""
    shape = tuple(shape)
    stop = min(stop, math.prod(shape))
    if start >= stop:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    (first, head), (last, tail) = divmod(start, inner), divmod(stop, inner)

    def within(row: int, lo: int, hi: int) -> list[Box]:
        return [((row, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], lo, hi)]

    if first == last:
        return within(first, head, tail)
    out = within(first, head, inner) if head else []
    whole = first + (1 if head else 0)
    if last > whole:
        out.append(((whole, *(0,) * (len(shape) - 1)), (last - whole, *shape[1:])))
    return out + (within(last, 0, tail) if tail else [])


def _ravel(index: Sequence[int], shape: Sequence[int]) -> int:
    flat = 0
    for i, n in zip(index, shape, strict=True):
        flat = flat * n + i
    return flat


def piece_boxes(region: Region, tensor: torch.Tensor, chunk: tuple[int, int] | None
                ) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """The boxes of a piece: (offsets in the full tensor, a view of `tensor` shaped like the box)."""
    lo = tuple(a for a, _ in region)
    shape = tuple(b - a for a, b in region)
    if chunk is None:
        assert tuple(tensor.shape) == shape, f"a piece of shape {tuple(tensor.shape)} for region {region}"
        return [(lo, tensor)] if math.prod(shape) else []
    j, _ = chunk
    n = tensor.numel()
    flat = tensor.reshape(-1)
    out = []
    for offsets, sizes in flat_range_boxes(shape, j * n, (j + 1) * n):
        begin = _ravel(offsets, shape) - j * n
        view = flat[begin:begin + math.prod(sizes)].view(sizes)
        out.append((tuple(a + o for a, o in zip(lo, offsets, strict=True)), view))
    return out


class Boxes:
    """The boxes of one full tensor of shape `shape` that this rank holds, each (offsets, view of the
    rank's tensor), offered to DCP through its checkpointable protocol: saving writes their values,
    loading fills them. Boxes may overlap (a weight two ops read under different splits)."""

    def __init__(self, shape: Sequence[int], boxes: Sequence[tuple[tuple[int, ...], torch.Tensor]]) -> None:
        assert boxes, "no boxes"
        self.shape = torch.Size(shape)
        self.boxes = [(torch.Size(o), t.detach()) for o, t in boxes]
        self.properties = TensorProperties.create_from_tensor(self.boxes[0][1])

    def size(self) -> torch.Size:
        return self.shape

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=o, sizes=t.shape) for o, t in self.boxes]

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=chunk, properties=self.properties, size=self.shape))
                for chunk in self.__create_chunk_list__()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        # DCP's load plan names a box by its position in `__create_chunk_list__`; offsets alone are
        # ambiguous where two boxes start at the same point.
        if index.index is not None and index.index < len(self.boxes) and self.boxes[index.index][0] == index.offset:
            return self.boxes[index.index][1]
        for offsets, t in self.boxes:
            if offsets == index.offset:
                return t
        raise ValueError(f"no box at {tuple(index.offset or ())} of {index.fqn!r}")

    def view(self, chunk: ChunkStorageMetadata) -> torch.Tensor:
        """The values of box `chunk`, which lies inside one of the boxes held."""
        for offsets, t in self.boxes:
            if all(o <= c and c + s <= o + n for o, n, c, s in zip(offsets, t.shape, chunk.offsets, chunk.sizes,
                                                                 strict=True)):
                for dim, (o, c, s) in enumerate(zip(offsets, chunk.offsets, chunk.sizes, strict=True)):
                    t = t.narrow(dim, c - o, s)
                return t
        raise AssertionError(f"box {chunk} is not inside a box held")


def boxes_of(shape: Sequence[int], pieces: Iterable[tuple[Region, torch.Tensor, tuple[int, int] | None]]
             ) -> Boxes | None:
    """The `Boxes` of the pieces (region, tensor, chunk) of a tensor of `shape` (None: they hold no
    element, e.g. a chunk that is all padding)."""
    boxes = [b for region, t, chunk in pieces for b in piece_boxes(region, t, chunk)]
    return Boxes(shape, boxes) if boxes else None


# ---------------------------------------------------------------------- DCP planners


def _subtract(box: Box, other: Box) -> list[Box]:
    """`box` minus `other`, as disjoint boxes (at most 2 per dim)."""
    lo, hi = list(box[0]), [a + n for a, n in zip(*box, strict=True)]
    cut_lo, cut_hi = other[0], [a + n for a, n in zip(*other, strict=True)]
    if any(a >= ch or ca >= b for a, b, ca, ch in zip(lo, hi, cut_lo, cut_hi, strict=True)):
        return [box]

    def slab(d: int, a: int, b: int) -> Box:
        return (tuple(lo[:d] + [a] + lo[d + 1:]), tuple(y - x for x, y in zip(lo[:d] + [a] + lo[d + 1:],
                                                                          hi[:d] + [b] + hi[d + 1:], strict=True)))

    out = []
    for d, (ca, ch) in enumerate(zip(cut_lo, cut_hi, strict=True)):
        # what is left below and above `other` on dim d; the rest lies within it on dims 0..d
        if lo[d] < ca:
            out.append(slab(d, lo[d], ca))
            lo[d] = ca
        if ch < hi[d]:
            out.append(slab(d, ch, hi[d]))
            hi[d] = ch
    return out


def disjoint_plans(plans: Sequence[SavePlan]) -> list[SavePlan]:
    """The plans of every rank with the boxes (SHARD items) of each tensor made disjoint: each distinct
    box, larger first, less the boxes accepted before it, is written once, by the holder with the fewest
    bytes to write so far, or for a buffer by the lowest rank holding it. Other items are left to DCP."""
    holders: dict[tuple[str, Box], list[int]] = {}
    templates: dict[tuple[str, Box], WriteItem] = {}
    items: list[list[WriteItem]] = [[] for _ in plans]
    for rank, plan in enumerate(plans):
        for item in plan.items:
            if item.type != WriteItemType.SHARD:
                items[rank].append(item)
                continue
            chunk = item.tensor_data.chunk
            key = (item.index.fqn, (tuple(chunk.offsets), tuple(chunk.sizes)))
            holders.setdefault(key, [])
            if rank not in holders[key]:
                holders[key].append(rank)
            templates.setdefault(key, item)
    load = [0] * len(plans)
    accepted: dict[str, list[Box]] = {}
    for key in sorted(holders, key=lambda k: (k[0], -math.prod(k[1][1]), k[1])):
        fqn, box = key
        pieces = [box]
        for done in accepted.get(fqn, []):
            pieces = [p for piece in pieces for p in _subtract(piece, done)]
        template = templates[key]
        for offsets, sizes in pieces:
            if not math.prod(sizes):
                continue
            nbytes = math.prod(sizes) * template.tensor_data.properties.dtype.itemsize
            rank = (min(holders[key]) if fqn.startswith(_BUFFER)
                    else min(holders[key], key=lambda r: (load[r], r)))
            load[rank] += nbytes
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            items[rank].append(dataclasses.replace(
                template, index=MetadataIndex(fqn, chunk.offsets),
                tensor_data=dataclasses.replace(template.tensor_data, chunk=chunk)))
            accepted.setdefault(fqn, []).append((offsets, sizes))
    return [dataclasses.replace(plan, items=rank_items) for plan, rank_items in zip(plans, items, strict=True)]


class _SavePlanner(DefaultSavePlanner):
    """DCP's planner with the boxes made disjoint first (`disjoint_plans`) and each written box read
    from the `Boxes` that holds it."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        return super().create_global_plan(disjoint_plans(all_plans))

    def resolve_data(self, write_item: WriteItem) -> Any:
        obj = self.state_dict[write_item.index.fqn]
        if isinstance(obj, Boxes):
            return obj.view(write_item.tensor_data.chunk)
        return super().resolve_data(write_item)


class _LoadPlanner(DefaultLoadPlanner):
    """DCP's planner reading into `Boxes` (`__get_tensor_shard__`) and plain tensors."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        # DefaultLoadPlanner's, less its materialization of meta tensors, which knows only tensor types and
        # would drop the `Boxes` (every tensor here is real).
        self.original_state_dict = self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        if isinstance(obj, Boxes):
            return obj.__get_tensor_shard__(index)
        return super().lookup_tensor(index)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


# ---------------------------------------------------------------------- the checkpoint directory


def checkpoint_path(directory: str | os.PathLike, step: int) -> Path:
    return Path(directory) / f"step-{step:08d}"


def checkpoint_step(path: str | os.PathLike) -> int:
    """The completed-step count a checkpoint directory's name records."""
    m = _NAME.match(Path(path).name)
    if m is None:
        raise ValueError(f"{path} is not named like a checkpoint (step-NNNNNNNN)")
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


def _digest(path: Path) -> dict[str, Any]:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return {"bytes": path.stat().st_size, "sha256": h.hexdigest()}


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def save_checkpoint(directory: str | os.PathLike, state: Mapping[str, Any], info: CheckpointInfo, *,
                    keep: int = 2) -> Path:
    """Write this rank's `state` (key -> `Boxes` or tensor) as checkpoint `info.step` of `directory`
    (created if missing); every rank calls it (a collective), and it returns, with the checkpoint's
    path, once the checkpoint is in place."""
    directory = Path(directory)
    final = checkpoint_path(directory, info.step)
    tmp = directory / f".{final.name}.tmp"
    rank = dist.get_rank() if _distributed() else 0
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # what a crashed write left
        tmp.mkdir()
    _barrier()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_DIST)
        dcp.save(dict(state), storage_writer=dcp.FileSystemWriter(tmp, thread_count=1), planner=_SavePlanner(),
                 no_dist=not _distributed())
    # DCP returns once every rank's files and its metadata are written; each rank hashes a share of them.
    world = dist.get_world_size() if _distributed() else 1
    files = sorted(p.name for p in tmp.iterdir() if p.is_file())
    digests = {name: _digest(tmp / name) for name in files[rank::world]}
    shares: list[Any] = [digests]
    if world > 1:
        shares = [None] * world if rank == 0 else None
        dist.gather_object(digests, shares, dst=0)
    if rank == 0:
        write_atomic(tmp / INFO_FILE, json.dumps({"format": FORMAT, **_info_doc(info)}, indent=1) + "\n")
        manifest = {name: d for share in shares for name, d in share.items()}
        manifest[INFO_FILE] = _digest(tmp / INFO_FILE)
        write_atomic(tmp / MANIFEST_FILE, json.dumps({"format": FORMAT, "files": dict(sorted(manifest.items()))},
                                                     indent=1) + "\n")
        _fsync_dir(tmp)
        if final.exists():  # a checkpoint of this step from an earlier run (perhaps broken)
            old = directory / f".{final.name}.old"
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            shutil.rmtree(old)
        tmp.rename(final)
        _fsync_dir(directory)
        for stale in _candidates(directory)[keep:]:
            shutil.rmtree(stale)
    _barrier()
    return final


def _info_doc(info: CheckpointInfo) -> dict[str, Any]:
    return {"step": info.step, "optimizer": info.optimizer, "losses": list(info.losses), "meta": dict(info.meta)}


def _candidates(directory: Path) -> list[Path]:
    """Checkpoint directories of `directory`, newest first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found, reverse=True)]


def verify_checkpoint(path: str | os.PathLike) -> None:
    """Check every file of checkpoint `path` against its manifest; ValueError (one line) saying what is
    wrong otherwise."""
    path = Path(path)
    try:
        doc = json.loads((path / MANIFEST_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"no {MANIFEST_FILE}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"unreadable {MANIFEST_FILE} ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("files"), dict):
        raise ValueError(f"{MANIFEST_FILE} is not a {FORMAT} manifest")
    for name, want in doc["files"].items():
        file = path / name
        if not file.is_file():
            raise ValueError(f"missing {name}")
        try:
            got = _digest(file)
        except OSError as exc:
            raise ValueError(f"cannot read {name} ({exc.strerror})") from None
        if got["bytes"] != want.get("bytes"):
            raise ValueError(f"{name} has {got['bytes']} bytes, the manifest says {want.get('bytes')}")
        if got["sha256"] != want.get("sha256"):
            raise ValueError(f"corrupt: the sha256 of {name} does not match the manifest")


def find_checkpoints(directory: str | os.PathLike) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest complete checkpoint in `directory` (None: none) and the broken ones newer than it, newest
    first, each with what is wrong with it (`verify_checkpoint`'s message)."""
    broken = []
    for path in _candidates(Path(directory)):
        try:
            verify_checkpoint(path)
        except ValueError as exc:
            broken.append((path, str(exc)))
            continue
        return path, broken
    return None, broken


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint in `directory` (None: none); broken ones are skipped with a warning."""
    found, broken = find_checkpoints(directory)
    for path, problem in broken:
        warnings.warn(f"ignoring checkpoint {path.name}: {problem}", stacklevel=2)
    return found


def read_info(path: str | os.PathLike) -> CheckpointInfo:
    """The `CheckpointInfo` of checkpoint `path` (ValueError, one line, when it has none)."""
    try:
        doc = json.loads((Path(path) / INFO_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not a checkpoint: cannot read its {INFO_FILE} ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"{path}: format {doc.get('format') if isinstance(doc, dict) else None!r}, "
                         f"expected {FORMAT!r}")
    return CheckpointInfo(step=int(doc["step"]), optimizer=str(doc["optimizer"]),
                          losses=tuple(float(x) for x in doc["losses"]), meta=doc["meta"])


def check_resumable(path: str | os.PathLike, info: CheckpointInfo, *, graph: str, fingerprint: str,
                    optimizer: str, seed: int | None = None) -> None:
    """ValueError (one line) unless a run training graph `graph` (its `OperatorGraph.fingerprint`) with
    `optimizer` and, unless None, the seed `seed` can resume from checkpoint `path`, whose info is `info`.

    The seed draws the synthetic batches of every step (`runtime.train`), so a run resumed with another
    seed than the one that wrote the checkpoint would go on with another data stream than the
    uninterrupted run's."""
    saved = info.meta.get("fingerprint")
    if saved != fingerprint:
        raise ValueError(f"checkpoint {path} was saved for another model: graph {info.meta.get('graph')!r} "
                         f"(fingerprint {str(saved)[:12]}), this run trains {graph!r} (fingerprint "
                         f"{fingerprint[:12]}); the model, its batch size or its capture differ")
    if info.optimizer != optimizer:
        raise ValueError(f"checkpoint {path} was saved with optimizer {info.optimizer}, this run uses {optimizer}")
    saved_seed = info.meta.get("seed")
    if seed is not None and saved_seed is not None and saved_seed != seed:
        raise ValueError(f"checkpoint {path} was saved by a run with seed {saved_seed}, this run has seed {seed}; "
                         f"resume with seed {saved_seed} (the seed draws every step's batch)")


def saved_tensors(path: str | os.PathLike) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The tensors checkpoint `path` holds: key -> (full shape, dtype)."""
    metadata = dcp.FileSystemReader(path).read_metadata()
    return {key: (tuple(md.size), md.properties.dtype) for key, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)}


def load_checkpoint(path: str | os.PathLike, state: dict[str, Any]) -> None:
    """Fill this rank's `state` (key -> `Boxes` or tensor, each key saved in checkpoint `path`) from the
    checkpoint; every rank calls it (a collective)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_DIST)
        dcp.load(state, storage_reader=dcp.FileSystemReader(path), planner=_LoadPlanner(),
                 no_dist=not _distributed())
