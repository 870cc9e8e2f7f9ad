"""Packed forwards (issues 31, 38): diffusion requests of different lengths share one flat forward
(`stepper.run_forwards` → `varlen.PackedAttention`), each request's logits bit for bit its own
forward's, and the engine's tokens stay each request's drop-in tokens."""
from __future__ import annotations

import importlib

import pytest
import torch

import remask
from remask.diffusion.parts.stepper import ForwardRequest, run_forwards
from remask.diffusion.parts.varlen import PackedAttention, Segment
from remask.engine import LLMEngine, SamplingParams
from remask.kernels.batch_invariant import batch_invariant_linear
from remask.models import tiny
from remask.models.spec import get_spec
from remask.zoo import charset, tasks

LENGTHS = (30, 23, 30, 41, 23, 1)


def invariant(rows, groups=None):
    return batch_invariant_linear(True, single_thread=True, token_groups=groups)


@pytest.fixture(scope="module")
def llada():
    return remask.load("tiny-llada")


@pytest.fixture(scope="module")
def dream(tmp_path_factory):
    path = tmp_path_factory.mktemp("dream")
    tiny.write_tiny_dream(str(path), seed=4, vocab_size=300, mask_token_id=299, eos_token_id=298)
    return remask.load(str(path))[0]


def _requests(spec, xs):
    return [ForwardRequest.call(x, spec.forward_inputs(None, x.shape[1]), spec=spec) for x in xs]


def _canvases(high: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, high, (1, n), generator=g) for n in LENGTHS]


@pytest.mark.parametrize("which", ["llada", "dream"])
def test_each_sequence_gets_its_own_forwards_logits(request, which):
    model = request.getfixturevalue(which)
    model = model[0] if isinstance(model, tuple) else model
    spec = get_spec(model)
    xs = _canvases(min(spec.vocab_size, 290) - 2)
    alone = [run_forwards(model, [r])[0] for r in _requests(spec, xs)]
    packed = run_forwards(model, _requests(spec, xs), invariant)
    loose = run_forwards(model, _requests(spec, xs))
    for a, p, q in zip(alone, packed, loose):
        assert torch.equal(p, a)          # bitwise with each request's own GEMM problems
        torch.testing.assert_close(q, a)


def test_attention_stays_inside_each_sequence(llada):
    model, _ = llada
    spec = get_spec(model)
    xs = _canvases(90)[:3]
    changed = [xs[0], xs[1].clone(), xs[2]]
    changed[1][0, 3] = (changed[1][0, 3] + 1) % 90      # another sequence's token: no effect on the first
    a = run_forwards(model, _requests(spec, xs))
    b = run_forwards(model, _requests(spec, changed))
    assert torch.equal(a[0], b[0]) and torch.equal(a[2], b[2]) and not torch.equal(a[1], b[1])


def test_refusals(llada):
    with pytest.raises(ValueError, match="segment"):
        PackedAttention([Segment(0, 1, 2)]).attend(0, *(torch.zeros(1, 1, 2, 4),) * 3, 0, torch.zeros(1, 1, 2, 2))
    ar_model, _ = remask.load("tiny-ar")
    with pytest.raises(ValueError, match="segmented"):
        run_forwards(ar_model, [ForwardRequest(torch.zeros(1, 3, dtype=torch.long))] * 2)
    assert ForwardRequest(torch.zeros(1, 3, dtype=torch.long), shared=dict(block_size=4)).pack_key() is None


MIXES = {
    "llada rules": [dict(steps=16, block_length=8), dict(steps=16, block_length=8, threshold=0.9),
                    dict(steps=16, block_length=4, factor=1.0), dict(steps=16, block_length=8, temperature=0.7)],
    "dream sampler": [dict(alg="entropy"), dict(alg="maskgit_plus", temperature=0.6, top_p=0.9),
                      dict(alg="confidence_threshold", threshold=0.8)],
}


