"""remask on both ends of the tested transformers range (pyproject.toml: the lower end is what
`make test` installs, the newest allowed what `make test-latest` installs): the cache keyword is
bound by each callee's signature (models/hf_compat.py), and no remask call triggers transformers'
deprecation notices for it."""
from __future__ import annotations

import functools
import logging
import warnings

import pytest
import torch
import transformers

import remask
from remask.models import hf_compat, tiny
from remask.models.hf_compat import cache_arg, cache_parameter, output_cache, output_cache_field


def _deprecate(old: str, new: str):
    """transformers' `deprecate_kwarg` shape: a `functools.wraps` wrapper taking **kwargs."""
    def decorator(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if old in kwargs:
                kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)
        return wrapper
    return decorator


def test_binds_the_name_each_callee_declares():
    def current(x, cache=None):
        return cache

    def older(x, past_key_values=None):
        return past_key_values

    @_deprecate("past_key_values", "cache")
    def renamed(x, cache=None):
        return cache

    assert cache_parameter(current) == "cache"
    assert cache_parameter(older) == "past_key_values"
    assert cache_parameter(renamed) == "cache"   # the wrapped signature, not the deprecated alias
    for fn in (current, older, renamed):
        assert fn(1, **cache_arg(fn, "C")) == "C"

    class Model:
        def forward(self, x, past_key_values=None):
            return past_key_values

    assert cache_parameter(Model().forward) == "past_key_values"

    def no_cache(x):
        return x

    with pytest.raises(TypeError, match="no KV cache argument"):
        cache_parameter(no_cache)


def test_output_field_follows_the_installed_output_class():
    import dataclasses

    from transformers.modeling_outputs import CausalLMOutputWithPast

    names = {f.name for f in dataclasses.fields(CausalLMOutputWithPast)}
    assert output_cache_field() in names
    out = hf_compat.lm_output(logits=torch.zeros(1), cache="C")
    assert output_cache(out) == "C"


def test_diffusion_gemma_helpers_bind_on_the_installed_version():
    """The DiffusionGemma helpers remask calls (5.24 renamed their cache keyword) take a cache under
    a name remask finds; transformers' `generate` equality is tests/test_diffusion_gemma.py's."""
    modeling = pytest.importorskip("transformers.models.diffusion_gemma.modeling_diffusion_gemma")
    for fn in (modeling.DiffusionGemmaDecoderModel.create_diffusion_decoder_attention_mask,
               modeling.DiffusionGemmaEncoderModel.create_masks_for_generate,
               modeling.DiffusionGemmaEncoderModel.forward, modeling.DiffusionGemmaForBlockDiffusion.forward):
        assert cache_parameter(fn) in hf_compat.CACHE_NAMES


class _Notices(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def deprecation_notices(monkeypatch):
    """transformers' deprecation notices during the test: its logger's records and its
    FutureWarnings (the `warning_once` memo is reset, so a notice seen earlier counts again)."""
    from transformers.utils import logging as hf_logging

    handler = _Notices()
    logger = hf_logging.get_logger("transformers")
    logger.addHandler(handler)
    if hasattr(hf_logging.logging.Logger, "warning_once") and hasattr(
            hf_logging.logging.Logger.warning_once, "cache_clear"):
        hf_logging.logging.Logger.warning_once.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield lambda: [m for m in handler.messages + [str(w.message) for w in caught]
                       if "deprecated" in m and ("past_key_values" in m or "cache" in m)]
    logger.removeHandler(handler)


def test_no_deprecated_cache_keyword_on_any_family(tmp_path, deprecation_notices):
    from remask.compat import fast_dllm_v2, llada2
    from remask.compat.sdar import block_diffusion_generate

    def load(writer, name, auto=transformers.AutoModel, **kw):
        writer(str(tmp_path / name), **kw)
        return auto.from_pretrained(str(tmp_path / name)).eval()

    prompt = torch.randint(0, 290, (1, 6), generator=torch.Generator().manual_seed(0))
    llada = load(tiny.write_tiny_llada, "llada", vocab_size=300, embedding_size=300, mask_token_id=299,
                 eos_token_id=298, pad_token_id=297)
    remask.generate(llada, prompt, steps=8, gen_length=8, block_length=8)
    remask.generate(llada, prompt, steps=8, gen_length=8, block_length=4, threshold=0.9, use_cache="dual")
    dream = load(tiny.write_tiny_dream, "dream", vocab_size=300, mask_token_id=299, eos_token_id=298,
                 pad_token_id=298, bos_token_id=298)
    remask.diffusion_generate(dream, prompt, max_new_tokens=8, steps=8)
    remask.diffusion_generate(dream, prompt, max_new_tokens=8, steps=8, alg="confidence_threshold",
                              block_length=4, use_cache="dual")
    sdar = load(tiny.write_tiny_sdar, "sdar", auto=transformers.AutoModelForCausalLM)
    block_diffusion_generate(sdar, {"input_ids": prompt}, mask_id=299, gen_length=8, block_length=4,
                             denoising_steps=4, temperature=0.0)
    model = load(tiny.write_tiny_llada2, "llada2", auto=transformers.AutoModelForCausalLM)
    llada2.generate(model, prompt, gen_length=8, block_length=4, steps=4)
    model = load(tiny.write_tiny_fast_dllm_v2, "fd2", auto=transformers.AutoModelForCausalLM)

    class Tokenizer:
        pad_token_id, eos_token_id, mask_token_id = 298, 298, 299

    fast_dllm_v2.generate(model, prompt, max_new_tokens=16, tokenizer=Tokenizer())
    ar, _ = remask.load("tiny-ar")
    remask.ar_generate(ar, torch.randint(3, 60, (1, 6)), max_new_tokens=4)
    remask.diffusion_generate(dream, prompt, max_new_tokens=8, temperature=0.0,
                              apd=remask.APDConfig(_small_ar(tmp_path), mixture_weight=0.7, kv_window=4))
    if hasattr(transformers, "DiffusionGemmaForBlockDiffusion"):
        gemma = load(tiny.write_tiny_diffusion_gemma, "dg", auto=transformers.AutoModelForImageTextToText)
        remask.diffusion_generate(gemma, torch.randint(3, 290, (1, 6)), max_new_tokens=8)
    assert deprecation_notices() == []


def _small_ar(tmp_path):
    """A tiny Llama with the tiny Dream's 300-token vocabulary (APD's verifier shares the tokenizer)."""
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def test_the_notice_detector_sees_a_deprecated_call(deprecation_notices):
    """The detector above is live: on a transformers that renamed the keyword, the old name warns."""
    ar, _ = remask.load("tiny-ar")
    if cache_parameter(ar.forward) != "cache":
        pytest.skip("this transformers still takes past_key_values")
    ar(torch.randint(3, 60, (1, 4)), past_key_values=None, use_cache=True)
    assert deprecation_notices()
