"""DiffusionGemma through remask: transformers' own `DiffusionGemmaForBlockDiffusion` (tiny random
checkpoints in the official format, written by `save_pretrained` and loaded back with the Auto
class), decoded by remask's canvas loop, against `model.generate` run side by side.

With ``reference_rng=True`` remask makes transformers' random draws in its order, so under the same
seed the tokens (and `tokens_per_forward`) are `model.generate`'s: single rows and left-padded
batches, several sampler settings, adaptive stopping on and off, EOS and padding after it,
`decoder_input_ids`, `max_length`, a generation_config.json round trip.
"""
from __future__ import annotations

import pytest
import torch

import remask
from remask.diffusion.families import canvas
from remask.diffusion.parts.selection import entropy_bound_accept
from remask.models import get_spec, tiny
from remask.zoo import charset

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DiffusionGemmaForBlockDiffusion"):   # pragma: no cover
    pytest.skip("DiffusionGemma needs transformers >= 5.11", allow_module_level=True)
from transformers import AutoModelForImageTextToText  # noqa: E402
from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig  # noqa: E402

V, L = 301, 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("diffusion_gemma")
    tiny.write_tiny_diffusion_gemma(str(path), seed=0, vocab_size=V, canvas_length=L,
                                    generation={"max_denoising_steps": 6, "t_min": 0.5, "t_max": 0.9})
    return str(path)


@pytest.fixture(scope="module")
def model(checkpoint):
    return AutoModelForImageTextToText.from_pretrained(checkpoint).eval()


PROMPT = torch.tensor([[2, 17, 42, 99, 5]])
PADDED = torch.tensor([[0, 0, 2, 17, 42], [2, 17, 42, 99, 5], [0, 2, 9, 8, 7]])
PADDED_MASK = (torch.arange(5)[None] >= torch.tensor([2, 0, 1])[:, None]).long()

SETTINGS = {
    "defaults": dict(max_new_tokens=16),
    "adaptive-stop": dict(max_new_tokens=24, max_denoising_steps=8, confidence_threshold=4.0),
    "wide-bound-no-stability": dict(max_new_tokens=16, sampler_config=EntropyBoundSamplerConfig(entropy_bound=3.0),
                                    confidence_threshold=4.0, stability_threshold=0),
    "stability-2": dict(max_new_tokens=16, max_denoising_steps=10, stability_threshold=2, confidence_threshold=5.0,
                        sampler_config=EntropyBoundSamplerConfig(entropy_bound=1.5)),
    "no-schedule-no-stop": dict(max_new_tokens=12, t_min=None, t_max=None, stability_threshold=None),
    "max_length": dict(max_length=21, max_denoising_steps=3),
}


def both(model, inputs, seed, **kw):
    torch.manual_seed(seed)
    want = model.generate(inputs, **kw)
    torch.manual_seed(seed)
    got = remask.diffusion_generate(model, inputs, reference_rng=True, **kw)
    return want, got


def assert_same(want, got):
    assert torch.equal(got.sequences, want.sequences), (got.sequences, want.sequences)
    assert torch.equal(got.tokens_per_forward, want.tokens_per_forward)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_single_row_reproduces_model_generate(model, name):
    want, got = both(model, PROMPT, 1234, **SETTINGS[name])
    assert_same(want, got)
    assert type(got).__name__ == "DiffusionGemmaGenerationOutput"
    assert torch.equal(got.sequences[:, :PROMPT.shape[1]], PROMPT)


@pytest.mark.parametrize("name", ["defaults", "adaptive-stop", "stability-2"])
def test_left_padded_batch_reproduces_model_generate(model, name):
    want, got = both(model, PADDED, 7, attention_mask=PADDED_MASK, **SETTINGS[name])
    assert_same(want, got)
    assert torch.equal(got.sequences[:, :5], PADDED)


