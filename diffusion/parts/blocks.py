"""The block-causal loop that SDAR, LLaDA2 and Fast-dLLM v2 share (`BlockLoop`; `StoreKVLoop` for the `store_kv`
models, SDAR and LLaDA2), the helpers their loops, settings checks and engine decoders share, and the
loop's commit parts: the family's own rule (its `_select`), one of dInfer's commit rules (`rule`: greedy, it chooses
each step's commits until the block has no mask; a combination no paper shipped) or FreeDave's draft-and-verify
(`drafts`: `parts/drafts.py`). One loop class per family takes any of them (`decoder=` its first argument): no class
per family and method.
"""
from __future__ import annotations

import inspect
from dataclasses import KW_ONLY, dataclass, fields, replace
from typing import Any, Callable, Generator, Mapping

import torch
from transformers.cache_utils import DynamicCache

from remask.caches.block import BlockBatch, BlockKVCache
from remask.models.spec import ModelSpec

from .checks import changed, check_instance, refuse_unread
from .constrain import CommitFilter, before_rule
from .constrain_loops import Constrainable
from .drafts import DraftConfig, DraftVerify
from .rules import check_rule_on_loop, commit_block, is_rule, rule_types
from .scoring import sample_categorical
from .selection import schedule_counts
from .stats import GenerationStats
from .step import CommitRule, masked_canvas
from .stepper import ForwardRequest, ForwardThenCommit


def num_transfer_schedule(block_length: int, steps: int) -> torch.Tensor:
    """Positions to commit at each step: `block_length` split evenly, the remainder to the first steps (LLaDA's
    schedule of a block of masks)."""
    return schedule_counts(torch.ones((1, block_length), dtype=torch.bool), steps)[0]


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
    conf = torch.where(masked, confidence, -torch.inf)
    high = (conf > threshold) & masked
    if int(high.sum()) >= count:
        return high
    transfer = torch.zeros_like(masked)
    transfer[0, torch.topk(conf[0], k=min(count, int(masked.sum()))).indices] = True
    return transfer


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


# The flat `SamplingParams` settings the block-causal loops read (Fast-dLLM v2's: not top_k), besides `decoder=`
READS = ("temperature", "top_p", "top_k", "threshold")


def _parts(rules: bool) -> tuple[tuple[type, ...], str]:
    """The commit parts a block-causal loop takes (FreeDave; dInfer's rules too with `rules`), and their names."""
    if not rules:
        return (DraftConfig,), "remask.FreeDave"
    names = ", ".join(rule.__name__ for rule in rule_types())
    return (DraftConfig, CommitRule), f"remask.FreeDave or a commit rule ({names})"


def family_config(decoder: Any, config_type: type, rules: bool = True) -> Any:
    """A block-causal family's config from a request's `decoder=`: None, its defaults; the family's config; FreeDave or
    (`rules`) one of dInfer's commit rules, the shorthand for ``config_type(rule=decoder)``; else refused by name."""
    parts, names = _parts(rules)
    return config_type(rule=decoder) if isinstance(decoder, parts) else \
        check_instance("decoder", decoder, config_type, f"remask.{config_type.__name__}, {names}") or config_type()


def check_part(config: Any, family: str, replaced: tuple[str, ...], drafted: tuple[str, ...], *, rules: bool = True,
               replaces: str = "remasking rule") -> None:
    """A family config's `rule`, its loop's commit part: None (the family's own rule), FreeDave or (`rules`) one of
    dInfer's rules; the config's settings given that a rule replaces (`replaced`) or FreeDave sets (`drafted`: its
    threshold, else one token per step; the loop refuses a schedule of more) refused by name."""
    name = type(config).__name__
    check_instance(f"{name}.rule", config.rule, *_parts(rules))
    given = {f"{name}.{n}": getattr(config, n) for n in changed(config, replaced if is_rule(config.rule) else drafted)}
    if is_rule(config.rule):   # the temperature is the request's: the loop checks it
        check_rule_on_loop(config.rule, family, temperature=0, unread=given, replaces=replaces)
    elif config.rule is not None and given:
        raise ValueError(f"{next(iter(given))}: with rule=FreeDave {family}'s loop commits one token per step (or by "
                         f"FreeDave's confidence_threshold): leave {list(given)} unset")


def rule_unread(config_type: type, entry: Callable, given: Mapping[str, Any]) -> dict[str, Any]:
    """The arguments of a drop-in call `entry(**given)` that a commit rule on the loop of `config_type` (a family
    config) does not read and the call set away from `entry`'s defaults, in `entry`'s order: the config's settings the
    rule replaces (its `rule_replaces`) and the sampling ones (`READS` but the temperature, which the rule refuses)."""
    parameters = inspect.signature(entry).parameters
    unread = [name for name in parameters if name in given and name in config_type.rule_replaces + READS[1:]]
    return {name: given[name] for name in unread if given[name] != parameters[name].default}


