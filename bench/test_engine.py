"""pytest-benchmark: 64 requests on tiny-llada through `LLMEngine` against sequential
`remask.generate` calls (the fuller table, 1…256 requests and tiny-ar, is `bench/engine.py`)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

import remask

sys.path.insert(0, os.path.dirname(__file__))
from conftest import no_roofline, run  # noqa: E402
from engine import LLADA_MIX, UNCACHED_MIX, engine_run, requests, sequential  # noqa: E402


@pytest.fixture(scope="module")
def tiny_llada():
    torch.set_num_threads(1)
    return remask.load("tiny-llada")


@pytest.mark.parametrize("mix_name,mix", [("uncached", UNCACHED_MIX), ("mixed", LLADA_MIX)])
@pytest.mark.parametrize("how", ["sequential", "engine", "engine-not-invariant"])
def test_engine_64_requests(benchmark, tiny_llada, how, mix_name, mix):
    model, tokenizer = tiny_llada
    reqs = requests(64, mix, 16)
    reference = sequential(model, reqs, ar=False)["rows"]
    info = dict(group=f"engine 64 requests, {mix_name} mix", kernel="engine", impl=how, baseline="sequential",
                requests=64, mix=mix_name)
    if how == "sequential":
        result = run(benchmark, lambda: sequential(model, reqs, ar=False), **info)
    else:
        result = run(benchmark, lambda: engine_run(model, tokenizer, reqs, how == "engine"), **info)
    assert result["rows"] == reference     # identical tokens: the comparison is of equal work
    no_roofline(benchmark, "end to end: 64 requests through the scheduler, no per-call cost model")
