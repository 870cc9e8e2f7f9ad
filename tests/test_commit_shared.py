"""Batched commits after a shared forward (issue 31): `BlockDecoder.commit_together` over several
decoders gives every row the tokens its own `commit` gives, and the engine uses it
(`receive_together`) for requests of one commit key."""
from __future__ import annotations

import copy

import pytest
import torch

import remask
from remask.diffusion.families.llada import BlockDecoder
from remask.diffusion.methods import registry
from remask.diffusion.methods.dinfer import VicinityCache, dinfer_decoder
from remask.diffusion.parts.stats import GenerationStats, SyncCounter
from remask.diffusion.parts.stepper import run_forwards, step_alone
from remask.engine import LLMEngine, SamplingParams
from remask.models.spec import get_spec
from remask.zoo import charset

PROMPTS = ["sort 52814", "sort 93710", "sort 11111", "sort 20485"]   # one length: one shared forward

RULES = {
    "schedule": dict(steps=16, gen_length=16, block_length=8),
    "threshold": dict(steps=16, gen_length=16, block_length=8, threshold=0.6),
    "factor": dict(steps=16, gen_length=16, block_length=4, factor=1.0),
    "suppressed eos": dict(steps=16, gen_length=16, block_length=8, logits_eos_inf=True),
}


@pytest.fixture(scope="module")
def tiny():
    return remask.load("tiny-llada")


@pytest.mark.portable   # a row stacked with others computes as alone on every CPU (make test-portable)
@pytest.mark.parametrize("rule", sorted(RULES))
def test_each_row_commits_what_its_own_commit_would(tiny, rule):
    model, _ = tiny
    spec = get_spec(model)
    decoders = [BlockDecoder(spec, **RULES[rule]) for _ in PROMPTS]
    states = [d.start(torch.tensor([charset.encode_chat(p)])) for d, p in zip(decoders, PROMPTS)]

    def together(*args):
        with SyncCounter() as counter:
            BlockDecoder.commit_together(*args)
        assert counter.total <= 1       # one host read for the whole group (a parallel rule's)

    steps = 0   # commits made together with another state's
    for i, state, alone, stats, alone_stats, batched in commit_each_step(model, decoders, states, together):
        assert torch.equal(state.x, alone.x), (rule, i)
        assert (state.block, state.step, state.done) == (alone.block, alone.step, alone.done)
        assert stats.tokens_per_step == alone_stats.tokens_per_step and stats.nfe == 1
        steps += batched > 1
    assert steps >= 4
    assert all(not (s.x == spec.mask_id).any() for s in states)


def test_commit_keys_keep_apart_what_cannot_batch(tiny):
    spec = get_spec(tiny[0])
    key = lambda **kw: BlockDecoder(spec, steps=16, gen_length=16, block_length=8, **kw).commit_key()  # noqa: E731
    assert key() == key() and key() is not None
    assert key(threshold=0.9) != key() and key(threshold=0.9) != key(threshold=0.8)
    assert BlockDecoder(spec, steps=16, gen_length=16, block_length=4).commit_key() != key()
    for alone in (dict(temperature=0.5), dict(remasking="random"), dict(reference_ties=True),
                  dict(confidence_eos_eot_inf="corrected"), dict(cfg_scale=1.0)):
        assert key(**alone) is None, alone


def test_the_engine_batches_commits_and_keeps_each_requests_tokens(tiny, monkeypatch):
    model, tokenizer = tiny
    calls = count_calls(monkeypatch, BlockDecoder, "commit_together")
    params = [SamplingParams(max_tokens=16, steps=16, block_length=8),
              SamplingParams(max_tokens=16, steps=16, block_length=8, threshold=0.6),
              SamplingParams(max_tokens=16, steps=16, block_length=8, min_tokens=4)]   # min_tokens: alone
    requests = [(f"{i}-{j}", p, sp) for j, sp in enumerate(params) for i, p in enumerate(PROMPTS)]
    got = run_all(model, tokenizer, requests)
    assert calls and max(calls) == len(PROMPTS)     # the two batchable settings, four rows each
    for rid, prompt, sp in requests:
        assert got[rid] == run_all(model, tokenizer, [("solo", prompt, sp)])["solo"], rid

