"""Fused canvas kernels for uniform-noise diffusion (DiffusionGemma), with the torch reference in
`canvas_ref`.

* `canvas_score(logits, temperature)` → (sample, argmax, entropy, top_prob): one pass over the vocabulary per
  row of `[N, V]` logits (bf16/fp16/fp32 in, upcast right after the load, float32 math), under
  softmax(l / T). It keeps the running Gumbel-max of x + g (Philox `tl.rand` at ``row·V + col``, or
  injected uniforms), the running argmax of x (lower index first), and the online-softmax
  statistics m, Σ e^(x−m), Σ e^(x−m)(x−m), from which H = log Σ − Σe(x−m)/Σ and p(argmax) =
  1/Σ. Nothing `[N, V]` is
  written: no tempered copy, no softmax, no probabilities for `torch.multinomial`.
* `canvas_update(sample, entropy, entropy_bound, vocab_size)` → (new canvas, accepted): the
  EB-sampler decision and the renoise in one launch, one program per row: the entropies (≥ 0, so
  their float bits order as integers) are packed with their position into int64 keys and sorted
  (ties by position), a prefix sum gives each position the entropy accepted before it, accepted
  positions take their sample and the others a Philox uniform token (``randint % V``), scattered
  back by position.

`canvas_score` / `canvas_update` dispatch: Triton on CUDA (or ``REMASK_TRITON=1``), the torch
reference otherwise; seeded, the reference draws the same Philox numbers (`remask.kernels.philox`)
at the same offsets, so a seed gives the same samples and canvas on either path.
"""
from __future__ import annotations

import torch

from .canvas_ref import canvas_score_torch, canvas_update_torch, seed_groups
from .dispatch import HAS_TRITON, next_power_of_2, use_triton