def engine_settings(spec: ModelSpec, params: Any, config: Any, family: str, *, rules: bool = True,
                    length: str = "block_length", stops: str | None = None) -> tuple[dict, int, Any, float | None]:
    """An engine request's settings for a block-causal family's loop, from its `config` (`family_config`): the flat
    settings it does not read refused by name (`checks.WAYS["family"]`: `READS`, top_k only with `rules`), and with a
    commit part the sampling ones (it commits greedily by its own rule); `stop_token_ids` refused unless the loop takes
    them (`stops`: where it stops instead). Returns (the config's settings given, less its block length and rule; the
    block length: the config's field `length`, else the model's, else 32, checked against the model's context; the
    commit part: a dInfer rule, or FreeDave without its `confidence_threshold`; the threshold: FreeDave's, else the
    request's `threshold` (never both), or None)."""
    refuse_unread(params, "family", READS if rules else tuple(n for n in READS if n != "top_k"), name=family)
    if stops is not None and params.stop_token_ids:
        raise ValueError(f"stop_token_ids: {family}'s loop stops at {stops}")
    sampling = changed(params, READS[1:])
    if config.rule is not None and sampling:
        raise ValueError(f"{sampling}: decoder={type(config.rule).__name__} on {family}'s loop commits greedily by its "
                         "own rule: leave them unset")
    block_length = getattr(config, length) or spec.block_length or 32
    if spec.max_length is not None and block_length > spec.max_length:   # canvases are whole blocks
        raise ValueError(f"{type(config).__name__}.{length} must be <= the model's maximum sequence length "
                         f"{spec.max_length}, got {block_length}")
    settings = {f.name: getattr(config, f.name) for f in fields(config)
                if f.name not in (length, "rule") and getattr(config, f.name) is not None}
    part, tau = (config.rule, None) if config.rule is None or is_rule(config.rule) else \
        (replace(config.rule, confidence_threshold=None), config.rule.confidence_threshold)
    return settings, block_length, part, params.threshold if tau is None else tau


class BlockLoop(Constrainable, ForwardThenCommit):
    """A block-causal family's loop as a `ForwardThenCommit`: the family's `_loop_forward` returns `(logits, (kind,
    positions))` (which forward it was, for its `_loop_commit`; the positions it computed, counted here);
    `_settle(state)`: the moves that take no forward, made before each forward. With `drafts` (FreeDave) the part
    forwards and commits inside a block, the loop around it."""

    rule: Any = None     # the commit part: one of dInfer's rules (`StoreKVLoop`), ...
    drafts: Any = None   # ... or FreeDave's draft-verify (`DraftVerify`); neither: the family's own rule
    takes_rules = False

    def _take(self, decoder: Any, **replaces: Any) -> None:
        """Set the commit part (after the loop's own settings, which it checks): None, the family's own rule; a
        commit rule (`takes_rules`; `replaces`: `check_rule_on_loop`'s words); FreeDave's config (`DraftVerify`).
        Each refusal names the setting."""
        if is_rule(check_instance("decoder", decoder, *_parts(self.takes_rules))):
            check_rule_on_loop(decoder, self.family, temperature=self.temperature, **replaces)
            self.rule = decoder
        elif decoder is not None:
            self.drafts = DraftVerify(self, decoder)

    def _forward(self, state: Any) -> Generator[ForwardRequest, Any, tuple[torch.Tensor | None, Any]]:
        """The step's forward: the family's own (with `drafts`: its prefill or store), or the part's."""
        if self.drafts is not None and not self._fd_pending(state):
            return (yield from self.drafts.forward(state))
        state.predictions = None   # draft-verify starts each block afresh
        return (yield from self._loop_forward(state))

    def commit(self, state: Any, logits: torch.Tensor | None, kind: Any, generator: torch.Generator | None = None,
               stats: GenerationStats | None = None) -> None:
        if kind is None or torch.is_tensor(kind):   # a draft-verify forward's: its drafts, None the block's first
            return self.drafts.commit(state, logits, kind, stats)
        if stats is not None:
            stats.forward(1, kind[1])
        self._loop_commit(state, logits, kind[0], generator, stats)

    def _fd_committed(self, state: Any) -> None:
        """After a draft-verify commit: the family's in-block stop, if it has one (sets `state.done`)."""

    def _fd_block_done(self, state: Any) -> None:
        """After draft-verify filled the block (default: the loop's next step stores it and moves on)."""

    def _default_end_ids(self) -> tuple[Any, str]:
        """A structure's answer ends at the loop's stop ids (the family's `stop_ids`); the current block is the
        filter's window."""
        return self.stop_ids, "the loop has no stop id (pass one)"

    def _constraint(self, prompt_length: int, answer_len: int) -> Any:
        """A new state's commit filter (None without a structure)."""
        return None if self.structure is None else \
            CommitFilter([self.structure.matcher(self.end_ids)], self.mask_id, prompt_length, answer_len)

    def _sequence_request(self, state: Any, blocks: torch.Tensor, inputs: dict) -> ForwardRequest:
        """Without a cache: K versions `blocks` `[K, L]` of the current block, each its own forward of the sequence
        up to the block's end (`inputs` expanded to K rows), the block's rows wanted, linears as alone."""
        K = blocks.shape[0]
        start, end = self._span(state)
        seqs = state.x[:, :end].repeat(K, 1)
        seqs[:, start:end] = blocks
        return ForwardRequest.call(seqs, {name: value.expand(K, *value.shape[1:]) for name, value in inputs.items()},
                                   rows=slice(start, None), rows_alone=K > 1)

    def _span(self, state: Any) -> tuple[int, int]:   # the current block in state.x
        return state.block * self.block_length, (state.block + 1) * self.block_length

    def _block_full(self, state: Any) -> bool:   # the current block holds no mask
        return not bool((state.x[:, slice(*self._span(state))] == self.mask_id).any())

    def _settle(self, state: Any) -> None:
        """The moves that take no forward, made before each forward (default: none)."""

    def next_forward(self, state: Any, generator: torch.Generator | None = None,
                     stats: GenerationStats | None = None) -> ForwardRequest | None:
        self._settle(state)
        return super().next_forward(state, generator, stats)