def commit_each_step(model, decoders, states, together):
    """Step `states` to their end (the second and fourth a few steps ahead), each step's logits committed by
    `together(live decoders, live states, logits, fed, stats)` and by each decoder's own `commit` on a copy;
    yields (state index, the state, its copy committed alone, the two stats, rows batched) after every commit."""
    with torch.no_grad():
        for i in (1, 3, 3):
            step_alone(decoders[i], model, states[i])
        while not all(s.done for s in states):
            live = [i for i, s in enumerate(states) if not s.done]
            answers = [run_forwards(model, [decoders[i].next_forward(states[i])])[0] for i in live]
            logits, fed = zip(*(decoders[i].finish_forward(states[i], a) for i, a in zip(live, answers)))
            alone = [copy.deepcopy(states[i]) for i in live]
            alone_stats = [GenerationStats() for _ in live]
            for j, i in enumerate(live):
                decoders[i].commit(alone[j], logits[j], fed[j], stats=alone_stats[j])
            stats = [GenerationStats() for _ in live]
            together([decoders[i] for i in live], [states[i] for i in live], logits, fed, stats)
            for j, i in enumerate(live):
                yield i, states[i], alone[j], stats[j], alone_stats[j], len(live)


def count_calls(monkeypatch, cls, name):
    """Replace the static `cls.name` by a spy; returns the list of the numbers of states it was called with."""
    sizes, real = [], getattr(cls, name)

    def spy(decoders, states, *args):
        sizes.append(len(states))
        return real(decoders, states, *args)

    monkeypatch.setattr(cls, name, staticmethod(spy))
    return sizes


RULE_PROMPTS = ["sort 52814", "add 3 and 4", "sort 9", "reverse abcdefg"]   # four lengths: blocks of other widths
# every rule the engine steps as a BlockDecoder (`Method.decoder`): a new one is checked here with no edit
RULE_CASES = {name: dict(decoder=method.config()) for name, method in registry.METHODS.items()
              if method.decoder is not None}
RULE_CASES["credit, dual cache"] = dict(decoder=remask.CreditDecoding(), use_cache="dual")
RULE_CASES["vicinity"] = dict(decoder=remask.ThresholdDecoding(), use_cache=VicinityCache(warmup_steps=1))


@pytest.mark.portable   # a row stacked with others computes as alone on every CPU (make test-portable)
@pytest.mark.parametrize("case", sorted(RULE_CASES))
def test_rule_commits_of_several_requests_batch_each_row_as_alone(tiny, case):
    """dInfer's rules in the engine: `commit_together` over requests at different blocks and steps (their blocks
    of different widths, CreditDecoding's credits at different decodes) commits what each request's own commit does."""
    model, _ = tiny
    spec = get_spec(model)
    prompts = [torch.tensor([charset.encode_chat(p)]) for p in RULE_PROMPTS]
    decoders = [dinfer_decoder(spec, p, gen_length=40, block_length=8, early_stop=False,
                              **RULE_CASES[case])[0] for p in prompts]
    assert len({d.commit_key() for d in decoders}) == 1 and decoders[0].commit_key() is not None
    states = [d.start(p) for d, p in zip(decoders, prompts)]
    widths, calls, credits = set(), 0, 0

    def together(decoders, states, *args):
        nonlocal calls
        widths.update(d.block_span(s)[1] - d.block_span(s)[0] for d, s in zip(decoders, states))
        calls += len(states) > 1
        BlockDecoder.commit_together(decoders, states, *args)

    for i, state, alone, stats, alone_stats, _ in commit_each_step(model, decoders, states, together):
        assert torch.equal(state.x, alone.x), (case, i)
        assert (state.block, state.step, state.iter_no, state.group, state.done) == \
            (alone.block, alone.step, alone.iter_no, alone.group, alone.done), (case, i)
        assert stats.tokens_per_step == alone_stats.tokens_per_step
        if alone.rule_state is not None:   # the credit each request carries on (None: a new block's)
            ours, theirs = state.rule_state["matrix"], alone.rule_state["matrix"]
            assert (ours is None and theirs is None) or torch.equal(ours, theirs), (case, i)
            credits += ours is not None
    assert calls >= 2 and len(widths) >= 2   # several batched commits, over blocks of more than one width
    assert credits > 0 or "credit" not in case
    assert all(not (s.x == spec.mask_id).any() for s in states)


