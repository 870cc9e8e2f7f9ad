"""SDAR's block diffusion decoding (JetAstra/SDAR `generate.py::block_diffusion_generate`), and the
block loop SDAR, LLaDA2 and Fast-dLLM v2 share (`BlockLoop`; `StoreKVLoop` for the `store_kv` models).

Autoregressive over blocks, parallel inside one: the prompt's whole blocks are prefilled into the
KV cache (`store_kv=True`); each block is denoised by forwards of the block against the cache, each
step sampling every position (temperature, top-k, top-p; the confidence is the sampled token's
probability) and committing masked positions by `remasking_strategy` (`select_positions`), n per
step by the schedule (`block_length` split over `denoising_steps`, remainder first). A finished
block is forwarded once more to store it; decoding stops after a block holding a stop id.

Upstream's draws are replayed: `torch.multinomial` over the block's filtered, tempered softmax with
torch's global generator (or `generator`). Departures, where upstream breaks its own output
(docs/quirks.md): temperature 0 is greedy (upstream divides by zero); a step never commits more
positions than the block has masks (upstream's top-k fallback then overwrites prompt or committed
tokens); `entropy_bounded` uses each position's entropy (upstream's sums the sampled probability over
the block and crashes on an unset variable); positions left masked after a stop are filled with the
first stop id (upstream returns mask tokens); a sampled mask token becomes the most probable other
token (upstream commits it, the position stays masked and the loop fails with an IndexError).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from functools import partial
from typing import Any, Generator, Sequence

import torch
from transformers.cache_utils import DynamicCache

from remask.caches.block import BlockBatch, BlockKVCache

from ..parts.checks import (check_block_within_context, check_bool, check_choice, check_generator, check_instance,
                            check_int, check_real, check_settings, check_stats, check_steps)
from ..methods.freedave_blocks import BlockFreeDave, check_block_decoder, split_freedave
from ..parts.rules import CommitRule, check_rule_on_loop, commit_block, is_rule, rule_types, unread_settings
from ..parts.scoring import sample_categorical
from ..parts.stats import GenerationStats
from ..parts.stepper import ForwardRequest, ForwardThenCommit

REMASKING_STRATEGIES = ("sequential", "low_confidence_static", "low_confidence_dynamic", "entropy_bounded")


def num_transfer_schedule(block_length: int, steps: int) -> torch.Tensor:
    """Positions to commit at each step: `block_length` split evenly, the remainder to the first steps."""
    base, remainder = divmod(block_length, steps)
    counts = torch.full((steps,), base, dtype=torch.int64)
    counts[:remainder] += 1
    return counts


def sample_block(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                 generator: torch.Generator | None, mask_id: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, their probabilities, the distributions) for logits `[1, L, V]`: upstream's sampler
    (`sample_categorical`'s defaults: top-k then top-p to −inf, one multinomial draw over the block's rows;
    T = 0: the argmax). A drawn `mask_id` becomes the most probable other token."""
    shape, V = logits.shape[:-1], logits.shape[-1]
    token, token_prob, probs = sample_categorical(logits.reshape(-1, V), temperature, top_k, top_p,
                                                  generator=generator, exclude_id=mask_id)
    return token.view(*shape), token_prob.view(*shape), probs.view(*shape, V)


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


