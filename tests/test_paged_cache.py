"""`use_cache="paged"`: the dual-cache algorithm over pages gives the dual cache's tokens, left-padded
rows equal solo rows, identical rows store their K/V once, and the Triton kernels run it."""
from __future__ import annotations

import pytest
import torch

import remask
from helpers import left_pad, random_prompt
from remask.caches import PagedKVCache
from remask.models.paged import BlockManager
from remask.zoo import charset, tasks


@pytest.fixture(scope="module")
def tiny_llada():
    return remask.load("tiny-llada")[0]


RULES = [dict(steps=16, block_length=4), dict(steps=16, block_length=8, threshold=0.5),
         dict(steps=16, block_length=8, factor=1.0), dict(steps=4, block_length=16)]


@pytest.mark.parametrize("rule", RULES, ids=lambda r: "-".join(f"{k}{v}" for k, v in r.items()))
def test_paged_equals_dual_on_tiny_llada(rule, tiny_llada):
    for problem in tasks.problems(14, tasks.EVAL_SEED):
        prompt = torch.tensor([charset.encode_chat(problem.prompt)])
        dual = remask.generate(tiny_llada, prompt, gen_length=16, use_cache="dual", **rule)
        paged = remask.generate(tiny_llada, prompt, gen_length=16, use_cache=PagedKVCache(page_size=4), **rule)
        assert torch.equal(paged, dual), (problem.prompt, rule)


@pytest.mark.parametrize("name", ["llada_gqa_tied", "llada_small"])
@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_paged_equals_dual_on_random_checkpoints(name, page_size, load_model):
    model = load_model(name)
    high = 290 if name == "llada_small" else 990
    for seed in range(3):
        prompt = random_prompt(1, 5 + 2 * seed, seed, high=high)
        kw = dict(steps=12, gen_length=12, block_length=4)
        dual = remask.generate(model, prompt, use_cache="dual", **kw)
        paged = remask.generate(model, prompt, use_cache=PagedKVCache(page_size=page_size), **kw)
        assert torch.equal(paged, dual), (name, page_size, seed)


def test_paged_logits_match_dual_logits(load_model):
    # The block step's logits: pages + fresh block K/V through the paged-attention path vs the
    # contiguous dual cache (float tolerance: different summation order).
    from remask.caches import KVCache

    model = load_model("llada_gqa_tied")
    x = torch.cat([random_prompt(2, 7, 0, high=990), torch.full((2, 8), 999)], dim=1)
    start, end = 7, 11
    dual, paged = KVCache(), PagedKVCache(page_size=3)
    model(x, past_key_values=dual)
    paged.begin_block(x, None, start, end)
    model(x, past_key_values=paged, cache_position=torch.arange(x.shape[1]))
    step = dict(cache_position=torch.arange(start, end))
    a = model(x[:, start:end], past_key_values=dual, **step).logits
    b = model(x[:, start:end], past_key_values=paged, **step).logits
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rule", [dict(steps=16), dict(steps=16, threshold=0.5)])
def test_paged_left_padded_rows_equal_solo_rows(rule, load_model):
    model = load_model("llada_small")
    prompts = [random_prompt(1, n, seed, high=290)[0] for n, seed in ((5, 1), (9, 2), (7, 3))]
    ids, mask = left_pad(prompts, pad_id=297)
    kw = dict(gen_length=16, block_length=8, use_cache="paged", **rule)
    batch = remask.generate(model, ids, mask, **kw)
    for i, p in enumerate(prompts):
        solo = remask.generate(model, p[None], **kw)
        assert torch.equal(batch[i, ids.shape[1]:], solo[0, p.shape[0]:]), (i, rule)


def test_identical_rows_store_their_pages_once(tiny_llada):
    prompt = torch.tensor([charset.encode_chat("sort 52814")] * 8)
    kw = dict(steps=16, gen_length=16, block_length=4)
    dual_stats, paged_stats = remask.GenerationStats(), remask.GenerationStats()
    dual = remask.generate(tiny_llada, prompt, use_cache="dual", stats=dual_stats, **kw)
    cache = PagedKVCache(page_size=4)
    paged = remask.generate(tiny_llada, prompt, use_cache=cache, stats=paged_stats, **kw)
    assert torch.equal(paged, dual)
    T = prompt.shape[1] + 16
    pages_one_row = -(-(T - 4) // 4)   # everything but the block, in pages of 4
    assert cache.peak_pages == pages_one_row
    assert cache.peak_shared_hits == 7 * pages_one_row
    # 8 rows stored once: one row's context in pages, where the dual cache holds 8 × T positions.
    assert paged_stats.kv_cache_bytes * 8 * T == dual_stats.kv_cache_bytes * pages_one_row * 4
    # A different row gets its own pages (its K/V differ everywhere in a bidirectional model).
    mixed = torch.tensor([charset.encode_chat("sort 52814"), charset.encode_chat("sort 52841")])
    cache = PagedKVCache(page_size=4)
    remask.generate(tiny_llada, mixed, use_cache=cache, **kw)
    assert cache.peak_shared_hits == 0 and cache.peak_pages == 2 * pages_one_row


def test_paged_runs_the_triton_kernels(monkeypatch, tiny_llada):
    # Under the interpreter (CPU) or compiled (CUDA): store + paged attention kernels inside decoding.
    prompt = torch.tensor([charset.encode_chat("reverse abc")])
    kw = dict(steps=8, gen_length=8, block_length=4)   # two forwards per block: one over the pages
    dual = remask.generate(tiny_llada, prompt, use_cache="dual", **kw)
    import remask.kernels.paged as paged_kernels
    calls = []
    real = paged_kernels.paged_attention_kernel
    monkeypatch.setenv("REMASK_TRITON", "1")

    class Counting:
        def __getitem__(self, grid):
            calls.append(grid)
            return real[grid]

    monkeypatch.setattr(paged_kernels, "paged_attention_kernel", Counting())
    paged = remask.generate(tiny_llada, prompt, use_cache=PagedKVCache(page_size=4), **kw)
    assert calls and torch.equal(paged, dual)


def test_block_manager_can_share_a_final_partial_page():
    bm = BlockManager(num_pages=6, page_size=4)
    a = bm.allocate([1, 2, 3, 4, 5], seed=7, share_last=True)
    b = bm.allocate([1, 2, 3, 4, 5], seed=7, share_last=True)
    c = bm.allocate([1, 2, 3, 4, 5], seed=8, share_last=True)
    assert a == b and not set(a) & set(c) and bm.num_free == 2


@pytest.mark.parametrize("kwargs,match", [(dict(page_size=0), "page_size"), (dict(num_pages=-1), "num_pages")])
def test_paged_cache_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PagedKVCache(**kwargs)


def test_paged_cache_too_small_pool_is_a_clear_error(tiny_llada):
    prompt = torch.tensor([charset.encode_chat("sort 52814")])
    with pytest.raises(RuntimeError, match="paged cache is full"):
        remask.generate(tiny_llada, prompt, steps=4, gen_length=8, block_length=4,
                        use_cache=PagedKVCache(page_size=4, num_pages=2))
