"""Batch-invariant linear layers: each batch row computed with the shapes it has alone.

A GEMM library picks its kernel by the problem's shape: on x86 CPUs a 1–3 row `F.linear`
(M = rows) takes another path than a larger one, so a row's bits can depend on how many rows share
its matmul. Inside `batch_invariant_linear()`, `F.linear` on a `[B, L, K]` input with B > 1 runs as
a batched GEMM of B problems of shape `[L, K]` — the problem each sequence poses alone — so every
sequence's result is the one `remask.generate` computes for it alone, whatever else is in the batch.
Measured bitwise on the shipped tiny models at one intra-op thread (`tests/test_engine.py`); with
several threads a batched GEMM may split the work otherwise than a single one, so the engine runs
its batched forwards on one thread when `batch_invariant=True` on CPU.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


class _PerSequenceLinear(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if x.dim() == 3 and x.shape[0] > 1:
                w_t = weight.t().expand(x.shape[0], *weight.t().shape)
                if bias is None:
                    return torch.bmm(x, w_t)
                # addmm alone adds the bias inside the GEMM (C = bias; C += x·Wᵀ): the same here
                return torch.baddbmm(bias.expand(x.shape[0], x.shape[1], -1), x, w_t)
        return func(*args, **kwargs)


@contextlib.contextmanager
def batch_invariant_linear(enabled: bool = True, single_thread: bool = True) -> Iterator[None]:
    """Run the block's forwards with per-sequence linear layers (and, on CPU, one intra-op thread)."""
    if not enabled:
        yield
        return
    threads = torch.get_num_threads()
    if single_thread and threads != 1:
        torch.set_num_threads(1)
    try:
        with _PerSequenceLinear():
            yield
    finally:
        if single_thread and threads != 1:
            torch.set_num_threads(threads)
