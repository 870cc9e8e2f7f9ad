"""The kept implementations weighed against `remask.kernels.varlen_attention` (docs/kernels.md, "Varlen
attention"), on CPU: FlexAttention with a document mask over a packed sequence (eager, then
`torch.compile`d), whether a segment's output is bitwise the same packed as alone, its time against
`varlen_attention_torch` on the same pack, and whether torch's varlen attention has a CPU kernel.

    python bench/varlen_alternatives.py          # one thread; the compiled attempt takes minutes
"""
from __future__ import annotations

import time
import traceback

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from remask.kernels.varlen_attention_ref import varlen_attention_torch

HQ, HKV, D, BLOCK, PAGE = 4, 2, 64, 32, 16
SEGMENTS = [(61, 32), (200, 32), (17, 64)]     # (cached positions, fresh queries = keys)


def segment_tensors(cache_len: int, n: int):
    g = torch.Generator().manual_seed(1000 + cache_len * 7 + n)   # a segment's data never depends on the pack
    return (torch.randn(n, HQ, D, generator=g), torch.randn(cache_len + n, HKV, D, generator=g),
            torch.randn(cache_len + n, HKV, D, generator=g))


def flex(segments, compiled: bool, repeats: int = 3):
    """Block-causal attention of each segment over its keys (cache then fresh) as one FlexAttention
    call on the packed sequences; returns (output [N, HQ, D], first-call s, later-call s)."""
    qs, ks, vs = zip(*(segment_tensors(c, n) for c, n in segments))
    q, k, v = (torch.cat(t)[None].transpose(1, 2) for t in (qs, ks, vs))
    q_doc = torch.cat([torch.full((n,), i) for i, (c, n) in enumerate(segments)])
    k_doc = torch.cat([torch.full((c + n,), i) for i, (c, n) in enumerate(segments)])
    q_pos = torch.cat([c + torch.arange(n) for c, n in segments])
    k_pos = torch.cat([torch.arange(c + n) for c, n in segments])

    def mask_mod(b, h, qi, ki):
        return (q_doc[qi] == k_doc[ki]) & (k_pos[ki] // BLOCK <= q_pos[qi] // BLOCK)

    block_mask = create_block_mask(mask_mod, 1, None, q.shape[2], k.shape[2], device="cpu")
    fn = torch.compile(flex_attention) if compiled else flex_attention
    started = time.perf_counter()
    out = fn(q, k, v, block_mask=block_mask, enable_gqa=True)
    first = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(repeats):
        out = fn(q, k, v, block_mask=block_mask, enable_gqa=True)
    return out[0].transpose(0, 1), first, (time.perf_counter() - started) / max(repeats, 1)


def reference(segments, repeats: int = 5):
    """`varlen_attention_torch` on the same pack, the cached keys in pages of PAGE."""
    qs, ks, vs = zip(*(segment_tensors(c, n) for c, n in segments))
    S = len(segments)
    pages = [-(-c // PAGE) for c, _ in segments]
    k_cache, v_cache = torch.zeros(sum(pages), PAGE, HKV, D), torch.zeros(sum(pages), PAGE, HKV, D)
    table = torch.zeros(S, max(pages), dtype=torch.int32)
    used = 0
    for s, (c, _) in enumerate(segments):
        table[s, :pages[s]] = torch.arange(used, used + pages[s])
        used += pages[s]
        slots = torch.arange(c)
        k_cache[table[s, slots // PAGE].long(), slots % PAGE] = ks[s][:c]
        v_cache[table[s, slots // PAGE].long(), slots % PAGE] = vs[s][:c]
    args = dict(k_cache=k_cache, v_cache=v_cache, block_table=table,
                cache_lens=torch.tensor([c for c, _ in segments], dtype=torch.int32),
                block_sizes=torch.full((S,), BLOCK, dtype=torch.int32))
    cu = torch.tensor([0] + torch.tensor([n for _, n in segments]).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.cat(qs)
    k = torch.cat([t[c:] for t, (c, _) in zip(ks, segments)])
    v = torch.cat([t[c:] for t, (c, _) in zip(vs, segments)])
    out = varlen_attention_torch(q, k, v, cu, **args)
    started = time.perf_counter()
    for _ in range(repeats):
        out = varlen_attention_torch(q, k, v, cu, **args)
    return out, (time.perf_counter() - started) / repeats


def main() -> None:
    torch.set_num_threads(1)
    ref, ref_s = reference(SEGMENTS)
    # flush: Inductor's compile workers are forked and would print an unflushed buffer again
    print(f"varlen_attention_torch: {ref_s * 1e3:.1f} ms", flush=True)
    rows = slice(SEGMENTS[0][1], SEGMENTS[0][1] + SEGMENTS[1][1])
    for compiled in (False, True):
        name = "torch.compile(flex_attention)" if compiled else "flex_attention (eager)"
        try:
            packed, first, later = flex(SEGMENTS, compiled)
            alone, _, _ = flex(SEGMENTS[1:2], compiled, repeats=0)
            print(f"{name}: first call {first:.2f} s, then {later * 1e3:.1f} ms; segment 1 packed == alone "
                  f"bitwise: {torch.equal(packed[rows], alone)} (max |diff| {(packed[rows] - alone).abs().max():.2g}); "
                  f"max |flex - reference| {(packed - ref).abs().max():.2g}", flush=True)
        except Exception as e:  # noqa: BLE001 - reported: what the measurement is
            lines = [line for line in traceback.format_exc().splitlines() if "error:" in line]
            print(f"{name}: {type(e).__name__}: {lines[0].strip() if lines else str(e).splitlines()[0]}", flush=True)
    try:
        from torch.nn.attention.varlen import varlen_attn
        cu = torch.tensor([0, 4], dtype=torch.int32)
        varlen_attn(torch.randn(4, 2, 16), torch.randn(4, 2, 16), torch.randn(4, 2, 16), cu, cu, 4, 4)
        print("torch varlen_attn: runs on CPU")
    except Exception as e:  # noqa: BLE001
        print(f"torch varlen_attn on CPU: {type(e).__name__}: {str(e).splitlines()[0][:120]}")


if __name__ == "__main__":
    main()
