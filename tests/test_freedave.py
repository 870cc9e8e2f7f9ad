"""FreeDave (`remask.diffusion.methods.freedave`): token equality with one-token-per-step decoding under
every cache mode and draft mode, fewer forwards, batches, FreeDave++, and its settings."""
from __future__ import annotations

import warnings

import pytest
import torch

import remask
from remask.diffusion.parts.cache import BlockForward
from remask.diffusion.methods.freedave import FreeDave, freedave_generate
from remask.diffusion.parts.scoring import score_rows
from remask.diffusion.parts.stepper import drive
from remask.kernels import unmask
from remask.models.spec import get_spec
from remask.zoo import charset
from helpers import left_pad, random_prompt

GEN, BLOCK = 32, 8
CACHES = [None, "prefix", "dual"]
PAD = {"llada_small": 297, "dream_small": 298}


@pytest.fixture(scope="module")
def tiny_llada():
    return remask.load("tiny-llada")[0]


@pytest.fixture
def model_of(load_model, tiny_llada):
    return lambda name: tiny_llada if name == "tiny-llada" else load_model(name)


def prompts_for(name: str, batch: int = 1, seed: int = 1) -> torch.Tensor:
    if name == "tiny-llada":
        texts = ["sort 52814", "rev abcdef", "sort 91735"]
        return torch.tensor([charset.encode_chat(t) for t in texts[seed - 1:seed - 1 + batch]])
    return random_prompt(batch, 7, seed, high=290)


def baseline(model, prompt, use_cache, attention_mask=None, threshold=None):
    """One-token-per-step decoding (or the threshold rule) with FreeDave's block / cache schedule:
    `remask.generate` for LLaDA; Fast-dLLM's Dream block decoder for Dream (first position of each
    block from the block-start forward; threshold 1.0 = the top-1 only). Returns (tokens, nfe)."""
    stats = remask.GenerationStats()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # tiny-llada was trained on shorter answers
        if get_spec(model).logit_shift:
            out = remask.diffusion_generate(model, prompt, attention_mask=attention_mask, max_new_tokens=GEN,
                                            steps=GEN, alg="confidence_threshold",
                                            threshold=1.0 if threshold is None else threshold, block_length=BLOCK,
                                            use_cache=use_cache, stats=stats)
        else:
            out = remask.generate(model, prompt, attention_mask, steps=GEN, gen_length=GEN, block_length=BLOCK,
                                  use_cache=use_cache, threshold=threshold, stats=stats)
    return out, stats.nfe


def freedave(model, prompt, use_cache, attention_mask=None, **config):
    stats = remask.GenerationStats()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = freedave_generate(model, prompt, attention_mask, config=FreeDave(**config), gen_length=GEN,
                                block_length=BLOCK, use_cache=use_cache, stats=stats)
    return out, stats.nfe


@pytest.mark.parametrize("use_cache", CACHES)
@pytest.mark.parametrize("name", ["tiny-llada", "llada_small", "dream_small"])
def test_equals_one_token_per_step_with_fewer_forwards(name, use_cache, model_of):
    model = model_of(name)
    prompt = prompts_for(name)
    expected, base_nfe = baseline(model, prompt, use_cache)
    assert base_nfe == GEN
    for draft_mode in ("tree_attention", "batch_expanding"):
        for draft_steps in (2, 4):
            out, nfe = freedave(model, prompt, use_cache, draft_steps=draft_steps, draft_mode=draft_mode)
            assert torch.equal(out, expected), (draft_mode, draft_steps)
            assert nfe < base_nfe, (draft_mode, draft_steps, nfe)


@pytest.mark.parametrize("name", ["llada_small", "dream_small"])
def test_one_draft_is_the_baseline_forward_for_forward(name, model_of):
    model = model_of(name)
    prompt = prompts_for(name)
    expected, base_nfe = baseline(model, prompt, "dual")
    out, nfe = freedave(model, prompt, "dual", draft_steps=1)
    assert torch.equal(out, expected) and nfe == base_nfe