LOGIT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .reductions import argmax_lowest, online_softmax, running_argmax

    @triton.jit
    def canvas_score_kernel(
        logits_ptr, stride_row, V, temperature,
        noise_ptr, stride_noise, seed, seeds_ptr, rows_per_seed,
        sample_ptr, argmax_ptr, entropy_ptr, top_prob_ptr,
        BLOCK: tl.constexpr, NOISE: tl.constexpr,
    ):
        """Program i: row i of logits `[N, V]` (V contiguous). NOISE: 1 injected uniforms `[N, V]`,
        2 Philox from `seed`, 3 Philox from `seeds[i // rows_per_seed]` at the row's place in its
        group (counted as alone). Writes sample, argmax (int64), entropy and the argmax's probability
        (float32) of row i."""
        row = tl.program_id(0).to(tl.int64)
        counter_row = row
        if NOISE == 3:
            seed = tl.load(seeds_ptr + row // rows_per_seed)
            counter_row = row % rows_per_seed
        p_row = logits_ptr + row * stride_row
        neg_inf = float("-inf")
        m = tl.full((), neg_inf, tl.float32)
        s = tl.zeros((), tl.float32)
        t = tl.zeros((), tl.float32)
        best = tl.full((), neg_inf, tl.float32)
        best_idx = tl.full((), -1, tl.int32)
        top = tl.full((), neg_inf, tl.float32)
        top_idx = tl.full((), -1, tl.int32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            in_v = cols < V
            x = tl.load(p_row + cols, mask=in_v, other=neg_inf).to(tl.float32) / temperature
            if NOISE == 1:
                u = tl.load(noise_ptr + row * stride_noise + cols, mask=in_v, other=0.5).to(tl.float32)
            else:
                u = tl.rand(seed, counter_row * V + cols)
            score = tl.where(in_v, x - tl.log(-tl.log(u)), neg_inf)
            # running Gumbel-max and plain argmax, the lower index first (strict > across chunks)
            c_best, c_idx = argmax_lowest(score, cols, in_v)
            best, best_idx = running_argmax(best, best_idx, c_best, c_idx)
            c_top, c_top_idx = argmax_lowest(x, cols, in_v)
            top, top_idx = running_argmax(top, top_idx, c_top, c_top_idx)
            m, s, t = online_softmax(m, s, t, x, c_top, True)
        tl.store(sample_ptr + row, best_idx.to(tl.int64))
        tl.store(argmax_ptr + row, top_idx.to(tl.int64))
        tl.store(entropy_ptr + row, tl.maximum(tl.log(s) - t / s, 0.0))
        tl.store(top_prob_ptr + row, 1.0 / s)   # p(argmax) = e^(m − m) / Σ

    @triton.jit
    def canvas_update_kernel(
        sample_ptr, entropy_ptr, noise_ptr, out_ptr, accepted_ptr,
        L, entropy_bound, seed, seeds_ptr, V,
        BLOCK_L: tl.constexpr, NOISE: tl.constexpr,
    ):
        """Program b: row b of the `[B, L]` canvas (all contiguous). NOISE: 1 injected token ids
        `[B, L]`, 2 Philox from `seed` at offset ``b·L + position``, 3 from `seeds[b]` at ``position``
        (row b as alone)."""
        row = tl.program_id(0).to(tl.int64)
        pos = tl.arange(0, BLOCK_L)
        valid = pos < L
        # padding sorts last (the largest finite float), then counts 0 in the prefix sums
        e = tl.load(entropy_ptr + row * L + pos, mask=valid, other=3.0e38).to(tl.float32)
        e = tl.maximum(e, 0.0)   # −0.0 and rounding below zero would break the integer order
        bits = e.to(tl.int32, bitcast=True).to(tl.int64)
        key = tl.sort((bits << 32) | pos.to(tl.int64))   # ascending entropy, then position
        idx = (key & 0xFFFFFFFF).to(tl.int32)
        live = idx < L
        e_sorted = tl.where(live, (key >> 32).to(tl.int32).to(tl.float32, bitcast=True), 0.0)
        before = tl.cumsum(e_sorted, axis=0) - e_sorted
        accepted = (before <= entropy_bound) & live
        offs = row * L + idx
        sample = tl.load(sample_ptr + offs, mask=live, other=0)
        if NOISE == 1:
            noise = tl.load(noise_ptr + offs, mask=live, other=0)
        elif NOISE == 2:
            r = tl.randint(seed, offs).to(tl.int64) & 0xFFFFFFFF
            noise = r % V
        else:
            r = tl.randint(tl.load(seeds_ptr + row), idx.to(tl.int64)).to(tl.int64) & 0xFFFFFFFF
            noise = r % V
        tl.store(out_ptr + offs, tl.where(accepted, sample.to(tl.int64), noise.to(tl.int64)), mask=live)
        tl.store(accepted_ptr + offs, accepted.to(tl.int8), mask=live)


def _check_score(logits, temperature, noise, seed):
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError(f"logits must be a 2-D tensor [N, V], got shape {getattr(logits, 'shape', None)}")
    if logits.dtype not in LOGIT_DTYPES:
        raise TypeError(f"logits dtype must be one of {[str(d) for d in LOGIT_DTYPES]}, got {logits.dtype}")
    if logits.shape[1] == 0 or logits.stride(1) != 1:
        raise ValueError("logits must have a non-empty vocabulary axis, contiguous (stride(1) == 1)")
    if not float(temperature) > 0:
        raise ValueError(f"temperature must be > 0, got {float(temperature)}")
    if noise is not None and (noise.shape != logits.shape or noise.device != logits.device or noise.stride(1) != 1):
        raise ValueError(f"noise must be uniforms of logits' shape {tuple(logits.shape)} on its device, V contiguous")
    if seed is not None and not isinstance(seed, int) and not torch.is_tensor(seed):
        raise TypeError(f"seed must be an int or an int64 tensor of seeds, got {type(seed).__name__}")


def canvas_score(
    logits: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    *,
    noise: torch.Tensor | None = None,
    seed: int | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sample, argmax, entropy, top_prob) per row of `logits` `[N, V]` under softmax(l / T), one pass.

    Args:
        logits: `[N, V]` float32/float16/bfloat16, V contiguous (rows may be strided).
        temperature: T > 0 (a float, or a 0-dim tensor as transformers' schedule makes it).
        noise: uniforms in (0, 1) of logits' shape for exact tests; otherwise Philox noise from
            `seed` at ``row·V + col`` (`tl.rand`, or its torch twin on the torch path: the same
            draws and float32 score). None draws a seed from torch's global generator. An int64
            tensor `[G]` (G dividing N): G equal groups of rows, each drawing from its own seed as
            a call on its rows alone (requests scored in one call, each its own numbers).

    Returns:
        sample, argmax (int64 `[N]`; the lower index on ties), entropy and the argmax's
        probability (float32 `[N]`).
    """
    _check_score(logits, temperature, noise, seed)
    if noise is None and seed is None:
        seed = int(torch.randint(0, 2**31 - 1, ()).item())
    seed = seed_groups(seed, logits.shape[0], logits.device) if noise is None else seed
    temperature = float(temperature) if not torch.is_tensor(temperature) else temperature
    if not use_triton(logits):
        return canvas_score_torch(logits, temperature, noise=noise, seed=seed)
    n_rows, V = logits.shape
    seeds = seed if torch.is_tensor(seed) else None
    sample = torch.empty(n_rows, dtype=torch.long, device=logits.device)
    argmax = torch.empty(n_rows, dtype=torch.long, device=logits.device)
    entropy = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    top_prob = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    if n_rows:
        block = min(4096, next_power_of_2(V))
        canvas_score_kernel[(n_rows,)](
            logits, logits.stride(0), V, float(temperature),
            noise if noise is not None else logits, noise.stride(0) if noise is not None else 0,
            int(seed) if noise is None and seeds is None else 0, seeds if seeds is not None else sample,
            n_rows // seeds.numel() if seeds is not None else 1,
            sample, argmax, entropy, top_prob, BLOCK=block, NOISE=1 if noise is not None else 2 if seeds is None else 3,
            num_warps=8 if block >= 2048 else 4)
    return sample, argmax, entropy, top_prob


def canvas_update(
    sample: torch.Tensor,
    entropy: torch.Tensor,
    entropy_bound: float,
    *,
    vocab_size: int,
    noise_tokens: torch.Tensor | None = None,
    seed: int | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The EB-sampler's accept and the renoise of a `[B, L]` canvas in one launch.

    Args:
        sample: `[B, L]` int64, each position's sample.
        entropy: `[B, L]` float32 entropies (the tempered distribution's).
        entropy_bound: accept, per row, the lowest-entropy positions while the entropies accepted
            before each one sum to ≤ this (> 0).
        vocab_size: renoised positions draw uniformly from [0, vocab_size).
        noise_tokens: `[B, L]` ids to use instead of draws (exact tests); otherwise Philox from
            `seed`, ``randint(seed, b·L + position) % V`` on either path; an int64 tensor `[B]` of
            seeds: ``randint(seed[b], position) % V``, row b as alone.

    Returns:
        the new canvas (int64 `[B, L]`) and the accepted mask (bool `[B, L]`).
    """
    if sample.dim() != 2 or entropy.shape != sample.shape:
        raise ValueError(f"sample and entropy must be [B, L] of one shape, got {tuple(sample.shape)} and "
                         f"{tuple(entropy.shape)}")
    if not entropy_bound > 0:
        raise ValueError(f"entropy_bound must be > 0, got {entropy_bound}")
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
    if noise_tokens is not None and noise_tokens.shape != sample.shape:
        raise ValueError(f"noise_tokens must have sample's shape {tuple(sample.shape)}, got {tuple(noise_tokens.shape)}")
    if noise_tokens is None and seed is None:
        seed = int(torch.randint(0, 2**31 - 1, ()).item())
    if noise_tokens is None:
        seed = seed_groups(seed, sample.shape[0], sample.device)
        if torch.is_tensor(seed) and seed.numel() != sample.shape[0]:
            raise ValueError(f"seed: one per row of the canvas ({sample.shape[0]}), got {seed.numel()}")
    if not use_triton(sample):
        return canvas_update_torch(sample, entropy, entropy_bound, vocab_size=vocab_size, noise_tokens=noise_tokens,
                                   seed=seed)
    B, L = sample.shape
    sample, entropy = sample.contiguous(), entropy.to(torch.float32).contiguous()
    out = torch.empty((B, L), dtype=torch.long, device=sample.device)
    accepted = torch.empty((B, L), dtype=torch.int8, device=sample.device)
    if B and L:
        canvas_update_kernel[(B,)](
            sample, entropy, noise_tokens.contiguous() if noise_tokens is not None else sample, out, accepted,
            L, float(entropy_bound), int(seed) if noise_tokens is None and not torch.is_tensor(seed) else 0,
            seed if torch.is_tensor(seed) else sample, vocab_size,
            BLOCK_L=next_power_of_2(L), NOISE=1 if noise_tokens is not None else 2 if not torch.is_tensor(seed) else 3)
    return out, accepted.bool()
