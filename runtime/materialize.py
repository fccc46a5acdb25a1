"""Building a model without ever holding it: construct it on the meta device, then replay the construction
one tensor at a time and keep only the pieces this rank's parts read.

Owns `build_pieces` (the pieces of a seeded build), `Pieces` (what it returns: parameter pieces by fqn,
region and chunk, and every buffer whole), `Construction` (the recorded build), `chunk_of` (one chunk of a
flattened region, the layout of a sharded op) and `MaterializeError`. Imports `soap`, torch and the
standard library only.

How: the build function runs under the meta device with a dispatch mode that records every aten op it
calls (factory ops, the initializers' in-place random ops, copies, views) together with the state of the
default random generator before each op. Tensors built from Python data (`torch.tensor`, `as_tensor`)
stay on the CPU: they are small, and a library that tells a meta-device build by them (Hugging Face's
skips its weight initialization there) sees an ordinary build. The
replay runs the recorded ops in order on real CPU tensors: it sets the generator's state before an op
where the recorded state changed (the build seeded it) and otherwise lets the ops draw from it as an eager
build would, so every random op draws exactly the numbers it draws in an eager build from the same seed:
the values equal the eager build's bit for bit. A storage is freed after its last use in the recording;
a parameter's wanted pieces are copied out at that point, before it is freed. So a rank holds at most the
tensors alive at one point of the construction that are still to be used (in a module's constructor: that
module's own parameters), never the whole model; `Pieces.peak_bytes` reports the most it held.

What it cannot replay: a build that reads tensor values in Python (`.item()`, `if x.any()`) fails on
the meta device; `build_pieces` raises `MaterializeError` naming the cause, and the caller builds the
model whole instead (and says so). Real CPU tensors a build makes explicitly (`device="cpu"` inside the
build) are taken as they were when recorded.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import ModuleType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from soap.lowering import chunk_numel
from soap.opdef import Region

# (fqn, region, chunk): the region's box per dim and None (the piece is the region), or (index, count)
PieceKey = tuple[str, Region, tuple[int, int] | None]

_FROM_DATA = (torch.tensor, torch.as_tensor, torch.asarray)
# torch.nn.init's initializers that read the tensor's values and return meta tensors untouched; the
# truncated normal's public function calls `_no_grad_trunc_normal_`, which is where its work happens
_READING_INIT = ("_no_grad_trunc_normal_", "orthogonal_", "dirac_", "sparse_")
# in-place ops that write every element of their first argument from their other arguments alone
_OVERWRITING = frozenset(f"aten::{name}" for name in (
    "uniform_", "normal_", "fill_", "zero_", "random_", "exponential_", "cauchy_", "log_normal_",
    "geometric_", "copy_"))
_CPU = torch.device("cpu")
_META = torch.device("meta")


class MaterializeError(RuntimeError):
    """The build cannot be recorded on the meta device (it reads tensor values) or replayed."""


def chunk_of(value: torch.Tensor, chunk: tuple[int, int]) -> torch.Tensor:
    """Chunk (index, count) of `value` flattened and zero-padded to a multiple of count (a sharded op's
    layout, `soap.lowering`)."""
    j, size = chunk
    n = chunk_numel(value.numel(), size)
    flat = torch.zeros(size * n, dtype=value.dtype)
    flat[:value.numel()] = value.reshape(-1)
    return flat[j * n:(j + 1) * n].clone()


def piece_of(value: torch.Tensor, region: Region, chunk: tuple[int, int] | None) -> torch.Tensor:
    """The piece (region, chunk) of a full tensor, as a new tensor."""
    part = value[tuple(slice(lo, hi) for lo, hi in region)]
    return part.clone() if chunk is None else chunk_of(part, chunk)


class Pieces(Mapping[str, torch.Tensor]):
    """What a rank materialized: `piece(fqn, region, chunk)` for the parameter pieces it asked for; as a
    mapping, every buffer of the model whole by fqn. `peak_bytes` is the most the replay held at once."""

    def __init__(self, pieces: Mapping[PieceKey, torch.Tensor], buffers: Mapping[str, torch.Tensor],
                 peak_bytes: int = 0) -> None:
        self._pieces = dict(pieces)
        self._buffers = dict(buffers)
        self.peak_bytes = peak_bytes

    def piece(self, fqn: str, region: Region, chunk: tuple[int, int] | None = None) -> torch.Tensor:
        key = (fqn, tuple(tuple(r) for r in region), chunk)
        if key in self._pieces:
            return self._pieces[key]
        if fqn in self._buffers:
            return piece_of(self._buffers[fqn], key[1], chunk)
        raise KeyError(f"piece {key} of {fqn!r} was not materialized on this rank")

    def __getitem__(self, fqn: str) -> torch.Tensor:
        return self._buffers[fqn]

    def __iter__(self) -> Iterator[str]:
        return iter(self._buffers)

    def __len__(self) -> int:
        return len(self._buffers)


def install_buffers(module: torch.nn.Module, buffers: Mapping[str, torch.Tensor]) -> None:
    """Put the real `buffers` (by fqn) into `module` in place of its meta ones (an opaque op calls its
    submodule, which reads its own buffers)."""
    for fqn, value in buffers.items():
        owner, _, name = fqn.rpartition(".")
        sub = module.get_submodule(owner)
        if name in sub._buffers:
            sub._buffers[name] = value


def take_piece(tensors: Mapping[str, torch.Tensor], fqn: str, region: Region,
               chunk: tuple[int, int] | None = None) -> torch.Tensor:
    """Piece (region, chunk) of `fqn` from `tensors`: a `Pieces`, or every tensor of the model whole."""
    if isinstance(tensors, Pieces):
        return tensors.piece(fqn, region, chunk)
    return piece_of(tensors[fqn], region, chunk)


# ---------------------------------------------------------------------- recording


def _is_meta(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "meta"


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _Ref:
    """A meta tensor as an op saw it: its storage and its view of it, taken when the op ran (a build may
    later swap a tensor's storage, as `param.data = ...` does)."""

    __slots__ = ("key", "dtype", "size", "stride", "offset", "nbytes", "whole")

    def __init__(self, t: torch.Tensor) -> None:
        self.key, self.dtype, self.offset = _key(t), t.dtype, t.storage_offset()
        self.size, self.stride = tuple(t.size()), tuple(t.stride())
        self.nbytes = t.untyped_storage().nbytes()
        # the view covers its storage exactly (an op writing all of it writes all of the storage)
        self.whole = self.offset == 0 and t.is_contiguous() and t.numel() * t.element_size() == self.nbytes


def _overwrites(func: Any) -> bool:
    """Whether `func` writes all of its first argument without reading it."""
    name = getattr(getattr(func, "_schema", None), "name", None)
    if name is None:  # an initializer recorded whole
        return getattr(func, "__name__", "") in _READING_INIT
    return name in _OVERWRITING


class _OnMeta(TorchFunctionMode):
    """Factory functions default to the meta device, except those making a tensor from Python data: those
    stay on the CPU (they are small, and libraries tell a meta-device build by them and skip their
    initialization)."""

    def __init__(self) -> None:
        super().__init__()
        from torch.utils._device import _device_constructors
        self.constructors = _device_constructors()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.constructors and func not in _FROM_DATA and kwargs.get("device") is None:
            kwargs = {**kwargs, "device": _META}
        return func(*args, **kwargs)


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, tuple, dict, Any, torch.Tensor | None]] = []
        self.storages: list[torch.UntypedStorage] = []  # kept alive: a storage's key is its address
        self._state = torch.default_generator.get_state()
        self.initial_state = self._state

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        changed = self._changed()
        out = func(*args, **kwargs)
        self.ops.append((func, *tree_map(self._ref, (args, kwargs, out)), changed))
        # a real op may have drawn random numbers: the next op compares against the state after it
        self._state = torch.default_generator.get_state()
        return out

    def _changed(self) -> torch.Tensor | None:
        """The generator's state if it changed since the last op (the build seeded it), else None."""
        state = torch.default_generator.get_state()
        changed = None if torch.equal(state, self._state) else state
        self._state = state
        return changed

    def whole(self, fn: Callable) -> Callable:
        """`fn(tensor, ...)` recorded as one step when `tensor` is on the meta device (run at replay)."""

        @functools.wraps(fn)
        def recorded(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if not _is_meta(tensor):
                return fn(tensor, *args, **kwargs)
            changed = self._changed()
            self.ops.append((fn, *tree_map(self._ref, ((tensor, *args), kwargs, tensor)), changed))
            return tensor

        return recorded

    def _ref(self, x: Any) -> Any:
        if not _is_meta(x):
            return x
        self.storages.append(x.untyped_storage())
        return _Ref(x)


class Construction:
    """A build recorded on the meta device: `value` is what the build function returned (its module's
    tensors on the meta device), `ops` the aten ops in order (meta tensors as `_Ref`s)."""

    def __init__(self, value: Any, recorder: _Recorder) -> None:
        self.value = value
        self.ops = recorder.ops
        self.storages = recorder.storages
        self.initial_state = recorder.initial_state


def record(build: Callable[[], Any]) -> Construction:
    """Run `build` on the meta device, recording its ops; `MaterializeError` when it cannot run there."""
    recorder = _Recorder()
    patched = [(holder, name, getattr(holder, name) if isinstance(holder, ModuleType) else holder[name])
               for holder, name in _value_reading_initializers()]
    try:
        for holder, name, fn in patched:
            _assign(holder, name, recorder.whole(fn))
        with _OnMeta(), recorder:
            value = build()
    except Exception as exc:
        raise MaterializeError(f"the model cannot be built on the meta device ({type(exc).__name__}: "
                               f"{str(exc).splitlines()[0] if str(exc) else ''})") from exc
    finally:
        for holder, name, fn in patched:
            _assign(holder, name, fn)
    return Construction(value, recorder)


def _value_reading_initializers() -> list[tuple[Any, str]]:
    """Where the initializers that read values (rejection sampling, QR) live, which skip meta tensors:
    torch.nn.init's, and the table Hugging Face's initialization module calls them through."""
    where: list[tuple[Any, str]] = [(torch.nn.init, name) for name in _READING_INIT]
    table = getattr(sys.modules.get("transformers.initialization"), "TORCH_INIT_FUNCTIONS", None)
    if isinstance(table, dict):
        where += [(table, name) for name in _READING_INIT if name in table]
    return where


def _assign(holder: Any, name: str, value: Callable) -> None:
    if isinstance(holder, ModuleType):
        setattr(holder, name, value)
    else:
        holder[name] = value


# ---------------------------------------------------------------------- replay


def replay(construction: Construction, module: torch.nn.Module,
           wanted: Iterable[PieceKey]) -> Pieces:
    """The `wanted` parameter pieces and every buffer of `module` (the recorded build's, on the meta
    device), with the values an eager build from the same random state gives them."""
    targets: dict[int, list[tuple[str, torch.Tensor]]] = {}  # storage key -> (fqn, meta tensor)
    named = {**dict(module.named_parameters(remove_duplicate=False)),
             **dict(module.named_buffers(remove_duplicate=False))}
    buffer_names = {name for name, _ in module.named_buffers(remove_duplicate=False)}
    wants: dict[str, list[PieceKey]] = {}
    for fqn, region, chunk in wanted:
        wants.setdefault(fqn, []).append((fqn, tuple(tuple(r) for r in region), chunk))
    pieces: dict[PieceKey, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    kept = 0

    def keep(fqn: str, value: torch.Tensor) -> None:
        nonlocal kept
        if fqn in buffer_names:
            buffers[fqn] = value.detach().clone()
            kept += buffers[fqn].nbytes
        for key in wants.get(fqn, ()):
            pieces[key] = piece_of(value.detach(), key[1], key[2])
            kept += pieces[key].nbytes

    for fqn, t in named.items():
        if fqn not in wants and fqn not in buffer_names:
            continue
        if _is_meta(t):
            targets.setdefault(_key(t), []).append((fqn, _Ref(t)))
        else:  # made on the CPU by the build itself
            keep(fqn, t)
    # Liveness: a storage is freed after its last use, and between two uses when the later one
    # overwrites it whole without reading it (a constructor's initialization that a later
    # re-initialization replaces): it is allocated afresh there.
    last: dict[int, int] = {}  # storage -> its last use so far (after the loop: its last use)
    dead_before: set[tuple[int, int]] = set()  # (op, storage) where the op overwrites the storage whole
    released_at: dict[int, set[int]] = {}  # op -> storages dead after it until a later whole overwrite
    sizes: dict[int, int] = {}
    for i, (func, args, kwargs, out, _) in enumerate(construction.ops):
        read = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, _Ref)]
        first = args[0] if args else None
        if (isinstance(first, _Ref) and _overwrites(func) and first.whole
                and sum(x.key == first.key for x in read) == 1):
            dead_before.add((i, first.key))
            if last.get(first.key, i) != i:
                released_at.setdefault(last[first.key], set()).add(first.key)
        for x in (*read, *(x for x in tree_flatten(out)[0] if isinstance(x, _Ref))):
            last[x.key] = i
            sizes[x.key] = x.nbytes
    missing = [fqn for key, items in targets.items() if key not in last for fqn, _ in items]
    if missing:
        raise MaterializeError(f"no recorded op made {', '.join(sorted(missing)[:3])}")
    freed_at: dict[int, list[int]] = {}
    for key, i in last.items():
        freed_at.setdefault(i, []).append(key)

    real: dict[int, torch.UntypedStorage] = {}
    held = peak = 0

    def as_real(x: Any) -> Any:
        if isinstance(x, _Ref):
            storage = real.get(x.key)
            if storage is None:
                raise MaterializeError("the build uses a meta tensor no recorded op made")
            return torch.empty(0, dtype=x.dtype).set_(storage, x.offset, x.size, x.stride)
        if isinstance(x, torch.device) and x.type == "meta":
            return _CPU
        return x

    generator = torch.default_generator
    saved_state = generator.get_state()
    generator.set_state(construction.initial_state)
    try:  # on success the generator is left as an eager build leaves it
        with torch.no_grad():
            for i, (func, args, kwargs, out, state) in enumerate(construction.ops):
                if state is not None:
                    generator.set_state(state)
                first = args[0] if args else None
                if isinstance(first, _Ref) and first.key not in real and (i, first.key) in dead_before:
                    real[first.key] = torch.UntypedStorage(sizes[first.key])
                    held += sizes[first.key]
                result = func(*tree_map(as_real, args), **tree_map(as_real, kwargs))
                metas, _ = tree_flatten(out)
                reals, _ = tree_flatten(result)
                for m, r in zip(metas, reals, strict=False):
                    if isinstance(m, _Ref) and m.key not in real and isinstance(r, torch.Tensor):
                        storage = r.untyped_storage()
                        real[m.key] = storage
                        held += storage.nbytes()
                peak = max(peak, held + kept)
                for key in freed_at.get(i, ()):
                    for fqn, t in targets.pop(key, ()):
                        keep(fqn, as_real(t))
                for key in (*freed_at.get(i, ()), *released_at.get(i, ())):
                    storage = real.pop(key, None)
                    if storage is not None:
                        held -= storage.nbytes()
    except Exception:
        generator.set_state(saved_state)
        raise
    return Pieces(pieces, buffers, peak_bytes=peak)