@pytest.mark.parametrize("name", ["tiny-llada", "llada_small", "dream_small"])
def test_batch_rows_equal_each_row_alone(name, model_of):
    # Rows accept chains of different lengths; every row is decoded as it is alone.
    model = model_of(name)
    batch = prompts_for(name, batch=3)
    for use_cache in CACHES:
        for draft_mode in ("tree_attention", "batch_expanding"):
            out, _ = freedave(model, batch, use_cache, draft_steps=4, draft_mode=draft_mode)
            for i in range(3):
                alone, _ = freedave(model, batch[i:i + 1], use_cache, draft_steps=4, draft_mode=draft_mode)
                assert torch.equal(out[i:i + 1], alone), (use_cache, draft_mode, i)
                if draft_mode == "tree_attention":
                    assert torch.equal(alone, baseline(model, batch[i:i + 1], use_cache)[0]), (use_cache, i)


@pytest.mark.parametrize("name", ["llada_small", "dream_small"])
def test_left_padded_batch_equals_the_padded_baseline(name, model_of):
    model = model_of(name)
    rows = [random_prompt(1, n, seed, high=290)[0] for n, seed in ((5, 1), (9, 2), (7, 3))]
    ids, mask = left_pad(rows, PAD[name])
    for use_cache in ("prefix", "dual"):
        expected, _ = baseline(model, ids, use_cache, attention_mask=mask)
        for draft_mode in ("tree_attention", "batch_expanding"):
            out, _ = freedave(model, ids, use_cache, attention_mask=mask, draft_steps=3, draft_mode=draft_mode)
            assert torch.equal(out, expected), (use_cache, draft_mode)


# --- FreeDave++ ------------------------------------------------------------------------------------

def sequential_reference(model, prompt, use_cache, draft_steps, threshold):
    """Upstream's FreeDave / FreeDave++ loop written plainly for one row: drafts built one by one,
    each verified by its own forward through remask's block forwards (the baseline's), the looped
    subset verification, and upstream's last step (at most one mask left: commit draft 0)."""
    spec = get_spec(model)
    mask_id, shift = spec.mask_id, spec.logit_shift
    P = prompt.shape[1]
    x = torch.full((1, P + GEN), mask_id, dtype=torch.long)
    x[:, :P] = prompt
    forwards = BlockForward(spec, use_cache, {}, None)
    conf_dtype = torch.float64 if threshold is not None and not shift else None

    def score(logits, local):
        x0, conf = score_rows(logits[0], torch.arange(local, local + BLOCK), exclude_id=mask_id)
        return x0, conf.to(conf_dtype or logits.dtype)

    def rule(tokens, x0, conf, thr):
        out = tokens.clone()[None]
        if thr is None:
            unmask(out, out == mask_id, x0[None], conf[None], k=1)
        else:
            unmask(out, out == mask_id, x0[None], conf[None], threshold=thr)
        return out[0]

    def top(tokens, x0, conf, k):
        masked = tokens == mask_id
        order = torch.sort(torch.where(masked, conf.double(), -torch.inf), descending=True, stable=True).indices
        out = tokens.clone()
        chosen = order[:min(k, int(masked.sum()))]
        out[chosen] = x0[chosen]
        return out

    for block in range(GEN // BLOCK):
        start, end = P + block * BLOCK, P + (block + 1) * BLOCK
        x0, conf = score(drive(forwards.refresh(x, start, end), model), start)
        stale = shift
        if shift:
            x[0, start] = x0[0]
        while bool((x[0, start:end] == mask_id).any()):
            cur = x[0, start:end].clone()
            masks = int((cur == mask_id).sum())
            K = min(draft_steps, masks)
            first = cur if stale else rule(cur, x0, conf, threshold)
            if not stale and masks <= 1:
                x[0, start:end] = first
                break
            drafts = [first] + [top(first, x0, conf, k) for k in range(1, K)]
            targets, preds = [], []
            for d in drafts:
                xd = x.clone()
                xd[0, start:end] = d
                logits, fed = drive(forwards.step(xd, start, end), model)
                p = score(logits, start - fed)
                preds.append(p)
                targets.append(rule(d, *p, threshold))
            best = 0
            while best < K - 1:
                ref = best
                for j in range(best + 1, K):
                    decoded = drafts[j] != mask_id
                    if bool((drafts[j][decoded] == targets[ref][decoded]).all()):
                        best = j
                if best == ref:
                    break
            x[0, start:end] = drafts[best]
            x0, conf = preds[best]
            stale = False
    return x


@pytest.mark.parametrize("name", ["llada_small", "dream_small"])
def test_freedave_plus_plus_is_upstreams_loop(name, model_of):
    model = model_of(name)
    prompt = prompts_for(name)
    for use_cache in ("prefix", "dual"):
        for threshold in (0.3, None):
            expected = sequential_reference(model, prompt, use_cache, 4, threshold)
            for draft_mode in ("tree_attention", "batch_expanding"):
                out, _ = freedave(model, prompt, use_cache, draft_steps=4, draft_mode=draft_mode,
                                  confidence_threshold=threshold)
                assert torch.equal(out, expected), (use_cache, threshold, draft_mode)


@pytest.mark.parametrize("name", ["llada_small", "dream_small"])
def test_freedave_plus_plus_with_exact_matching_is_threshold_decoding(name, model_of):
    model = model_of(name)
    prompt = prompts_for(name)
    saved = False
    for use_cache in CACHES:
        for threshold in (0.3, 0.9):
            expected, base_nfe = baseline(model, prompt, use_cache, threshold=threshold)
            # one draft: threshold decoding itself, forward for forward, under either rule
            for rule in ("subset", "exact"):
                out, nfe = freedave(model, prompt, use_cache, draft_steps=1, confidence_threshold=threshold,
                                    match_rule=rule)
                assert torch.equal(out, expected) and nfe == base_nfe, (use_cache, threshold, rule)
            out, nfe = freedave(model, prompt, use_cache, draft_steps=4, confidence_threshold=threshold,
                                match_rule="exact")
            assert torch.equal(out, expected) and nfe <= base_nfe, (use_cache, threshold, nfe, base_nfe)
            saved |= nfe < base_nfe
    assert saved


def test_subset_matching_is_not_threshold_decoding(model_of):
    # Upstream's subset rule accepts a draft that commits fewer tokens than the threshold step:
    # FreeDave++ then leaves threshold decoding's trajectory (measured on this checkpoint).
    model = model_of("dream_small")
    prompt = prompts_for("dream_small")
    expected, _ = baseline(model, prompt, None, threshold=0.3)
    out, _ = freedave(model, prompt, None, draft_steps=4, confidence_threshold=0.3)
    assert not torch.equal(out, expected)


# --- settings -------------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("draft_steps", 0), ("draft_steps", 2.0), ("draft_steps", True), ("draft_mode", "tree"),
    ("draft_mode", "debug"), ("confidence_threshold", 0), ("confidence_threshold", 1.5),
    ("confidence_threshold", "0.9"), ("match_rule", "prefix"),
])
def test_bad_config_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        FreeDave(**{field: value})


