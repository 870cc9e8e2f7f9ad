"""Host synchronisations per decoding step (issue 31): counted by `SyncCounter`. The bar is at most
one per step: none for LLaDA's schedule (with or without a cache), one for a parallel rule (is the
block decoded?). bench/step_overhead.py reports them with the step's host overhead."""
from __future__ import annotations

import pytest
import torch

import remask
from remask.diffusion.families.llada import BlockDecoder
from remask.diffusion.parts.stats import SyncCounter
from remask.diffusion.parts.stepper import step_alone
from remask.models.spec import get_spec
from remask.zoo import charset

from remask.diffusion.parts.stats import GenerationStats

# case -> (settings, most host waits in one step)
CASES = {
    "no cache": (dict(steps=16, gen_length=16, block_length=8), 0),
    "prefix cache": (dict(steps=16, gen_length=16, block_length=8, use_cache="prefix"), 0),
    "dual cache": (dict(steps=16, gen_length=16, block_length=8, use_cache="dual"), 0),
    "threshold, dual cache": (dict(steps=16, gen_length=16, block_length=8, use_cache="dual", threshold=0.9), 1),
    "factor, no cache": (dict(steps=16, gen_length=16, block_length=8, factor=1.0), 1),
}


def test_the_counter_sees_every_kind_of_host_wait():
    t = torch.tensor([1.0, 0.0, 2.0])
    with SyncCounter() as counter:
        t.item() if t.numel() == 1 else t[0].item()
        t.tolist()
        t.cpu()
        bool(t[0])
        t.nonzero()
        torch.nonzero(t)
        int(t[2])
        float(t[1])
        t + 1                      # not a host wait
    assert counter.counts == {"item": 1, "tolist": 1, "cpu": 1, "bool": 1, "nonzero": 2, "int": 1, "float": 1}
    assert counter.total == 8


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_step_waits_for_the_host_at_most_once(case):
    settings, most = CASES[case]
    model, _ = remask.load("tiny-llada")
    decoder = BlockDecoder(get_spec(model), **settings)
    state = decoder.start(torch.tensor([charset.encode_chat("sort 52814")]))
    stats = GenerationStats()      # counting a step's commits must not read them back either
    per_step = []
    with torch.no_grad():
        while not state.done:
            with SyncCounter() as counter:
                step_alone(decoder, model, state, None, stats)
            per_step.append(counter.total)
    assert len(per_step) >= 2 and max(per_step) <= most, per_step
    assert sum(stats.tokens_per_step) == 16 and len(stats.tokens_per_step) == len(per_step)


def test_step_counts_kept_on_the_device_are_read_once_when_asked():
    stats = GenerationStats()
    stats.step(torch.tensor(3))
    stats.step(2)
    stats.step(torch.tensor([1]).sum())
    assert stats.num_steps == 3
    with SyncCounter() as counter:
        assert stats.tokens_per_step == [3, 2, 1]
        assert stats.tokens_per_step == [3, 2, 1] and stats.mean_tokens_per_step == 2
    assert counter.total == 1          # one read for the pending counts, none after
    other = GenerationStats()
    other.add_steps(stats, since=1)
    assert other.tokens_per_step == [2, 1]
