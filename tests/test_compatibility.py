"""docs/compatibility.md is what the code says (`python -m remask.engine.compatibility`)."""
from __future__ import annotations

import os

import pytest

from remask.engine import compatibility

DOC = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "compatibility.md")


@pytest.fixture(scope="module")
def table():
    return compatibility.matrix()


def test_the_committed_matrix_is_generated_from_the_code(table):
    with open(DOC, encoding="utf-8") as f:
        committed = f.read()
    assert committed == compatibility.markdown(table), \
        "docs/compatibility.md is stale: run python -m remask.engine.compatibility --out docs/compatibility.md"


def test_every_refusal_names_what_conflicts(table):
    """No cell is an internal error: each "no" is a refusal that names a setting or a part."""
    names = ("use_cache", "decoder", "alg", "threshold", "does not read", "logit_shift")
    for setting in compatibility.SETTINGS:
        for method, row in table[setting].items():
            for family, value in row.items():
                assert value == "yes" or (value.startswith("no: ") and any(n in value for n in names)), \
                    (setting, method, family, value)


def test_each_method_runs_on_its_own_family_and_each_family_runs_its_own_rule(table):
    table = table["plain"]
    assert all(value == "yes" for value in table["the family's own rule (LLaDA: low-confidence blocks)"].values())
    # every method's paper used LLaDA; a refused pair of parts is refused on every family; a family's own loop's
    # config (`decoder=`) runs on that family only
    families = {"SDARDecoding": "sdar", "LLaDA2Decoding": "llada2_moe", "FastDLLMV2Decoding": "fast_dllm_v2",
                "CanvasDecoding": "diffusion_gemma"}
    assert all(row["llada"] == "yes" for name, row in table.items()
               if name not in ("dKV-Cache + dInfer ThresholdDecoding", *families))
    for name, family in families.items():
        assert [f for f, value in table[name].items() if value == "yes"] == [family], name
    assert all(value.startswith("no: ") for value in table["dKV-Cache + dInfer ThresholdDecoding"].values())
    assert table["Elastic-Cache + dInfer HierarchicalDecoding"]["llada"] == "yes"
    # The combinations no paper shipped (tests/test_combinations.py, tests/test_rules_on_blocks.py).
    for rule in ("dInfer ThresholdDecoding", "dInfer CreditDecoding", "dInfer HierarchicalDecoding"):
        assert table[rule]["Dream"] == table[rule]["sdar"] == table[rule]["llada2_moe"] == "yes"


def test_structured_output_goes_wherever_the_method_goes(table):
    """Every family and every method enforce a JSON schema (docs/serving.md): adding one to a request
    changes no cell of the table."""
    assert table["structured_outputs"] == table["plain"]


def test_the_generator_writes_the_file(tmp_path, table, monkeypatch):
    monkeypatch.setattr(compatibility, "matrix", lambda: table)
    out = tmp_path / "m.md"
    assert compatibility.main(["--out", str(out)]) == 0
    assert out.read_text(encoding="utf-8") == compatibility.markdown(table)
