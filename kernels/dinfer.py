"""dInfer's decoding step in two launches, no host sync between them (torch references in
`dinfer_ref.py`).

* `credit_confidence(logits, credit, masked, first, alpha, gamma, beta)` — one program per row of
  logits: a pass over V finds the raw argmax and its softmax probability (online softmax); a second
  pass decays the row's credit, adds the boost at that argmax, writes the credit back and finds the
  argmax x0 and probability conf of ``logits + alpha·log(1 + credit)``. float32 math (inputs
  upcast right after loading), no probabilities materialised.
* `dinfer_select(x, x0, conf, mask_id, rule, threshold, low_threshold)` — one program per row of a
  block: dInfer's threshold rule (clamped to the row's best) or its hierarchical rule (the best of
  every contiguous masked run: a run-id cumsum, then a forward and a reverse running max of (run id,
  confidence) packed into one int64 — a segmented max scan in O(L), blocks up to 1024 positions),
  written into x in place.

Each dispatcher runs Triton on CUDA (or with ``REMASK_TRITON=1``) and the torch reference otherwise.
Interpreter-tested against the references (tests/test_kernel_dinfer.py); never compiled or timed on
a GPU here. The CPU path (the references) is what reproduces dInfer's fixtures bit for bit; on a GPU
the kernels' sums run in another order, so a confidence can differ in its last bits from upstream's
torch ones (a threshold decision moves only on such a near-tie).
"""
from __future__ import annotations

import torch

from .dinfer_ref import SELECT_RULES, credit_confidence_torch, dinfer_select_torch
from .dispatch import HAS_TRITON, next_power_of_2, use_triton

