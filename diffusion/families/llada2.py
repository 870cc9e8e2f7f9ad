"""LLaDA2's block diffusion decoders: LLaDA2.0's `generate` and LLaDA2.1's token-editing `generate`.

Autoregressive over blocks, parallel inside one. LLaDA2.0 (`editing_threshold=None`): each block
(the first holds the prompt's tail) gets up to `steps` forwards; each samples every position of the
block (temperature, top-k, top-p; the confidence is the sampled token's probability) and commits the
masked positions above `threshold` when there are at least the schedule's count (`block_length` split
over `steps`, remainder first), else the count most confident. LLaDA2.1 (`editing_threshold` set):
a block loops until it has no masks and no edits, or more than `max_post_steps` forwards ran after
its masks were gone; each forward commits masks as above with the fixed count `num_to_transfer`
(mask → token) and replaces every generated, unmasked token of the block whose argmax differs and
whose probability exceeds `editing_threshold` (token → token). Both stop after a block holding EOS
(2.0 always, 2.1 with `eos_early_stop`); 2.0 with `eos_early_stop` also stops inside a block once an
EOS is committed with nothing masked before it. The output is cut after the first EOS.

Upstream has no KV cache in these loops (each forward covers the sequence up to the current block
under the block-causal mask). Block-causal attention makes a cache exact: the prompt's whole blocks
are prefilled (`store_kv=True`), each step forwards the block against the cache (`store_kv=False`),
and a finished block is forwarded once more to store it. `use_cache=False` runs upstream's forwards.

Departures (each where upstream breaks its own output; docs/block-diffusion.md): temperature 0 is
greedy (dFactory's sampler always draws from the softmax; the 2.0 remote code draws too once top-k
or top-p is set); a drawn mask token becomes the most probable other token (upstream commits it and
may return it); the output never holds a mask token; 2.0's in-block EOS stop returns the
continuation like every other exit (upstream returns the prompt with it there only); upstream reads
only row 0 of a batch, so one prompt at a time is accepted.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Generator

import torch
from transformers.cache_utils import DynamicCache

from remask.caches.block import PagedBlocks

from ..parts.checks import (MAX_LOOP_STEPS, check_block_within_context, check_bool, check_instance, check_int, check_real,
                     check_settings, check_steps)
from ..methods.freedave import FreeDave
from ..methods.freedave_blocks import BlockFreeDave, check_freedave_loop
from ..parts.rules import CommitRule, check_rule_on_loop, commit_block, is_rule, rule_types
from .sdar import BlockLoop, block_request, num_transfer_schedule, sample_block
from ..parts.stats import GenerationStats
from ..parts.stepper import ForwardRequest

__all__ = ["LLaDA2Decoder", "LLaDA2State", "num_transfer_schedule", "select_mask_to_token",
           "select_token_edits", "validate_llada2_args"]


def select_mask_to_token(masked: torch.Tensor, confidence: torch.Tensor, count: int, threshold: float) -> torch.Tensor:
    """Masked positions of a `[1, L]` block to commit: those above `threshold` when there are at
    least `count`, else the `count` most confident (never more than there are masks)."""
    transfer = torch.zeros_like(masked)
    masks = int(masked.sum())
    if masks == 0:
        return transfer
    conf = torch.where(masked, confidence, -torch.inf)
    high = (conf[0] > threshold) & masked[0]
    if int(high.sum()) >= count:
        transfer[0] = high
    else:
        transfer[0, torch.topk(conf[0], k=min(count, masks)).indices] = True
    return transfer


def select_token_edits(block: torch.Tensor, masked: torch.Tensor, prompt_in_block: torch.Tensor,
                       tokens: torch.Tensor, confidence: torch.Tensor, editing_threshold: float) -> torch.Tensor:
    """LLaDA2.1's token-to-token edits: generated, unmasked positions whose prediction differs from
    the current token with probability above `editing_threshold`."""
    editable = ~masked & ~prompt_in_block[None, :]
    return editable & (confidence > editing_threshold) & (tokens != block)


def validate_llada2_args(*, mask_id: int, eos_id: int | None, gen_length: int, block_length: int, steps: int,
                         temperature: float, top_k: int | None, top_p: float | None, minimal_topk: int,
                         threshold: float, editing_threshold: float | None, max_post_steps: int,
                         num_to_transfer: int, eos_early_stop: bool) -> None:
    check_int("mask_id", mask_id, minimum=0)
    check_int("eos_id", eos_id, minimum=0, allow_none=True)
    check_int("gen_length", gen_length, minimum=1)
    check_int("block_length", block_length, minimum=1)
    check_int("steps", steps, minimum=1)
    check_real("temperature", temperature, low=0)
    check_int("top_k", top_k, minimum=0, allow_none=True)
    check_real("top_p", top_p, low=0, high=1, low_open=True, allow_none=True)
    check_int("minimal_topk", minimal_topk, minimum=1)
    if gen_length // minimal_topk < 1:
        raise ValueError(f"minimal_topk ({minimal_topk}) must not exceed gen_length ({gen_length}): upstream "
                         f"runs min(steps, gen_length // minimal_topk) steps per block")
    check_real("threshold", threshold)
    check_real("editing_threshold", editing_threshold, allow_none=True)
    check_int("max_post_steps", max_post_steps, minimum=0)
    check_int("num_to_transfer", num_to_transfer, minimum=1)
    check_bool("eos_early_stop", eos_early_stop)


@dataclass(eq=False)
class LLaDA2State:
    """One prompt under LLaDA2's loop: `x` `[1, total]` (prompt, then masks), the cache, the block
    being decoded, its step and post-mask step counts; `stored` once the blocks before it are cached."""

    x: torch.Tensor
    prompt_length: int
    cache: DynamicCache | None
    attention: torch.Tensor
    position_ids: torch.Tensor
    block: int
    num_blocks: int
    stored: bool = False
    step: int = 0
    post_steps: int = 0
    done: bool = False
    end: int | None = None   # where the output ends (after the first EOS), once done
    predictions: Any = None   # FreeDave's predictions for the current block (`LLaDA2FreeDave`)
    rule_state: Any = None    # (block, the commit rule's per-block state), `commit_block`'s (`LLaDA2Rules`)
    pending: Any = None       # the forward asked for and not yet answered (a sub-generator)
    constraint: Any = None    # structured output: a `CommitFilter` of one row (`BlockLoop.constrain`)


class LLaDA2Decoder(BlockLoop, PagedBlocks):
    """LLaDA2's loop as a state and a step: each `step` is one model forward — the prefill, a
    decoding step of the current block, or the forward that stores a finished block. In the engine
    every one-block forward of the running requests (`block_request`: a decoding step or a store,
    each at its own block against its own cache) is stacked into one call."""

    def __init__(self, *, mask_id: int, eos_id: int | None, gen_length: int = 2048, block_length: int = 32,
                 steps: int = 32, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                 minimal_topk: int = 1, threshold: float = 0.95, editing_threshold: float | None = None,
                 max_post_steps: int = 16, num_to_transfer: int = 1, eos_early_stop: bool = False,
                 use_cache: bool = True, block_store: Any = None):
        validate_llada2_args(mask_id=mask_id, eos_id=eos_id, gen_length=gen_length, block_length=block_length,
                             steps=steps, temperature=temperature, top_k=top_k, top_p=top_p,
                             minimal_topk=minimal_topk, threshold=threshold, editing_threshold=editing_threshold,
                             max_post_steps=max_post_steps, num_to_transfer=num_to_transfer,
                             eos_early_stop=eos_early_stop)
        check_bool("use_cache", use_cache)
        self.mask_id, self.eos_id, self.gen_length, self.block_length = mask_id, eos_id, gen_length, block_length
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.threshold, self.editing_threshold = threshold, editing_threshold
        self.max_post_steps, self.num_to_transfer = max_post_steps, num_to_transfer
        self.eos_early_stop, self.use_cache = eos_early_stop, use_cache
        self.steps = min(steps, gen_length // minimal_topk)
        self.schedule = num_transfer_schedule(block_length, self.steps).tolist()
        # the engine's page store: each state's cache is then a `remask.caches.BlockKVCache` in its pages
        self.block_store = block_store if use_cache else None

    @property
    def editing(self) -> bool:
        """LLaDA2.1's loop (token editing) rather than LLaDA2.0's."""
        return self.editing_threshold is not None

    def start(self, model: torch.nn.Module, input_ids: torch.Tensor) -> LLaDA2State:
        if not torch.is_tensor(input_ids) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
            raise ValueError(f"inputs must be a LongTensor [1, length], got {getattr(input_ids, 'shape', None)}")
        if input_ids.shape[0] != 1:
            raise ValueError(f"inputs: LLaDA2's generate decodes one prompt (batch 1; upstream reads row 0 only), "
                             f"got batch {input_ids.shape[0]}")
        if input_ids.shape[1] == 0:
            raise ValueError("inputs: the prompt is empty")
        if bool((input_ids == self.mask_id).any()):
            raise ValueError(f"inputs hold the mask id {self.mask_id}: LLaDA2 decodes only after the prompt")
        L, device = self.block_length, input_ids.device
        prompt_length = input_ids.shape[1]
        num_blocks = (prompt_length + self.gen_length + L - 1) // L
        x = torch.full((1, num_blocks * L), self.mask_id, dtype=torch.long, device=device)
        x[:, :prompt_length] = input_ids
        blocks = torch.tril(torch.ones(num_blocks, num_blocks, dtype=torch.bool, device=device))
        first = prompt_length // L
        return LLaDA2State(x=x, prompt_length=prompt_length, cache=self.new_cache(input_ids) if self.use_cache else None,
                           attention=blocks.repeat_interleave(L, 0).repeat_interleave(L, 1)[None, None],
                           position_ids=torch.arange(num_blocks * L, device=device)[None], block=first,
                           num_blocks=num_blocks, stored=first == 0 or not self.use_cache,
                           constraint=self._constraint(prompt_length, num_blocks * L - prompt_length))

    def _default_end_ids(self) -> list:
        return [] if self.eos_id is None else [self.eos_id]

    def _constrain_before(self, state: LLaDA2State, logits: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Structured output, before the rule: the frontier's logits masked; the block as it was."""
        if state.constraint is None:
            return logits, None
        from ..parts.constrain_loops import mask_frontier_rows

        L, b = self.block_length, state.block
        return mask_frontier_rows(state.constraint, logits, b * L, (b + 1) * L), state.x[:, b * L:(b + 1) * L].clone()

    def _constrain_after(self, state: LLaDA2State, prior: torch.Tensor, tokens: torch.Tensor | None,
                         logits: torch.Tensor) -> bool:
        """Structured output, after the rule (and 2.1's edits): edits of consumed tokens kept only
        where the prefix stays valid, the block filtered. True when the answer is complete (the
        loop is then done, its output cut after the end token)."""
        from ..parts.constrain_loops import filter_block, keep_valid_edits

        L, b, constraint = self.block_length, state.block, state.constraint
        if self.editing:
            keep_valid_edits(constraint, state.x, prior, b * L, (b + 1) * L)
        filter_block(constraint, state.x, prior, tokens, logits, b * L, (b + 1) * L)
        matcher = constraint.matchers[0]
        if not matcher.ended:
            return False
        state.done = True
        state.end = min(state.prompt_length + matcher._ended_at + 1, state.prompt_length + self.gen_length)
        return True

    def num_final(self, state: LLaDA2State) -> int:
        """Generated positions that are final: those of the finished blocks (the output once done)."""
        if state.done:
            return state.end - state.prompt_length
        return max(0, state.block * self.block_length - state.prompt_length)

    def _forward(self, state: LLaDA2State) -> Generator[ForwardRequest, Any, tuple[torch.Tensor | None, Any]]:
        """The step's forward: the store of what is finished (the prompt's whole blocks, or the
        block just decoded: one block is a block forward like the others), else a decoding step of
        the current block (against the cache, or without one the sequence up to it under the
        block-causal mask). Returns (logits `[1, L, V]`, ("store", positions) or "decide")."""
        L, b = self.block_length, state.block
        if not state.stored:
            start = state.cache.get_seq_length()
            if b * L - start == L:
                yield block_request(state.x[:, start:b * L], state.position_ids[:, start:b * L], state.cache, True)
            else:
                yield ForwardRequest.call(state.x[:, start:b * L],
                                          dict(attention_mask=state.attention[:, :, start:b * L, :b * L],
                                               position_ids=state.position_ids[:, start:b * L]),
                                          cache=state.cache, use_cache=True, store_kv=True)
            return None, ("store", b * L - start)
        span = slice(b * L, (b + 1) * L)
        if self.use_cache:
            logits = yield block_request(state.x[:, span], state.position_ids[:, span], state.cache, False)
        else:
            end = (b + 1) * L
            logits = yield ForwardRequest.call(state.x[:, :end], dict(attention_mask=state.attention[:, :, :end, :end],
                                                                      position_ids=state.position_ids[:, :end]),
                                               rows=slice(-L, None))
        return logits, "decide"

    def commit(self, state: LLaDA2State, logits: torch.Tensor | None, kind: Any,
               generator: torch.Generator | None = None, stats: GenerationStats | None = None) -> None:
        """The step's decision from its forward's logits `[1, L, V]` (`kind`: which forward it was)."""
        if kind != "decide":   # the forward stored the finished blocks
            state.stored = True
            if stats is not None:
                stats.forward(1, kind[1])
            return
        if stats is not None:
            stats.forward(1, self.block_length if self.use_cache else (state.block + 1) * self.block_length)
        self._decide(state, logits, generator, stats)

    def output(self, state: LLaDA2State) -> torch.Tensor:
        """The continuation `[1, n]`: up to and including the first EOS, at most `gen_length`."""
        end = state.end if state.end is not None else state.prompt_length + self.gen_length
        return state.x[:, state.prompt_length:end]

    def _decide(self, state: LLaDA2State, logits: torch.Tensor, generator: torch.Generator | None,
                stats: GenerationStats | None) -> None:
        L, b = self.block_length, state.block
        block = state.x[:, b * L:(b + 1) * L]   # a view: commits write into x
        masked = block == self.mask_id
        logits, prior = self._constrain_before(state, logits)
        # upstream's sampler is SDAR's (`remask.diffusion.scoring.sample_categorical`, its defaults)
        tokens, confidence, _ = sample_block(logits, self.temperature, self.top_k, self.top_p, generator,
                                             self.mask_id)
        # under a structure the filter may leave holes past the schedule: one more token per step
        count = self.num_to_transfer if self.editing else (self.schedule[state.step] if state.step < len(self.schedule)
                                                           else 1)
        transfer = select_mask_to_token(masked, confidence, count, self.threshold)
        edits = torch.zeros_like(masked)
        if self.editing:
            prompt_in_block = torch.arange(b * L, (b + 1) * L, device=block.device) < state.prompt_length
            edits = select_token_edits(block, masked, prompt_in_block, tokens, confidence, self.editing_threshold)
        change = transfer | edits
        block[change] = tokens[change]
        state.step += 1
        if stats is not None:
            stats.step(transfer.sum())
        if prior is not None and self._constrain_after(state, prior, tokens, logits):
            return
        if self.editing:
            finished = (not bool(masked.any()) and not bool(edits.any())) or self._post_steps_spent(state)
            if prior is not None:   # a structure's block ends only without holes
                finished = finished and not bool((block == self.mask_id).any())
        else:
            if self.eos_early_stop and self.eos_id is not None and bool((tokens[transfer] == self.eos_id).any()):
                gen = state.x[0, state.prompt_length:(b + 1) * L]
                eos = (gen == self.eos_id).nonzero(as_tuple=True)[0]
                if len(eos) and not bool((gen[:int(eos[0])] == self.mask_id).any()):
                    state.done, state.end = True, state.prompt_length + int(eos[0]) + 1
                    return
            finished = not bool((block == self.mask_id).any()) or (prior is None and state.step >= self.steps)
        if finished:
            self._finish_block(state)

    def _post_steps_spent(self, state: LLaDA2State) -> bool:
        """2.1: upstream counts the forwards that start with no mask in the block and stops the block
        when that count would exceed `max_post_steps` — decided here, before the next forward."""
        block = state.x[:, state.block * self.block_length:(state.block + 1) * self.block_length]
        if bool((block == self.mask_id).any()):
            return False
        state.post_steps += 1   # the next forward would start mask-free
        return state.post_steps > self.max_post_steps

    def _finish_block(self, state: LLaDA2State) -> None:
        L = self.block_length
        end = (state.block + 1) * L
        gen = state.x[0, state.prompt_length:end]
        has_eos = self.eos_id is not None and bool((gen == self.eos_id).any())
        stop = has_eos and (not self.editing or (self.eos_early_stop and not bool((gen == self.mask_id).any())))
        state.block += 1
        state.step, state.post_steps = 0, 0
        if stop or state.block == state.num_blocks:
            state.done = True
            limit = state.prompt_length + self.gen_length
            answer = state.x[0, state.prompt_length:limit]
            eos = (answer == self.eos_id).nonzero(as_tuple=True)[0] if self.eos_id is not None else answer[:0]
            state.end = state.prompt_length + int(eos[0]) + 1 if len(eos) else limit
            # positions left masked (a block cut short) become EOS — upstream returns the mask token
            tail = state.x[0, state.prompt_length:state.end]
            if bool((tail == self.mask_id).any()):
                tail[tail == self.mask_id] = self.eos_id if self.eos_id is not None else tail[tail != self.mask_id][0]
        else:
            state.stored = not self.use_cache