@pytest.mark.parametrize("batch_invariant", [True, False])
@pytest.mark.parametrize("mix", sorted(MIXES))
def test_engine_shares_one_forward_across_lengths_with_each_requests_tokens(llada, mix, batch_invariant):
    model, tokenizer = llada
    problems = tasks.problems(8, tasks.EVAL_SEED)
    requests = [(charset.encode_chat(p.prompt), SamplingParams(max_tokens=16, seed=i, **MIXES[mix][i % len(MIXES[mix])]))
                for i, p in enumerate(problems)]
    assert len({len(ids) for ids, _ in requests}) > 1            # several lengths
    engine = LLMEngine(model, tokenizer, batch_invariant=batch_invariant)
    for i, (ids, params) in enumerate(requests):
        engine.add_request(str(i), ids, params)
    got, steps = {}, 0
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out.outputs[0].token_ids
    assert engine.runner.forwards == steps      # one forward per engine step for all of them
    for i, (ids, params) in enumerate(requests):
        prompt = torch.tensor([ids])
        generator = torch.Generator().manual_seed(params.seed)
        if params.alg is not None:
            out = remask.diffusion_generate(model, prompt, generator=generator, **params.diffusion_generate_kwargs())
        else:
            out = remask.generate(model, prompt, generator=generator, **params.generate_kwargs())
        want = out[0, prompt.shape[1]:].tolist()
        assert len(got[str(i)]) > 0 and charset.MASK_ID not in got[str(i)]
        if batch_invariant:    # bitwise; without invariance the packed GEMMs may round otherwise
            assert got[str(i)] == want[:len(got[str(i)])], i


def test_elastic_forwards_pack_bit_for_bit_though_their_rows_change_between_layers(llada):
    """Elastic-Cache's forwards (rows queried, then every position from the first recomputed
    layer on) packed with each other and with a plain request: each gets the logits, the trace and
    the recompute layer of its own forward."""
    from remask.diffusion.methods.elastic import elastic_steps
    from remask.diffusion.parts.stepper import Progress

    model, _ = llada
    prompts = [torch.randint(5, 60, (1, n), generator=torch.Generator().manual_seed(n)) for n in (9, 14)]
    configs = [remask.ElasticCache(window_length=8, gamma=0.999, threshold=None),
               remask.ElasticCache(window_length=8, gamma=0.0, threshold=None)]

    def next_request(gen, answer=None):
        item = gen.send(answer)
        while isinstance(item, Progress):
            item = next(gen)
        return item

    def at_third_forward():
        gens, traces, requests = [], [], []
        for prompt, config in zip(prompts, configs):
            traces.append([])
            gens.append(elastic_steps(get_spec(model), prompt, config=config, gen_length=24, eos_id=99,
                                      trace=traces[-1]))
            request = next_request(gens[-1])
            for _ in range(2):
                request = next_request(gens[-1], run_forwards(model, [request])[0])
            requests.append(request)
        return gens, requests, traces

    gens, requests, traces = at_third_forward()
    alone = [run_forwards(model, [r])[0] for r in requests]
    for g, a in zip(gens, alone):
        next_request(g, a)
    gens, requests, packed_traces = at_third_forward()
    plain = ForwardRequest(torch.randint(5, 60, (1, 17), generator=torch.Generator().manual_seed(3)))
    packed = run_forwards(model, [requests[0], plain, requests[1]], invariant)
    for g, p in zip(gens, (packed[0], packed[2])):
        next_request(g, p)
    assert all(torch.equal(a, p) for a, p in zip(alone, (packed[0], packed[2])))
    assert torch.equal(packed[1], run_forwards(model, [plain])[0])
    assert traces == packed_traces
    layers = len(model.model.transformer.blocks)
    assert traces[0][-1][1] < layers and traces[1][-1][1] == layers, "one forward recomputes layers, the other none"


