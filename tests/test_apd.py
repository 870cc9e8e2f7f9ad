"""APD (adaptive parallel decoding with an AR verifier) on the shipped tiny pair and random models."""
from __future__ import annotations

import pytest
import torch

import remask
from remask.diffusion.families.apd import APDConfig, apd_generate
from remask.kernels import apd_accept
from remask.models.spec import get_spec
from remask.zoo import charset, tasks


@pytest.fixture(scope="module")
def pair():
    return remask.load("tiny-llada")[0], remask.load("tiny-ar")[0]


def _prompts(n):
    return [torch.tensor([charset.encode_chat(p.prompt)]) for p in tasks.problems(n, tasks.EVAL_SEED)]


def accept_length(draft, dllm_logits, verifier_logits, mixture_weight):
    """Longest accepted prefix: token j is accepted iff it is the argmax of R·dllm + (1 − R)·verifier
    (j = 0 always is)."""
    return int(apd_accept(draft, dllm_logits, verifier_logits, mixture_weight)[1])


def test_accept_length_rule():
    V = 5
    dllm = torch.full((4, V), -5.0)
    ar = torch.full((4, V), -5.0)
    dllm[:, 1] = 0.0          # the dLLM prefers token 1 everywhere
    ar[:, 2] = 0.0            # the verifier prefers token 2
    ar[1, 1] = 0.0            # ... except at position 1, where both like 1
    draft = torch.tensor([3, 1, 1, 1])
    assert accept_length(draft, dllm, ar, 1.0) == 4        # R = 1: the dLLM's argmax is the target
    assert accept_length(draft, dllm, ar, 0.0) == 2        # R = 0: the verifier's (j = 0 is always accepted)
    assert accept_length(torch.tensor([2, 2, 2, 2]), dllm, ar, 0.0) == 1


def test_r1_accepts_the_whole_greedy_window(pair):
    # R = 1 at T = 0: every draft is the dLLM's argmax, so each round commits its whole window.
    model, verifier = pair
    for prompt in _prompts(5):
        stats = remask.GenerationStats()
        out = remask.generate(model, prompt, gen_length=16, apd=APDConfig(verifier, 1.0, kv_window=4, max_lookahead=8),
                              stats=stats)
        assert stats.tokens_per_step[0] == 8 and not (out == charset.MASK_ID).any()


def test_r0_commits_the_verifiers_greedy_continuation(pair):
    # R = 0: apart from each round's first token (always accepted: the dLLM's draft), every
    # committed token is the verifier's greedy choice given the committed prefix.
    model, verifier = pair
    rounds_with_several = 0
    for prompt in _prompts(14):
        stats = remask.GenerationStats()
        out = remask.generate(model, prompt, gen_length=16, apd=APDConfig(verifier, 0.0, kv_window=4, max_lookahead=16),
                              stats=stats)
        greedy = verifier(out).logits[0].argmax(-1)   # greedy[i] predicts position i + 1
        pos = prompt.shape[1]
        for n in stats.tokens_per_step:
            for j in range(pos + 1, pos + n):
                assert out[0, j] == greedy[j - 1]
            rounds_with_several += n > 1
            pos += n
    assert rounds_with_several > 0