MAX_SELECT_L = 1024

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .reductions import argmax_lowest, online_softmax, order_key32, running_argmax

    @triton.jit
    def _max_combine(a, b):
        return tl.maximum(a, b)

    @triton.jit
    def credit_confidence_kernel(logits_ptr, stride_row, credit_ptr, masked_ptr, x0_ptr, conf_ptr, V,
                                 first, alpha, gamma, beta, BLOCK_V: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride_row
        cbase = credit_ptr + row * V
        cols0 = tl.arange(0, BLOCK_V)
        # pass 1: the raw argmax and its probability
        m = float("-inf")
        s = 0.0
        t = 0.0
        best = float("-inf")
        best_i = -1
        for start in range(0, V, BLOCK_V):
            cols = start + cols0
            ok = cols < V
            x = tl.load(base + cols, mask=ok, other=float("-inf")).to(tl.float32)
            cmax, cidx = argmax_lowest(x, cols, ok)
            m, s, t = online_softmax(m, s, t, x, cmax, False)
            best, best_i = running_argmax(best, best_i, cmax, cidx)
        p_top = 1.0 / s
        is_masked = tl.load(masked_ptr + row) != 0
        boost = tl.where(is_masked, tl.exp(gamma * tl.log(p_top)), 0.0)
        # pass 2: decay, boost, fuse; the fused argmax and its probability
        m2 = float("-inf")
        s2 = 0.0
        t2 = 0.0
        best2 = float("-inf")
        best2_i = -1
        for start in range(0, V, BLOCK_V):
            cols = start + cols0
            ok = cols < V
            x = tl.load(base + cols, mask=ok, other=float("-inf")).to(tl.float32)
            c = tl.load(cbase + cols, mask=ok, other=0.0)
            c = tl.where(first != 0, c, c * beta)
            c = c + tl.where(cols == best_i, boost, 0.0)
            tl.store(cbase + cols, c, mask=ok)
            f = tl.where(ok, x + alpha * tl.log(c + 1.0), float("-inf"))
            cmax, cidx = argmax_lowest(f, cols, ok)
            m2, s2, t2 = online_softmax(m2, s2, t2, f, cmax, False)
            best2, best2_i = running_argmax(best2, best2_i, cmax, cidx)
        tl.store(x0_ptr + row, best2_i.to(tl.int64))
        tl.store(conf_ptr + row, 1.0 / s2)

    @triton.jit
    def dinfer_select_kernel(x_ptr, stride_x, x0_ptr, stride_x0, conf_ptr, stride_conf, L, mask_id,
                             threshold, low_threshold, HIERARCHY: tl.constexpr, HAS_HIGH: tl.constexpr,
                             HAS_LOW: tl.constexpr, BLOCK_L: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        idx = tl.arange(0, BLOCK_L)
        ok = idx < L
        x = tl.load(x_ptr + row * stride_x + idx, mask=ok, other=0)
        x0 = tl.load(x0_ptr + row * stride_x0 + idx, mask=ok, other=0)
        conf = tl.load(conf_ptr + row * stride_conf + idx, mask=ok, other=0.0).to(tl.float32)
        masked = (x == mask_id) & ok
        if HIERARCHY:
            floor = -3.4028234663852886e38   # torch.finfo(float32).min, as the reference
            c = tl.where(masked, conf, floor)
            # run id of each position: the number of masked runs started at or before it
            prev = tl.load(x_ptr + row * stride_x + idx - 1, mask=ok & (idx > 0), other=-1) == mask_id
            starts = (masked & ~prev).to(tl.int32)
            # segmented running maxima as plain ones: (run id, c's order key) packed into one int64
            # (run ids ascend along the row, so a max over a prefix stays in the position's run;
            # reversed ids for the suffix). Unmasked lanes carry key 0, below every masked one.
            run = tl.cumsum(starts, axis=0)
            low = tl.where(masked, order_key32(c).to(tl.int64) + 2147483648, 0)
            pre = tl.associative_scan((run.to(tl.int64) << 32) | low, 0, _max_combine)
            suf = tl.associative_scan(((BLOCK_L - run).to(tl.int64) << 32) | low, 0, _max_combine, reverse=True)
            run_max = tl.maximum(pre & 4294967295, suf & 4294967295)
            # the reference's max also holds the float32 floor: a -inf confidence never commits here
            commit = masked & (low == run_max) & (c > float("-inf"))
            if HAS_LOW:
                commit = commit & (c > low_threshold)
            if HAS_HIGH:
                commit = commit | (c > threshold)
            _, top = argmax_lowest(c, idx, ok)
            commit = (commit | (idx == top)) & masked
        else:
            candidates = masked & (x0 != mask_id)
            c = tl.where(candidates, conf, float("-inf"))
            bar = tl.max(c, axis=0) - 1e-5
            bar = tl.minimum(tl.maximum(bar, -1000.0), threshold)
            commit = candidates & (c >= bar)
        tl.store(x_ptr + row * stride_x + idx, tl.where(commit, x0, x), mask=ok)


def _check_credit(logits: torch.Tensor, credit: torch.Tensor, masked: torch.Tensor) -> None:
    if logits.dim() != 3 or not logits.is_floating_point():
        raise ValueError(f"logits must be a floating tensor [B, L, V], got {tuple(logits.shape)} {logits.dtype}")
    if credit.shape != logits.shape or credit.dtype != torch.float32 or not credit.is_contiguous():
        raise ValueError(f"credit must be a contiguous float32 tensor of the logits' shape {tuple(logits.shape)}")
    if masked.shape != logits.shape[:2] or masked.dtype != torch.bool:
        raise ValueError(f"masked must be a bool tensor {tuple(logits.shape[:2])}")


def credit_confidence_triton(logits: torch.Tensor, credit: torch.Tensor, masked: torch.Tensor, first: bool,
                             alpha: float, gamma: float, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    B, L, V = logits.shape
    rows = logits.reshape(B * L, V)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    x0 = torch.empty(B * L, dtype=torch.long, device=logits.device)
    conf = torch.empty(B * L, dtype=torch.float32, device=logits.device)
    block_v = min(4096, next_power_of_2(V))
    credit_confidence_kernel[(B * L,)](rows, rows.stride(0), credit, masked.reshape(-1).to(torch.int8), x0, conf, V,
                                       int(first), float(alpha), float(gamma), float(beta), BLOCK_V=block_v)
    return x0.view(B, L), conf.view(B, L)


def credit_confidence(logits: torch.Tensor, credit: torch.Tensor, masked: torch.Tensor, first: bool, alpha: float,
                      gamma: float, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """dInfer's credit step (see the module docstring); `credit` is updated in place."""
    _check_credit(logits, credit, masked)
    if use_triton(logits):
        return credit_confidence_triton(logits, credit, masked, first, alpha, gamma, beta)
    return credit_confidence_torch(logits, credit, masked, first, alpha, gamma, beta)


def dinfer_select_triton(x: torch.Tensor, x0: torch.Tensor, conf: torch.Tensor, mask_id: int, rule: str,
                         threshold: float | None, low_threshold: float | None = None) -> torch.Tensor:
    B, L = x.shape
    hierarchy = rule == "hierarchy"
    dinfer_select_kernel[(B,)](x, x.stride(0), x0, x0.stride(0), conf, conf.stride(0), L, int(mask_id),
                               float(threshold if threshold is not None else 0.0),
                               float(low_threshold if low_threshold is not None else 0.0),
                               HIERARCHY=hierarchy, HAS_HIGH=threshold is not None,
                               HAS_LOW=low_threshold is not None, BLOCK_L=max(16, next_power_of_2(L)))
    return x


def dinfer_select(x: torch.Tensor, x0: torch.Tensor, conf: torch.Tensor, mask_id: int, rule: str,
                  threshold: float | None, low_threshold: float | None = None) -> torch.Tensor:
    """One step's commit on each row of `x` `[B, L]` (in place; see the module docstring)."""
    if rule not in SELECT_RULES:
        raise ValueError(f"rule must be one of {list(SELECT_RULES)}, got {rule!r}")
    if x.dim() != 2 or x.dtype != torch.long or x0.shape != x.shape or x0.dtype != torch.long:
        raise ValueError(f"x and x0 must be LongTensors [B, L] of one shape, got {tuple(x.shape)} / {tuple(x0.shape)}")
    if conf.shape != x.shape or conf.dtype != torch.float32:
        raise ValueError(f"conf must be a float32 tensor {tuple(x.shape)}, got {tuple(conf.shape)} {conf.dtype}")
    if rule == "threshold" and threshold is None:
        raise ValueError("threshold: the threshold rule needs one")
    if x.stride(1) != 1 or x0.stride(1) != 1 or conf.stride(1) != 1:
        raise ValueError("x, x0 and conf must have unit stride along L")
    if use_triton(x) and x.shape[1] <= MAX_SELECT_L:
        return dinfer_select_triton(x, x0, conf, mask_id, rule, threshold, low_threshold)
    return dinfer_select_torch(x, x0, conf, mask_id, rule, threshold, low_threshold)
