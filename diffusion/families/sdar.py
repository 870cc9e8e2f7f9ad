"""SDAR's block diffusion decoding (JetAstra/SDAR `generate.py::block_diffusion_generate`) on the block loop of
`parts/blocks.py` (`StoreKVLoop`).

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

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Generator, Sequence

import torch

from remask.models.spec import ModelSpec

from ..parts.blocks import (BlockState, StoreKVLoop, check_part, engine_settings, family_config, num_transfer_schedule,
                            rule_unread, select_mask_to_token)
from ..parts.checks import (NoWorkBound, check_bool, check_choice, check_generator, check_int, check_ints, check_real,
                            check_stats, check_steps, checked)
from ..parts.constrain_loops import filter_block, structure_for_call
from ..parts.rules import check_rule_on_loop, is_rule
from ..parts.stats import GenerationStats
from ..parts.stepper import ForwardRequest, decode_alone

REMASKING_STRATEGIES = ("sequential", "low_confidence_static", "low_confidence_dynamic", "entropy_bounded")
FREEDAVE_STRATEGIES = ("low_confidence_static", "low_confidence_dynamic")   # the rules FreeDave drafts


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


class SDARDecoder(StoreKVLoop):
    """SDAR's loop as a state and a step: each `step` is one model forward — the prefill, a
    denoising step of the current block (sample, select, commit), or the store of a finished block.
    `decoder`: the commit part (`BlockLoop._take`): None, `remasking_strategy`; one of dInfer's rules (greedy);
    FreeDave (greedy, one token per step, lossless under ``low_confidence_static``, ``low_confidence_dynamic``
    with ``match_rule="exact"``: the same tokens with fewer forwards). The rule's defaults are the engine's (the
    drop-in `sdar_generate` passes upstream's)."""

    family = "SDAR"

    def __init__(self, decoder: Any = None, *, mask_id: int, gen_length: int, block_length: int, denoising_steps: int,
                 temperature: float, top_k: int, top_p: float, remasking_strategy: str = "low_confidence_static",
                 confidence_threshold: float | None = 0.85, eb_threshold: float | None = None,
                 stop_ids: Sequence[int] = (), fill_after_stop: bool = True, block_store: Any = None,
                 use_cache: bool = True):
        check_ints(0, mask_id=mask_id, top_k=top_k)
        check_ints(1, gen_length=gen_length, block_length=block_length, denoising_steps=denoising_steps)
        check_real("temperature", temperature, low=0)
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
        self._take(decoder)

    def _settle(self, state: BlockState) -> None:
        """Without a cache a finished block has nothing to store: on to the next one, no forward."""
        if not state.done and not self.use_cache and self._block_full(state):
            self._next_block(state)

    def _loop_forward(self, state: BlockState) -> Generator[ForwardRequest, Any, tuple[torch.Tensor | None, Any]]:
        if state.stored and self.use_cache and self._block_full(state):   # a finished block joins the cache
            return (yield self._store_request(state, *self._span(state))), ("store", self.block_length)
        return (yield from super()._loop_forward(state))

    def _select(self, masked: torch.Tensor, confidence: torch.Tensor, count: int, probs: torch.Tensor | None = None,
                *_: Any) -> torch.Tensor:
        """`remasking_strategy`'s positions (`select_positions`; the state, block and tokens are not read)."""
        return select_positions(self.strategy, masked, confidence, probs, count, self.confidence_threshold,
                                self.eb_threshold)

    def _decided(self, state: BlockState, block: torch.Tensor, masked: torch.Tensor, change: torch.Tensor,
                 tokens: torch.Tensor | None, logits: torch.Tensor, prior: torch.Tensor | None) -> None:
        if prior is not None:   # structured output: the block filtered after the rule
            filter_block(state.constraint, state.x, prior, None, logits, *self._span(state))

    def _next_block(self, state: BlockState) -> None:
        state.block += 1
        state.step = 0
        stopped = any(stop in state.x[:, state.prompt_length:] for stop in self.stop_ids)
        if stopped and self.fill_after_stop:
            state.x[:, state.block * self.block_length:] = self.stop_ids[0]
        state.done = stopped or state.block == state.num_blocks

    def _fd_loop(self) -> tuple:
        return (all(n == 1 for n in self.schedule), "denoising_steps", self.strategy in FREEDAVE_STRATEGIES,
                f"remasking_strategy must be one of {list(FREEDAVE_STRATEGIES)}, got {self.strategy!r}")


@dataclass(frozen=True)
class SDARDecoding(NoWorkBound):
    """SDAR's loop on an engine request (`SamplingParams(decoder=SDARDecoding(...))`, JSON ``{"name": "sdar", ...}``):
    `block_diffusion_generate`'s settings, None the loop's default (`block_length` the model's, `denoising_steps`
    the block length, ``low_confidence_static``, 0.85). `rule`: the loop's commit part, remask.FreeDave or one of
    dInfer's commit rules (`decoder=` one of them is short for ``SDARDecoding(rule=...)``); the settings it replaces
    are refused. No setting sizes work past the model's block, checked at the engine (`NoWorkBound`)."""

    # the settings a commit rule replaces (refused with one; FreeDave sets all but the steps); the drop-in's
    # sampling settings besides (`blocks.rule_unread`)
    rule_replaces: ClassVar[tuple] = ("denoising_steps", "remasking_strategy", "confidence_threshold", "eb_threshold")

    qualified = True
    block_length: int | None = checked(None, check_int, minimum=1, allow_none=True)
    denoising_steps: int | None = None
    remasking_strategy: str | None = None
    confidence_threshold: float | None = checked(None, check_real, low=0, high=1, allow_none=True)
    eb_threshold: float | None = checked(None, check_real, low=0, low_open=True, allow_none=True)
    rule: Any = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_steps("SDARDecoding.denoising_steps", self.denoising_steps, self.block_length or math.inf,
                    "SDARDecoding.block_length")
        if self.remasking_strategy is not None:
            check_choice("SDARDecoding.remasking_strategy", self.remasking_strategy, REMASKING_STRATEGIES)
        check_part(self, "SDAR", self.rule_replaces, self.rule_replaces[1:], replaces="remasking_strategy")


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
    `decoder=remask.FreeDave(...)`: the same tokens with fewer forwards; one of
    dInfer's rules (`SDARDecoder`'s commit part; greedy; `SDARDecoding.rule_replaces`, top_k and top_p must stay at
    their defaults).
    `structured_outputs`: the answer held to it (compiled against `tokenizer`, default the one saved
    beside the model; the stop ids end it, only where it is complete)."""
    stops = [] if stopping_criteria_idx is None else (
        [stopping_criteria_idx] if isinstance(stopping_criteria_idx, int) else list(stopping_criteria_idx))
    kwargs = dict(mask_id=mask_id, gen_length=gen_length, block_length=block_length, temperature=temperature,
                  denoising_steps=denoising_steps, top_k=top_k, top_p=top_p, remasking_strategy=remasking_strategy,
                  confidence_threshold=confidence_threshold, eb_threshold=eb_threshold, stop_ids=stops,
                  fill_after_stop=fill_after_stop, use_cache=use_cache)
    if is_rule(decoder):
        check_rule_on_loop(decoder, "SDAR", temperature=temperature, replaces="remasking_strategy",
                           unread=rule_unread(SDARDecoding, sdar_generate, kwargs))
    decoder = SDARDecoder(decoder, **kwargs)
    decoder.constrain(structure_for_call(structured_outputs, model, tokenizer, decoder.mask_id, gen_length))
    check_generator(generator, input_ids.device if torch.is_tensor(input_ids) else "cpu")
    stats = check_stats("stats", stats) or GenerationStats()   # None: counted, then dropped
    stats.start()
    state = decode_alone(decoder, model, decoder.start(input_ids), generator, stats)
    stats.stop(int(state.x.shape[1] - state.prompt_length))
    return state.x


def engine_decoder(spec: ModelSpec, params: Any, *, store: Any, stop_ids: Sequence[int]) -> SDARDecoder:
    """One engine request's SDAR loop (`Family.engine_decoder`): `block_diffusion_generate`'s, `gen_length=max_tokens`,
    stopping after a block holding EOS or a `stop_token_ids` id, its settings from `decoder=` (`SDARDecoding`, or a
    commit part: `blocks.family_config`); `threshold`: ``low_confidence_dynamic`` at it. FreeDave sets the rule (one
    token per step, or its threshold). `store`: the engine's paged KV store (the blocks' caches); `stop_ids`: the
    engine's stop ids."""
    config = family_config(params.decoder, SDARDecoding)
    settings, block_length, part, threshold = engine_settings(spec, params, config, "SDAR")
    # a work bound, before the schedule (O(denoising_steps)) is built
    check_steps("SDARDecoding.denoising_steps", config.denoising_steps, block_length, "the block length")
    if threshold is not None:   # `threshold=`, or FreeDave's (FreeDave without one: one token per step, the default)
        if config.remasking_strategy not in (None, "low_confidence_dynamic") or config.confidence_threshold is not None:
            raise ValueError("threshold is the shorthand for SDARDecoding(remasking_strategy='low_confidence_dynamic', "
                             "confidence_threshold=...): give one of them")
        settings.update(remasking_strategy="low_confidence_dynamic", confidence_threshold=threshold)
    return SDARDecoder(part, block_store=store, mask_id=spec.mask_id, gen_length=params.max_tokens,
                       block_length=block_length, denoising_steps=settings.pop("denoising_steps", block_length),
                       temperature=params.temperature, top_k=params.top_k or 0,
                       top_p=1.0 if params.top_p is None else params.top_p,
                       stop_ids=sorted(set(stop_ids) | set(params.stop_token_ids)), **settings)
