"""Ray Data with one `remask.LLM` per actor, on a local Ray instance with 2 CPU actors: the same
answers as one process, in input order."""
from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

import remask  # noqa: E402
from remask.integrations.ray import generate  # noqa: E402
from remask.zoo import tasks  # noqa: E402


def test_two_actors_equal_one_process():
    prompts = [p.prompt for p in tasks.problems(12, tasks.EVAL_SEED)]
    params = dict(max_tokens=16, steps=16, block_length=8, temperature=0.6, seed=3)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        rows = generate(prompts, "tiny-llada", params, num_actors=2, batch_size=4, chat=True)
    finally:
        ray.shutdown()
    want = remask.LLM("tiny-llada").generate(prompts, remask.SamplingParams(**params), use_tqdm=False, chat=True)
    assert [r["prompt"] for r in rows] == prompts
    assert [r["text"] for r in rows] == [o.outputs[0].text for o in want]
    assert [r["token_ids"] for r in rows] == [o.outputs[0].token_ids for o in want]
    with pytest.raises(ValueError, match="num_actors"):
        generate(prompts, "tiny-llada", params, num_actors=0)
