"""SDAR's block diffusion decoding (JetAstra/SDAR `generate.py::block_diffusion_generate`).

Autoregressive over blocks, parallel inside one: the prompt's whole blocks are prefilled into the
KV cache (`store_kv=True`); then each block (the first one holds the prompt's tail) is denoised by
forwards over the block against the cache (`store_kv=False`), each step sampling every position
(temperature, top-k, top-p; the confidence is the sampled token's probability) and committing some
masked positions by `remasking_strategy`: ``"sequential"`` (the first n masks, left to right),
``"low_confidence_static"`` (the n most confident), ``"low_confidence_dynamic"`` (every one above
`confidence_threshold` when there are at least n, else the n most confident), ``"entropy_bounded"``
(lowest entropy first while the running sum stays ≤ `eb_threshold`); n follows the per-step schedule
(`block_length` split over `denoising_steps`, remainder first). A finished block is forwarded once
more with `store_kv=True` and decoding moves on; it stops after a block holding a stop id.

Upstream's draws are replayed: `torch.multinomial` over the block's filtered, tempered softmax with
torch's global generator (or `generator`). Departures, on by default because upstream breaks its own
output (docs/quirks.md): temperature 0 is greedy (upstream divides by zero); a step never commits
more positions than the block has masks (upstream's top-k fallback then overwrites prompt or
committed tokens); `entropy_bounded` uses each position's entropy (upstream's is a sum over the
block of the sampled probability and crashes on an unset variable); positions left masked after a
stop are filled with the first stop id (upstream returns them as mask tokens); a sampled mask token
is replaced by the most probable other token (upstream commits it, the position stays masked and
the loop then fails with an IndexError).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Generator, Sequence

import torch
from transformers.cache_utils import DynamicCache

from remask.caches.block import BlockBatch, PagedBlocks

from ..parts.checks import (check_block_within_context, check_bool, check_choice, check_generator, check_instance, check_int,
                     check_real, check_settings, check_stats, check_steps)
from ..methods.freedave import FreeDave
from ..methods.freedave_blocks import BlockFreeDave, check_freedave_loop
from ..parts.rules import CommitRule, check_block_decoder, check_rule_on_loop, commit_block, is_rule, rule_types, unread_settings
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
    """(tokens, their probabilities, the distributions) for logits `[1, L, V]`: upstream's sampler,
    `remask.diffusion.scoring.sample_categorical` with its defaults (top-k then top-p to −inf, one
    multinomial draw over the block's rows; T = 0: the argmax, where upstream divides by 0). A draw
    of `mask_id` (which upstream commits, leaving the position masked) becomes the most probable
    other token — only there, so every other draw is upstream's."""
    shape, V = logits.shape[:-1], logits.shape[-1]
    token, token_prob, probs = sample_categorical(logits.reshape(-1, V), temperature, top_k, top_p,
                                                  generator=generator, exclude_id=mask_id)
    return token.view(*shape), token_prob.view(*shape), probs.view(*shape, V)


def select_positions(strategy: str, mask_index: torch.Tensor, x0_p: torch.Tensor, probs: torch.Tensor,
                     count: int, confidence_threshold: float | None, eb_threshold: float | None) -> torch.Tensor:
    """Which masked positions of a `[1, L]` block to commit this step (never more than it has)."""
    transfer = torch.zeros_like(mask_index)
    masks = int(mask_index.sum())
    count = min(count, masks)   # upstream's top-k would pick unmasked positions beyond the masks
    if strategy == "sequential":
        first = int(mask_index[0].nonzero()[0])
        transfer[0, first:first + count] = True
        return transfer & mask_index
    if strategy == "entropy_bounded":
        entropy = -(probs * torch.log(probs.clamp_min(1e-12))).sum(dim=-1)
        entropy = torch.where(mask_index, entropy, torch.inf)
        sorted_entropy, order = torch.sort(entropy, dim=1)
        k = int(torch.searchsorted(torch.cumsum(sorted_entropy, dim=1)[0],
                                   torch.tensor(eb_threshold, dtype=entropy.dtype), right=False))
        transfer[0, order[0, :max(1, min(k, masks))]] = True
        return transfer
    confidence = torch.where(mask_index, x0_p, -torch.inf)
    if strategy == "low_confidence_dynamic":
        high = confidence[0] > confidence_threshold
        if int(high.sum()) >= count:
            transfer[0] = high
            return transfer
    transfer[0, torch.topk(confidence[0], count).indices] = True
    return transfer


def validate_sdar_args(mask_id: int, gen_length: int, block_length: int, denoising_steps: int, temperature: float,
                       top_k: int, top_p: float, remasking_strategy: str, confidence_threshold: float | None,
                       eb_threshold: float | None) -> None:
    """The checks of SDAR's settings (shared by the function, the engine and `SamplingParams`)."""
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
    """The forward of one block `[K, L]` (K versions of it: FreeDave's drafts) against `cache`
    (SDAR's and LLaDA2's `store_kv` models), storing the block when `store`: its cache argument is
    a `BlockBatch` of K rows over the one cache (never copied), each row's attention as its own
    forward's — the forward's mask is all ones (a block sees itself and every earlier block), so
    none is passed — and each row's linears as alone (`rows_alone`). The engine stacks such
    requests of one step into one call (`stepper.run_forwards`)."""
    K = blocks.shape[0]
    return ForwardRequest.call(blocks, dict(position_ids=positions.expand(K, -1)),
                               cache=BlockBatch([cache] * K, [store] * K), rows_alone=K > 1, use_cache=True,
                               store_kv=False)


class BlockLoop(ForwardThenCommit):
    """A block-causal family's loop (SDAR, LLaDA2, Fast-dLLM v2) as a `ForwardThenCommit`:
    `_forward(state)` (a sub-generator of the step's one `ForwardRequest`, returning `(logits,
    kind)`: which forward it was), `commit(state, logits, kind, generator, stats)`, and
    `_settle(state)`: the loop's moves that take no forward (a block that ends with nothing to
    store, the next block opened), made before each forward. The drop-in loops call `step`; the
    engine asks `next_forward` and hands the logits to `receive`."""

    structure: Any = None   # structured output: a `remask.structured.CompiledStructure` (`constrain`)
    end_ids: tuple = ()

    def constrain(self, structure: Any, end_ids: Any = None) -> "BlockLoop":
        """Hold every answer to `structure` (`diffusion/parts/constrain_loops.py`): the block being
        denoised is the commit filter's window; `end_ids` (default: the loop's own stop ids) end an
        answer, allowed exactly where the structure is complete. Returns the decoder."""
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

    def _settle(self, state: Any) -> None:
        """The moves before the next forward that take none (none here)."""

    def next_forward(self, model: torch.nn.Module, state: Any, generator: torch.Generator | None = None,
                     stats: GenerationStats | None = None) -> ForwardRequest | None:
        self._settle(state)
        return super().next_forward(model, state, generator, stats)

    def step(self, model: torch.nn.Module, state: Any, generator: torch.Generator | None = None,
             stats: GenerationStats | None = None) -> None:
        self._settle(state)
        if not state.done:
            super().step(model, state, generator, stats)


@dataclass(eq=False)
class SDARState:
    """One prompt under SDAR's loop: `x` `[1, total]` (prompt, then masks), the cache, the block
    being denoised and its step; `prefilled` once the prompt's whole blocks are in the cache."""

    x: torch.Tensor
    prompt_length: int
    cache: DynamicCache
    attention: torch.Tensor
    position_ids: torch.Tensor
    block: int
    num_blocks: int
    prefilled: bool = False
    step: int = 0
    done: bool = False
    stopped_at: int | None = None
    predictions: Any = None   # FreeDave's predictions for the current block (`SDARFreeDave`)
    rule_state: Any = None    # (block, the commit rule's per-block state), `commit_block`'s (`SDARRules`)
    pending: Any = None       # the forward asked for and not yet answered (a sub-generator)
    constraint: Any = None    # structured output: a `CommitFilter` of one row (`BlockLoop.constrain`)


class SDARDecoder(BlockLoop, PagedBlocks):
    """SDAR's loop as a state and a step: each `step` is one model forward — the prefill, a
    denoising step of the current block (sample, select, commit), or the forward that stores a
    finished block in the cache and moves on. `sdar_generate` drives it for one prompt; in the
    engine every block forward (a `BlockBatch` request: `block_request`) of the running requests,
    each at its own block against its own cache, is stacked into one call."""

    def __init__(self, *, mask_id: int, gen_length: int, block_length: int, denoising_steps: int,
                 temperature: float, top_k: int, top_p: float, remasking_strategy: str,
                 confidence_threshold: float | None, eb_threshold: float | None, stop_ids: Sequence[int] = (),
                 fill_after_stop: bool = True, block_store: Any = None, use_cache: bool = True):
        validate_sdar_args(mask_id, gen_length, block_length, denoising_steps, temperature, top_k, top_p,
                           remasking_strategy, confidence_threshold, eb_threshold)
        for stop in stop_ids:
            check_int("stopping_criteria_idx", stop, minimum=0)
        self.mask_id, self.gen_length, self.block_length = mask_id, gen_length, block_length
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.strategy, self.confidence_threshold, self.eb_threshold = (remasking_strategy, confidence_threshold,
                                                                       eb_threshold)
        self.stop_ids, self.fill_after_stop = list(stop_ids), fill_after_stop
        self.schedule = num_transfer_schedule(block_length, denoising_steps).tolist()
        # the engine's page store (`remask.engine.paged_kv.PagedKVStore`): each state's cache is then
        # a `BlockKVCache` in its pages; None: a contiguous DynamicCache, as upstream
        self.block_store = block_store
        # False: no cache at all — every step forwards the whole sequence up to the current block under
        # the block-causal mask (the check that the exact cache changes nothing)
        check_bool("use_cache", use_cache)
        self.use_cache = use_cache

    def _block(self, state: SDARState) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """The current block's tokens (a view of x), positions, and whether it is finished (the
        forward then stores its K/V)."""
        span = slice(state.block * self.block_length, (state.block + 1) * self.block_length)
        cur_x = state.x[:, span]
        return cur_x, state.position_ids[:, span], not bool((cur_x == self.mask_id).any())

    def _settle(self, state: SDARState) -> None:
        """Without a cache a finished block has nothing to store: on to the next one, no forward."""
        if not state.done and state.prefilled and not self.use_cache and self._block(state)[2]:
            self._next_block(state)

    def _forward(self, state: SDARState) -> Generator[ForwardRequest, Any, tuple[torch.Tensor | None, str]]:
        """The step's forward: the prefill (the prompt's whole blocks, stored; one block is a block
        forward like the others), a denoising forward of the current block (against the cache, or
        without one the sequence up to it under the block-causal mask), or the store of the
        finished block. Returns (logits `[1, L, V]`, "prefill" / "denoise" / "store")."""
        L = self.block_length
        if not state.prefilled:   # the prompt's whole blocks, stored
            n = state.block * L
            if n == L:
                yield block_request(state.x[:, :L], state.position_ids[:, :L], state.cache, True)
            else:
                yield ForwardRequest.call(state.x[:, :n], dict(attention_mask=state.attention[:, :n, :n],
                                                               position_ids=state.position_ids[:, :n]),
                                          cache=state.cache, use_cache=True, store_kv=True)
            return None, "prefill"
        cur_x, positions, finished = self._block(state)
        if not self.use_cache:
            end = (state.block + 1) * L
            logits = yield ForwardRequest.call(state.x[:, :end], dict(attention_mask=state.attention[:, :end, :end],
                                                                      position_ids=state.position_ids[:, :end]),
                                               rows=slice(-L, None))
            return logits, "denoise"
        # a finished block joins the cache (and the loop moves on); else a denoising step
        logits = yield block_request(cur_x, positions, state.cache, finished)
        return logits, "store" if finished else "denoise"

    def commit(self, state: SDARState, logits: torch.Tensor | None, kind: str,
               generator: torch.Generator | None = None, stats: GenerationStats | None = None) -> None:
        """The step's decision from its forward's logits `[1, L, V]` (`kind`: which forward it was)."""
        L = self.block_length
        if kind == "prefill":
            state.prefilled = True
            if stats is not None:
                stats.forward(1, state.block * L)
            return
        if stats is not None:
            stats.forward(1, L if self.use_cache else (state.block + 1) * L)
        if kind == "store":
            self._next_block(state)
        elif state.constraint is None:
            self._denoise(state, self._block(state)[0], logits, generator, stats)
        else:   # structured output: the frontier masked before the rule, the block filtered after it
            from ..parts.constrain_loops import filter_block, mask_frontier_rows

            cur_x, start = self._block(state)[0], state.block * L
            logits = mask_frontier_rows(state.constraint, logits, start, start + L)
            prior = cur_x.clone()
            self._denoise(state, cur_x, logits, generator, stats)
            filter_block(state.constraint, state.x, prior, None, logits, start, start + L)

    def num_final(self, state: SDARState) -> int:
        """Generated positions that are final: those of the finished blocks (all of them once done),
        never more than `gen_length` (the last block's positions past it are decoded, not returned:
        a request's `max_tokens` caps its answer)."""
        if state.done:
            return min(state.x.shape[1] - state.prompt_length, self.gen_length)
        return min(max(0, state.block * self.block_length - state.prompt_length), self.gen_length)

    def start(self, model: torch.nn.Module, input_ids: torch.Tensor) -> SDARState:
        if not torch.is_tensor(input_ids) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
            raise ValueError(f"prompt input_ids must be a LongTensor [1, length], got "
                             f"{getattr(input_ids, 'shape', None)}")
        if input_ids.shape[0] != 1:
            raise ValueError(f"SDAR's block_diffusion_generate decodes one prompt (batch 1), got batch "
                             f"{input_ids.shape[0]}; use remask.LLM for many")
        if bool((input_ids == self.mask_id).any()):
            raise ValueError(f"the prompt holds the mask id {self.mask_id}: SDAR decodes only after the prompt")
        device, L = input_ids.device, self.block_length
        prompt_length = input_ids.shape[1]
        num_blocks = (prompt_length + self.gen_length + L - 1) // L
        total = num_blocks * L
        blocks = torch.tril(torch.ones(num_blocks, num_blocks, device=device))
        x = torch.full((1, total), self.mask_id, dtype=torch.long, device=device)
        x[:, :prompt_length] = input_ids
        return SDARState(x=x, prompt_length=prompt_length, cache=self.new_cache(input_ids),
                         attention=blocks.repeat_interleave(L, 0).repeat_interleave(L, 1)[None],
                         position_ids=torch.arange(total, device=device)[None], block=prompt_length // L,
                         num_blocks=num_blocks, prefilled=prompt_length < L or not self.use_cache,
                         constraint=self._constraint(prompt_length, total - prompt_length))

    def _next_block(self, state: SDARState) -> None:
        L = self.block_length
        state.block += 1
        state.step = 0
        if self.stop_ids and any(stop in state.x[:, state.prompt_length:] for stop in self.stop_ids):
            state.stopped_at = state.block * L
            if self.fill_after_stop:
                state.x[:, state.stopped_at:] = self.stop_ids[0]
            state.done = True
        elif state.block == state.num_blocks:
            state.done = True

    def _denoise(self, state: SDARState, cur_x: torch.Tensor, logits: torch.Tensor,
                 generator: torch.Generator | None, stats: GenerationStats | None) -> None:
        mask_index = cur_x == self.mask_id
        x0, x0_p, probs = sample_block(logits, self.temperature, self.top_k, self.top_p, generator, self.mask_id)
        # The schedule commits every mask within `denoising_steps` steps; only the entropy-bounded
        # rule (its own count) can need more, and then at least one position per step.
        count = self.schedule[state.step] if state.step < len(self.schedule) else 1
        transfer = select_positions(self.strategy, mask_index, x0_p, probs, count, self.confidence_threshold,
                                    self.eb_threshold)
        cur_x[transfer] = x0[transfer]
        state.step += 1
        if stats is not None:
            stats.step(transfer.sum())


class SDARFreeDave(BlockFreeDave, SDARDecoder):
    """SDAR's loop with FreeDave (`diffusion/methods/freedave_blocks.py`): the tokens of the same loop
    without it — greedy, one token per step (`denoising_steps == block_length`), committed by
    ``low_confidence_static`` (lossless) or ``low_confidence_dynamic`` (its threshold rule; lossless
    with ``match_rule="exact"``) — with fewer forwards."""

    def __init__(self, freedave: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        check_freedave_loop(freedave, "SDAR", temperature=self.temperature,
                            one_per_step=kwargs["denoising_steps"] == self.block_length,
                            steps_name="denoising_steps", rule_ok=self.strategy in FREEDAVE_STRATEGIES,
                            rule=f"remasking_strategy must be one of {list(FREEDAVE_STRATEGIES)}, got {self.strategy!r}",
                            block_length=self.block_length)
        self.freedave = freedave

    def _fd_pending(self, state: SDARState) -> bool:
        return not state.prefilled or self._block(state)[2]

    def _fd_scores(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x0, x0_p, _ = sample_block(logits, 0.0, self.top_k, self.top_p, None, self.mask_id)
        return x0, x0_p

    def _fd_select(self, masked: torch.Tensor, conf: torch.Tensor) -> torch.Tensor:
        return select_positions(self.strategy, masked, conf, None, 1, self.confidence_threshold, self.eb_threshold)

    def _fd_block_done(self, state: SDARState) -> None:
        pass   # the next step stores the full block and moves on (the loop's own step)


FREEDAVE_STRATEGIES = ("low_confidence_static", "low_confidence_dynamic")


class SDARRules(SDARDecoder):
    """SDAR's loop with one of dInfer's commit rules (`remask.diffusion.rules`): the same forwards,
    cache, blocks and stop, but each step of a block commits the masked positions the rule chooses
    from the block's logits (greedy) instead of `remasking_strategy`'s, until the block has no mask
    (every step commits at least one). A combination no paper shipped."""

    def __init__(self, rule: Any, **kwargs: Any) -> None:
        check_instance("decoder", rule, CommitRule, "a remask commit rule (" + ", ".join(t.__name__ for t in rule_types()) + ")")
        super().__init__(**kwargs)
        check_rule_on_loop(rule, "SDAR", temperature=self.temperature)
        self.rule = rule

    def _denoise(self, state: SDARState, cur_x: torch.Tensor, logits: torch.Tensor,
                 generator: torch.Generator | None, stats: GenerationStats | None) -> None:
        commit, state.rule_state = commit_block(self.rule, cur_x, logits, self.mask_id, state.rule_state,
                                                state.block)
        state.step += 1
        if stats is not None:
            stats.step(commit.sum())


# sdar_generate's settings that a dInfer rule replaces, with their defaults (given ones are refused)
RULE_UNREAD = dict(denoising_steps=8, top_k=0, top_p=1.0, remasking_strategy="low_confidence_dynamic",
                   confidence_threshold=0.85, eb_threshold=None)


@torch.no_grad()
def sdar_generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    *,
    mask_id: int,
    gen_length: int = 128,
    block_length: int = 8,
    denoising_steps: int = 8,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    remasking_strategy: str = "low_confidence_dynamic",
    confidence_threshold: float = 0.85,
    eb_threshold: float | None = None,
    stopping_criteria_idx: Sequence[int] | int | None = None,
    fill_after_stop: bool = True,
    generator: torch.Generator | None = None,
    stats: GenerationStats | None = None,
    use_cache: bool = True,
    decoder: Any = None,
    structured_outputs: Any = None,
    tokenizer: Any = None,
) -> torch.LongTensor:
    """SDAR's loop on one prompt `[1, P]`; returns x `[1, ceil((P + gen_length) / block_length) · block_length]`.
    `decoder=remask.FreeDave(...)`: the same tokens with fewer forwards (`SDARFreeDave`).
    `decoder=remask.ThresholdDecoding(...)` / `HierarchicalDecoding(...)` / `CreditDecoding(...)`:
    dInfer's rule chooses each step's commits in SDAR's loop (`SDARRules`; greedy: temperature=0;
    `denoising_steps`, `top_k`, `top_p`, `remasking_strategy`, `confidence_threshold`,
    `eb_threshold` are not read and must stay at their defaults).
    `structured_outputs`: a `remask.StructuredOutputsParams`, compiled against `tokenizer` (default:
    the one saved beside the model); the stop ids end the answer, allowed only where it is
    complete (`diffusion/parts/constrain_loops.py`)."""
    stops = [] if stopping_criteria_idx is None else (
        [stopping_criteria_idx] if isinstance(stopping_criteria_idx, int) else list(stopping_criteria_idx))
    kwargs = dict(mask_id=mask_id, gen_length=gen_length, block_length=block_length,
                  denoising_steps=denoising_steps, temperature=temperature, top_k=top_k, top_p=top_p,
                  remasking_strategy=remasking_strategy, confidence_threshold=confidence_threshold,
                  eb_threshold=eb_threshold, stop_ids=stops, fill_after_stop=fill_after_stop, use_cache=use_cache)
    if decoder is None:
        decoder = SDARDecoder(**kwargs)
    elif is_rule(decoder):
        given = dict(denoising_steps=denoising_steps, top_k=top_k, top_p=top_p, remasking_strategy=remasking_strategy,
                     confidence_threshold=confidence_threshold, eb_threshold=eb_threshold)
        check_rule_on_loop(decoder, "SDAR", temperature=temperature, replaces="remasking_strategy",
                           unread=unread_settings(given, RULE_UNREAD))
        decoder = SDARRules(decoder, **kwargs)
    else:
        check_block_decoder(decoder)
        decoder = SDARFreeDave(decoder, **kwargs)
    if structured_outputs is not None:
        from ..parts.constrain_loops import compile_for

        decoder.constrain(compile_for(structured_outputs, model, tokenizer, mask_id))
        decoder.structure.check_budget(gen_length)
    check_generator(generator, input_ids.device if torch.is_tensor(input_ids) else "cpu")
    check_stats("stats", stats)
    state = decoder.start(model, input_ids)
    if stats is not None:
        stats.start()
    while not state.done:
        decoder.step(model, state, generator, stats)
    if stats is not None:
        stats.stop(int(state.x.shape[1] - state.prompt_length))
    return state.x


def _freedave_rule(freedave: Any, settings: dict) -> FreeDave:
    """A request's `decoder=FreeDave` sets the loop's rule: one token per step by confidence, or with
    `confidence_threshold=τ` the threshold rule (``low_confidence_dynamic`` at τ); `settings` gets
    them, and those the request set itself are refused."""
    check_instance("decoder", freedave, FreeDave, "remask.FreeDave, ThresholdDecoding, CreditDecoding or "
                   "HierarchicalDecoding (the decoders block-causal models take)")
    given = sorted(set(settings) & {"denoising_steps", "remasking_strategy", "confidence_threshold", "eb_threshold"})
    if given:
        raise ValueError(f"sdar.{given[0]}: with decoder=FreeDave the rule is FreeDave's (one token per step, or "
                         f"its confidence_threshold): leave {given} unset")
    threshold = freedave.confidence_threshold
    settings.update(remasking_strategy="low_confidence_static" if threshold is None else "low_confidence_dynamic",
                    **({} if threshold is None else {"confidence_threshold": threshold}))
    return replace(freedave, confidence_threshold=None)


RULE_SETTINGS = ("denoising_steps", "remasking_strategy", "confidence_threshold", "eb_threshold")


def engine_decoder(engine: Any, params: Any) -> SDARDecoder:
    """One engine request's SDAR loop (`Family.engine_decoder`): the loop
    `remask.compat.sdar.block_diffusion_generate` runs with `gen_length=max_tokens`, its finished
    blocks in the engine's pages; it stops after a block holding EOS or a `stop_token_ids` id.
    Reads `temperature`, `top_k`, `top_p`, `threshold` (shorthand for `low_confidence_dynamic` with
    that confidence threshold) and `params.sdar`; refuses every other decoding setting by name.
    `decoder=` a dInfer rule runs `SDARRules` (reads `sdar.block_length` only)."""
    from dataclasses import fields

    read = ("max_tokens", "n", "seed", "stop", "stop_token_ids", "temperature", "top_k", "top_p", "threshold", "sdar",
            "decoder", "structured_outputs")
    set_here = [f.name for f in fields(type(params)) if f.name not in read and getattr(params, f.name) != f.default]
    if set_here:
        raise ValueError(f"a block-causal model (SDAR) does not read {set_here}; its settings are temperature, "
                         "top_k, top_p, threshold, decoder (remask.FreeDave or dInfer's rules) and sdar={block_length, "
                         "denoising_steps, remasking_strategy, confidence_threshold, eb_threshold}")
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
        kind = partial(SDARFreeDave, _freedave_rule(params.decoder, settings))
    return kind(block_store=engine.runner.store, mask_id=engine.spec.mask_id, gen_length=params.max_tokens,
                block_length=block_length, denoising_steps=settings.get("denoising_steps", block_length),
                temperature=params.temperature,
                top_k=params.top_k or 0, top_p=1.0 if params.top_p is None else params.top_p,
                remasking_strategy=settings.get("remasking_strategy", "low_confidence_static"),
                confidence_threshold=settings.get("confidence_threshold", 0.85),
                eb_threshold=settings.get("eb_threshold"),
                stop_ids=sorted(set(engine.stop_ids) | set(params.stop_token_ids)))
