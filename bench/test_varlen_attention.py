"""Varlen attention (issue 47: one attention launch per layer for a whole pack of requests):
`varlen_attention` over 4 requests (called with tensors, and with the `VarlenPlan` a runner makes once
per step) against what a packed forward does today, one `paged_attention` call per request
(`PackedAttention`), and against the torch reference `varlen_attention_torch`.

Shape (as bench/test_block_attention.py): 4 requests with 61 / 200 / 333 / 517 cached positions in
pages of 16, a 32-token block each (fresh queries = keys), block-causal with blocks of 32 (SDAR,
LLaDA2, Fast-dLLM v2), 16 query heads over 4 KV heads × 64. On a GPU `varlen_attention` and
`paged_attention` run their Triton kernels (one launch against four); on CPU the dispatchers run the
torch references, so the rows there compare the references' formulations, not the kernels.

    make bench            # or: python -m pytest bench/test_varlen_attention.py --benchmark-json=...
"""
from __future__ import annotations

import pytest
import torch

from conftest import DEVICE, ON_GPU, run
from remask.kernels import paged_attention, roofline, varlen_attention
from remask.kernels.varlen_attention import varlen_plan
from remask.kernels.varlen_attention_ref import varlen_attention_torch

CACHE_LENS, M, HQ, H_KV, D, PAGE, BLOCK = [61, 200, 333, 517], 32, 16, 4, 64, 16, 32


def inputs(dtype):
    g = torch.Generator().manual_seed(0)
    S = len(CACHE_LENS)
    need = [-(-n // PAGE) for n in CACHE_LENS]
    num_pages = sum(need) + 4
    pool = torch.randperm(num_pages, generator=g)
    table = torch.zeros(S, max(need), dtype=torch.int32)
    used = 0
    for s, n in enumerate(need):
        table[s, :n] = pool[used:used + n]
        used += n
    k_cache, v_cache = (torch.randn(num_pages, PAGE, H_KV, D, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(S * M, HQ, D, generator=g).to(dtype)
    k, v = (torch.randn(S * M, H_KV, D, generator=g).to(dtype) for _ in range(2))
    args = dict(q=q, k=k, v=v, cu_seqlens=torch.arange(0, S * M + 1, M, dtype=torch.int32), k_cache=k_cache,
                v_cache=v_cache, block_table=table, cache_lens=torch.tensor(CACHE_LENS, dtype=torch.int32),
                block_sizes=torch.full((S,), BLOCK, dtype=torch.int32))
    return {name: t.to(DEVICE) for name, t in args.items()}


def per_request(a):
    """Today's packed forward: each request's own paged_attention call, written into the pack's rows."""
    out = torch.empty_like(a["q"])
    for s in range(len(CACHE_LENS)):
        rows = slice(s * M, (s + 1) * M)
        out[rows] = paged_attention(a["q"][None, rows], a["k_cache"], a["v_cache"], a["block_table"][s:s + 1],
                                    a["cache_lens"][s:s + 1], a["k"][None, rows], a["v"][None, rows],
                                    block_size=BLOCK)[0]
    return out


def with_plan(a):
    """The call as a runner makes it per layer: the pack's `VarlenPlan` made once per step, outside."""
    plan = varlen_plan([M] * len(CACHE_LENS), CACHE_LENS, [BLOCK] * len(CACHE_LENS), device=DEVICE)
    rest = {n: t for n, t in a.items() if n not in ("cu_seqlens", "cache_lens", "block_sizes")}
    return lambda: varlen_attention(**rest, cu_seqlens=plan)


IMPLS = {
    "reference": lambda a: (lambda: varlen_attention_torch(**a)),
    "per-request paged_attention": lambda a: (lambda: per_request(a)),
    "remask varlen": lambda a: (lambda: varlen_attention(**a)),
    "remask varlen, plan per step": with_plan,
}


@pytest.mark.parametrize("impl", list(IMPLS))
def test_varlen_attention(benchmark, impl):
    args = inputs(torch.bfloat16 if ON_GPU else torch.float32)
    fn = IMPLS[impl](args)
    cost = roofline.cost_paged_attention(CACHE_LENS, M, HQ, H_KV, D, args["q"].dtype, page_size=PAGE,
                                         block_size=BLOCK)
    run(benchmark, fn, cost=cost,
        group=f"varlen attention, {len(CACHE_LENS)} requests × {M} fresh, block-causal {BLOCK}, "
              f"{HQ}/{H_KV} heads × {D}, page {PAGE}",
        kernel="varlen_attention", impl=impl, baseline="reference", cache_lens=CACHE_LENS, block_size=BLOCK)