def select_positions(strategy: str, mask_index: torch.Tensor, x0_p: torch.Tensor, probs: torch.Tensor,
                     count: int, confidence_threshold: float | None, eb_threshold: float | None) -> torch.Tensor:
    """The masked positions of a `[1, L]` block to commit this step, at most as many as it has:
    ``"sequential"`` the first `count`, ``"low_confidence_static"`` the `count` most confident,
    ``"low_confidence_dynamic"`` `select_mask_to_token` at `confidence_threshold`, ``"entropy_bounded"``
    lowest entropy first while the running sum stays ≤ `eb_threshold`."""
    if strategy in ("low_confidence_static", "low_confidence_dynamic"):   # static: none is above +inf
        threshold = confidence_threshold if strategy == "low_confidence_dynamic" else torch.inf
        return select_mask_to_token(mask_index, x0_p, count, threshold)
    transfer = torch.zeros_like(mask_index)
    if strategy == "sequential":
        first = int(mask_index[0].nonzero()[0])
        transfer[0, first:first + min(count, int(mask_index.sum()))] = True
        return transfer & mask_index
    entropy = -(probs * torch.log(probs.clamp_min(1e-12))).sum(dim=-1)   # entropy_bounded
    entropy = torch.where(mask_index, entropy, torch.inf)
    sorted_entropy, order = torch.sort(entropy, dim=1)
    k = int(torch.searchsorted(torch.cumsum(sorted_entropy, dim=1)[0],
                               torch.tensor(eb_threshold, dtype=entropy.dtype), right=False))
    transfer[0, order[0, :max(1, min(k, int(mask_index.sum())))]] = True
    return transfer


SDAR_SETTINGS = ("block_length", "denoising_steps", "remasking_strategy", "confidence_threshold", "eb_threshold")


def check_sdar_settings(settings) -> dict:
    """A request's SDAR settings (`SamplingParams.sdar`): a dict with keys from SDAR_SETTINGS."""
    out = check_settings("sdar", settings, SDAR_SETTINGS)
    for name in ("block_length", "denoising_steps"):
        if name in out:
            check_int(f"sdar.{name}", out[name], minimum=1)
    if "block_length" in out and "denoising_steps" in out:   # else at the engine, with the model's block size
        check_steps("sdar.denoising_steps", out["denoising_steps"], out["block_length"], "sdar.block_length")
    if "remasking_strategy" in out:
        check_choice("sdar.remasking_strategy", out["remasking_strategy"], REMASKING_STRATEGIES)
    if "confidence_threshold" in out:
        check_real("sdar.confidence_threshold", out["confidence_threshold"], low=0, high=1)
    if out.get("eb_threshold") is not None:
        check_real("sdar.eb_threshold", out["eb_threshold"], low=0, low_open=True)
    return out


def block_request(blocks: torch.Tensor, positions: torch.Tensor, cache: Any, store: bool) -> ForwardRequest:
    """The forward of one block `[K, L]` (K versions: FreeDave's drafts) against `cache`, storing it when `store`:
    a `BlockBatch` of K rows over the one cache (never copied), each row its own forward (no mask: a block sees
    itself and every earlier one) with its linears as alone. The engine stacks such requests into one call."""
    K = blocks.shape[0]
    return ForwardRequest.call(blocks, dict(position_ids=positions.expand(K, -1)),
                               cache=BlockBatch([cache] * K, [store] * K), rows_alone=K > 1, use_cache=True,
                               store_kv=False)


def check_prompt(input_ids: Any, mask_id: int, family: str, name: str, empty_ok: bool = False) -> None:
    """A block loop decodes one prompt `[1, P]` (a LongTensor, argument `name`) without the mask id."""
    if not torch.is_tensor(input_ids) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise ValueError(f"{name} must be a LongTensor [1, length], got {getattr(input_ids, 'shape', None)}")
    if input_ids.shape[0] != 1:
        raise ValueError(f"{name}: {family}'s loop decodes one prompt (batch 1), got batch {input_ids.shape[0]}; "
                         "use remask.LLM for many")
    if input_ids.shape[1] == 0 and not empty_ok:
        raise ValueError(f"{name}: the prompt is empty")
    if bool((input_ids == mask_id).any()):
        raise ValueError(f"{name} holds the mask id {mask_id}: {family} decodes only after the prompt")


ENGINE_READS = ("max_tokens", "n", "seed", "stop", "stop_token_ids", "temperature", "top_p", "threshold", "decoder",
                "structured_outputs")


