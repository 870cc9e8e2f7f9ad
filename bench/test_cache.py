"""KV caching end to end: no cache vs Fast-dLLM's prefix and dual cache vs the paged dual cache.

One `remask.generate` per round at LLaDA's one-token-per-step schedule (Fast-dLLM's "+Cache"
column: block 32, no parallel decoding), on random LLaDA-format models built in memory: the
shipped tiny shape and a ~100M-parameter shape (12 layers, d=768, 12 heads, SwiGLU 2304, tied
32k vocabulary). Per-step time = median / NFE; the ratio is the no-cache median over this one's,
measured in the same run. Memory: a batch of 8 copies of one 1024-token prompt under the dual
cache (8 contiguous copies) and the paged cache (its pages stored once).

    make bench            # or: python -m pytest bench/test_cache.py --benchmark-json=...
"""
from __future__ import annotations

import pytest
import torch

import remask
from conftest import DEVICE, ON_GPU, forward_cost, record_cost, run
from remask.models import LLaDAConfig, LLaDAModelLM
from remask.caches import PagedKVCache
from remask.models.tiny import LLADA_DEFAULTS

SHAPES = {
    # name: (config overrides, prompt length, gen length)
    "tiny": (dict(d_model=128, n_heads=4, n_kv_heads=4, n_layers=4, mlp_hidden_size=384, vocab_size=128,
                  embedding_size=128, mask_token_id=4), 448, 64),
    "100M": (dict(d_model=768, n_heads=12, n_kv_heads=12, n_layers=12, mlp_hidden_size=2304, vocab_size=32768,
                  embedding_size=32768, mask_token_id=32767, weight_tying=True), 448, 64),
}
MODES = {"none": None, "prefix": "prefix", "dual": "dual", "paged": "paged"}
_models: dict[str, torch.nn.Module] = {}


def model_for(shape: str) -> torch.nn.Module:
    if shape not in _models:
        overrides = SHAPES[shape][0]
        config = LLaDAConfig(**{**LLADA_DEFAULTS, "max_sequence_length": 4096, "eos_token_id": 1,
                                "pad_token_id": 1, **overrides})
        torch.manual_seed(0)
        dtype = torch.bfloat16 if ON_GPU else torch.float32
        _models[shape] = LLaDAModelLM(config).to(DEVICE, dtype).eval()
    return _models[shape]


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_generate_with_cache(benchmark, shape, mode):
    model = model_for(shape)
    _, prompt_len, gen_length = SHAPES[shape]
    vocab = model.config.vocab_size
    prompt = torch.randint(5, vocab - 2, (1, prompt_len), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    stats = remask.GenerationStats()
    kw = dict(steps=gen_length, gen_length=gen_length, block_length=32, use_cache=MODES[mode])

    def call():
        stats.__init__()
        return remask.generate(model, prompt, stats=stats, **kw)

    run(benchmark, call, rounds=3 if shape == "tiny" or ON_GPU else 1,
        group=f"generate {shape} ({n_params(model) / 1e6:.0f}M) prompt {prompt_len} gen {gen_length} block 32",
        kernel="cache", impl=mode, baseline="none", shape=shape, generated=gen_length)
    benchmark.extra_info.update(nfe=stats.nfe, forward_positions=stats.forward_positions,
                                kv_cache_bytes=stats.kv_cache_bytes)   # filled by the timed calls
    record_cost(benchmark, forward_cost(model, stats))


@pytest.mark.parametrize("mode", ["dual", "paged"])
def test_batch_of_one_shared_prompt_memory(benchmark, mode):
    # Batch 8 of one 1024-token prompt: the dual cache holds 8 contiguous copies; the paged cache
    # shares every page (identical rows have identical K/V in a bidirectional model).
    model = model_for("tiny")
    prompt = torch.randint(5, 120, (1, 1024), generator=torch.Generator().manual_seed(2)).to(DEVICE).repeat(8, 1)
    stats = remask.GenerationStats()
    cache = PagedKVCache(page_size=16) if mode == "paged" else "dual"

    def call():
        stats.__init__()
        return remask.generate(model, prompt, steps=4, gen_length=32, block_length=32, use_cache=cache, stats=stats)

    run(benchmark, call, rounds=1, group="batch 8 × one 1024-token prompt, gen 32 (tiny shape)",
        kernel="cache_memory", impl=mode, baseline="dual", prompt_bytes_one_copy=_prompt_bytes(model, 1024))
    benchmark.extra_info.update(kv_cache_bytes=stats.kv_cache_bytes)
    record_cost(benchmark, forward_cost(model, stats))


def _prompt_bytes(model, length: int) -> int:
    cfg = model.config
    head_dim = cfg.d_model // cfg.n_heads
    itemsize = next(model.parameters()).element_size()
    return 2 * cfg.n_layers * length * cfg.n_kv_heads * head_dim * itemsize