@pytest.mark.parametrize("kwargs, match", [
    (dict(steps=16), "steps"), (dict(use_cache="paged"), "use_cache"), (dict(use_cache="full"), "use_cache"),
    (dict(config="fast"), "config"), (dict(block_length=12), "block_length"), (dict(gen_length=0), "gen_length"),
])
def test_bad_call_arguments(kwargs, match, tiny_llada):
    kw = dict(gen_length=32, block_length=8) | kwargs
    with pytest.raises(ValueError, match=match):
        freedave_generate(tiny_llada, prompts_for("tiny-llada"), **kw)


def test_refuses_a_uniform_noise_model(tmp_path):
    """A uniform-noise model (DiffusionGemma) has no mask to draft over, even with a `mask_id` given."""
    from transformers import AutoModelForImageTextToText

    from remask.models import tiny

    tiny.write_tiny_diffusion_gemma(str(tmp_path), seed=0)
    model = AutoModelForImageTextToText.from_pretrained(str(tmp_path)).eval()
    with pytest.raises(ValueError, match="mask-diffusion models"):
        freedave_generate(model, torch.tensor([[2, 17, 42]]), mask_id=300, gen_length=8, block_length=8)


@pytest.mark.parametrize("name", ["llada", "dream"])
def test_official_vocabulary_checkpoints(name, model_of):
    # The random checkpoints with the released vocabularies and special ids.
    model = model_of(name)
    prompt = prompts_for(name)
    expected, base_nfe = baseline(model, prompt, "dual")
    for draft_mode in ("tree_attention", "batch_expanding"):
        out, nfe = freedave(model, prompt, "dual", draft_steps=4, draft_mode=draft_mode)
        assert torch.equal(out, expected) and nfe < base_nfe, draft_mode


