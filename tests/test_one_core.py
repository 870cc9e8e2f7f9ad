"""One decoding core (issue 30): every method runs step by step in the engine, one forward per
engine step, with the tokens of its drop-in function; the engine interleaves them with other
requests, streams their final blocks, and holds expensive steps back by cost (`cost_stride`)."""
from __future__ import annotations

import warnings

import pytest
import torch

import remask
from remask.diffusion.methods import decoders
from remask.diffusion.parts import stepper
from remask.engine import LLMEngine, SamplingParams
from remask.zoo import charset

pytestmark = pytest.mark.filterwarnings("ignore:gen_length=")

METHODS = {
    "freedave": dict(decoder=remask.FreeDave(), block_length=16),
    "freedave_dual": dict(decoder=remask.FreeDave(), block_length=16, use_cache="dual"),
    "threshold": dict(decoder=remask.ThresholdDecoding(threshold=0.7), block_length=16),
    "credit": dict(decoder=remask.CreditDecoding(), block_length=16),
    "hierarchical": dict(decoder=remask.HierarchicalDecoding(), block_length=16),
    "vicinity": dict(use_cache=remask.VicinityCache(prefix_look=4, after_look=4, warmup_steps=2), block_length=16),
    "wino": dict(decoder=remask.WINO(), block_length=16),
    "multiblock": dict(decoder=remask.MultiBlock(threshold=0.1), block_length=8),
    "dkv": dict(use_cache=remask.DKVCache(), steps=32, block_length=16),
    "dkv_random": dict(use_cache=remask.DKVCache(), steps=32, block_length=16, remasking="random", seed=7),
    "d2cache": dict(use_cache=remask.D2Cache(), steps=32, block_length=16),
    # top-1 per forward: the threshold rule decodes this prompt in 3 forwards, as many as the short
    # request's, and a request finishes in the step of its last forward
    "elastic": dict(use_cache=remask.ElasticCache(threshold=None)),
}


@pytest.fixture(scope="module")
def llada():
    model, tokenizer = remask.load("tiny-llada")
    return model, tokenizer


def prompt_ids(text: str = "sort 52814") -> list[int]:
    return charset.encode_chat(text)


