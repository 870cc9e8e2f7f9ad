"""`bench/engine.py --per-method` runs (a smoke test on two methods and two requests): every
method's engine tokens equal its drop-in calls', and the table holds the columns the issue asks."""
from __future__ import annotations

import sys
from pathlib import Path

import remask

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import engine as bench  # noqa: E402


def test_per_method_bench_runs_and_its_tokens_match(monkeypatch):
    ar, _ = remask.load("tiny-ar")
    names = {"WINO", "threshold 0.9 + dual cache"}
    chosen = [s for s in bench.method_settings(ar) if s[0] in names]
    monkeypatch.setattr(bench, "method_settings", lambda verifier: chosen)
    rows = bench.per_method([2], 16, 1)
    canvas = "DiffusionGemma canvas (random tiny)"
    assert {r["method"] for r in rows} == names | {"AR (tiny-ar)", canvas}
    assert all(r["identical"] and 0 < r["host_share"] < 1 for r in rows)
    # one call per step; DiffusionGemma's: its decoder forwards (with self-conditioning logits and without) and its
    # encoder forwards of one length
    assert all(r["calls_per_step"] <= (3.0 if r["method"] == canvas else 1.0) + 1e-9 for r in rows)
    # the diffusion rows attend in the packed forward (part of it); the AR row's attention is the paged route's,
    # DiffusionGemma's transformers' own (not clocked)
    assert all(0 < r["attention_share"] < 1 - r["host_share"] for r in rows if r["method"] in names)
    table = bench.per_method_table(rows, "python bench/engine.py --per-method")
    assert all(column in table for column in ("model calls per step", "invariance cost", "host share",
                                              "attention share")) and table.count("\n|") == len(rows) + 2


def test_every_row_of_the_per_method_bench_is_a_valid_request():
    """Each row's settings build `SamplingParams` (the rows a registered method adds included: a model family's own
    config, which runs only on its family, is not one of them)."""
    ar, _ = remask.load("tiny-ar")
    settings = bench.method_settings(ar)
    for label, kw in settings:
        remask.SamplingParams(max_tokens=32, seed=0, **kw)
    labels = [label for label, _ in settings]
    assert len(labels) == len(set(labels)) and "KLASS" in labels and "APD" in labels
    assert not {"SDARDecoding", "LLaDA2Decoding", "FastDLLMV2Decoding", "CanvasDecoding"} & set(labels)


def test_the_forward_clock_counts_each_outermost_call_once(monkeypatch):
    """A module called inside another clocked one (an encoder in its model's forward) is not counted twice; called
    alone (DiffusionGemma's canvas loop runs its encoder so), it is counted."""
    import torch

    ticks = iter(range(100))
    monkeypatch.setitem(bench.CLOCK, "now", lambda: float(next(ticks)))
    inner = torch.nn.Linear(2, 2)
    outer = torch.nn.Sequential(inner, torch.nn.ReLU())
    clock = bench.ForwardClock([outer, inner])
    outer(torch.zeros(1, 2))      # pre(outer)=0, [inner nested: no reads], post(outer)=1
    inner(torch.zeros(1, 2))      # 2 → 3
    clock.close()
    outer(torch.zeros(1, 2))      # not clocked
    assert clock.calls == 2 and clock.seconds == 2.0
    canvas_model, _ = bench.canvas_model()
    if canvas_model is not None:
        assert remask.models.get_spec(canvas_model).encoder in bench.forward_modules(canvas_model, {})
