"""Filtering (temperature, top-k, top-p) and tempered categorical sampling exist once, in
`remask.diffusion.parts.scoring`: every flag combination equals a direct torch formulation of the
reference it stands for (SDAR's and LLaDA2's `generate.py`, Dream's `sample_tokens`, Fast-dLLM v2's
`sample_with_top_p`, APD's draft), and the families' modules no longer carry their own copy."""
from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

from remask.diffusion.families import apd, fast_dllm_v2, llada2, sdar
from remask.diffusion.parts import blocks, scoring
from remask.diffusion.parts.scoring import draw_categorical, filter_logits, sample_categorical, score_tokens

V = 50
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _logits(seed: int, shape=(6, V), dtype=torch.float32, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(shape, generator=g) * 3
    logits[..., 7] = logits[..., 3]          # a tie, for top-k's "keep every token tied with the k-th"
    return logits.to(dtype).to(device)


# --- the references, written out as each upstream does it ---------------------------------------

def ref_sdar_filter(logits, temperature, top_k, top_p):
    """SDAR / LLaDA2 generate.py: logits / T (T ≠ 1), top-k (k > 0), top-p (p < 1), removed → −inf."""
    if temperature != 1.0 and temperature > 0:
        logits = logits / temperature
    if top_k is not None and top_k > 0:
        kth = torch.topk(logits, top_k).values[..., -1, None]
        logits = torch.where(logits < kth, torch.full_like(logits, float("-inf")), logits)
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        remove = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1) > top_p
        remove[..., 1:] = remove[..., :-1].clone()
        remove[..., 0] = False
        logits = logits.masked_fill(torch.zeros_like(remove).scatter(-1, order, remove), float("-inf"))
    return logits


def ref_dream_filter(logits, temperature, top_p, top_k):
    """Dream's `sample_tokens` (and APD's copy): logits / T, top-p, then top-k, removed → dtype min."""
    if temperature > 0:
        logits = logits / temperature
    if top_p is not None and top_p < 1:
        sorted_logits, sorted_indices = torch.sort(logits, descending=True)
        cumulative_probs = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1)
        sorted_indices_to_remove = cumulative_probs > top_p
        sorted_indices_to_remove[..., 1:] = sorted_indices_to_remove[..., :-1].clone()
        sorted_indices_to_remove[..., 0] = 0
        mask = torch.zeros_like(logits, dtype=torch.bool)
        mask = mask.scatter_(-1, sorted_indices, sorted_indices_to_remove)
        logits = logits.masked_fill(mask, torch.finfo(logits.dtype).min)
    if top_k is not None:
        top_k = min(top_k, logits.size(-1))
        indices_to_remove = logits < torch.topk(logits, top_k)[0][..., -1, None]
        logits = logits.masked_fill(indices_to_remove, torch.finfo(logits.dtype).min)
    return logits


def ref_sdar_sample(logits, temperature, top_k, top_p, generator, mask_id):
    """SDAR's sampling (T = 0: the argmax), with remask's mask-token fix."""
    probs = F.softmax(ref_sdar_filter(logits, temperature, top_k, top_p), dim=-1)
    token = (torch.multinomial(probs, num_samples=1, generator=generator) if temperature > 0
             else probs.argmax(dim=-1, keepdim=True))
    if mask_id is not None and bool((token == mask_id).any()):
        other = probs.index_fill(-1, torch.tensor([mask_id], device=probs.device), -1.0).argmax(-1, keepdim=True)
        token = torch.where(token == mask_id, other, token)
    return token.squeeze(-1), torch.gather(probs, -1, token).squeeze(-1), probs


def ref_fast_sample(logits, top_p, temperature, generator):
    """Fast-dLLM v2's `sample_with_top_p` (each batch row drawing in turn)."""
    if temperature <= 0:
        probs = torch.softmax(logits, dim=-1)
        return probs.argmax(dim=-1), probs
    probs = F.softmax(logits / temperature, dim=-1)
    sorted_probs, sorted_indices = torch.sort(probs, descending=True)
    remove_sorted = torch.cumsum(sorted_probs, dim=-1) > top_p
    remove_sorted[..., 1:] = remove_sorted[..., :-1].clone()
    remove_sorted[..., 0] = 0
    remove = torch.zeros_like(probs, dtype=torch.bool).scatter_(dim=-1, index=sorted_indices, src=remove_sorted)
    probs[remove] = 0
    probs = probs / torch.sum(probs, dim=-1, keepdim=True)
    tokens = torch.stack([torch.multinomial(probs[row], num_samples=1, generator=generator).squeeze(-1)
                          for row in range(probs.shape[0])])
    return tokens, probs


