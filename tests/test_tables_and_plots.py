"""What the commands write besides their text: `--csv` (the `--json` rows as CSV, through pandas) and
`--plot` (PNGs drawn by matplotlib, the optional extra `plot`), the one-line error where matplotlib is
missing, and the table helpers of `soapflow.tables`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd
import pytest
from test_cli import run_cli, run_json

from soapflow.tables import frame, markdown_table, text_table

PNG = b"\x89PNG\r\n\x1a\n"
NEEDS_MATPLOTLIB = "the plots are drawn with matplotlib (pip install 'soapflow[plot]')"


def read_csv_rows(path: Path) -> list[dict]:
    """The CSV's rows as dicts, an empty field as None (as in the JSON)."""
    df = pd.read_csv(path, float_precision="round_trip", keep_default_na=False, na_values=[""])
    return [{k: None if pd.isna(v) else v for k, v in row.items()} for row in df.to_dict("records")]


def assert_same_rows(csv_rows: list[dict], json_rows: list[dict]) -> None:
    assert len(csv_rows) == len(json_rows)
    for got, want in zip(csv_rows, json_rows, strict=True):
        assert list(got) == list(want)
        for key, value in want.items():
            if isinstance(value, list):
                assert json.loads(got[key]) == value, key
            else:
                assert got[key] == value, key


def synthetic_validate_report() -> dict:
    from soapflow.validate import _summary

    rows = [{"model": model, "strategy": s, "predicted_ms": p, "measured_ms": m, "error": (p - m) / m}
            for model, s, p, m in (("mlp", "dp", 10.0, 11.0), ("mlp", "mp", 20.5, 19.0),
                                   ("mlp", "random3", 14.25, 15.0), ("cnn", "dp", 5.0, 5.5), ("cnn", "tp", 7.5, 6.0))]
    return {"topology": "machine", "topology_ref": "machine.json", "calibrated": True, "nproc": 2, "steps": 3,
            "rounds": 2, "seed": 0, "setup": {}, "rows": rows, **_summary(rows, "predicted_ms"), "elapsed_s": 1.0}


def assert_matplotlib_png(path: Path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG)
    assert len(data) > 8_000  # axes, labels and data, not an empty canvas
    assert b"Matplotlib" in data  # the Software text chunk matplotlib writes


# ------------------------------------------------------------------------------------------------------ CSV


def test_compare_csv_rows_are_the_json_rows(capsys, tmp_path):
    path = tmp_path / "rows.csv"
    doc = run_json(capsys, "compare", "mlp", "--batch", "8", "-t", "cpu-2", "-s", "tp", "--csv", str(path))
    assert_same_rows(read_csv_rows(path), doc["rows"])
    code, out, err = run_cli(capsys, "compare", "mlp", "--batch", "8", "-t", "cpu-2", "--csv", str(path))
    assert code == 0 and f"rows written to {path}" in out, err
    assert [r["strategy"] for r in read_csv_rows(path)] == ["dp", "mp", "tp", "expert", "fsdp"]


def test_validate_csv_rows_are_the_json_rows(capsys, tmp_path, monkeypatch):
    import soapflow.validate

    report = synthetic_validate_report()
    monkeypatch.setattr(soapflow.validate, "validate", lambda *args, **kwargs: report)
    path = tmp_path / "rows.csv"
    doc = run_json(capsys, "validate", "mlp", "cnn", "-t", "cpu-2", "--csv", str(path))
    assert_same_rows(read_csv_rows(path), doc["rows"])


@pytest.mark.slow
def test_validate_csv_end_to_end(capsys, tmp_path):
    path = tmp_path / "rows.csv"
    doc = run_json(capsys, "validate", "mlp", "-t", "cpu-2", "--batch", "8", "--strategies", "2", "--steps", "1",
                   "--csv", str(path))
    assert len(doc["rows"]) == 2
    assert_same_rows(read_csv_rows(path), doc["rows"])


def test_a_csv_file_that_cannot_be_written_is_one_line(capsys, tmp_path):
    code, _, err = run_cli(capsys, "compare", "mlp", "--batch", "8", "-t", "cpu-2", "--csv",
                           str(tmp_path / "no" / "such" / "dir.csv"))
    assert code == 1 and len(err.strip().splitlines()) == 1 and err.startswith("soapflow: error:"), err


# ---------------------------------------------------------------------------------------------------- plots


def test_optimize_plot_is_a_matplotlib_png(capsys, tmp_path):
    pytest.importorskip("matplotlib", reason=NEEDS_MATPLOTLIB)
    path = tmp_path / "conv.png"
    code, out, err = run_cli(capsys, "optimize", "mlp", "--batch", "8", "-t", "cpu-2", "--proposals", "200",
                             "-o", str(tmp_path / "best.json"), "--plot", str(path))
    assert code == 0 and f"convergence plot written to {path}" in out, err
    assert_matplotlib_png(path)


def test_compare_plot_is_a_matplotlib_png(capsys, tmp_path):
    pytest.importorskip("matplotlib", reason=NEEDS_MATPLOTLIB)
    path = tmp_path / "bars.png"
    doc = run_json(capsys, "compare", "mlp", "--batch", "8", "-t", "cpu-2", "-s", "tp", "--plot", str(path))
    assert doc["plot"] == str(path)
    assert_matplotlib_png(path)


def test_validate_scatter_plot_is_a_matplotlib_png(tmp_path):
    pytest.importorskip("matplotlib", reason=NEEDS_MATPLOTLIB)
    from soapflow.validate import write_scatter_plot

    path = tmp_path / "scatter.png"
    write_scatter_plot(path, synthetic_validate_report())
    assert_matplotlib_png(path)


@pytest.mark.parametrize("argv", [
    ["optimize", "no_such_model", "-t", "cpu-2"],
    ["compare", "no_such_model", "-t", "cpu-2"],
    ["validate", "no_such_model", "-t", "cpu-2"],
])
def test_plot_without_matplotlib_is_one_line_before_any_work(capsys, tmp_path, monkeypatch, argv):
    """With matplotlib not importable, `--plot` fails first (not on the model, which does not exist either)
    with one line naming the extra to install."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    path = tmp_path / "plot.png"
    code, out, err = run_cli(capsys, *argv, "--plot", str(path))
    assert code == 1 and out == ""
    assert err.splitlines() == ["soapflow: error: --plot needs matplotlib, which is not installed: "
                                "pip install 'soapflow[plot]'"]
    assert not path.exists()


# --------------------------------------------------------------------------------------------------- tables


def test_text_and_markdown_tables_from_a_frame():
    df = frame([{"name": "dp", "ms": 12.5, "note": "ok"}, {"name": "tensor", "ms": None, "note": "x"}])
    assert list(df.columns) == ["name", "ms", "note"]
    assert text_table(df, {"ms": "{:.1f}".format}).splitlines() == [
        "name      ms  note",
        "------  ----  ----",
        "dp      12.5  ok",
        "tensor     -  x",
    ]
    assert markdown_table(df, {"ms": "{:.1f}".format}, right=["ms"]).splitlines() == [
        "| name | ms | note |",
        "|---|---:|---|",
        "| dp | 12.5 | ok |",
        "| tensor | - | x |",
    ]
