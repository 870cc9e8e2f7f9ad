"""Fast-dLLM v2's block diffusion decoding (NVlabs/Fast-dLLM `v2/generation_functions.py::batch_sample`
and the official model's `generate`).

Autoregressive over blocks of `block_size`, each denoised one sub-block of `small_block_size` at a
time: forward the whole block against the prefix cache without storing it, shift the logits by one
position (row i takes the logit of i−1, the first row its own), and commit the sub-block's masked
positions above `threshold` plus always the most probable one. A full block is forwarded once more
to store it, and the argmax of its last logit is the next block's first token (as after a prefill
ending on a block boundary). With `use_block_cache` a sub-block whose first position is decoded
forwards only itself against the block's stored keys and values (refreshed when a sub-block starts
masked; its first row then takes its own logit). Stops: `generate` ends once a stop token has no
mask before it and truncates after it; `batch_sample` finishes a row at the end of the block where
it committed a stop and writes pad after the first stop.

Upstream's draws are replayed (at temperature > 0 `torch.multinomial` over the sub-block's top-p
renormalized softmax with torch's global generator, or `generator`). Departures (docs/block-diffusion.md,
where upstream breaks its own output): a prompt of exactly one block is prefilled like any longer one
(upstream never caches it, so it decodes without the prompt; `prefill_whole_block_prompt=False`
keeps that); rows of a batch are decoded each alone (upstream samples every row with row 0's draws
and crashes, and decides the sub-block cache refresh for the whole batch); a chosen mask token
becomes the most probable other token (upstream commits it, which at temperature 0 loops forever).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Generator, Sequence

import torch
from transformers.cache_utils import DynamicCache

from remask.caches.block import PackedRows
from remask.models.fast_dllm_v2 import RowBatch
from remask.models.spec import ModelSpec, shift_logits

from ..parts.blocks import BlockLoop, LoopState, check_part, check_prompt, engine_settings, family_config
from ..parts.checks import (NoWorkBound, ParameterTypeError, check_bool, check_choice, check_generator, check_int,
                            check_ints, check_real, check_stats, checked)
from ..parts.constrain import before_rule
from ..parts.constrain_loops import filter_block, next_token, structure_for_call
from ..parts.scoring import sample_categorical
from ..parts.stats import GenerationStats
from ..parts.stepper import ForwardRequest, decode_alone

STOP_MODES = ("generate", "batch_sample")


def choose_tokens(logits: torch.Tensor, top_p: float, temperature: float, mask_id: int | None,
                  generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens `[B, L]`, their probabilities, the distributions) for logits `[B, L, V]`, as the official
    `sample_with_top_p` (T = 0: the softmax's argmax; T > 0: a `torch.multinomial` draw per row from the
    renormalized top-p nucleus of softmax(logits / T); upstream: row 0's only). A drawn mask becomes the next best."""
    return sample_categorical(logits, temperature, None, top_p, generator=generator, exclude_id=mask_id,
                              top_p_on="probs", filter_greedy=False, per_row=True)


def select_to_commit(token_probs: torch.Tensor, masked: torch.Tensor, threshold: float) -> torch.Tensor:
    """The official rule: masked positions above `threshold`, plus the most probable masked one."""
    confidence = torch.where(masked, token_probs, -torch.inf)
    commit = confidence > threshold
    commit[torch.arange(commit.shape[0]), confidence.argmax(dim=-1)] = True
    return commit & masked


class BlockRows(PackedRows, RowBatch):
    """A whole-block forward's cache argument (`RowBatch`: each row over its own prefix cache, storing as `stores`
    says, under its official block mask): the block's row or FreeDave's drafts; stacked as `BlockBatch`."""

    ROWS = ("caches", "stores", "block_sizes")


@dataclass(eq=False)
class FastDLLMV2State(LoopState):
    """One prompt under the loop: `x` `[1, n]` (prompt, decoded blocks, the current block), its caches,
    where the current block (-1: none) and its new part start; `finished`: a stop was committed."""

    blocks_left: int
    skip_first_block: bool
    cache: Any = None
    block_cache: Any = None
    block_start: int = -1
    new_start: int = -1
    sub_block: int = 0
    prefilled: bool = False
    finished: bool = False


