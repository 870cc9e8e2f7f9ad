"""Sparse attention during diffusion decoding (docs/sparse.md): `SparseConfig` and the block forwards
it implies; the attention itself is `remask.caches.sparse`'s.

* ``method="retention"`` — Sparse-dLLM (OpenMOSS/Sparse-dLLM): per semi-autoregressive block, full
  forwards up to `delay_step`; the one at `delay_step` keeps, per layer, the top `retention_ratio` of
  the positions outside the block; every later step feeds the block alone, attending over the kept
  positions plus the block. `head_select=True`: per-KV-head selection (dLLM-Serve).
* ``method="block_mask"`` — SparseD (INV-WZQ/SparseD): full forwards every step, dense for the first
  `skip_fraction` of the steps; at global step `int(steps·skip_fraction) + 1` each layer picks, per
  head and query block, the key blocks with the largest mean attention; later steps attend through them.

Both plug into LLaDA's block loop (`remask.generate`) and Dream's sampler (`remask.diffusion_generate`:
retention on its block decoder, block masks on its whole-canvas loop, as upstream's Dream samplers do).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generator

import torch

from remask.caches.sparse import BlockMaskAttention, RetentionKVCache
from remask.models.spec import ModelSpec

from .checks import Checked, check_bool, check_choice, check_config_bounds, check_int, check_real, checked
from .stepper import ForwardRequest

SPARSE_METHODS = ("retention", "block_mask")


@dataclass(frozen=True)
class SparseConfig(Checked):
    """Sparse attention for `remask.generate(..., sparse=SparseConfig(...))`. `retention_ratio`: the
    fraction of the keys outside the block kept (retention) / of the key blocks kept per query block
    (block_mask). `delay_step`: the step of each block whose full forward selects (Sparse-dLLM uses 1).
    `block_len`: the semi-AR block length the method assumes (None: the sampler's `block_length`, which
    upstream's `config.block_len` must equal). `pool_kernel`: odd max-pooling width over the scores, or
    None. `skip_fraction`: block_mask's share of dense steps. `kv_block_size`: the index lists'
    granularity (retention: 1, single tokens as upstream; block_mask: SparseD's `block_size`, e.g. 32
    for short prompts, 128 for long ones). `corrected_scale`: block_mask's selection softmax scaled by
    1/√head_dim (True) or 1/√n_heads (False); None: as the sampler's upstream (SparseD's LLaDA
    `generate`: 1/√n_heads; its Dream `diffusion_generate`: 1/√head_dim)."""

    retention_ratio: float = checked(0.5, check_real, low=0, high=1, low_open=True)
    delay_step: int = checked(1, check_int, minimum=0)
    block_len: int | None = checked(None, check_int, minimum=1, allow_none=True)
    pool_kernel: int | None = 3
    head_select: bool = checked(False, check_bool)
    method: str = "retention"
    skip_fraction: float = checked(0.2, check_real, low=0, high=1, high_open=True)
    kv_block_size: int = checked(1, check_int, minimum=1)
    corrected_scale: bool | None = checked(None, check_bool, allow_none=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.validate()

    def validate(self, block_length: int | None = None) -> None:
        """The checks across fields and against the sampler's `block_length` (each field's own: when built)."""
        check_choice("sparse method", self.method, SPARSE_METHODS)
        if self.pool_kernel is not None and (check_int("pool_kernel", self.pool_kernel, minimum=1) % 2 == 0):
            raise ValueError(f"pool_kernel must be None or an odd int >= 1 (the pooled scores keep their length), "
                             f"got {self.pool_kernel!r}")
        if self.method == "retention" and self.kv_block_size != 1:
            raise ValueError(f"method='retention' keeps single tokens (kv_block_size=1, as Sparse-dLLM); got "
                             f"kv_block_size={self.kv_block_size}")
        if self.block_len is not None and block_length is not None and self.block_len != block_length:
            raise ValueError(f"SparseConfig.block_len={self.block_len} must equal block_length={block_length} "
                             f"(the block whose queries select and whose keys are never evicted)")

    def check_request(self, *, gen_length: int | None = None, block_length: int | None = None,
                      steps: int | None = None, prompt_length: int | None = None) -> None:
        """The work bound of a request in LLaDA's block loop (docs/parameters.md, "Work bounds"):
        SparseD's tiles cover the T positions from `kv_block_size` T, and beyond it their padding
        grows as its square: refused past T. `delay_step` and `pool_kernel` read "at most" and take
        any value (a block past its steps never selects; a kernel past 2N − 1 pools the N keys
        outside the block as 2N − 1), at no more work. `prompt_length` None: not known yet."""
        if prompt_length is not None and self.method == "block_mask":
            check_config_bounds(self, "sparse", {"kv_block_size": (prompt_length + gen_length,
                                                                   "the sequence: prompt + gen_length")})


class RetentionForward:
    """The forwards of one semi-AR block under Sparse-dLLM retention, with the interface of
    `remask.diffusion.parts.cache.BlockForward` (`refresh` at step 0, `step` → (logits, first fed position)):
    full forwards before `delay_step`, a selecting full forward at it, the block alone after it."""

    def __init__(self, spec: ModelSpec, sparse: SparseConfig, forward_inputs: dict[str, Any],
                 valid: torch.Tensor | None, topk_ties: bool = False) -> None:
        self.spec, self.sparse, self.forward_inputs = spec, sparse, forward_inputs
        self.cache = RetentionKVCache(sparse.retention_ratio, sparse.pool_kernel, sparse.head_select, valid, topk_ties)
        self.step_index = 0   # within the current block

    @property
    def cache_nbytes(self) -> int:
        return self.cache.nbytes

    def refresh(self, x: torch.Tensor, start: int, end: int) -> Generator[ForwardRequest, Any, torch.Tensor]:
        self.step_index = 0
        return (yield from self.step(x, start, end))[0]

    def step(self, x: torch.Tensor, start: int, end: int) -> Generator[ForwardRequest, Any, tuple[torch.Tensor, int]]:
        step, self.step_index = self.step_index, self.step_index + 1
        if step < self.sparse.delay_step:
            return (yield ForwardRequest.call(x, self.forward_inputs, spec=self.spec)), 0
        if step > self.sparse.delay_step:   # the block alone
            inputs = self.spec.inputs_for_positions(self.forward_inputs, start, end)
            return (yield ForwardRequest.call(x[:, start:end], inputs, spec=self.spec, cache=self.cache,
                                              cache_position=torch.arange(start, end, device=x.device))), start
        self.cache.begin_select(start, end)
        logits = yield ForwardRequest.call(x, self.forward_inputs, spec=self.spec, cache=self.cache,
                                           cache_position=torch.arange(x.shape[1], device=x.device))
        self.cache.end_select()
        return logits, 0


class BlockMaskForward:
    """SparseD's forwards, with the interface of `BlockForward`: every step is a full forward;
    the global step (counted across blocks) decides dense, selecting or block-sparse attention."""

    def __init__(self, spec: ModelSpec, sparse: SparseConfig, forward_inputs: dict[str, Any], steps: int,
                 gen_length: int, head_dim_scale: bool = False) -> None:
        # head_dim_scale: the sampler's upstream scale when `corrected_scale` is None (LLaDA's
        # generate: 1/√n_heads, False; Dream's diffusion_generate: 1/√head_dim, True)
        self.spec, self.forward_inputs = spec, forward_inputs
        self.select_step = int(steps * sparse.skip_fraction) + 1
        corrected = head_dim_scale if sparse.corrected_scale is None else sparse.corrected_scale
        self.hook = BlockMaskAttention(sparse.kv_block_size, sparse.retention_ratio, gen_length, corrected)
        self.global_step = 0

    cache_nbytes = 0   # attention through block masks: nothing cached

    def refresh(self, x: torch.Tensor, start: int, end: int) -> Generator[ForwardRequest, Any, torch.Tensor]:
        step, self.global_step = self.global_step, self.global_step + 1
        self.hook.phase = "sparse" if step > self.select_step else "select" if step == self.select_step else "dense"
        return (yield ForwardRequest.call(x, self.forward_inputs, spec=self.spec, cache=self.hook,
                                          cache_position=torch.arange(x.shape[1], device=x.device)))

    def step(self, x: torch.Tensor, start: int, end: int) -> Generator[ForwardRequest, Any, tuple[torch.Tensor, int]]:
        return (yield from self.refresh(x, start, end)), 0

