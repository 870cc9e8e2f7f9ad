"""Paged KV kernels (store, gather, attention) against torch references: compiled on a GPU, under the
Triton interpreter on CPU. The kernels' inputs live on DEVICE; the references run on CPU copies."""
from __future__ import annotations

import pytest
import torch

from conftest import DEVICE
from remask.kernels.paged import paged_attention, paged_gather, paged_store
from remask.kernels.paged_ref import paged_attention_torch, paged_gather_torch, paged_store_torch


@pytest.fixture
def triton_path(monkeypatch):
    monkeypatch.setenv("REMASK_TRITON", "1")


def on_device(*tensors):
    """The kernel's copies of `tensors` on DEVICE (None stays None); views keep their strides."""
    return tuple(None if t is None else t.to(DEVICE) for t in tensors)


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
    caches = [torch.full((num_pages, page_size, H, D), float("nan"), dtype=dtype, device=device)
              for device in (DEVICE, DEVICE, "cpu", "cpu")]
    paged_store(*on_device(k, v), caches[0], caches[1], slots.to(DEVICE))
    paged_store_torch(k, v, caches[2], caches[3], slots)
    torch.testing.assert_close(caches[0].cpu(), caches[2], equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(caches[1].cpu(), caches[3], equal_nan=True, rtol=0, atol=0)
    written = (~caches[0].cpu().isnan()).all(dim=(2, 3)).reshape(-1)
    assert int(written.sum()) == int((slots >= 0).sum())   # only the kept slots changed


@pytest.mark.parametrize("heads", [(2, 24), (3, 401)])     # H·D = 1203: two column tiles, the last partial
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_matches_reference(dtype, heads, triton_path, poisoned_outputs):
    gen = torch.Generator().manual_seed(3)
    page_size, (H, D) = 6, heads
    table, lens = random_tables(gen, [13, 1, 30, 6], page_size, num_pages=20)
    cache = torch.randn(20, page_size, H, D, generator=gen).to(dtype)
    out = paged_gather(*on_device(cache, table, lens), max_len=31).cpu()
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
    out = paged_attention(*on_device(q, k_cache, v_cache, table, lens, k_new, v_new)).cpu()
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
    out = paged_attention(*on_device(q, k_cache, v_cache, table, lens, k_new, v_new)).cpu()
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
    table = torch.tensor([[69_999, 40_000, 65_537]], dtype=torch.int32)
    lens = torch.tensor([10], dtype=torch.int32)
    q = torch.randn(1, 3, 1, D)
    ref = paged_attention_torch(q, *[torch.as_strided(base, (70_000, page_size, 1, D), (0, D, D, 1))] * 2, table, lens)
    # every page aliases page 0 (the view is made on DEVICE: a copy would drop the zero stride)
    k_cache = torch.as_strided(base.to(DEVICE), (70_000, page_size, 1, D), (0, D, D, 1))
    out = paged_attention(*on_device(q), k_cache, k_cache, *on_device(table, lens)).cpu()
    assert rel_rms(out, ref) < 1e-5
    # and the store writes through a large slot index
    cache = torch.zeros(9000, 3, 1, 8, device=DEVICE)
    rows = torch.randn(2, 1, 8)
    paged_store(*on_device(rows, rows), cache, cache.clone(), torch.tensor([8999 * 3 + 2, -1], device=DEVICE))
    torch.testing.assert_close(cache[8999, 2].cpu(), rows[0])


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


# --- block-causal (block diffusion: SDAR, LLaDA2, Fast-dLLM v2) ---------------------------------

def block_inputs(gen, seq_lens, M, Hq, H_kv, D, page_size, dtype=torch.float32):
    """Random paged caches, a block table for `seq_lens`, and M queries with M fresh K/V rows."""
    num_pages = sum(-(-n // page_size) for n in seq_lens) + 3
    table, lens = random_tables(gen, seq_lens, page_size, num_pages)
    k_cache, v_cache = (torch.randn(num_pages, page_size, H_kv, D, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(len(seq_lens), M, Hq, D, generator=gen).to(dtype)
    k_new, v_new = (torch.randn(len(seq_lens), M, H_kv, D, generator=gen).to(dtype) for _ in range(2))
    return q, k_cache, v_cache, table, lens, k_new, v_new


def dense_block_causal(q, k_cache, v_cache, table, lens, k_new, v_new, block_size):
    """SDPA per sequence over its gathered keys + the fresh ones, under an explicit boolean mask
    built from absolute positions: key at p visible to the query at r iff p // bs <= r // bs."""
    outs = []
    group = q.shape[2] // k_cache.shape[2]
    for b, s in enumerate(lens.tolist()):
        k = torch.cat([paged_gather_torch(k_cache, table[b:b + 1], lens[b:b + 1], s)[0], k_new[b]]).float()
        v = torch.cat([paged_gather_torch(v_cache, table[b:b + 1], lens[b:b + 1], s)[0], v_new[b]]).float()
        q_pos = s + torch.arange(q.shape[1])
        k_pos = torch.arange(s + k_new.shape[1])
        mask = (k_pos[None, :] // block_size) <= (q_pos[:, None] // block_size)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        o = torch.nn.functional.scaled_dot_product_attention(
            q[b].float().transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask)
        outs.append(o.transpose(0, 1))
    return torch.stack(outs).to(q.dtype)


BLOCK_CASES = [
    # (seq_lens, M = N, Hq, H_kv, D, page_size): seq_lens off every block size, 0 included
    ([0, 5, 13], 7, 4, 2, 24, 4),
    ([2, 0, 9, 30], 11, 3, 1, 40, 5),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 3, 4, 8])
@pytest.mark.parametrize("case", BLOCK_CASES, ids=lambda c: f"lens{c[0]}-M{c[1]}-Hq{c[2]}-Hkv{c[3]}-D{c[4]}-P{c[5]}")
def test_block_causal_kernel_matches_reference(case, block_size, dtype, triton_path, poisoned_outputs):
    seq_lens, M, Hq, H_kv, D, page_size = case
    gen = torch.Generator().manual_seed(block_size * 100 + M)
    inputs = block_inputs(gen, seq_lens, M, Hq, H_kv, D, page_size, dtype)
    out = paged_attention(*on_device(*inputs), block_size=block_size).cpu()
    ref = paged_attention_torch(*(t.float() if t.is_floating_point() else t for t in inputs), block_size=block_size)
    assert out.dtype == dtype and not out.isnan().any()
    assert rel_rms(out, ref) < {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]


@pytest.mark.parametrize("block_size", [4, 32])
def test_block_causal_kernel_skips_and_masks_across_tiles(block_size, triton_path, poisoned_outputs):
    # M = N = 70: two query tiles (BLOCK_M 64) and five fresh-key tiles (BLOCK_N 16), so some key
    # tiles are fully visible (no mask), some diagonal (masked) and some skipped per query tile.
    gen = torch.Generator().manual_seed(block_size)
    inputs = block_inputs(gen, [5, 0], 70, 2, 1, 16, 16)
    out = paged_attention(*on_device(*inputs), block_size=block_size).cpu()
    ref = paged_attention_torch(*inputs, block_size=block_size)
    assert not out.isnan().any() and rel_rms(out, ref) < 1e-5


def test_block_causal_kernel_never_reads_future_tiles(triton_path, poisoned_outputs):
    # block_size 16, M = N = 70 after 16 cached positions: the first query tile (rows 0..63) ends
    # its loop at fresh key 64, so NaN fresh rows 64..69 (seen only by rows 64..69) cannot reach
    # it; a tile that were loaded would (0 · NaN in the P·V product).
    gen = torch.Generator().manual_seed(16)
    q, k_cache, v_cache, table, lens, k_new, v_new = block_inputs(gen, [16], 70, 2, 1, 16, 8)
    ref = paged_attention_torch(q, k_cache, v_cache, table, lens, k_new, v_new, block_size=16)
    k_bad, v_bad = k_new.clone(), v_new.clone()
    k_bad[:, 64:] = float("nan")
    v_bad[:, 64:] = float("nan")
    out = paged_attention(*on_device(q, k_cache, v_cache, table, lens, k_bad, v_bad), block_size=16).cpu()
    assert not out[:, :64].isnan().any() and rel_rms(out[:, :64], ref[:, :64]) < 1e-5


@pytest.mark.parametrize("block_size", [1, 3, 4, 8])
def test_block_causal_reference_equals_dense_masked_sdpa(block_size):
    gen = torch.Generator().manual_seed(block_size)
    inputs = block_inputs(gen, [0, 7, 13, 2], 9, 4, 2, 16, 5)
    ref = paged_attention_torch(*inputs, block_size=block_size)
    assert rel_rms(ref, dense_block_causal(*inputs, block_size)) < 1e-5


@pytest.mark.parametrize("impl", ["kernel", "torch"])
def test_block_size_covering_everything_is_bidirectional(impl, monkeypatch):
    monkeypatch.setenv("REMASK_TRITON", "1" if impl == "kernel" else "0")
    gen = torch.Generator().manual_seed(4)
    seq_lens, M = [3, 11, 0], 6
    inputs = block_inputs(gen, seq_lens, M, 2, 2, 16, 4)
    if impl == "kernel":
        inputs = on_device(*inputs)
    bidirectional = paged_attention(*inputs)
    for block_size in (max(seq_lens) + M, 1000):
        torch.testing.assert_close(paged_attention(*inputs, block_size=block_size), bidirectional,
                                   rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl", ["kernel", "torch"])
def test_block_size_one_is_causal_attention(impl, monkeypatch):
    monkeypatch.setenv("REMASK_TRITON", "1" if impl == "kernel" else "0")
    gen = torch.Generator().manual_seed(5)
    inputs = q, k_cache, v_cache, table, lens, k_new, v_new = block_inputs(gen, [6, 1], 5, 2, 1, 16, 4)
    out = paged_attention(*(on_device(*inputs) if impl == "kernel" else inputs), block_size=1).cpu()
    for b, s in enumerate(lens.tolist()):
        k = torch.cat([paged_gather_torch(k_cache, table[b:b + 1], lens[b:b + 1], s)[0], k_new[b]])
        v = torch.cat([paged_gather_torch(v_cache, table[b:b + 1], lens[b:b + 1], s)[0], v_new[b]])
        # causal over absolute positions: query i (at s + i) sees keys 0 .. s + i
        mask = torch.ones(5, s + 5, dtype=torch.bool).tril(diagonal=s)
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        causal = torch.nn.functional.scaled_dot_product_attention(
            q[b].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask).transpose(0, 1)
        assert rel_rms(out[b], causal) < 1e-5
        # and the last query sees everything: the bidirectional result for that row
        assert rel_rms(out[b, -1], paged_attention_torch(*(t[b:b + 1] for t in (q,)), k_cache, v_cache, table[b:b + 1],
                                                         lens[b:b + 1], k_new[b:b + 1], v_new[b:b + 1])[0, -1]) < 1e-5


def test_block_size_none_is_unchanged(triton_path):
    gen = torch.Generator().manual_seed(6)
    inputs = on_device(*block_inputs(gen, [9, 2], 7, 2, 1, 16, 4))
    torch.testing.assert_close(paged_attention(*inputs, block_size=None), paged_attention(*inputs), rtol=0, atol=0)


@pytest.mark.parametrize("impl", [paged_attention, paged_attention_torch], ids=["dispatch", "torch"])
@pytest.mark.parametrize("kwargs,match", [
    (dict(block_size=0), "block_size must be a positive int"),
    (dict(block_size=-2), "block_size must be a positive int"),
    (dict(block_size=2.0), "block_size must be a positive int"),
    (dict(block_size=True), "block_size must be a positive int"),
    (dict(block_size=4, n_new=3), "block_size.*k_new N == q M"),
    (dict(block_size=4, n_new=None), "block_size.*k_new"),
])
def test_block_size_bad_input_names_the_parameter(impl, kwargs, match):
    cache = torch.randn(4, 4, 2, 16)
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    lens = torch.tensor([6], dtype=torch.int32)
    kwargs = dict(kwargs)   # the parametrized dict is shared between the two impls
    n_new = kwargs.pop("n_new", 2)
    kv = (None, None) if n_new is None else (torch.randn(1, n_new, 2, 16), torch.randn(1, n_new, 2, 16))
    with pytest.raises(ValueError, match=match):
        impl(torch.randn(1, 2, 2, 16), cache, cache, table, lens, *kv, **kwargs)
