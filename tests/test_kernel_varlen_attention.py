"""Varlen attention (`remask.kernels.varlen_attention`): the Triton kernel (compiled on a GPU, under the
interpreter on CPU) against the torch reference, the reference against dense SDPA per segment, and
batch invariance: a segment's output bitwise the same alone and packed with others, on both paths.
Shapes are small and odd (the interpreter is slow); segments of 37 rows span two 32-row tiles."""
from __future__ import annotations

import importlib

import pytest
import torch

from conftest import DEVICE
from remask.kernels.paged_ref import paged_gather_torch
from torch.utils._python_dispatch import TorchDispatchMode

from remask.kernels.varlen_attention import (BIDIRECTIONAL, CAUSAL, pack_masks, query_tiles, varlen_attention,
                                             varlen_attention_torch, varlen_plan)

varlen_module = importlib.import_module("remask.kernels.varlen_attention")   # the package exports the function
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.fixture
def triton_path(monkeypatch):
    monkeypatch.setenv("REMASK_TRITON", "1")


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-12))


def make_pack(seed, cache_lens, rows, Hq=4, H_kv=2, D=24, page_size=5, dtype=torch.float32, fresh=True, cache=True):
    """Random queries / fresh K/V for segments of `rows` queries, and a paged cache holding
    `cache_lens[s]` positions of each in shuffled distinct pages (junk ids past the need)."""
    gen = torch.Generator().manual_seed(seed)
    S, N = len(rows), sum(rows)
    cu = torch.tensor([0] + torch.tensor(rows).cumsum(0).tolist(), dtype=torch.int32)
    args = dict(q=torch.randn(N, Hq, D, generator=gen).to(dtype),
                k=torch.randn(N, H_kv, D, generator=gen).to(dtype) if fresh else None,
                v=torch.randn(N, H_kv, D, generator=gen).to(dtype) if fresh else None, cu_seqlens=cu)
    if cache:
        need = [-(-n // page_size) for n in cache_lens]
        num_pages = sum(need) + 3
        pool = torch.randperm(num_pages, generator=gen)
        table = torch.randint(0, num_pages, (S, max(need) + 1), generator=gen, dtype=torch.int32)
        used = 0
        for s, n in enumerate(need):
            table[s, :n] = pool[used:used + n].to(torch.int32)
            used += n
        args.update(k_cache=torch.randn(num_pages, page_size, H_kv, D, generator=gen).to(dtype),
                    v_cache=torch.randn(num_pages, page_size, H_kv, D, generator=gen).to(dtype),
                    block_table=table, cache_lens=torch.tensor(cache_lens, dtype=torch.int32))
    return args


def on_device(args: dict) -> dict:
    return {name: t.to(DEVICE) if isinstance(t, torch.Tensor) else t for name, t in args.items()}


def as_float32(args: dict) -> dict:
    return {name: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
            for name, t in args.items()}


def dense_segment(args: dict, s: int, block_size: int, own_mask: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA of segment s alone over its gathered keys + its fresh ones, under an explicit boolean
    mask built from absolute positions (the definition, independent of the reference's code)."""
    cu = args["cu_seqlens"].tolist()
    a, b = cu[s], cu[s + 1]
    q = args["q"][a:b].float()
    keys, values, c = [], [], 0
    if args.get("k_cache") is not None:
        c = int(args["cache_lens"][s])
        one = (args["block_table"][s:s + 1], args["cache_lens"][s:s + 1], c)
        keys.append(paged_gather_torch(args["k_cache"], *one)[0].float())
        values.append(paged_gather_torch(args["v_cache"], *one)[0].float())
    if args["k"] is not None:
        keys.append(args["k"][a:b].float())
        values.append(args["v"][a:b].float())
    k, v = torch.cat(keys), torch.cat(values)
    q_pos = c + torch.arange(b - a)
    k_pos = torch.arange(k.shape[0])
    visible = torch.ones(b - a, k.shape[0], dtype=torch.bool) if block_size == BIDIRECTIONAL else \
        (k_pos[None, :] // block_size) <= (q_pos[:, None] // block_size)
    if own_mask is not None:
        visible = visible & own_mask
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                           attn_mask=visible).transpose(0, 1)
    return out.nan_to_num(0.0)     # SDPA gives NaN for a row with no visible key; varlen gives zeros


# --- the kernel against the reference ---------------------------------------------------------------

CASES = [
    # (cache_lens, rows, Hq, H_kv, D, page_size, block_sizes)
    ([3, 0, 40], [5, 7, 37], 4, 2, 24, 5, [BIDIRECTIONAL, CAUSAL, 4]),
    ([17, 9], [1, 6], 3, 1, 40, 7, [3, BIDIRECTIONAL]),
    ([0, 33, 2, 0], [4, 0, 9, 2], 2, 2, 64, 16, [CAUSAL, 2, 32, BIDIRECTIONAL]),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"cache{c[0]}-rows{c[1]}-Hq{c[2]}-Hkv{c[3]}-D{c[4]}-P{c[5]}")
def test_kernel_matches_reference(case, dtype, triton_path, poisoned_outputs):
    cache_lens, rows, Hq, H_kv, D, page_size, kinds = case
    args = make_pack(sum(rows) + D, cache_lens, rows, Hq, H_kv, D, page_size, dtype)
    args["block_sizes"] = torch.tensor(kinds, dtype=torch.int32)
    out = varlen_attention(**on_device(args)).cpu()
    ref = varlen_attention_torch(**as_float32(args))
    assert out.dtype == dtype and not out.isnan().any()
    assert rel_rms(out, ref) < TOL[dtype]


@pytest.mark.parametrize("kind", [BIDIRECTIONAL, CAUSAL, 3, 16])
def test_each_mask_kind_over_several_tiles(kind, triton_path, poisoned_outputs, monkeypatch):
    # 16 × 16 tiles: 37 queries after 21 cached keys span three query tiles and, block-causal, fresh
    # key tiles fully visible, diagonal and skipped per query tile.
    monkeypatch.setattr(varlen_module, "varlen_attention_config", lambda D, dtype, low=True: (16, 16, 4))
    args = make_pack(kind + 7, [21, 4], [37, 3], Hq=2, H_kv=1, D=16, page_size=4)
    args["block_sizes"] = torch.tensor([kind, kind], dtype=torch.int32)
    out = varlen_attention(**on_device(args)).cpu()
    assert not out.isnan().any()
    for s in range(2):
        a, b = args["cu_seqlens"][s].item(), args["cu_seqlens"][s + 1].item()
        assert rel_rms(out[a:b], dense_segment(args, s, kind)) < 1e-5


@pytest.mark.parametrize("layout", ["no cache", "cache only", "empty caches"])
def test_without_cache_or_without_fresh_keys(layout, triton_path, poisoned_outputs):
    rows, cache_lens = [6, 11, 1], ([0, 0, 0] if layout == "empty caches" else [9, 2, 14])
    args = make_pack(len(layout), cache_lens, rows, fresh=layout != "cache only", cache=layout != "no cache")
    if layout != "cache only":
        args["block_sizes"] = torch.tensor([CAUSAL, BIDIRECTIONAL, 4], dtype=torch.int32)
    out = varlen_attention(**on_device(args)).cpu()
    ref = varlen_attention_torch(**args)
    assert not out.isnan().any() and rel_rms(out, ref) < 1e-5
    kinds = args.get("block_sizes", torch.zeros(3, dtype=torch.int32)).tolist()
    for s in range(3):
        a, b = args["cu_seqlens"][s].item(), args["cu_seqlens"][s + 1].item()
        assert rel_rms(ref[a:b], dense_segment(args, s, kinds[s])) < 1e-5


@pytest.mark.parametrize("impl", ["kernel", "torch"])
def test_own_masks_are_anded_with_the_kind(impl, monkeypatch, poisoned_outputs):
    monkeypatch.setenv("REMASK_TRITON", "1" if impl == "kernel" else "0")
    cache_lens, rows = [7, 0, 12], [5, 4, 9]
    args = make_pack(11, cache_lens, rows)
    kinds = [BIDIRECTIONAL, CAUSAL, 4]
    gen = torch.Generator().manual_seed(5)
    masks = [torch.rand(m, c + m, generator=gen) < 0.6 for c, m in zip(cache_lens, rows)]
    masks[0][2] = False            # a query that sees nothing: zeros
    masks[1] = None                # a segment without a mask of its own
    mask, offsets = pack_masks(masks)
    out = varlen_attention(**on_device(args), block_sizes=torch.tensor(kinds, dtype=torch.int32, device=DEVICE),
                           mask=mask.to(DEVICE), mask_offsets=offsets.to(DEVICE)).cpu()
    assert not out.isnan().any()
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    for s in range(3):
        a, b = args["cu_seqlens"][s].item(), args["cu_seqlens"][s + 1].item()
        assert rel_rms(out[a:b], dense_segment(args, s, kinds[s], masks[s])) < 1e-5


# --- batch invariance ------------------------------------------------------------------------------

def sub_pack(args: dict, keep: list[int]) -> dict:
    """The pack of segments `keep` only (their rows, tables, lengths and kinds), in that order."""
    cu = args["cu_seqlens"].tolist()
    rows = torch.cat([torch.arange(cu[s], cu[s + 1]) for s in keep])
    out = dict(args, cu_seqlens=torch.tensor([0] + torch.tensor([cu[s + 1] - cu[s] for s in keep]).cumsum(0).tolist(),
                                             dtype=torch.int32))
    for name in ("q", "k", "v"):
        if args.get(name) is not None:
            out[name] = args[name][rows].clone()
    for name in ("block_table", "cache_lens", "block_sizes"):
        if args.get(name) is not None:
            out[name] = args[name][keep].clone()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl", ["kernel", "torch"])
def test_segment_alone_equals_segment_packed_bitwise(impl, dtype, monkeypatch, poisoned_outputs):
    monkeypatch.setenv("REMASK_TRITON", "1" if impl == "kernel" else "0")
    # Segment 2 (37 queries, block-causal, 23 cached) alone, then packed behind and before others
    # of other lengths, kinds and caches: the same bits.
    args = make_pack(3, [5, 40, 23, 0], [3, 12, 37, 8], Hq=4, H_kv=2, D=32, page_size=6, dtype=dtype)
    args["block_sizes"] = torch.tensor([BIDIRECTIONAL, CAUSAL, 4, 2], dtype=torch.int32)
    alone = varlen_attention(**on_device(sub_pack(args, [2]))).cpu()
    packed = varlen_attention(**on_device(args)).cpu()
    reordered = varlen_attention(**on_device(sub_pack(args, [3, 2, 0]))).cpu()
    a, b = args["cu_seqlens"][2].item(), args["cu_seqlens"][3].item()
    assert not alone.isnan().any()
    assert torch.equal(packed[a:b], alone)
    assert torch.equal(reordered[8:45], alone)


def test_other_segments_are_never_read(triton_path, poisoned_outputs):
    # NaN in every other segment's queries, fresh K/V and pages: segment 1 stays finite and equal.
    args = make_pack(8, [9, 14, 6], [7, 10, 5], page_size=4)
    args["block_sizes"] = torch.tensor([CAUSAL, 3, BIDIRECTIONAL], dtype=torch.int32)
    clean = varlen_attention(**on_device(args)).cpu()
    bad = {name: t.clone() if isinstance(t, torch.Tensor) else t for name, t in args.items()}
    for name in ("q", "k", "v"):
        bad[name][:7] = float("nan")
        bad[name][17:] = float("nan")
    own = set(args["block_table"][1, :4].tolist())    # 14 cached positions: 4 pages of 4
    others = [p for p in range(args["k_cache"].shape[0]) if p not in own]
    bad["k_cache"][others] = float("nan")
    bad["v_cache"][others] = float("nan")
    out = varlen_attention(**on_device(bad)).cpu()
    assert not out[7:17].isnan().any()
    assert torch.equal(out[7:17], clean[7:17])


# --- a plan per step (VarlenPlan): the same bits, nothing read back, only the kernel launched ------------

def planned(args: dict, kinds=None) -> dict:
    """`args` with cu_seqlens / cache_lens / block_sizes replaced by their `varlen_plan`."""
    cu = args["cu_seqlens"].tolist()
    cache = args.get("cache_lens")
    plan = varlen_plan([b - a for a, b in zip(cu, cu[1:])], None if cache is None else cache.tolist(), kinds,
                       device=DEVICE)
    rest = {name: t for name, t in args.items() if name not in ("cu_seqlens", "cache_lens", "block_sizes")}
    return dict(rest, cu_seqlens=plan)


@pytest.mark.parametrize("layout", ["cache and fresh", "no cache", "cache only", "own masks"])
@pytest.mark.parametrize("impl", ["kernel", "torch"])
def test_a_plan_gives_the_bits_of_the_tensors(layout, impl, monkeypatch, poisoned_outputs):
    monkeypatch.setenv("REMASK_TRITON", "1" if impl == "kernel" else "0")
    rows, lens = [3, 37, 0, 8], [5, 23, 4, 0]
    args = make_pack(5, lens, rows, page_size=6, fresh=layout != "cache only", cache=layout != "no cache")
    kinds = [BIDIRECTIONAL] * 4 if layout == "cache only" else [BIDIRECTIONAL, 4, CAUSAL, 2]
    args["block_sizes"] = torch.tensor(kinds, dtype=torch.int32)
    if layout == "own masks":
        gen = torch.Generator().manual_seed(6)
        args["mask"], args["mask_offsets"] = pack_masks(
            [torch.rand(m, c + m, generator=gen) < 0.7 if s % 2 else None for s, (m, c) in enumerate(zip(rows, lens))])
    by_tensors = varlen_attention(**on_device(args)).cpu()
    by_plan = varlen_attention(**planned(on_device(args), kinds)).cpu()
    assert not by_plan.isnan().any()
    assert torch.equal(by_plan, by_tensors)


class AtenOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.skipif(DEVICE != "cpu", reason="counts the ops of the CPU launch with the kernel stubbed")
def test_a_planned_call_reads_nothing_back_and_launches_only_the_kernel(monkeypatch):
    # On an H200 each value read back is a sync and each small op a launch: per layer, the call with
    # tensors cost 6 syncs and ~10 metadata ops (bench/results/gpu-h200-2026-11-29.md). With a plan,
    # the launcher may allocate its output and take views, nothing else; the kernel is stubbed here.
    monkeypatch.setenv("REMASK_TRITON", "1")
    grids = []

    class Stub:
        def __getitem__(self, grid):
            return lambda *a, **k: grids.append(grid)

    monkeypatch.setattr(varlen_module, "varlen_attention_kernel", Stub())
    args = make_pack(4, [5, 23, 0], [3, 37, 8], page_size=6)
    kinds = [BIDIRECTIONAL, 4, CAUSAL]
    args["block_sizes"] = torch.tensor(kinds, dtype=torch.int32)
    plan_args = planned(args, kinds)
    with AtenOps() as planned_ops:
        varlen_attention(**plan_args)
    with AtenOps() as tensor_ops:
        varlen_attention(**args)
    assert grids == [(1 + 2 + 1, 4), (3 + 48 // 32, 4)]     # the plan's exact tiles; query_tiles' upper bound
    assert set(planned_ops.names) <= {"empty", "view", "unsqueeze", "alias", "detach"}, planned_ops.names
    assert "_local_scalar_dense" in tensor_ops.names          # the check the plan made once on the host


@pytest.mark.parametrize("call,match", [
    (lambda: varlen_plan([]), "at least one segment"),
    (lambda: varlen_plan([3, -1]), "seq_lens must be ints >= 0"),
    (lambda: varlen_plan([3, 2], [1]), "cache_lens must have one entry per segment"),
    (lambda: varlen_plan([3, 2], [1, 2], [0, True]), "block_sizes must be ints"),
    (lambda: varlen_plan([3, 2.0]), "seq_lens must be ints"),
])
def test_a_plan_checks_its_values_on_the_host(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("change,match", [
    (dict(seq_lens=[6, 4]), "plan covers 10 query rows, q has N=9"),
    (dict(cache_lens=[5, 9]), "past the block_table capacity"),
    (dict(cache_lens=None), "go with a plan made with cache_lens"),
    (dict(block_sizes=[0, 3], fresh=False), "need the in-forward keys"),
    (dict(extra=dict(cache_lens=torch.tensor([5, 2], dtype=torch.int32))), "pass neither"),
])
@pytest.mark.parametrize("impl", ["dispatch", "torch-forced"])
def test_a_plan_that_does_not_fit_the_call_is_refused(change, match, impl, monkeypatch):
    monkeypatch.setenv("REMASK_TRITON", "0" if impl == "torch-forced" else "1")
    plan = varlen_plan(change.get("seq_lens", [6, 3]), change.get("cache_lens", [5, 2]), change.get("block_sizes"))
    fresh = change.get("fresh", True)
    args = dict(q=torch.randn(9, 4, 16), k=torch.randn(9, 2, 16) if fresh else None,
                v=torch.randn(9, 2, 16) if fresh else None, cu_seqlens=plan, k_cache=torch.randn(4, 4, 2, 16),
                v_cache=torch.randn(4, 4, 2, 16), block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                **change.get("extra", {}))
    with pytest.raises(ValueError, match=match):
        varlen_attention(**args)


# --- the reference, dispatch, layout, errors --------------------------------------------------------

@pytest.mark.parametrize("case", CASES[:2], ids=["three", "two"])
def test_reference_equals_dense_sdpa_per_segment(case):
    cache_lens, rows, Hq, H_kv, D, page_size, kinds = case
    args = make_pack(1, cache_lens, rows, Hq, H_kv, D, page_size)
    ref = varlen_attention_torch(**args, block_sizes=torch.tensor(kinds))
    cu = args["cu_seqlens"].tolist()
    for s in range(len(rows)):
        assert rel_rms(ref[cu[s]:cu[s + 1]], dense_segment(args, s, kinds[s])) < 1e-5


def test_query_tiles_cover_every_row_once():
    cu = torch.tensor([0, 5, 5, 70, 71, 135])      # lengths 5, 0, 65, 1, 64
    seg, row0 = query_tiles(cu, 135, 32)
    assert seg.shape[0] == 5 + 135 // 32
    used = row0 >= 0
    assert [(int(s), int(r)) for s, r in zip(seg[used], row0[used])] == \
        [(0, 0), (2, 0), (2, 32), (2, 64), (3, 0), (4, 0), (4, 32)]


def test_dispatch_defaults_to_torch_on_cpu(monkeypatch):
    monkeypatch.delenv("REMASK_TRITON", raising=False)
    if DEVICE != "cpu":
        pytest.skip("CPU dispatch")
    args = make_pack(2, [3, 8], [4, 2])
    assert torch.equal(varlen_attention(**args), varlen_attention_torch(**args))


@pytest.mark.parametrize("change,match", [
    (dict(q=torch.randn(9, 3, 16)), "multiple"),
    (dict(cu_seqlens=torch.tensor([0, 5, 8], dtype=torch.int32)), "cu_seqlens must rise"),
    (dict(cu_seqlens=torch.tensor([0, 3, 6, 9], dtype=torch.int32)), "block_table"),
    (dict(cu_seqlens=torch.tensor([0.0, 9.0])), "cu_seqlens must be an int"),
    (dict(k=None), "both k and v"),
    (dict(block_table=None), "together"),
    (dict(cache_lens=torch.tensor([3, 100], dtype=torch.int32)), "capacity"),
    (dict(block_sizes=torch.tensor([1, -1], dtype=torch.int32)), "block_sizes must be >= 0"),
    (dict(block_sizes=torch.tensor([1.0, 2.0])), "block_sizes must be an int"),
    (dict(k=None, v=None, block_sizes=torch.tensor([1, 0])), "need the in-forward keys"),
    (dict(mask=torch.ones(10, dtype=torch.bool)), "mask_offsets"),
    (dict(mask=torch.ones(10, dtype=torch.bool), mask_offsets=torch.tensor([0, -1])), "reach past"),
    (dict(mask=torch.ones(10), mask_offsets=torch.tensor([0, -1])), "flat bool"),
    (dict(k_cache=torch.randn(4, 4, 2, 16).transpose(2, 3)), "k_cache and v_cache must"),
])
@pytest.mark.parametrize("impl", ["dispatch", "torch-forced"])
def test_bad_input_names_the_parameter(change, match, impl, monkeypatch):
    monkeypatch.setenv("REMASK_TRITON", "0" if impl == "torch-forced" else "1")
    args = dict(q=torch.randn(9, 4, 16), k=torch.randn(9, 2, 16), v=torch.randn(9, 2, 16),
                cu_seqlens=torch.tensor([0, 6, 9], dtype=torch.int32), k_cache=torch.randn(4, 4, 2, 16),
                v_cache=torch.randn(4, 4, 2, 16), block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                cache_lens=torch.tensor([5, 2], dtype=torch.int32))
    args.update(change)
    with pytest.raises(ValueError, match=match):
        varlen_attention(**args)


# --- several attentions in one call (`varlen_attention_each`: the engine's varlen route) ------------------------

@pytest.mark.parametrize("impl", ["kernel", "torch"])
def test_each_set_attends_its_own_keys_in_one_call(impl, monkeypatch, poisoned_outputs):
    """Sets of 5 / 1 / 37 queries over 9 / 3 / 40 keys of their own (GQA 4 / 2), one with a boolean mask: each
    output is SDPA over the set alone, bitwise the same alone and with the others, and a plan made for the layout
    gives the same bits on the next call (a forward's next layer)."""
    monkeypatch.setenv("REMASK_TRITON", "1" if impl == "kernel" else "0")
    from remask.kernels.varlen_attention import varlen_attention_each

    gen = torch.Generator().manual_seed(9)
    shapes = [(5, 9), (1, 3), (37, 40)]
    qs = [torch.randn(m, 4, 24, generator=gen).to(DEVICE) for m, _ in shapes]
    ks = [torch.randn(t, 2, 24, generator=gen).to(DEVICE) for _, t in shapes]
    vs = [torch.randn(t, 2, 24, generator=gen).to(DEVICE) for _, t in shapes]
    masks = [None, None, (torch.rand(37, 40, generator=gen) < 0.7).to(DEVICE)]
    masks[2][:, 0] = True                     # every query sees a key
    outs, plan = varlen_attention_each(qs, ks, vs, masks)
    for (q, k, v, mask), out in zip(zip(qs, ks, vs, masks), outs):
        want = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1).cpu(), k.repeat_interleave(2, 1).transpose(0, 1).cpu(),
            v.repeat_interleave(2, 1).transpose(0, 1).cpu(), attn_mask=None if mask is None else mask.cpu())
        assert rel_rms(out.cpu(), want.transpose(0, 1)) < 1e-5
    for s in range(3):
        assert torch.equal(varlen_attention_each([qs[s]], [ks[s]], [vs[s]], [masks[s]])[0][0], outs[s])
    again, same_plan = varlen_attention_each(qs, ks, vs, masks, plan)
    assert same_plan is plan and all(torch.equal(a, b) for a, b in zip(again, outs))
