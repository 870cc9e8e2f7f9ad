"""Block-sparse attention (Triton, compiled on a GPU or under the interpreter on CPU, and the torch
runtime) against the dense-mask float32 oracle; paged vs contiguous layouts; token-level retention
lists. The Triton path's inputs live on DEVICE, the torch path's and the oracles' on CPU."""
from __future__ import annotations

import mmap

import pytest
import torch

from conftest import DEVICE
from remask.kernels.sparse_attention import block_sparse_attention, block_sparse_attention_triton
from remask.kernels.sparse_attention_ref import (block_mask_to_dense, block_sparse_attention_reference,
                                                 block_sparse_attention_torch)


@pytest.fixture(params=["triton", "torch"])
def path(request, monkeypatch):
    """Both implementations, through the dispatcher (so every input also passes its checks)."""
    monkeypatch.setenv("REMASK_TRITON", "1" if request.param == "triton" else "0")
    return request.param


def path_device(path: str) -> str:
    """Where a path's inputs live: DEVICE for Triton, CPU for the torch runtime."""
    return DEVICE if path == "triton" else "cpu"


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-12))


def random_lists(gen, B, H, n_qb, n_kb, width=None):
    """Random distinct, unsorted block lists `[B, H, n_qb, width]` int32 and counts `[B, H, n_qb]`,
    junk past each count (ids repeated and out of range: never to be read), the first list empty
    and the last full."""
    width = n_kb + 2 if width is None else width
    idx = torch.randint(-3, n_kb + 3, (B, H, n_qb, width), generator=gen, dtype=torch.int32)
    num = torch.randint(0, n_kb + 1, (B, H, n_qb), generator=gen, dtype=torch.int32)
    num.view(-1)[0] = 0
    num.view(-1)[-1] = n_kb
    for flat, n in enumerate(num.view(-1).tolist()):
        idx.view(-1, width)[flat, :n] = torch.randperm(n_kb, generator=gen)[:n].to(torch.int32)
    return num, idx


def index_layout(num, idx, layout, Hq):
    """The lists as the kernel may receive them: "contiguous" int32; "strided" int64 views into
    larger, permuted buffers; "shared" one list per (b, query block) expanded over heads (stride 0)."""
    if layout == "contiguous":
        return num, idx
    if layout == "shared":
        B, _, n_qb, width = idx.shape
        return num[:, :1].expand(B, Hq, n_qb), idx[:, :1].expand(B, Hq, n_qb, width)
    B, H, n_qb, width = idx.shape
    num_buf = torch.full((n_qb, B, H), -7777, dtype=torch.int64, device=num.device)
    idx_buf = torch.full((n_qb, B, width, 2 * H), -7777, dtype=torch.int64, device=idx.device)
    num_view = num_buf.permute(1, 2, 0)
    idx_view = idx_buf.permute(1, 3, 0, 2)[:, ::2]
    num_view.copy_(num)
    idx_view.copy_(idx)
    return num_view, idx_view