class CheckedVerifier(torch.nn.Module):
    """Wraps a causal LM; every cached call is checked against a forward from scratch over the
    committed prefix plus the draft (the cache must survive APD's crops intact)."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.config, self.prefix, self.checked = inner, inner.config, None, 0

    def forward(self, ids, past_key_values=None, cache_position=None, **kw):
        out = self.inner(ids, past_key_values=past_key_values, cache_position=cache_position, **kw)
        if past_key_values is not None:
            start = int(cache_position[0])
            full = self.inner(torch.cat([self.prefix[:, :start], ids], dim=1)).logits[:, start:]
            torch.testing.assert_close(out.logits, full, rtol=1e-4, atol=1e-4)
            self.checked += 1
        return out


def test_verifier_cache_stays_consistent_after_crops(pair):
    model, verifier = pair
    checked = CheckedVerifier(verifier)
    for prompt in _prompts(6):
        # Committed tokens never change, so the final sequence is the prefix every cached call extends.
        apd = dict(mixture_weight=0.5, kv_window=2, max_lookahead=6, dllm_cache=True)
        final = remask.generate(model, prompt, gen_length=16, apd=APDConfig(verifier, **apd))
        checked.prefix = final
        again = remask.generate(model, prompt, gen_length=16, apd=APDConfig(checked, **apd))
        assert torch.equal(again, final)
    assert checked.checked > 0


def test_dllm_cache_follows_the_config_by_default(pair, monkeypatch):
    # As the reference: a dLLM whose config says use_cache=False recomputes from position 0 every
    # round (kv_window has no effect); dllm_cache=True keeps the window cache.
    model, verifier = pair
    assert model.config.use_cache is False
    prompt = _prompts(1)[0]
    seen = {}
    for dllm_cache in (None, True):
        stats = remask.GenerationStats()
        remask.generate(model, prompt, gen_length=16, stats=stats,
                        apd=APDConfig(verifier, 0.5, kv_window=2, max_lookahead=4, dllm_cache=dllm_cache))
        seen[dllm_cache] = stats
    P = prompt.shape[1]
    rounds = len(seen[None].tokens_per_step)
    assert rounds >= 2   # windows of 4 until an EOS: each round a forward over positions [0, curr + 4)
    assert seen[None].forward_positions == sum(min(P + sum(seen[None].tokens_per_step[:i]) + 4, P + 16)
                                              for i in range(rounds))
    assert seen[True].forward_positions < seen[None].forward_positions


def test_eos_stops_and_fills(pair):
    model, verifier = pair
    for prompt in _prompts(7):
        stats = remask.GenerationStats()
        out = remask.generate(model, prompt, gen_length=16, apd=APDConfig(verifier, 0.7, kv_window=4, max_lookahead=4),
                              stats=stats)
        gen = out[0, prompt.shape[1]:]
        first_eos = int((gen == charset.EOS_ID).nonzero()[0])
        assert (gen[first_eos:] == charset.EOS_ID).all() and not (gen == charset.MASK_ID).any()
        assert sum(stats.tokens_per_step) <= first_eos + 4   # stopped in the round that produced EOS


def test_dream_entry_point_and_shift(load_model):
    # A Dream-format dLLM (logit shift) through remask.diffusion_generate with an AR verifier that
    # shares its vocabulary size.
    from transformers import LlamaConfig, LlamaForCausalLM

    dream = load_model("dream_small")
    torch.manual_seed(0)
    verifier = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2)).eval()
    prompt = torch.randint(0, 290, (1, 5), generator=torch.Generator().manual_seed(3))
    out = remask.diffusion_generate(dream, prompt, max_new_tokens=12, apd=APDConfig(verifier, 0.7, 4, 6))
    assert out.shape == (1, 17) and not (out == 299).any()
    # `decoder=APDConfig(...)`: the registry's name for the same sampler
    assert torch.equal(remask.diffusion_generate(dream, prompt, max_new_tokens=12,
                                                 decoder=APDConfig(verifier, 0.7, 4, 6)), out)


def test_apd_is_a_registered_decoder(pair):
    """APD is the registry's `apd`: `decoder=APDConfig(...)` (and its JSON form, the verifier a model) decodes as the
    drop-in keyword `apd=` does, and the method's loop (`decoder_steps`) gives the same tokens; `apd=` with another
    `decoder=` is refused by name."""
    from remask.diffusion.methods import registry
    from remask.diffusion.methods.decoders import run_decoder

    model, verifier = pair
    prompt = _prompts(1)[0]
    config = APDConfig(verifier, 0.7, kv_window=4, max_lookahead=8)
    want = remask.generate(model, prompt, gen_length=16, apd=config)
    assert torch.equal(remask.generate(model, prompt, gen_length=16, decoder=config), want)
    assert torch.equal(run_decoder(model, prompt, None, config, gen_length=16, block_length=16, use_cache=None,
                                   mask_id=None, stats=None), want)
    assert registry.way_of(config) == "apd" and registry.way_of(remask.FreeDave()) == "method"
    params = remask.SamplingParams(max_tokens=16, decoder={"name": "apd", "verifier": verifier, "kv_window": 4,
                                                           "max_lookahead": 8})
    assert params.decoder == config and params.way == "apd"
    with pytest.raises(ValueError, match=r"does not combine with \['apd'\]"):
        remask.generate(model, prompt, gen_length=16, decoder=config, apd=config)
    with pytest.raises(ValueError, match="does not read.*apd"):
        remask.generate(model, prompt, gen_length=16, block_length=8, decoder=remask.FreeDave(), apd=config)


@pytest.mark.parametrize("kwargs,match", [
    (dict(mixture_weight=1.5), "mixture_weight"),
    (dict(kv_window=-1), "kv_window"),
    (dict(max_lookahead=0), "max_lookahead"),
])
def test_apd_config_errors(kwargs, match, pair):
    model, verifier = pair
    with pytest.raises(ValueError, match=match):
        remask.generate(model, _prompts(1)[0], gen_length=16, apd=APDConfig(verifier, **kwargs))


def test_apd_input_errors(pair, load_model):
    model, verifier = pair
    prompt = _prompts(1)[0]
    with pytest.raises(ValueError, match="one sequence at a time"):
        remask.generate(model, prompt.repeat(2, 1), gen_length=16, apd=APDConfig(verifier))
    with pytest.raises(ValueError, match="does not combine"):
        remask.generate(model, prompt, gen_length=16, threshold=0.9, apd=APDConfig(verifier))
    with pytest.raises(ValueError, match="verifier must be"):
        remask.generate(model, prompt, gen_length=16, apd=APDConfig(None))
    with pytest.raises(ValueError, match="vocabulary"):
        # The official-vocabulary LLaDA's prompt ids do not exist in the 128-token tiny-ar.
        remask.generate(load_model("llada"), torch.tensor([[5000, 6000]]), gen_length=8, apd=APDConfig(verifier))


@pytest.mark.parametrize("name,value", [("steps", 16), ("block_length", 16), ("remasking", "random"),
                                        ("logits_eos_inf", True), ("confidence_eos_eot_inf", True),
                                        ("early_stop", True), ("reference_rng", True), ("reference_ties", True),
                                        ("eos_id", 2), ("eot_id", 3)])
def test_apd_refuses_every_setting_it_does_not_read(name, value, pair):
    """APD decodes with its own loop and its verifier: a setting of LLaDA's block rule is refused by
    name, never silently ignored."""
    model, verifier = pair
    with pytest.raises(ValueError, match=f"does not combine with .*{name}"):
        remask.generate(model, _prompts(1)[0], gen_length=16, apd=APDConfig(verifier), **{name: value})


def test_coupled_gumbel_at_t0_is_the_reference_rule(pair):
    model, verifier = pair
    for prompt in _prompts(4):
        outs = [remask.generate(model, prompt, gen_length=16,
                                apd=APDConfig(verifier, 0.6, kv_window=4, max_lookahead=8, coupled_gumbel=c))
                for c in (False, True)]
        assert torch.equal(outs[0], outs[1])


def test_coupled_gumbel_r1_accepts_every_sampled_draft(pair):
    # R = 1: the target is the dLLM's own sample under the shared noise, i.e. the draft.
    model, verifier = pair
    for i, prompt in enumerate(_prompts(4)):
        stats = remask.GenerationStats()
        out = remask.generate(model, prompt, gen_length=16, temperature=0.8,
                              generator=torch.Generator().manual_seed(i),
                              apd=APDConfig(verifier, 1.0, kv_window=4, max_lookahead=8, coupled_gumbel=True),
                              stats=stats)
        assert stats.tokens_per_step[0] == 8 and not (out == charset.MASK_ID).any()


def test_coupled_gumbel_samples_reproducibly_and_keeps_fewer_at_low_r(pair):
    model, verifier = pair
    prompts = _prompts(6)

    def run(R, seed):
        outs, rounds = [], 0
        for prompt in prompts:
            stats = remask.GenerationStats()
            outs.append(remask.generate(model, prompt, gen_length=16, temperature=1.0,
                                        generator=torch.Generator().manual_seed(seed), stats=stats,
                                        apd=APDConfig(verifier, R, kv_window=4, max_lookahead=16, coupled_gumbel=True)))
            rounds += len(stats.tokens_per_step)
        return outs, rounds

    a, rounds_high = run(0.9, 1)
    b, _ = run(0.9, 1)
    c, _ = run(0.9, 2)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))      # it samples
    assert not any(bool((x == charset.MASK_ID).any()) for x in a)
    _, rounds_low = run(0.1, 1)
    assert rounds_low > rounds_high      # trusting the verifier more rejects more drafts


def test_triton_accept_kernel_gives_the_same_tokens(pair, monkeypatch):
    # The whole loop with the acceptance test in the Triton kernel (interpreted on CPU).
    model, verifier = pair
    prompt = _prompts(1)[0]
    config = APDConfig(verifier, 0.7, kv_window=4, max_lookahead=8)
    want = remask.generate(model, prompt, gen_length=16, apd=config)
    import remask.kernels.accept as accept_module
    calls = []
    real = accept_module.apd_accept_triton
    monkeypatch.setattr(accept_module, "apd_accept_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setenv("REMASK_TRITON", "1")
    assert torch.equal(remask.generate(model, prompt, gen_length=16, apd=config), want)
    assert calls   # the kernel did run