def test_eos_pads_the_rest_and_stops_finished_rows(model):
    """EOS ids taken from a run's first canvas: that row ends there, pad follows its first EOS, its
    later canvases are all pad, and the loop stops once every row has finished."""
    kw = dict(max_new_tokens=24, attention_mask=PADDED_MASK)
    torch.manual_seed(3)
    free = model.generate(PADDED, **kw).sequences
    eos = [int(free[0, 5 + 2]), int(free[2, 5 + 4])]
    want, got = both(model, PADDED, 3, eos_token_id=eos, **kw)
    assert_same(want, got)
    out = got.sequences
    assert (out[0, 5 + 3:] == 0).all() and (out[2, 5 + 5:] == 0).all()
    assert bool((out[1, 5:] == 0).sum() < out.shape[1] - 5)


def test_decoder_input_ids_and_return_dict_off(model):
    start = torch.randint(0, V, (3, L), generator=torch.Generator().manual_seed(3))
    want, got = both(model, PADDED, 11, attention_mask=PADDED_MASK, decoder_input_ids=start, max_new_tokens=16,
                     return_dict_in_generate=False)
    assert torch.is_tensor(got) and torch.equal(got, want)


def test_the_callers_logits_processors_run_before_the_schedule_as_in_model_generate(model):
    """A `logits_processor` list (transformers' two-argument warper and a processor that reads the step) is applied
    as `model.generate` applies it, before the checkpoint's temperature schedule: the same tokens under one seed."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper

    class SharperOnOddSteps:   # reads the step (counting down), as the schedule does
        def __call__(self, input_ids, scores, cur_step):
            return scores * (3.0 if int(cur_step) % 2 else 1.0)

    def processors():   # a fresh list for each call: `model.generate` appends its schedule to the caller's
        return LogitsProcessorList([TemperatureLogitsWarper(0.7), SharperOnOddSteps()])
    torch.manual_seed(5)
    want = model.generate(PADDED, attention_mask=PADDED_MASK, max_new_tokens=16, logits_processor=processors())
    torch.manual_seed(5)
    got = remask.diffusion_generate(model, PADDED, attention_mask=PADDED_MASK, max_new_tokens=16, reference_rng=True,
                                    logits_processor=processors())
    assert_same(want, got)
    torch.manual_seed(5)
    plain = remask.diffusion_generate(model, PADDED, attention_mask=PADDED_MASK, max_new_tokens=16,
                                      reference_rng=True)
    assert not torch.equal(plain.sequences, got.sequences)   # the processors changed the draws


def test_generation_config_round_trip(model, checkpoint):
    """The checkpoint's generation_config.json (with the sampler config) drives both loops alike."""
    assert model.generation_config.max_denoising_steps == 6 and model.generation_config.t_max == 0.9
    want, got = both(model, PROMPT, 5, max_new_tokens=24)
    assert_same(want, got)
    stats = remask.GenerationStats()
    remask.diffusion_generate(model, PROMPT, max_new_tokens=24, stability_threshold=None, stats=stats)
    assert stats.nfe == 3 * 6   # three canvases of the checkpoint's 6 denoising steps
    assert stats.generated_tokens == 24 and len(stats.tokens_per_step) == 18


def test_spec_and_patch(model):
    spec = get_spec(model)
    assert (spec.kind, spec.noise, spec.layout, spec.mask_id, spec.block_length) == (
        "diffusion_gemma", "uniform", "encoder-decoder", None, L)
    patched = remask.patch(AutoModelForImageTextToText.from_pretrained(model.name_or_path).eval())
    torch.manual_seed(9)
    want = model.generate(PROMPT, max_new_tokens=8)
    torch.manual_seed(9)
    got = patched.generate(PROMPT, max_new_tokens=8, reference_rng=True)
    assert_same(want, got)


