"""Reading and writing the project's JSON files: one-line errors on read, atomic writes.

A file is written to a temporary file in the same folder, flushed to disk, then renamed over the old
one, so a reader sees the old file or the new one, never half of either; an error names the file asked
for, never the temporary one. `unwritable_reason` says up front why a folder cannot receive files, so
that a command can refuse before it spends minutes on work it cannot save.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    """Replace `path` with `data` (text is written as UTF-8) atomically: temporary file, fsync, rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise _naming(exc, path) from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise _naming(exc, path) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _naming(exc: OSError, path: Path) -> OSError:
    """`exc` (which may name the temporary file) naming `path` instead."""
    if exc.errno is None:
        return exc
    return type(exc)(exc.errno, exc.strerror, os.fspath(path))


def unwritable_reason(directory: str | os.PathLike) -> str | None:
    """Why files cannot be written in `directory`, created with its missing parents as `write_atomic` does
    (None: they can): the nearest existing one of it and its parents is not a directory or not writable."""
    existing = Path(directory)
    while not existing.exists():  # false too for a path under a regular file
        existing = existing.parent
    if not existing.is_dir():
        return f"{os.fspath(existing)!r} is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{os.fspath(existing)!r} is not writable"
    return None


def write_json(path: str | os.PathLike, doc: Any) -> None:
    """`doc` as indented JSON, written atomically."""
    write_atomic(path, json.dumps(doc, indent=1) + "\n")


def read_json(path: str | os.PathLike, source: str, error: type[Exception]) -> Any:
    """The JSON document in `path`; `error` with a one-line message naming `source` when the file cannot
    be read or is not JSON."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise error(f"cannot read {source}: {exc.strerror}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{source} is not JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
