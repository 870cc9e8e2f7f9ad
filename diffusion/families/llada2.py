"""LLaDA2's block diffusion decoders: LLaDA2.0's `generate` and LLaDA2.1's token-editing `generate`.

Autoregressive over blocks, parallel inside one, sampling as SDAR does. LLaDA2.0: each block gets
up to `steps` forwards, each committing the masked positions above `threshold` when there are at
least the schedule's count, else the count most confident. LLaDA2.1 (`editing_threshold` set): a
block loops until it has no masks and no edits, or more than `max_post_steps` forwards ran after
its masks were gone; each forward commits `num_to_transfer` masks as above and replaces every
generated token whose argmax differs with probability above `editing_threshold`. Both stop after a
block holding EOS (2.0 always, 2.1 with `eos_early_stop`); 2.0 with `eos_early_stop` also stops
inside a block at an EOS with nothing masked before it. The output is cut after the first EOS.

Upstream has no KV cache here (`use_cache=False` runs its forwards); block-causal attention makes
the `StoreKVLoop`'s cache exact.
Departures (where upstream breaks its own output; docs/block-diffusion.md): temperature 0 is greedy
(dFactory's sampler always draws; the 2.0 remote code too once top-k or top-p is set); a drawn mask
token becomes the most probable other token (upstream may return it); the output never holds a mask
token; 2.0's in-block EOS stop returns the continuation like every other exit (upstream returns the
prompt with it there only); one prompt at a time (upstream reads row 0 only).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

import torch

from remask.models.spec import ModelSpec

from ..parts.blocks import (BlockState, StoreKVLoop, check_part, engine_settings, family_config, num_transfer_schedule,
                            sample_block, select_mask_to_token)
from ..parts.checks import (MAX_LOOP_STEPS, NoWorkBound, check_bool, check_bools, check_int, check_ints, check_real,
                            check_steps, checked)
from ..parts.constrain_loops import filter_block, keep_valid_edits
from ..parts.rules import is_rule

__all__ = ["LLaDA2Decoding", "LLaDA2Decoder", "LLaDA2State", "num_transfer_schedule", "sample_block",
           "select_mask_to_token", "select_token_edits"]


def select_token_edits(block: torch.Tensor, masked: torch.Tensor, prompt_in_block: torch.Tensor,
                       tokens: torch.Tensor, confidence: torch.Tensor, editing_threshold: float) -> torch.Tensor:
    """LLaDA2.1's token-to-token edits: generated, unmasked positions whose prediction differs from
    the current token with probability above `editing_threshold`."""
    editable = ~masked & ~prompt_in_block[None, :]
    return editable & (confidence > editing_threshold) & (tokens != block)


LLaDA2State = BlockState


class LLaDA2Decoder(StoreKVLoop):
    """LLaDA2's loop as a state and a step: each `step` is one model forward — the prefill, a
    decoding step of the current block, or the store of the block just finished. `decoder`: the commit part
    (`BlockLoop._take`): None, the threshold / schedule rule (and 2.1's edits); one of dInfer's rules (2.0's loop,
    its EOS stops included, no `steps` cap); FreeDave (2.0's loop: greedy, one token per step, `threshold=1.0`
    lossless, below 1 with ``match_rule="exact"``: the same tokens with fewer forwards). Neither with 2.1's edits."""

    family = "LLaDA2"
    mask_dtype = torch.bool
    mask_lead = (1, 1)
    prompt_name, empty_prompt_ok = "inputs", False

    def __init__(self, decoder: Any = None, *, mask_id: int, eos_id: int | None, gen_length: int = 2048,
                 block_length: int = 32, steps: int = 32, temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, minimal_topk: int = 1, threshold: float = 0.95,
                 editing_threshold: float | None = None, max_post_steps: int = 16, num_to_transfer: int = 1,
                 eos_early_stop: bool = False, use_cache: bool = True, block_store: Any = None):
        check_ints(0, mask_id=mask_id, max_post_steps=max_post_steps)
        check_ints(1, gen_length=gen_length, block_length=block_length, steps=steps, minimal_topk=minimal_topk,
                   num_to_transfer=num_to_transfer)
        check_int("eos_id", eos_id, minimum=0, allow_none=True)
        check_real("temperature", temperature, low=0)
        check_int("top_k", top_k, minimum=0, allow_none=True)
        check_real("top_p", top_p, low=0, high=1, low_open=True, allow_none=True)
        if gen_length // minimal_topk < 1:
            raise ValueError(f"minimal_topk ({minimal_topk}) must not exceed gen_length ({gen_length}): upstream "
                             f"runs min(steps, gen_length // minimal_topk) steps per block")
        check_real("threshold", threshold)
        check_real("editing_threshold", editing_threshold, allow_none=True)
        check_bools(eos_early_stop=eos_early_stop, use_cache=use_cache)
        self.mask_id, self.eos_id, self.gen_length, self.block_length = mask_id, eos_id, gen_length, block_length
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.threshold, self.editing_threshold, self.use_cache = threshold, editing_threshold, use_cache
        self.editing = editing_threshold is not None   # LLaDA2.1's loop (token editing) rather than LLaDA2.0's
        self.stop_ids = [] if eos_id is None else [eos_id]
        self.max_post_steps, self.num_to_transfer, self.eos_early_stop = max_post_steps, num_to_transfer, eos_early_stop
        self.steps = min(steps, gen_length // minimal_topk)
        self.schedule = num_transfer_schedule(block_length, self.steps).tolist()
        self.block_store = block_store if use_cache else None
        self._take(decoder, unread={"editing_threshold": editing_threshold} if self.editing else {},
                   replaces="token editing")

    def output(self, state: LLaDA2State) -> torch.Tensor:
        """The continuation `[1, n]`: up to and including the first EOS, at most `gen_length`."""
        return state.x[:, state.prompt_length:self._end(state)]

    def _select(self, masked: torch.Tensor, confidence: torch.Tensor, count: int, probs: torch.Tensor | None = None,
                state: LLaDA2State | None = None, block: torch.Tensor | None = None,
                tokens: torch.Tensor | None = None) -> torch.Tensor:
        """2.0: the schedule's count (mask → token); 2.1: `num_to_transfer`, and the token edits."""
        transfer = select_mask_to_token(masked, confidence, self.num_to_transfer if self.editing else count,
                                        self.threshold)
        if not self.editing:
            return transfer
        start, end = self._span(state)
        prompt_in_block = torch.arange(start, end, device=block.device) < state.prompt_length
        return transfer | select_token_edits(block, masked, prompt_in_block, tokens, confidence, self.editing_threshold)

    def _decided(self, state: LLaDA2State, block: torch.Tensor, masked: torch.Tensor, change: torch.Tensor,
                 tokens: torch.Tensor | None, logits: torch.Tensor, prior: torch.Tensor | None) -> None:
        """After the step's commits: structured output's filter (after the rule and 2.1's edits, kept only where
        the prefix stays valid; a complete answer ends the output after it), the EOS stops, the block's end."""
        if prior is not None:
            (start, end), constraint = self._span(state), state.constraint
            if self.editing:
                keep_valid_edits(constraint, state.x, prior, start, end)
            filter_block(constraint, state.x, prior, tokens, logits, start, end)
            if constraint.matchers[0].ended:
                state.done, ended_at = True, constraint.matchers[0]._ended_at
                state.end = min(state.prompt_length + ended_at + 1, state.prompt_length + self.gen_length)
                return
        if self.editing:   # no mask and no edit (or the post steps spent); a structure's block ends only without holes
            finished = (not bool((masked | change).any()) or self._post_steps_spent(state)) and \
                (prior is None or self._block_full(state))
        else:
            if self._eos_stop(state, block[change] if tokens is None else tokens[change]):
                return
            finished = self._block_full(state) or (self.rule is None and prior is None and state.step >= self.steps)
        if finished:
            self._finish_block(state)

    def _eos_stop(self, state: LLaDA2State, committed: torch.Tensor | None = None) -> bool:
        """2.0's in-block stop (`eos_early_stop`) once the `committed` tokens hold an EOS (None: any):
        an EOS with nothing masked before it ends the output. True when it stopped."""
        if not self.eos_early_stop or self.eos_id is None or \
                (committed is not None and not bool((committed == self.eos_id).any())):
            return False
        gen = state.x[0, state.prompt_length:self._span(state)[1]]
        eos = self._first_eos(gen)
        if eos is not None and not bool((gen[:eos] == self.mask_id).any()):
            state.done, state.end = True, state.prompt_length + eos + 1
            return True
        return False

    def _first_eos(self, gen: torch.Tensor) -> int | None:
        """The index of the first EOS in the generated tokens `gen` (None: none, or no EOS id)."""
        eos = (gen == self.eos_id).nonzero(as_tuple=True)[0] if self.eos_id is not None else gen[:0]
        return int(eos[0]) if len(eos) else None

    def _post_steps_spent(self, state: LLaDA2State) -> bool:
        """2.1: upstream counts the forwards that start with no mask in the block and stops the block
        when that count would exceed `max_post_steps` — decided here, before the next forward."""
        if not self._block_full(state):
            return False
        state.post_steps += 1   # the next forward would start mask-free
        return state.post_steps > self.max_post_steps

    def _finish_block(self, state: LLaDA2State) -> None:
        gen = state.x[0, state.prompt_length:self._span(state)[1]]
        has_eos = self._first_eos(gen) is not None
        stop = has_eos and (not self.editing or (self.eos_early_stop and not bool((gen == self.mask_id).any())))
        state.block += 1
        state.step, state.post_steps = 0, 0
        if stop or state.block == state.num_blocks:
            state.done = True
            eos = self._first_eos(state.x[0, state.prompt_length:state.prompt_length + self.gen_length])
            state.end = state.prompt_length + (self.gen_length if eos is None else eos + 1)
            # positions left masked (a block cut short) become EOS — upstream returns the mask token
            tail = state.x[0, state.prompt_length:state.end]
            tail[tail == self.mask_id] = self.eos_id if self.eos_id is not None else tail[tail != self.mask_id][0]
        else:
            state.stored = not self.use_cache

    def _fd_loop(self) -> tuple:
        return (all(n == 1 for n in self.schedule), "steps", not self.editing,
                "editing_threshold: LLaDA2.1's token editing revises committed tokens; it does not combine")

    _fd_committed = _eos_stop   # 2.0's in-block EOS stop
    _fd_block_done = _finish_block


@dataclass(frozen=True)
class LLaDA2Decoding(NoWorkBound):
    """LLaDA2's loop on an engine request (`SamplingParams(decoder=LLaDA2Decoding(...))`, JSON ``{"name": "llada2",
    ...}``): `generate`'s settings, None the loop's default (`block_length` the model's, else 32; `steps` the block
    length; the official ones). `rule`: the loop's commit part, remask.FreeDave or one of dInfer's commit rules
    (`decoder=` one of them is short for ``LLaDA2Decoding(rule=...)``; neither with 2.1's edits); the settings it
    replaces are refused. No token count bounds max_post_steps's loop: a cap (docs/parameters.md, work bounds); the
    steps are checked against the model's block at the engine."""

    # the settings a commit rule replaces (refused with one); the drop-in's sampling settings besides
    # (`blocks.rule_unread`)
    rule_replaces: ClassVar[tuple] = ("steps", "minimal_topk", "editing_threshold", "max_post_steps", "num_to_transfer")

    qualified = True
    block_length: int | None = checked(None, check_int, minimum=1, allow_none=True)
    steps: int | None = None
    minimal_topk: int | None = checked(None, check_int, minimum=1, allow_none=True)
    eos_early_stop: bool | None = checked(None, check_bool, allow_none=True)
    editing_threshold: float | None = checked(None, check_real, allow_none=True)
    max_post_steps: int | None = checked(None, check_int, minimum=0, maximum=MAX_LOOP_STEPS, allow_none=True)
    num_to_transfer: int | None = None
    rule: Any = None

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("steps", "num_to_transfer"):
            check_steps(f"LLaDA2Decoding.{name}", getattr(self, name), self.block_length or math.inf,
                        "LLaDA2Decoding.block_length")
        check_part(self, "LLaDA2", self.rule_replaces, (), replaces="threshold rule and schedule")


def engine_decoder(spec: ModelSpec, params: Any, *, store: Any, stop_ids: Sequence[int]) -> LLaDA2Decoder:
    """One engine request's LLaDA2 loop (`Family.engine_decoder`): `remask.compat.llada2.generate`'s with
    `gen_length=max_tokens`, its settings from `decoder=` (`LLaDA2Decoding`, or a commit part: `blocks.family_config`).
    FreeDave sets the rule: one token per step (threshold 1.0), or its threshold. `store`: the engine's paged KV store
    (the blocks' caches); `stop_ids` are not read (the loop stops at the model's EOS id only)."""
    config = family_config(params.decoder, LLaDA2Decoding)
    settings, block_length, part, tau = engine_settings(spec, params, config, "LLaDA2",
                                                        stops="its EOS id only (the model's)")
    for name in ("steps", "num_to_transfer"):   # work bounds, before the schedule (O(steps)) is built
        check_steps(f"LLaDA2Decoding.{name}", settings.get(name), block_length, "the block length")
    threshold = (1.0 if part is not None and not is_rule(part) else 0.95) if tau is None else tau   # FreeDave: 1.0
    return LLaDA2Decoder(part, mask_id=spec.mask_id, eos_id=spec.eos_id, gen_length=params.max_tokens,
                         block_length=block_length, steps=settings.pop("steps", block_length),
                         temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, threshold=threshold,
                         block_store=store, **settings)
