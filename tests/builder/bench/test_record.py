"""The benchmark record (builder.bench.record): the current line of each figure is its latest, the repository's
record reads cleanly, and the command prints the current figures as a table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from builder.bench.record import latest_figures, main

ROOT = Path(__file__).resolve().parents[3]


def _line(figure: str, value: float) -> str:
    return json.dumps({"figure": figure, "value": value, "unit": "tok/s", "device": "GPU", "date": "2026-11-30T00:00"})


def test_the_latest_line_of_a_figure_is_its_value(tmp_path, capsys):
    record = tmp_path / "r.jsonl"
    record.write_text("\n".join([_line("decode_b1_bf16", 1.0), _line("ttft_128_bf16", 9.0), "",
                                 _line("decode_b1_bf16", 2.0)]) + "\n")
    assert [(r["figure"], r["value"]) for r in latest_figures(record)] == [("decode_b1_bf16", 2.0),
                                                                          ("ttft_128_bf16", 9.0)]
    assert [r["figure"] for r in latest_figures(record, ["ttft"])] == ["ttft_128_bf16"]
    assert main(["--record", str(record), "decode"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2:] == ["| decode_b1_bf16 | 2.0 | tok/s | GPU | 2026-11-30 |"]


@pytest.mark.parametrize("bad, message", [("{not json", "r.jsonl:2: not a JSON line"),
                                          ('{"value": 3}', "r.jsonl:2: not a figure"),
                                          ("[1, 2]", "r.jsonl:2: not a figure")])
def test_a_bad_line_is_named(tmp_path, bad, message):
    record = tmp_path / "r.jsonl"
    record.write_text(_line("a", 1.0) + "\n" + bad + "\n")
    with pytest.raises(ValueError, match=message):
        latest_figures(record)


def test_the_repositorys_record_reads_cleanly():
    rows = latest_figures(ROOT / "docs" / "benchmarks.jsonl")
    assert len(rows) > 100
    for row in rows:
        assert isinstance(row["value"], (int, float)) and row["unit"] and row["device"] and row["command"], row
