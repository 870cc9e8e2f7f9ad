"""Fast-dLLM v2's block diffusion decoding (NVlabs/Fast-dLLM `v2/generation_functions.py::batch_sample`
and the official model's `generate`).

Autoregressive over blocks of `block_size`, parallel inside one, sub-block by sub-block: the prompt's
whole blocks are prefilled into the KV cache (and when the prompt ends on a block boundary the next
token is the argmax of the last prefill logit, as an AR model would pick it); each block (masks
after the prompt's tail or that first token) is then denoised one sub-block of `small_block_size`
at a time: forward the whole block against the cache without storing it, shift the logits by one
position (row i takes the logit of i−1; the block's first row its own), and on the sub-block's
masked positions commit every token whose probability is above `threshold` plus always the most
probable one. A block without masks is forwarded once more, storing it in the cache, and the
argmax of its last logit becomes the first token of the next block. With `use_block_cache` a
sub-block whose first position is decoded forwards only itself against the block's stored keys
and values (refreshed when a sub-block starts masked); its first row then takes its own logit.

Stops: `generate` ends as soon as a stop token has no mask before it and truncates after the
first stop; `batch_sample` finishes a row at the end of the block where it committed a stop and
writes pad over everything after the first stop in its answer.

Upstream's draws are replayed: at temperature > 0, `torch.multinomial` over the top-p filtered,
renormalized softmax of the sub-block with torch's global generator (or `generator`); temperature 0
is the argmax. Departures (docs/block-diffusion.md, all where upstream breaks its own output): a
prompt of exactly one block is prefilled like any longer one (upstream never puts it in the cache,
so it decodes without the prompt; `prefill_whole_block_prompt=False` keeps that); rows of a batch
are decoded each alone (upstream samples every row with row 0's draws and crashes, and decides the
sub-block cache refresh for the whole batch); a chosen mask token is replaced by the most probable
other token (upstream commits it, which at temperature 0 loops forever).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generator

import torch
from transformers.cache_utils import DynamicCache

from remask.models.fast_dllm_v2 import RowBatch

from ..parts.checks import (ParameterTypeError, check_block_within_context, check_bool, check_choice, check_generator,
                     check_int, check_real, check_settings, check_stats)
from ..methods.freedave_blocks import BlockFreeDave, check_freedave_loop
from ..parts.scoring import sample_categorical
from ..parts.stats import GenerationStats
from ..parts.stepper import ForwardRequest
from .sdar import BlockLoop

STOP_MODES = ("generate", "batch_sample")


def shift_logits(logits: torch.Tensor) -> torch.Tensor:
    """The token shift: row i takes the logit of row i−1, the first row keeps its own."""
    return torch.cat([logits[:, :1], logits[:, :-1]], dim=1)


def choose_tokens(logits: torch.Tensor, top_p: float, temperature: float, mask_id: int | None,
                  generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens `[B, L]`, their probabilities, the distributions `[B, L, V]`) for a sub-block's logits
    `[B, L, V]`, as the official `sample_with_top_p` (`remask.diffusion.scoring.sample_categorical`
    with its flags: T = 0 → the raw softmax and its argmax; T > 0 → softmax(logits / T), tokens
    beyond the top-p nucleus zeroed, renormalized, one `torch.multinomial` draw per batch row —
    upstream draws only for row 0 and then crashes on a batch, so a batch of one makes exactly
    upstream's draws). A chosen mask token (which upstream commits, leaving the position masked)
    becomes the most probable other token."""
    return sample_categorical(logits, temperature, None, top_p, generator=generator, exclude_id=mask_id,
                              top_p_on="probs", filter_greedy=False, per_row=True)


def select_to_commit(token_probs: torch.Tensor, masked: torch.Tensor, threshold: float) -> torch.Tensor:
    """The official rule: masked positions above `threshold`, plus the most probable masked one."""
    confidence = torch.where(masked, token_probs, -torch.inf)
    commit = confidence > threshold
    commit[torch.arange(commit.shape[0]), confidence.argmax(dim=-1)] = True
    return commit & masked