def test_rule_commit_keys_keep_apart_what_cannot_batch(tiny):
    spec = get_spec(tiny[0])
    prompt = torch.tensor([charset.encode_chat("sort 1")])
    key = lambda **kw: dinfer_decoder(spec, prompt, gen_length=16, block_length=8, **kw)[0].commit_key()  # noqa: E731
    assert key(decoder=remask.CreditDecoding()) == key(decoder=remask.CreditDecoding()) is not None
    assert key(decoder=remask.ThresholdDecoding(threshold=0.8)) != key(decoder=remask.ThresholdDecoding())
    assert key(decoder=remask.CreditDecoding()) != key(decoder=remask.ThresholdDecoding())
    assert key(decoder=remask.ThresholdDecoding(smoothing=remask.IterationSmoothing())) is None
    assert key(decoder=remask.KLASS()) is None   # its KL memory does not stack


def test_the_engine_batches_rule_commits_and_keeps_each_requests_tokens(tiny, monkeypatch):
    model, tokenizer = tiny
    sizes = count_calls(monkeypatch, BlockDecoder, "_rules_together")
    params = [SamplingParams(max_tokens=16, block_length=8, decoder=remask.CreditDecoding()),
              SamplingParams(max_tokens=16, block_length=8, decoder=remask.HierarchicalDecoding()),
              SamplingParams(max_tokens=16, block_length=8, use_cache=VicinityCache())]
    got = run_all(model, tokenizer, [(f"{i}-{j}", p, sp) for j, sp in enumerate(params)
                                     for i, p in enumerate(RULE_PROMPTS)])
    assert sizes and max(sizes) == len(RULE_PROMPTS)
    for j, sp in enumerate(params):
        for i, prompt in enumerate(RULE_PROMPTS):
            assert got[f"{i}-{j}"] == run_all(model, tokenizer, [("solo", prompt, sp)])["solo"], (i, j)
            want = remask.generate(model, torch.tensor([charset.encode_chat(prompt)]), gen_length=16, block_length=8,
                                   decoder=sp.decoder, use_cache=sp.use_cache)
            assert got[f"{i}-{j}"][0] == want[0, -16:].tolist(), (i, j)   # the drop-in's tokens


def run_all(model, tokenizer, requests):
    engine = LLMEngine(model, tokenizer)
    for rid, prompt, sp in requests:
        engine.add_request(rid, charset.encode_chat(prompt), sp)
    got = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = (out.outputs[0].all_token_ids, out.outputs[0].tokens_per_step)
    return got


DREAM_CASES = [(model, alg) for model in ("tiny-llada", "dream_small")
               for alg in ("maskgit_plus", "topk_margin", "entropy")]


@pytest.mark.portable   # a row stacked with others computes as alone on every CPU (make test-portable)
@pytest.mark.parametrize("model_name, alg", DREAM_CASES)
def test_dream_sampler_commits_of_several_requests_batch_each_row_as_alone(tiny, load_model, model_name, alg):
    """Dream's sampler in the engine: `DreamDecoder.commit_together` over requests of other canvas lengths, step counts
    and schedules, at different steps, commits what each request's own commit does (LLaDA's layout and Dream's)."""
    from remask.diffusion.families.dream import DreamDecoder, DreamGenerationConfig

    model = tiny[0] if model_name == "tiny-llada" else load_model(model_name)
    spec = get_spec(model)
    prompts = [torch.tensor([charset.encode_chat(p)]) for p in RULE_PROMPTS] if model_name == "tiny-llada" else \
        [torch.randint(0, 290, (1, n), generator=torch.Generator().manual_seed(n)) for n in (5, 9, 12, 7)]
    lengths, steps = (12, 16, 9, 16), (12, 8, 9, 4)
    decoders = []
    for prompt, length, count in zip(prompts, lengths, steps):
        config = DreamGenerationConfig(mask_token_id=spec.mask_id, pad_token_id=spec.pad_id, eos_token_id=spec.eos_id,
                                       steps=count, alg=alg, max_length=prompt.shape[1] + length)
        decoders.append(DreamDecoder(spec, config))
    assert len({d.commit_key() for d in decoders}) == 1 and decoders[0].commit_key() is not None
    states = [d.start(p) for d, p in zip(decoders, prompts)]
    calls, idle = 0, 0
    for i, state, alone, stats, alone_stats, batched in commit_each_step(model, decoders, states,
                                                                         DreamDecoder.commit_together):
        assert torch.equal(state.x, alone.x), (alg, i)
        assert (state.step, state.done) == (alone.step, alone.done)
        assert stats.tokens_per_step == alone_stats.tokens_per_step and stats.nfe == 1
        calls += batched > 1
        idle += stats.tokens_per_step == [0]
    assert calls >= 4 and idle > 0   # batched steps, some of which commit nothing for a request (a count of 0)
    assert all(not (s.x == spec.mask_id).any() for s in states)


