"""Reading and writing the project's JSON files: one-line errors on read, atomic writes.

A file is written to a temporary file in the same folder, flushed to disk, then renamed over the old
one, so a reader sees the old file or the new one, never half of either.
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
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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
