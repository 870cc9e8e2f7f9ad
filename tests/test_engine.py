"""`remask.LLM` / `LLMEngine`: batched, continuously scheduled decoding whose tokens never depend on
the batch — each request's tokens are exactly those of `remask.generate` / `ar_generate` on its
prompt alone with the same seed, whether it is submitted with 63 others, in shuffled order, or
alone; requests join and leave between steps; bad requests and failing requests stay local."""
from __future__ import annotations

import copy
import random

import pytest
import torch

import remask
from remask.diffusion.parts.stepper import ForwardRequest, run_forwards
from remask.engine import EngineState, LLMEngine, SamplingParams, SequenceStatus
from remask.models.hf_compat import output_cache
from remask.models import tiny
from transformers import AutoModel
from remask.zoo import charset, tasks

PROBLEMS = [charset.encode_chat(p.prompt) for p in tasks.problems(64, tasks.EVAL_SEED)]


@pytest.fixture(scope="module")
def llada():
    return remask.load("tiny-llada")


@pytest.fixture(scope="module")
def ar():
    return remask.load("tiny-ar")


def mixed_params(i: int) -> SamplingParams:
    """Request i's settings: the LLaDA rules, caches and sampling, cycled."""
    kinds = [
        dict(steps=16, block_length=8),                                           # low-confidence
        dict(steps=8, block_length=16),
        dict(steps=16, block_length=8, threshold=0.9),                             # Fast-dLLM threshold
        dict(steps=16, block_length=4, factor=1.0),                                # Fast-dLLM factor
        dict(steps=16, block_length=8, threshold=0.9, use_cache="dual"),           # dual cache
        dict(steps=16, block_length=8, use_cache="prefix"),
        dict(steps=16, block_length=8, temperature=0.7),                           # seeded sampling
        dict(steps=16, block_length=16, remasking="random"),
        dict(steps=16, block_length=8, early_stop=True),
        dict(steps=8, block_length=8, cfg_scale=0.5),
        dict(steps=16, block_length=8, sparse=remask.SparseConfig(retention_ratio=0.5)),
    ]
    return SamplingParams(max_tokens=16, seed=1000 + i, **kinds[i % len(kinds)])


def alone_llada(model, ids, params: SamplingParams, index: int = 0) -> list[int]:
    prompt = torch.tensor([ids])
    out = remask.generate(model, prompt, generator=torch.Generator().manual_seed(params.seed + index),
                          **params.generate_kwargs())
    return out[0, prompt.shape[1]:].tolist()


def run_engine(engine: LLMEngine, requests: list[tuple[str, list[int], SamplingParams]]) -> dict[str, list[int]]:
    for request_id, ids, params in requests:
        engine.add_request(request_id, ids, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def test_64_mixed_requests_equal_generate_alone_together_shuffled_and_one_by_one(llada):
    model, tokenizer = llada
    requests = [(f"r{i}", PROBLEMS[i], mixed_params(i)) for i in range(64)]
    expected = {rid: alone_llada(model, ids, p) for rid, ids, p in requests}

    together = run_engine(LLMEngine(model, tokenizer), requests)
    shuffled_requests = list(requests)
    random.Random(0).shuffle(shuffled_requests)
    shuffled = run_engine(LLMEngine(model, tokenizer, max_num_seqs=17), shuffled_requests)
    again = run_engine(LLMEngine(model, tokenizer), requests)
    for rid, _, _ in requests:
        assert together[rid].outputs[0].all_token_ids == expected[rid], rid
        assert shuffled[rid].outputs[0].all_token_ids == expected[rid], rid
        assert again[rid].outputs[0].all_token_ids == expected[rid], rid
    for rid, ids, p in requests[:12]:   # one by one
        single = run_engine(LLMEngine(model, tokenizer), [(rid, ids, p)])
        assert single[rid].outputs[0].all_token_ids == expected[rid], rid
    # the answers are the model's (not garbage): most of the greedy schedule ones are right
    problems = tasks.problems(64, tasks.EVAL_SEED)
    right = sum(problems[i].is_correct(together[f"r{i}"].outputs[0].text) for i in range(0, 64, 11))
    assert right >= 4


def test_same_request_in_batches_of_every_size_is_bitwise_the_same(llada):
    model, tokenizer = llada
    params = SamplingParams(max_tokens=16, steps=16, block_length=8, temperature=1.0, seed=7)
    target = PROBLEMS[3]
    results = []
    for size in (1, 2, 5, 16, 33):
        engine = LLMEngine(model, tokenizer)
        others = [(f"o{i}", PROBLEMS[(i + 10) % 64], params.replace(seed=i)) for i in range(size - 1)]
        position = size // 2
        batch = others[:position] + [("target", target, params)] + others[position:]
        results.append(run_engine(engine, batch)["target"].outputs[0].all_token_ids)
    assert all(r == results[0] for r in results)
    assert results[0] == alone_llada(model, target, params)


def test_n_samples_draw_from_seed_plus_index(llada):
    model, tokenizer = llada
    params = SamplingParams(max_tokens=16, steps=16, block_length=16, temperature=1.0, n=3, seed=11)
    out = run_engine(LLMEngine(model, tokenizer), [("a", PROBLEMS[5], params)])["a"]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    for i, o in enumerate(out.outputs):
        assert o.all_token_ids == alone_llada(model, PROBLEMS[5], params, index=i)


def test_ar_requests_equal_ar_generate_alone(ar):
    model, tokenizer = ar
    engine = LLMEngine(model, tokenizer)
    requests = [(f"a{i}", PROBLEMS[i], SamplingParams(max_tokens=12, seed=i, temperature=[0.0, 0.8][i % 2],
                                                      top_k=[None, 5][i % 2])) for i in range(16)]
    done = run_engine(engine, requests)
    eos = [charset.EOS_ID]
    for rid, ids, p in requests:
        prompt = torch.tensor([ids])
        alone = remask.ar_generate(model, prompt, generator=torch.Generator().manual_seed(p.seed), **p.ar_kwargs(eos))
        row = alone[0, prompt.shape[1]:].tolist()
        got = done[rid].outputs[0]
        assert got.all_token_ids == row[:len(got.all_token_ids)], rid
        if charset.EOS_ID in row:   # the engine stops at EOS, ar_generate pads after it
            assert got.token_ids == row[:row.index(charset.EOS_ID) + 1] and got.finish_reason == "stop"
        else:
            assert got.all_token_ids == row and got.finish_reason == "length"


def test_requests_join_while_others_run_and_abort_frees(llada):
    model, tokenizer = llada
    engine = LLMEngine(model, tokenizer)
    slow = SamplingParams(max_tokens=16, steps=16, block_length=4, seed=0)
    engine.add_request("first", PROBLEMS[0], slow)
    engine.step()
    engine.step()
    engine.add_request("late", PROBLEMS[1], SamplingParams(max_tokens=16, steps=16, block_length=4, seed=1))
    engine.add_request("gone", PROBLEMS[2], SamplingParams(max_tokens=16, steps=16, block_length=4, seed=2,
                                                           use_cache="dual"))
    engine.step()
    running = {s.request_id: s for s in engine.scheduler.running}
    assert {"first", "late", "gone"} <= set(running)
    assert running["late"].stats.nfe == 1 and running["first"].stats.nfe == 3   # joined without waiting
    gone = running["gone"]
    out = engine.abort_request("gone")
    assert out.outputs[0].finish_reason == "abort" and gone.status is SequenceStatus.ABORTED
    assert gone.state is None and gone not in engine.scheduler.running   # its cache is dropped
    assert engine.abort_request("gone") is None
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert set(done) == {"first", "late"}
    assert done["late"].outputs[0].all_token_ids == alone_llada(model, PROBLEMS[1], SamplingParams(
        max_tokens=16, steps=16, block_length=4, seed=1))


def test_step_reports_final_blocks_as_they_complete(llada):
    model, tokenizer = llada
    engine = LLMEngine(model, tokenizer)
    engine.add_request("s", PROBLEMS[4], SamplingParams(max_tokens=16, steps=16, block_length=4, seed=0))
    seen = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.append(len(out.outputs[0].all_token_ids))
    assert seen == [4, 8, 12, 16]   # a block's tokens are reported once the block is decoded


def test_final_only_reports_each_request_once_at_its_end_with_the_cumulative_tokens(llada, ar, monkeypatch):
    requests = [("d", PROBLEMS[4], dict(max_tokens=16, steps=16, block_length=4, seed=0, n=2, temperature=0.7)),
                ("t", PROBLEMS[5], dict(max_tokens=16, steps=16, block_length=8, threshold=0.9, use_cache="dual"))]
    runs = {}
    for kind in ("cumulative", "final_only"):
        engine = LLMEngine(*llada)
        for request_id, ids, kwargs in requests:
            engine.add_request(request_id, ids, SamplingParams(output_kind=kind, **kwargs))
        reports = []
        while engine.has_unfinished_requests():
            reports += engine.step()
        runs[kind] = reports
    assert len(runs["cumulative"]) > 2                                  # the block rule reports as blocks finish
    assert sorted(o.request_id for o in runs["final_only"]) == ["d", "t"] and all(o.finished for o in runs["final_only"])
    last = {o.request_id: [c.all_token_ids for c in o.outputs] for o in runs["cumulative"] if o.finished}
    assert {o.request_id: [c.all_token_ids for c in o.outputs] for o in runs["final_only"]} == last
    ar_engine = LLMEngine(*ar)
    ar_engine.add_request("a", PROBLEMS[0], SamplingParams(max_tokens=6, output_kind="final_only"))
    seen = []
    while ar_engine.has_unfinished_requests():
        seen += ar_engine.step()
    assert [o.finished for o in seen] == [True] and len(seen[0].outputs[0].all_token_ids) >= 1
    kinds = []                                                          # LLM.generate asks for final outputs only
    add = LLMEngine.add_request
    monkeypatch.setattr(LLMEngine, "add_request",
                        lambda self, request_id, prompt, params=None, **kw: (kinds.append(params.output_kind),
                                                                             add(self, request_id, prompt, params, **kw)))
    llm = remask.LLM(*llada)
    out = llm.generate([PROBLEMS[5]], SamplingParams(**requests[1][2]), use_tqdm=False)
    assert kinds == ["final_only"] and [c.all_token_ids for c in out[0].outputs] == last["t"]
    with pytest.raises(ValueError, match="output_kind"):
        engine.add_request("x", PROBLEMS[0], SamplingParams(output_kind="final_only"), drafts=True)
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="delta")