def refuse_unread(params: Any, family: str, reads: tuple, settings: str) -> None:
    """Refuse by name the request's settings (off their defaults) that the family's loop does not
    read: those outside `ENGINE_READS` and `reads`; `settings` lists what it reads."""
    unread = [f.name for f in fields(type(params))
              if f.name not in ENGINE_READS + reads and getattr(params, f.name) != f.default]
    if unread:
        raise ValueError(f"a block-causal model ({family}) does not read {unread}; its settings are {settings}")


class BlockLoop(ForwardThenCommit):
    """A block-causal family's loop as a `ForwardThenCommit` (`_forward` returns `(logits, kind)`: which forward it
    was, for `commit`), with `_settle(state)`: the moves that take no forward, made before each forward."""

    structure: Any = None   # structured output: a `remask.structured.CompiledStructure` (`constrain`)
    end_ids: tuple = ()

    def constrain(self, structure: Any, end_ids: Any = None) -> "BlockLoop":
        """Hold every answer to `structure` (`parts/constrain_loops.py`; the current block is the filter's window);
        `end_ids` (default: the loop's stop ids) end it where it is complete. Returns the decoder."""
        from ..parts.constrain_loops import end_ids_or_refuse

        self.structure = structure
        if structure is not None:
            self.end_ids = tuple(end_ids_or_refuse(self._default_end_ids() if end_ids is None else end_ids,
                                                   "the loop has no stop id (pass one)"))
        return self

    def _default_end_ids(self) -> list:
        return list(getattr(self, "stop_ids", ()))

    def _constraint(self, prompt_length: int, answer_len: int) -> Any:
        """A new state's commit filter (None without a structure)."""
        if self.structure is None:
            return None
        from ..parts.constrain_loops import block_filter

        return block_filter(self.structure, self.end_ids, self.mask_id, prompt_length, answer_len)

    def _span(self, state: Any) -> tuple[int, int]:   # the current block in state.x
        return state.block * self.block_length, (state.block + 1) * self.block_length

    def _count(self, stats: GenerationStats | None, rows: int, state: Any) -> None:
        """Count a forward of `rows` versions of the current block (without a cache: the sequence to its end)."""
        if stats is not None:
            stats.forward(rows, self.block_length if self.use_cache else self._span(state)[1])

    def _settle(self, state: Any) -> None:
        pass

    def next_forward(self, model: torch.nn.Module, state: Any, generator: torch.Generator | None = None,
                     stats: GenerationStats | None = None) -> ForwardRequest | None:
        self._settle(state)
        return super().next_forward(model, state, generator, stats)

    def step(self, model: torch.nn.Module, state: Any, generator: torch.Generator | None = None,
             stats: GenerationStats | None = None) -> None:
        self._settle(state)
        if not state.done:
            super().step(model, state, generator, stats)

    def run(self, model: torch.nn.Module, input_ids: torch.Tensor, generator: torch.Generator | None = None,
            stats: GenerationStats | None = None, **start: Any) -> Any:
        """Decode one prompt `[1, P]` to the end; returns the final state."""
        state = self.start(model, input_ids, **start)
        while not state.done:
            self.step(model, state, generator, stats)
        return state

    def structured(self, structured_outputs: Any, model: torch.nn.Module, tokenizer: Any, budget: int) -> None:
        """Hold a drop-in call's answers (up to `budget` tokens) to its `structured_outputs`."""
        if structured_outputs is not None:
            from ..parts.constrain_loops import compile_for

            self.constrain(compile_for(structured_outputs, model, tokenizer, self.mask_id))
            self.structure.check_budget(budget)


