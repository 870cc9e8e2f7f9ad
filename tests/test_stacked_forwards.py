"""The stacked route of `stepper.run_forwards` (the block-causal models, not `spec.segmented`):
requests whose caches pack (`BlockBatch`, Fast-dLLM v2's `BlockRows`) run as ONE call on their rows
stacked, each getting the logits of its own forward and storing as its own forward stores; in the
engine, the block forwards of every running request — each at its own block, plain loops and
FreeDave's drafts alike — are one model call per step."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.cache_utils import DynamicCache

import remask
from remask.caches.block import _cached
from remask.diffusion.parts.blocks import block_request
from remask.diffusion.parts.stepper import ForwardRequest, run_forwards
from remask.models.request import stacked_key
from remask.kernels.batch_invariant import batch_invariant_linear
from remask.models import tiny

WRITERS = {"sdar": tiny.write_tiny_sdar, "llada2": tiny.write_tiny_llada2, "fast_dllm_v2": tiny.write_tiny_fast_dllm_v2}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    loaded = {}

    def get(name):
        if name not in loaded:
            path = tmp_path_factory.mktemp(name)
            WRITERS[name](str(path), seed=0)
            loaded[name] = AutoModelForCausalLM.from_pretrained(str(path)).eval()
        return loaded[name]
    return get


def invariant(rows, token_groups=None):   # the runner's batch invariance on CPU
    return batch_invariant_linear(rows > 1, single_thread=True)


def test_stacked_requests_get_their_own_forwards(models):
    """A store, a denoising step and two drafts, each against its own cache of another length,
    stacked into one call: each request's logits and cache are bitwise those of its own forward."""
    model = models("sdar")
    x = torch.randint(0, 250, (1, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16)[None]

    def requests():
        caches = []
        for n in (4, 8, 0):
            cache = DynamicCache()
            if n:
                model(x[:, :n], position_ids=positions[:, :n], past_key_values=cache, use_cache=True, store_kv=True)
            caches.append(cache)
        drafts = x[:, 0:4].repeat(2, 1)
        drafts[1, 2] = 7
        return caches, [block_request(x[:, 4:8], positions[:, 4:8], caches[0], True),
                        block_request(x[:, 8:12], positions[:, 8:12], caches[1], False),
                        block_request(drafts, positions[:, 0:4], caches[2], False)]

    with torch.no_grad():
        own_caches, own = requests()
        alone = [run_forwards(model, [r], invariant)[0] for r in own]
        caches, stacked = requests()
        keys = {stacked_key(r) for r in stacked}
        assert len(keys) == 1 and None not in keys and all(r.pack_key() == stacked_key(r) for r in stacked)
        together = run_forwards(model, stacked, invariant)
    for a, b in zip(alone, together):
        assert a.shape == b.shape and torch.equal(a, b)
    assert [c.get_seq_length() for c in caches] == [c.get_seq_length() for c in own_caches] == [8, 8, 0]
    assert torch.equal(_cached(caches[0], 0)[0], _cached(own_caches[0], 0)[0])
    # a request of several rows that does not ask for each row alone, or a tensor shared input, runs alone
    assert stacked_key(ForwardRequest.call(x[:, :8].view(2, 4), {}, cache=stacked[0].cache)) is None
    assert stacked_key(ForwardRequest.call(x[:, :4], {}, cache=stacked[0].cache, extra=torch.ones(2))) is None


@pytest.mark.parametrize("name,settings", [
    ("sdar", dict(block_length=4)),
    ("llada2", dict(block_length=4)),
    ("fast_dllm_v2", {}),
])
def test_engine_runs_one_call_per_step(models, name, settings):
    """Prompts of at most one whole block (no prefill longer than a block): every engine step is one
    model call for all requests, plain loops and FreeDave (its drafts) together, and each request's
    tokens are those it gets alone."""
    model = models(name)
    prompts = [torch.randint(0, 250, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in range(3, 8)]
    config = {"sdar": remask.SDARDecoding, "llada2": remask.LLaDA2Decoding, "fast_dllm_v2": remask.FastDLLMV2Decoding}[name]
    plain = remask.SamplingParams(max_tokens=8, temperature=0.0, decoder=config(**settings))
    fd = remask.SamplingParams(max_tokens=8, temperature=0.0,
                               decoder=config(rule=remask.FreeDave(draft_steps=3), **settings))
    params = [plain if i % 2 else fd for i in range(len(prompts))]
    llm = remask.LLM(model)
    engine = llm.engine
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, p)
    outputs, steps = {}, 0
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
        steps += 1
    assert engine.runner.forwards <= steps   # a step whose requests all rest or settle calls nothing
    assert engine.runner.forwards < sum(o.outputs[0].nfe for o in outputs.values())
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        alone = llm.generate([prompt], p, use_tqdm=False)[0].outputs[0].all_token_ids
        assert outputs[str(i)].outputs[0].all_token_ids == alone, i


@pytest.mark.parametrize("name", ["sdar", "llada2", "fast_dllm_v2"])
def test_engine_varlen_route_is_one_attention_call_per_layer(models, monkeypatch, name):
    """`LLMEngine(varlen_attention=True)` on a block-causal model: every stacked forward (plain block steps, stores,
    FreeDave's drafts) attends in ONE `varlen_attention` call per layer (SDAR, LLaDA2: each row's cache read in
    place from the page store; Fast-dLLM v2: its prefix caches pooled, under its block masks), and each request's
    tokens are the same alone as among the others."""
    from test_varlen import varlen_calls, varlen_engine_tokens

    model = models(name)
    layers = model.config.num_hidden_layers
    prompts = [torch.randint(0, 250, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in range(3, 8)]
    config = {"sdar": remask.SDARDecoding, "llada2": remask.LLaDA2Decoding, "fast_dllm_v2": remask.FastDLLMV2Decoding}
    settings = {} if name == "fast_dllm_v2" else dict(block_length=4)
    params = [remask.SamplingParams(max_tokens=8, temperature=0.0, decoder=config[name](**settings, **(
        {} if i % 2 else dict(rule=remask.FreeDave(draft_steps=3))))) for i in range(len(prompts))]
    calls = varlen_calls(monkeypatch)

    run = lambda indices: varlen_engine_tokens(model, None, prompts, params, indices)   # noqa: E731
    together, forwards = run(range(len(prompts)))
    assert len(calls) == layers * forwards and max(calls) > 4   # several requests' blocks in one call
    for i in (0, 3):
        calls.clear()
        alone, forwards = run([i])
        assert alone[i] == together[i] and len(calls) == layers * forwards