@dataclass(eq=False)
class LoopState:
    """What the state of every block loop holds (`BlockLoop` reads it): `x` `[1, n]`, the prompt then the blocks;
    keyword-only, `done` and the parts' fields."""

    x: torch.Tensor
    prompt_length: int
    _: KW_ONLY
    done: bool = False
    predictions: Any = None   # FreeDave's predictions for the current block (`DraftVerify`)
    pending: Any = None       # the forward asked for and not yet answered (a sub-generator)
    constraint: Any = None    # structured output: a `CommitFilter` of one row (`BlockLoop.constrain`)


@dataclass(eq=False)
class BlockState(LoopState):
    """One prompt under a `StoreKVLoop`: `x` `[1, total]` (prompt, then masks), the cache (or None),
    the block being decoded and its step; `stored` once the blocks before it are in the cache."""

    cache: Any
    attention: torch.Tensor
    position_ids: torch.Tensor
    block: int
    num_blocks: int
    stored: bool = False
    step: int = 0
    post_steps: int = 0       # LLaDA2.1: the forwards since the block's masks were gone
    end: int | None = None    # where the output ends (LLaDA2: after the first EOS), once done; None: `_end`
    rule_state: Any = None    # (block, the commit rule's per-block state), `commit_block`'s (`StoreKVLoop.rule`)