def test_dream_commit_keys_keep_apart_what_cannot_batch(tiny):
    from remask.diffusion.families.dream import DreamDecoder, DreamGenerationConfig

    spec = get_spec(tiny[0])

    def key(hooked=False, **settings):
        config = DreamGenerationConfig(mask_token_id=spec.mask_id, steps=8, max_length=24, **settings)
        return DreamDecoder(spec, config, tokens_hook=(lambda step, x, logits: x) if hooked else None).commit_key()

    assert key(alg="entropy") == key(alg="entropy") is not None and key(alg="entropy") != key(alg="maskgit_plus")
    for alone in (dict(alg="origin"), dict(alg="confidence_threshold"), dict(alg="entropy", temperature=0.5),
                  dict(alg="entropy", alg_temp=0.1), dict(alg="entropy", top_k=5), dict(alg="entropy", hooked=True),
                  dict(alg="entropy", return_dict_in_generate=True, output_history=True)):
        assert key(**alone) is None, alone


def test_prophet_requests_batch_their_commits_in_the_engine(tiny, monkeypatch):
    """A step generator's commit asked as `Together` (Prophet's `BlockDecoder` commits): the engine makes the commits
    of its requests in one `commit_together`, each request's tokens the drop-in's."""
    model, tokenizer = tiny
    sizes = count_calls(monkeypatch, BlockDecoder, "commit_together")
    sp = SamplingParams(max_tokens=16, steps=16, block_length=8, decoder=remask.Prophet())
    got = run_all(model, tokenizer, [(str(i), p, sp) for i, p in enumerate(RULE_PROMPTS)])
    assert max(sizes) == len(RULE_PROMPTS)
    for i, prompt in enumerate(RULE_PROMPTS):
        want = remask.generate(model, torch.tensor([charset.encode_chat(prompt)]), steps=16, gen_length=16,
                               block_length=8, decoder=remask.Prophet())
        assert got[str(i)][0] == want[0, -16:].tolist(), i


def _steps_of(script):
    """A step generator that asks for `Together` work and a forward per entry of `script` ("ok", "raise": its
    work's run raises, "fail": the generator raises after its work), then returns its canvas."""
    from remask.diffusion.parts.stepper import StepwiseDecoder, Together
    from remask.models.request import ForwardRequest

    def run(args):
        if any(kind == "raise" for kind, _ in args):
            raise RuntimeError("the batched work failed")
        return [value * 2 for _, value in args]

    def make_steps(prompt, generator, stats):
        x = prompt.clone()
        for n, kind in enumerate(script):
            doubled = yield Together("double", run, (kind, n))
            assert doubled == 2 * n
            if kind == "fail":
                raise ValueError("this request's own error")
            yield ForwardRequest.call(x, {})
        return x

    return StepwiseDecoder(make_steps, gen_length=0)


def test_a_generator_that_fails_among_others_fails_alone():
    """`StepwiseDecoder.receive_together`: the requests' `Together` work in one call per key; a generator that raises
    fails alone at its next step; a batched run that raises is thrown into each generator that asked."""
    prompt = torch.zeros(1, 3, dtype=torch.long)
    decoders = [_steps_of(["ok", "ok"]), _steps_of(["ok", "fail"]), _steps_of(["ok", "ok"])]
    states = [d.start(prompt) for d in decoders]
    for d, s in zip(decoders, states):
        assert d.next_forward(s) is not None
    decoders[0].receive_together(decoders, states, [None] * 3, [None] * 3, [None] * 3)
    assert states[0].pending is not None and states[2].pending is not None
    with pytest.raises(ValueError, match="own error"):
        decoders[1].next_forward(states[1])
    assert not states[1].done
    decoders[0].receive_together([decoders[0], decoders[2]], [states[0], states[2]], [None] * 2, [None] * 2,
                                 [None] * 2)
    assert states[0].done and states[2].done
    raising = [_steps_of(["raise"]), _steps_of(["ok"])]   # one key: the run fails for both
    with pytest.raises(RuntimeError, match="batched work failed"):
        raising[0].next_forward(raising[0].start(prompt))   # alone (its first step)
    assert raising[1].next_forward(raising[1].start(prompt)) is not None
    states = [d.start(prompt) for d in raising]
    for s, d in zip(states, raising):
        s.steps = d.make_steps(prompt, None, s.counted)
    raising[0].receive_together(raising, states, [None] * 2, [None] * 2, [None] * 2)
    for d, s in zip(raising, states):
        with pytest.raises(RuntimeError, match="batched work failed"):
            d.next_forward(s)