def test_fused_default_path_keeps_the_prompt_and_is_seeded(model):
    """Without reference_rng the step is scored by the fused kernel (its own stream): the same seed
    gives the same tokens, the prompt comes back unchanged, tokens are in the vocabulary."""
    runs = [remask.diffusion_generate(model, PADDED, attention_mask=PADDED_MASK, max_new_tokens=16,
                                      generator=torch.Generator().manual_seed(4)).sequences for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    assert torch.equal(runs[0][:, :5], PADDED)
    assert int(runs[0].max()) < V and int(runs[0].min()) >= 0


def test_step_functions():
    entropy = torch.tensor([[0.5, 0.1, 0.3, 2.0], [3.0, 0.0, 0.0, 0.2]])
    accepted = entropy_bound_accept(entropy, 0.5)
    # row 0: sorted 0.1, 0.3, 0.5, 2.0 → sums before each: 0, 0.1, 0.4, 0.9 → three accepted;
    # row 1: 0, 0, 0.2, 3.0 → 0, 0, 0, 0.2: all (the largest entropy is not counted against the bound)
    assert accepted.tolist() == [[True, True, True, False], [True, True, True, True]]
    assert entropy_bound_accept(torch.tensor([[0.9, 0.8, 0.7]]), 0.5).tolist() == [[False, False, True]]
    tracker = canvas.StabilityTracker(2, 1.0)
    a = torch.tensor([[1, 2]])
    low = torch.tensor([0.5])
    assert [bool(tracker(a, low)) for _ in range(3)] == [False, False, True]
    assert not bool(tracker(torch.tensor([[1, 3]]), low))


def test_bad_arguments_name_the_parameter(model):
    with pytest.raises(ValueError, match="top_k|Unexpected|unexpected"):
        remask.diffusion_generate(model, PROMPT, top_k=5)
    with pytest.raises(ValueError, match="past_key_values"):
        remask.diffusion_generate(model, PROMPT, past_key_values=object())
    with pytest.raises(ValueError, match="attention_mask"):
        remask.diffusion_generate(model, PROMPT, attention_mask=torch.ones(1, 3))
    with pytest.raises(TypeError, match="reference_rng"):
        remask.diffusion_generate(model, PROMPT, reference_rng=1)
    with pytest.raises(ValueError, match="pixel_values"):
        remask.diffusion_generate(model, PROMPT, pixel_values=torch.zeros(1))


def test_remask_rules_keep_the_invariants_and_count_their_steps(model):
    """remask's accept rules on DiffusionGemma: top_k=L accepts every position at every step; the
    threshold rule accepts at least one; the explicit reference rule under reference_rng is the
    reference; every run keeps the prompt, stays in the vocabulary and repeats under its seed."""
    kw = dict(attention_mask=PADDED_MASK, max_new_tokens=16, stability_threshold=None)
    stats = remask.GenerationStats()
    remask.diffusion_generate(model, PADDED, canvas_sampler=remask.CanvasSampler(rule="top_k", top_k=L), stats=stats,
                              generator=torch.Generator().manual_seed(0), **kw)
    assert stats.tokens_per_step == [3 * L] * (2 * 6)
    stats = remask.GenerationStats()
    remask.diffusion_generate(model, PADDED, canvas_sampler=remask.CanvasSampler(rule="threshold", threshold=0.99),
                              stats=stats, generator=torch.Generator().manual_seed(0), **kw)
    assert min(stats.tokens_per_step) >= 3
    want, got = both(model, PADDED, 2, canvas_sampler=remask.CanvasSampler(), **kw)
    assert_same(want, got)
    for sampler in (remask.CanvasSampler(rule="top_k", top_k=3), remask.CanvasSampler(freeze_after=2),
                    remask.CanvasSampler(rule="threshold", threshold=0.5, freeze_after=1)):
        runs = [remask.diffusion_generate(model, PADDED, canvas_sampler=sampler,
                                          generator=torch.Generator().manual_seed(8), **kw).sequences for _ in range(2)]
        assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0][:, :5], PADDED)
        assert 0 <= int(runs[0].min()) and int(runs[0].max()) < V