class FastDLLMV2Decoder(BlockLoop):
    """Fast-dLLM v2's loop: each `step` is one model forward — the prefill, a denoising forward of the current
    sub-block, or the store of a full block (yielding the next block's first token). `stop_mode`: the official
    "generate"'s or "batch_sample"'s ending; `num_blocks`: upstream's block count. `decoder`: None, or FreeDave
    (`BlockLoop._take`; generate's loop with the prefix cache: greedy, `threshold >= 1` lossless, below 1 with
    ``match_rule="exact"``: the same tokens with fewer forwards, drafts crossing sub-blocks)."""

    family = "Fast-dLLM v2"

    def __init__(self, decoder: Any = None, *, mask_id: int, num_blocks: int, block_size: int = 32,
                 small_block_size: int = 8, threshold: float = 0.9, stop_token: int = 151645,
                 pad_token: int | None = None, top_p: float = 0.95, temperature: float = 0.0,
                 use_block_cache: bool = False, stop_mode: str = "generate", prefill_whole_block_prompt: bool = True,
                 use_cache: bool = True):
        check_ints(0, mask_id=mask_id, num_blocks=num_blocks, stop_token=stop_token)
        check_ints(1, block_size=block_size, small_block_size=small_block_size)
        if block_size % small_block_size:
            # upstream never decodes the positions past the last whole sub-block and loops forever
            raise ValueError(f"small_block_size must divide block_size ({block_size}), got {small_block_size}")
        check_real("threshold", threshold)
        check_real("top_p", top_p, low=0, high=1, low_open=True)
        check_real("temperature", temperature, low=0)
        check_bool("use_block_cache", use_block_cache)
        check_choice("stop_mode", stop_mode, STOP_MODES)
        check_int("pad_token", pad_token, minimum=0, allow_none=True)
        check_bool("prefill_whole_block_prompt", prefill_whole_block_prompt)
        if stop_mode == "batch_sample" and pad_token is None:
            raise ValueError("pad_token is needed with stop_mode='batch_sample' (the tokenizer's pad_token_id)")
        # use_cache=False: every forward covers the sequence up to the current block (the check that
        # the prefix cache is exact: the same tokens when block_size is the official 32)
        check_bool("use_cache", use_cache)
        if not use_cache and (use_block_cache or not prefill_whole_block_prompt):
            raise ValueError("use_cache=False runs without any cache: not with use_block_cache=True or "
                             "prefill_whole_block_prompt=False")
        self.mask_id, self.num_blocks, self.small_block_size = mask_id, num_blocks, small_block_size
        self.block_size = self.block_length = block_size   # `block_length`: `BlockLoop`'s name
        self.threshold, self.stop_token, self.pad_token, self.top_p = threshold, stop_token, pad_token, top_p
        self.stop_ids = [stop_token]
        self.temperature, self.use_block_cache, self.use_cache = temperature, use_block_cache, use_cache
        self.stop_mode, self.prefill_whole_block_prompt = stop_mode, prefill_whole_block_prompt
        self._take(decoder)

    def num_final(self, state: FastDLLMV2State) -> int:
        """Generated positions that are final: all before the block being decoded (all once done)."""
        end = state.x.shape[1] if state.done or state.block_start < 0 else state.block_start
        return max(0, end - state.prompt_length)

    def start(self, input_ids: torch.Tensor, skip_first_block: bool | None = None) -> FastDLLMV2State:
        """A state for one prompt `[1, P]`. `skip_first_block`: upstream's prompt whose first block is
        never forwarded (None: decided from `prefill_whole_block_prompt` and P)."""
        check_prompt(input_ids, self.mask_id, self.family, "input_ids")
        prompt_length = input_ids.shape[1]
        if skip_first_block is None:
            skip_first_block = not self.prefill_whole_block_prompt and prompt_length == self.block_size
        if self.structure is not None and self.stop_mode != "generate":
            raise ValueError("structured_outputs: enforced in generate's loop (stop_mode='generate'), "
                             "not batch_sample's")
        return FastDLLMV2State(x=input_ids.clone(), prompt_length=prompt_length, blocks_left=self.num_blocks,
                               skip_first_block=skip_first_block,
                               constraint=self._constraint(prompt_length, (self.num_blocks + 1) * self.block_size))

    def _next_token(self, state: FastDLLMV2State, logits_row: torch.Tensor) -> torch.Tensor:
        """A block's first token `[1, 1]`: the argmax; under a structure the best one it allows."""
        if state.constraint is None or state.constraint.matchers[0].ended:
            return logits_row.argmax(dim=-1).view(1, 1)
        return torch.tensor([[next_token(state.constraint, logits_row.reshape(-1))]], device=state.x.device)

    def _prefill_span(self, state: FastDLLMV2State) -> tuple[int, int]:
        first = self.block_size if state.skip_first_block else 0
        return first, state.prompt_length // self.block_size * self.block_size

    def _settle(self, state: FastDLLMV2State) -> None:
        """A prefill with nothing to forward, the next block opened (or the end), `batch_sample`'s end."""
        while not state.done:
            if not state.prefilled:
                first, end = self._prefill_span(state)
                if end > first and (self.use_cache or state.prompt_length % self.block_size == 0):
                    return   # the prefill's forward
                state.prefilled = True
            elif state.block_start < 0:   # between blocks
                self._open_block(state)
            else:
                if self.stop_mode == "batch_sample" and state.finished and self._block_full(state):
                    self._finish(state)
                return

    def _block_rows(self, state: FastDLLMV2State, blocks: torch.Tensor, store: bool) -> ForwardRequest:
        """The whole-block forward of `blocks` `[K, L]` against the prefix cache (storing when `store`,
        under the block's mask; else under the official default block size 32)."""
        K = blocks.shape[0]
        if state.cache is None:   # nothing prefilled (a prompt shorter than a block): an empty cache
            state.cache = DynamicCache()
        return ForwardRequest.call(blocks, {}, cache=BlockRows([state.cache] * K, [store] * K,
                                                               [self.block_size if store else 32] * K),
                                   rows_alone=K > 1)

    def _loop_forward(self, state: FastDLLMV2State) -> Generator[ForwardRequest, Any, tuple[torch.Tensor, tuple]]:
        """The prefill, a full block's store, or a denoising forward of the current sub-block (the whole block, or the
        sub-block alone once the block is in the sub-block cache); returns (shifted, cut logits, (kind, positions))."""
        L, block = self.block_size, state.x[:, state.block_start:]   # the current block (once prefilled)
        masked = block == self.mask_id
        if not state.prefilled or not bool(masked.any()):   # the prefill, or a finished block's store: the next token
            what = "store" if state.prefilled else "prefill"
            first, end = (state.block_start, state.x.shape[1]) if state.prefilled else self._prefill_span(state)
            if not self.use_cache:   # the sequence's own forward, for the next token only
                return (yield ForwardRequest.call(state.x[:, :end], {}, rows=slice(-1, None), block_size=L)), \
                    (what, end)
            if end - first == L:   # one block: a block store (a prefill's positions count from the cache: 0)
                return (yield self._block_rows(state, state.x[:, first:end], True)), (what, L)
            state.cache = DynamicCache()
            logits = yield ForwardRequest.call(state.x[:, first:end], {}, cache=state.cache, rows=slice(-1, None),
                                               use_cache=True, update_past_key_values=True, block_size=L)
            return logits, (what, end - first)
        S = self.small_block_size
        while not bool(masked[:, state.sub_block * S:(state.sub_block + 1) * S].any()):
            state.sub_block += 1
        start, end = state.sub_block * S, (state.sub_block + 1) * S
        if not self.use_block_cache:   # the whole block (without a cache: the sequence up to its end)
            logits = yield from self._fd_forwards(state, block)
            return logits[:, start:end], ("denoise", L if self.use_cache else state.block_start + L)
        kept = dict(cache=state.cache, use_cache=True, update_past_key_values=False, use_block_cache=True)
        if state.block_cache is not None and not bool(block[0, start] == self.mask_id):   # the sub-block alone
            logits = yield ForwardRequest.call(block[:, start:end], {}, block_past_key_values=state.block_cache,
                                               replace_position=start, **kept)
            return shift_logits(logits), ("denoise", end - start)
        state.block_cache = DynamicCache()   # the whole block, its keys and values kept in a new sub-block cache
        logits = shift_logits((yield ForwardRequest.call(block, {}, block_past_key_values=state.block_cache, **kept)))
        return logits[:, start:end], ("denoise", L)

    def _loop_commit(self, state: FastDLLMV2State, logits: torch.Tensor, what: str,
                     generator: torch.Generator | None = None, stats: GenerationStats | None = None) -> None:
        """The step's decision from its forward's logits (`what`: which forward it was)."""
        if what == "denoise":
            return self._denoise(state, logits, generator, stats)
        # the next token, as an AR model picks it: after a stored block (it opens the next block), or
        # after a prompt that ends on a block boundary
        if what == "store" or state.prompt_length % self.block_size == 0:
            state.x = torch.cat([state.x, self._next_token(state, logits[0, -1])], dim=1)
        if what == "prefill":
            state.prefilled = True
            return
        state.block_start = -1
        state.blocks_left -= 1
        if state.blocks_left <= 0:
            self._finish(state)

    def _denoise(self, state: FastDLLMV2State, logits: torch.Tensor, generator: torch.Generator | None,
                 stats: GenerationStats | None) -> None:
        """One denoising step of the current sub-block from its (shifted) logits."""
        S = self.small_block_size
        window = (state.block_start + state.sub_block * S, state.block_start + (state.sub_block + 1) * S)
        sub = state.x[:, window[0]:window[1]]
        masked = sub == self.mask_id
        logits, prior = before_rule(state.constraint, logits, sub, *window, 0)
        tokens, token_probs, _ = self._sample(logits, self.temperature, generator)
        commit = select_to_commit(token_probs, masked, self.threshold)
        sub[commit] = tokens[commit]
        if stats is not None:
            stats.step(commit.sum())
        if prior is not None:   # structured output: the sub-block filtered after the rule
            filter_block(state.constraint, state.x, prior, tokens, logits, *window)
            commit = (sub != self.mask_id) & masked
        if bool(((tokens == self.stop_token) & commit).any()):
            state.finished = True
        if self.stop_mode == "generate":
            self._fd_committed(state)

    def _open_block(self, state: FastDLLMV2State) -> None:
        """The next block: masks up to the block boundary (a whole block when x ends on one)."""
        L = self.block_size
        if state.blocks_left <= 0 or self.stop_mode == "generate" and \
                bool((state.x[:, state.prompt_length:] == self.stop_token).any()):
            self._finish(state)
            return
        state.new_start = state.x.shape[1]
        masks = torch.full((1, L - state.new_start % L), self.mask_id, dtype=torch.long, device=state.x.device)
        state.x = torch.cat([state.x, masks], dim=1)
        state.block_start = state.x.shape[1] - L
        state.sub_block, state.block_cache = 0, None

    def _fd_committed(self, state: FastDLLMV2State) -> None:
        """`generate`'s stop (after each commit, FreeDave's too): the end once the block's new part holds a stop with
        no mask before the first one."""
        new = state.x[0, state.new_start:]
        stops = (new == self.stop_token).nonzero()
        if len(stops) > 0 and not bool((new[:int(stops[0])] == self.mask_id).any()):
            self._finish(state)

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

    def _fd_loop(self) -> tuple:
        return (True, "threshold", not self.use_block_cache and self.stop_mode == "generate",
                "use_block_cache / batch_sample: FreeDave runs generate's loop with the prefix cache "
                "(use_block_cache=False)")

    def _span(self, state: FastDLLMV2State) -> tuple[int, int]:
        return state.block_start, state.block_start + self.block_size

    def _fd_pending(self, state: FastDLLMV2State) -> bool:
        return not state.prefilled or self._block_full(state)   # after `_settle`: prefilled means inside a block

    def _sample(self, logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> tuple:
        return choose_tokens(logits, self.top_p, temperature, self.mask_id, generator)

    def _select(self, masked: torch.Tensor, conf: torch.Tensor, count: int = 1) -> torch.Tensor:
        """FreeDave's rule on a `[1, L]` row (`DraftVerify`; `count` 1: the official rule commits at least one)."""
        transfer, S = torch.zeros_like(masked), self.small_block_size
        if bool(masked.any()):   # the loop's step: the first sub-block holding a mask
            start = int(masked[0].nonzero()[0]) // S * S
            transfer[:, start:start + S] = select_to_commit(conf[:, start:start + S], masked[:, start:start + S],
                                                            self.threshold)
        return transfer

    def _fd_forwards(self, state: FastDLLMV2State, blocks: torch.Tensor
                     ) -> Generator[ForwardRequest, Any, torch.Tensor]:
        """Shifted logits `[K, L, V]` of K versions of the current block, each as the loop's own forward."""
        return shift_logits((yield self._block_rows(state, blocks, False) if self.use_cache else
                             self._sequence_request(state, blocks, {})))


@torch.no_grad()
def fast_dllm_v2_generate(model: torch.nn.Module, input_ids: torch.Tensor, *, max_new_tokens: int,
                          mask_id: int = 151665, threshold: float = 1.0, small_block_size: int = 8,
                          block_size: int = 32, stop_token: int = 151645, top_p: float = 0.95,
                          temperature: float = 0.0, use_block_cache: bool = False,
                          prefill_whole_block_prompt: bool = True, generator: torch.Generator | None = None,
                          stats: GenerationStats | None = None, use_cache: bool = True,
                          decoder: Any = None, structured_outputs: Any = None,
                          tokenizer: Any = None) -> torch.LongTensor:
    """The official `generate` loop on prompts `[B, P]`, each row decoded alone (upstream's stop test and truncation
    read the whole batch). Returns `[B, n]`: each row truncated after its first stop, shorter rows right-padded with
    `stop_token`. `decoder=remask.FreeDave(...)`: the same tokens with fewer forwards. `structured_outputs`: each
    answer held to it (ended by `stop_token` where complete; compiled against `tokenizer`, default the model's)."""
    check_int("max_new_tokens", max_new_tokens, minimum=0)
    check_int("block_size", block_size, minimum=1)
    check_generator(generator, input_ids.device if torch.is_tensor(input_ids) else "cpu")
    stats = check_stats("stats", stats) or GenerationStats()   # None: counted, then dropped
    if not torch.is_tensor(input_ids) or input_ids.dim() != 2 or input_ids.shape[0] == 0:
        raise ValueError(f"input_ids must be a LongTensor [batch, length], got {getattr(input_ids, 'shape', None)}")
    loop = FastDLLMV2Decoder(decoder, mask_id=mask_id, num_blocks=max_new_tokens // block_size, block_size=block_size,
                             small_block_size=small_block_size, threshold=threshold, stop_token=stop_token,
                             top_p=top_p, temperature=temperature, use_block_cache=use_block_cache,
                             prefill_whole_block_prompt=prefill_whole_block_prompt, use_cache=use_cache)
    loop.constrain(structure_for_call(structured_outputs, model, tokenizer, loop.mask_id, max_new_tokens))
    stats.start()
    rows = [decode_alone(loop, model, loop.start(prompt), generator, stats).x[0] for prompt in input_ids.split(1)]
    stats.stop(int(sum(len(row) for row in rows) - input_ids.numel()))
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=stop_token)


