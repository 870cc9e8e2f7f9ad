"""Helpers shared by the tests: the tiny checkpoints' definitions, prompts and padding."""
from __future__ import annotations

import torch

from remask.models import tiny

# name -> (writer, kwargs). "llada" and "dream" use the official vocabularies and special ids.
CHECKPOINTS = {
    "llada": (tiny.write_tiny_llada, dict(seed=0)),
    "llada_gqa_tied": (tiny.write_tiny_llada, dict(seed=1, shards=2, n_kv_heads=2, weight_tying=True, vocab_size=1000,
                                                   embedding_size=1000, mask_token_id=999, eos_token_id=998,
                                                   pad_token_id=998)),
    "llada_small": (tiny.write_tiny_llada, dict(seed=3, vocab_size=300, embedding_size=300, mask_token_id=299,
                                                eos_token_id=298, pad_token_id=297, eot_token_id=296)),
    "dream": (tiny.write_tiny_dream, dict(seed=2)),
    # LM-head bias on EOS (126081) and EOT (126348): these become frequent predictions.
    "llada_eos": (tiny.write_tiny_llada, dict(seed=5, include_bias=True, logit_bias={126081: 11.5, 126348: 11.8})),
    "dream_small": (tiny.write_tiny_dream, dict(seed=4, vocab_size=300, mask_token_id=299, eos_token_id=298,
                                                pad_token_id=298, bos_token_id=298)),
}


def random_prompt(batch: int, length: int, seed: int, high: int = 290) -> torch.Tensor:
    return torch.randint(0, high, (batch, length), generator=torch.Generator().manual_seed(seed))


def left_pad(rows: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad 1-D id tensors to one length; returns (ids, attention_mask)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = r
        mask[i, width - len(r):] = 1
    return ids, mask


_FIXTURE_MODELS: dict[str, torch.nn.Module] = {}


def load_fixture_checkpoint(tmp_path_factory, checkpoints: dict, name: str) -> torch.nn.Module:
    """The tiny checkpoint a reference fixture names (`meta.checkpoints[name]`: the writer's kwargs, its
    name when not `write_tiny_llada`, and the weights' digest), written and loaded once per session and
    shared by every test file that names the same weights."""
    from transformers import AutoModel

    ck = checkpoints[name]
    if ck["digest"] not in _FIXTURE_MODELS:
        path = tmp_path_factory.mktemp(name)
        writer = getattr(tiny, ck.get("writer", "write_tiny_llada"))
        assert writer(str(path), **ck["kwargs"]) == ck["digest"], "the tiny writer changed"
        _FIXTURE_MODELS[ck["digest"]] = AutoModel.from_pretrained(str(path)).eval()
    return _FIXTURE_MODELS[ck["digest"]]


def margin_case(fixture: str, case: dict) -> None:
    """Marks the start of a reference case for the decision-margin recorder (a no-op unless
    REMASK_MARGINS_OUT is set; tests/fixture_margins.py writes the margins into the fixture)."""
    from remask.margins import DecisionMargins

    if DecisionMargins._active:
        DecisionMargins.mark(f"{fixture}:{case_key(case)}")


# Keys a margin run adds to a case: left out of its key, so a case keeps its key once they are in.
MARGIN_KEYS = ("min_margin",)


def case_key(case: dict) -> str:
    import hashlib
    import json

    body = {k: v for k, v in case.items() if k not in MARGIN_KEYS}
    return hashlib.sha1(json.dumps(body, sort_keys=True).encode()).hexdigest()[:12]


def as_progress(steps, model):
    """A step generator seen as before forwards became requests: it yields each `Progress` (one
    forward at most between two of them) and returns the output; every `ForwardRequest` is answered
    alone by the drop-in driver (`stepper.run_forwards`), so a hook on the model counts forwards, and `Together`
    work alone (as `stepper.drive` does)."""
    from remask.diffusion.parts.stepper import ForwardRequest, Together, run_forwards

    answer = None
    while True:
        try:
            item = steps.send(answer)
        except StopIteration as stop:
            return stop.value
        if isinstance(item, ForwardRequest):
            answer = run_forwards(model, [item])[0]
        elif isinstance(item, Together):
            answer = item.alone()
        else:
            answer = None
            yield item


class Server:
    """A uvicorn server for `app` on 127.0.0.1 (a free port) in a daemon thread, started within 30 s;
    `stop()` ends it (graceful shutdown bounded to 10 s)."""

    def __init__(self, app) -> None:
        import threading
        import time

        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                                    timeout_graceful_shutdown=10))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "the server did not start"
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def rule_on_sdar_drop_in_equals_engine(model: torch.nn.Module, rule: object) -> None:
    """`decoder=rule` on SDAR's own loop: the drop-in `sdar_generate` and the engine give the same
    tokens, with no mask token among them."""
    import remask
    from remask.diffusion.families.sdar import sdar_generate
    from remask.models import get_spec

    prompt, mask = random_prompt(1, 6, seed=6, high=250), get_spec(model).mask_id
    llm = remask.LLM(model)
    x = sdar_generate(model, prompt, mask_id=mask, gen_length=12, block_length=4, temperature=0.0,
                      stopping_criteria_idx=sorted(set(llm.engine.stop_ids)), decoder=rule)
    served = llm.generate([prompt[0].tolist()], remask.SamplingParams(
        max_tokens=12, temperature=0.0, decoder=remask.SDARDecoding(block_length=4, rule=rule)), use_tqdm=False)[0]
    assert served.outputs[0].all_token_ids == x[0, 6:18].tolist() and mask not in served.outputs[0].all_token_ids