def test_freezing_commits_stable_positions_and_ends_the_canvas(model):
    """freeze_after=1: a position whose argmax repeats is kept for good; once a row's canvas is all
    frozen it stops (fewer forwards than the full schedule) and outputs the frozen tokens."""
    drafts = []

    class Drafts:
        def put(self, value):
            pass

        def put_draft(self, value):
            drafts.append(value.clone())

        def end(self):
            pass

    stats = remask.GenerationStats()
    out = remask.diffusion_generate(model, PROMPT, max_new_tokens=8, max_denoising_steps=40, stability_threshold=None,
                                    canvas_sampler=remask.CanvasSampler(freeze_after=1), stats=stats,
                                    streamer=Drafts(), generator=torch.Generator().manual_seed(1))
    assert stats.nfe < 40 and len(drafts) == stats.nfe
    assert torch.equal(out.sequences[0, 5:], drafts[-1][0])
    # once frozen a position's draft never changes again: the last two drafts agree everywhere
    assert torch.equal(drafts[-1], drafts[-2])


def test_canvas_sampler_validates_its_fields():
    with pytest.raises(ValueError, match="rule"):
        remask.CanvasSampler(rule="nope")
    with pytest.raises((ValueError, TypeError), match="threshold"):
        remask.CanvasSampler(rule="threshold")
    with pytest.raises(ValueError, match="top_k"):
        remask.CanvasSampler(top_k=3)
    with pytest.raises((ValueError, TypeError), match="freeze_after"):
        remask.CanvasSampler(freeze_after=0)


# ---- the engine and the server ------------------------------------------------------------------

