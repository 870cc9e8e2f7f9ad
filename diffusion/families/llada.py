"""LLaDA-style block semi-autoregressive decoding, and Fast-dLLM parallel decoding on top of it.

`generate` reproduces ML-GSAI/LLaDA `generate.py` (integer schedule, top-k commit, CFG, random
remasking, EOS options, left-padded batches); with `threshold` / `factor`, NVlabs/Fast-dLLM v1's
(loop until the block is decoded, float64 confidences). Any diffusion model with a spec works. A
step: forward (`ModelSpec.logits`) → `score_rows` (the block's rows) → `remask.kernels.unmask`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Generator, Sequence

import torch

from remask.caches import KVCache, PagedKVCache
from remask.kernels import unmask
from remask.models.spec import ModelSpec

from ..parts.sparse import BlockMaskForward, RetentionForward, SparseConfig
from ..parts.cache import BlockForward, cache_mode, valid_positions
from ..parts.checks import (CombinationError, check_bools, check_choice, check_generator, check_instance, check_ints,
                            check_length, check_mask_id, check_prompt, check_real, check_stats, check_token_id,
                            warn_if_longer_than_trained, warn_if_padded_without_mask)
from ..parts.constrain import CommitFilter, before_rule, end_ids_of
from ..parts.scoring import score_rows, score_tokens
from ..parts.selection import frechet_profile_counts, schedule_counts, topk_commit
from ..parts.stats import GenerationStats
from ..parts.step import CommitRule, masked_canvas, stacked_rule_commit
from ..parts.stepper import ForwardRequest, ForwardThenCommit, guided_forward, run_forwards

REMASKING = ("low_confidence", "random")


@dataclass(frozen=True)
class Precision:
    """Dtypes in which a reference computes confidences (for bit-exact reproduction): the softmax
    (None = the logits' dtype) and the uniforms of random remasking."""

    softmax: torch.dtype | None
    random: torch.dtype


LLADA_PRECISION = Precision(softmax=None, random=torch.float32)  # generate.py (f51cb17 dropped float64)
FAST_DLLM_PRECISION = Precision(softmax=torch.float64, random=torch.float64)  # get_transfer_index
FAST_DLLM_FACTOR_PRECISION = Precision(softmax=torch.float64, random=torch.float32)  # ..._dynamic


def validate_block_args(gen_length: int, block_length: int, steps: int, length: str = "gen_length") -> tuple[int, int]:
    """Return (num_blocks, steps_per_block) or raise a ValueError naming the bad parameter (`length`: the name
    of the generation length, Dream's "the generation length")."""
    check_ints(1, **{length: gen_length, "block_length": block_length, "steps": steps})
    if gen_length % block_length:
        raise ValueError(f"{length} ({gen_length}) must be divisible by block_length ({block_length})")
    num_blocks = gen_length // block_length
    if steps % num_blocks:
        raise ValueError(f"steps ({steps}) must be divisible by the number of blocks "
                         f"({length} / block_length = {num_blocks})")
    return num_blocks, steps // num_blocks


def validate_rule(threshold: float | None, factor: float | None, frechet_margin: float | None = None) -> None:
    given = [name for name, value in (("threshold", threshold), ("factor", factor),
                                      ("frechet_margin", frechet_margin)) if value is not None]
    if len(given) > 1:
        raise ValueError(f"pass at most one of Fast-dLLM's parallel rules (threshold or factor, or Fast-dLLM++'s "
                         f"frechet_margin), got {' and '.join(given)}")
    check_real("threshold", threshold, low=0, high=1, low_open=True, allow_none=True)
    check_real("factor", factor, low=0, low_open=True, allow_none=True)
    check_real("frechet_margin", frechet_margin, allow_none=True)   # any finite δ, as Fast-dLLM++ takes it


def block_forwards(spec: ModelSpec, use_cache: Any, sparse: SparseConfig | None,
                   forward_inputs: dict[str, Any], attention_mask: torch.Tensor | None, total_len: int,
                   topk_ties: bool, steps: int = 0, gen_length: int = 0) -> Any:
    """The forwards of a block loop: sparse attention's (`parts/sparse.py`), else `BlockForward`."""
    if sparse is not None and sparse.method == "block_mask":
        return BlockMaskForward(spec, sparse, forward_inputs, steps, gen_length)
    valid = valid_positions(attention_mask, total_len)
    if sparse is not None:
        return RetentionForward(spec, sparse, forward_inputs, valid, topk_ties=topk_ties)
    return BlockForward(spec, use_cache, forward_inputs, valid)


class BlockwiseDecoder(ForwardThenCommit):
    """What LLaDA's and Dream's block decoders share (a `block_length`; states with `x`, `prompt_len`, the first
    block's start `first`, `forwards`, `block` and the `step` within it, 0: the block's refresh forward is next)."""

    def block_span(self, state: Any) -> tuple[int, int]:
        start = state.first + state.block * self.block_length
        return start, min(start + self.block_length, state.x.shape[1])

    def num_final(self, state: Any) -> int:
        """Generated positions that no later step changes: the blocks already decoded."""
        return max((state.x.shape[1] if state.done else self.block_span(state)[0]) - state.prompt_len, 0)

    def _forward(self, state: Any) -> Generator[ForwardRequest, Any, tuple[torch.Tensor, int]]:
        start, end = self.block_span(state)
        if state.step == 0:
            return (yield from state.forwards.refresh(state.x, start, end)), 0
        return (yield from state.forwards.step(state.x, start, end))


@dataclass
class BlockState:
    """Rows under the block loop: `x` `[B, T]` (prompt, then masks until committed), `block`, `step`."""

    x: torch.Tensor
    prompt_len: int
    forwards: Any
    forward_inputs: dict[str, Any]
    prompt_index: torch.Tensor
    finished: torch.Tensor
    stop_ids: torch.Tensor            # EOS/EOT ids of early stop and the corrected rule, on x's device
    block: int = 0
    step: int = 0
    schedule: torch.Tensor | None = None
    done: bool = False
    pending: Any = None               # the forward asked for and not yet answered (a sub-generator)
    constraint: Any = None            # structured output: a `CommitFilter` (one matcher per row), or None
    first: int = 0                    # the first block's start (the prompt's end, or aligned down: `align_blocks`)
    # a commit rule's loop (`rule=`): its memory over the block, the iterations left before the masks are counted
    # again, whether the next forward is an iteration's main one (after its cache-building forward), the forwards so
    # far (the window cache's warmup, iteration smoothing), the block the window cache last saw, the smoothed inputs
    rule_state: Any = None
    group: int = 0
    main_next: bool = False
    iter_no: int = 0
    cache_block: tuple[int, int] | None = None
    embeds: torch.Tensor | None = None


class BlockDecoder(BlockwiseDecoder):
    """LLaDA's block rule (and Fast-dLLM's rules, caches, sparse attention) as a state and a step:
    `block_diffusion_generate` drives one batch, the engine packs many states' forwards into one
    call. The constructor validates every setting (`generate` documents them).

    `rule`: a `CommitRule` commits instead of LLaDA's schedule (greedy; `steps` unread), dInfer's way
    (`diffusion/methods/dinfer.py`): a block is iterated while any row has a mask in it, in groups of
    ``max(min(masks // expected_tpf, maximum_unroll), 1)`` iterations; with `use_cache` a block's first
    iteration is a full forward that builds the cache and decodes, then the cached one; `window` (a
    `VicinityCache`: `prefix_look`, `after_look`, `warmup_steps`) recomputes ``[start − prefix_look,
    end + after_look)`` against a cache built on entering a block; the rule's `smoothing` feeds
    smoothed embeddings; `early_stop` fills a row with EOS after a block holding one. `align_blocks`:
    blocks start at ``floor(P / block_length) * block_length`` (the last may be shorter)."""

    def __init__(self, spec: ModelSpec, *, steps: int = 128, gen_length: int = 128, block_length: int = 128,
                 temperature: float = 0.0, cfg_scale: float = 0.0, remasking: str = "low_confidence",
                 logits_eos_inf: bool = False, confidence_eos_eot_inf: bool | str = False,
                 threshold: float | None = None, factor: float | None = None, precision: Precision | None = None,
                 early_stop: bool = False, reference_rng: bool = False, use_cache: str | PagedKVCache | None = None,
                 sparse: SparseConfig | None = None, reference_ties: bool = False, structure: Any = None,
                 end_ids: Sequence[int] = (), rule: CommitRule | None = None, align_blocks: bool = False,
                 window: Any = None, maximum_unroll: int = 4, expected_tpf: int = 8,
                 frechet_margin: float | None = None) -> None:
        check_mask_id(spec)
        check_instance("decoder", rule, CommitRule, "a remask commit rule (ThresholdDecoding, CreditDecoding, "
                       "HierarchicalDecoding or another CommitRule)")
        if rule is not None:
            rule.check_greedy("dInfer")
        check_bools(align_blocks=align_blocks)
        if rule is None:
            self.num_blocks, self.steps_per_block = validate_block_args(gen_length, block_length, steps)
        check_ints(1, gen_length=gen_length, block_length=block_length, maximum_unroll=maximum_unroll,
                   expected_tpf=expected_tpf)
        validate_rule(threshold, factor, frechet_margin)
        check_choice("remasking", remasking, REMASKING)
        check_real("temperature", temperature, low=0)
        check_choice("confidence_eos_eot_inf", confidence_eos_eot_inf, (False, True, "corrected"))
        check_real("cfg_scale", cfg_scale, low=0)
        check_bools(logits_eos_inf=logits_eos_inf, early_stop=early_stop, reference_rng=reference_rng,
                    reference_ties=reference_ties)
        mode = cache_mode(use_cache)
        if mode is not None and cfg_scale > 0:
            raise ValueError("cfg_scale > 0 cannot be combined with use_cache (Fast-dLLM's caches have no CFG pass); "
                             "use use_cache=None")
        if mode is not None and spec.logit_shift and rule is None:
            raise CombinationError(f"use_cache={mode!r} in the LLaDA block loop needs unshifted logits; for Dream "
                                   "use remask.diffusion_generate(..., use_cache=...) or, in the engine, "
                                   "SamplingParams(alg=..., use_cache=...) (Fast-dLLM's Dream block decoder)")
        if sparse is not None:
            check_instance("sparse", sparse, SparseConfig, "a remask.SparseConfig")
            sparse.validate(block_length)
            clashes = [name for name, bad in (("use_cache", mode is not None), ("cfg_scale", cfg_scale > 0)) if bad]
            if clashes:
                raise ValueError(f"sparse= keeps its own cache and has no CFG pass; it does not combine with {clashes}")
            if spec.logit_shift:
                raise CombinationError("sparse= in the LLaDA block loop needs unshifted logits (LLaDA-format models)")
        if precision is None:
            precision = FAST_DLLM_FACTOR_PRECISION if factor is not None else (
                LLADA_PRECISION if threshold is None and frechet_margin is None else FAST_DLLM_PRECISION)
        self.suppress = [check_token_id(spec, spec.eos_id, "eos_id")] if logits_eos_inf else None
        stop_ids = ([check_token_id(spec, spec.eos_id, "eos_id"), check_token_id(spec, spec.eot_id, "eot_id")]
                    if confidence_eos_eot_inf else [])
        # As implemented upstream: the chained assignment after the argmax zeroes p(EOT) in the
        # confidence softmax; at T=0 the noisy logits alias the logits, so p(EOS) too.
        self.zero_prob_ids = stop_ids[0 if temperature == 0 else 1:] if confidence_eos_eot_inf is True else None
        if early_stop:   # a commit rule's loop (dInfer's) stops on EOS alone
            stop_ids = [i for i in (spec.eos_id, spec.eot_id)[:1 if rule is not None else 2] if i is not None]
            if not stop_ids:
                raise ValueError("early_stop needs an eos_id in the model spec; pass eos_id explicitly")
        self.spec, self.mode, self.use_cache, self.sparse, self.precision = spec, mode, use_cache, sparse, precision
        self.gen_length, self.block_length, self.steps = gen_length, block_length, steps
        self.temperature, self.cfg_scale, self.remasking = temperature, cfg_scale, remasking
        self.threshold, self.factor, self.early_stop, self.stop_ids = threshold, factor, early_stop, stop_ids
        self.frechet_margin = frechet_margin
        self.confidence_eos_eot_inf, self.reference_ties = confidence_eos_eot_inf, reference_ties
        self.parallel = threshold is not None or factor is not None or frechet_margin is not None
        self.reference_sampling = temperature > 0 and reference_rng
        # structured output (remask/structured.py): a CompiledStructure, and the ids that end an answer
        self.structure, self.end_ids = structure, end_ids_of(spec, end_ids)
        self.rule, self.align_blocks, self.window = rule, align_blocks, window
        # a rule's commits batch across requests unless they smooth or keep a state that does not stack (`commit_key`)
        self.rule_alone = rule is not None and (rule.smoothing is not None or not rule.batches(rule.new_state()))
        self.maximum_unroll, self.expected_tpf = maximum_unroll, expected_tpf

    def check_input(self, prompt: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        """The prompt checks of this rule (call before `start`)."""
        check_prompt(self.spec.device, prompt, attention_mask, spec=self.spec, mask_in_prompt="refuse")
        check_length(self.spec, prompt.shape[1] + self.gen_length, "prompt length + gen_length")
        if self.sparse is not None:
            self.sparse.check_request(gen_length=self.gen_length, block_length=self.block_length, steps=self.steps,
                                      prompt_length=prompt.shape[1])
            if self.sparse.method == "block_mask" and attention_mask is not None and not bool(attention_mask.all()):
                raise ValueError("sparse method 'block_mask' decodes unpadded rows (SparseD's block masks cover the "
                                 "whole sequence); pass rows of equal length or decode them one at a time")

    def start(self, prompt: torch.Tensor, attention_mask: torch.Tensor | None = None) -> BlockState:
        spec, mask_id = self.spec, self.spec.mask_id
        B, P = prompt.shape
        T = P + self.gen_length
        x = masked_canvas(prompt, T - P, mask_id)
        forward_inputs = spec.forward_inputs(attention_mask, T)
        forwards = block_forwards(spec, self.use_cache, self.sparse, forward_inputs, attention_mask, T,
                                  self.reference_ties, self.steps, self.gen_length)
        state = BlockState(x=x, prompt_len=P, forwards=forwards, forward_inputs=forward_inputs,
                           prompt_index=x != mask_id, finished=torch.zeros(B, dtype=torch.bool, device=x.device),
                           stop_ids=torch.tensor(self.stop_ids, dtype=torch.long, device=x.device),
                           constraint=CommitFilter.start(self.structure, self.end_ids, B, mask_id, P, self.gen_length),
                           first=(P // self.block_length) * self.block_length if self.align_blocks else P)
        if self.rule is not None and self.rule.smoothing is not None:
            state.embeds = self.rule.smoothing.embed(spec.embeddings, x, mask_id)
        self._begin_block(state)
        return state

    def _begin_block(self, state: BlockState) -> None:
        start, end = self.block_span(state)
        state.step = 0
        if self.rule is not None:
            state.rule_state, state.group = self.rule.new_state(), 0
            self._next_group(state)
            return
        state.schedule = schedule_counts(state.x[:, start:end] == self.spec.mask_id, self.steps_per_block)

    def _next_group(self, state: BlockState, left: int | None = None) -> None:
        """A commit rule's loop at the end of a group of iterations: the block's masks counted (the
        step's host wait; `left` where counted already); none left ends the block, else the next group's size."""
        start, end = self.block_span(state)
        if left is None:
            left = int((state.x[:, start:end] == self.spec.mask_id).sum())
        if left == 0:
            self._end_block(state, state.x[:, start:end], end)
        else:
            state.group = max(min(left // self.expected_tpf, self.maximum_unroll), 1)

    def _builds_cache(self, state: BlockState, start: int, end: int) -> bool:
        """Whether a commit rule's iteration starts with a full forward building the cache (and decoding)."""
        w = self.window
        if w is None:
            return state.forwards.mode is not None and state.step == 0
        if state.iter_no < w.warmup_steps:
            return False
        if state.forwards.cache is None:
            return True
        # dInfer's cache manager: "a new block" is judged against the block of its previous query,
        # which it has not seen when the cache was first built
        changed, state.cache_block = state.cache_block != (start, end), (start, end)
        return changed and state.block > 0

    def _rule_forward(self, state: BlockState) -> Generator[ForwardRequest, Any, tuple[torch.Tensor, int]]:
        start, end = self.block_span(state)
        forwards, T, w = state.forwards, state.x.shape[1], self.window
        inputs = state.x if state.embeds is None else state.embeds
        state.main_next = not state.main_next and self._builds_cache(state, start, end)
        if state.main_next:   # a full forward into a new cache
            forwards.cache = KVCache()
        if w is None:
            return (yield from forwards.step(inputs, start, end, refresh=state.main_next))
        lo, hi = (0, T) if state.main_next else (max(0, start - w.prefix_look), min(T, end + w.after_look))
        logits = yield from forwards.span(inputs, lo, hi, forwards.cache)   # (before the cache: a full forward)
        return logits, 0 if forwards.cache is None else lo

    def _rule_commit(self, state: BlockState, logits: torch.Tensor, fed: int, stats: GenerationStats | None) -> None:
        """A commit rule's decode of the block (`rule=`), then the iteration's end (class docstring)."""
        x, mask_id, rule, smoothing = state.x, self.spec.mask_id, self.rule, self.rule.smoothing
        start, end = self.block_span(state)
        if stats is not None:
            stats.forward(len(x), logits.shape[1], state.forwards.cache_nbytes)
        if smoothing is not None:   # this iteration's weight and threshold
            weight, threshold = smoothing.at(state.iter_no, rule.threshold)
            rule = replace(rule, threshold=threshold)
        block, block_logits = x[:, start:end], logits[:, start - fed:end - fed]
        constraint = state.constraint   # the frontier masked before the rule scores (parts/constrain.py)
        block_logits, prior = before_rule(constraint, block_logits, block, start, end, 0)
        commit, tokens = rule.commit(block, block_logits, mask_id, state.rule_state)
        block[commit] = tokens[commit]
        if constraint is not None:   # keep what the structure accepts, advance the matchers
            constraint.filter(x, prior, tokens, block_logits, start, end, 0)
        if stats is not None:
            stats.step(int((prior == mask_id).sum() - (block == mask_id).sum()) if constraint is not None
                       else int(commit.sum()))
        if smoothing is not None:
            hi = fed + logits.shape[1]
            state.embeds[:, fed:hi] = smoothing.embed(self.spec.embeddings, x[:, fed:hi], mask_id, logits, weight)
        self._end_iteration(state)

    @staticmethod
    def _rules_together(decoders: Sequence["BlockDecoder"], states: Sequence[BlockState],
                        logits: Sequence[torch.Tensor], fed: Sequence[int], stats: Sequence[GenerationStats | None]
                        ) -> None:
        """`_rule_commit` of several states of one `commit_key` (one rule, no smoothing, no structure): the blocks of
        one width (a last block may be shorter) stacked into one `rule.commit_rows`, each row's commit its own."""
        spans = [d.block_span(s) for d, s in zip(decoders, states)]
        widths: dict[int, list[int]] = {}
        for i, (a, b) in enumerate(spans):
            widths.setdefault(b - a, []).append(i)
        head = decoders[0]
        for members in widths.values():
            blocks = [states[i].x[:, spans[i][0]:spans[i][1]] for i in members]
            items = [(head.rule, block, logits[i][:, spans[i][0] - fed[i]:spans[i][1] - fed[i]], head.spec.mask_id,
                      states[i].rule_state) for i, block in zip(members, blocks)]
            stacked, commit, tokens = stacked_rule_commit(items)
            stacked = torch.where(commit, tokens, stacked)
            # one host read for the lot: each row's commits and the masks its block has left
            counts = torch.stack([commit.sum(1), (stacked == head.spec.mask_id).sum(1)]).tolist()
            row = 0
            for i, block, rows in zip(members, blocks, stacked.split([len(b) for b in blocks])):
                block.copy_(rows)
                committed, left = (sum(c[row:row + len(block)]) for c in counts)
                row += len(block)
                if stats[i] is not None:
                    stats[i].forward(len(block), logits[i].shape[1], states[i].forwards.cache_nbytes)
                    stats[i].step(committed)
                decoders[i]._end_iteration(states[i], left)

    def _end_iteration(self, state: BlockState, left: int | None = None) -> None:
        """`left`: the block's masks after this iteration where the caller has counted them."""
        state.iter_no += 1
        state.step += 1
        if not state.main_next:   # the iteration's last forward
            state.group -= 1
            if state.group == 0:
                self._next_group(state, left)

    def _forward(self, state: BlockState) -> Generator[ForwardRequest, Any, tuple[torch.Tensor, int]]:
        if self.rule is not None:
            return (yield from self._rule_forward(state))
        if self.cfg_scale == 0:
            return (yield from super()._forward(state))
        # unsupervised CFG, `un + (cfg+1)(cond − un)`: the unconditional rows have every original prompt
        # position (left pads included) masked; one forward of both
        un_x = state.x.clone()
        un_x[state.prompt_index] = self.spec.mask_id
        return (yield from guided_forward(self.spec, state.x, un_x, state.forward_inputs, self.cfg_scale)), 0

    def commit(self, state: BlockState, logits: torch.Tensor, fed: int, generator: torch.Generator | None = None,
               stats: GenerationStats | None = None, on_step: Callable | None = None) -> None:
        """Score the block's rows of `logits` (positions `fed`… on), commit, and move on to the next
        step, block, or the end."""
        self.commit_together([self], [state], [logits], [fed], [stats], generator, on_step)

    @staticmethod
    def commit_together(decoders: Sequence["BlockDecoder"], states: Sequence[BlockState],
                        logits: Sequence[torch.Tensor], fed: Sequence[int], stats: Sequence[GenerationStats | None],
                        generator: torch.Generator | None = None, on_step: Callable | None = None) -> None:
        """`decoders[i].commit(states[i], logits[i], fed[i], stats=stats[i])` for every i — one decoder alone, or
        several of one `commit_key` (greedy, one rule) — in one scoring call and one unmask over all their rows, each
        row's tokens its own commit's; a parallel rule's "block over?" is one host read for the lot. A commit rule's
        (`rule=`): `_rules_together`."""
        head, state, alone = decoders[0], states[0], len(states) == 1
        if head.rule is not None:
            if alone:
                return head._rule_commit(state, logits[0], fed[0], stats[0])
            return BlockDecoder._rules_together(decoders, states, logits, fed, stats)
        x, mask_id, precision, width = state.x, head.spec.mask_id, head.precision, head.block_length
        spans = [d.block_span(s) for d, s in zip(decoders, states)]
        (start, end), (B, L) = spans[0], logits[0].shape[:2]
        local = start - fed[0]   # the block's first row within the (first) logits
        # a view when alone: unmask writes the committed tokens straight into x
        block_x = x[:, start:end] if alone else torch.cat([s.x[:, a:b] for s, (a, b) in zip(states, spans)])
        constraint = state.constraint   # (a structure commits alone)
        # the first undecided position's logits hold only what the structure allows (before the rule)
        lg, prior = before_rule(constraint, logits[0], block_x, start, end, local)
        if head.reference_sampling and head.mode == "prefix" and state.step > 0 and head.frechet_margin is None:
            # Fast-dLLM v1's prefix loop draws (and discards) one extra noise tensor per cached step (Fast-dLLM++'s,
            # whose loop `frechet_margin` follows, does not).
            torch.rand(lg.shape, dtype=torch.float64, device=x.device, generator=generator)
        if head.reference_sampling or head.reference_ties:
            # The reference's formulation over the whole [B, T, V] logits: its float64 noise
            # stream, and its softmax rounding (which decides its ties at p = 1.0).
            x0, conf = score_tokens(lg, temperature=head.temperature, suppress_ids=head.suppress,
                                    zero_prob_ids=head.zero_prob_ids, softmax_dtype=precision.softmax,
                                    exclude_id=mask_id, generator=generator)
            x0, conf = x0[:, local:local + width], conf[:, local:local + width]
        else:
            # each row's block in the logits flattened: state i's rows one after another, its block `start - fed` on
            first, offset = [], 0
            for part, f, (a, _) in zip(logits, fed, spans):
                first += [offset + b * part.shape[1] + a - f for b in range(part.shape[0])]
                offset += part.shape[0] * part.shape[1]
            rows = (torch.tensor(first, device=x.device)[:, None] + torch.arange(width, device=x.device)).reshape(-1)
            flat = lg if alone else torch.cat([part.reshape(-1, part.shape[-1]) for part in logits])
            x0, conf = score_rows(flat, rows, temperature=head.temperature, suppress_ids=head.suppress,
                                  zero_prob_ids=head.zero_prob_ids, exclude_id=mask_id, generator=generator,
                                  rows_in_bounds=True)
            # Rounded to the reference's softmax dtype, so its ties (e.g. p = 1.0) are its ties.
            x0, conf = x0.view(len(first), width), conf.view(len(first), width).to(precision.softmax or lg.dtype)
        if head.remasking == "random":
            # Drawn over every position the forward computed, as upstream, then cut to the block.
            conf = torch.rand((B, L), dtype=precision.random, device=x.device, generator=generator)[:, local:local + width]
        if head.confidence_eos_eot_inf == "corrected":
            # What the option was meant to do: commit EOS/EOT only when nothing else is left.
            conf = conf.masked_fill(torch.isin(x0, state.stop_ids), -torch.inf)
        block_mask = block_x == mask_id
        before = block_mask.clone() if on_step is not None else None
        # the schedule's budget `k` per row, or Fast-dLLM++'s Fréchet profile budget (a threshold or factor rule is
        # parallel: no budget)
        k = None if head.parallel else torch.cat([d._budget(s) for d, s in zip(decoders, states)])
        if head.frechet_margin is not None:
            k = frechet_profile_counts(conf, block_mask, head.frechet_margin)
        if head.reference_ties and not head.parallel:
            committed = topk_commit(block_x, block_mask, x0, conf, k, L, local)
        else:   # commit into `block_x` (clearing `block_mask`); the counts `[B]`
            committed = unmask(block_x, block_mask, x0, conf, k=k, threshold=head.threshold, factor=head.factor)
        if constraint is not None:
            # keep what the structure accepts, advance the matchers (parts/constrain.py)
            committed = torch.tensor(constraint.filter(x, prior, x0, lg, start, end, local), device=x.device)
            block_mask = block_x == mask_id
        if on_step is not None:
            transfer = torch.zeros_like(x, dtype=torch.bool)
            transfer[:, start:end] = before & ~block_mask
            on_step(state.block, x, transfer)
        # unmask cleared the committed positions of block_mask; with a parallel rule (or a structure, whose filter
        # may leave holes the schedule did not plan) the block ends when none is left (the step's one host wait)
        left = counts = None
        if head.parallel or constraint is not None:   # each row's masks left and commits in that one read
            left, counts = torch.stack([block_mask.any(dim=1).long(), committed.long()]).tolist()
        offset = 0
        for i, (decoder, s, (a, b)) in enumerate(zip(decoders, states, spans)):
            own = slice(offset, offset + len(s.x))   # the state's rows in the stacked blocks
            offset = own.stop
            if not alone:
                s.x[:, a:b] = block_x[own]
            if stats[i] is not None:
                stats[i].forward(len(s.x) * (2 if decoder.cfg_scale > 0 else 1), logits[i].shape[1],
                                 s.forwards.cache_nbytes)
                stats[i].step(committed[own].sum() if counts is None else sum(counts[own]))
            s.step += 1
            if constraint is not None and all(constraint.finished):
                s.done = True
            elif (not any(left[own])) if left is not None else s.step == decoder.steps_per_block:
                decoder._end_block(s, s.x[:, a:b], b)

    def _budget(self, state: BlockState) -> torch.Tensor:
        """The schedule's commits per row; past it (a structure's filter left holes) one per row."""
        if state.step < self.steps_per_block:
            return state.schedule[:, state.step]
        return torch.ones_like(state.schedule[:, 0])

    def commit_key(self) -> tuple | None:
        """Equal for decoders whose commits after one shared forward one batched call can make
        (`commit_together`: greedy, the same rule and scoring settings — a commit rule (`rule=`, dInfer's) the same
        rule, without iteration smoothing, its state stacking); None when it commits alone."""
        if self.temperature > 0 or self.reference_sampling or self.reference_ties or self.cfg_scale > 0 \
                or self.remasking != "low_confidence" or self.confidence_eos_eot_inf == "corrected" \
                or self.structure is not None or self.processors or self.rule_alone:
            return None
        return (BlockDecoder, self.spec.mask_id, self.block_length, self.threshold, self.factor, self.frechet_margin,
                tuple(self.suppress or ()), tuple(self.zero_prob_ids or ()), self.precision.softmax, self.rule)

    def _end_block(self, state: BlockState, block_x: torch.Tensor, end: int) -> None:
        if self.early_stop:
            # A row stops once a fully decoded block contains a stop token; the rest becomes EOS.
            block_done = (block_x != self.spec.mask_id).all(dim=1)
            has_stop = torch.isin(block_x, state.stop_ids).any(dim=1)
            newly = block_done & has_stop & ~state.finished
            state.x[newly, end:] = self.stop_ids[0]
            state.finished |= newly
            if bool(state.finished.all()):
                state.done = True
                return
        state.block += 1
        state.done = self.block_span(state)[0] >= state.x.shape[1]
        if not state.done:
            self._begin_block(state)


@torch.no_grad()
def block_diffusion_generate(model: torch.nn.Module, prompt: torch.Tensor, attention_mask: torch.Tensor | None = None,
                             *, spec: ModelSpec, generator: torch.Generator | None = None,
                             stats: GenerationStats | None = None,
                             on_step: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
                             **settings: Any) -> torch.Tensor:
    """The block loop behind `remask.generate` and `remask.compat.fast_dllm.generate`:
    `BlockDecoder(spec, **settings)` over one batch (every argument validated first); returns
    `[B, prompt_len + gen_length]`. `use_cache` (Fast-dLLM v1): "prefix" = a full forward at each
    block start builds the K/V cache, then each step feeds the block and all after it against the
    cache cut at the block start; "dual" = each step feeds only the block, whose fresh K/V overwrite
    its cache entries; "paged" = dual over pages (`PagedKVCache`); keys cached after RoPE
    (`diffusion/parts/cache.py`). `reference_ties`: `torch.topk` over the forward-length vector the
    references build (their order among equal confidences; `selection.topk_commit`).
    """
    decoder = BlockDecoder(spec, **settings)
    decoder.check_input(prompt, attention_mask)
    check_generator(generator, prompt.device)
    check_stats("stats", stats)
    check_instance("on_step", on_step, Callable, "a callable")
    warn_if_padded_without_mask(prompt, attention_mask, spec.pad_id)
    warn_if_longer_than_trained(spec, decoder.gen_length)
    if stats is not None:
        stats.start()
    state = decoder.start(prompt, attention_mask)
    while not state.done:   # each forward alone, then its commit (with `on_step`)
        answer = run_forwards(model, [decoder.next_forward(state)])[0]
        decoder.commit(state, *decoder.finish_forward(state, answer), generator, stats, on_step)
    if stats is not None:
        stats.stop(len(state.x) * decoder.gen_length)
    return state.x
