"""Tables of report rows with pandas: one DataFrame per table, written as text, markdown or CSV.

Owns `frame` (rows, one dict each, as a DataFrame in a given column order), `text_table` (aligned plain
text for the terminal: `compare` and `validate` print theirs with it), `markdown_table` (a GitHub
markdown table for the benchmarks' results; pandas' own `to_markdown` needs the `tabulate` package, which
this avoids) and `write_csv` (`--csv FILE`: the rows as `--json` prints them, one line each). A missing
value (None or NaN) reads ``-`` in text and markdown and is an empty field in CSV.

Imports pandas and nothing of the project.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import pandas as pd

Formats = Mapping[str, Callable[[Any], str]]
MISSING = "-"


def frame(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None) -> pd.DataFrame:
    """The rows as a DataFrame: `columns` in that order (None: every key, in order of first appearance)."""
    if columns is None:
        columns = list(dict.fromkeys(k for r in rows for k in r))
    return pd.DataFrame([{c: r.get(c) for c in columns} for r in rows], columns=list(columns), dtype=object)


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and value != value)


def cells(df: pd.DataFrame, formats: Formats | None = None) -> pd.DataFrame:
    """Every cell as its text: `formats[column]` where given, else `str`; a missing value is ``-``."""
    formats = formats or {}

    def show(column: str) -> Callable[[Any], str]:
        fmt = formats.get(column, str)
        return lambda v: MISSING if _missing(v) else fmt(v)

    return pd.DataFrame({c: df[c].map(show(c)) for c in df.columns}, columns=df.columns)


def _numeric(df: pd.DataFrame) -> list[str]:
    """The columns whose present values are all numbers (right-aligned by default)."""
    def is_number(v: Any) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool)

    return [c for c in df.columns if df[c].map(lambda v: _missing(v) or is_number(v)).all()
            and not df[c].map(_missing).all()]


def text_table(df: pd.DataFrame, formats: Formats | None = None, *, right: Collection[str] | None = None) -> str:
    """`df` as aligned text: a header, a rule of dashes under it, one line per row, columns two spaces
    apart. `right` names the right-aligned columns (None: the numeric ones)."""
    right = set(_numeric(df) if right is None else right)
    text = cells(df, formats)
    widths = {c: max([len(str(c)), *text[c].map(len)]) for c in df.columns}

    def line(values: Mapping[str, str]) -> str:
        return "  ".join(values[c].rjust(widths[c]) if c in right else values[c].ljust(widths[c])
                         for c in df.columns).rstrip()

    rows = [line(dict(r)) for _, r in text.iterrows()]
    return "\n".join([line({c: str(c) for c in df.columns}), "  ".join("-" * widths[c] for c in df.columns),
                      *rows])


def markdown_table(df: pd.DataFrame, formats: Formats | None = None, *, right: Collection[str] = (),
                   headers: Sequence[str] | None = None) -> str:
    """`df` as a GitHub markdown table, one line per row; the columns in `right` right-aligned (``---:``);
    `headers` replaces the column names in the header line (where two columns show the same name)."""
    text = cells(df, formats)
    headers = [str(c) for c in df.columns] if headers is None else list(headers)
    assert len(headers) == len(df.columns), (headers, list(df.columns))
    lines = ["| " + " | ".join(headers) + " |",
             "|" + "".join("---:|" if c in right else "---|" for c in df.columns)]
    lines += ["| " + " | ".join(r) + " |" for r in text.itertuples(index=False)]
    return "\n".join(lines)


def write_csv(path: str | os.PathLike, rows: Sequence[Mapping[str, Any]]) -> None:
    """The rows as CSV with a header line, the columns in order of first appearance; a list value (the
    runs of a measured time) is written as its JSON text, so that `json.loads` reads it back."""
    df = frame(rows)
    for c in df.columns:
        df[c] = df[c].map(lambda v: json.dumps(v) if isinstance(v, list | tuple) else v)
    df.to_csv(path, index=False)


__all__ = ["cells", "frame", "markdown_table", "text_table", "write_csv"]
