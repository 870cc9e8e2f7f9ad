"""dInfer's parallel decoders and caches for LLaDA-style models (inclusionAI/dInfer, arXiv 2510.08666).

`dinfer_generate` reproduces dInfer's `BlockWiseDiffusionLLM` / `VicinityCacheDiffusionLLM` loop at
temperature 0, token for token (reference fixtures: tests/fixtures/dinfer_reference.json), as LLaDA's
`BlockDecoder` with the rule as its commit part (`rule=`, `align_blocks`, `window`; families/llada.py):

* blocks start at ``floor(P / block_length) * block_length`` (``start_block_align=True``): the first
  may overlap the prompt tail (whose tokens are never touched), the last may be shorter;
* a block is iterated while any row has a mask in it, in groups of
  ``max(min(masks // expected_tpf, maximum_unroll), 1)`` iterations (dInfer's loop unrolling: the
  extra iterations of a finished block cost forwards and change nothing);
* ``use_cache="prefix"`` / ``"dual"``: a block's first iteration is a full forward that decodes and
  builds the cache, then a cached forward (prefix: the block and all after it; dual: the block)
  that decodes again; later iterations are cached forwards only;
* ``VicinityCache``: the first ``warmup_steps`` iterations (over the whole sequence) are full
  forwards without a cache; the cache is built by a full forward (which also decodes) when there is
  none and on entering every block but the first; every iteration then recomputes the window
  ``[start - prefix_look, end + after_look)`` against it;
* ``early_stop``: after a block, rows holding EOS in it get EOS at every later position; decoding
  ends when every row has.

The rules are described on their classes, the departures from upstream in `dinfer_generate`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from remask.models.spec import ModelSpec

from ..families.llada import BlockDecoder
from ..parts.checks import NoWorkBound, check_instance, check_int, check_method_call, checked
from ..parts.stats import GenerationStats
from ..parts.rules import CreditDecoding, HierarchicalDecoding, IterationSmoothing, ThresholdDecoding
from ..parts.step import CommitRule, masked_canvas
from ..parts.stepper import Progress, StepGenerator, drop_in, row_by_row

__all__ = ["ThresholdDecoding", "CreditDecoding", "HierarchicalDecoding", "VicinityCache", "IterationSmoothing",
           "dinfer_decoder", "dinfer_generate", "dinfer_steps"]


@dataclass(frozen=True)
class VicinityCache(NoWorkBound):
    """dInfer's vicinity cache refresh (`VicinityCacheDiffusionLLM`, dual cache): every iteration
    recomputes the window ``[start − prefix_look, end + after_look)`` (module docstring).

    No work bound (docs/parameters.md, "Work bounds", "Not bounded"): the window is clipped to the sequence
    (`[max(0, start − prefix_look), min(T, end + after_look))`), and a `warmup_steps` past the loop's iterations
    makes every one a warmup; none costs more work than the value that reaches the bound (upstream takes any)."""

    prefix_look: int = checked(16, check_int, minimum=0)
    after_look: int = checked(16, check_int, minimum=0)
    warmup_steps: int = checked(4, check_int, minimum=0)


def dinfer_decoder(spec: ModelSpec, prompt: torch.Tensor, *, decoder: CommitRule, use_cache: Any = None,
                   early_stop: bool = True, attention_mask: torch.Tensor | None = None, mask_id: int | None = None,
                   eos_id: int | None = None, stats: GenerationStats | None = None,
                   **block: Any) -> tuple[BlockDecoder, GenerationStats]:
    """dInfer's loop as LLaDA's `BlockDecoder` with the rule as its commit part (`block`: its layout, unrolling and
    structure), its arguments checked (`dinfer_steps`' arguments), and the stats it counts into. The engine steps it
    as a request's decoder (one row: its commits batch with the other requests' of one rule, `commit_key`)."""
    check_instance("decoder", decoder, CommitRule, "a remask commit rule (ThresholdDecoding, CreditDecoding, "
                   "HierarchicalDecoding or another CommitRule)", allow_none=False)
    vicinity = use_cache if isinstance(use_cache, VicinityCache) else None
    if vicinity is None and use_cache not in (None, "prefix", "dual"):
        raise ValueError(f"use_cache must be None, 'prefix', 'dual' or a remask VicinityCache, got {use_cache!r}")
    for name, value in (("mask_id", mask_id), ("eos_id", eos_id)):
        check_int(name, value, minimum=0, allow_none=True)
    spec, stats = check_method_call(spec, prompt, attention_mask, stats, "remask.dinfer_generate", mask_id=mask_id,
                                    eos_id=eos_id)
    if spec.eos_id is None and early_stop:
        raise ValueError("early_stop needs an EOS id: the model has none, pass eos_id=")
    return BlockDecoder(spec, early_stop=early_stop, use_cache=None if vicinity is not None else use_cache,
                        rule=decoder, align_blocks=True, window=vicinity, **block), stats


def dinfer_steps(spec: ModelSpec, prompt: torch.Tensor, *, decoder: CommitRule = ThresholdDecoding(),
                 gen_length: int = 128, block_length: int = 128, use_cache: str | VicinityCache | None = None,
                 early_stop: bool = True, attention_mask: torch.Tensor | None = None, mask_id: int | None = None,
                 eos_id: int | None = None, maximum_unroll: int = 4, expected_tpf: int = 8,
                 stats: GenerationStats | None = None, structure: Any = None, end_ids: Any = ()) -> StepGenerator:
    """`dinfer_generate` as a step generator (`remask.diffusion.parts.stepper`), its arguments checked at
    the call: it yields a `ForwardRequest` per forward and a `Progress` after each (`final`: the
    decoded blocks), and returns the tokens. `structure` / `end_ids`: structured output, held at
    every decode (`diffusion/parts/constrain.py`: commits filtered, a block iterated until full)."""
    block_decoder, stats = dinfer_decoder(**locals())   # the arguments as given
    # decoded row by row where upstream couples a batch's rows (the vicinity warmup and unrolling,
    # iteration smoothing's iteration count): each row as alone, in its row of the canvas
    alone = block_decoder.window is not None or decoder.smoothing is not None
    canvas = masked_canvas(prompt, gen_length, block_decoder.spec.mask_id)

    @torch.no_grad()
    def decode_rows(rows: slice, mask: torch.Tensor | None) -> StepGenerator:
        """The rows `canvas[rows]` to their end, one forward at a time."""
        state = block_decoder.start(canvas[rows, :prompt.shape[1]], mask)
        while (request := block_decoder.next_forward(state)) is not None:
            block_decoder.receive(state, (yield request), None, stats)
            yield Progress(state.x, block_decoder.num_final(state))
        return state.x

    return row_by_row(canvas, decode_rows, attention_mask, stats, gen_length * prompt.shape[0],
                      None if alone else [slice(None)])


@drop_in(dinfer_steps)
def dinfer_generate() -> torch.LongTensor:
    """dInfer's block-wise decoding (greedy) with one of its decoders and caches (module docstring).

    `decoder`: `ThresholdDecoding`, `CreditDecoding`, `HierarchicalDecoding` or any other `CommitRule`
    (`remask.diffusion.parts.rules`); `use_cache`: None, "prefix", "dual" or a `VicinityCache`;
    `maximum_unroll`, `expected_tpf`: dInfer's loop unrolling (NFE, and with a `VicinityCache` the
    iteration that ends the warmup); `stats`: NFE, tokens per decode, cache bytes. Returns
    `[B, P + gen_length]`, no mask left (upstream: the batch-1 sequence with every EOS removed).

    Departures from dInfer (fce4e32), each only where upstream breaks its own output:
        * a decode where every masked position predicts the mask token commits nothing upstream,
          repeated forever; here the most confident one takes its best non-mask token;
        * upstream stops after a block where every row has EOS even with early_stop=False, leaving
          later blocks masked; here early_stop=False decodes every block;
        * batches: rows are decoded exactly as alone (hierarchical decoding is batch-1 upstream; a
          `VicinityCache` or smoothing run, whose counts span the batch upstream, decodes row by
          row); `attention_mask` keeps left pads out of attention (upstream has no padding);
        * the credit state lives for one call (upstream's can leak into the next call when a
          generation ends with masks left in later blocks).
    """