def _gen(seed, device):
    return torch.Generator(device=device).manual_seed(seed)


# --- filtering ------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
@pytest.mark.parametrize("top_k", [None, 0, 1, 5, 3])
@pytest.mark.parametrize("top_p", [None, 0.3, 0.9, 1.0])
def test_filter_flags_equal_each_reference(device, dtype, temperature, top_k, top_p):
    logits = _logits(11, dtype=dtype, device=device)
    # SDAR / LLaDA2: top_k then top_p, −inf (top_k 0 and None off)
    got = filter_logits(logits, temperature, top_k, top_p)
    assert torch.equal(got, ref_sdar_filter(logits, temperature, top_k, top_p))
    assert torch.equal(got, filter_logits(logits, temperature, top_k, top_p, order="top_k_first", removed="-inf"))
    # Dream / APD: top_p then top_k, dtype min (their validation refuses top_k 0)
    if top_k != 0:
        got = filter_logits(logits, temperature, top_k, top_p, order="top_p_first", removed="dtype_min")
        assert torch.equal(got, ref_dream_filter(logits, temperature, top_p, top_k))


def test_filter_flags_differ_where_the_references_do():
    """The flags are not cosmetic: with both filters set the orders give other distributions, and
    the removed value is visible in the logits (not in the probabilities)."""
    logits = _logits(3)
    k_first = filter_logits(logits, 1.0, 5, 0.5)
    p_first = filter_logits(logits, 1.0, 5, 0.5, order="top_p_first")
    assert not torch.equal(k_first.isinf(), p_first.isinf())
    inf = filter_logits(logits, 0.0, 2, None)
    low = filter_logits(logits, 0.0, 2, None, removed="dtype_min")
    assert bool(inf.isinf().any()) and not bool(low.isinf().any())
    assert torch.equal(F.softmax(inf, -1), F.softmax(low, -1))
    # a top_k above the vocabulary keeps everything (SDAR's topk raised there)
    assert torch.equal(filter_logits(logits, 0.0, V + 3, None), logits)
    with pytest.raises(ValueError, match="order"):
        filter_logits(logits, order="sideways")
    with pytest.raises(ValueError, match="removed"):
        filter_logits(logits, removed="nan")
    with pytest.raises(ValueError, match="top_p_on"):
        sample_categorical(logits, 1.0, top_p_on="tokens")


# --- sampling -------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature", [0.0, 0.5, 1.0, 1.7])
@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (None, None), (5, 1.0), (0, 0.8), (8, 0.6)])
@pytest.mark.parametrize("mask_id", [None, 7])
def test_sdar_llada2_flags_equal_their_sampler(device, temperature, top_k, top_p, mask_id):
    logits = _logits(5, device=device)
    if mask_id is not None:
        logits[:3, mask_id] = 50.0     # the mask token is the argmax there: the fix picks another
    for seed in range(4):
        tokens, token_probs, probs = sample_categorical(logits, temperature, top_k, top_p,
                                                        generator=_gen(seed, device), exclude_id=mask_id)
        ref = ref_sdar_sample(logits, temperature, top_k, top_p, _gen(seed, device), mask_id)
        assert torch.equal(tokens, ref[0]) and torch.equal(token_probs, ref[1]) and torch.equal(probs, ref[2])
        if mask_id is not None:
            assert not bool((tokens == mask_id).any())
    # the families' adapters are the same function
    shaped = logits[None]
    t, p, d = blocks.sample_block(shaped, temperature, top_k or 0, 1.0 if top_p is None else top_p,
                                  _gen(0, device), mask_id)
    ref = ref_sdar_sample(logits, temperature, top_k, top_p, _gen(0, device), mask_id)
    assert torch.equal(t[0], ref[0]) and torch.equal(p[0], ref[1]) and torch.equal(d[0], ref[2])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature", [0.0, 0.6, 1.0])