CASES = [
    # (B, Hq, H_kv, Lq, Lk, D, q_block_size, kv_block_size, list layout, kv_len cuts the last block)
    (2, 4, 2, 37, 61, 64, 5, 5, "contiguous", True),
    (1, 4, 1, 37, 100, 64, 16, 1, "strided", False),
    (2, 2, 2, 61, 37, 128, 32, 16, "shared", True),
    (1, 2, 2, 9, 100, 64, 1, 32, "contiguous", True),
    (1, 4, 4, 37, 61, 128, 5, 32, "strided", True),
    (1, 4, 2, 37, 100, 64, 16, 5, "shared", False),
    (1, 2, 1, 70, 61, 64, 70, 7, "contiguous", True),     # a query block split over two row chunks
    (1, 2, 1, 20, 300, 64, 20, 130, "strided", True),     # blocks wider than one tile (three passes)
    (1, 2, 1, 37, 200, 64, 16, 128, "contiguous", True),
    (2, 4, 2, 23, 61, 64, 3, 13, "shared", True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}-Hq{}-Hkv{}-Lq{}-Lk{}-D{}-qb{}-kvb{}-{}-cut{}".format(*c))
def test_matches_dense_mask_oracle(case, dtype, path, poisoned_outputs):
    B, Hq, H_kv, Lq, Lk, D, qbs, kvbs, layout, cut = case
    gen = torch.Generator().manual_seed(Lq * Lk + qbs * 7 + kvbs)
    dev = path_device(path)
    n_qb, n_kb = -(-Lq // qbs), -(-Lk // kvbs)
    num, idx = random_lists(gen, B, 1 if layout == "shared" else Hq, n_qb, n_kb)
    num, idx = index_layout(num.to(dev), idx.to(dev), layout, Hq)   # the layout's strides made on dev
    # q and k in the models' [B, L, H, D] memory order: strided over L and H.
    q = torch.randn(B, Lq, Hq, D, generator=gen).to(dtype).to(dev).transpose(1, 2)
    k = torch.randn(B, Lk, H_kv, D, generator=gen).to(dtype).to(dev).transpose(1, 2)
    v = torch.randn(B, H_kv, Lk, D, generator=gen).to(dtype).to(dev)
    kv_len = None
    if cut:
        kv_len = torch.tensor([Lk - 1 - (3 * b) % kvbs for b in range(B)], dtype=torch.int32)
    kwargs = dict(q_block_size=qbs, kv_block_size=kvbs)
    out = block_sparse_attention(q, k, v, num, idx, kv_len=None if kv_len is None else kv_len.to(dev), **kwargs).cpu()
    q, k, v, num, idx = (t.cpu() for t in (q, k, v, num, idx))
    ref = block_sparse_attention_reference(q.float(), k.float(), v.float(), num, idx, kv_len=kv_len, **kwargs)
    assert out.shape == q.shape and out.dtype == dtype and not out.isnan().any()
    assert rel_rms(out, ref) < (5e-3 if dtype == torch.bfloat16 else 1e-5)
    # Queries that attend to nothing (the first list is empty) are exact zeros.
    nothing = ~block_mask_to_dense(num, idx, qbs, kvbs, Lq, Lk, kv_len).any(dim=-1)
    assert bool(nothing[0, 0, 0]) and (out[nothing] == 0).all()


def test_block_mask_to_dense_by_hand():
    # Lq=5 in query blocks of 2 (the last partial), Lk=7 in key blocks of 3, kv_len 6 cuts block 2.
    num = torch.tensor([[[2, 0, 1]]])
    idx = torch.tensor([[[[2, 0, 9], [1, 1, 1], [1, 5, 5]]]])   # junk past the counts
    dense = block_mask_to_dense(num, idx, 2, 3, 5, 7, kv_len=torch.tensor([6]))
    want = torch.tensor([[1, 1, 1, 0, 0, 0, 0]] * 2 + [[0] * 7] * 2 + [[0, 0, 0, 1, 1, 1, 0]]).bool()
    assert torch.equal(dense[0, 0], want)


def to_pages(x: torch.Tensor, perm: torch.Tensor, num_pages: int, page: int) -> torch.Tensor:
    """`[B, H_kv, n_blocks·page, D]` → pages `[num_pages, page, H_kv, D]`, logical block j of
    sequence b in page perm[b·n_blocks + j]; the unused pages hold NaN (never to be read)."""
    B, H_kv, L, D = x.shape
    pages = torch.full((num_pages, page, H_kv, D), float("nan"), dtype=x.dtype, device=x.device)
    pages[perm] = x.view(B, H_kv, L // page, page, D).permute(0, 2, 3, 1, 4).reshape(-1, page, H_kv, D)
    return pages


@pytest.mark.parametrize("dtype,kvbs,qbs", [(torch.float32, 16, 16), (torch.bfloat16, 5, 7), (torch.float16, 1, 32)])
def test_paged_layout_equals_contiguous(dtype, kvbs, qbs, path, poisoned_outputs):
    gen = torch.Generator().manual_seed(kvbs)
    B, Hq, H_kv, Lq, D = 2, 4, 2, 37, 64
    n_kb = -(-50 // kvbs)
    Lk = n_kb * kvbs
    num, idx = random_lists(gen, B, Hq, -(-Lq // qbs), n_kb)
    q = torch.randn(B, Hq, Lq, D, generator=gen).to(dtype)
    k = torch.randn(B, H_kv, Lk, D, generator=gen).to(dtype)
    v = torch.randn(B, H_kv, Lk, D, generator=gen).to(dtype)
    num_pages = B * n_kb + 3
    perm = torch.randperm(num_pages, generator=gen)[:B * n_kb]
    table = torch.randint(0, num_pages, (B, n_kb + 2), generator=gen, dtype=torch.int32)   # junk past the need
    table[:, :n_kb] = perm.view(B, n_kb).to(torch.int32)
    k_pages, v_pages = to_pages(k, perm, num_pages, kvbs), to_pages(v, perm, num_pages, kvbs)
    kv_len = torch.tensor([Lk, Lk - kvbs // 2], dtype=torch.int64)
    kwargs = dict(q_block_size=qbs, kv_block_size=kvbs, kv_len=kv_len)
    dev = path_device(path)
    on = dict(kwargs, kv_len=kv_len.to(dev))
    paged = block_sparse_attention(*(t.to(dev) for t in (q, k_pages, v_pages, num, idx)), block_table=table.to(dev),
                                   **on).cpu()
    contiguous = block_sparse_attention(*(t.to(dev) for t in (q, k, v, num, idx)), **on).cpu()
    assert not paged.isnan().any()
    torch.testing.assert_close(paged, contiguous, rtol=1e-6, atol=1e-6)
    ref = block_sparse_attention_reference(q.float(), k_pages.float(), v_pages.float(), num, idx,
                                           block_table=table, **kwargs)
    assert rel_rms(paged, ref) < (1e-5 if dtype == torch.float32 else 5e-3)


def test_token_retention_equals_sdpa_over_the_kept_keys(path, poisoned_outputs):
    # One block of 32 queries (positions 32..63 of a 96-token sequence) keeps 20 earlier or later
    # positions plus its own: kv_block_size=1 lists of token positions, unsorted.
    gen = torch.Generator().manual_seed(5)
    B, Hq, H_kv, D, L = 1, 4, 2, 64, 96
    own = torch.arange(32, 64)
    others = torch.cat([torch.arange(0, 32), torch.arange(64, L)])
    kept = torch.cat([others[torch.randperm(len(others), generator=gen)[:20]], own])
    kept = kept[torch.randperm(len(kept), generator=gen)]
    q = torch.randn(B, Hq, 32, D, generator=gen)
    k = torch.randn(B, H_kv, L, D, generator=gen)
    v = torch.randn(B, H_kv, L, D, generator=gen)
    dev = path_device(path)
    idx = kept.to(dev).view(1, 1, 1, -1).expand(B, Hq, 1, len(kept))
    num = torch.full((B, Hq, 1), len(kept), dtype=torch.int32, device=dev)
    out = block_sparse_attention(q.to(dev), k.to(dev), v.to(dev), num, idx, q_block_size=32, kv_block_size=1).cpu()
    kk = k[:, :, kept.sort().values].repeat_interleave(Hq // H_kv, dim=1)
    vv = v[:, :, kept.sort().values].repeat_interleave(Hq // H_kv, dim=1)
    dense = torch.nn.functional.scaled_dot_product_attention(q, kk, vv)
    assert rel_rms(out, dense) < 1e-5


def test_bad_counts_and_ids_are_ignored_not_read():
    # Counts past the list width are clamped and ids outside [0, n_kv_blocks) skipped, by both paths.
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 10, 16, generator=gen) for _ in range(3))
    idx = torch.tensor([[[[1, -1, 0, 99]], [[2, 1, 0, 3]]]])
    num = torch.tensor([[[9], [3]]])
    kwargs = dict(q_block_size=10, kv_block_size=4)
    ref = block_sparse_attention_reference(q, k, v, num, idx, **kwargs)
    on_device = (t.to(DEVICE) for t in (q, k, v, num, idx))
    outs = [block_sparse_attention_triton(*on_device, **kwargs).cpu(),
            block_sparse_attention_torch(q, k, v, num, idx, **kwargs)]
    for out in outs:
        assert rel_rms(out, ref) < 1e-5


def test_large_offsets_use_int64(path):
    # Key rows more than 2^31 elements from the base pointer, rows 2^25 + 2^20 elements apart in
    # an anonymous copy-on-write mapping (4.4 GB of address space, 64 pages touched).
    # On a GPU (the Triton path) the rows live in a 4.4 GB allocation of device memory, never touched
    # but for those 64 rows.
    D, Lk, row_stride = 64, 64, 2 ** 25 + 2 ** 20
    numel = (Lk - 1) * row_stride + D
    assert (Lk - 1) * row_stride > 2 ** 31
    dev = path_device(path)
    if dev == "cpu":
        try:
            buffer = mmap.mmap(-1, numel * 2, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except (OSError, ValueError) as err:   # pragma: no cover - a system that refuses the mapping
            pytest.skip(f"cannot map 4.4 GB of address space: {err}")
        storage = torch.frombuffer(buffer, dtype=torch.float16)
    else:
        try:
            storage = torch.empty(numel, dtype=torch.float16, device=dev)
        except torch.OutOfMemoryError as err:   # pragma: no cover - a GPU without 4.4 GB free
            pytest.skip(f"cannot allocate 4.4 GB on {dev}: {err}")
    k = torch.as_strided(storage, (1, 1, Lk, D), (0, 0, row_stride, 1))
    gen = torch.Generator().manual_seed(0)
    k.copy_(torch.randn(1, 1, Lk, D, generator=gen))
    q = torch.randn(1, 1, 3, D, generator=gen).half()
    idx = torch.tensor([[[[0]]]])
    num = torch.ones((1, 1, 1), dtype=torch.int32)
    out = block_sparse_attention(q.to(dev), k, k, num.to(dev), idx.to(dev), q_block_size=3, kv_block_size=Lk).cpu()
    k = k.cpu()
    ref = block_sparse_attention_reference(q.float(), k.float(), k.float(), num, idx, q_block_size=3, kv_block_size=Lk)
    assert rel_rms(out, ref) < 5e-3


def test_dispatch_defaults_to_torch_on_cpu(monkeypatch):
    monkeypatch.delenv("REMASK_TRITON", raising=False)
    if DEVICE != "cpu":
        pytest.skip("CPU dispatch")
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 9, 16, generator=gen) for _ in range(3))
    num, idx = random_lists(gen, 1, 2, 2, 3)
    kwargs = dict(q_block_size=5, kv_block_size=3)
    torch.testing.assert_close(block_sparse_attention(q, k, v, num, idx, **kwargs),
                               block_sparse_attention_torch(q, k, v, num, idx, **kwargs), rtol=0, atol=0)


def _call(q=None, k=None, v=None, num=None, idx=None, **kwargs):
    q = torch.randn(1, 4, 9, 16) if q is None else q
    k = torch.randn(1, 2, 12, 16) if k is None else k
    v = k if v is None else v
    num = torch.ones((1, 4, 3), dtype=torch.int32) if num is None else num
    idx = torch.zeros((1, 4, 3, 2), dtype=torch.int32) if idx is None else idx
    kwargs = {"q_block_size": 4, "kv_block_size": 4, **kwargs}
    return block_sparse_attention(q, k, v, num, idx, **kwargs)


@pytest.mark.parametrize("call,match", [
    (lambda: _call(q_block_size=0), "q_block_size"),
    (lambda: _call(kv_block_size=2.0), "kv_block_size"),
    (lambda: _call(q=torch.ones(1, 4, 9, 16, dtype=torch.int64)), "q must"),
    (lambda: _call(q=torch.randn(4, 9, 16)), "q must"),
    (lambda: _call(k=torch.randn(1, 3, 12, 16)), "H_kv"),
    (lambda: _call(k=torch.randn(1, 2, 12, 8)), "k and v"),
    (lambda: _call(v=torch.randn(1, 2, 12, 16).double()), "v must"),
    (lambda: _call(num=torch.ones((1, 4, 2), dtype=torch.int32)), "kv_num_blocks"),
    (lambda: _call(num=torch.ones((1, 4, 3))), "kv_num_blocks"),
    (lambda: _call(idx=torch.zeros((1, 4, 3, 2), dtype=torch.int16)), "kv_indices"),
    (lambda: _call(idx=torch.zeros((1, 4, 3, 2), dtype=torch.int32, device="meta")), "kv_indices.*device"),
    (lambda: _call(kv_len=torch.tensor([3.0])), "kv_len"),
    (lambda: _call(kv_len=torch.tensor([3, 4])), "kv_len"),
    (lambda: _call(k=torch.randn(5, 3, 2, 16), block_table=torch.zeros((1, 4), dtype=torch.int32)), "page_size"),
    (lambda: _call(k=torch.randn(5, 4, 2, 16), block_table=torch.zeros((1, 4))), "block_table"),
    (lambda: _call(k=torch.randn(5, 4, 2, 16), block_table=torch.zeros((2, 4), dtype=torch.int32)), "block_table"),
])
def test_bad_input_names_the_parameter(call, match):
    with pytest.raises(ValueError, match=match):
        call()