class StoreKVLoop(BlockLoop):
    """The loop of the `store_kv` models (SDAR, LLaDA2); the family supplies `_select` and `_decided` (`_decide`'s
    hooks) and its block's end. `use_cache=False`: each forward covers the sequence up to the current block under
    the block-causal mask (the cache's check)."""

    takes_rules = True
    mask_dtype: Any = None   # the block-causal mask's dtype and leading dims, as the model's remote code takes it
    mask_lead = (1,)
    prompt_name, empty_prompt_ok = "input_ids", True   # `start`'s prompt, as the family's function names it
    # the family sets `block_store`: the engine's `PagedKVStore` (each cache a `BlockKVCache`), or None (a
    # `DynamicCache`)

    def _cache_args(self, ids: torch.Tensor) -> tuple[list[int], int, int]:
        """A `BlockKVCache`'s for the prompt `ids` `[1, P]`: its whole blocks' ids, the whole sequence's positions,
        the block length."""
        L, P = self.block_length, ids.shape[1]
        return ids[0, :P // L * L].tolist(), (P + self.gen_length + L - 1) // L * L, L

    def pages_needed(self, manager: Any, prompt_ids: torch.Tensor) -> int | None:
        """Free pages a request with this prompt takes in the engine's store (all allocated at start);
        None without the store (a contiguous cache)."""
        return None if self.block_store is None else BlockKVCache.pages_needed(manager, *self._cache_args(prompt_ids))

    def new_cache(self, input_ids: torch.Tensor) -> Any:
        """A new request's cache: pages of the engine's store, or a contiguous `DynamicCache`."""
        return DynamicCache() if self.block_store is None else BlockKVCache(self.block_store,
                                                                            *self._cache_args(input_ids))

    def release(self, state: Any) -> None:
        """Give back the state's cache pages (the engine's paged cache), if it has any."""
        if hasattr(state.cache, "release"):
            state.cache.release()

    def start(self, input_ids: torch.Tensor) -> BlockState:
        check_prompt(input_ids, self.mask_id, self.family, self.prompt_name, self.empty_prompt_ok)
        L, device, P = self.block_length, input_ids.device, input_ids.shape[1]
        num_blocks = (P + self.gen_length + L - 1) // L
        total = num_blocks * L
        x = masked_canvas(input_ids, total - P, self.mask_id)
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

    def _end(self, state: BlockState) -> int:
        """Where the output ends: where the family's stop cut it (`state.end`), else after `gen_length` (the last
        block's positions past it are decoded, not returned: a request's max_tokens)."""
        return state.end if state.end is not None else min(state.x.shape[1], state.prompt_length + self.gen_length)

    def _store_request(self, state: BlockState, start: int, end: int) -> ForwardRequest:
        """The forward storing the whole blocks `x[start:end]` (one block: a block forward like the others)."""
        if end - start == self.block_length:
            return block_request(state.x[:, start:end], state.position_ids[:, start:end], state.cache, True)
        return ForwardRequest.call(state.x[:, start:end], dict(attention_mask=state.attention[..., start:end, :end],
                                                               position_ids=state.position_ids[:, start:end]),
                                   cache=state.cache, use_cache=True, store_kv=True)

    def _loop_forward(self, state: BlockState) -> Generator[ForwardRequest, Any, tuple[torch.Tensor | None, Any]]:
        """The store of the blocks before the current one (the prompt's, or the block just decoded),
        else a decoding step of the current block. Returns (logits, ("stored" or "decide", positions))."""
        start, end = self._span(state)
        if not state.stored:
            cached = state.cache.get_seq_length()
            yield self._store_request(state, cached, start)
            return None, ("stored", start - cached)
        logits = yield from self._fd_forwards(state, state.x[:, start:end])
        return logits, ("decide", self.block_length if self.use_cache else end)

    def _loop_commit(self, state: BlockState, logits: torch.Tensor | None, kind: str,
                     generator: torch.Generator | None = None, stats: GenerationStats | None = None) -> None:
        if kind == "stored":   # the forward stored the blocks before the current one
            state.stored = True
        elif kind == "store":
            self._next_block(state)
        else:
            self._decide(state, logits, generator, stats)

    def _decide(self, state: BlockState, logits: torch.Tensor, generator: torch.Generator | None,
                stats: GenerationStats | None) -> None:
        """A decoding step of the current block: the commit rule's, or the family's (`_select` on the sampled block,
        every position sampled), then the family's `_decided`."""
        start, end = self._span(state)
        block = state.x[:, start:end]   # a view: commits write into x
        masked = block == self.mask_id
        logits, prior = before_rule(state.constraint, logits, block, start, end, 0)
        if self.rule is not None:   # the commit rule's step on the block (a view), its state held per block
            change, state.rule_state = commit_block(self.rule, block, logits, self.mask_id, state.rule_state,
                                                    state.block)
            tokens, committed = None, change
        else:
            tokens, confidence, probs = self._sample(logits, self.temperature, generator)
            # past the schedule (SDAR's entropy_bounded, a structure's filter leaving holes): one position per step
            count = self.schedule[state.step] if state.step < len(self.schedule) else 1
            change = self._select(masked, confidence, count, probs, state, block, tokens)
            block[change] = tokens[change]
            committed = change & masked
        state.step += 1
        if stats is not None:
            stats.step(committed.sum())
        self._decided(state, block, masked, change, tokens, logits, prior)

    def _fd_pending(self, state: BlockState) -> bool:   # the prefill or store of the blocks before
        return not state.stored or self._block_full(state)

    def _sample(self, logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> tuple:
        return sample_block(logits, temperature, self.top_k, self.top_p, generator, self.mask_id)

    def _fd_forwards(self, state: BlockState, blocks: torch.Tensor) -> Generator[ForwardRequest, Any, torch.Tensor]:
        """Logits `[K, L, V]` of K versions of the current block (the loop's forward: K = 1): without the cache the
        sequence up to the block under `state.attention`; with it one row each reading the one cache
        (`block_request`), linears as alone."""
        start, end = self._span(state)
        if not self.use_cache:
            return (yield self._sequence_request(state, blocks, dict(attention_mask=state.attention[..., :end, :end],
                                                                     position_ids=state.position_ids[:, :end])))
        return (yield block_request(blocks, state.position_ids[:, start:end], state.cache, False))
