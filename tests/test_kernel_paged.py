"""Paged KV kernels (store, gather, attention) under the Triton interpreter against torch references."""
from __future__ import annotations

import pytest
import torch

from conftest import DEVICE
from remask.kernels.paged import paged_attention, paged_gather, paged_store
from remask.kernels.paged_ref import paged_attention_torch, paged_gather_torch, paged_store_torch


@pytest.fixture
def triton_path(monkeypatch):
    monkeypatch.setenv("REMASK_TRITON", "1")


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-12))


def random_tables(gen, seq_lens, page_size, num_pages, extra_pages=1):
    """Random distinct page ids per sequence (a shuffled pool), padded with junk past the need."""
    need = [(-(-n // page_size)) for n in seq_lens]
    max_pages = max(need) + extra_pages
    pool = torch.randperm(num_pages, generator=gen)
    assert sum(need) <= num_pages
    table = torch.randint(0, num_pages, (len(seq_lens), max_pages), generator=gen, dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        table[b, :n] = pool[used:used + n].to(torch.int32)
        used += n
    return table, torch.tensor(seq_lens, dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,D,page_size", [(2, 64, 16), (3, 40, 5), (1, 128, 7)])
def test_store_scatters_rows_and_skips_minus_one(dtype, H, D, page_size, triton_path):
    gen = torch.Generator().manual_seed(H * D + page_size)
    num_pages, N = 11, 23
    k = torch.randn(N, H, D, generator=gen).to(dtype)
    v = torch.randn(N, H, D, generator=gen).to(dtype)
    slots = torch.randperm(num_pages * page_size, generator=gen)[:N]
    slots[::4] = -1
    caches = [torch.full((num_pages, page_size, H, D), float("nan"), dtype=dtype) for _ in range(4)]
    paged_store(k, v, caches[0], caches[1], slots)
    paged_store_torch(k, v, caches[2], caches[3], slots)
    torch.testing.assert_close(caches[0], caches[2], equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(caches[1], caches[3], equal_nan=True, rtol=0, atol=0)
    written = (~caches[0].isnan()).all(dim=(2, 3)).reshape(-1)
    assert int(written.sum()) == int((slots >= 0).sum())   # only the kept slots changed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_matches_reference(dtype, triton_path, poisoned_outputs):
    gen = torch.Generator().manual_seed(3)
    page_size, H, D = 6, 2, 24
    table, lens = random_tables(gen, [13, 1, 30, 6], page_size, num_pages=20)
    cache = torch.randn(20, page_size, H, D, generator=gen).to(dtype)
    out = paged_gather(cache, table, lens, max_len=31)
    ref = paged_gather_torch(cache, table, lens, max_len=31)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


CASES = [
    # (seq_lens, M queries, N fresh, Hq, H_kv, D, page_size)
    ([17, 5, 40], 7, 7, 4, 2, 64, 8),
    ([1, 33], 32, 32, 4, 4, 64, 16),
    ([29], 9, 0, 6, 2, 40, 5),
    ([0, 12, 61], 16, 16, 2, 1, 128, 13),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"lens{c[0]}-M{c[1]}-N{c[2]}-Hq{c[3]}-Hkv{c[4]}-D{c[5]}-P{c[6]}")
def test_paged_attention_matches_float32_reference(case, dtype, triton_path, poisoned_outputs):
    seq_lens, M, N, Hq, H_kv, D, page_size = case
    gen = torch.Generator().manual_seed(sum(seq_lens) + M)
    B = len(seq_lens)
    num_pages = sum(-(-n // page_size) for n in seq_lens) + 3
    table, lens = random_tables(gen, seq_lens, page_size, num_pages)
    k_cache = torch.randn(num_pages, page_size, H_kv, D, generator=gen).to(dtype)
    v_cache = torch.randn(num_pages, page_size, H_kv, D, generator=gen).to(dtype)
    q = torch.randn(B, M, Hq, D, generator=gen).to(dtype)
    k_new = torch.randn(B, N, H_kv, D, generator=gen).to(dtype) if N else None
    v_new = torch.randn(B, N, H_kv, D, generator=gen).to(dtype) if N else None
    out = paged_attention(q, k_cache, v_cache, table, lens, k_new, v_new)
    ref = paged_attention_torch(q.float(), k_cache.float(), v_cache.float(), table, lens,
                                None if k_new is None else k_new.float(), None if v_new is None else v_new.float())
    assert out.dtype == dtype and not out.isnan().any()
    assert rel_rms(out, ref) < (1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_paged_attention_equals_dense_attention_over_the_same_keys(triton_path):
    # The paged result equals SDPA over the gathered keys followed by the fresh ones.
    gen = torch.Generator().manual_seed(9)
    table, lens = random_tables(gen, [19, 19], 4, num_pages=12)
    k_cache, v_cache = (torch.randn(12, 4, 2, 32, generator=gen) for _ in range(2))
    q, k_new, v_new = torch.randn(2, 5, 2, 32, generator=gen), torch.randn(2, 5, 2, 32, generator=gen), \
        torch.randn(2, 5, 2, 32, generator=gen)
    out = paged_attention(q, k_cache, v_cache, table, lens, k_new, v_new)
    k = torch.cat([paged_gather_torch(k_cache, table, lens), k_new], dim=1).transpose(1, 2)
    v = torch.cat([paged_gather_torch(v_cache, table, lens), v_new], dim=1).transpose(1, 2)
    dense = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k, v).transpose(1, 2)
    assert rel_rms(out, dense) < 1e-5


def test_many_pages_use_int64_offsets(triton_path):
    # Page ids near the end of a cache whose element offsets exceed int32: 2^31 / (4·1·64) = 8.4M
    # pages would be needed; a strided view with a huge page stride reaches the same offsets
    # without the memory.
    D, page_size = 64, 4
    base = torch.randn(2, page_size, 1, D)
    k_cache = torch.as_strided(base, (70_000, page_size, 1, D), (0, D, D, 1))   # every page aliases page 0
    table = torch.tensor([[69_999, 40_000, 65_537]], dtype=torch.int32)
    lens = torch.tensor([10], dtype=torch.int32)
    q = torch.randn(1, 3, 1, D)
    out = paged_attention(q, k_cache, k_cache, table, lens)
    ref = paged_attention_torch(q, k_cache, k_cache, table, lens)
    assert rel_rms(out, ref) < 1e-5
    # and the store writes through a large slot index
    cache = torch.zeros(9000, 3, 1, 8)
    rows = torch.randn(2, 1, 8)
    paged_store(rows, rows, cache, cache.clone(), torch.tensor([8999 * 3 + 2, -1]))
    torch.testing.assert_close(cache[8999, 2], rows[0])


def test_dispatch_defaults_to_torch_on_cpu(monkeypatch):
    monkeypatch.delenv("REMASK_TRITON", raising=False)
    if DEVICE != "cpu":
        pytest.skip("CPU dispatch")
    gen = torch.Generator().manual_seed(1)
    table, lens = random_tables(gen, [5], 4, num_pages=3)
    k_cache = torch.randn(3, 4, 1, 16, generator=gen)
    q = torch.randn(1, 2, 1, 16, generator=gen)
    torch.testing.assert_close(paged_attention(q, k_cache, k_cache, table, lens),
                               paged_attention_torch(q, k_cache, k_cache, table, lens))


@pytest.mark.parametrize("call,match", [
    (lambda c, t, l: paged_attention(torch.randn(1, 2, 3, 16), c, c, t, l), "multiple"),
    (lambda c, t, l: paged_attention(torch.randn(1, 2, 2, 16), c, c, t.float(), l), "block_table"),
    (lambda c, t, l: paged_attention(torch.randn(1, 2, 2, 16), c, c, t, l + 100), "capacity"),
    (lambda c, t, l: paged_attention(torch.randn(1, 2, 2, 16), c, c, t, l, k_new=torch.randn(1, 2, 2, 16)), "both"),
    (lambda c, t, l: paged_store(torch.randn(3, 2, 16), torch.randn(3, 2, 16), c, c, torch.tensor([0, 1])),
     "slot_mapping"),
    (lambda c, t, l: paged_gather(c.transpose(2, 3), t, l), "contiguous"),
])
def test_bad_input_names_the_parameter(call, match):
    cache = torch.randn(4, 4, 2, 16)
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    lens = torch.tensor([6], dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        call(cache, table, lens)