def validate_fast_dllm_v2_args(mask_id: int, block_size: int, small_block_size: int, threshold: float,
                               stop_token: int, top_p: float, temperature: float, use_block_cache: bool) -> None:
    """The checks of Fast-dLLM v2's settings (shared by `generate`, `batch_sample` and the decoder)."""
    check_int("mask_id", mask_id, minimum=0)
    check_int("block_size", block_size, minimum=1)
    check_int("small_block_size", small_block_size, minimum=1)
    if block_size % small_block_size:
        # upstream never decodes the positions past the last whole sub-block and loops forever
        raise ValueError(f"small_block_size must divide block_size ({block_size}), got {small_block_size}")
    check_real("threshold", threshold)
    check_int("stop_token", stop_token, minimum=0)
    check_real("top_p", top_p, low=0, high=1, low_open=True)
    check_real("temperature", temperature, low=0)
    check_bool("use_block_cache", use_block_cache)


class BlockRows(RowBatch):
    """A request's cache argument for a whole-block forward (`models.fast_dllm_v2.RowBatch`: each row
    over its own prefix cache, storing when its `stores` says, under its official block mask): its
    block's row (`block_size` the store's block size, a denoising forward's the official default 32)
    or FreeDave's drafts. The engine stacks such requests of one step into one call
    (`stepper.run_forwards`: `pack_key` / `pack`), as `BlockBatch` does for SDAR and LLaDA2."""

    def pack_key(self) -> tuple:
        return ()

    @classmethod
    def pack(cls, members: list["BlockRows"], sizes: list[int]) -> "BlockRows":
        for member, size in zip(members, sizes):
            if len(member.caches) != size:
                raise ValueError(f"a RowBatch of {len(member.caches)} rows packed as {size}")
        return cls([c for m in members for c in m.caches], [s for m in members for s in m.stores],
                   [b for m in members for b in m.block_sizes])


@dataclass(eq=False)
class FastDLLMV2State:
    """One prompt under the loop: `x` `[1, n]` (prompt, decoded blocks, the current block with its
    masks), the prefix cache, the sub-block cache, where the current block and its new part start,
    the sub-block being denoised; `done` once decoding has ended (`finished`: by a stop)."""

    x: torch.Tensor
    prompt_length: int
    blocks_left: int
    skip_first_block: bool
    cache: Any = None
    block_cache: Any = None
    block_start: int = -1
    new_start: int = -1
    sub_block: int = 0
    prefilled: bool = False
    done: bool = False
    finished: bool = False
    finished_block: int | None = None
    predictions: Any = None   # FreeDave's predictions for the current block (`FastDLLMV2FreeDave`)
    pending: Any = None       # the forward asked for and not yet answered (a sub-generator)
    constraint: Any = None    # structured output: a `CommitFilter` of one row (`BlockLoop.constrain`)

    @property
    def in_block(self) -> bool:
        return self.block_start >= 0


