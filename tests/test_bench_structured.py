"""bench/structured.py runs (its --quick smoke run) and reports each section."""
from __future__ import annotations

import importlib.util
import os

import pytest

pytest.importorskip("llguidance")


def test_structured_bench_smoke(tmp_path):
    path = os.path.join(os.path.dirname(__file__), "..", "bench", "structured.py")
    spec = importlib.util.spec_from_file_location("bench_structured", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "structured.md"
    report = bench.main(["--quick", "--out", str(out)])
    assert out.read_text() == report
    for heading in ("Matcher cost per engine step", "Engine throughput", "JSON form"):
        assert heading in report
    assert "| tiny-llada | 3 | 3/3 |" in report or "| tiny-llada | 3 |" in report
    assert "False" not in report.split("## Engine throughput")[1].split("##")[0]   # engine answers = sequential
