"""APD's fused accept kernel: for every draft position, the mixture target over the vocabulary, its
comparison with the draft, and the accepted length, in one pass and without materialising
anything of size `[N, V]`.

Program (i, j) streams vocabulary split j of row i once, in float32 (inputs upcast on load),
keeping the running argmax of ``R·l_dLLM + (1 − R)·l_AR (+ T·g)`` — the lowest index winning ties,
as `torch.argmax` — over the shared vocabulary ``v < vocab``. The row that owns the final argmax
(directly, or in the small combine kernel when the vocabulary is split over several programs, as in
the confidence kernel) writes the target and, where the draft differs from it at a row j > 0,
lowers the accepted length with ``atomic_min(n_accept, j)``: the length starts at N, so it ends at
the first rejected position — the cumulative product of the accept flags, with no second pass.

The launch configuration is the confidence kernel's plain function of the shape
(`confidence_config`); `apd_accept` dispatches to Triton on CUDA (or ``REMASK_TRITON=1``) and to
`accept_ref.apd_accept_torch` elsewhere.
"""
from __future__ import annotations

import torch

from .accept_ref import apd_accept_torch
from .confidence import LOGIT_DTYPES, confidence_config, sm_count
from .dispatch import HAS_TRITON, next_power_of_2, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .reductions import argmax_lowest, running_argmax

    @triton.jit
    def _commit(i_row, target, draft_ptr, target_ptr, n_accept_ptr):
        """Store row i's target and shorten the accepted length if the draft disagrees (row 0 never)."""
        tl.store(target_ptr + i_row, target.to(tl.int64))
        draft = tl.load(draft_ptr + i_row)
        if (i_row > 0) & (draft != target.to(tl.int64)):
            tl.atomic_min(n_accept_ptr, i_row.to(tl.int32))

    @triton.jit
    def apd_accept_fwd_kernel(
        dllm_ptr, stride_dllm, verifier_ptr, stride_verifier, V,
        draft_ptr, noise_ptr, stride_noise, w_dllm, w_verifier, temperature,
        part_best_ptr, part_idx_ptr, n_rows, target_ptr, n_accept_ptr,
        BLOCK: tl.constexpr, SPLIT_BLOCKS: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_NOISE: tl.constexpr,
    ):
        """dllm `[N, *]`, verifier `[N, *]` (rows strided, V contiguous; fp32/fp16/bf16), draft `[N]`
        int64, noise `[N, *]` uniforms (HAS_NOISE). NUM_SPLITS == 1: writes target `[N]` int64 and
        lowers n_accept `[1]` int32; otherwise the partial argmax part_best / part_idx
        `[N, NUM_SPLITS]` (fp32 / int32) for the combine kernel."""
        i_row = tl.program_id(0).to(tl.int64)
        i_split = tl.program_id(1)
        neg_inf = float("-inf")
        best = tl.full((), neg_inf, tl.float32)
        best_idx = tl.full((), -1, tl.int32)
        start = i_split * (SPLIT_BLOCKS * BLOCK)
        for b in range(SPLIT_BLOCKS):
            cols = start + b * BLOCK + tl.arange(0, BLOCK)
            in_v = cols < V
            l_d = tl.load(dllm_ptr + i_row * stride_dllm + cols, mask=in_v, other=0.0).to(tl.float32)
            l_a = tl.load(verifier_ptr + i_row * stride_verifier + cols, mask=in_v, other=0.0).to(tl.float32)
            score = w_dllm * l_d + w_verifier * l_a
            if HAS_NOISE:
                u = tl.load(noise_ptr + i_row * stride_noise + cols, mask=in_v, other=0.5).to(tl.float32)
                score = score - temperature * tl.log(-tl.log(u))
            score = tl.where(in_v, score, neg_inf)
            c_best, c_idx = argmax_lowest(score, cols, in_v)
            best, best_idx = running_argmax(best, best_idx, c_best, c_idx)
        if NUM_SPLITS == 1:
            _commit(i_row, best_idx, draft_ptr, target_ptr, n_accept_ptr)
        else:
            tl.store(part_best_ptr + i_row * NUM_SPLITS + i_split, best)
            tl.store(part_idx_ptr + i_row * NUM_SPLITS + i_split, best_idx)

    @triton.jit
    def apd_accept_combine_kernel(part_best_ptr, part_idx_ptr, draft_ptr, target_ptr, n_accept_ptr,
                                  NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr):
        """Program i merges row i's partial argmaxes (splits cover ascending ranges) and commits it."""
        i_row = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, SPLITS_P2)
        valid = j < NUM_SPLITS
        best_j = tl.load(part_best_ptr + i_row * NUM_SPLITS + j, mask=valid, other=float("-inf"))
        idx_j = tl.load(part_idx_ptr + i_row * NUM_SPLITS + j, mask=valid, other=2147483647)
        target = argmax_lowest(best_j, idx_j, valid)[1]   # splits cover ascending ranges
        _commit(i_row, target, draft_ptr, target_ptr, n_accept_ptr)