def test_engine_request_equals_model_generate_and_ignores_its_batch(model):
    """A request with `reference_rng` and seed s decodes what `model.generate` does after
    torch.manual_seed(s) (its own generator replays the global stream); every request runs its
    own forwards, so together, alone or in another order the tokens are the same."""
    llm = remask.LLM(model)
    prompts = [[2, 17, 42, 99, 5], [2, 9, 8], [2, 5, 6, 7, 8, 9, 10]]
    params = remask.SamplingParams(max_tokens=16, seed=3, reference_rng=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        torch.manual_seed(3)
        want = model.generate(torch.tensor([prompt]), max_new_tokens=16).sequences[0, len(prompt):].tolist()
        assert out.outputs[0].all_token_ids == want
        assert out.outputs[0].nfe <= 2 * 6
    params = remask.SamplingParams(max_tokens=12, seed=4, decoder=remask.CanvasDecoding(
        entropy_bound=1.0, max_denoising_steps=5, sampler=remask.CanvasSampler(freeze_after=2)))
    together = llm.generate(prompts, params, use_tqdm=False)
    alone = [llm.generate([p], params, use_tqdm=False)[0] for p in reversed(prompts)][::-1]
    for a, b in zip(together, alone):
        assert a.outputs[0].all_token_ids == b.outputs[0].all_token_ids
        assert len(a.outputs[0].all_token_ids) == 12   # max_tokens caps the two canvases' 16 positions
    direct = remask.diffusion_generate(model, torch.tensor([prompts[0]]), max_new_tokens=12, max_denoising_steps=5,
                                       sampler_config=EntropyBoundSamplerConfig(entropy_bound=1.0),
                                       canvas_sampler=remask.CanvasSampler(freeze_after=2),
                                       generator=torch.Generator().manual_seed(4))
    assert direct.sequences[0, 5:17].tolist() == together[0].outputs[0].all_token_ids


def test_forwards_of_several_requests_share_one_call_each_as_alone(model):
    """The encoder forwards (a closed canvas each) and then the decoder forwards of four requests (other prompt
    lengths, caches and masks) stacked in one call each: every request's cache is written and its logits are
    computed bitwise as by its own forward, under the engine's invariance context (each request's attention
    over its own cache, its experts over its own tokens: those would mix the requests' rows)."""
    import copy

    from remask.diffusion.parts.stepper import run_forwards
    from remask.kernels.batch_invariant import batch_invariant_linear

    def invariant(rows, groups=None):   # the engine runner's on CPU
        return batch_invariant_linear(rows > 1, single_thread=True, token_groups=groups)

    canvas_model = remask.models.diffusion_gemma.CanvasModel(get_spec(model))
    g = torch.Generator().manual_seed(0)
    caches, encodes = [], []
    for n in (5, 3, 12, 7):
        caches.append(canvas_model.new_cache())
        run_forwards(model, [canvas_model.encoder_forward(torch.randint(3, V - 3, (1, n), generator=g),
                                                          torch.ones(1, n, dtype=torch.bool), torch.arange(n)[None],
                                                          caches[-1])], invariant)
        encodes.append((torch.randint(3, V - 3, (1, L), generator=g), torch.ones(1, n + L, dtype=torch.bool),
                        torch.arange(n, n + L)[None]))
    alone = [copy.deepcopy(cache) for cache in caches]
    for cache, (ids, mask, positions) in zip(alone, encodes):
        run_forwards(model, [canvas_model.encoder_forward(ids, mask, positions, cache)], invariant)
    run_forwards(model, [canvas_model.encoder_forward(ids, mask, positions, cache)
                         for cache, (ids, mask, positions) in zip(caches, encodes)], invariant)
    for own, shared in zip(alone, caches):
        assert all(torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
                   for a, b in zip(own.layers, shared.layers))
    requests = []
    for cache, (_, mask, positions) in zip(caches, encodes):
        canvas = torch.randint(0, V, (1, L), generator=g)
        masks = canvas_model.decoder_masks(canvas, cache, torch.nn.functional.pad(mask, (0, L), value=True))
        requests.append(canvas_model.decoder_forward(canvas, torch.randn(1, L, V, generator=g) * 3, masks, cache,
                                                     positions + L))
    alone = [run_forwards(model, [request], invariant)[0] for request in requests]
    together = run_forwards(model, requests, invariant)
    assert all(torch.equal(a, b) for a, b in zip(alone, together))


def test_stacked_calls_split_the_products_that_mix_requests_rows(model):
    """Inside a stacked call of three requests (1, 2 and 1 rows of `L` positions), `F.linear` over the flattened
    tokens and `torch.matmul` over the stacked rows reach the function below (here a recorder; in the engine the
    batch-invariant linears or torch's) one request at a time, and give what the whole call would; `F.linear` over
    stacked rows (an `nn.Linear`'s: the batch-invariant linears pose each row's problem) and other shapes pass on
    whole."""
    import torch.nn.functional as F

    from remask.kernels.batch_invariant import linear_seam
    from remask.models.diffusion_gemma import _MATMUL, CanvasRows

    rows = CanvasRows([None] * 3, [{}] * 3, [1, 2, 1], L)
    seen: list[tuple[str, tuple[int, ...]]] = []

    def recorder(name, seam):
        def record(x, *args, **kwargs):
            seen.append((name, tuple(x.shape)))
            return seam.raw(x, *args, **kwargs)
        return record
    g = torch.Generator().manual_seed(0)
    tokens, stacked, w = torch.randn(4 * L, 6, generator=g), torch.randn(4, L, 6, generator=g), torch.randn(5, 6)
    with linear_seam.active(recorder("linear", linear_seam)), _MATMUL.active(recorder("matmul", _MATMUL)):
        with rows.forward_scope(model):
            assert torch.allclose(F.linear(tokens, w), tokens @ w.T)
            assert torch.allclose(torch.matmul(stacked, w.T), stacked @ w.T)
            F.linear(stacked, w)
            F.linear(tokens[:3], w)
    assert seen == [("linear", (L, 6)), ("linear", (2 * L, 6)), ("linear", (L, 6)),
                    ("matmul", (1, L, 6)), ("matmul", (2, L, 6)), ("matmul", (1, L, 6)),
                    ("linear", (4, L, 6)), ("linear", (3, 6))]
    assert F.linear is linear_seam.raw and torch.matmul is _MATMUL.raw


def test_engine_runs_even_a_lone_forward_on_one_thread(model):
    """DiffusionGemma's bits depend on the intra-op thread count (`ModelSpec.thread_sensitive`), so the engine's
    runner computes a lone request's forward on one CPU thread, as a batched one; a LLaDA's keeps all threads."""
    from remask.engine.model_runner import ModelRunner

    llada, _ = remask.load("tiny-llada")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for m, lone in ((model, 1), (llada, 2)):
            runner = ModelRunner(m, get_spec(m))
            with runner._invariant(1):
                assert torch.get_num_threads() == lone
            with runner._invariant(3):
                assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_engine_runs_its_requests_forwards_in_shared_calls(model):
    """In the engine, every step's decoder forwards are one model call per kind (with self-conditioning logits
    or without: transformers' forward takes them for every row or none), and its encoder forwards one call per
    input length (each closed canvas has the same); the tokens are each request's alone."""
    prompts = [[2, 17, 42, 99, 5], [2, 9, 8], [2, 5, 6, 7, 8, 9, 10], [2, 11, 12, 13]]
    params = [remask.SamplingParams(max_tokens=16, seed=3, reference_rng=True),
              remask.SamplingParams(max_tokens=24, seed=4, decoder=remask.CanvasDecoding(
                  entropy_bound=1.0, max_denoising_steps=5, sampler=remask.CanvasSampler(freeze_after=2)))]
    calls: list[list[tuple[str, int]]] = []   # per step: (part, rows) of each call

    def record(part, key):   # the encoder takes its ids positionally, the decoder by keyword
        return lambda _m, args, kwargs, _o: calls[-1].append((part, (args[0] if args else kwargs[key]).shape[0]))
    hooks = [model.get_decoder().register_forward_hook(record("decoder", "decoder_input_ids"), with_kwargs=True),
             model.get_encoder().register_forward_hook(record("encoder", "input_ids"), with_kwargs=True)]
    llm = remask.LLM(model)
    for i, prompt in enumerate(prompts):
        llm.engine.add_request(f"r{i}", prompt, params[i % 2])
    done = {}
    try:
        while llm.engine.has_unfinished_requests():
            calls.append([])
            done.update({out.request_id: out.outputs[0].all_token_ids for out in llm.engine.step() if out.finished})
    finally:
        for hook in hooks:
            hook.remove()
    assert calls[0] == [("encoder", 1)] * 4   # four prompt lengths
    assert calls[1] == [("decoder", 4)]       # every request's first decoder forward: one call
    assert all(sum(part == "decoder" for part, _ in step) <= 2 and sum(part == "encoder" for part, _ in step) <= 1
               for step in calls[1:]), calls
    assert ("encoder", 2) in calls[6]         # the first canvases closed: their encoder forwards in one call
    for i, prompt in enumerate(prompts):
        assert done[f"r{i}"] == llm.generate([prompt], params[i % 2], use_tqdm=False)[0].outputs[0].all_token_ids


def test_engine_refuses_what_the_model_does_not_read(model):
    llm = remask.LLM(model)
    with pytest.raises(ValueError, match="temperature"):
        llm.generate([[2, 5]], remask.SamplingParams(temperature=0.5), use_tqdm=False)
    with pytest.raises(ValueError, match="canvas.*steps"):
        remask.SamplingParams(decoder={"name": "canvas", "steps": 3})
    with pytest.raises(ValueError, match="CanvasDecoding.entropy_bound"):
        remask.SamplingParams(decoder=remask.CanvasDecoding(entropy_bound=0))
    with pytest.raises(ValueError, match="decoder: CanvasDecoding"):
        remask.LLM("tiny-llada").generate([[1, 5]], remask.SamplingParams(decoder=remask.CanvasDecoding(t_min=0.3)),
                                          use_tqdm=False)
    with pytest.raises(ValueError, match="decoder must be remask.CanvasDecoding"):
        llm.generate([[2, 5]], remask.SamplingParams(decoder=remask.SDARDecoding()), use_tqdm=False)
    # issue 37: a stable canvas equals the last `stability_threshold` ones, kept as a history of that many;
    # past the checkpoint's max_denoising_steps no canvas could be stable, so it is refused, not allocated
    steps = model.generation_config.max_denoising_steps
    with pytest.raises(ValueError, match=rf"CanvasDecoding.stability_threshold must be <= {steps} "):
        llm.generate([[2, 5]], remask.SamplingParams(decoder=remask.CanvasDecoding(stability_threshold=steps + 1,
                                                                                 confidence_threshold=1.0)),
                     use_tqdm=False)
    llm.generate([[2, 5]], remask.SamplingParams(max_tokens=4, decoder=remask.CanvasDecoding(
        stability_threshold=steps, confidence_threshold=1.0)), use_tqdm=False)


def test_served_over_http_with_drafts(tmp_path):
    """`remask serve`'s app with a DiffusionGemma checkpoint (the zoo's character tokenizer beside
    it): completions equal the offline LLM, canvas settings over HTTP, drafts stream the canvas."""
    import httpx

    from test_serve import Server
    from remask.serve import AsyncEngine, build_app

    path = tmp_path / "dg"
    tiny.write_tiny_diffusion_gemma(str(path), seed=1, charset=charset, generation={"max_denoising_steps": 4})
    llm = remask.LLM(str(path))
    engine = AsyncEngine(remask.LLM(str(path)))
    server = Server(build_app({"dg": engine}))
    try:
        canvas = {"name": "canvas", "entropy_bound": 2.0, "sampler": {"rule": "top_k", "top_k": 3}}
        body = dict(model="dg", prompt="sort 52814", max_tokens=8, seed=5, decoder=canvas)
        got = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        want = llm.generate("sort 52814", remask.SamplingParams(max_tokens=8, seed=5, decoder=remask.CanvasDecoding(
            entropy_bound=2.0, sampler=remask.CanvasSampler(rule="top_k", top_k=3))), use_tqdm=False)[0]
        assert got["choices"][0]["text"] == want.outputs[0].text
        bad = httpx.post(f"{server.url}/v1/completions", json=dict(body, decoder=dict(canvas, sampler={"rule": "x"})),
                         timeout=60)
        assert bad.status_code == 400 and "rule" in bad.text and bad.json()["error"]["param"] == "decoder"
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                          json=dict(body, stream=True, stream_options={"include_drafts": True})) as response:
            lines = [line for line in response.iter_lines() if line.startswith("data: {")]
        assert sum('"draft"' in line for line in lines) >= 4   # one per denoising step of the canvas
    finally:
        server.stop()
        engine.shutdown()