class FastDLLMV2Decoder(BlockLoop):
    """Fast-dLLM v2's loop as a state and a step: each `step` is one model forward — the prefill,
    a denoising forward of the current sub-block (then the commit), or the forward that stores a
    finished block and yields the next block's first token. `stop_mode` "generate" ends like the
    official `generate` (at the first stop with no mask before it, then truncates after it),
    "batch_sample" like `batch_sample` (at the end of the block holding a committed stop, pad after
    the first stop). `num_blocks`: how many blocks to decode (upstream's loop count). In the engine
    the whole-block forwards against the prefix cache (a one-block prefill, a denoising forward, a
    store: `BlockRows` requests) of the running requests, each at its own block, are stacked into
    one call; the sub-block cache's forwards run alone."""

    def __init__(self, *, mask_id: int, num_blocks: int, block_size: int = 32, small_block_size: int = 8,
                 threshold: float = 0.9, stop_token: int = 151645, pad_token: int | None = None, top_p: float = 0.95,
                 temperature: float = 0.0, use_block_cache: bool = False, stop_mode: str = "generate",
                 prefill_whole_block_prompt: bool = True, use_cache: bool = True):
        validate_fast_dllm_v2_args(mask_id, block_size, small_block_size, threshold, stop_token, top_p, temperature,
                                   use_block_cache)
        check_int("num_blocks", num_blocks, minimum=0)
        check_choice("stop_mode", stop_mode, STOP_MODES)
        check_int("pad_token", pad_token, minimum=0, allow_none=True)
        check_bool("prefill_whole_block_prompt", prefill_whole_block_prompt)
        if stop_mode == "batch_sample" and pad_token is None:
            raise ValueError("pad_token is needed with stop_mode='batch_sample' (the tokenizer's pad_token_id)")
        self.mask_id, self.num_blocks, self.block_size, self.small_block_size = (mask_id, num_blocks, block_size,
                                                                                 small_block_size)
        self.threshold, self.stop_token, self.pad_token = threshold, stop_token, pad_token
        self.top_p, self.temperature, self.use_block_cache = top_p, temperature, use_block_cache
        self.stop_mode, self.prefill_whole_block_prompt = stop_mode, prefill_whole_block_prompt
        # False: no cache at all — every forward covers the sequence up to the current block (the
        # check that the prefix cache is exact: the same tokens when block_size is the official 32)
        check_bool("use_cache", use_cache)
        if not use_cache and (use_block_cache or not prefill_whole_block_prompt):
            raise ValueError("use_cache=False runs without any cache: not with use_block_cache=True or "
                             "prefill_whole_block_prompt=False")
        self.use_cache = use_cache

    def num_final(self, state: FastDLLMV2State) -> int:
        """Generated positions that are final: everything before the block being decoded (all once done)."""
        end = state.x.shape[1] if state.done or not state.in_block else state.block_start
        return max(0, end - state.prompt_length)

    def start(self, model: torch.nn.Module, input_ids: torch.Tensor, skip_first_block: bool | None = None
              ) -> FastDLLMV2State:
        """A state for one prompt `[1, P]`. `skip_first_block`: upstream's handling of a prompt whose
        first block is never forwarded (a prompt of exactly one block, or `batch_sample` with
        `min_len == block_size`); None decides it from `prefill_whole_block_prompt` and P."""
        if not torch.is_tensor(input_ids) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
            raise ValueError(f"input_ids must be a LongTensor [1, length], got {getattr(input_ids, 'shape', None)}")
        if input_ids.shape[0] != 1 or input_ids.shape[1] == 0:
            raise ValueError(f"a FastDLLMV2Decoder state holds one non-empty prompt [1, length], got "
                             f"{tuple(input_ids.shape)}")
        if bool((input_ids == self.mask_id).any()):
            raise ValueError(f"input_ids holds the mask id {self.mask_id}: Fast-dLLM v2 decodes only after the prompt")
        prompt_length = input_ids.shape[1]
        if skip_first_block is None:
            skip_first_block = not self.prefill_whole_block_prompt and prompt_length == self.block_size
        if self.structure is not None and self.stop_mode != "generate":
            raise ValueError("structured_outputs: enforced in generate's loop (stop_mode='generate'), not batch_sample's")
        return FastDLLMV2State(x=input_ids.clone(), prompt_length=prompt_length, blocks_left=self.num_blocks,
                               skip_first_block=skip_first_block,
                               constraint=self._constraint(prompt_length, (self.num_blocks + 1) * self.block_size))

    def _default_end_ids(self) -> list:
        return [self.stop_token]

    def _next_token(self, state: FastDLLMV2State, logits_row: torch.Tensor) -> torch.Tensor:
        """The token the loop picks by argmax (a block's first), `[1, 1]`; under a structure the best
        one it allows there (the matcher consumes it)."""
        if state.constraint is None or state.constraint.matchers[0].ended:
            return logits_row.argmax(dim=-1).view(1, 1)
        from ..parts.constrain_loops import next_token

        return torch.tensor([[next_token(state.constraint, logits_row.reshape(-1))]], device=state.x.device)

    def _prefill_span(self, state: FastDLLMV2State) -> tuple[int, int]:
        first = self.block_size if state.skip_first_block else 0
        return first, state.prompt_length // self.block_size * self.block_size

    def _settle(self, state: FastDLLMV2State) -> None:
        """The loop's moves that take no forward: a prefill with nothing to forward (no whole block
        in the prompt; without the cache, a prompt not ending on a block: no first token to take),
        the next block opened (or the end: a stop, the block budget), `batch_sample`'s end of the
        block holding its stop."""
        while not state.done:
            if not state.prefilled:
                first, end = self._prefill_span(state)
                if end > first and (self.use_cache or state.prompt_length % self.block_size == 0):
                    return   # the prefill's forward
                state.prefilled = True
                continue
            if not state.in_block:
                self._open_block(state)
                continue
            if self.stop_mode == "batch_sample" and state.finished and \
                    not bool((state.x[:, state.block_start:] == self.mask_id).any()):
                self._finish(state)
            return

    def _block_rows(self, state: FastDLLMV2State, blocks: torch.Tensor, store: bool) -> ForwardRequest:
        """The whole-block forward of `blocks` `[K, L]` against the state's prefix cache (storing
        when `store`, under the block's mask; else the official default block size 32)."""
        K = blocks.shape[0]
        if state.cache is None:   # nothing prefilled (a prompt shorter than a block): an empty cache
            state.cache = DynamicCache()
        return ForwardRequest.call(blocks, {}, cache=BlockRows([state.cache] * K, [store] * K,
                                                               [self.block_size if store else 32] * K),
                                   rows_alone=K > 1)

    def _forward(self, state: FastDLLMV2State) -> Generator[ForwardRequest, Any, tuple[torch.Tensor, tuple]]:
        """The step's forward (after `_settle`): the prefill (the prompt's whole blocks, stored; without
        the cache the prompt, for the next token only), the store of a finished block (its last
        logit opens the next block), or a denoising forward of the current sub-block (the whole
        block against the prefix cache; with the sub-block cache the sub-block alone where the
        block's keys are stored; without a cache the sequence up to the block's end). Returns
        (logits: a denoising forward's shifted and cut to the sub-block, (kind, positions))."""
        L = self.block_size
        if not state.prefilled:
            first, end = self._prefill_span(state)
            if not self.use_cache:
                logits = yield ForwardRequest.call(state.x[:, :end], {}, rows=slice(-1, None), block_size=L)
                return logits, ("prefill", end)
            if end - first == L:   # one block: a store like any other (positions count from the cache: 0)
                logits = yield self._block_rows(state, state.x[:, first:end], True)
            else:
                state.cache = DynamicCache()
                logits = yield ForwardRequest.call(state.x[:, first:end], {}, cache=state.cache, rows=slice(-1, None),
                                                   use_cache=True, update_past_key_values=True, block_size=L)
            return logits, ("prefill", end - first)
        block = state.x[:, state.block_start:]
        masked = block == self.mask_id
        if not bool(masked.any()):   # finished block: store it, the next block's first token
            if not self.use_cache:   # the next block's first token from the sequence's own forward
                end = state.block_start + L
                return (yield ForwardRequest.call(state.x[:, :end], {}, rows=slice(-1, None), block_size=L)), \
                    ("store", end)
            return (yield self._block_rows(state, block, True)), ("store", L)
        S = self.small_block_size
        while not bool(masked[:, state.sub_block * S:(state.sub_block + 1) * S].any()):
            state.sub_block += 1
        start, end = state.sub_block * S, (state.sub_block + 1) * S
        if not self.use_cache:
            end_of_block = state.block_start + L
            logits = yield ForwardRequest.call(state.x[:, :end_of_block], {}, rows=slice(state.block_start, None))
            return shift_logits(logits)[:, start:end], ("denoise", end_of_block)
        if self.use_block_cache and state.block_cache is not None and not bool(block[0, start] == self.mask_id):
            logits = yield ForwardRequest.call(block[:, start:end], {}, cache=state.cache, use_cache=True,
                                               update_past_key_values=False, use_block_cache=True,
                                               block_past_key_values=state.block_cache, replace_position=start)
            return shift_logits(logits), ("denoise", end - start)
        if self.use_block_cache:   # the whole block, its keys and values kept in a new sub-block cache
            state.block_cache = DynamicCache()
            logits = yield ForwardRequest.call(block, {}, cache=state.cache, use_cache=True,
                                               update_past_key_values=False, use_block_cache=True,
                                               block_past_key_values=state.block_cache)
        else:
            logits = yield self._block_rows(state, block, False)
        return shift_logits(logits)[:, start:end], ("denoise", L)

    def commit(self, state: FastDLLMV2State, logits: torch.Tensor, kind: tuple,
               generator: torch.Generator | None = None, stats: GenerationStats | None = None) -> None:
        """The step's decision from its forward's logits (`kind`: which forward it was, its positions)."""
        what, positions = kind
        if what == "prefill":
            state.prefilled = True
            if stats is not None:
                stats.forward(1, positions)
            if state.prompt_length % self.block_size == 0:   # the next token, as an AR model picks it
                state.x = torch.cat([state.x, self._next_token(state, logits[0, -1])], dim=1)
            return
        if what == "store":
            self._after_store(state, logits, stats, positions)
            return
        if stats is not None:
            stats.forward(1, positions)
        S = self.small_block_size
        start, end = state.sub_block * S, (state.sub_block + 1) * S
        masked = state.x[:, state.block_start:] == self.mask_id
        self._commit_sub_block(state, logits, masked, start, end, generator, stats)

    def _after_store(self, state: FastDLLMV2State, logits: torch.Tensor, stats: GenerationStats | None,
                     positions: int) -> None:
        """A finished block was stored: the argmax of its last position opens the next block."""
        if stats is not None:
            stats.forward(1, positions)
        state.x = torch.cat([state.x, self._next_token(state, logits[0, -1])], dim=1)
        state.block_start = -1
        state.blocks_left -= 1
        if state.blocks_left <= 0:
            self._finish(state)

    def _commit_sub_block(self, state: FastDLLMV2State, logits: torch.Tensor, masked: torch.Tensor, start: int,
                          end: int, generator: torch.Generator | None, stats: GenerationStats | None) -> None:
        """One denoising step of the sub-block `[start, end)` from its (shifted) logits."""
        block = state.x[:, state.block_start:]
        constraint = state.constraint
        if constraint is not None:   # structured output: the frontier masked before the rule
            from ..parts.constrain_loops import filter_block, mask_frontier_rows

            window = (state.block_start + start, state.block_start + end)
            logits = mask_frontier_rows(constraint, logits, *window)
            prior = state.x[:, window[0]:window[1]].clone()
        tokens, token_probs, _ = choose_tokens(logits, self.top_p, self.temperature, self.mask_id, generator)
        commit = select_to_commit(token_probs, masked[:, start:end], self.threshold)
        sub = block[:, start:end]
        sub[commit] = tokens[commit]
        if stats is not None:
            stats.step(commit.sum())
        if constraint is not None:   # ... and the sub-block filtered after it
            filter_block(constraint, state.x, prior, tokens, logits, *window)
            commit = (sub != self.mask_id) & (prior != self.mask_id).logical_not()
        if bool(((tokens == self.stop_token) & commit).any()) and not state.finished:
            state.finished = True
            state.finished_block = state.block_start // self.block_size
        if self.stop_mode == "generate" and self._stop_reached(state):
            self._finish(state)

    def _open_block(self, state: FastDLLMV2State) -> None:
        """The next block: masks up to the block boundary (a whole block when x ends on one)."""
        L = self.block_size
        if self.stop_mode == "generate" and bool((state.x[:, state.prompt_length:] == self.stop_token).any()):
            self._finish(state)
            return
        if state.blocks_left <= 0:
            self._finish(state)
            return
        state.new_start = state.x.shape[1]
        masks = torch.full((1, L - state.new_start % L), self.mask_id, dtype=torch.long, device=state.x.device)
        state.x = torch.cat([state.x, masks], dim=1)
        state.block_start = state.x.shape[1] - L
        state.sub_block = 0
        state.block_cache = None

    def _stop_reached(self, state: FastDLLMV2State) -> bool:
        """`generate`'s test: a stop in the block's new part with no mask before the first one."""
        new = state.x[0, state.new_start:]
        stops = (new == self.stop_token).nonzero()
        return len(stops) > 0 and not bool((new[:int(stops[0])] == self.mask_id).any())

    def _finish(self, state: FastDLLMV2State) -> None:
        state.done = True
        answer = state.x[0, state.prompt_length:]
        stops = (answer == self.stop_token).nonzero()
        if self.stop_mode == "generate":
            if len(stops):   # truncate after the first stop (the masks after it go with it)
                state.x = state.x[:, :state.prompt_length + int(stops[0]) + 1]
        elif state.finished:
            answer[int(stops[0]) + 1:] = self.pad_token
        state.block_start = -1


