"""Where one `varlen_attention` call's time goes on a GPU (issue 47): the call with tensors, with the
`VarlenPlan` a runner makes once per step, its checks and tile list alone, and today's four
`paged_attention` calls; host µs per call (no sync between calls), wall µs, device syncs per call
(`torch.cuda.set_sync_debug_mode`), then the kernels' own CUDA time (`torch.profiler`). The shape is
bench/test_varlen_attention.py's (4 requests × 32 fresh rows after 61 / 200 / 333 / 517 cached
positions, bf16 on a GPU). bench/results/gpu-h200-2026-11-29.md has the H200's figures.

    python bench/varlen_call_time.py            # on a GPU (on CPU: the torch references, 2 calls each)
"""
from __future__ import annotations

import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_varlen_attention import inputs, per_request, with_plan  # noqa: E402

from remask.kernels.varlen_attention import _check, query_tiles, varlen_attention, varlen_attention_triton  # noqa: E402


def main() -> None:
    on_gpu = torch.cuda.is_available()
    a = inputs(torch.bfloat16 if on_gpu else torch.float32)
    checks = ("q", "k", "v", "cu_seqlens", "k_cache", "v_cache", "block_table", "cache_lens", "block_sizes")
    pieces = {
        "varlen_attention, tensors": lambda: varlen_attention(**a),
        "varlen_attention, plan per step": with_plan(a),
        "its launcher alone (varlen_attention_triton)": lambda: varlen_attention_triton(
            *(a[n] for n in checks), None, None, a["q"].shape[-1] ** -0.5),
        "its checks alone (_check)": lambda: _check(*(a[n] for n in checks), None, None),
        "query_tiles alone": lambda: query_tiles(a["cu_seqlens"], a["q"].shape[0], 32),
        "four paged_attention calls": lambda: per_request(a),
    }
    if not on_gpu:
        pieces.pop("its launcher alone (varlen_attention_triton)")    # Triton needs CUDA (or the interpreter)
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    iters = 50 if on_gpu else 2
    print(f"{'piece':46s} {'host µs/call':>13s} {'wall µs/call':>13s} {'syncs/call':>10s}")
    for name, fn in pieces.items():
        for _ in range(3):
            fn()
        sync()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        host = (time.perf_counter() - start) / iters
        sync()
        wall = (time.perf_counter() - start) / iters
        syncs = "-"
        if on_gpu:
            torch.cuda.set_sync_debug_mode("warn")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                fn()
            torch.cuda.set_sync_debug_mode("default")
            syncs = str(sum("synchroniz" in str(w.message) for w in caught))
        print(f"{name:46s} {host * 1e6:13.1f} {wall * 1e6:13.1f} {syncs:>10s}", flush=True)
    if on_gpu:
        from torch.profiler import ProfilerActivity, profile

        for name in ("varlen_attention, plan per step", "four paged_attention calls"):
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    pieces[name]()
                sync()
            print(f"\n{name}: kernels over 20 calls")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=6))


if __name__ == "__main__":
    main()
