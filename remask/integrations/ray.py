"""Ray Data: decode a dataset beyond one machine with one `remask.LLM` per actor (the `ray` extra).

    import ray, remask
    from remask.integrations.ray import LLMPredictor

    ds = ray.data.read_json("prompts.jsonl")                      # a "prompt" column
    ds = ds.map_batches(LLMPredictor, fn_constructor_kwargs=dict(model="tiny-llada", chat=True,
                        params=dict(max_tokens=16, steps=16, block_length=8)),
                        concurrency=4, batch_size=64, num_cpus=1)
    ds.write_json("answers/")

Each actor loads the model once and decodes its batches through its own engine (continuous
batching inside the actor). A row's answer does not depend on which actor or batch it lands in
(seeded, batch-invariant requests), so the results equal one process's. `generate` is the same
for a list of prompts, in input order.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

import remask
from remask.engine import SamplingParams


class LLMPredictor:
    """A Ray Data callable class: `model` (a shipped name or a checkpoint folder on every node),
    `params` (a `SamplingParams` or a dict of its fields), `chat` (wrap each prompt in the chat
    template), other keywords for `remask.LLM`. Adds `text`, `token_ids`, `finish_reason`, `nfe`."""

    def __init__(self, model: str, params: SamplingParams | dict[str, Any] | None = None, chat: bool = False,
                 **llm_kwargs: Any) -> None:
        self.params = params if isinstance(params, SamplingParams) else SamplingParams(**(params or {}))
        self.chat = chat
        self.llm = remask.LLM(model, **llm_kwargs)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if "prompt" not in batch:
            raise ValueError(f"the dataset needs a 'prompt' column, has {sorted(batch)}")
        prompts = [str(p) for p in batch["prompt"]]
        outs = self.llm.generate(prompts, self.params, use_tqdm=False, chat=self.chat)
        first = [o.outputs[0] for o in outs]
        token_ids = np.empty(len(first), dtype=object)
        token_ids[:] = [list(o.token_ids) for o in first]
        return {**batch, "text": np.array([o.text for o in first], dtype=object), "token_ids": token_ids,
                "finish_reason": np.array([o.finish_reason for o in first], dtype=object),
                "nfe": np.array([o.nfe for o in first])}


def generate(prompts: Sequence[str], model: str, params: SamplingParams | dict[str, Any] | None = None, *,
             num_actors: int = 2, batch_size: int = 16, chat: bool = False, **llm_kwargs: Any) -> list[dict[str, Any]]:
    """Decode `prompts` on `num_actors` Ray actors (one CPU each; `ray.init` first, or Ray starts a
    local instance); returns one dict per prompt, in input order."""
    import ray

    if not isinstance(num_actors, int) or num_actors < 1:
        raise ValueError(f"num_actors must be an int >= 1, got {num_actors!r}")
    ds = ray.data.from_items([{"row": i, "prompt": p} for i, p in enumerate(prompts)])
    ds = ds.map_batches(LLMPredictor, fn_constructor_kwargs=dict(model=model, params=params, chat=chat, **llm_kwargs),
                        concurrency=num_actors, batch_size=batch_size, num_cpus=1)
    rows = sorted(ds.take_all(), key=lambda r: r["row"])
    return [{"prompt": r["prompt"], "text": r["text"], "token_ids": list(r["token_ids"]),
             "finish_reason": r["finish_reason"], "nfe": int(r["nfe"])} for r in rows]