def test_elastic_cache_requests_batch_their_rule_commits_in_the_engine(tiny, monkeypatch):
    """A commit rule's commit asked as `Together` (Elastic-Cache's window with a rule): the engine commits the windows
    of one width of its requests in one `commit_rows`, each request's tokens the drop-in's."""
    from remask.diffusion.parts import step

    model, tokenizer = tiny
    sizes, real = [], step.rule_commits
    monkeypatch.setattr(step, "rule_commits", lambda items: sizes.append(len(items)) or real(items))
    sp = SamplingParams(max_tokens=16, use_cache=remask.ElasticCache(), decoder=remask.CreditDecoding())
    got = run_all(model, tokenizer, [(str(i), p, sp) for i, p in enumerate(RULE_PROMPTS)])
    assert max(sizes) == len(RULE_PROMPTS)
    for i, prompt in enumerate(RULE_PROMPTS):
        want = remask.generate(model, torch.tensor([charset.encode_chat(prompt)]), gen_length=16, block_length=16,
                               use_cache=remask.ElasticCache(), decoder=remask.CreditDecoding())
        assert got[str(i)][0] == want[0, -16:].tolist(), i


@pytest.mark.portable
def test_greedy_ar_requests_sample_together_each_as_ar_generate_alone(monkeypatch):
    """The AR decoder's greedy requests (no processor, no structure) take their next tokens from one `sample` over
    their stacked last positions; sampled ones and those with a processor (min_tokens) sample alone. Every request's
    tokens are `ar_generate`'s on it alone (min_tokens: its own, alone in the engine)."""
    from remask.diffusion.families.ar import ARDecoder

    model, tokenizer = remask.load("tiny-ar")
    rows: list[int] = []
    real = ARDecoder.sample

    def sample(self, logits, *args, **kwargs):
        rows.append(logits.shape[0])
        return real(self, logits, *args, **kwargs)
    monkeypatch.setattr(ARDecoder, "sample", sample)
    params = [SamplingParams(max_tokens=12), SamplingParams(max_tokens=12, top_k=3),
              SamplingParams(max_tokens=12, temperature=0.8, seed=5), SamplingParams(max_tokens=12, min_tokens=6)]
    requests = [(f"{i}-{j}", p, sp) for j, sp in enumerate(params) for i, p in enumerate(RULE_PROMPTS)]
    engine = LLMEngine(model, tokenizer)
    for rid, prompt, sp in requests:
        engine.add_request(rid, charset.encode_chat(prompt), sp)
    got = {}
    while engine.has_unfinished_requests():
        got.update({out.request_id: out.outputs[0] for out in engine.step() if out.finished})
    assert max(rows) == len(RULE_PROMPTS)   # the greedy ones of one key in one call
    for rid, prompt, sp in requests:
        if sp.min_tokens:   # (ar_generate has no min_tokens: the request alone in the engine)
            assert got[rid].all_token_ids == run_all(model, tokenizer, [("solo", prompt, sp)])["solo"][0], rid
            continue
        ids = torch.tensor([charset.encode_chat(prompt)])
        alone = remask.ar_generate(model, ids, generator=torch.Generator().manual_seed(sp.seed or 0),
                                   **sp.ar_kwargs([charset.EOS_ID]))[0, ids.shape[1]:].tolist()
        assert got[rid].all_token_ids == alone[:len(got[rid].all_token_ids)], rid