def apd_accept_triton(
    draft: torch.Tensor,
    dllm_logits: torch.Tensor,
    verifier_logits: torch.Tensor,
    mixture_weight: float,
    *,
    vocab: int,
    temperature: float = 0.0,
    noise: torch.Tensor | None = None,
    num_splits: int | None = None,
    block: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the kernel (arguments as `apd_accept`; checked there). `num_splits` and `block` (a
    power of two) override the configuration, so tests exercise several chunks and splits."""
    n_rows = draft.shape[0]
    device = draft.device
    target = torch.empty(n_rows, dtype=torch.long, device=device)
    n_accept = torch.full((1,), n_rows, dtype=torch.int32, device=device)
    if n_rows == 0:
        return target, n_accept[0].long()
    block_cfg, split_blocks, splits, num_warps = confidence_config(n_rows, vocab, sm_count(device))
    if block is not None or num_splits is not None:
        block = block or block_cfg
        n_blocks = -(-vocab // block)
        split_blocks = -(-n_blocks // max(1, min(num_splits or 1, n_blocks)))
        splits = -(-n_blocks // split_blocks)
    else:
        block = block_cfg
    has_noise = temperature > 0
    if splits > 1:
        part_best = torch.empty((n_rows, splits), dtype=torch.float32, device=device)
        part_idx = torch.empty((n_rows, splits), dtype=torch.int32, device=device)
    else:
        part_best, part_idx = target, target  # never read: NUM_SPLITS == 1
    apd_accept_fwd_kernel[(n_rows, splits)](
        dllm_logits, dllm_logits.stride(0), verifier_logits, verifier_logits.stride(0), vocab,
        draft, noise if has_noise else target, noise.stride(0) if has_noise else 0,
        float(mixture_weight), float(1 - mixture_weight), float(temperature),
        part_best, part_idx, n_rows, target, n_accept,
        BLOCK=block, SPLIT_BLOCKS=split_blocks, NUM_SPLITS=splits, HAS_NOISE=has_noise, num_warps=num_warps,
    )
    if splits > 1:
        apd_accept_combine_kernel[(n_rows,)](part_best, part_idx, draft, target, n_accept, NUM_SPLITS=splits,
                                             SPLITS_P2=next_power_of_2(splits))
    return target, n_accept[0].long()


def _check(draft, dllm_logits, verifier_logits, mixture_weight, vocab, temperature, noise):
    if not isinstance(draft, torch.Tensor) or draft.dim() != 1 or draft.dtype != torch.long:
        raise ValueError(f"draft must be a 1-D int64 tensor [N], got {getattr(draft, 'dtype', type(draft))} "
                         f"of shape {tuple(getattr(draft, 'shape', ()))}")
    n_rows = draft.shape[0]
    for name, logits in (("dllm_logits", dllm_logits), ("verifier_logits", verifier_logits)):
        if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[0] != n_rows:
            raise ValueError(f"{name} must be a 2-D tensor [N={n_rows}, V], got shape {tuple(getattr(logits, 'shape', ()))}")
        if logits.dtype not in LOGIT_DTYPES:
            raise TypeError(f"{name} dtype must be one of {[str(d) for d in LOGIT_DTYPES]}, got {logits.dtype}")
        if logits.stride(1) != 1:
            raise ValueError(f"{name} must be contiguous along the vocabulary axis (stride(1) == 1)")
        if logits.device != draft.device:
            raise ValueError(f"{name} is on {logits.device} but draft on {draft.device}")
        if not isinstance(vocab, int) or not 0 < vocab <= logits.shape[1]:
            raise ValueError(f"vocab must be an int in [1, {logits.shape[1]}] ({name} has {logits.shape[1]} columns), "
                             f"got {vocab!r}")
    if not 0 <= mixture_weight <= 1:
        raise ValueError(f"mixture_weight must be in [0, 1], got {mixture_weight}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature > 0:
        if noise is None:
            raise ValueError("temperature > 0 needs noise: uniforms in (0, 1) of shape [N, >= vocab] "
                             "(the same draws as the draft's, for the coupled Gumbel rule)")
        if noise.dim() != 2 or noise.shape[0] != n_rows or noise.shape[1] < vocab or noise.stride(1) != 1 \
                or not noise.is_floating_point() or noise.device != draft.device:
            raise ValueError(f"noise must be a floating [N={n_rows}, >= {vocab}] tensor on {draft.device}, "
                             f"contiguous along V; got {noise.dtype} of shape {tuple(noise.shape)}")


def apd_accept(
    draft: torch.Tensor,
    dllm_logits: torch.Tensor,
    verifier_logits: torch.Tensor,
    mixture_weight: float,
    *,
    vocab: int | None = None,
    temperature: float = 0.0,
    noise: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """APD's acceptance test for the N draft positions of one round.

    Args:
        draft: `[N]` int64 draft tokens, each below `vocab`.
        dllm_logits: `[N, V_d]` the dLLM's (aligned) logits at the draft positions; fp32/fp16/bf16,
            rows may be strided, V contiguous.
        verifier_logits: `[N, V_a]` the verifier's logits aligned so row j conditions on draft[:j].
        mixture_weight: R in [0, 1]; the target is the argmax of R·l_dLLM + (1 − R)·l_AR.
        vocab: the shared vocabulary `[0, vocab)` the target ranges over (default min(V_d, V_a)).
        temperature: 0 → the reference's deterministic target. > 0 → the coupled Gumbel target
            ``argmax(mix + T·g)``, g = −log(−log noise): with the same uniforms as the draft's
            ``argmax(l_dLLM + T·g)``, the two coincide as often as possible (the paper's rule).
        noise: uniforms `[N, >= vocab]` in (0, 1); required when temperature > 0.

    Returns:
        target `[N]` int64 and the accepted length (0-d int64 tensor): the longest prefix of
        `draft` equal to `target`, where row 0 always counts as accepted.
    """
    vocab = min(dllm_logits.shape[-1], verifier_logits.shape[-1]) if vocab is None else vocab
    _check(draft, dllm_logits, verifier_logits, mixture_weight, vocab, temperature, noise)
    kwargs = dict(vocab=vocab, temperature=temperature, noise=noise)
    if use_triton(dllm_logits):
        return apd_accept_triton(draft, dllm_logits, verifier_logits, mixture_weight, **kwargs)
    return apd_accept_torch(draft, dllm_logits, verifier_logits, mixture_weight, **kwargs)