def test_cli_generate_takes_canvas_settings(tmp_path, capsys):
    import json

    from remask.cli import main

    path = tmp_path / "dg"
    tiny.write_tiny_diffusion_gemma(str(path), seed=1, charset=charset, generation={"max_denoising_steps": 3})
    argv = ["generate", str(path), "--prompt", "sort 123", "--max-tokens", "8", "--seed", "1", "--quiet",
            "--decoder", '{"name": "canvas", "entropy_bound": 1.0, "sampler": {"rule": "top_k", "top_k": 2}}']
    assert main(argv) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["nfe"] == 3 and len(row["token_ids"]) <= 8
    assert main(argv[:-1] + ['{"name": "canvas", "sampler": {"rule": "nope"}}']) == 2
    assert "rule" in capsys.readouterr().err
    assert main(["models", str(path)]) == 0 and "diffusion_gemma" in capsys.readouterr().out


def test_requests_with_one_prompt_share_its_encoder_cache(model):
    """n samples and repeated prompts copy the prompt's encoder cache instead of encoding it again;
    the tokens are bitwise those of an engine that never shares (and of each request alone)."""
    prompts = [[2, 17, 42, 99, 5], [2, 9, 8], [2, 17, 42, 99, 5]]
    params = remask.SamplingParams(max_tokens=16, n=2, seed=6)
    sharing = remask.LLM(model)
    shared = sharing.generate(prompts, params, use_tqdm=False)
    stats = sharing.engine.kv_stats()
    assert stats["prefix_lookups"] == 6 and stats["prefix_hits"] == 4   # 2 distinct prompts, 6 samples
    alone = remask.LLM(model, enable_prefix_caching=False).generate(prompts, params, use_tqdm=False)
    for a, b in zip(shared, alone):
        assert [o.all_token_ids for o in a.outputs] == [o.all_token_ids for o in b.outputs]