def test_attention_calls_are_the_requests_own_when_not_batched(monkeypatch):
    """`batch_calls=False` (CUDA under batch invariance): each request's attention is one call of its
    own shape, as alone; with batching, requests of one shape share a call; the outputs agree."""
    import remask.diffusion.parts.varlen as varlen

    g = torch.Generator().manual_seed(5)
    segments = [Segment(0, 1, 7), Segment(7, 2, 5), Segment(17, 1, 7), Segment(24, 1, 3)]
    q, k, v = (torch.randn(1, 2, 27, 8, generator=g) for _ in range(3))
    calls = []
    real = varlen.attention
    monkeypatch.setattr(varlen, "attention", lambda q_, *a: calls.append(tuple(q_.shape)) or real(q_, *a))
    batched = PackedAttention(segments).attend(0, q, k, v, 0, None)
    assert sorted(calls) == [(1, 2, 3, 8), (2, 2, 5, 8), (2, 2, 7, 8)]
    calls.clear()
    own = PackedAttention(segments, batch_calls=False).attend(0, q, k, v, 0, None)
    assert sorted(calls) == [(1, 2, 3, 8), (1, 2, 7, 8), (1, 2, 7, 8), (2, 2, 5, 8)]
    assert torch.equal(batched, own)


def varlen_calls(monkeypatch) -> list[int]:
    """Each `varlen_attention` call's query rows, while the test runs."""
    kernel = importlib.import_module("remask.kernels.varlen_attention")   # (the package exports the function)
    calls, real = [], kernel.varlen_attention
    monkeypatch.setattr(kernel, "varlen_attention", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    return calls


def _with_attention_counted(monkeypatch):
    """Count `varlen_attention` calls of the packed route; any per-request SDPA call fails the test."""
    import remask.diffusion.parts.varlen as varlen

    monkeypatch.setattr(varlen, "attention", lambda *a: pytest.fail("a request attended alone on the varlen route"))
    return varlen_calls(monkeypatch)


@pytest.mark.parametrize("which", ["llada", "dream"])
def test_varlen_route_gives_each_request_its_bits_alone_or_packed_with_1_7_63(request, which):
    """`varlen=True`: a request's logits are bitwise the same alone (a pack of one) and packed with 1, 7 and 63
    others of other lengths (the kernel's per-row reduction order), and close to the per-request SDPA route."""
    model = request.getfixturevalue(which)
    model = model[0] if isinstance(model, tuple) else model
    spec = get_spec(model)
    g = torch.Generator().manual_seed(7)
    high = min(spec.vocab_size, 290) - 2
    xs = [torch.randint(0, high, (1, int(n)), generator=g) for n in torch.randint(1, 48, (64,), generator=g)]
    alone = run_forwards(model, _requests(spec, xs[:1]), invariant, varlen=True)[0]
    # another float32 summation order than SDPA's: close, not equal
    torch.testing.assert_close(alone, run_forwards(model, _requests(spec, xs[:1]), invariant)[0], atol=1e-4, rtol=1e-4)
    for n in (2, 8, 64):
        packed = run_forwards(model, _requests(spec, xs[:n]), invariant, varlen=True)
        assert torch.equal(packed[0], alone), n
    for x, own in zip(xs[:8], packed):
        assert torch.equal(own, run_forwards(model, _requests(spec, [x]), invariant, varlen=True)[0])


def test_varlen_route_leaves_the_other_caches_and_float_masks_their_own_attention(llada, monkeypatch):
    """A request whose attention cannot be a varlen segment (here a float bias) attends alone, as on the
    per-request route, bit for bit; the others of its pack share the one call."""
    model, _ = llada
    spec = get_spec(model)
    xs = _canvases(90)[:3]
    bias = torch.zeros(1, 1, xs[1].shape[1], xs[1].shape[1])
    bias[..., 0] = -1.0e4                                   # a real additive bias: no boolean mask says it
    requests = lambda: [*_requests(spec, xs[:1]), ForwardRequest(xs[1], per_row=dict(attention_bias=bias)),
                        *_requests(spec, xs[2:])]
    plain = run_forwards(model, requests(), invariant)
    calls = varlen_calls(monkeypatch)
    routed = run_forwards(model, requests(), invariant, varlen=True)
    assert torch.equal(routed[1], plain[1])
    for i in (0, 2):
        torch.testing.assert_close(routed[i], plain[i], atol=1e-4, rtol=1e-4)
    assert calls == [xs[0].shape[1] + xs[2].shape[1]] * len(model.model.transformer.blocks)


def varlen_engine_tokens(model, tokenizer, prompts, params, indices) -> tuple[dict[int, list[int]], int]:
    """`LLMEngine(varlen_attention=True)` on requests `indices`: each one's generated ids, and the model calls."""
    engine = LLMEngine(model, tokenizer, varlen_attention=True)
    for i in indices:
        engine.add_request(str(i), prompts[i], params[i])
    got = {}
    while engine.has_unfinished_requests():
        got.update({int(o.request_id): o.outputs[0].token_ids for o in engine.step() if o.finished})
    return got, engine.runner.forwards


ROUTED = {   # LLaDA's and Dream's settings whose caches join the varlen route: none, prefix, dual, methods' own KVCache
    "low-confidence": dict(block_length=8, steps=16),
    "threshold + prefix cache": dict(block_length=8, threshold=0.9, use_cache="prefix"),
    "threshold + dual cache": dict(block_length=8, threshold=0.9, use_cache="dual"),
    "FreeDave + dual cache": dict(block_length=8, decoder=remask.FreeDave(), use_cache="dual"),
    "dInfer threshold": dict(block_length=8, decoder=remask.ThresholdDecoding()),
    "MultiBlock + its KV cache": dict(block_length=8, decoder=remask.MultiBlock(cache_delay_iter=1)),
    "Dream's sampler": dict(alg="entropy"),
    "Dream block decoder + dual cache": dict(alg="entropy", block_length=8, use_cache="dual"),
}


@pytest.mark.parametrize("setting", sorted(ROUTED))
def test_engine_varlen_route_is_one_attention_call_per_layer_whatever_the_requests(llada, monkeypatch, setting):
    """`LLMEngine(varlen_attention=True)`: every layer of every engine step attends in ONE call, for one request or
    five of different lengths, and each request's tokens are the same alone as among the five."""
    model, tokenizer = llada
    layers = len(model.model.transformer.blocks)
    problems = tasks.problems(5, tasks.EVAL_SEED)
    prompts = [charset.encode_chat(p.prompt) for p in problems]
    assert len({len(p) for p in prompts}) > 1

    params = [SamplingParams(max_tokens=16, seed=i, **ROUTED[setting]) for i in range(5)]
    run = lambda indices: varlen_engine_tokens(model, tokenizer, prompts, params, indices)   # noqa: E731
    calls = _with_attention_counted(monkeypatch)
    together, forwards = run(range(5))
    assert len(calls) == layers * forwards
    for i in (0, 3):
        calls.clear()
        alone, forwards = run([i])
        assert alone[i] == together[i] and charset.MASK_ID not in alone[i]
        assert len(calls) == layers * forwards


def test_engine_varlen_route_on_an_autoregressive_model_reads_the_page_store_in_place(monkeypatch):
    """tiny-ar with `varlen_attention=True`: each layer of each step (new prompts — some sharing a system prompt's
    pages — and one token of every running sequence) is ONE call over the page store; each request's tokens are
    the same alone as among the others, and, greedy or seeded, the default route's."""
    model, tokenizer = remask.load("tiny-ar")
    layers = model.config.num_hidden_layers
    system = charset.encode_chat("You are a careful assistant. Answer briefly and exactly.")[:-2]
    prompts = [(system if i % 2 else []) + charset.encode_chat(p.prompt)
               for i, p in enumerate(tasks.problems(8, tasks.EVAL_SEED))]
    params = [SamplingParams(max_tokens=16, seed=i, temperature=0.0 if i % 3 else 0.8) for i in range(8)]
    default = LLMEngine(model, tokenizer)
    for i in range(8):
        default.add_request(str(i), prompts[i], params[i])
    want = {}
    while default.has_unfinished_requests():
        want.update({int(o.request_id): o.outputs[0].token_ids for o in default.step() if o.finished})
    calls = varlen_calls(monkeypatch)
    together, forwards = varlen_engine_tokens(model, tokenizer, prompts, params, range(8))
    assert len(calls) == layers * forwards and together == want
    for i in (0, 5):
        calls.clear()
        alone, forwards = varlen_engine_tokens(model, tokenizer, prompts, params, [i])
        assert alone[i] == together[i] and len(calls) == layers * forwards


def test_engine_varlen_route_takes_apds_verifier_too(llada, monkeypatch):
    """APD with `varlen_attention=True`: the dLLM's packed forwards and the verifier's flat forwards over the
    sequences' own caches each attend in ONE call per layer; tokens the same alone as among six."""
    model, tokenizer = llada
    verifier = remask.load("tiny-ar")[0]
    prompts = [charset.encode_chat(p.prompt) for p in tasks.problems(6, tasks.EVAL_SEED)]
    params = [SamplingParams(max_tokens=24, seed=i, decoder=remask.APDConfig(verifier=verifier)) for i in range(6)]
    forwards = {model: 0, verifier: 0}
    for module in forwards:
        monkeypatch.setattr(module, "forward", lambda *a, _f=module.forward, _m=module, **k: (
            forwards.__setitem__(_m, forwards[_m] + 1), _f(*a, **k))[1])
    calls = varlen_calls(monkeypatch)
    together, _ = varlen_engine_tokens(model, tokenizer, prompts, params, range(6))
    assert forwards[verifier] > 0
    layers = {model: len(model.model.transformer.blocks), verifier: verifier.config.num_hidden_layers}
    assert len(calls) == sum(n * layers[m] for m, n in forwards.items())
    for i in (0, 4):
        assert varlen_engine_tokens(model, tokenizer, prompts, params, [i])[0][i] == together[i]


def test_varlen_attention_refused_where_there_is_no_packed_forward(tmp_path):
    import transformers

    with pytest.raises((TypeError, ValueError), match="varlen_attention"):
        LLMEngine(*remask.load("tiny-llada"), varlen_attention="yes")
    if not hasattr(transformers, "DiffusionGemmaForBlockDiffusion"):
        pytest.skip("this transformers has no DiffusionGemma")
    tiny.write_tiny_diffusion_gemma(str(tmp_path), seed=1, charset=charset)
    with pytest.raises(ValueError, match="varlen_attention=True: the 'diffusion_gemma' model"):
        LLMEngine(*remask.load(str(tmp_path)), varlen_attention=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_varlen_route_on_gpu_gives_each_request_its_tokens_alone_or_among_eight(monkeypatch):
    """On CUDA the route's attention is the Triton kernel (compiled): one launch per layer per step, and each
    request's tokens the same alone as among eight of mixed settings and lengths."""
    model, tokenizer = remask.load("tiny-llada", device="cuda")
    layers = len(model.model.transformer.blocks)
    prompts = [charset.encode_chat(p.prompt) for p in tasks.problems(8, tasks.EVAL_SEED)]
    settings = [ROUTED[name] for name in sorted(ROUTED)]

    params = [SamplingParams(max_tokens=16, seed=i, **settings[i]) for i in range(8)]
    run = lambda indices: varlen_engine_tokens(model, tokenizer, prompts, params, indices)   # noqa: E731
    calls = _with_attention_counted(monkeypatch)
    together, forwards = run(range(8))
    assert len(calls) == layers * forwards
    for i in range(8):
        assert run([i])[0][i] == together[i], sorted(ROUTED)[i]