class LLaDA2FreeDave(BlockFreeDave, LLaDA2Decoder):
    """LLaDA2.0's loop with FreeDave (`diffusion/methods/freedave_blocks.py`): the tokens of the same loop
    without it — greedy, one token per step (`steps == block_length`), committing the masked positions
    above `threshold` or else the most confident one (`threshold=1.0`: exactly one per step, lossless;
    below 1 lossless with ``match_rule="exact"``) — with fewer forwards. Not LLaDA2.1's editing."""

    def __init__(self, freedave: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        check_freedave_loop(freedave, "LLaDA2", temperature=self.temperature,
                            one_per_step=all(count == 1 for count in self.schedule), steps_name="steps",
                            rule_ok=not self.editing,
                            rule="editing_threshold: LLaDA2.1's token editing revises committed tokens; it does "
                                 "not combine", block_length=self.block_length)
        self.freedave = freedave

    def _fd_pending(self, state: LLaDA2State) -> bool:
        return not state.stored

    def _fd_scores(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return sample_block(logits, 0.0, self.top_k, self.top_p, None, self.mask_id)[:2]

    def _fd_select(self, masked: torch.Tensor, conf: torch.Tensor) -> torch.Tensor:
        return select_mask_to_token(masked, conf, 1, self.threshold)

    def _fd_committed(self, state: LLaDA2State) -> None:
        """2.0's in-block EOS stop (`eos_early_stop`): an EOS with nothing masked before it."""
        if not self.eos_early_stop or self.eos_id is None:
            return
        gen = state.x[0, state.prompt_length:(state.block + 1) * self.block_length]
        eos = (gen == self.eos_id).nonzero(as_tuple=True)[0]
        if len(eos) and not bool((gen[:int(eos[0])] == self.mask_id).any()):
            state.done, state.end = True, state.prompt_length + int(eos[0]) + 1

    def _fd_block_done(self, state: LLaDA2State) -> None:
        self._finish_block(state)


class LLaDA2Rules(LLaDA2Decoder):
    """LLaDA2.0's loop with one of dInfer's commit rules (`remask.diffusion.rules`): the same
    forwards, cache, blocks and EOS stops (`eos_early_stop` included), but each step of a block
    commits the masked positions the rule chooses from the block's logits (greedy) instead of the
    threshold / schedule rule, until the block has no mask (every step commits at least one: no
    `steps` cap). Not LLaDA2.1's editing. A combination no paper shipped."""

    def __init__(self, rule: Any, **kwargs: Any) -> None:
        check_instance("decoder", rule, CommitRule, "a remask commit rule (" + ", ".join(t.__name__ for t in rule_types()) + ")")
        super().__init__(**kwargs)
        check_rule_on_loop(rule, "LLaDA2", temperature=self.temperature,
                           unread={"editing_threshold": self.editing_threshold} if self.editing else {},
                           replaces="token editing")
        self.rule = rule

    def _decide(self, state: LLaDA2State, logits: torch.Tensor, generator: torch.Generator | None,
                stats: GenerationStats | None) -> None:
        L, b = self.block_length, state.block
        block = state.x[:, b * L:(b + 1) * L]   # a view: commits write into x
        logits, prior = self._constrain_before(state, logits)
        commit, state.rule_state = commit_block(self.rule, block, logits, self.mask_id, state.rule_state, b)
        state.step += 1
        if stats is not None:
            stats.step(commit.sum())
        if prior is not None and self._constrain_after(state, prior, None, logits):
            return
        if self.eos_early_stop and self.eos_id is not None and bool((block[commit] == self.eos_id).any()):
            gen = state.x[0, state.prompt_length:(b + 1) * L]   # 2.0's in-block stop, as `_decide`
            eos = (gen == self.eos_id).nonzero(as_tuple=True)[0]
            if len(eos) and not bool((gen[:int(eos[0])] == self.mask_id).any()):
                state.done, state.end = True, state.prompt_length + int(eos[0]) + 1
                return
        if not bool((block == self.mask_id).any()):
            self._finish_block(state)


# generate's settings that a dInfer rule replaces, with their defaults (given ones are refused)
RULE_UNREAD = dict(steps=32, top_p=None, top_k=None, minimal_topk=1, threshold=0.95, editing_threshold=None,
                   max_post_steps=16, num_to_transfer=1)
RULE_SETTINGS = ("steps", "minimal_topk", "editing_threshold", "max_post_steps", "num_to_transfer")


LLADA2_SETTINGS = ("block_length", "steps", "minimal_topk", "eos_early_stop", "editing_threshold", "max_post_steps",
                   "num_to_transfer")


def check_llada2_settings(settings: Any) -> dict:
    """A request's LLaDA2 settings (`SamplingParams.llada2`): a dict with keys from LLADA2_SETTINGS."""
    out = check_settings("llada2", settings, LLADA2_SETTINGS)
    for name in ("block_length", "steps", "minimal_topk", "num_to_transfer"):
        if name in out:
            check_int(f"llada2.{name}", out[name], minimum=1)
    if "max_post_steps" in out:      # no token count bounds this loop: a cap (docs/parameters.md, work bounds)
        check_int("llada2.max_post_steps", out["max_post_steps"], minimum=0, maximum=MAX_LOOP_STEPS)
    for name in ("steps", "num_to_transfer"):   # else at the engine, with the model's block size
        if "block_length" in out and name in out:
            check_steps(f"llada2.{name}", out[name], out["block_length"], "llada2.block_length")
    if "eos_early_stop" in out:
        check_bool("llada2.eos_early_stop", out["eos_early_stop"])
    if out.get("editing_threshold") is not None:
        check_real("llada2.editing_threshold", out["editing_threshold"])
    return out


def engine_decoder(engine: Any, params: Any) -> LLaDA2Decoder:
    """One engine request's LLaDA2 loop (`Family.engine_decoder`): the loop
    `remask.compat.llada2.generate` runs with `gen_length=max_tokens`, its finished blocks in the
    engine's pages. Reads `temperature`, `top_k`, `top_p`, `threshold` (mask → token) and
    `params.llada2` (`block_length`, `steps`, `minimal_topk`, `eos_early_stop`, and 2.1's
    `editing_threshold`, `max_post_steps`, `num_to_transfer`); refuses every other decoding setting.
    `decoder=` a dInfer rule runs `LLaDA2Rules` (reads `llada2.block_length`, `eos_early_stop`)."""
    from dataclasses import fields

    read = ("max_tokens", "n", "seed", "stop", "stop_token_ids", "temperature", "top_k", "top_p", "threshold",
            "llada2", "decoder", "structured_outputs")
    set_here = [f.name for f in fields(type(params)) if f.name not in read and getattr(params, f.name) != f.default]
    if set_here:
        raise ValueError(f"a block-causal model (LLaDA2) does not read {set_here}; its settings are temperature, "
                         f"top_k, top_p, threshold, decoder (remask.FreeDave or dInfer's rules) and "
                         f"llada2={{{', '.join(LLADA2_SETTINGS)}}}")
    if params.stop_token_ids:
        raise ValueError("stop_token_ids: LLaDA2's loop stops at its EOS id only (the model's)")
    settings = dict(params.llada2 or {})
    block_length = settings.pop("block_length", engine.spec.block_length or 32)
    # work bounds, before the schedule (O(steps)) or the canvas (whole blocks) is built
    check_block_within_context(engine.spec, "llada2.block_length", block_length)
    for name in ("steps", "num_to_transfer"):
        check_steps(f"llada2.{name}", settings.get(name), block_length, "the block length")
    kind, threshold = LLaDA2Decoder, 0.95 if params.threshold is None else params.threshold
    if is_rule(params.decoder):
        # SamplingParams refuses temperature > 0, threshold, top_k, top_p with a decoder
        check_rule_on_loop(params.decoder, "LLaDA2", temperature=params.temperature,
                           replaces="threshold rule and schedule",
                           unread={f"llada2.{name}": settings[name] for name in RULE_SETTINGS if name in settings})
        kind = partial(LLaDA2Rules, params.decoder)
    elif params.decoder is not None:
        # FreeDave sets the rule: one token per step (threshold 1.0: never above), or its threshold rule
        check_instance("decoder", params.decoder, FreeDave, "remask.FreeDave, ThresholdDecoding, CreditDecoding or "
                       "HierarchicalDecoding (the decoders block-causal models take)")
        if "steps" in settings:
            raise ValueError("llada2.steps: with decoder=FreeDave a block takes one token per step: leave it unset")
        fd = params.decoder
        threshold = 1.0 if fd.confidence_threshold is None else fd.confidence_threshold
        kind = partial(LLaDA2FreeDave, replace(fd, confidence_threshold=None))
    return kind(mask_id=engine.spec.mask_id, eos_id=engine.spec.eos_id, gen_length=params.max_tokens,
                block_length=block_length, steps=settings.pop("steps", block_length),
                temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, threshold=threshold,
                block_store=engine.runner.store, **settings)
