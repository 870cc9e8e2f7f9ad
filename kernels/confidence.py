"""Fused confidence scoring over the vocabulary: logits → (x0, confidence of x0), one pass.

Per selected row of logits `[N, V]` the kernel streams the vocabulary once, in float32, keeping

* the running argmax of the selection score ``l + T·g`` (g = Gumbel noise, Philox `tl.rand` from a
  seed or injected uniforms; plain logits at T=0), the lower index winning ties, over the tokens
  not in ``argmax_ids``;
* online-softmax statistics of the untempered logits with ``softmax_ids`` removed: running max m,
  Σ exp(l − m) and Σ exp(l − m)·(l − m) (for the entropy), and the runner-up value (for the
  margin).

From those: ``prob`` = exp(l[x0] − m)/Σ, ``margin`` = (1 − exp(l2 − m))/Σ, ``neg_entropy`` =
Σ e(l − m)/Σ − log Σ. Nothing of size `[N, V]` is ever written. When rows are few (a 32-position
block) the vocabulary is split over several programs per row, each writing its partial state, and
a small combine kernel merges them (flash-decoding style). Configurations are a plain function of
the shape (`confidence_config`), never autotuned.

`confidence` is the dispatcher: Triton on CUDA (or when ``REMASK_TRITON=1``), the float64 torch
reference of `confidence_ref` otherwise. Seeded, both draw the same Philox numbers
(`remask.kernels.philox`) at the same offsets and form the same float32 selection score.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .confidence_ref import (CONFIDENCE_MODES, combine_partials_torch, confidence_partials_torch, confidence_torch,
                             id_tensor)
from .dispatch import HAS_TRITON, next_power_of_2, use_triton

LOGIT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MODE_CODE = {mode: code for code, mode in enumerate(CONFIDENCE_MODES)}
NO_NOISE, TENSOR_NOISE, PHILOX_NOISE = 0, 1, 2

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .reductions import argmax_lowest, online_softmax, running_argmax

    @triton.jit
    def _hits(cols, ids_ptr, n_ids):
        """[BLOCK] bool: which of `cols` are in the id list."""
        hit = cols < 0
        for j in range(n_ids):
            hit = hit | (cols == tl.load(ids_ptr + j))
        return hit

    @triton.jit
    def _finalize(m, s, t, x0_logit, second, MODE: tl.constexpr):
        if MODE == 0:  # prob
            conf = tl.exp(x0_logit - m) / s
        elif MODE == 1:  # margin: p1 − p2, p1 = exp(m − m)/s
            conf = (1.0 - tl.exp(second - m)) / s
        else:  # neg_entropy
            conf = t / s - tl.log(s)
        return conf

    @triton.jit
    def confidence_fwd_kernel(
        logits_ptr, stride_row, V, vocab_start, vocab_size,
        rows_ptr,
        noise_ptr, stride_noise, seed, temperature,
        argmax_ids_ptr, n_argmax_ids, softmax_ids_ptr, n_softmax_ids,
        part_ptr, part_idx_ptr, n_rows,
        x0_ptr, conf_ptr,
        BLOCK: tl.constexpr, SPLIT_BLOCKS: tl.constexpr, NUM_SPLITS: tl.constexpr, MODE: tl.constexpr,
        HAS_ROWS: tl.constexpr, NOISE: tl.constexpr, HAS_ARGMAX_IDS: tl.constexpr, HAS_SOFTMAX_IDS: tl.constexpr,
        WRITE_PARTIAL: tl.constexpr,
    ):
        """Program (i, j): output row i, vocabulary split j.

        logits `[*, V]` (row stride `stride_row`, V contiguous; fp32/fp16/bf16, upcast on load),
        rows `[n_rows]` int64 (HAS_ROWS), noise `[*, V]` uniforms (NOISE == 1), id lists int64.
        Not WRITE_PARTIAL: writes x0 `[n_rows]` int64 and conf `[n_rows]`; otherwise writes the
        partial state part `[6, n_rows, NUM_SPLITS]` fp32 (m, Σe, Σe(l−m), best score, logit at
        best, runner-up) and part_idx `[n_rows, NUM_SPLITS]` int32 for the combine kernel.
        A vocabulary shard (tensor parallel) holds the global columns `vocab_start + [0, V)` of
        `vocab_size`: ids, indices and Philox offsets are global, so the draws are the whole row's.
        """
        i_row = tl.program_id(0).to(tl.int64)
        i_split = tl.program_id(1)
        if HAS_ROWS:
            row = tl.load(rows_ptr + i_row).to(tl.int64)
        else:
            row = i_row
        p_row = logits_ptr + row * stride_row
        neg_inf = float("-inf")
        m = tl.full((), neg_inf, tl.float32)
        s = tl.zeros((), tl.float32)
        t = tl.zeros((), tl.float32)
        second = tl.full((), neg_inf, tl.float32)
        best = tl.full((), neg_inf, tl.float32)
        best_logit = tl.full((), neg_inf, tl.float32)
        best_idx = tl.full((), -1, tl.int32)
        start = i_split * (SPLIT_BLOCKS * BLOCK)
        for b in range(SPLIT_BLOCKS):
            cols = start + b * BLOCK + tl.arange(0, BLOCK)
            in_v = cols < V
            gcols = cols + vocab_start   # global token ids
            l = tl.load(p_row + cols, mask=in_v, other=neg_inf).to(tl.float32)  # upcast first (bf16)
            l_arg = l
            l_soft = l
            if HAS_ARGMAX_IDS:
                l_arg = tl.where(_hits(gcols, argmax_ids_ptr, n_argmax_ids), neg_inf, l)
            if HAS_SOFTMAX_IDS:
                l_soft = tl.where(_hits(gcols, softmax_ids_ptr, n_softmax_ids), neg_inf, l)
            # Selection: running argmax of l + T·g, lowest index first (strict > across chunks).
            if NOISE == 1:
                u = tl.load(noise_ptr + row * stride_noise + cols, mask=in_v, other=0.5).to(tl.float32)
                score = tl.where(in_v, l_arg - temperature * tl.log(-tl.log(u)), neg_inf)
            elif NOISE == 2:
                u = tl.rand(seed, row * vocab_size + gcols)
                score = tl.where(in_v, l_arg - temperature * tl.log(-tl.log(u)), neg_inf)
            else:
                score = l_arg
            c_best, c_idx = argmax_lowest(score, gcols, in_v)
            c_logit = tl.max(tl.where(gcols == c_idx, l_soft, neg_inf), axis=0)
            take = (c_best > best) | (best_idx < 0)   # running_argmax's rule, carrying the logit too
            best, best_idx = running_argmax(best, best_idx, c_best, c_idx)
            best_logit = tl.where(take, c_logit, best_logit)
            # Online softmax statistics of the untempered logits.
            c_max = tl.max(l_soft, axis=0)
            if MODE == 1:
                c_arg = argmax_lowest(l_soft, cols, in_v)[1]
                c_second = tl.max(tl.where(cols == c_arg, neg_inf, l_soft), axis=0)
                second = tl.maximum(tl.minimum(m, c_max), tl.maximum(second, c_second))
            m, s, t = online_softmax(m, s, t, l_soft, c_max, MODE == 2)
        if not WRITE_PARTIAL:
            tl.store(x0_ptr + i_row, best_idx.to(tl.int64))
            conf = _finalize(m, s, t, best_logit, second, MODE)
            tl.store(conf_ptr + i_row, conf.to(conf_ptr.dtype.element_ty))
        else:
            plane = n_rows * NUM_SPLITS
            p = part_ptr + i_row * NUM_SPLITS + i_split
            tl.store(p, m)
            tl.store(p + plane, s)
            tl.store(p + 2 * plane, t)
            tl.store(p + 3 * plane, best)
            tl.store(p + 4 * plane, best_logit)
            tl.store(p + 5 * plane, second)
            tl.store(part_idx_ptr + i_row * NUM_SPLITS + i_split, best_idx)

    @triton.jit
    def confidence_combine_kernel(part_ptr, part_idx_ptr, n_rows, x0_ptr, conf_ptr,
                                  NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, MODE: tl.constexpr):
        """Program i merges the NUM_SPLITS partial states of output row i (layout as above)."""
        i_row = tl.program_id(0).to(tl.int64)
        neg_inf = float("-inf")
        j = tl.arange(0, SPLITS_P2)
        valid = j < NUM_SPLITS
        plane = n_rows * NUM_SPLITS
        p = part_ptr + i_row * NUM_SPLITS + j
        m_j = tl.load(p, mask=valid, other=neg_inf)
        s_j = tl.load(p + plane, mask=valid, other=0.0)
        t_j = tl.load(p + 2 * plane, mask=valid, other=0.0)
        best_j = tl.load(p + 3 * plane, mask=valid, other=neg_inf)
        logit_j = tl.load(p + 4 * plane, mask=valid, other=neg_inf)
        second_j = tl.load(p + 5 * plane, mask=valid, other=neg_inf)
        idx_j = tl.load(part_idx_ptr + i_row * NUM_SPLITS + j, mask=valid, other=2147483647)
        # argmax: the best score, the lowest index among equal scores (splits cover ascending ranges)
        x0 = argmax_lowest(best_j, idx_j, valid)[1]
        x0_logit = tl.max(tl.where(idx_j == x0, logit_j, neg_inf), axis=0)
        # softmax statistics rescaled to the global max
        m = tl.max(m_j, axis=0)
        live = s_j > 0
        dm = tl.where(live, m_j - m, 0.0)
        scale = tl.where(live, tl.exp(dm), 0.0)
        s = tl.sum(s_j * scale, axis=0)
        t = tl.sum(scale * (t_j + dm * s_j), axis=0)
        # runner-up value: the best of every split's runner-up and every split max but one copy of m
        first_max = tl.min(tl.where((m_j == m) & valid, j, SPLITS_P2), axis=0)
        second = tl.maximum(tl.max(second_j, axis=0), tl.max(tl.where(j == first_max, neg_inf, m_j), axis=0))
        tl.store(x0_ptr + i_row, x0.to(tl.int64))
        conf = _finalize(m, s, t, x0_logit, second, MODE)
        tl.store(conf_ptr + i_row, conf.to(conf_ptr.dtype.element_ty))


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (the interpreter gets 4: a few splits, cheaply)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def confidence_config(n_rows: int, V: int, num_sms: int) -> tuple[int, int, int, int]:
    """(BLOCK, split_blocks, num_splits, num_warps) for `n_rows` rows of width V on `num_sms` SMs.

    One program per row streams V in BLOCK chunks; when rows cannot fill the GPU (about 2
    programs per SM) the vocabulary is split so that rows × splits does.
    """
    block = min(4096, next_power_of_2(V))
    n_blocks = -(-V // block)
    wanted = max(1, -(-2 * num_sms // max(n_rows, 1)))
    num_splits = min(n_blocks, wanted)
    split_blocks = -(-n_blocks // num_splits)
    num_splits = -(-n_blocks // split_blocks)
    return block, split_blocks, num_splits, 8 if block >= 2048 else 4


def confidence_triton(
    logits: torch.Tensor,
    *,
    temperature: float = 0.0,
    mode: str = "prob",
    rows: torch.Tensor | None = None,
    argmax_ids: Sequence[int] | torch.Tensor | None = None,
    softmax_ids: Sequence[int] | torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
    seed: int | None = None,
    out_dtype: torch.dtype = torch.float32,
    num_splits: int | None = None,
    block: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the kernel (arguments as `confidence_torch`; checked by `confidence`).

    `num_splits` and `block` (a power of two) override the configuration (tests use them to
    exercise several chunks and splits at small V).
    """
    n_rows = rows.numel() if rows is not None else logits.shape[0]
    V = logits.shape[1]
    x0 = torch.empty(n_rows, dtype=torch.long, device=logits.device)
    conf = torch.empty(n_rows, dtype=out_dtype, device=logits.device)
    if n_rows == 0:
        return x0, conf
    block_cfg, split_blocks, splits, _ = confidence_config(n_rows, V, sm_count(logits.device))
    if block is not None or num_splits is not None:
        block = block or block_cfg
        n_blocks = -(-V // block)
        split_blocks = -(-n_blocks // max(1, min(num_splits or 1, n_blocks)))
        splits = -(-n_blocks // split_blocks)
    part, part_idx = _launch(logits, temperature, mode, rows, argmax_ids, softmax_ids, noise, seed,
                             block or block_cfg, split_blocks, splits, x0, conf, partial=splits > 1)
    if splits > 1:
        confidence_combine_kernel[(n_rows,)](part, part_idx, n_rows, x0, conf, NUM_SPLITS=splits,
                                             SPLITS_P2=next_power_of_2(splits), MODE=MODE_CODE[mode])
    return x0, conf


def _launch(logits, temperature, mode, rows, argmax_ids, softmax_ids, noise, seed, block, split_blocks, splits,
            x0=None, conf=None, vocab_start: int = 0, vocab_size: int | None = None, partial: bool = False):
    """One launch of `confidence_fwd_kernel` over `splits` programs per row of `split_blocks`
    blocks each; returns the partial state (part, part_idx) when `partial`, else dummies."""
    n_rows = rows.numel() if rows is not None else logits.shape[0]
    device = logits.device
    argmax_ids, softmax_ids = id_tensor(argmax_ids, device), id_tensor(softmax_ids, device)
    noise_kind = NO_NOISE if temperature == 0 else (TENSOR_NOISE if noise is not None else PHILOX_NOISE)
    dummy = torch.empty(1, dtype=torch.long, device=device)   # absent optional pointers (never read)
    if partial:
        part = torch.empty((6, n_rows, splits), dtype=torch.float32, device=device)
        part_idx = torch.empty((n_rows, splits), dtype=torch.int32, device=device)
    else:
        part, part_idx = dummy, dummy
    confidence_fwd_kernel[(n_rows, splits)](
        logits, logits.stride(0), logits.shape[1], int(vocab_start),
        int(vocab_size if vocab_size is not None else logits.shape[1]),
        rows if rows is not None else dummy,
        noise if noise_kind == TENSOR_NOISE else dummy,
        noise.stride(0) if noise_kind == TENSOR_NOISE else 0,
        int(seed) if noise_kind == PHILOX_NOISE else 0, float(temperature),
        argmax_ids if argmax_ids is not None else dummy, 0 if argmax_ids is None else argmax_ids.numel(),
        softmax_ids if softmax_ids is not None else dummy, 0 if softmax_ids is None else softmax_ids.numel(),
        part, part_idx, n_rows, x0 if x0 is not None else dummy, conf if conf is not None else dummy,
        BLOCK=block, SPLIT_BLOCKS=split_blocks, NUM_SPLITS=splits, MODE=MODE_CODE[mode],
        HAS_ROWS=rows is not None, NOISE=noise_kind, HAS_ARGMAX_IDS=argmax_ids is not None,
        HAS_SOFTMAX_IDS=softmax_ids is not None, WRITE_PARTIAL=partial,
        num_warps=8 if block >= 2048 else 4,
    )
    return part, part_idx


def confidence_partials_triton(
    logits: torch.Tensor, *, vocab_start: int, vocab_size: int, temperature: float = 0.0, mode: str = "prob",
    rows: torch.Tensor | None = None, argmax_ids=None, softmax_ids=None, noise: torch.Tensor | None = None,
    seed: int | None = None, num_splits: int = 1, block: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The partial state of a vocabulary shard (see `confidence_partials_torch`): part
    `[6, R, num_splits]` float32 and part_idx `[R, num_splits]` int32, split j covering the shard's
    j-th run of blocks. `num_splits` is the caller's, so every rank sends the same shape (splits
    past the shard's end report an empty state)."""
    n_rows = rows.numel() if rows is not None else logits.shape[0]
    if n_rows == 0:
        return (torch.empty((6, 0, num_splits), dtype=torch.float32, device=logits.device),
                torch.empty((0, num_splits), dtype=torch.int32, device=logits.device))
    block = block or confidence_config(n_rows, max(logits.shape[1], 1), sm_count(logits.device))[0]
    split_blocks = max(1, -(-(-(-logits.shape[1] // block)) // max(1, num_splits)))
    return _launch(logits, temperature, mode, rows, argmax_ids, softmax_ids, noise, seed, block, split_blocks,
                   num_splits, vocab_start=vocab_start, vocab_size=vocab_size, partial=True)


def combine_partials_triton(part: torch.Tensor, part_idx: torch.Tensor, mode: str = "prob",
                            out_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partial states `[6, R, S]` (ascending columns) with the combine kernel."""
    n_rows, splits = part_idx.shape
    x0 = torch.empty(n_rows, dtype=torch.long, device=part.device)
    conf = torch.empty(n_rows, dtype=out_dtype, device=part.device)
    if n_rows:
        confidence_combine_kernel[(n_rows,)](part.float().contiguous(), part_idx.to(torch.int32).contiguous(),
                                             n_rows, x0, conf, NUM_SPLITS=splits,
                                             SPLITS_P2=next_power_of_2(splits), MODE=MODE_CODE[mode])
    return x0, conf


def _check(logits, temperature, mode, rows, noise, seed, out_dtype, rows_in_bounds=False):
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError(f"logits must be a 2-D tensor [N, V], got shape {getattr(logits, 'shape', None)}")
    if logits.dtype not in LOGIT_DTYPES:
        raise TypeError(f"logits dtype must be one of {[str(d) for d in LOGIT_DTYPES]}, got {logits.dtype}")
    if logits.shape[1] == 0:
        raise ValueError("logits must have a non-empty vocabulary axis (V > 0)")
    if logits.stride(1) != 1:
        raise ValueError("logits must be contiguous along the vocabulary axis (stride(1) == 1); rows may be strided")
    if mode not in CONFIDENCE_MODES:
        raise ValueError(f"mode must be one of {list(CONFIDENCE_MODES)}, got {mode!r}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if out_dtype not in (torch.float32, torch.float64):
        raise TypeError(f"out_dtype must be torch.float32 or torch.float64, got {out_dtype}")
    if rows is not None:
        if rows.dim() != 1 or rows.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"rows must be a 1-D int32/int64 index tensor, got {rows.dtype} of shape {tuple(rows.shape)}")
        if rows.device != logits.device:
            raise ValueError(f"rows is on {rows.device} but logits on {logits.device}")
        # Off CUDA a bad row would be read silently (the interpreter) or wrap (negative indices), so
        # the values are checked there, unless the caller built `rows` itself (a decoder's block rows).
        if not rows_in_bounds and not rows.is_cuda and rows.numel() and \
                not (0 <= int(rows.min()) and int(rows.max()) < logits.shape[0]):
            raise IndexError(f"rows must index logits' {logits.shape[0]} rows, got values in "
                             f"[{int(rows.min())}, {int(rows.max())}]")
    if noise is not None:
        if noise.shape != logits.shape:
            raise ValueError(f"noise must have logits' shape {tuple(logits.shape)}, got {tuple(noise.shape)}")
        if noise.device != logits.device or not noise.is_floating_point() or noise.stride(1) != 1:
            raise ValueError("noise must be a floating tensor of uniforms in (0, 1) on logits' device, "
                             "contiguous along V")
    if seed is not None and not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")


def confidence(
    logits: torch.Tensor,
    *,
    temperature: float = 0.0,
    mode: str = "prob",
    rows: torch.Tensor | None = None,
    suppress_ids: Sequence[int] | None = None,
    noise: torch.Tensor | None = None,
    seed: int | None = None,
    exclude_ids: Sequence[int] | None = None,
    zero_prob_ids: Sequence[int] | None = None,
    out_dtype: torch.dtype = torch.float32,
    rows_in_bounds: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose a token per row and score it, in one pass over the vocabulary.

    Args:
        logits: `[N, V]` float32/float16/bfloat16; rows may be strided, V must be contiguous.
        temperature: 0 → x0 = argmax(l); > 0 → x0 = argmax(l + T·g), a sample of softmax(l/T)
            (Gumbel-max). The confidence always uses the **untempered** softmax of l.
        mode: ``"prob"`` p(x0), ``"margin"`` p1 − p2, ``"neg_entropy"`` Σ p log p.
        rows: optional int index `[R]` of the rows to score (e.g. the masked positions of a
            block); nothing is copied.
        suppress_ids: token ids treated as −inf logits (never chosen, no probability mass).
        noise: uniforms in (0, 1) of logits' shape (indexed by logits row, like the logits) for
            exact tests; otherwise, at T > 0, Philox noise from `seed` at offset ``row·V + col``
            (`tl.rand` in the kernel, its torch twin `philox.philox_uniform` on the torch path:
            the same draws and float32 score, so the same x0 on any device). `seed=None` draws
            one from torch's global generator.
        exclude_ids: ids that may not be chosen but keep their probability mass (the mask token).
        zero_prob_ids: ids removed from the confidence softmax only (LLaDA's EOS/EOT quirk).
        out_dtype: float32 or float64 confidences (the Triton kernel accumulates in float32, the
            torch path in float64).
        rows_in_bounds: the caller built `rows` within ``[0, N)`` itself; skips reading their
            values back to check them (a host read in every decoding step otherwise).

    Returns:
        x0 `[R]` int64 and confidence `[R]` (`out_dtype`), R = len(rows) or N.
    """
    _check(logits, temperature, mode, rows, noise, seed, out_dtype, rows_in_bounds)
    if temperature > 0 and noise is None and seed is None:
        seed = int(torch.randint(0, 2**31 - 1, ()).item())
    suppress = list(suppress_ids or [])
    kwargs = dict(temperature=temperature, mode=mode, rows=rows,
                  argmax_ids=suppress + list(exclude_ids or []) or None,
                  softmax_ids=suppress + list(zero_prob_ids or []) or None,
                  noise=noise, seed=seed, out_dtype=out_dtype)
    if use_triton(logits):
        return confidence_triton(logits, **kwargs)
    return confidence_torch(logits, **kwargs)


def confidence_vocab_parallel(
    logits: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    group=None,
    temperature: float = 0.0,
    mode: str = "prob",
    rows: torch.Tensor | None = None,
    suppress_ids: Sequence[int] | None = None,
    seed: int | None = None,
    exclude_ids: Sequence[int] | None = None,
    zero_prob_ids: Sequence[int] | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`confidence` for tensor parallel: this rank holds the logit columns
    ``[vocab_start, vocab_start + logits.shape[1])`` of `vocab_size` (a vocabulary-parallel LM
    head, shards in rank order); every rank of `group` calls it with the same rows and ids.

    Each rank scores its shard in one pass (the kernel, or its torch reference off CUDA) into a
    few numbers per row — max, Σ e^(l−m), Σ e^(l−m)(l−m), best score and index, the logit there,
    the runner-up — and the ranks all-gather those (7 values per row and rank; never the logits)
    and combine them: max, argmax with the lowest index on ties, log-sum-exp. The Gumbel draws are
    the unsharded call's (Philox at the global offset ``row·vocab_size + column``, in the kernel
    and the torch reference alike), so the tokens equal one process's. Returns x0 `[R]` int64 and confidence `[R]` on every rank.
    """
    import torch.distributed as dist

    _check(logits, temperature, mode, rows, None, seed, out_dtype)
    world = dist.get_world_size(group)
    if temperature > 0 and seed is None:   # one seed for every rank: rank 0's draw
        pick = torch.randint(0, 2**31 - 1, (1,), dtype=torch.long).to(logits.device)
        dist.broadcast(pick, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        seed = int(pick.item())
    suppress = list(suppress_ids or [])
    kwargs = dict(vocab_start=vocab_start, vocab_size=vocab_size, temperature=temperature, mode=mode, rows=rows,
                  argmax_ids=suppress + list(exclude_ids or []) or None,
                  softmax_ids=suppress + list(zero_prob_ids or []) or None, seed=seed)
    triton_path = use_triton(logits)
    if triton_path:
        n_rows = rows.numel() if rows is not None else logits.shape[0]
        widest = -(-vocab_size // world)   # the same split count on every rank (equal shapes to gather)
        num_splits = confidence_config(n_rows, widest, sm_count(logits.device))[2]
        part, part_idx = confidence_partials_triton(logits, num_splits=num_splits, **kwargs)
    else:
        part, part_idx = confidence_partials_torch(logits, **kwargs)
    parts = [torch.empty_like(part) for _ in range(world)]
    idxs = [torch.empty_like(part_idx) for _ in range(world)]
    dist.all_gather(parts, part.contiguous(), group=group)
    dist.all_gather(idxs, part_idx.contiguous(), group=group)
    part, part_idx = torch.cat(parts, dim=2), torch.cat(idxs, dim=1)   # rank order = column order
    if triton_path:
        return combine_partials_triton(part, part_idx, mode, out_dtype)
    return combine_partials_torch(part, part_idx, mode, out_dtype)