@pytest.mark.parametrize("make,match", [
    (lambda: SamplingParams(max_tokens=0), "max_tokens"),
    (lambda: SamplingParams(max_tokens=16, block_length=5), "block_length"),
    (lambda: SamplingParams(max_tokens=16, steps=3, block_length=8), "steps"),
    (lambda: SamplingParams(temperature=float("inf")), "temperature"),
    (lambda: SamplingParams(use_cache="dual", sparse=remask.SparseConfig()), "sparse"),
    (lambda: SamplingParams(stop=[""]), "stop"),
    (lambda: SamplingParams(stop_token_ids=[-1]), "stop_token_ids"),
    (lambda: SamplingParams(seed=-1), "seed"),
    (lambda: SamplingParams(n=0), "n must"),
])
def test_bad_sampling_params(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_bad_requests_are_refused_at_add_request_and_the_engine_keeps_serving(llada, ar):
    model, tokenizer = llada
    engine = LLMEngine(model, tokenizer, max_num_batched_tokens=64)
    engine.add_request("ok", PROBLEMS[0], SamplingParams(max_tokens=16, steps=16, block_length=8, seed=0))
    bad = [
        ("long", list(range(8, 8 + 120)), SamplingParams(max_tokens=16), "maximum sequence length"),
        ("big", PROBLEMS[1], SamplingParams(max_tokens=64, steps=64, block_length=64), "max_num_batched_tokens"),
        ("oov", [1, 500], SamplingParams(), "vocabulary"),
        ("masked", [1, charset.MASK_ID, 6], SamplingParams(), "mask token"),
        ("empty", [], SamplingParams(), "empty"),
        ("topk", PROBLEMS[1], SamplingParams(top_k=5), "top_k"),
        ("ok", PROBLEMS[1], SamplingParams(), "already in use"),
        ("stop-oov", PROBLEMS[1], SamplingParams(stop_token_ids=[128]), "stop_token_ids"),
    ]
    for request_id, ids, params, match in bad:
        with pytest.raises(ValueError, match=match):
            engine.add_request(request_id, ids, params)
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.add_request("typed", PROBLEMS[1], dict(max_tokens=4))
    with pytest.raises(ValueError, match="tiny-llada"):
        remask.LLM("no-such-model")
    ar_engine = LLMEngine(*ar)
    with pytest.raises(ValueError, match="threshold"):
        ar_engine.add_request("x", PROBLEMS[0], SamplingParams(threshold=0.9))
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert list(done) == ["ok"] and done["ok"].outputs[0].finish_reason in ("stop", "length")


def test_a_failing_request_fails_alone(llada, monkeypatch):
    model, tokenizer = llada
    engine = LLMEngine(model, tokenizer)
    params = SamplingParams(max_tokens=16, steps=16, block_length=8, seed=0)
    engine.add_request("good", PROBLEMS[0], params)
    engine.add_request("bad", PROBLEMS[1], params.replace(use_cache="dual"))
    engine.step()
    bad = next(s for s in engine.scheduler.running if s.request_id == "bad")

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(bad.decoder, "commit", broken)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done["bad"].outputs[0].finish_reason == "error" and "simulated" in done["bad"].outputs[0].error
    assert done["good"].outputs[0].all_token_ids == alone_llada(model, PROBLEMS[0], params)


def test_stop_strings_and_token_ids(llada):
    model, tokenizer = llada
    llm = remask.LLM(model, tokenizer)
    params = SamplingParams(max_tokens=16, steps=16, block_length=8, seed=0)
    full = llm.generate("greet Hugo", params, use_tqdm=False, chat=True)[0].outputs[0]
    assert full.text == "Hello, Hugo!" and full.finish_reason == "stop"
    cut = llm.generate("greet Hugo", params.replace(stop=[", "]), use_tqdm=False, chat=True)[0].outputs[0]
    assert cut.text == "Hello" and cut.finish_reason == "stop"
    comma = charset.CHAR_TO_ID[","]
    by_id = llm.generate("greet Hugo", params.replace(stop_token_ids=[comma]), use_tqdm=False, chat=True)[0].outputs[0]
    assert by_id.text == "Hello" and by_id.token_ids[-1] == comma


def test_llm_chat_and_text_prompts(llada):
    llm = remask.LLM("tiny-llada")
    params = SamplingParams(max_tokens=16, steps=16, block_length=8, seed=0)
    a = llm.chat([{"role": "user", "content": "sort 52814"}], params, use_tqdm=False)
    b = llm.generate("sort 52814", params, use_tqdm=False, chat=True)
    c = llm.generate([charset.encode_chat("sort 52814")], params, use_tqdm=False)
    assert a[0].outputs[0].text == b[0].outputs[0].text == c[0].outputs[0].text == "12458"
    assert c[0].prompt is None and b[0].prompt_token_ids == charset.encode_chat("sort 52814")
    m = a[0].metrics
    assert 0 <= m["time_to_first_token"] <= m["latency"]


def test_llm_generate_is_all_or_nothing(llada):
    llm = remask.LLM(*llada)
    params = SamplingParams(max_tokens=16, steps=16, block_length=8, seed=0)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([PROBLEMS[0], PROBLEMS[1], [1, 500]], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests() and not llm.engine.requests
    assert llm.generate([], params, use_tqdm=False) == []
    with pytest.raises(ValueError, match="2 entries for 1 prompts"):
        llm.generate([PROBLEMS[0]], [params, params], use_tqdm=False)


def test_engine_states(llada):
    engine = LLMEngine(*llada)
    assert engine.state is EngineState.READY
    engine.add_request("a", PROBLEMS[0], SamplingParams(max_tokens=16, steps=16, block_length=16, seed=0))
    engine.drain()
    with pytest.raises(RuntimeError, match="draining"):
        engine.add_request("b", PROBLEMS[1], SamplingParams())
    while engine.has_unfinished_requests():
        engine.step()
    engine.shutdown()
    assert engine.state is EngineState.SHUT_DOWN


@pytest.mark.parametrize("length", [2, 3, 5, 17])
@pytest.mark.parametrize("batch", [2, 7])
def test_batch_invariant_forward_is_bitwise_the_forward_alone(llada, length, batch):
    """The model's logits for a sequence in a batched forward, under `batch_invariant_linear`,
    are bitwise its logits alone — also for the shortest sequences, where a plain batched GEMM
    takes another kernel path than the 1–3-row GEMM of the sequence alone."""
    from remask.kernels.batch_invariant import batch_invariant_linear

    model = llada[0]
    x = torch.randint(8, 100, (batch, length), generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        with batch_invariant_linear():
            batched = model(x).logits
        alone = torch.cat([model(x[i:i + 1]).logits for i in range(batch)])
    assert torch.equal(batched, alone)


DREAM_KINDS = [dict(alg="entropy"), dict(alg="maskgit_plus", temperature=0.6, top_p=0.9),
               dict(alg="topk_margin", temperature=0.8, top_k=20), dict(alg="origin", temperature=0.5),
               dict(alg="entropy", alg_temp=0.4, temperature=0.3), dict(alg="confidence_threshold", threshold=0.8),
               dict(alg="maskgit_plus", eps=0.2, steps=4),
               # Fast-dLLM's Dream block decoder
               dict(alg="confidence_threshold", threshold=0.8, block_length=4, use_cache="dual"),
               dict(alg="entropy", block_length=4), dict(alg="maskgit_plus", temperature=0.5, block_length=4,
                                                         use_cache="prefix")]


@pytest.mark.parametrize("which", ["tiny-llada", "dream_small"])
def test_dream_sampler_requests_equal_diffusion_generate_alone(llada, load_model, which):
    """Dream's sampler (`alg=`) and Fast-dLLM's Dream block decoder (`alg=` with `block_length` /
    `use_cache`) in the engine, on tiny-llada and on a random Dream checkpoint (logit shift, "full"
    attention inputs): each request's tokens are `diffusion_generate`'s alone."""
    model, tokenizer = llada if which == "tiny-llada" else (load_model("dream_small"), None)
    high = 100 if which == "tiny-llada" else 290
    g = torch.Generator().manual_seed(5)
    prompts = [PROBLEMS[i] if which == "tiny-llada" else torch.randint(0, high, (5 + i % 4,), generator=g).tolist()
               for i in range(30)]
    requests = [(f"d{i}", prompts[i], SamplingParams(max_tokens=8, seed=50 + i,
                                                     **{"steps": 8, **DREAM_KINDS[i % len(DREAM_KINDS)]}))
                for i in range(30)]
    done = run_engine(LLMEngine(model, tokenizer), requests)
    for rid, ids, p in requests:
        prompt = torch.tensor([ids])
        alone = remask.diffusion_generate(model, prompt, generator=torch.Generator().manual_seed(p.seed),
                                          **p.diffusion_generate_kwargs())
        assert done[rid].outputs[0].all_token_ids == alone[0, prompt.shape[1]:].tolist(), rid


def test_dream_sampler_params_are_checked():
    with pytest.raises(ValueError, match="factor"):
        SamplingParams(alg="entropy", factor=1.0)
    with pytest.raises(ValueError, match="threshold"):
        SamplingParams(alg="entropy", threshold=0.9)
    with pytest.raises(ValueError, match="alg="):
        SamplingParams(alg_temp=0.5)
    with pytest.raises(ValueError, match="alg"):
        SamplingParams(alg="greedy")


def alone_ar(model, ids: list[int], params: SamplingParams) -> list[int]:
    prompt = torch.tensor([ids])
    return remask.ar_generate(model, prompt, generator=torch.Generator().manual_seed(params.seed),
                              **params.ar_kwargs([charset.EOS_ID]))[0, prompt.shape[1]:].tolist()


def assert_ar_equal(got, alone: list[int], rid: str) -> None:
    """The engine stops at EOS; `ar_generate` pads after it."""
    assert got.all_token_ids == alone[:len(got.all_token_ids)], rid
    assert len(got.all_token_ids) == len(alone) or alone[len(got.all_token_ids) - 1] == charset.EOS_ID, rid


def test_ar_requests_of_mixed_lengths_run_as_one_flat_forward_per_step(ar, monkeypatch):
    """12 prompts of different lengths, mixed settings and budgets (they finish at different
    steps), one aborted and one failing mid-run: one model call per step for all of them (no
    padding), the rest equal `ar_generate` alone, and every page comes back."""
    model, tokenizer = ar
    engine = LLMEngine(model, tokenizer)
    requests = []
    for i in range(12):
        params = SamplingParams(max_tokens=[3, 8, 16][i % 3], seed=i, temperature=[0.0, 0.9][i % 2],
                                top_p=[None, 0.8][i % 2])
        requests.append((f"g{i}", PROBLEMS[i], params))
        engine.add_request(*requests[-1])
    assert len({len(ids) for _, ids, _ in requests}) > 3
    done = {o.request_id: o for o in engine.step() if o.finished}   # every prompt in one forward
    assert engine.runner.forwards == 1 and engine.kv_stats()["pages_in_use"] > 0
    done.update({o.request_id: o for o in engine.step() if o.finished})
    engine.abort_request("g4")
    failing = next(s for s in engine.scheduler.running if s.request_id == "g5")
    monkeypatch.setattr(failing.decoder, "sample", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done["g5"].outputs[0].finish_reason == "error" and "boom" in done["g5"].outputs[0].error
    assert "g4" not in done and engine.kv_stats()["pages_in_use"] == 0
    nfe = 0
    for rid, ids, p in requests:
        if rid not in ("g4", "g5"):
            assert_ar_equal(done[rid].outputs[0], alone_ar(model, ids, p), rid)
            nfe += done[rid].outputs[0].nfe
    assert engine.runner.forwards <= 17 < nfe
    lone = LLMEngine(model, tokenizer)
    lone.add_request("x", PROBLEMS[0], SamplingParams(max_tokens=8))
    lone.step()
    assert lone.kv_stats()["pages_in_use"] == 1
    lone.abort_request("x")                           # aborted between steps: its pages go back at once
    assert lone.kv_stats()["pages_in_use"] == 0 and not lone.has_unfinished_requests()


SYSTEM = [(7 * i + 3) % 100 + 8 for i in range(32)]   # a 32-token "system prompt": two pages of 16


def test_ar_requests_with_a_shared_system_prompt_store_it_once(ar):
    model, tokenizer = ar
    requests = [(f"s{i}", SYSTEM + PROBLEMS[i], SamplingParams(max_tokens=8, seed=i, temperature=[0.0, 0.9][i % 2]))
                for i in range(4)]
    own_pages = sum(-(-len(ids) // 16) for _, ids, _ in requests)

    engine = LLMEngine(model, tokenizer, page_size=16)
    for request in requests:
        engine.add_request(*request)
    engine.step()                                     # the four prompts, in one forward
    stats = engine.kv_stats()
    assert stats["pages_in_use"] == own_pages - 3 * 2          # the system prompt's two pages once, not four times
    assert stats["prefix_hits"] == 6 and stats["pages_unshared"] == 0
    unshared = LLMEngine(model, tokenizer, page_size=16, enable_prefix_caching=False)
    for request in requests:
        unshared.add_request(*request)
    unshared.step()
    assert unshared.kv_stats()["pages_in_use"] == own_pages and unshared.kv_stats()["prefix_hits"] == 0

    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    for rid, ids, p in requests:
        assert_ar_equal(done[rid].outputs[0], alone_ar(model, ids, p), rid)
    # A later request finds the pages kept (nobody holds them, nobody took them since).
    assert engine.kv_stats()["pages_in_use"] == 0
    late = run_engine(engine, [("late", SYSTEM + PROBLEMS[9], SamplingParams(max_tokens=8, seed=9))])
    assert engine.kv_stats()["prefix_hits"] == 8
    assert_ar_equal(late["late"].outputs[0], alone_ar(model, SYSTEM + PROBLEMS[9], SamplingParams(max_tokens=8,
                                                                                                   seed=9)), "late")


def test_a_shared_page_that_differs_is_never_used(ar):
    """Sharing is verified: a request that finds a page by prefix hash compares, layer by layer,
    what it computes with what the page holds. Here the kept pages are corrupted after their
    writer finished: the next request takes private pages (copy-on-write) and its tokens are its own."""
    model, tokenizer = ar
    engine = LLMEngine(model, tokenizer, page_size=16)
    run_engine(engine, [("a", SYSTEM + PROBLEMS[1], SamplingParams(max_tokens=4))])
    first_page = engine.pages.hash_to_page[engine.pages.chain_hash(None, SYSTEM[:16])]
    engine.runner.store.values[1][first_page * 16 + 3] += 1.0        # layer 1 of the first page
    params = SamplingParams(max_tokens=12, seed=2)
    done = run_engine(engine, [("b", SYSTEM + PROBLEMS[2], params)])
    stats = engine.kv_stats()
    assert stats["prefix_hits"] == 2 and stats["pages_unshared"] == 2
    assert_ar_equal(done["b"].outputs[0], alone_ar(model, SYSTEM + PROBLEMS[2], params), "b")


def test_the_page_store_is_never_read_where_nothing_was_written(ar, tmp_path):
    """The store is allocated uninitialised: every slot a sequence reads, it wrote first. Poisoned with NaN
    after its allocation (no prefix hit to verify), an AR and a block-causal engine give the same tokens."""
    from transformers import AutoModelForCausalLM
    from remask.models import tiny

    tiny.write_tiny_sdar(str(tmp_path), seed=0)
    sdar = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    for (model, tokenizer), params in ((ar, SamplingParams(max_tokens=12, seed=3, temperature=0.8)),
                                       ((sdar, None), SamplingParams(max_tokens=8, seed=3))):
        requests = [(f"r{i}", PROBLEMS[i], params.replace(seed=i)) for i in range(5)]
        clean = run_engine(LLMEngine(model, tokenizer, enable_prefix_caching=False), requests)
        engine = LLMEngine(model, tokenizer, enable_prefix_caching=False)
        run_engine(engine, [("first", PROBLEMS[20], params)])       # allocates the store's layers
        store = engine.runner.store
        assert store.keys and all(t.numel() for t in store.keys)
        for held in store.keys + store.values:
            held.fill_(float("nan"))
        poisoned = run_engine(engine, requests)
        for rid, _, _ in requests:
            assert poisoned[rid].outputs[0].token_ids == clean[rid].outputs[0].token_ids, rid


def test_ar_preemption_when_pages_run_out_recomputes_the_same_tokens(ar):
    """A store too small for every request at once: the newest running sequences give their
    pages back and start again later from their seed; nothing reported ever changes, every
    request ends with the tokens it has alone, and every page comes back."""
    model, tokenizer = ar
    requests = [(f"p{i}", PROBLEMS[i], SamplingParams(max_tokens=40, seed=i, temperature=[0.0, 0.9][i % 2],
                                                      stop_token_ids=[99]))
                for i in range(8)]
    engine = LLMEngine(model, tokenizer, kv_cache_pages=10, page_size=8)
    for request in requests:
        engine.add_request(*request)
    seen: dict[str, list[int]] = {}
    done = {}
    while engine.has_unfinished_requests():
        assert engine.kv_stats()["pages_in_use"] <= 10
        for out in engine.step():
            ids = out.outputs[0].all_token_ids
            before = seen.get(out.request_id, [])
            assert ids[:len(before)] == before, out.request_id      # reports only ever grow
            seen[out.request_id] = ids
            if out.finished:
                done[out.request_id] = out
    assert sum(o.metrics["preemptions"] for o in done.values()) > 0
    for rid, ids, p in requests:
        assert_ar_equal(done[rid].outputs[0], alone_ar(model, ids, p), rid)
    assert engine.kv_stats()["pages_in_use"] == 0
    assert engine.kv_stats()["peak_pages_in_use"] <= 10


def test_page_store_knobs_are_checked(ar, llada):
    model, tokenizer = ar
    small = LLMEngine(model, tokenizer, kv_cache_pages=2, page_size=8)
    with pytest.raises(ValueError, match="kv_cache_pages=2"):
        small.add_request("big", PROBLEMS[0], SamplingParams(max_tokens=16))   # more than the whole store
    for kwargs, match in [(dict(kv_cache_pages=0), "kv_cache_pages"), (dict(page_size=0), "page_size"),
                          (dict(kv_cache_memory_fraction=1.5), "kv_cache_memory_fraction"),
                          (dict(kv_cache_memory_fraction=0.5), "CUDA|cpu|kv_cache_pages"),
                          (dict(kv_cache_pages=4, kv_cache_memory_fraction=0.5), "not both|cpu"),
                          (dict(enable_prefix_caching="yes"), "enable_prefix_caching")]:
        with pytest.raises(ValueError, match=match):
            LLMEngine(model, tokenizer, **kwargs)
    with pytest.raises(ValueError, match="kv_cache_pages"):
        LLMEngine(*llada, kv_cache_pages=64)       # a diffusion request keeps its own cache
    assert LLMEngine(*llada).kv_stats()["pages"] == 0


@pytest.mark.parametrize("use_cache", ["dual", "prefix"])
def test_cached_block_steps_are_shared(llada, use_cache):
    """Prefix / dual cache requests of one prompt length share their block-start forwards and
    their cached block steps (each sequence's cache updated as alone), with alone's tokens."""
    model, tokenizer = llada
    same_length = [p for p in PROBLEMS if len(p) == len(PROBLEMS[0])][:4]
    rules = [dict(), dict(threshold=0.9), dict(factor=1.0), dict(temperature=0.8)]
    requests = [(f"c{i}", same_length[i % len(same_length)],
                 SamplingParams(max_tokens=16, steps=16, block_length=8, use_cache=use_cache, seed=i, **rules[i % 4]))
                for i in range(8)]
    engine = LLMEngine(model, tokenizer)
    done = run_engine(engine, requests)
    for rid, ids, p in requests:
        assert done[rid].outputs[0].all_token_ids == alone_llada(model, ids, p), rid
    nfe = sum(o.outputs[0].nfe for o in done.values())
    assert engine.runner.forwards * 3 < nfe     # shared: far fewer model calls than forwards counted


def test_apd_requests_run_in_the_engine_and_share_their_model_calls(llada, ar):
    """APD (a verifier, one sequence at a time) beside block-rule requests: each APD request's
    tokens equal `remask.generate(apd=...)` alone, its accepted tokens are reported as they are
    final, and it refuses the settings it does not read. Every step is at most two model calls, the
    dLLM's (every request's forward of that model) and the verifier's (every APD request's)."""
    model, tokenizer = llada
    verifier = ar[0]
    configs = [remask.APDConfig(verifier, 0.7, kv_window=4, max_lookahead=8),
               remask.APDConfig(verifier, 0.3, kv_window=None, max_lookahead=None),
               remask.APDConfig(verifier, 0.9, kv_window=4, max_lookahead=8, coupled_gumbel=True)]
    requests = [(f"apd{i}", PROBLEMS[i], SamplingParams(max_tokens=16, seed=i, decoder=configs[i % 3],
                                                        temperature=[0.0, 0.0, 0.8][i % 3])) for i in range(6)]
    requests += [(f"blk{i}", PROBLEMS[10 + i], mixed_params(i)) for i in range(4)]
    engine = LLMEngine(model, tokenizer)
    for request in requests:
        engine.add_request(*request)
    seen: dict[str, list[int]] = {}
    done = {}
    verifier_calls = []
    hook = verifier.register_forward_hook(lambda *_: verifier_calls.append(1))
    calls_per_step = []
    while engine.has_unfinished_requests():
        before, verified = engine.runner.forwards, len(verifier_calls)
        outputs = engine.step()
        calls_per_step.append((engine.runner.forwards - before, len(verifier_calls) - verified))
        for out in outputs:
            ids = out.outputs[0].all_token_ids
            assert ids[:len(seen.get(out.request_id, []))] == seen.get(out.request_id, [])
            seen[out.request_id] = ids
            if out.finished:
                done[out.request_id] = out
    for rid, ids, p in requests:
        if rid.startswith("apd"):
            prompt = torch.tensor([ids])
            alone = remask.generate(model, prompt, gen_length=16, apd=p.decoder, temperature=p.temperature,
                                    generator=torch.Generator().manual_seed(p.seed))[0, prompt.shape[1]:].tolist()
        else:
            alone = alone_llada(model, ids, p)
        assert done[rid].outputs[0].all_token_ids == alone, rid
    hook.remove()
    assert all(calls <= 2 and verified <= 1 for calls, verified in calls_per_step), calls_per_step
    assert calls_per_step[1] == (2, 1)   # the six APD requests' first verifier forwards: one call
    with pytest.raises(ValueError, match="block_length"):
        engine.add_request("bad", PROBLEMS[0], SamplingParams(max_tokens=16, block_length=8, decoder=configs[0]))
    with pytest.raises(ValueError, match="autoregressive.*decoder"):
        LLMEngine(*ar).add_request("bad", PROBLEMS[0], SamplingParams(max_tokens=8, decoder=configs[0]))


def test_causal_continuations_of_another_model_share_one_forward_each_as_alone(ar):
    """The runner's flat forward of a verifier's continuations (APD's): prompts of different lengths, then
    drafts of several tokens over each one's own cache: each gets bitwise the logits and cache contents of
    its own forward, as the drop-in driver runs it."""
    from remask.engine.model_runner import ModelRunner

    verifier = ar[0]
    g = torch.Generator().manual_seed(0)
    runner = ModelRunner(verifier, remask.get_spec(verifier))
    prompts = [torch.randint(5, 100, (1, n), generator=g) for n in (7, 12, 3)]
    drafts = [torch.randint(5, 100, (1, n), generator=g) for n in (4, 1, 6)]

    def request(ids, cache, past):
        positions = torch.arange(past, past + ids.shape[1])[None]
        return ForwardRequest(ids, per_row=dict(position_ids=positions), shared=dict(use_cache=True), cache=cache,
                              output="model", module=verifier, extends=True, rows=slice(None))

    alone = [run_forwards(verifier, [request(p, None, 0)])[0] for p in prompts]
    packed = runner._causal_forward([(None, request(p, None, 0)) for p in prompts])
    for a, p in zip(alone, packed):
        assert torch.equal(a.logits, p.logits)
    alone = [run_forwards(verifier, [request(d, copy.deepcopy(output_cache(a)), n.shape[1])])[0]
             for d, a, n in zip(drafts, alone, prompts)]
    packed = runner._causal_forward([(None, request(d, output_cache(p), n.shape[1]))
                                     for d, p, n in zip(drafts, packed, prompts)])
    for a, p in zip(alone, packed):
        assert torch.equal(a.logits, p.logits)
        for held, own in zip(output_cache(p).layers, output_cache(a).layers):
            assert torch.equal(held.keys, own.keys) and torch.equal(held.values, own.values)


def test_a_model_shared_by_two_engine_threads_keeps_the_paged_attention_until_both_leave(ar):
    """The server's engines run on threads of their own and may share a model (an AR engine's, an APD
    verifier's): one thread leaving its flat forward must not restore the model's attention setting
    under the other, still inside; the last one out restores it."""
    import threading

    from remask.engine.paged_kv import ATTN_IMPLEMENTATION, ForwardBatch, paged_forward

    model = ar[0]
    original = model.config._attn_implementation
    inside, leave = threading.Event(), threading.Event()

    def hold():
        with paged_forward(model, ForwardBatch([], None, torch.device("cpu"))):
            inside.set()
            leave.wait(10)

    other = threading.Thread(target=hold)
    other.start()
    assert inside.wait(10)
    with paged_forward(model, ForwardBatch([], None, torch.device("cpu"))):
        leave.set()   # the first one in leaves first
        other.join(10)
        assert model.config._attn_implementation == ATTN_IMPLEMENTATION
    assert model.config._attn_implementation == original


def test_apd_params_refuse_the_settings_apd_does_not_read_when_built(ar):
    config = remask.APDConfig(ar[0], 0.7)
    for name, value in [("threshold", 0.9), ("steps", 16), ("use_cache", "dual"), ("alg", "entropy"),
                        ("remasking", "random"), ("cfg_scale", 1.0), ("logits_eos_inf", True),
                        ("confidence_eos_eot_inf", True)]:
        with pytest.raises(ValueError, match=f"apd.*{name}"):
            SamplingParams(max_tokens=16, decoder=config, **{name: value})
    assert SamplingParams(max_tokens=16, decoder=config, temperature=0.5, top_p=0.9, seed=1).decoder is config


def test_drafts_report_the_canvas_every_step_without_changing_the_tokens(llada, ar):
    model, tokenizer = llada
    params = SamplingParams(max_tokens=16, steps=16, block_length=8, seed=4, temperature=0.5)
    engine = LLMEngine(model, tokenizer)
    engine.add_request("d", PROBLEMS[3], params, drafts=True)
    reports = []
    while engine.has_unfinished_requests():
        reports += [o.outputs[0] for o in engine.step()]
    assert len(reports) == 16                                  # one per step
    final = reports[-1].all_token_ids
    assert final == alone_llada(model, PROBLEMS[3], params) and reports[-1].draft == final
    for r in reports[:-1]:
        assert len(r.draft) == 16 and None in r.draft
        assert r.draft[:len(r.all_token_ids)] == r.all_token_ids           # final blocks are in the canvas
        assert all(t is None or t == f for t, f in zip(r.draft, final))    # committed tokens stay (no remasking)
    with pytest.raises(ValueError, match="drafts"):
        engine.add_request("x", PROBLEMS[0], params, drafts="yes")
    ar_engine = LLMEngine(*ar)
    ar_engine.add_request("a", PROBLEMS[0], SamplingParams(max_tokens=4), drafts=True)   # AR: final tokens only
    assert all(o.outputs[0].draft is None for o in ar_engine.step())


def test_the_swapped_attention_is_plain_sdpa_for_other_threads(ar):
    """While an engine forward has the model's attention swapped, another thread using the same
    model (its own `ar_generate`, with padding and a cache) gets exactly transformers' SDPA."""
    import threading

    from remask.caches.page_manager import PageManager
    from remask.engine.paged_kv import ForwardBatch, PagedKVStore, paged_forward

    model, _ = ar
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    expected = remask.ar_generate(model, ids, mask, max_new_tokens=6, eos_token_id=[])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    inside, release = threading.Event(), threading.Event()

    def hold_the_swap() -> None:
        batch = ForwardBatch([], PagedKVStore(PageManager(4, 4)), torch.device("cpu"))
        with paged_forward(model, batch):
            inside.set()
            release.wait(30)

    thread = threading.Thread(target=hold_the_swap)
    thread.start()
    try:
        assert inside.wait(30) and model.config._attn_implementation == "remask_paged"
        assert torch.equal(remask.ar_generate(model, ids, mask, max_new_tokens=6, eos_token_id=[]), expected)
        with torch.no_grad():
            assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, logits)   # the pads stay masked
    finally:
        release.set()
        thread.join()
    assert model.config._attn_implementation == "sdpa"


def test_one_thread_switch_is_shared_by_engines_in_several_threads():
    """Two threads inside batch-invariant forwards at once: the intra-op thread count is restored
    only when the last one leaves (never under the other's forward)."""
    import threading

    from remask.kernels.batch_invariant import batch_invariant_linear

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
        seen = []

        def a() -> None:
            with batch_invariant_linear():
                a_in.set()
                b_in.wait(10)
            a_out.set()

        def b() -> None:
            a_in.wait(10)
            with batch_invariant_linear():
                b_in.set()
                a_out.wait(10)
                seen.append(torch.get_num_threads())     # a has left; b is still inside
        threads = [threading.Thread(target=a), threading.Thread(target=b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert seen == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


# ---- vLLM's prompt dicts (TextPrompt / TokensPrompt) ----------------------------------------------

def test_prompt_dicts_decode_as_the_plain_forms(llada, ar):
    """{"prompt": text} is the text, {"prompt_token_ids": ids} the ids, token for token: alone, as
    one dict, and in a list mixing every form; a TokensPrompt's optional text is reported, not
    tokenized (vLLM's meaning)."""
    llm = remask.LLM(*llada)
    params = SamplingParams(max_tokens=16, steps=16, block_length=8, seed=0)
    ids = charset.encode_chat("sort 52814")
    plain = llm.generate([ids, "sort 52814", "reverse abcd"], params, use_tqdm=False)
    mixed = llm.generate([{"prompt_token_ids": ids}, {"prompt": "sort 52814"}, "reverse abcd", ids],
                         params, use_tqdm=False)
    assert [o.outputs[0].all_token_ids for o in mixed] == [o.outputs[0].all_token_ids for o in plain + plain[:1]]
    assert [o.outputs[0].text for o in mixed] == [o.outputs[0].text for o in plain + plain[:1]]
    assert mixed[0].outputs[0].text == "12458"
    assert [o.prompt for o in mixed] == [None, "sort 52814", "reverse abcd", None]
    assert mixed[1].prompt_token_ids == plain[1].prompt_token_ids
    one = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)      # a single dict: one prompt
    assert len(one) == 1 and one[0].outputs[0].all_token_ids == plain[0].outputs[0].all_token_ids
    chat = llm.generate({"prompt": "sort 52814"}, params, use_tqdm=False, chat=True)
    assert chat[0].outputs[0].all_token_ids == plain[0].outputs[0].all_token_ids
    both = llm.generate({"prompt_token_ids": ids, "prompt": "sort 52814 (chat)"}, params, use_tqdm=False)[0]
    assert both.prompt == "sort 52814 (chat)" and both.prompt_token_ids == ids
    assert both.outputs[0].all_token_ids == plain[0].outputs[0].all_token_ids
    engine = LLMEngine(*ar)                                                     # the engine takes them too
    got = run_engine(engine, [("d", {"prompt_token_ids": ids}, SamplingParams(max_tokens=8)),
                              ("p", ids, SamplingParams(max_tokens=8))])
    assert got["d"].outputs[0].all_token_ids == got["p"].outputs[0].all_token_ids


@pytest.mark.parametrize("prompt,match", [
    ({"prompt": "sort 52814", "multi_modal_data": {"image": None}}, "'multi_modal_data'"),
    ({"prompt_token_ids": [1, 5], "prompt_embeds": None}, "'prompt_embeds'"),
    ({"prompt": "sort 52814", "mm_processor_kwargs": {}}, "'mm_processor_kwargs'"),
    ({"prompt": "sort 52814", "cache_salt": "a"}, "'cache_salt'"),
    ({"encoder_prompt": "a", "decoder_prompt": None}, "'encoder_prompt'"),
    ({"prompt": "sort 52814", "promt": "x"}, "unknown key 'promt'.*'prompt', 'prompt_token_ids'"),
    ({"text": "sort 52814"}, "unknown key 'text'"),
    ({}, "needs 'prompt'"),
    ({"prompt": 5}, r"prompt\['prompt'\]"),
    ({"prompt_token_ids": "1 5"}, r"prompt\['prompt_token_ids'\]"),
    ({"prompt_token_ids": [1, 500]}, "vocabulary"),
])
def test_prompt_dicts_refuse_bad_keys_by_name(llada, prompt, match):
    """vLLM's keys remask cannot honour and unknown keys are refused naming the key and the
    accepted ones, never dropped; the call is all or nothing."""
    llm = remask.LLM(*llada)
    with pytest.raises(ValueError, match=match):
        llm.generate([PROBLEMS[0], prompt], SamplingParams(max_tokens=8), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests() and not llm.engine.requests
    with pytest.raises(ValueError, match=match):
        llm.engine.add_request("x", prompt, SamplingParams(max_tokens=8))


def test_llm_chat_takes_messages_not_prompts(llada):
    llm = remask.LLM(*llada)
    with pytest.raises(ValueError, match="LLM.generate"):
        llm.chat({"prompt": "sort 52814"}, SamplingParams(max_tokens=8), use_tqdm=False)


# ---- ignore_eos and min_tokens -----------------------------------------------------------------------

# tiny-llada's answers to these end with EOS within 10 tokens; max_tokens 16.
END_PROMPTS = [charset.encode_chat(p) for p in ("sort 52814", "reverse abcd", "greet Hugo", "name a colour")]
# every path that takes min_tokens: LLaDA's block rule (Fast-dLLM's rules, the caches, CFG,
# sparse attention, sampling), Dream's sampler and Dream's block decoder
MIN_TOKENS_KINDS = [
    dict(steps=16, block_length=8),
    dict(block_length=8, threshold=0.9, use_cache="dual"),
    dict(steps=16, block_length=4, factor=1.0, use_cache="prefix"),
    dict(steps=8, block_length=8, cfg_scale=0.5),
    dict(steps=16, block_length=8, sparse=remask.SparseConfig(retention_ratio=0.5)),
    dict(steps=16, block_length=8, temperature=0.7),
    dict(steps=16, block_length=8, early_stop=True),
    dict(steps=16, alg="entropy"),
    dict(steps=16, alg="confidence_threshold", block_length=8, use_cache="dual"),
]


def finished_outputs(engine: LLMEngine, requests) -> dict:
    return {rid: out.outputs[0] for rid, out in run_engine(engine, requests).items()}


def test_ignore_eos_diffusion_decodes_the_same_and_keeps_every_position(llada, load_model):
    """A diffusion model decodes its whole window anyway: ignore_eos changes no token, only where
    the answer ends — it keeps all max_tokens positions (EOS included, as an ordinary token), with
    finish reason "length"; stop_token_ids still end it (vLLM's rule). On tiny-llada and on a
    checkpoint whose LM head favours EOS/EOT (llada_eos), where EOS comes early."""
    model, tokenizer = llada
    eos_model = load_model("llada_eos")
    eos_prompts = [[int(t) for t in torch.randint(0, 900, (7,), generator=torch.Generator().manual_seed(20 + i))]
                   for i in range(2)]
    cases = [(LLMEngine(model, tokenizer), END_PROMPTS, [MIN_TOKENS_KINDS[i] for i in (0, 1, 7)]),
             (LLMEngine(eos_model), eos_prompts, [dict(steps=16, block_length=8), dict(steps=16, alg="entropy")])]
    for engine, prompts, kinds in cases:
        requests = []
        for i, ids in enumerate(prompts):
            for k, kind in enumerate(kinds):
                params = SamplingParams(max_tokens=16, seed=i, **kind)
                requests += [(f"p{i}-{k}", ids, params), (f"i{i}-{k}", ids, params.replace(ignore_eos=True))]
        got = finished_outputs(engine, requests)
        early = 0
        for rid, _, params in requests[::2]:
            plain, ignored = got[rid], got["i" + rid[1:]]
            assert ignored.all_token_ids == plain.all_token_ids, rid
            assert ignored.token_ids == ignored.all_token_ids and len(ignored.token_ids) == 16, rid
            assert ignored.finish_reason == "length", rid
            early += plain.finish_reason == "stop" and len(plain.token_ids) < 16
            assert plain.token_ids == ignored.all_token_ids[:len(plain.token_ids)], rid
        assert early >= len(requests) // 4, "the answers should end early without ignore_eos"
    llm = remask.LLM(model, tokenizer)
    params = SamplingParams(max_tokens=16, steps=16, block_length=8, seed=0, ignore_eos=True)
    out = llm.generate("greet Hugo", params, use_tqdm=False, chat=True)[0].outputs[0]
    assert out.text == "Hello, Hugo!" and len(out.token_ids) == 16    # EOS is special: not in the text
    comma = charset.CHAR_TO_ID[","]
    cut = llm.generate("greet Hugo", params.replace(stop_token_ids=[comma]), use_tqdm=False, chat=True)[0].outputs[0]
    assert cut.text == "Hello" and cut.token_ids[-1] == comma and cut.finish_reason == "stop"


def test_ignore_eos_ar_runs_to_max_tokens_past_the_first_eos(ar):
    """As in vLLM: decoding goes on after EOS; the tokens up to and including the first EOS are
    the plain request's (the same logits and draws), the output has exactly max_tokens tokens, and
    it equals ar_generate with no EOS id (the only stop ids left: stop_token_ids)."""
    model, tokenizer = ar
    requests = []
    for i, ids in enumerate(END_PROMPTS):
        params = SamplingParams(max_tokens=16, seed=i, temperature=[0.0, 0.8][i % 2])
        requests += [(f"p{i}", ids, params), (f"i{i}", ids, params.replace(ignore_eos=True))]
    got = finished_outputs(LLMEngine(model, tokenizer), requests)
    for rid, ids, params in requests[::2]:
        plain, ignored = got[rid], got["i" + rid[1:]]
        assert plain.finish_reason == "stop" and plain.token_ids[-1] == charset.EOS_ID, rid
        assert ignored.all_token_ids[:len(plain.token_ids)] == plain.token_ids, rid
        assert len(ignored.token_ids) == 16 and ignored.finish_reason == "length", rid
        assert ignored.all_token_ids == alone_ar(model, ids, params.replace(ignore_eos=True)), rid
    params = SamplingParams(max_tokens=16, ignore_eos=True, stop_token_ids=[charset.EOS_ID])
    stopped = finished_outputs(LLMEngine(model, tokenizer), [("s", END_PROMPTS[0], params)])["s"]
    assert stopped.token_ids == got["p0"].token_ids and stopped.finish_reason == "stop"   # stop_token_ids still stop


def test_min_tokens_diffusion_no_end_token_before_n_and_batch_invariant(llada):
    """min_tokens=N: the end ids' logits are −inf at the answer's first N positions, at every step
    and whatever the rule, so the answer has at least N tokens before its end; a request's tokens are
    the same alone and among requests with other settings (with and without min_tokens)."""
    model, tokenizer = llada
    engine = LLMEngine(model, tokenizer)
    ends = set(engine.stop_ids)
    N = 10
    requests = []
    for i, ids in enumerate(END_PROMPTS):
        for k, kind in enumerate(MIN_TOKENS_KINDS):
            params = SamplingParams(max_tokens=16, seed=10 * i + k, **kind)
            requests += [(f"p{i}-{k}", ids, params), (f"m{i}-{k}", ids, params.replace(min_tokens=N))]
    together = finished_outputs(engine, requests)
    shortened = 0
    for rid, ids, params in requests:
        out = together[rid]
        if rid.startswith("m"):
            assert not ends & set(out.all_token_ids[:N]), rid
            assert len(out.token_ids) > N or len(out.token_ids) == 16, rid
            shortened += len(together["p" + rid[1:]].token_ids) <= N
    assert shortened >= len(requests) // 4, "most plain answers should end before N"
    for rid, ids, params in requests[1::2][::3]:                     # a third of them, each alone
        alone = finished_outputs(LLMEngine(model, tokenizer), [(rid, ids, params)])[rid]
        assert alone.all_token_ids == together[rid].all_token_ids, rid
    shuffled = list(requests)
    random.Random(1).shuffle(shuffled)
    again = finished_outputs(LLMEngine(model, tokenizer, max_num_seqs=7), shuffled)
    assert all(again[rid].all_token_ids == together[rid].all_token_ids for rid, _, _ in requests)


def test_min_tokens_on_a_checkpoint_that_favours_eos(load_model):
    """llada_eos (an LM-head bias on EOS/EOT) ends its answers within a few tokens; with
    min_tokens no EOS/EOT lands before position N, ignore_eos on top keeps every position."""
    model = load_model("llada_eos")
    engine = LLMEngine(model)
    ids = [int(t) for t in torch.randint(0, 900, (7,), generator=torch.Generator().manual_seed(20))]
    kinds = [dict(steps=16, block_length=8), dict(steps=16, alg="entropy")]
    requests = []
    for k, kind in enumerate(kinds):
        params = SamplingParams(max_tokens=16, seed=k, **kind)
        requests += [(f"p{k}", ids, params), (f"m{k}", ids, params.replace(min_tokens=10)),
                     (f"b{k}", ids, params.replace(min_tokens=10, ignore_eos=True))]
    got = finished_outputs(engine, requests)
    for k in range(len(kinds)):
        assert len(got[f"p{k}"].token_ids) < 10                       # EOS/EOT early without min_tokens
        assert not {126081, 126348} & set(got[f"m{k}"].all_token_ids[:10]) and len(got[f"m{k}"].token_ids) > 10
        assert got[f"b{k}"].all_token_ids == got[f"m{k}"].all_token_ids and len(got[f"b{k}"].token_ids) == 16


def ar_alone_with_min_tokens(model, ids: list[int], params: SamplingParams, ends: list[int]) -> list[int]:
    """`ar_generate`'s loop with vLLM's min_tokens rule written out: end ids at −inf while fewer
    than min_tokens tokens exist."""
    from remask.diffusion.families.ar import ARDecoder
    from remask.diffusion.parts.stepper import step_alone
    from remask.models.spec import get_spec

    def hold(state, logits, position):        # [B, 1, V] of the next position
        if state.step < params.min_tokens:
            logits = logits.clone()
            logits[..., ends] = -torch.inf
        return logits

    decoder = ARDecoder(get_spec(model), **params.ar_kwargs([charset.EOS_ID])).add_processor(hold)
    generator = torch.Generator().manual_seed(params.seed)
    state = decoder.start(torch.tensor([ids]))
    with torch.no_grad():
        while not state.done:
            step_alone(decoder, model, state, generator)
    return state.tokens[0].tolist()


def test_min_tokens_ar_masks_end_ids_until_n_tokens_as_vllm(ar):
    """AR: exactly vLLM's rule (the end ids masked while fewer than N tokens exist), batch-invariant:
    greedy and sampled requests among plain ones equal the rule applied to ar_generate's loop alone."""
    model, tokenizer = ar
    engine = LLMEngine(model, tokenizer)
    ends = sorted(set(engine.stop_ids) | {charset.EOS_ID})
    requests = []
    for i, ids in enumerate(END_PROMPTS):
        params = SamplingParams(max_tokens=16, seed=i, temperature=[0.0, 0.8][i % 2])
        requests += [(f"p{i}", ids, params), (f"m{i}", ids, params.replace(min_tokens=9)),
                     (f"b{i}", ids, params.replace(min_tokens=9, ignore_eos=True))]
    got = finished_outputs(engine, requests)
    for rid, ids, params in requests:
        out = got[rid]
        if params.min_tokens:
            assert not set(ends) & set(out.all_token_ids[:9]) and len(out.token_ids) >= 10 or \
                len(out.token_ids) == 16, rid
            assert_ar_equal(out, ar_alone_with_min_tokens(model, ids, params, ends), rid)
        if params.ignore_eos:
            assert len(out.token_ids) == 16 and out.finish_reason == "length", rid


def test_min_tokens_holds_back_stop_strings_and_stop_token_ids_as_vllm(llada, ar):
    """A stop string ends the answer only where it ends past the text of the first min_tokens
    tokens (vLLM checks stop strings from there on): tiny-ar answers 'sort 52814' with 12458. And
    stop_token_ids are end ids like EOS: held back at the first min_tokens tokens / positions."""
    llm = remask.LLM(*ar)
    params = SamplingParams(max_tokens=16, stop=["45"])
    outs = [llm.generate("sort 52814", params.replace(min_tokens=n), use_tqdm=False, chat=True)[0].outputs[0]
            for n in (0, 3, 4)]
    assert [(o.text, o.finish_reason) for o in outs] == [("12", "stop"), ("12", "stop"), ("12458", "stop")]
    assert outs[2].token_ids[-1] == charset.EOS_ID          # not stopped by "45" (within the first 4 tokens)
    comma = charset.CHAR_TO_ID[","]
    for model, kind in ((llada, dict(steps=16, block_length=8, seed=0)), (ar, {})):
        params = SamplingParams(max_tokens=16, stop_token_ids=[comma], **kind)
        gen = remask.LLM(*model)
        plain, held = (gen.generate("greet Hugo", params.replace(min_tokens=n), use_tqdm=False, chat=True)[0].outputs[0]
                       for n in (0, 8))
        assert plain.text == "Hello" and plain.token_ids[-1] == comma    # "Hello, Hugo!" cut at the comma
        assert comma not in held.token_ids[:8] and len(held.token_ids) > 8 and held.finish_reason == "stop"


def test_ignore_eos_and_min_tokens_are_refused_where_the_loop_cannot_honour_them(llada, ar, tmp_path):
    model, tokenizer = llada
    llm = remask.LLM(model, tokenizer)
    ids = END_PROMPTS[0]
    refused = [
        (SamplingParams(max_tokens=16, block_length=8, min_tokens=4, decoder=remask.FreeDave()),
         "min_tokens: .*FreeDave"),
        (SamplingParams(max_tokens=16, block_length=8, ignore_eos=True, decoder=remask.ThresholdDecoding()),
         "ignore_eos: .*ThresholdDecoding"),
        (SamplingParams(max_tokens=16, ignore_eos=True, use_cache=remask.VicinityCache()),
         "ignore_eos: .*VicinityCache"),
        (SamplingParams(max_tokens=16, min_tokens=4, decoder=remask.APDConfig(ar[0])), "min_tokens: .*apd"),
        (SamplingParams(max_tokens=16, ignore_eos=True, min_tokens=2, decoder=remask.APDConfig(ar[0])),
         "ignore_eos / min_tokens: .*apd"),
    ]
    for params, match in refused:
        with pytest.raises(ValueError, match=match):
            llm.engine.add_request("x", ids, params)
    assert not llm.engine.requests
    ok = llm.generate("sort 52814", SamplingParams(max_tokens=16, block_length=8, ignore_eos=True,
                                                   decoder=remask.FreeDave()), use_tqdm=False, chat=True)[0].outputs[0]
    assert len(ok.token_ids) == 16 and ok.finish_reason == "length" and ok.text == "12458"
    from transformers import AutoModelForCausalLM
    from remask.models import tiny

    tiny.write_tiny_sdar(str(tmp_path), seed=0)
    sdar = remask.LLM(AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval())
    for name, value in (("ignore_eos", True), ("min_tokens", 2)):
        with pytest.raises(ValueError, match=f"{name}: not supported with a block-causal model"):
            sdar.generate([[5, 17, 42]], SamplingParams(max_tokens=8, **{name: value}), use_tqdm=False)


def test_ignore_eos_and_min_tokens_are_checked_when_built():
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=1)
    with pytest.raises(ValueError, match="min_tokens must be <= max_tokens"):
        SamplingParams(max_tokens=8, min_tokens=9)
    with pytest.raises(ValueError, match="ignore_eos.*early_stop"):
        SamplingParams(ignore_eos=True, early_stop=True)
    assert SamplingParams(max_tokens=8, min_tokens=8).min_tokens == 8


def test_a_passed_deadline_aborts_the_request_between_steps_and_frees_it(llada):
    """`set_deadline`: the engine itself ends a request whose deadline passed, at the next step,
    waiting or running, with finish reason "timeout"; the others go on."""
    from remask.engine.sequence import now

    model, tokenizer = llada
    engine = LLMEngine(model, tokenizer, max_num_seqs=1)
    one_block = SamplingParams(max_tokens=32, steps=32, block_length=32, seed=0)
    engine.add_request("late", PROBLEMS[0], one_block)
    engine.add_request("queued", PROBLEMS[1], one_block)     # waiting: max_num_seqs=1
    engine.add_request("fine", PROBLEMS[2], SamplingParams(max_tokens=8, steps=8, block_length=8, seed=1))
    engine.step()
    engine.step()
    seq = engine.requests["late"][2][0]
    nfe = seq.stats.nfe
    assert nfe >= 1 and not seq.is_finished
    engine.set_deadline("late", now())
    engine.set_deadline("queued", now() - 1)
    engine.set_deadline("fine", now() + 3600)
    outs = {o.request_id: o for o in engine.step()}
    for name in ("late", "queued"):
        assert outs[name].finished and outs[name].outputs[0].finish_reason == "timeout"
    assert outs["late"].outputs[0].nfe == nfe                # aborted before another forward
    assert seq.state is None and seq not in engine.scheduler.running
    assert set(engine.requests) == {"fine"}
    while engine.has_unfinished_requests():
        done = [o for o in engine.step() if o.finished]
    assert done[0].request_id == "fine" and done[0].outputs[0].finish_reason in ("stop", "length")
    with pytest.raises(ValueError, match="not in flight"):
        engine.set_deadline("fine", now())
    engine.add_request("x", PROBLEMS[0], one_block)
    with pytest.raises(ValueError, match="deadline"):
        engine.set_deadline("x", float("nan"))
    with pytest.raises(ValueError, match="reason"):
        engine.abort_request("x", reason="bored")


def test_a_small_request_beside_an_n128_request_finishes_within_its_own_steps(llada):
    """Fairness (issue 29): one request's 128 samples used to hold a later request back until they
    were all done (first come, first served over sequences). Now each step is shared round-robin
    over requests: the small request is in the very next step's batch and finishes in its own
    number of steps, with its tokens alone; the big request loses one slot per step, not more."""
    model, tokenizer = llada
    engine = LLMEngine(model, tokenizer, max_num_seqs=64)
    tiny = dict(max_tokens=4, steps=4, block_length=4)
    engine.add_request("big", PROBLEMS[0], SamplingParams(n=128, seed=0, **tiny))
    engine.step()
    small = SamplingParams(seed=7, **tiny)
    engine.add_request("small", PROBLEMS[1], small)
    done, steps, batches = {}, 0, []
    schedule = engine.scheduler.schedule

    def counted():
        admitted, batch, preempted = schedule()
        batches.append(batch)
        return admitted, batch, preempted

    engine.scheduler.schedule = counted
    while "small" not in done:
        steps += 1
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert steps <= small.steps + 1, steps                       # its first step at once, then its own steps
    assert all(len(b) == 64 and sum(s.request_id == "small" for s in b) == 1 for b in batches)
    assert done["small"].outputs[0].all_token_ids == alone_llada(model, PROBLEMS[1], small)
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    big = done["big"].outputs
    assert len(big) == 128 and big[5].all_token_ids == alone_llada(model, PROBLEMS[0], SamplingParams(n=128, seed=0,
                                                                                                     **tiny), 5)


def test_steps_are_shared_round_robin_over_owners_then_requests(llada):
    """Owner "a" floods the engine with three n=8 requests; owner "b"'s one request still gets half
    of every step it can use (owners first, then each owner's requests), and everything finishes
    with its tokens alone."""
    model, tokenizer = llada
    engine = LLMEngine(model, tokenizer, max_num_seqs=4)
    params = SamplingParams(max_tokens=4, steps=4, block_length=4, seed=3, n=8)
    for i in range(3):
        engine.add_request(f"a{i}", PROBLEMS[i], params, owner="a")
    engine.add_request("b", PROBLEMS[3], params, owner="b")
    with pytest.raises(ValueError, match="owner"):
        engine.add_request("c", PROBLEMS[4], params, owner=7)
    _, batch, _ = engine.scheduler.schedule()
    assert sum(s.owner == "b" for s in batch) == 2 and sum(s.owner == "a" for s in batch) == 2
    assert len({s.request_id for s in batch if s.owner == "a"}) == 2   # a's share, split over its requests
    done = run_engine(engine, [])
    assert set(done) == {"a0", "a1", "a2", "b"}
    assert done["b"].outputs[3].all_token_ids == alone_llada(model, PROBLEMS[3], params, 3)


def test_a_request_over_the_memory_budget_is_refused_by_name_before_allocation(llada, ar, monkeypatch):
    """Admission (issue 29): a request's memory (its samples' positions × logits, activations and
    cache, plus each sample's bookkeeping) is estimated before any sample, decoder or buffer exists
    and refused against `max_request_bytes`, naming the parameter that drives it; the default
    budget admits every ordinary request (n=128 included) and refuses a flood of samples."""
    import remask.engine.llm_engine as llm_engine

    model, tokenizer = llada
    engine = LLMEngine(model, tokenizer)
    ok = SamplingParams(max_tokens=64, steps=64, n=128, use_cache="dual", block_length=32)
    assert engine.request_bytes(len(PROBLEMS[0]), ok)[0] <= engine.max_request_bytes
    engine.add_request("ok", PROBLEMS[0], ok)                  # the server's cap, the context's length
    with pytest.raises(ValueError, match="^n: .*max_request_bytes"):
        engine.add_request("flood", PROBLEMS[0], SamplingParams(max_tokens=16, n=100_000))
    total, one = engine.request_bytes(len(PROBLEMS[0]), SamplingParams(max_tokens=16, n=8))
    small = LLMEngine(model, tokenizer, max_request_bytes=one * 2)

    def no_sample(*args, **kwargs):
        raise AssertionError("a sample was made before the admission check")

    monkeypatch.setattr(llm_engine, "Sequence", no_sample)
    for params, name in ((SamplingParams(max_tokens=16, n=8), "n"), (SamplingParams(max_tokens=96), "max_tokens")):
        with pytest.raises(ValueError, match=f"^{name}: .*max_request_bytes={one * 2}"):
            small.add_request("x", PROBLEMS[0], params)
    assert not small.requests and not small.has_unfinished_requests()
    monkeypatch.undo()
    small.add_request("fits", PROBLEMS[0], SamplingParams(max_tokens=16, n=2))
    with pytest.raises(ValueError, match="max_request_bytes"):
        LLMEngine(model, tokenizer, max_request_bytes=0)
    ar_engine = LLMEngine(*ar)
    ar_engine.add_request("ar", PROBLEMS[0], SamplingParams(max_tokens=16, n=128))


def test_ar_logprobs_are_the_raw_distribution_and_change_no_token_even_across_preemption(ar, llada):
    """`SamplingParams.logprobs`: per token the sampled id's raw log-probability (log_softmax of the
    model's logits) and the k most likely alternatives; the same tokens as without; a preempted
    sequence reports the same logprobs as one decoded alone. Diffusion models refuse it by name."""
    model, tokenizer = ar
    requests = [(f"p{i}", PROBLEMS[i], SamplingParams(max_tokens=40, seed=i, temperature=[0.0, 0.9][i % 2],
                                                      stop_token_ids=[99], logprobs=2))
                for i in range(8)]
    engine = LLMEngine(model, tokenizer, kv_cache_pages=10, page_size=8)   # small: preemptions happen
    for request in requests:
        engine.add_request(*request)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            o = out.outputs[0]
            assert len(o.logprobs) == len(o.token_ids)      # reported with the tokens, also mid-way
            if out.finished:
                done[out.request_id] = out
    assert sum(o.metrics["preemptions"] for o in done.values()) > 0
    for rid, ids, p in requests:
        got = done[rid].outputs[0]
        plain = alone_ar(model, ids, p.replace(logprobs=None))
        assert_ar_equal(got, plain, rid)                                 # logprobs change no token
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids + got.token_ids])).logits[0].float()
        raw = torch.log_softmax(logits, -1)[len(ids) - 1:-1]
        for i, (token, entry) in enumerate(zip(got.token_ids, got.logprobs)):
            assert next(iter(entry)) == token and entry[token].logprob == pytest.approx(raw[i, token].item(), abs=1e-4)
            assert entry[token].rank == int((raw[i] > raw[i, token]).sum()) + 1
            top = sorted((lp for lp in entry.values() if lp.rank <= 2), key=lambda lp: lp.rank)
            assert [lp.logprob for lp in top] == pytest.approx(raw[i].topk(2).values.tolist(), abs=1e-4)


def diffusion_logprobs(engine: LLMEngine, requests: list[tuple[str, list[int], SamplingParams]]) -> dict:
    """Run `requests` with and without `logprobs`; the tokens must be the same. Returns the outputs with."""
    plain = run_engine(engine, requests)
    for request_id, ids, params in requests:
        engine.add_request(request_id, ids, params.replace(logprobs=2))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            o = out.outputs[0]
            assert len(o.logprobs) == len(o.token_ids), out.request_id     # reported with the final tokens
            if out.finished:
                done[out.request_id] = o
    for request_id, _, _ in requests:
        assert done[request_id].token_ids == plain[request_id].outputs[0].token_ids, request_id
    return done


def test_mask_model_logprobs_come_from_the_committing_forward_and_change_no_token(llada, tmp_path):
    """LLaDA's block rule (every rule, cache, CFG, sparse, sampling) and Dream's sampler and block decoder report
    per token the log-probability it had in the forward that committed it; the same tokens as without. Greedy, a
    committed token is that forward's most likely (rank 1). The methods with loops of their own refuse by name."""
    model, tokenizer = llada
    requests = [(f"r{i}", PROBLEMS[i], mixed_params(i)) for i in range(11)]
    done = diffusion_logprobs(LLMEngine(model, tokenizer), requests)
    for rid, _, params in requests:
        for token, entry in zip(done[rid].token_ids, done[rid].logprobs):
            assert next(iter(entry)) == token and len(entry) in (2, 3) and entry[token].logprob <= 1e-6
            if params.temperature == 0:
                assert entry[token].rank == 1, rid
    # one token a step: the first committed is the most confident position of the all-mask canvas
    ids = PROBLEMS[0]
    o = diffusion_logprobs(LLMEngine(model, tokenizer), [("one", ids, SamplingParams(max_tokens=8, steps=8))])["one"]
    with torch.no_grad():
        raw = torch.log_softmax(model(torch.tensor([ids + [model.config.mask_token_id] * 8])).logits[0, len(ids):], -1)
    first = int(raw.max(-1).values.argmax())
    assert o.logprobs[first][o.token_ids[first]].logprob == pytest.approx(raw[first].max().item(), abs=1e-5)
    tiny.write_tiny_dream(str(tmp_path), seed=4, vocab_size=300, mask_token_id=299, eos_token_id=298,
                          pad_token_id=297, bos_token_id=296)
    dream = AutoModel.from_pretrained(str(tmp_path)).eval()
    prompts = [[5 + (i * 7 + j) % 40 for j in range(6 + i)] for i in range(3)]
    for kwargs in (dict(alg="entropy"), dict(alg="confidence_threshold", block_length=8, use_cache="dual", threshold=0.9)):
        done = diffusion_logprobs(LLMEngine(dream, None), [(f"d{i}", p, SamplingParams(max_tokens=16, **kwargs))
                                                           for i, p in enumerate(prompts)])
        assert all(entry[token].rank == 1 for o in done.values() for token, entry in zip(o.token_ids, o.logprobs))
    with pytest.raises(ValueError, match="logprobs: .* not with FreeDave"):
        LLMEngine(model, tokenizer).add_request("d", ids, SamplingParams(max_tokens=8, logprobs=1,
                                                                         decoder=remask.FreeDave()))


def test_mask_model_logprobs_of_samples_decoded_one_after_another_are_each_their_own(llada):
    """With `n` above `max_num_seqs` a request's samples run one after another through one decoder and its one
    recorder: each sample reports the tokens and logprobs it reports alone."""
    model, tokenizer = llada
    params = SamplingParams(max_tokens=16, steps=16, block_length=8, early_stop=True, temperature=0.7, seed=5,
                            logprobs=1)
    engine = LLMEngine(model, tokenizer, max_num_seqs=1)
    together = run_engine(engine, [("n3", PROBLEMS[3], params.replace(n=3))])["n3"].outputs
    for i, sample in enumerate(together):
        alone = run_engine(engine, [(f"s{i}", PROBLEMS[3], params.replace(seed=5 + i))])[f"s{i}"].outputs[0]
        assert sample.token_ids == alone.token_ids and sample.logprobs == alone.logprobs, i
