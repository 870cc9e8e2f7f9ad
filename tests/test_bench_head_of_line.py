"""`bench/head_of_line.py` runs (a smoke test: one method, two short requests), with structured
requests in the mix too: the short requests' tokens do not change beside the long request."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import head_of_line  # noqa: E402


def test_head_of_line_runs_plain_and_structured(tmp_path, capsys):
    for extra in ([], ["--structured"]):
        out = tmp_path / f"hol{len(extra)}.md"
        assert head_of_line.main(["--short", "2", "--long-tokens", "32", "--methods", "WINO", "--repeats", "1",
                                  "--out", str(out), *extra]) == 0
        text = out.read_text()
        assert "| WINO |" in text and "identical beside every method: yes" in text
        assert ("Structured requests in the mix" in text) == bool(extra)