@dataclass(eq=False)
class BlockState:
    """One prompt under a `StoreKVLoop`: `x` `[1, total]` (prompt, then masks), the cache (or None),
    the block being decoded and its step; `stored` once the blocks before it are in the cache."""

    x: torch.Tensor
    prompt_length: int
    cache: Any
    attention: torch.Tensor
    position_ids: torch.Tensor
    block: int
    num_blocks: int
    stored: bool = False
    step: int = 0
    done: bool = False
    post_steps: int = 0       # LLaDA2.1: the forwards since the block's masks were gone
    end: int | None = None    # LLaDA2: where the output ends (after the first EOS), once done
    predictions: Any = None   # FreeDave's predictions for the current block (`BlockFreeDave`)
    rule_state: Any = None    # (block, the commit rule's per-block state), `commit_block`'s (`*Rules`)
    pending: Any = None       # the forward asked for and not yet answered (a sub-generator)
    constraint: Any = None    # structured output: a `CommitFilter` of one row (`BlockLoop.constrain`)


class StoreKVLoop(BlockLoop):
    """The loop of the `store_kv` models (SDAR, LLaDA2); the family supplies `_decide`. `use_cache=False`: each
    forward covers the sequence up to the current block under the block-causal mask (the cache's check)."""

    family = ""
    mask_dtype: Any = None   # the block-causal mask's dtype and leading dims, as the model's remote code takes it
    mask_lead = (1,)
    prompt_name, empty_prompt_ok = "input_ids", True   # `start`'s prompt, as the family's function names it
    block_store: Any = None   # the engine's `PagedKVStore` (each cache a `BlockKVCache`), or None: a `DynamicCache`

    def block_sizes(self, prompt_length: int) -> tuple[int, int]:
        """(positions of the prompt's whole blocks, positions of the whole sequence)."""
        L = self.block_length
        return prompt_length // L * L, (prompt_length + self.gen_length + L - 1) // L * L

    def pages_needed(self, manager: Any, prompt_ids: torch.Tensor) -> int | None:
        """Free pages a request with this prompt takes in the engine's store (all allocated at start);
        None without the store (a contiguous cache)."""
        if self.block_store is None:
            return None
        prefix, total = self.block_sizes(prompt_ids.shape[1])
        return BlockKVCache.pages_needed(manager, prompt_ids[0, :prefix].tolist(), total, self.block_length)

    def new_cache(self, input_ids: torch.Tensor) -> Any:
        """A new request's cache: pages of the engine's store, or a contiguous `DynamicCache`."""
        if self.block_store is None:
            return DynamicCache()
        prefix, total = self.block_sizes(input_ids.shape[1])
        return BlockKVCache(self.block_store, input_ids[0, :prefix].tolist(), total, self.block_length)

    def release(self, state: Any) -> None:
        """Give back the state's cache pages (the engine's paged cache), if it has any."""
        if hasattr(state.cache, "release"):
            state.cache.release()

    def start(self, model: torch.nn.Module, input_ids: torch.Tensor) -> BlockState:
        check_prompt(input_ids, self.mask_id, self.family, self.prompt_name, self.empty_prompt_ok)
        L, device, P = self.block_length, input_ids.device, input_ids.shape[1]
        num_blocks = (P + self.gen_length + L - 1) // L
        total = num_blocks * L
        x = torch.full((1, total), self.mask_id, dtype=torch.long, device=device)
        x[:, :P] = input_ids
        blocks = torch.tril(torch.ones(num_blocks, num_blocks, dtype=self.mask_dtype, device=device))
        attention = blocks.repeat_interleave(L, 0).repeat_interleave(L, 1).view(*self.mask_lead, total, total)
        return BlockState(x=x, prompt_length=P, cache=self.new_cache(input_ids) if self.use_cache else None,
                          attention=attention, position_ids=torch.arange(total, device=device)[None], block=P // L,
                          num_blocks=num_blocks, stored=P < L or not self.use_cache,
                          constraint=self._constraint(P, total - P))

    def num_final(self, state: BlockState) -> int:
        """Generated positions that are final: those of the finished blocks (the answer once done)."""
        if state.done:
            return self._end(state) - state.prompt_length
        return max(0, state.block * self.block_length - state.prompt_length)

    def _block_full(self, state: BlockState) -> bool:
        start, end = self._span(state)
        return not bool((state.x[:, start:end] == self.mask_id).any())

    def _store_request(self, state: BlockState, start: int, end: int) -> ForwardRequest:
        """The forward storing the whole blocks `x[start:end]` (one block: a block forward like the others)."""
        if end - start == self.block_length:
            return block_request(state.x[:, start:end], state.position_ids[:, start:end], state.cache, True)
        return ForwardRequest.call(state.x[:, start:end], dict(attention_mask=state.attention[..., start:end, :end],
                                                               position_ids=state.position_ids[:, start:end]),
                                   cache=state.cache, use_cache=True, store_kv=True)

    def _forward(self, state: BlockState) -> Generator[ForwardRequest, Any, tuple[torch.Tensor | None, Any]]:
        """The store of the blocks before the current one (the prompt's, or the block just decoded),
        else a decoding step of the current block. Returns (logits, ("stored", positions) or "decide")."""
        start, end = self._span(state)
        if not state.stored:
            cached = state.cache.get_seq_length()
            yield self._store_request(state, cached, start)
            return None, ("stored", start - cached)
        if self.use_cache:
            logits = yield block_request(state.x[:, start:end], state.position_ids[:, start:end], state.cache, False)
        else:
            logits = yield ForwardRequest.call(state.x[:, :end], dict(attention_mask=state.attention[..., :end, :end],
                                                                      position_ids=state.position_ids[:, :end]),
                                               rows=slice(-self.block_length, None))
        return logits, "decide"

    def commit(self, state: BlockState, logits: torch.Tensor | None, kind: Any,
               generator: torch.Generator | None = None, stats: GenerationStats | None = None) -> None:
        if isinstance(kind, tuple):   # the forward stored the blocks before the current one
            state.stored = True
            if stats is not None:
                stats.forward(1, kind[1])
            return
        self._count(stats, 1, state)
        if kind == "store":
            self._next_block(state)
        else:
            self._decide(state, logits, generator, stats)

    def _constrain_before(self, state: BlockState, logits: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Structured output, before the rule: the frontier's logits masked; the block as it was."""
        if state.constraint is None:
            return logits, None
        from ..parts.constrain_loops import mask_frontier_rows

        start, end = self._span(state)
        return mask_frontier_rows(state.constraint, logits, start, end), state.x[:, start:end].clone()


class BlockRules:
    """Mixin over a `StoreKVLoop`: one of dInfer's commit rules chooses each step's commits (greedy) instead of the
    family's rule, until the block has no mask (each step commits one or more). A combination no paper shipped."""

    def __init__(self, rule: Any, **kwargs: Any) -> None:
        check_instance("decoder", rule, CommitRule,
                       "a remask commit rule (" + ", ".join(t.__name__ for t in rule_types()) + ")")
        super().__init__(**kwargs)
        check_rule_on_loop(rule, self.family, temperature=self.temperature, **self._rule_replaces())
        self.rule = rule

    def _rule_replaces(self) -> dict:
        return {}

    def _rule_commit(self, state: BlockState, block: torch.Tensor, logits: torch.Tensor,
                     stats: GenerationStats | None) -> torch.Tensor:
        """A step of the rule on the block (a view); returns what it committed."""
        commit, state.rule_state = commit_block(self.rule, block, logits, self.mask_id, state.rule_state, state.block)
        state.step += 1
        if stats is not None:
            stats.step(commit.sum())
        return commit


SDARState = BlockState


class SDARDecoder(StoreKVLoop):
    """SDAR's loop as a state and a step: each `step` is one model forward — the prefill, a
    denoising step of the current block (sample, select, commit), or the store of a finished block."""

    family = "SDAR"

    def __init__(self, *, mask_id: int, gen_length: int, block_length: int, denoising_steps: int,
                 temperature: float, top_k: int, top_p: float, remasking_strategy: str,
                 confidence_threshold: float | None, eb_threshold: float | None, stop_ids: Sequence[int] = (),
                 fill_after_stop: bool = True, block_store: Any = None, use_cache: bool = True):
        check_int("mask_id", mask_id, minimum=0)
        check_int("gen_length", gen_length, minimum=1)
        check_int("block_length", block_length, minimum=1)
        check_int("denoising_steps", denoising_steps, minimum=1)
        check_real("temperature", temperature, low=0)
        check_int("top_k", top_k, minimum=0)
        check_real("top_p", top_p, low=0, high=1, low_open=True)
        check_choice("remasking_strategy", remasking_strategy, REMASKING_STRATEGIES)
        if remasking_strategy == "low_confidence_dynamic":
            check_real("confidence_threshold", confidence_threshold, low=0, high=1)
        if remasking_strategy == "entropy_bounded":
            check_real("eb_threshold", eb_threshold, low=0, low_open=True)
        for stop in stop_ids:
            check_int("stopping_criteria_idx", stop, minimum=0)
        check_bool("use_cache", use_cache)
        self.mask_id, self.gen_length, self.block_length = mask_id, gen_length, block_length
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.strategy, self.confidence_threshold = remasking_strategy, confidence_threshold
        self.eb_threshold, self.stop_ids, self.fill_after_stop = eb_threshold, list(stop_ids), fill_after_stop
        self.schedule = num_transfer_schedule(block_length, denoising_steps).tolist()
        self.block_store, self.use_cache = block_store, use_cache

    def _settle(self, state: SDARState) -> None:
        """Without a cache a finished block has nothing to store: on to the next one, no forward."""
        if not state.done and not self.use_cache and self._block_full(state):
            self._next_block(state)

    def _forward(self, state: SDARState) -> Generator[ForwardRequest, Any, tuple[torch.Tensor | None, Any]]:
        if state.stored and self.use_cache and self._block_full(state):   # a finished block joins the cache
            return (yield self._store_request(state, *self._span(state))), "store"
        return (yield from super()._forward(state))

    def _decide(self, state: SDARState, logits: torch.Tensor, generator: torch.Generator | None,
                stats: GenerationStats | None) -> None:
        logits, prior = self._constrain_before(state, logits)
        start, end = self._span(state)
        self._denoise(state, state.x[:, start:end], logits, generator, stats)
        if prior is not None:   # structured output: the block filtered after the rule
            from ..parts.constrain_loops import filter_block

            filter_block(state.constraint, state.x, prior, None, logits, start, end)

    def _end(self, state: SDARState) -> int:
        # the last block's positions past `gen_length` are decoded, not returned (a request's max_tokens)
        return min(state.x.shape[1], state.prompt_length + self.gen_length)

    def _next_block(self, state: SDARState) -> None:
        state.block += 1
        state.step = 0
        if self.stop_ids and any(stop in state.x[:, state.prompt_length:] for stop in self.stop_ids):
            if self.fill_after_stop:
                state.x[:, state.block * self.block_length:] = self.stop_ids[0]
            state.done = True
        elif state.block == state.num_blocks:
            state.done = True

    def _denoise(self, state: SDARState, cur_x: torch.Tensor, logits: torch.Tensor,
                 generator: torch.Generator | None, stats: GenerationStats | None) -> None:
        mask_index = cur_x == self.mask_id
        x0, x0_p, probs = sample_block(logits, self.temperature, self.top_k, self.top_p, generator, self.mask_id)
        # past the schedule (only entropy_bounded, its own count, can need more steps): one position per step
        count = self.schedule[state.step] if state.step < len(self.schedule) else 1
        transfer = select_positions(self.strategy, mask_index, x0_p, probs, count, self.confidence_threshold,
                                    self.eb_threshold)
        cur_x[transfer] = x0[transfer]
        state.step += 1
        if stats is not None:
            stats.step(transfer.sum())


FREEDAVE_STRATEGIES = ("low_confidence_static", "low_confidence_dynamic")


class SDARFreeDave(BlockFreeDave, SDARDecoder):
    """SDAR's loop with FreeDave (`methods/freedave_blocks.py`): its tokens — greedy, one token per step, lossless
    under ``low_confidence_static``, ``low_confidence_dynamic`` with ``match_rule="exact"`` — with fewer forwards."""

    def _fd_loop(self) -> tuple:
        return (all(n == 1 for n in self.schedule), "denoising_steps", self.strategy in FREEDAVE_STRATEGIES,
                f"remasking_strategy must be one of {list(FREEDAVE_STRATEGIES)}, got {self.strategy!r}")

    def _fd_select(self, masked: torch.Tensor, conf: torch.Tensor) -> torch.Tensor:
        return select_positions(self.strategy, masked, conf, None, 1, self.confidence_threshold, self.eb_threshold)


class SDARRules(BlockRules, SDARDecoder):
    """SDAR's loop with one of dInfer's commit rules instead of `remasking_strategy` (`BlockRules`)."""

    def _denoise(self, state: SDARState, cur_x: torch.Tensor, logits: torch.Tensor,
                 generator: torch.Generator | None, stats: GenerationStats | None) -> None:
        self._rule_commit(state, cur_x, logits, stats)


# sdar_generate's settings that a dInfer rule replaces, with their defaults (given ones are refused)
RULE_UNREAD = dict(denoising_steps=8, top_k=0, top_p=1.0, remasking_strategy="low_confidence_dynamic",
                   confidence_threshold=0.85, eb_threshold=None)
RULE_SETTINGS = ("denoising_steps", "remasking_strategy", "confidence_threshold", "eb_threshold")


@torch.no_grad()
def sdar_generate(model: torch.nn.Module, input_ids: torch.Tensor, *, mask_id: int, gen_length: int = 128,
                  block_length: int = 8, denoising_steps: int = 8, temperature: float = 1.0, top_k: int = 0,
                  top_p: float = 1.0, remasking_strategy: str = "low_confidence_dynamic",
                  confidence_threshold: float = 0.85, eb_threshold: float | None = None,
                  stopping_criteria_idx: Sequence[int] | int | None = None, fill_after_stop: bool = True,
                  generator: torch.Generator | None = None, stats: GenerationStats | None = None,
                  use_cache: bool = True, decoder: Any = None, structured_outputs: Any = None,
                  tokenizer: Any = None) -> torch.LongTensor:
    """SDAR's loop on one prompt `[1, P]`; returns x `[1, ceil((P + gen_length) / block_length) · block_length]`.
    `decoder=remask.FreeDave(...)`: the same tokens with fewer forwards (`SDARFreeDave`); one of
    dInfer's rules (`SDARRules`; greedy; the settings of `RULE_UNREAD` must stay at their defaults).
    `structured_outputs`: the answer held to it (compiled against `tokenizer`, default the one saved
    beside the model; the stop ids end it, only where it is complete)."""
    stops = [] if stopping_criteria_idx is None else (
        [stopping_criteria_idx] if isinstance(stopping_criteria_idx, int) else list(stopping_criteria_idx))
    unread = dict(denoising_steps=denoising_steps, top_k=top_k, top_p=top_p, remasking_strategy=remasking_strategy,
                  confidence_threshold=confidence_threshold, eb_threshold=eb_threshold)
    kwargs = dict(mask_id=mask_id, gen_length=gen_length, block_length=block_length, temperature=temperature,
                  stop_ids=stops, fill_after_stop=fill_after_stop, use_cache=use_cache, **unread)
    if decoder is None:
        decoder = SDARDecoder(**kwargs)
    elif is_rule(decoder):
        check_rule_on_loop(decoder, "SDAR", temperature=temperature, replaces="remasking_strategy",
                           unread=unread_settings(unread, RULE_UNREAD))
        decoder = SDARRules(decoder, **kwargs)
    else:
        check_block_decoder(decoder)
        decoder = SDARFreeDave(decoder, **kwargs)
    decoder.structured(structured_outputs, model, tokenizer, gen_length)
    check_generator(generator, input_ids.device if torch.is_tensor(input_ids) else "cpu")
    check_stats("stats", stats)
    if stats is not None:
        stats.start()
    state = decoder.run(model, input_ids, generator, stats)
    if stats is not None:
        stats.stop(int(state.x.shape[1] - state.prompt_length))
    return state.x


def engine_decoder(engine: Any, params: Any) -> SDARDecoder:
    """One engine request's SDAR loop (`Family.engine_decoder`): `block_diffusion_generate`'s, `gen_length=max_tokens`,
    stopping after a block holding EOS or a `stop_token_ids` id; `threshold`: ``low_confidence_dynamic`` at it.
    `decoder=` a dInfer rule runs `SDARRules`; FreeDave sets the rule (one token per step, or its threshold)."""
    refuse_unread(params, "SDAR", ("top_k", "sdar"), "temperature, top_k, top_p, threshold, decoder (remask.FreeDave "
                  "or dInfer's rules) and sdar={block_length, denoising_steps, remasking_strategy, "
                  "confidence_threshold, eb_threshold}")
    settings = dict(params.sdar or {})
    block_length = settings.get("block_length", engine.spec.block_length)
    # work bounds, before the schedule (O(denoising_steps)) or the canvas (whole blocks) is built
    check_block_within_context(engine.spec, "sdar.block_length", block_length)
    if block_length is not None:
        check_steps("sdar.denoising_steps", settings.get("denoising_steps"), block_length, "the block length")
    if params.threshold is not None:
        if settings.get("remasking_strategy", "low_confidence_dynamic") != "low_confidence_dynamic" or \
                "confidence_threshold" in settings:
            raise ValueError("threshold is the shorthand for sdar={'remasking_strategy': "
                             "'low_confidence_dynamic', 'confidence_threshold': ...}: give one of them")
        settings.update(remasking_strategy="low_confidence_dynamic", confidence_threshold=params.threshold)
    kind = SDARDecoder
    if is_rule(params.decoder):
        # SamplingParams refuses temperature > 0, threshold, top_k, top_p with a decoder
        check_rule_on_loop(params.decoder, "SDAR", temperature=params.temperature, replaces="remasking_strategy",
                           unread={f"sdar.{name}": settings[name] for name in RULE_SETTINGS if name in settings})
        kind = partial(SDARRules, params.decoder)
    elif params.decoder is not None:
        freedave, threshold = split_freedave(params.decoder, rules=True)
        given = sorted(set(settings) & set(RULE_SETTINGS))
        if given:
            raise ValueError(f"sdar.{given[0]}: with decoder=FreeDave the rule is FreeDave's (one token per step, or "
                             f"its confidence_threshold): leave {given} unset")
        settings.update(remasking_strategy="low_confidence_static" if threshold is None else "low_confidence_dynamic",
                        **({} if threshold is None else {"confidence_threshold": threshold}))
        kind = partial(SDARFreeDave, freedave)
    return kind(block_store=engine.runner.store, mask_id=engine.spec.mask_id, gen_length=params.max_tokens,
                block_length=block_length, denoising_steps=settings.get("denoising_steps", block_length),
                temperature=params.temperature, top_k=params.top_k or 0,
                top_p=1.0 if params.top_p is None else params.top_p, eb_threshold=settings.get("eb_threshold"),
                remasking_strategy=settings.get("remasking_strategy", "low_confidence_static"),
                confidence_threshold=settings.get("confidence_threshold", 0.85),
                stop_ids=sorted(set(engine.stop_ids) | set(params.stop_token_ids)))