def drop_in(model, ids: list[int], settings: dict) -> list[int]:
    """`remask.generate` with the settings a `SamplingParams` of them means (32 tokens)."""
    kwargs = {k: v for k, v in settings.items() if k != "seed"}
    kwargs.setdefault("steps", 32)
    kwargs.setdefault("block_length", 32)
    generator = torch.Generator().manual_seed(settings["seed"]) if "seed" in settings else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = remask.generate(model, torch.tensor([ids]), gen_length=32, generator=generator, **kwargs)
    return out[0, len(ids):].tolist()


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list]:
    """Run to the end; per request: its outputs in order (one per step that reported it)."""
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    seen: dict[str, list] = {rid: [] for rid in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    return seen


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_steps_in_the_engine_with_its_drop_in_tokens(llada, method):
    """Engine tokens == the drop-in function's; the method's request takes one forward per engine
    step (many steps, never its whole generation in one); a short request queued beside it
    finishes first, with the tokens it has alone."""
    model, tokenizer = llada
    settings = METHODS[method]
    ids = prompt_ids()
    expected = drop_in(model, ids, settings)
    engine = LLMEngine(model, tokenizer, cost_stride=False)
    short = SamplingParams(max_tokens=8, block_length=8, threshold=0.9, use_cache="dual", seed=1)
    before = engine.runner.forwards
    seen = run(engine, {"method": (ids, SamplingParams(max_tokens=32, temperature=0.0, **settings)),
                        "short": (prompt_ids("add 31 4"), short)})
    final = seen["method"][-1]
    assert final.finished and final.outputs[0].error is None
    assert final.outputs[0].all_token_ids == expected
    nfe = final.outputs[0].nfe
    assert nfe > 1 and engine.runner.forwards - before >= nfe          # its forwards, one per step
    assert seen["short"][-1].finished
    assert seen["short"][-1].metrics["finish_time"] < final.metrics["finish_time"]
    alone = run(LLMEngine(model, tokenizer), {"short": (prompt_ids("add 31 4"), short)})
    assert alone["short"][-1].outputs[0].all_token_ids == seen["short"][-1].outputs[0].all_token_ids


def test_a_method_step_is_at_most_one_forward(llada):
    """`StepwiseDecoder.step` advances the method's generator by one forward: counted on the model."""
    model, _ = llada
    calls = []
    handle = model.register_forward_hook(lambda *a: calls.append(1))
    try:
        engine = LLMEngine(model)
        engine.add_request("a", prompt_ids(), SamplingParams(max_tokens=32, **METHODS["freedave_dual"]))
        per_step = []
        while engine.has_unfinished_requests():
            calls.clear()
            engine.step()
            per_step.append(len(calls))
    finally:
        handle.remove()
    assert max(per_step) == 1 and sum(per_step) > 4


def test_method_requests_stream_each_block_when_it_is_final(llada):
    """A block method's request reports its first block before it finishes (streaming), and what
    it reported never changes."""
    model, tokenizer = llada
    seen = run(LLMEngine(model, tokenizer), {"a": (prompt_ids(), SamplingParams(
        max_tokens=32, block_length=8, decoder=remask.FreeDave()))})["a"]
    partial = [out.outputs[0].all_token_ids for out in seen if not out.finished]
    assert partial, "no block was reported before the request finished"
    final = seen[-1].outputs[0].all_token_ids
    assert min(len(tokens) for tokens in partial) < 32
    for tokens in partial:
        assert 0 < len(tokens) <= 32 and tokens == final[:len(tokens)]


def test_drop_in_and_engine_drive_the_same_generator():
    """`run_decoder` is `drive(decoder_steps(...))`, and no run-to-end path is left."""
    assert not hasattr(decoders, "RunToEndDecoder") and not hasattr(decoders, "RunToEndState")
    steps = iter([stepper.Progress(torch.zeros(1, 3, dtype=torch.long))])

    def gen():
        yield from steps
        return torch.ones(1, 3, dtype=torch.long)

    assert stepper.drive(gen()).tolist() == [[1, 1, 1]]

    def broken():
        yield stepper.Progress(torch.zeros(1, 1))

    with pytest.raises(RuntimeError, match="return its output"):
        stepper.drive(broken())


def test_bad_method_settings_are_refused_at_add_request_before_any_forward(llada):
    model, tokenizer = llada
    engine = LLMEngine(model, tokenizer)
    before = engine.runner.forwards
    with pytest.raises(ValueError, match="block_length"):
        engine.add_request("a", prompt_ids(), SamplingParams(max_tokens=32, block_length=16,
                                                             use_cache=remask.ElasticCache()))
    with pytest.raises(ValueError, match="WINO"):
        engine.add_request("b", prompt_ids(), SamplingParams(max_tokens=32, block_length=16, decoder=remask.WINO(),
                                                             use_cache="dual"))
    assert engine.runner.forwards == before and not engine.has_unfinished_requests()


def test_cost_stride_holds_expensive_steps_back_without_changing_tokens(llada):
    """Beside cheap requests, a request whose steps compute many times their positions runs once
    every ⌊ratio⌋ steps: the cheap ones finish in fewer engine steps than with plain continuous
    batching, and every request's tokens are the same either way."""
    model, tokenizer = llada
    requests = {"long": (prompt_ids(), SamplingParams(max_tokens=64, block_length=32, decoder=remask.FreeDave())),
                **{f"s{i}": (prompt_ids(f"add {i} 7"), SamplingParams(max_tokens=8, block_length=8, threshold=0.9,
                                                                     use_cache="dual", seed=i)) for i in range(4)}}
    results = {}
    for stride in (True, False):
        engine = LLMEngine(model, tokenizer, cost_stride=stride)
        step, finished = 0, {}
        for rid, (ids, params) in requests.items():
            engine.add_request(rid, ids, params)
        while engine.has_unfinished_requests():
            step += 1
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = (step, out.outputs[0].all_token_ids)
        results[stride] = finished
    assert {r: t for r, (_, t) in results[True].items()} == {r: t for r, (_, t) in results[False].items()}
    short_steps = {stride: max(s for r, (s, _) in res.items() if r != "long") for stride, res in results.items()}
    assert short_steps[True] <= short_steps[False]
    assert results[True]["long"][0] > results[False]["long"][0]       # the long one was held back
    with pytest.raises(ValueError, match="cost_stride"):
        LLMEngine(model, tokenizer, cost_stride="yes")


def test_similar_requests_are_never_held(llada):
    """Requests of one kind step together every step with cost_stride on (no straggler)."""
    model, tokenizer = llada
    params = SamplingParams(max_tokens=16, block_length=8, steps=16)
    engine = LLMEngine(model, tokenizer)
    for i in range(4):
        engine.add_request(f"r{i}", prompt_ids(f"sort {i}{i + 3}"), params)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    assert steps == 16