@pytest.mark.parametrize("name", ["tiny-llada", "dream_small"])
def test_one_interface_generate_diffusion_generate_and_the_engine(name, model_of):
    """`decoder=remask.FreeDave(...)` in `remask.generate` (LLaDA), `remask.diffusion_generate`
    (Dream) and `remask.SamplingParams` (the engine): each equals `freedave_generate`, which equals
    the one-token-per-step baseline; settings FreeDave does not read are refused by name."""
    model = model_of(name)
    prompt = prompts_for(name, batch=2)
    expected, base_nfe = baseline(model, prompt, "dual")
    config = remask.FreeDave(draft_steps=3)
    stats = remask.GenerationStats()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if get_spec(model).logit_shift:
            out = remask.diffusion_generate(model, prompt, max_new_tokens=GEN, steps=GEN, block_length=BLOCK,
                                            use_cache="dual", decoder=config, stats=stats)
            with pytest.raises(ValueError, match="temperature"):
                remask.diffusion_generate(model, prompt, max_new_tokens=GEN, steps=GEN, temperature=0.5,
                                          decoder=config)
        else:
            out = remask.generate(model, prompt, steps=GEN, gen_length=GEN, block_length=BLOCK, use_cache="dual",
                                  decoder=config, stats=stats)
            with pytest.raises(ValueError, match="threshold"):
                remask.generate(model, prompt, steps=GEN, gen_length=GEN, block_length=BLOCK, threshold=0.9,
                                decoder=config)
        assert out.tolist() == expected.tolist() and stats.nfe < base_nfe
        params = remask.SamplingParams(max_tokens=GEN, block_length=BLOCK, use_cache="dual", temperature=0.0,
                                       decoder=config)
        served = remask.LLM(model).generate([row.tolist() for row in prompt], params, use_tqdm=False)
    for row, result in zip(expected, served):
        assert result.outputs[0].all_token_ids == row[prompt.shape[1]:].tolist()
        assert 0 < result.outputs[0].nfe < base_nfe
    with pytest.raises(ValueError, match="decoder"):
        remask.SamplingParams(decoder="freedave")
    with pytest.raises(ValueError, match="threshold"):
        remask.SamplingParams(decoder=config, threshold=0.9)


def test_json_forms_over_http_and_the_command_line():
    """Decoder and cache configs in JSON form — `{"name": ..., fields...}` — are built by
    `SamplingParams` (the one validation layer), so HTTP bodies and `remask generate` flags take them;
    an unknown name or field is refused naming the field."""
    import argparse

    from remask.cli import _sampling_flags
    from remask.serve.protocol import CompletionRequest

    def build_parser():   # `remask generate`'s SamplingParams flags
        parser = argparse.ArgumentParser()
        _sampling_flags(parser)
        return parser

    params = remask.SamplingParams(decoder={"name": "freedave", "draft_steps": 2}, use_cache="dual")
    assert params.decoder == remask.FreeDave(draft_steps=2)
    params = remask.SamplingParams(use_cache={"name": "dkv", "cache_reloading_step": 4}, steps=8, max_tokens=8)
    assert params.use_cache == remask.DKVCache(cache_reloading_step=4)
    request = CompletionRequest(model="m", prompt=[1, 2], max_tokens=16, temperature=0.0,
                                decoder={"name": "credit", "threshold": 0.8},
                                use_cache={"name": "vicinity", "prefix_look": 4})
    sampled = request.sampling_params()
    assert sampled.decoder == remask.CreditDecoding(threshold=0.8)
    assert sampled.use_cache == remask.VicinityCache(prefix_look=4)
    with pytest.raises(ValueError, match="decoder.name"):
        remask.SamplingParams(decoder={"name": "freedav"})
    with pytest.raises(ValueError, match="decoder"):
        CompletionRequest(model="m", prompt=[1], decoder={"name": "wino", "treshold": 0.5}).sampling_params()
    with pytest.raises(ValueError, match="use_cache.name"):
        remask.SamplingParams(use_cache={"name": "lru"})
    args = build_parser().parse_args(["--decoder", '{"name": "freedave", "draft_steps": 3}', "--use-cache",
                                      '{"name": "d2cache", "current_k": 8}'])
    assert args.decoder == {"name": "freedave", "draft_steps": 3}
    assert args.use_cache == {"name": "d2cache", "current_k": 8}
    assert build_parser().parse_args(["--use-cache", "dual"]).use_cache == "dual"
    assert remask.SamplingParams(**{k: v for k, v in vars(args).items() if v is not None}).decoder == \
        remask.FreeDave(draft_steps=3)