@pytest.mark.portable   # stacked rows (FFT density, sums, sorts) compute as alone on every CPU (make test-portable)
def test_d2cache_requests_settle_their_steps_together_each_as_alone(tiny, monkeypatch):
    """d2Cache's step ends (scores, commit, the next forward's rows) of its requests in one `_settle` per setting, the
    sequence-wide part stacked per prompt length: each request's tokens the drop-in's, and its tokens per step."""
    from remask.diffusion.methods import d2cache

    model, tokenizer = tiny
    sizes, real = [], d2cache._settle
    monkeypatch.setattr(d2cache, "_settle", lambda *args: sizes.append(len(args[-1])) or real(*args))
    prompts = RULE_PROMPTS + ["sort 52815", "sort 7"]   # lengths shared by two requests, and alone
    for config in (remask.D2Cache(current_k=4), remask.D2Cache(rollout_p=0.5, inflate_w=0)):
        sizes.clear()
        sp = SamplingParams(max_tokens=16, steps=16, block_length=8, use_cache=config)
        got = run_all(model, tokenizer, [(str(i), p, sp) for i, p in enumerate(prompts)])
        assert max(sizes) == len(prompts)
        for i, prompt in enumerate(prompts):
            stats = remask.GenerationStats()
            want = remask.generate(model, torch.tensor([charset.encode_chat(prompt)]), steps=16, gen_length=16,
                                   block_length=8, use_cache=config, stats=stats)
            assert got[str(i)] == (want[0, -16:].tolist(), stats.tokens_per_step), (config, i)


@pytest.mark.portable   # stacked drafts score and step as alone on every CPU (make test-portable)
@pytest.mark.parametrize("cache,config", [("dual", remask.FreeDave()), (None, remask.FreeDave(draft_steps=3)),
                                          ("prefix", remask.FreeDave(confidence_threshold=0.9, match_rule="exact"))])
def test_freedave_requests_take_their_verdicts_together_each_as_alone(tiny, monkeypatch, cache, config):
    """FreeDave's round verdicts (the drafts scored, each draft's target, the chain) of its requests in one `_verdicts`
    per setting, their drafts padded to the most any request has: each request's tokens and rounds the drop-in's."""
    from remask.diffusion.methods import freedave

    model, tokenizer = tiny
    sizes, drafts, real = [], [], freedave._verdicts
    monkeypatch.setattr(freedave, "_verdicts", lambda *args: (sizes.append(len(args[-1])),
                                                               drafts.append({d.shape[1] for *_, d, _ in args[-1]}),
                                                               real(*args))[-1])
    prompts = RULE_PROMPTS + ["sort 52815"]
    sp = SamplingParams(max_tokens=16, block_length=8, decoder=config, use_cache=cache)
    got = run_all(model, tokenizer, [(str(i), p, sp) for i, p in enumerate(prompts)])
    if config.confidence_threshold is None:   # every request drafts in every step; some with fewer drafts (padded)
        assert max(sizes) == len(prompts) and any(len(k) > 1 for k in drafts)
    else:   # FreeDave++ decodes a block in a step or two: the requests' rounds part
        assert max(sizes) > 1
    for i, prompt in enumerate(prompts):
        stats = remask.GenerationStats()
        want = remask.generate(model, torch.tensor([charset.encode_chat(prompt)]), gen_length=16, block_length=8,
                               decoder=config, use_cache=cache, stats=stats)
        assert got[str(i)] == (want[0, -16:].tolist(), stats.tokens_per_step), (cache, i)


@pytest.mark.portable   # spans scored with other requests' score as alone on every CPU (make test-portable)
@pytest.mark.parametrize("config", [remask.MultiBlock(), remask.MultiBlock(cache_delay_iter=1),
                                    remask.MultiBlock.sglang()], ids=["default", "kv cache", "sglang"])
def test_multiblock_requests_score_their_spans_together_each_as_alone(tiny, monkeypatch, config):
    """MultiBlock's scoring (each row's open span: greedy token, negative entropy) of its requests in one `_score_spans`
    call a step: each request's tokens and tokens per step the drop-in's."""
    from remask.diffusion.methods import multiblock

    model, tokenizer = tiny
    sizes, real = [], multiblock._score_spans
    monkeypatch.setattr(multiblock, "_score_spans", lambda *args: sizes.append(len(args[-1])) or real(*args))
    prompts = RULE_PROMPTS + ["sort 52815"]
    sp = SamplingParams(max_tokens=16, block_length=8, decoder=config)
    got = run_all(model, tokenizer, [(str(i), p, sp) for i, p in enumerate(prompts)])
    assert max(sizes) == len(prompts)
    for i, prompt in enumerate(prompts):
        stats = remask.GenerationStats()
        want = remask.generate(model, torch.tensor([charset.encode_chat(prompt)]), gen_length=16, block_length=8,
                               decoder=config, stats=stats)
        assert got[str(i)] == (want[0, -16:].tolist(), stats.tokens_per_step), (config, i)