@pytest.mark.portable
def test_engine_scores_its_requests_canvases_in_one_call_each_as_alone(model, monkeypatch):
    """On the fused kernels, a step's canvas requests are scored in one `canvas_score` call and renoised in one
    `canvas_update` call per setting (the entropy bound, or a rule that decides in torch), each request drawing
    from its own seeds: its tokens are `diffusion_generate`'s on it alone with its seed. `reference_rng` requests
    (transformers' draws) are scored alone."""
    rows_per_call: dict[str, list[list[int]]] = {"canvas_score": [], "canvas_update": []}
    for name, calls in rows_per_call.items():
        real = getattr(canvas, name)

        def counted(first, *args, _real=real, _calls=calls, **kwargs):
            _calls[-1].append(first.shape[0])
            return _real(first, *args, **kwargs)
        monkeypatch.setattr(canvas, name, counted)
    settings = [remask.CanvasDecoding(max_denoising_steps=5),
                remask.CanvasDecoding(max_denoising_steps=4, entropy_bound=1.5),
                remask.CanvasDecoding(max_denoising_steps=4, sampler=remask.CanvasSampler(rule="threshold",
                                                                                          threshold=0.3))]
    prompts = [[2, 17, 42, 99, 5], [2, 9, 8], [2, 5, 6, 7, 8, 9, 10], [2, 11, 12, 13], [2, 40, 41], [2, 3]]
    requests = [(f"r{i}", prompt, remask.SamplingParams(max_tokens=16, seed=10 + i, decoder=settings[i % 3]))
                for i, prompt in enumerate(prompts)]
    requests.append(("ref", prompts[0], remask.SamplingParams(max_tokens=16, seed=3, reference_rng=True)))
    engine = remask.LLM(model).engine
    for request in requests:
        engine.add_request(*request)
    done = {}
    while engine.has_unfinished_requests():
        for calls in rows_per_call.values():
            calls.append([])
        done.update({out.request_id: out.outputs[0].all_token_ids for out in engine.step() if out.finished})
    scores, updates = rows_per_call["canvas_score"], rows_per_call["canvas_update"]
    assert max(len(step) for step in scores) <= 3 and max(len(step) for step in updates) <= 2
    assert max(rows for step in scores for rows in step) == 2 * L     # the two requests of a setting: one call
    assert max(rows for step in updates for rows in step) == 2        # the two EB-sampler bounds: a call each
    for rid, prompt, params in requests:
        kw = dict(reference_rng=True) if params.reference_rng else params.decoder.generation_kwargs(
            canvas_sampler=params.decoder.sampler)
        if params.reference_rng:
            torch.manual_seed(params.seed)
        alone = remask.diffusion_generate(model, torch.tensor([prompt]), max_new_tokens=16,
                                          generator=torch.Generator().manual_seed(params.seed), **kw)
        assert done[rid] == alone.sequences[0, len(prompt):len(prompt) + 16].tolist(), rid