class FastDLLMV2FreeDave(BlockFreeDave, FastDLLMV2Decoder):
    """Fast-dLLM v2's `generate` loop with FreeDave (`diffusion/methods/freedave_blocks.py`): the tokens of
    the same loop without it — greedy, its sub-block rule (`threshold >= 1`: one token per step,
    lossless; below 1 the threshold rule, lossless with ``match_rule="exact"``), the prefix cache or
    none — with fewer forwards. Drafts may run into the next sub-blocks; verification decides."""

    def __init__(self, freedave: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        check_freedave_loop(freedave, "Fast-dLLM v2", temperature=self.temperature, one_per_step=True,
                            steps_name="threshold",
                            rule_ok=not self.use_block_cache and self.stop_mode == "generate",
                            rule="use_block_cache / batch_sample: FreeDave runs generate's loop with the prefix cache "
                                 "(use_block_cache=False)", block_length=self.block_length)
        self.freedave = freedave

    @property
    def block_length(self) -> int:
        return self.block_size

    def _span(self, state: FastDLLMV2State) -> tuple[int, int]:
        return state.block_start, state.block_start + self.block_size

    def _fd_pending(self, state: FastDLLMV2State) -> bool:
        # after `_settle`: prefilled means inside a block
        return not state.prefilled or not bool((state.x[:, state.block_start:] == self.mask_id).any())

    def _fd_scores(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return choose_tokens(logits, self.top_p, 0.0, self.mask_id, None)[:2]

    def _fd_rule(self, tokens: torch.Tensor, x0: torch.Tensor, conf: torch.Tensor) -> torch.Tensor:
        out = tokens.clone()
        S = self.small_block_size
        for n in range(out.shape[0]):   # the loop's step: the first sub-block holding a mask
            masked = out[n:n + 1] == self.mask_id
            if not bool(masked.any()):
                continue
            start = int(masked[0].nonzero()[0]) // S * S
            sub = out[n:n + 1, start:start + S]
            commit = select_to_commit(conf[n:n + 1, start:start + S], masked[:, start:start + S], self.threshold)
            sub[commit] = x0[n:n + 1, start:start + S][commit]
        return out

    def _fd_forwards(self, state: FastDLLMV2State, blocks: torch.Tensor
                     ) -> Generator[ForwardRequest, Any, torch.Tensor]:
        """Shifted logits `[K, L, V]` of K versions of the current block: without the cache the
        sequence up to the block's end, as the loop's own forward; with it the loop's own
        whole-block forward for each version, one row each against the one prefix cache."""
        K, L = blocks.shape
        start, end = self._span(state)
        if not self.use_cache:
            seqs = state.x[:, :end].repeat(K, 1)
            seqs[:, start:end] = blocks
            logits = yield ForwardRequest.call(seqs, {}, rows=slice(start, None), rows_alone=K > 1)
        else:
            logits = yield self._block_rows(state, blocks, False)
        return shift_logits(logits)

    def _fd_committed(self, state: FastDLLMV2State) -> None:
        if self._stop_reached(state):   # generate's stop: a stop with no mask before it
            self._finish(state)

    def _fd_block_done(self, state: FastDLLMV2State) -> None:
        pass   # the next step stores the block and takes the next block's first token (the loop's step)


def decode(model: torch.nn.Module, decoder: FastDLLMV2Decoder, input_ids: torch.Tensor,
           generator: torch.Generator | None = None, stats: GenerationStats | None = None,
           skip_first_block: bool | None = None) -> FastDLLMV2State:
    """Drive `decoder` on one prompt `[1, P]` to the end; returns the final state."""
    state = decoder.start(model, input_ids, skip_first_block=skip_first_block)
    while not state.done:
        decoder.step(model, state, generator, stats)
    return state


@torch.no_grad()
def fast_dllm_v2_generate(model: torch.nn.Module, input_ids: torch.Tensor, *, max_new_tokens: int,
                          mask_id: int = 151665, threshold: float = 1.0, small_block_size: int = 8,
                          block_size: int = 32, stop_token: int = 151645, top_p: float = 0.95,
                          temperature: float = 0.0, use_block_cache: bool = False,
                          prefill_whole_block_prompt: bool = True, generator: torch.Generator | None = None,
                          stats: GenerationStats | None = None, use_cache: bool = True,
                          decoder: Any = None, structured_outputs: Any = None,
                          tokenizer: Any = None) -> torch.LongTensor:
    """The official `generate` loop on prompts `[B, P]`; each row is decoded alone (upstream's stop
    test and truncation read the whole batch). Returns `[B, n]`: each row truncated after its first
    stop as upstream truncates a batch of one, shorter rows right-padded with `stop_token`.
    `decoder=remask.FreeDave(...)`: the same tokens with fewer forwards (`FastDLLMV2FreeDave`).
    `structured_outputs`: each answer held to it (compiled against `tokenizer`, default the one saved
    beside the model; `stop_token` ends it, only where it is complete)."""
    check_int("max_new_tokens", max_new_tokens, minimum=0)
    check_int("block_size", block_size, minimum=1)
    check_generator(generator, input_ids.device if torch.is_tensor(input_ids) else "cpu")
    check_stats("stats", stats)
    if not torch.is_tensor(input_ids) or input_ids.dim() != 2 or input_ids.shape[0] == 0:
        raise ValueError(f"input_ids must be a LongTensor [batch, length], got {getattr(input_ids, 'shape', None)}")
    kwargs = dict(mask_id=mask_id, num_blocks=max_new_tokens // block_size, block_size=block_size,
                  small_block_size=small_block_size, threshold=threshold, stop_token=stop_token,
                  top_p=top_p, temperature=temperature, use_block_cache=use_block_cache,
                  stop_mode="generate", prefill_whole_block_prompt=prefill_whole_block_prompt, use_cache=use_cache)
    loop = FastDLLMV2Decoder(**kwargs) if decoder is None else FastDLLMV2FreeDave(decoder, **kwargs)
    if structured_outputs is not None:
        from ..parts.constrain_loops import compile_for

        loop.constrain(compile_for(structured_outputs, model, tokenizer, mask_id))
        loop.structure.check_budget(max_new_tokens)
    if stats is not None:
        stats.start()
    rows = [decode(model, loop, input_ids[b:b + 1], generator, stats).x for b in range(input_ids.shape[0])]
    width = max(row.shape[1] for row in rows)
    out = torch.full((len(rows), width), stop_token, dtype=torch.long, device=input_ids.device)
    for b, row in enumerate(rows):
        out[b, :row.shape[1]] = row[0]
    if stats is not None:
        stats.stop(int(sum(row.shape[1] for row in rows) - input_ids.numel()))
    return out


@torch.no_grad()
def fast_dllm_v2_batch_sample(model: torch.nn.Module, input_ids: torch.Tensor, seq_len: torch.Tensor, *,
                              min_len: int, block_size: int, max_new_tokens: int, small_block_size: int,
                              pad_token: int, mask_id: int = 151665, threshold: float = 0.95,
                              stop_token: int = 151645, use_block_cache: bool = False, top_p: float = 0.95,
                              temperature: float = 0.0, prefill_whole_block_prompt: bool = True,
                              generator: torch.Generator | None = None,
                              stats: GenerationStats | None = None) -> dict[int, torch.Tensor]:
    """The official `batch_sample` on prompts `[B, W]` (row b's prompt: its first `seq_len[b]`
    tokens): returns {row: 1-D tensor}, as upstream. Each row is decoded alone with upstream's
    block budget (`max_new_tokens // block_size + max(seq_len) // block_size` blocks counted from
    block 0); a finished row keeps the one pad token upstream appends while batch-mates go on."""
    if not torch.is_tensor(input_ids) or input_ids.dim() != 2 or input_ids.shape[0] == 0 or input_ids.dtype != torch.long:
        raise ValueError(f"input_ids must be a LongTensor [batch, length], got {getattr(input_ids, 'shape', None)}")
    if not torch.is_tensor(seq_len) or seq_len.dim() != 1 or seq_len.shape[0] != input_ids.shape[0] \
            or seq_len.is_floating_point():
        raise ParameterTypeError(f"seq_len must be an integer tensor [batch={input_ids.shape[0]}] of prompt lengths, "
                                 f"got {getattr(seq_len, 'shape', seq_len)!r}")
    lengths = [int(n) for n in seq_len.tolist()]
    if min(lengths) < 1 or max(lengths) > input_ids.shape[1]:
        raise ValueError(f"seq_len must lie in [1, {input_ids.shape[1]}] (the width of input_ids), got {lengths}")
    check_real("min_len", min_len)
    if min_len != min(lengths):
        raise ValueError(f"min_len must be the shortest prompt, min(seq_len) = {min(lengths)}, got {min_len}")
    check_int("block_size", block_size, minimum=1)
    check_int("max_new_tokens", max_new_tokens, minimum=0)
    check_generator(generator, input_ids.device)
    check_stats("stats", stats)
    num_blocks = max_new_tokens // block_size + max(lengths) // block_size
    # upstream forwards no block before min_len's; with min_len == block_size the prompt's first
    # block is never in the cache (`prefill_whole_block_prompt=False` keeps that)
    skip = not prefill_whole_block_prompt and int(min_len) == block_size
    if stats is not None:
        stats.start()
    states = []
    for b, length in enumerate(lengths):
        decoder = FastDLLMV2Decoder(mask_id=mask_id, num_blocks=num_blocks - length // block_size,
                                    block_size=block_size, small_block_size=small_block_size, threshold=threshold,
                                    stop_token=stop_token, pad_token=pad_token, top_p=top_p, temperature=temperature,
                                    use_block_cache=use_block_cache, stop_mode="batch_sample",
                                    prefill_whole_block_prompt=prefill_whole_block_prompt)
        states.append(decode(model, decoder, input_ids[b:b + 1, :length], generator, stats, skip_first_block=skip))
    # upstream's batch: a row finished in block k leaves with the pad appended at k's end when a
    # batch-mate goes on past k; unfinished rows come last
    last = [s.finished_block if s.finished else num_blocks for s in states]
    out: dict[int, torch.Tensor] = {}
    for b in sorted(range(len(states)), key=lambda b: (last[b], b)):
        row = states[b].x[0]
        if states[b].finished and any(last[r] > last[b] for r in range(len(states)) if r != b):
            row = torch.cat([row, row.new_tensor([pad_token])])
        out[b] = row
    if stats is not None:
        stats.stop(int(sum(len(row) for row in out.values()) - sum(lengths)))
    return out


FAST_DLLM_V2_SETTINGS = ("block_size", "small_block_size", "use_block_cache")


def check_fast_dllm_v2_settings(settings: Any) -> dict:
    """A request's Fast-dLLM v2 settings (`SamplingParams.fast_dllm_v2`): keys from FAST_DLLM_V2_SETTINGS."""
    out = check_settings("fast_dllm_v2", settings, FAST_DLLM_V2_SETTINGS)
    for name in ("block_size", "small_block_size"):
        if name in out:
            check_int(f"fast_dllm_v2.{name}", out[name], minimum=1)
    if "block_size" in out and out.get("small_block_size", 1) > out["block_size"]:
        raise ValueError(f"fast_dllm_v2.small_block_size must be <= fast_dllm_v2.block_size ({out['block_size']}), "
                         f"got {out['small_block_size']}")
    if "use_block_cache" in out:
        check_bool("fast_dllm_v2.use_block_cache", out["use_block_cache"])
    return out


def engine_decoder(engine: Any, params: Any) -> FastDLLMV2Decoder:
    """One engine request's Fast-dLLM v2 loop (`Family.engine_decoder`): the official `generate`
    (`remask.compat.fast_dllm_v2.generate`) with `max_new_tokens` = `max_tokens` rounded up to whole
    blocks. Reads `temperature`, `top_p` (default 0.95), `threshold` (default 0.9, the official
    chatbot's) and `params.fast_dllm_v2` (`block_size` — default the config's `bd_size` —,
    `small_block_size` (8), `use_block_cache`); refuses every other decoding setting by name."""
    from dataclasses import fields

    read = ("max_tokens", "n", "seed", "stop", "stop_token_ids", "temperature", "top_p", "threshold", "fast_dllm_v2",
            "decoder", "structured_outputs")
    set_here = [f.name for f in fields(type(params)) if f.name not in read and getattr(params, f.name) != f.default]
    if set_here:
        raise ValueError(f"a block-causal model (Fast-dLLM v2) does not read {set_here}; its settings are "
                         f"temperature, top_p, threshold and fast_dllm_v2={{{', '.join(FAST_DLLM_V2_SETTINGS)}}}")
    if params.stop_token_ids:
        raise ValueError("stop_token_ids: Fast-dLLM v2's loop stops at one stop token (the model's EOS)")
    settings = dict(params.fast_dllm_v2 or {})
    block_size = settings.pop("block_size", engine.spec.block_length or 32)
    check_block_within_context(engine.spec, "fast_dllm_v2.block_size", block_size)   # the canvas is whole blocks
    kind, threshold = FastDLLMV2Decoder, 0.9 if params.threshold is None else params.threshold
    if params.decoder is not None:
        # FreeDave sets the rule: one token per step (threshold 1.0: only the most probable), or its
        # threshold rule
        from dataclasses import replace
        from functools import partial

        from ..parts.checks import check_instance
        from ..methods.freedave import FreeDave

        check_instance("decoder", params.decoder, FreeDave, "remask.FreeDave (the decoder block-causal models take)")
        fd = params.decoder
        threshold = 1.0 if fd.confidence_threshold is None else fd.confidence_threshold
        kind = partial(FastDLLMV2FreeDave, replace(fd, confidence_threshold=None))
    return kind(mask_id=engine.spec.mask_id, num_blocks=-(-params.max_tokens // block_size),
                block_size=block_size, small_block_size=settings.pop("small_block_size", 8), threshold=threshold,
                stop_token=engine.spec.eos_id, top_p=0.95 if params.top_p is None else params.top_p,
                temperature=params.temperature, stop_mode="generate", **settings)
