"""Block-causal paged attention (block diffusion: SDAR, LLaDA2, Fast-dLLM v2): `paged_attention(...,
block_size=32)` against its torch reference `paged_attention_torch` (gathers the pages, float32,
dense mask), with the bidirectional call beside them for the cost of the mask.

Shape: 4 sequences with 61 / 200 / 333 / 517 cached positions (none on a block boundary, so
the first fresh block is partially filled), 64 fresh queries = keys each (prefill of two-plus
blocks), 16 query heads over 4 KV heads × 64, pages of 16. On a GPU `paged_attention` runs the
Triton kernel (future fresh-key tiles skipped); on CPU the dispatcher runs the torch reference, so
the two rows there differ only by the dispatch.

    make bench            # or: python -m pytest bench/test_block_attention.py --benchmark-json=...
"""
from __future__ import annotations

import pytest
import torch

from conftest import DEVICE, ON_GPU, run
from remask.kernels import paged_attention, roofline
from remask.kernels.paged_ref import paged_attention_torch

SEQ_LENS, M, HQ, H_KV, D, PAGE, BLOCK = [61, 200, 333, 517], 64, 16, 4, 64, 16, 32

IMPLS = {
    "reference": lambda *a: paged_attention_torch(*a, block_size=BLOCK),
    "remask": lambda *a: paged_attention(*a, block_size=BLOCK),
    "remask bidirectional": lambda *a: paged_attention(*a),
}


def inputs(dtype):
    g = torch.Generator().manual_seed(0)
    need = [-(-n // PAGE) for n in SEQ_LENS]
    num_pages = sum(need) + 4
    pool = torch.randperm(num_pages, generator=g)
    table = torch.zeros(len(SEQ_LENS), max(need), dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        table[b, :n] = pool[used:used + n]
        used += n
    lens = torch.tensor(SEQ_LENS, dtype=torch.int32)
    k_cache, v_cache = (torch.randn(num_pages, PAGE, H_KV, D, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(len(SEQ_LENS), M, HQ, D, generator=g).to(dtype)
    k_new, v_new = (torch.randn(len(SEQ_LENS), M, H_KV, D, generator=g).to(dtype) for _ in range(2))
    return [t.to(DEVICE) for t in (q, k_cache, v_cache, table, lens, k_new, v_new)]


@pytest.mark.parametrize("impl", list(IMPLS))
def test_block_causal_paged_attention(benchmark, impl):
    args = inputs(torch.bfloat16 if ON_GPU else torch.float32)
    fn = IMPLS[impl]
    # The block-causal impls' work (the reference computes the same output); bidirectional: every fresh key.
    cost = roofline.cost_paged_attention(SEQ_LENS, M, HQ, H_KV, D, args[0].dtype, page_size=PAGE,
                                         block_size=None if impl == "remask bidirectional" else BLOCK)
    run(benchmark, lambda: fn(*args), cost=cost,
        group=f"block-causal paged attention, {len(SEQ_LENS)} seqs × {M} fresh, block {BLOCK}, "
              f"{HQ}/{H_KV} heads × {D}, page {PAGE}",
        kernel="block_attention", impl=impl, baseline="reference", seq_lens=SEQ_LENS, block_size=BLOCK)