@pytest.mark.parametrize("top_p", [0.3, 0.95, 1.0])
@pytest.mark.parametrize("batch", [1, 2])
def test_fast_dllm_v2_flags_equal_sample_with_top_p(device, temperature, top_p, batch):
    logits = _logits(9, shape=(batch, 5, V), device=device)
    for seed in range(3):
        tokens, token_probs, probs = sample_categorical(logits, temperature, None, top_p, generator=_gen(seed, device),
                                                        top_p_on="probs", filter_greedy=False, per_row=True)
        ref_tokens, ref_probs = ref_fast_sample(logits.clone(), top_p, temperature, _gen(seed, device))
        assert torch.equal(tokens, ref_tokens) and torch.equal(probs, ref_probs)
        assert torch.equal(token_probs, torch.gather(ref_probs, -1, ref_tokens[..., None])[..., 0])
        got = fast_dllm_v2.choose_tokens(logits, top_p, temperature, None, _gen(seed, device))
        assert torch.equal(got[0], ref_tokens) and torch.equal(got[2], ref_probs)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("top_k,top_p", [(None, None), (4, None), (None, 0.7), (6, 0.5)])
def test_dream_categorical_equals_its_sampler(temperature, top_k, top_p):
    """`score_tokens(sampler="categorical")`: Dream's `Categorical(probs).sample()` over its filter."""
    logits = _logits(13)
    for seed in range(3):
        torch.manual_seed(seed)
        x0, conf = score_tokens(logits, temperature=temperature, sampler="categorical", top_p=top_p, top_k=top_k)
        probs = torch.softmax(ref_dream_filter(logits, temperature, top_p, top_k), dim=-1)
        torch.manual_seed(seed)
        if temperature > 0:
            ref = torch.distributions.Categorical(probs=probs).sample()
            ref_conf = torch.gather(probs, -1, ref[:, None])[:, 0]
        else:
            ref_conf, ref = probs.max(dim=-1)
        assert torch.equal(x0, ref) and torch.equal(conf, ref_conf)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_apd_draft_is_dreams_filter_then_gumbel(temperature):
    logits = _logits(17, dtype=torch.float32)
    got = apd.shared_argmax(apd.draft_scores(logits, temperature, 0.8, 6, _gen(2, "cpu")), None)
    scores = ref_dream_filter(logits, temperature, 0.8, 6)
    if temperature > 0:
        noise = torch.rand(scores.shape, dtype=torch.float64, generator=_gen(2, "cpu"))
        scores = scores.to(torch.float64).exp() / (-torch.log(noise)) ** temperature
    assert torch.equal(got, scores.argmax(dim=-1))


@pytest.mark.parametrize("device", DEVICES)
def test_draw_flags(device):
    probs = F.softmax(_logits(21, shape=(2, 4, V), device=device), dim=-1)
    flat = draw_categorical(probs, _gen(1, device))
    assert torch.equal(flat, torch.multinomial(probs.reshape(-1, V), 1, generator=_gen(1, device)).view(2, 4))
    g = _gen(1, device)
    rows = draw_categorical(probs, _gen(1, device), per_row=True)
    assert torch.equal(rows, torch.stack([torch.multinomial(probs[r], 1, generator=g)[:, 0] for r in range(2)]))
    scaled = probs * 3.0
    g = _gen(4, device)
    assert torch.equal(draw_categorical(scaled, _gen(4, device), renormalize=True),
                       torch.multinomial((scaled / scaled.sum(-1, keepdim=True)).reshape(-1, V), 1,
                                         generator=g).view(2, 4))


# --- one home ---------------------------------------------------------------------------------------

def test_the_families_carry_no_copy():
    for module, names in ((sdar, ("filter_logits",)), (llada2, ("filter_logits", "sample_tokens")),
                          (fast_dllm_v2, ("sample_with_top_p",)), (apd, ("tempered_filtered",)),
                          (scoring, ("tempered_filtered",))):
        for name in names:
            assert not hasattr(module, name), f"{module.__name__}.{name}"
    assert blocks.sample_categorical is scoring.sample_categorical
    assert fast_dllm_v2.sample_categorical is scoring.sample_categorical
    assert llada2.sample_block is blocks.sample_block
    assert apd.filter_logits is scoring.filter_logits
    for module in (blocks, sdar, llada2, fast_dllm_v2, apd):
        source = inspect.getsource(module)
        for call in ("multinomial(", 'float("-inf")', "descending=True"):
            assert call not in source, f"{module.__name__} spells out {call}"
