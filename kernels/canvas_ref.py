"""Torch reference for the canvas kernels (uniform-noise diffusion: DiffusionGemma): the CPU
runtime and the oracle of tests and benchmarks.

* `canvas_score_torch(logits, temperature, ...)` → (sample, argmax, entropy, top_prob) per row of
  `[N, V]` logits under the tempered distribution softmax(l / T): a Gumbel-max sample, the argmax
  (lowest index on ties), the entropy and the argmax's probability, in float64 a few rows at a time (never `[N, V]` float64).
* `canvas_update_torch(sample, entropy, entropy_bound, ...)` → (new canvas, accepted): the
  EB-sampler's decision per row (accept the lowest-entropy positions while the sum of the accepted
  entropies minus the largest stays ≤ the bound; ties in entropy ordered by position) and the
  update (accepted positions take their sample, the others a uniform random token).

The Triton kernels (`remask.kernels.canvas`) compute the same in float32. Seeded calls (a `seed`,
no injected noise) draw the kernels' own random numbers here too: Philox (`remask.kernels.philox`,
bit-identical to `tl.rand` / `tl.randint`) at the kernels' offsets, the sample's score formed in
float32 as the kernel forms it, so a seed gives the same canvas on any device through either path
(up to the last bit of the kernels' float32 logs: see `philox.gumbel_from_uniform`).
"""
from __future__ import annotations

import torch

from .confidence_ref import CHUNK_ELEMENTS, gumbel
from .philox import grid_offsets, gumbel_from_uniform, philox_randint, philox_uniform


def canvas_score_torch(
    logits: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    *,
    noise: torch.Tensor | None = None,
    seed: int | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of `logits` `[N, V]`: x = l / T (`temperature`, a float or 0-dim tensor, divided in
    the logits' float32 as transformers' schedule does), then the sample argmax(x + g) (g Gumbel
    noise from the uniforms `noise` `[N, V]`, summed in float64; or, with `seed`, the kernel's
    Philox uniforms at ``row·V + col`` and its float32 sum x + g), the argmax of x, the entropy
    −Σ p log p of softmax(x) and p(argmax). `seed=None` without `noise` means seed 0. `seed` may be
    an int64 tensor `[G]` (G dividing N): the rows in G equal groups, group g drawing from ``seed[g]``
    as a call on its rows alone does (its rows counted from 0), so requests scored together draw
    their own numbers.

    Returns sample and argmax (int64 `[N]`), entropy (float32 `[N]`, ≥ 0) and top_prob (float32).
    """
    n_rows, V = logits.shape
    device = logits.device
    sample = torch.empty(n_rows, dtype=torch.long, device=device)
    argmax = torch.empty(n_rows, dtype=torch.long, device=device)
    entropy = torch.empty(n_rows, dtype=torch.float32, device=device)
    top_prob = torch.empty(n_rows, dtype=torch.float32, device=device)
    seeds = seed_groups(seed, n_rows, device)
    rows_per_seed = n_rows // max(1, seeds.numel()) if torch.is_tensor(seeds) else max(1, n_rows)
    cols = torch.arange(V, dtype=torch.int64, device=device)
    chunk = max(1, CHUNK_ELEMENTS // max(V, 1))
    for r0 in range(0, n_rows, chunk):
        rows = slice(r0, min(r0 + chunk, n_rows))
        x32 = logits[rows].to(torch.float32) / temperature
        x = x32.to(torch.float64)
        if noise is not None:
            sample[rows] = torch.argmax(x + gumbel(noise[rows].to(torch.float64)), dim=1)
        else:   # the kernel's draws and its float32 score x + g (it forms x − log(−log u): the same number)
            row_ids = torch.arange(rows.start, rows.stop, dtype=torch.int64, device=device)
            key = seeds[row_ids // rows_per_seed, None] if torch.is_tensor(seeds) else seeds
            g = gumbel_from_uniform(philox_uniform(key, grid_offsets(row_ids % rows_per_seed, V, cols)))
            sample[rows] = torch.argmax(x32 + g, dim=1)
        argmax[rows] = torch.max(x, dim=1).indices   # the first maximal index
        log_p = torch.log_softmax(x, dim=1)
        entropy[rows] = (-(log_p.exp() * log_p).sum(dim=1)).clamp_min(0.0).to(torch.float32)
        top_prob[rows] = log_p.max(dim=1).values.exp().to(torch.float32)
    return sample, argmax, entropy, top_prob


def canvas_update_torch(
    sample: torch.Tensor,
    entropy: torch.Tensor,
    entropy_bound: float,
    *,
    vocab_size: int,
    noise_tokens: torch.Tensor | None = None,
    seed: int | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The EB-sampler step on a `[B, L]` canvas: returns (new canvas int64 `[B, L]`, accepted bool).

    A position is accepted when the entropies before it in ascending order (position order among
    equal entropies) sum to ≤ `entropy_bound`; the others get `noise_tokens` (`[B, L]` ids) or
    the kernel's draws ``philox_randint(seed, b·L + position) % vocab_size`` (`seed=None`: 0); with
    an int64 tensor `seed` `[B]`, row b draws ``philox_randint(seed[b], position)``, as alone.
    """
    sorted_entropy, order = torch.sort(entropy.to(torch.float32), dim=-1, stable=True)
    before = torch.cumsum(sorted_entropy, dim=-1) - sorted_entropy
    accepted = torch.zeros_like(before, dtype=torch.bool).scatter(-1, order, before <= entropy_bound)
    if noise_tokens is None:
        B, L = sample.shape
        seeds = seed_groups(seed, B, sample.device)
        rows = torch.arange(B, device=sample.device) if not torch.is_tensor(seeds) else \
            torch.zeros(B, dtype=torch.int64, device=sample.device)   # a seed per row: each counted as alone
        offsets = grid_offsets(rows, L, torch.arange(L, device=sample.device))
        noise_tokens = philox_randint(seeds[:, None] if torch.is_tensor(seeds) else seeds, offsets) % vocab_size
    return torch.where(accepted, sample, noise_tokens.to(sample.dtype)), accepted


def seed_groups(seed: int | torch.Tensor | None, n_rows: int, device: torch.device) -> int | torch.Tensor:
    """The seed of a call over `n_rows` rows: an int (None: 0), or an int64 tensor `[G]` on the rows' device,
    G dividing `n_rows` (each group of rows draws from its own)."""
    if not torch.is_tensor(seed):
        return int(seed if seed is not None else 0)
    if seed.dim() != 1 or seed.dtype != torch.int64 or seed.numel() == 0 or n_rows % seed.numel():
        raise ValueError(f"a seed tensor must be int64 [G] with G dividing the {n_rows} rows, got {seed.dtype} "
                         f"{tuple(seed.shape)}")
    return seed.to(device)