@torch.no_grad()
def fast_dllm_v2_batch_sample(model: torch.nn.Module, input_ids: torch.Tensor, seq_len: torch.Tensor, *,
                              min_len: int, block_size: int, max_new_tokens: int, small_block_size: int,
                              pad_token: int, mask_id: int = 151665, threshold: float = 0.95,
                              stop_token: int = 151645, use_block_cache: bool = False, top_p: float = 0.95,
                              temperature: float = 0.0, prefill_whole_block_prompt: bool = True,
                              generator: torch.Generator | None = None,
                              stats: GenerationStats | None = None) -> dict[int, torch.Tensor]:
    """The official `batch_sample` on prompts `[B, W]` (row b's: its first `seq_len[b]` tokens): returns
    {row: 1-D tensor}, as upstream. Each row is decoded alone with upstream's block budget (counted
    from block 0); a finished row keeps the one pad token upstream appends while batch-mates go on."""
    if not torch.is_tensor(input_ids) or input_ids.dim() != 2 or input_ids.shape[0] == 0 \
            or input_ids.dtype != torch.long:
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
    stats = check_stats("stats", stats) or GenerationStats()   # None: counted, then dropped
    num_blocks = max_new_tokens // block_size + max(lengths) // block_size
    # upstream forwards no block before min_len's; with min_len == block_size the prompt's first
    # block is never in the cache (`prefill_whole_block_prompt=False` keeps that)
    skip = not prefill_whole_block_prompt and int(min_len) == block_size
    stats.start()
    states = []
    for b, length in enumerate(lengths):
        decoder = FastDLLMV2Decoder(mask_id=mask_id, num_blocks=num_blocks - length // block_size,
                                    block_size=block_size, small_block_size=small_block_size, threshold=threshold,
                                    stop_token=stop_token, pad_token=pad_token, top_p=top_p, temperature=temperature,
                                    use_block_cache=use_block_cache, stop_mode="batch_sample",
                                    prefill_whole_block_prompt=prefill_whole_block_prompt)
        state = decoder.start(input_ids[b:b + 1, :length], skip_first_block=skip)
        states.append(decode_alone(decoder, model, state, generator, stats))
    # upstream's batch: a row finished in block k (its last: x ends there) leaves with the pad appended at k's end
    # when a batch-mate goes on past k; unfinished rows come last
    last = [s.x.shape[1] // block_size - 1 if s.finished else num_blocks for s in states]
    pad = input_ids.new_tensor([pad_token])
    out = {b: torch.cat([states[b].x[0], pad]) if states[b].finished and max(last) > last[b] else states[b].x[0]
           for b in sorted(range(len(states)), key=lambda b: (last[b], b))}
    stats.stop(int(sum(len(row) for row in out.values()) - sum(lengths)))
    return out


@dataclass(frozen=True)
class FastDLLMV2Decoding(NoWorkBound):
    """Fast-dLLM v2's loop on an engine request (`SamplingParams(decoder=FastDLLMV2Decoding(...))`, JSON
    ``{"name": "fast_dllm_v2", ...}``): `generate`'s settings, None the loop's default (`block_size` the config's
    `bd_size`, `small_block_size` 8, no block cache). `rule`: the loop's commit part, remask.FreeDave (`decoder=`
    FreeDave is short for ``FastDLLMV2Decoding(rule=...)``). No setting sizes work past the block (`NoWorkBound`)."""

    qualified = True
    block_size: int | None = checked(None, check_int, minimum=1, allow_none=True)
    small_block_size: int | None = checked(None, check_int, minimum=1, allow_none=True)
    use_block_cache: bool | None = checked(None, check_bool, allow_none=True)
    rule: Any = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.small_block_size is not None and self.small_block_size > (self.block_size or math.inf):
            raise ValueError(f"FastDLLMV2Decoding.small_block_size must be <= FastDLLMV2Decoding.block_size "
                             f"({self.block_size}), got {self.small_block_size}")
        check_part(self, "Fast-dLLM v2", (), (), rules=False)


def engine_decoder(spec: ModelSpec, params: Any, *, store: Any, stop_ids: Sequence[int]) -> FastDLLMV2Decoder:
    """One engine request's Fast-dLLM v2 loop (`Family.engine_decoder`): the official `generate` with
    `max_new_tokens` = `max_tokens` rounded up to whole blocks, its settings from `decoder=` (`FastDLLMV2Decoding`, or
    FreeDave: `blocks.family_config`); `top_p` default 0.95, `threshold` 0.9 (the official chatbot's). FreeDave sets
    the rule (one token per step, threshold 1.0, or its threshold). `store` and `stop_ids` are not read (the loop
    keeps its rows' caches itself and stops at the model's EOS)."""
    config = family_config(params.decoder, FastDLLMV2Decoding, rules=False)
    settings, block_size, part, tau = engine_settings(spec, params, config, "Fast-dLLM v2", rules=False,
                                                      length="block_size", stops="one stop token (the model's EOS)")
    threshold = (0.9 if part is None else 1.0) if tau is None else tau   # FreeDave: one token per step
    return FastDLLMV2Decoder(part, mask_id=spec.mask_id, num_blocks=-(-params.max_tokens // block_size),
                             block_size=block_size, small_block_size=settings.pop("small_block_size", 8),
                             threshold=threshold, stop_token=spec.eos_id,
                             top_p=0.95 if params.top_p is None else params.top_p, temperature=params.temperature,
                             stop_mode="generate", **settings)
