"""dInfer's parallel decoders and caches for LLaDA-style models (inclusionAI/dInfer, arXiv 2510.08666).

`dinfer_generate` reproduces dInfer's `BlockWiseDiffusionLLM` / `VicinityCacheDiffusionLLM` loop at
temperature 0, token for token (reference fixtures: tests/fixtures/dinfer_reference.json):

* blocks start at ``floor(P / block_length) * block_length`` (dInfer's ``start_block_align=True``):
  the first block may overlap the prompt tail (its prompt tokens are never touched) and the last
  block may be shorter; ``P + gen_length`` positions in all, no multiple-of-block requirement;
* a block is iterated while any row has a mask in it, in groups of
  ``max(min(masks // expected_tpf, maximum_unroll), 1)`` iterations (dInfer's loop unrolling: the
  extra iterations of a finished block cost forwards and change nothing);
* ``use_cache="prefix"`` / ``"dual"``: the first iteration of a block is a full forward that
  decodes and builds the cache, then, in the same iteration, a cached forward (prefix: the block
  and everything after it; dual: the block alone) that decodes again; later iterations are cached
  forwards only;
* ``use_cache=VicinityCache(...)``: the first ``warmup_steps`` iterations (counted over the whole
  sequence) are full forwards without a cache; the cache is built by a full forward (which also
  decodes) when there is none and again on entering every block but the first; every iteration
  then recomputes the window ``[start - prefix_look, end + after_look)`` against it;
* ``early_stop``: after a block, rows holding EOS anywhere in it have every later position set to
  EOS; decoding ends when every row has.

Decoding rules (`ThresholdDecoding`, `CreditDecoding`, `HierarchicalDecoding`) are described on
their classes. Departures from upstream, each only where upstream breaks its own output, are listed
in `dinfer_generate`'s docstring.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Generator

import torch
import torch.nn.functional as F

from remask.caches import KVCache
from remask.kernels.dinfer import credit_confidence, dinfer_select
from remask.models.spec import get_spec

from ..parts.cache import BlockForward
from ..parts.checks import (check_bool, check_config_bounds, check_instance, check_int, check_model_kind, check_prompt,
                     check_real, check_stats, check_mask_id)
from ..parts.stats import GenerationStats
from ..parts.step import CommitRule
from ..parts.stepper import ForwardRequest, Progress, StepGenerator, drive

__all__ = ["ThresholdDecoding", "CreditDecoding", "HierarchicalDecoding", "VicinityCache", "IterationSmoothing",
           "dinfer_generate", "dinfer_steps"]


def _check_unit(name: str, value: Any, *, allow_none: bool = False, low_open: bool = True) -> None:
    check_real(name, value, low=0, high=1, low_open=low_open, allow_none=allow_none)


@dataclass(frozen=True)
class IterationSmoothing:
    """dInfer's iteration smoothing (`IterationSmooth`, `IterSmoothWithVicinityCache`): the model is
    fed embeddings, not ids. After each forward, every position still masked gets
    ``E[mask] + w · softmax(logits) @ E`` (its discrete embedding plus w times the expected
    embedding of its prediction), every other position its plain embedding; the next forward reads
    those. With the iteration count n (over the sequence; a cache-building forward counts too),
    ``w = min(cont_weight_init + cont_weight_growth · n, cont_weight)`` and the decoder's threshold
    is ``max(1 − n · threshold_decay, threshold)``: it starts at 1 and decays to the decoder's own.
    Set on a dInfer decoder: ``ThresholdDecoding(smoothing=IterationSmoothing())``."""

    cont_weight: float = 0.3
    cont_weight_init: float = 0.15
    cont_weight_growth: float = 0.02
    threshold_decay: float = 0.02

    def __post_init__(self) -> None:
        for name in ("cont_weight", "cont_weight_init", "cont_weight_growth", "threshold_decay"):
            check_real(name, getattr(self, name), low=0)


def _check_smoothing(rule: Any) -> None:
    """A decoder's `smoothing`: None, an `IterationSmoothing`, or its fields as a dict (the JSON form)."""
    if isinstance(rule.smoothing, dict):
        try:
            object.__setattr__(rule, "smoothing", IterationSmoothing(**rule.smoothing))
        except TypeError as e:
            raise ValueError(f"smoothing: {e}") from None
    check_instance("smoothing", rule.smoothing, IterationSmoothing, "a remask.IterationSmoothing")


@dataclass(frozen=True)
class ThresholdDecoding(CommitRule):
    """dInfer's `ThresholdParallelDecoder` at temperature 0.

    Per row: x0 = argmax of the logits, confidence = its float32 softmax probability; positions whose
    x0 is the mask token are not candidates; every masked candidate with confidence ≥
    ``min(threshold, max_confidence − 1e-5)`` is committed, i.e. all above `threshold`, or else the
    most confident one together with any within 1e-5 of it.

    Not the same rule as remask's ``generate(threshold=)`` (Fast-dLLM's): that one commits exactly
    the single top position when none reaches the threshold, never excludes mask-token
    predictions, and compares float64 confidences.
    """

    name = "threshold"
    threshold: float = 0.9
    smoothing: IterationSmoothing | None = None

    def __post_init__(self) -> None:
        _check_unit("threshold", self.threshold)
        _check_smoothing(self)

    def commit(self, block: torch.Tensor, logits: torch.Tensor, mask_id: int,
               state: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        proposal, logits, before = _proposal(block, logits, mask_id)
        _threshold_commit(proposal, logits, self.threshold, mask_id)
        return _committed(proposal, before, logits, mask_id)


@dataclass(frozen=True)
class CreditDecoding(CommitRule):
    """dInfer's `CreditThresholdParallelDecoder`: the threshold rule on credit-fused logits.

    Each block keeps a float32 credit matrix C `[B, L, V]` (zeros on entering it). At every decode
    of the block: C ← decay_beta · C (except the first), then C[b, l, top1] += p_top1 ** boost_gamma
    on the masked positions (top1 and p_top1 from the softmax of the raw logits), and the threshold
    rule runs on ``logits + credit_alpha · log(1 + C)``.
    """

    name = "credit"
    threshold: float = 0.9
    credit_alpha: float = 0.7
    boost_gamma: float = 0.2
    decay_beta: float = 0.8
    smoothing: IterationSmoothing | None = None

    def __post_init__(self) -> None:
        _check_unit("threshold", self.threshold)
        check_real("credit_alpha", self.credit_alpha, low=0)
        check_real("boost_gamma", self.boost_gamma, low=0)
        _check_unit("decay_beta", self.decay_beta, low_open=False)
        _check_smoothing(self)

    def new_state(self) -> _Credit:
        return _Credit(self)

    def commit(self, block: torch.Tensor, logits: torch.Tensor, mask_id: int,
               state: _Credit | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if state is None:
            raise ValueError("CreditDecoding keeps a credit state over a block's steps: pass state=rule.new_state()")
        proposal, logits, before = _proposal(block, logits, mask_id)
        x0, conf = state.step(logits, before)
        dinfer_select(proposal, x0, conf, mask_id, "threshold", self.threshold)
        return _committed(proposal, before, logits, mask_id)


@dataclass(frozen=True)
class HierarchicalDecoding(CommitRule):
    """dInfer's `HierarchyDecoder` at temperature 0.

    Confidence = softmax probability of the argmax on masked positions. The block's masked
    positions are split into maximal contiguous runs; in every run the most confident position(s)
    (all that tie the run's maximum) are committed if their confidence is > `low_threshold`; every
    position with confidence > `threshold` is committed too, and so is the single most confident
    masked position (the first among equals), so each step commits at least one. `threshold` or
    `low_threshold` None switches that part off (as upstream). Upstream supports one row only;
    here each row is decoded on its own.
    """

    name = "hierarchical"
    threshold: float | None = 0.9
    low_threshold: float | None = 0.4
    smoothing: IterationSmoothing | None = None

    def __post_init__(self) -> None:
        _check_unit("threshold", self.threshold, allow_none=True, low_open=False)
        _check_unit("low_threshold", self.low_threshold, allow_none=True, low_open=False)
        _check_smoothing(self)
        if self.smoothing is not None and self.threshold is None:
            # upstream computes max(1 - n * decay, None) and raises a TypeError
            raise ValueError("threshold: iteration smoothing decays the threshold towards the decoder's own; "
                             "HierarchicalDecoding(threshold=None) has none")

    def commit(self, block: torch.Tensor, logits: torch.Tensor, mask_id: int,
               state: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        proposal, logits, before = _proposal(block, logits, mask_id)
        _hierarchy_commit(proposal, logits, self, mask_id)
        return _committed(proposal, before, logits, mask_id)


@dataclass(frozen=True)
class VicinityCache:
    """dInfer's vicinity cache refresh (`VicinityCacheDiffusionLLM`, dual cache): every iteration
    recomputes the K/V of the window ``[block_start − prefix_look, block_end + after_look)`` and
    attends over the cached rest; the whole cache is rebuilt on entering a block. The first
    `warmup_steps` iterations of a sequence run without a cache."""

    prefix_look: int = 16
    after_look: int = 16
    warmup_steps: int = 4

    def __post_init__(self) -> None:
        check_int("prefix_look", self.prefix_look, minimum=0)
        check_int("after_look", self.after_look, minimum=0)
        check_int("warmup_steps", self.warmup_steps, minimum=0)

    def check_request(self, *, gen_length: int | None = None, block_length: int | None = None,
                      steps: int | None = None, prompt_length: int | None = None, maximum_unroll: int = 4) -> None:
        """The work bounds of a request (docs/parameters.md, "Work bounds"), with dInfer's blocks
        (aligned to `block_length` from position 0, so they depend on the prompt): the window's
        start `block_start − prefix_look` is 0 from the last block's start on, its end
        `block_end + after_look` the sequence's end from `T − the first block's end` on; and a
        sequence runs at most `gen_length + blocks × maximum_unroll` iterations (at least one token
        each, plus a rebuild and the unrolled tail per block), past which every one is a warmup.
        `prompt_length` None: not known yet (checked where the loop is built)."""
        if prompt_length is None:
            return
        T = prompt_length + gen_length
        first = (prompt_length // block_length) * block_length
        starts = range(first, T, block_length)
        check_config_bounds(self, "use_cache", {
            "prefix_look": (starts[-1], "the last block's start"),
            "after_look": (T - min(first + block_length, T), "the positions after the first block"),
            "warmup_steps": (gen_length + len(starts) * maximum_unroll,
                             "the most iterations the loop runs: gen_length + blocks × maximum_unroll")})


# ----------------------------------------------------------------------------------------------
# decoding rules (in place on x[:, start:end]); each returns the [B] bool "made progress" flags


def _threshold_commit(x_block: torch.Tensor, logits: torch.Tensor, threshold: float, mask_id: int) -> None:
    x0 = logits.argmax(dim=-1)
    p = F.softmax(logits.to(torch.float32), dim=-1).gather(-1, x0.unsqueeze(-1)).squeeze(-1)
    dinfer_select(x_block, x0, p, mask_id, "threshold", threshold)


def _hierarchy_commit(x_block: torch.Tensor, logits: torch.Tensor, rule: HierarchicalDecoding,
                      mask_id: int) -> None:
    x0 = logits.argmax(dim=-1)
    p = F.log_softmax(logits, dim=-1).gather(-1, x0.unsqueeze(-1)).squeeze(-1).exp()
    # a committed mask-token prediction leaves the position masked, as upstream
    dinfer_select(x_block, x0, p, mask_id, "hierarchy", rule.threshold, rule.low_threshold)


class _Credit:
    """Per-block credit state of `CreditDecoding` (reset on entering a block)."""

    def __init__(self, rule: CreditDecoding) -> None:
        self.rule, self.matrix, self.calls = rule, None, 0

    def reset(self) -> None:
        self.matrix, self.calls = None, 0

    def step(self, logits: torch.Tensor, masked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Update the credit and return (x0, confidence) of the credit-fused logits (one launch on GPU)."""
        r = self.rule
        if self.matrix is None or self.matrix.shape != logits.shape:
            self.matrix, self.calls = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device), 0
        out = credit_confidence(logits, self.matrix, masked, self.calls == 0, r.credit_alpha, r.boost_gamma,
                                r.decay_beta)
        self.calls += 1
        return out


def _fallback(x_block: torch.Tensor, before: torch.Tensor, logits: torch.Tensor, mask_id: int) -> int:
    """Rows whose step committed nothing real while masks remain (every candidate predicted the
    mask token: upstream repeats the same step forever) commit their most confident masked
    position with its best non-mask token. Returns the number of such commits."""
    masked = x_block == mask_id
    stuck = masked.any(dim=1) & (masked == before).all(dim=1)
    if not bool(stuck.any()):
        return 0
    rows = stuck.nonzero().squeeze(1)
    lg = logits[rows].to(torch.float32).clone()
    lg[..., mask_id] = -math.inf
    p, tok = F.softmax(lg, dim=-1).max(dim=-1)
    p = torch.where(masked[rows], p, -math.inf)
    pos = p.argmax(dim=1)
    x_block[rows, pos] = tok[torch.arange(len(rows)), pos]
    return len(rows)


def _proposal(block: torch.Tensor, logits: torch.Tensor,
              mask_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(a copy of the block to commit into, the logits in float32 as dInfer's decode reads them,
    the block's masked positions before the step)."""
    if block.dim() != 2 or logits.dim() != 3 or logits.shape[:2] != block.shape:
        raise ValueError(f"a block [B, L] and its logits [B, L, V], got {tuple(block.shape)} and "
                         f"{tuple(logits.shape)}")
    logits = logits if logits.dtype == torch.float32 else logits.to(torch.float32)
    return block.clone(), logits, block == mask_id


def _committed(proposal: torch.Tensor, before: torch.Tensor, logits: torch.Tensor,
               mask_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fallback (a step where every candidate predicts the mask token commits the most
    confident masked position with its best other token), then (commit, tokens)."""
    _fallback(proposal, before, logits, mask_id)
    return before & (proposal != mask_id), proposal


class _Decoder:
    """A `CommitRule` in dInfer's block loop: its state made again at each block, its commits
    written into the block."""

    def __init__(self, rule: Any, mask_id: int, constraint: Any = None) -> None:
        self.rule, self.mask_id = rule, mask_id
        self.state = rule.new_state()
        self.constraint = constraint   # structured output: a `CommitFilter` over x's rows, or None

    def block_start(self) -> None:
        self.state = self.rule.new_state()

    def decode(self, x: torch.Tensor, logits: torch.Tensor, start: int, end: int,
               threshold: float | None = None) -> int:
        """Commit in x[:, start:end] from the block's logits `[B, end-start, V]`; committed count.
        `threshold`: this iteration's (iteration smoothing), else the rule's."""
        block = x[:, start:end]
        rule = self.rule if threshold is None else replace(self.rule, threshold=threshold)
        constraint = self.constraint
        if constraint is not None:   # the frontier masked before the rule scores (parts/constrain.py)
            logits = constraint.mask_frontier(logits, start, end, 0)
            prior = block.clone()
        commit, tokens = rule.commit(block, logits, self.mask_id, self.state)
        block[commit] = tokens[commit]
        if constraint is not None:   # keep what the structure accepts, advance the matchers
            constraint.filter(x, prior, tokens, logits, start, end, 0)
            return int((prior == self.mask_id).sum() - (block == self.mask_id).sum())
        return int(commit.sum())


# ----------------------------------------------------------------------------------------------
# the block loop


@dataclass
class _Run:
    model: torch.nn.Module
    spec: Any
    decoder: _Decoder
    forward_inputs: dict[str, Any]
    valid: torch.Tensor | None
    stats: GenerationStats | None
    maximum_unroll: int
    expected_tpf: int
    iter_no: int = 0
    cache: KVCache | None = None
    cache_block: tuple[int, int] | None = None
    block_forward: BlockForward | None = None
    refreshed: set = field(default_factory=set)
    smoothing: IterationSmoothing | None = None
    embeds: torch.Tensor | None = None   # the smoothed inputs `[B, T, d]` (iteration smoothing)
    # step reporting: the whole canvas `[B, T]` (x may be one row of it), the prompt length, the
    # masks left in the current block (all rows) and its end, the generated positions final so far,
    # and whether to report them (decoding row by row, only the last row's are the minimum)
    canvas: torch.Tensor | None = None
    prompt_len: int = 0
    left: int = 0
    block_end: int = 0
    final: int = 0
    report_final: bool = True

    def progress(self) -> Progress:
        return Progress(self.canvas, self.final if self.report_final else 0)

    def _request(self, ids: torch.Tensor | None, embeds: torch.Tensor | None, lo: int, hi: int, T: int,
                 cache: KVCache | None) -> ForwardRequest:
        """The request for positions `[lo, hi)` of a canvas of `T` (all T without a cache): the ids
        `ids` or the smoothed inputs `embeds` `[B, hi - lo, d]`, reading and writing `cache`. In the
        engine every such request joins the step's packed forward (`varlen.PackedAttention`): full
        forwards, the vicinity cache's rebuilds and windows, as prefix / dual's steps."""
        per_row = {} if embeds is None else {"inputs_embeds": embeds}
        if cache is None:
            return ForwardRequest.call(ids, {**self.forward_inputs, **per_row}, spec=self.spec)
        inputs = self.forward_inputs if lo == 0 and hi == T else \
            self.spec.inputs_for_positions(self.forward_inputs, lo, hi)
        cache.write_start = lo   # the model reads it instead of cache_position[0] (no host sync)
        device = (ids if ids is not None else embeds).device
        return ForwardRequest.call(ids, {**inputs, **per_row}, spec=self.spec, cache=cache,
                                   cache_position=torch.arange(lo, hi, device=device))

    def logits(self, x: torch.Tensor, lo: int, hi: int,
               cache: KVCache | None) -> Generator[ForwardRequest, Any, torch.Tensor]:
        """Sub-generator: the logits of positions `[lo, hi)` of `x` (every position without a cache)."""
        out = yield self._request(x if cache is None else x[:, lo:hi], None, lo, hi, x.shape[1], cache)
        if self.stats is not None:
            self.stats.forward(x.shape[0], hi - lo, 0 if cache is None else cache.nbytes)
        return out

    def decode(self, x: torch.Tensor, logits: torch.Tensor, start: int, end: int,
               threshold: float | None = None) -> None:
        committed = self.decoder.decode(x, logits, start, end, threshold)
        if self.stats is not None:
            self.stats.step(committed)
        self.left -= committed
        if self.left <= 0:   # the block is decoded: no later step changes it
            self.final = max(self.final, self.block_end - self.prompt_len)

    # --- iteration smoothing (IterationSmooth / IterSmoothWithVicinityCache) --------------------
    def _smoothing_now(self) -> tuple[float, float]:
        """This iteration's continuous weight and threshold (upstream's expressions)."""
        sm = self.smoothing
        weight = min(sm.cont_weight_init + sm.cont_weight_growth * self.iter_no, sm.cont_weight)
        return weight, max(1 - self.iter_no * sm.threshold_decay, self.decoder.rule.threshold)

    def _embed(self, ids: torch.Tensor, logits: torch.Tensor | None = None, weight: float = 0.0) -> torch.Tensor:
        """Plain embeddings of `ids`; with `logits`, masked positions add `weight` times the expected
        embedding of their prediction (dInfer's H2Embed, tau 1)."""
        table = self.model.get_input_embeddings()
        out = table(ids)
        if logits is None:
            return out
        expected = torch.softmax(logits / 1.0, dim=-1) @ table.weight
        return torch.where((ids == self.decoder.mask_id).unsqueeze(-1), weight * expected + 1 * out, out)

    def _embeds_forward(self, lo: int, hi: int,
                        cache: KVCache | None) -> Generator[ForwardRequest, Any, torch.Tensor]:
        """Sub-generator: a forward of the smoothed inputs of positions `[lo, hi)` (all of them
        without a cache)."""
        embeds = self.embeds if cache is None else self.embeds[:, lo:hi]
        out = yield self._request(None, embeds, lo, hi, self.embeds.shape[1], cache)
        if self.stats is not None:
            self.stats.forward(self.embeds.shape[0], hi - lo, 0 if cache is None else cache.nbytes)
        return out

    def _smooth_step(self, x: torch.Tensor, lo: int, hi: int, cache: KVCache | None, start: int,
                     end: int) -> StepGenerator:
        """One smoothed iteration over `[lo, hi)`: forward, decode the block, new inputs there; then
        a `Progress`."""
        weight, threshold = self._smoothing_now()
        logits = yield from self._embeds_forward(lo, hi, cache)
        self.iter_no += 1
        self.decode(x, logits[:, start - lo:end - lo], start, end, threshold)
        self.embeds[:, lo:hi] = self._embed(x[:, lo:hi], logits, weight)
        del logits
        yield self.progress()

    def iterate_smooth(self, x: torch.Tensor, start: int, end: int, block_id: int) -> StepGenerator:
        T, mode = x.shape[1], self.block_forward.mode
        if mode is not None and block_id not in self.refreshed:   # the cache-building forward
            self.refreshed.add(block_id)
            self.cache = KVCache()
            yield from self._smooth_step(x, 0, T, self.cache, start, end)
        if mode is None:
            yield from self._smooth_step(x, 0, T, None, start, end)
        else:
            yield from self._smooth_step(x, start, T if mode == "prefix" else end, self.cache, start, end)
            if mode == "prefix":
                self.cache.crop(start)   # the suffix's K/V are recomputed at every step

    def iterate_vicinity_smooth(self, x: torch.Tensor, start: int, end: int, block_id: int,
                                vc: VicinityCache) -> StepGenerator:
        T = x.shape[1]
        if self.iter_no < vc.warmup_steps:
            yield from self._smooth_step(x, 0, T, None, start, end)
            return
        if self._vicinity_rebuild(start, end, block_id):
            self.cache = KVCache()
            yield from self._smooth_step(x, 0, T, self.cache, start, end)
        yield from self._smooth_step(x, max(0, start - vc.prefix_look), min(T, end + vc.after_look), self.cache,
                                     start, end)

    # BaseDiffusionIteration (no cache / prefix / dual); a `Progress` after every forward
    def iterate(self, x: torch.Tensor, start: int, end: int, block_id: int) -> StepGenerator:
        bf = self.block_forward
        if bf.mode is None:
            logits = yield from self.logits(x, 0, x.shape[1], None)
            self.decode(x, logits[:, start:end], start, end)
            del logits
            yield self.progress()
        else:
            if block_id not in self.refreshed:
                self.refreshed.add(block_id)
                full = yield from bf.refresh(x, start, end)
                self._count(x.shape[0], x.shape[1], bf)
                self.decode(x, full[:, start:end], start, end)
                del full
                yield self.progress()
            logits, fed = yield from bf.step(x, start, end)
            self._count(x.shape[0], logits.shape[1], bf)
            self.decode(x, logits[:, start - fed:end - fed], start, end)
            del logits
            yield self.progress()
        self.iter_no += 1

    def _count(self, batch: int, length: int, bf: BlockForward) -> None:
        if self.stats is not None:
            self.stats.forward(batch, length, bf.cache_nbytes)

    # VicinityCacheIteration
    def iterate_vicinity(self, x: torch.Tensor, start: int, end: int, block_id: int,
                         vc: VicinityCache) -> StepGenerator:
        T = x.shape[1]
        if self.iter_no < vc.warmup_steps:
            logits = yield from self.logits(x, 0, T, None)
            self.decode(x, logits[:, start:end], start, end)
            del logits
            self.iter_no += 1
            yield self.progress()
            return
        if self._vicinity_rebuild(start, end, block_id):
            self.cache = KVCache()
            logits = yield from self.logits(x, 0, T, self.cache)
            self.decode(x, logits[:, start:end], start, end)
            del logits
            self.iter_no += 1
            yield self.progress()
        lo, hi = max(0, start - vc.prefix_look), min(T, end + vc.after_look)
        logits = yield from self.logits(x, lo, hi, self.cache)
        self.decode(x, logits[:, start - lo:end - lo], start, end)
        del logits
        self.iter_no += 1
        yield self.progress()

    def _vicinity_rebuild(self, start: int, end: int, block_id: int) -> bool:
        """Whether the vicinity cache is (re)built before this iteration's window forward."""
        if self.cache is None:
            return True
        # dInfer's cache manager: "a new block" is judged against the block of its previous query,
        # which it has not seen when the cache was first built
        changed = self.cache_block != (start, end)
        self.cache_block = (start, end)
        return changed and block_id > 0

    def run_block(self, x: torch.Tensor, start: int, end: int, block_id: int,
                  vicinity: VicinityCache | None) -> StepGenerator:
        mask_id = self.decoder.mask_id
        self.decoder.block_start()
        self.block_end = end
        while True:
            left = int((x[:, start:end] == mask_id).sum())
            if left == 0:
                break
            self.left = left
            for _ in range(int(max(min(left // self.expected_tpf, self.maximum_unroll), 1))):
                if vicinity is None:
                    yield from (self.iterate if self.smoothing is None else self.iterate_smooth)(x, start, end,
                                                                                                  block_id)
                elif self.smoothing is None:
                    yield from self.iterate_vicinity(x, start, end, block_id, vicinity)
                else:
                    yield from self.iterate_vicinity_smooth(x, start, end, block_id, vicinity)


def dinfer_generate(
    model: torch.nn.Module,
    prompt: torch.Tensor,
    *,
    decoder: CommitRule = ThresholdDecoding(),
    gen_length: int = 128,
    block_length: int = 128,
    use_cache: str | VicinityCache | None = None,
    early_stop: bool = True,
    attention_mask: torch.Tensor | None = None,
    mask_id: int | None = None,
    eos_id: int | None = None,
    maximum_unroll: int = 4,
    expected_tpf: int = 8,
    stats: GenerationStats | None = None,
) -> torch.LongTensor:
    """dInfer's block-wise decoding (greedy) with one of its decoders and caches.

    Args:
        model: a remask LLaDA-style diffusion model (mask predictor, bidirectional attention).
        prompt: `[B, P]` token ids (left-padded with `attention_mask` when rows differ).
        decoder: a commit rule: `ThresholdDecoding`, `CreditDecoding`, `HierarchicalDecoding` or any other
            `CommitRule` (`remask.diffusion.rules`).
        gen_length, block_length: `gen_length` new positions; blocks of `block_length` aligned to
            multiples of it from position 0 (the first block may overlap the prompt, the last may be
            shorter).
        use_cache: None, "prefix", "dual" or a `VicinityCache`.
        early_stop: after a block with EOS in a row, fill the rest of that row with EOS; stop when
            every row has EOS.
        maximum_unroll, expected_tpf: dInfer's loop unrolling (affects NFE, and with a
            `VicinityCache` the iteration count that ends the warmup).
        stats: a `GenerationStats` (NFE, tokens committed per decode, cache bytes).

    Returns:
        `[B, P + gen_length]`: the prompt unchanged, no mask token left (upstream returns the
        batch-1 sequence with every EOS removed; here the full sequence is returned).

    Departures from dInfer (fce4e32), each only where upstream breaks its own output:
        * a decode where every masked position predicts the mask token commits nothing upstream and
          the loop repeats it forever; here the most confident masked position takes its best
          non-mask token instead;
        * upstream stops after a block where every row has EOS even with early_stop=False, leaving
          the later blocks masked; here early_stop=False decodes every block;
        * batches: rows are decoded exactly as alone (hierarchical decoding is batch-1 upstream;
          a `VicinityCache` run, whose warmup and unrolling count iterations over the whole batch
          upstream, decodes row by row); `attention_mask` keeps left pads out of attention
          (upstream has no padding support);
        * the credit state lives for one call (upstream's can leak into the next call when a
          generation ends with masks left in later blocks).
    """
    return drive(dinfer_steps(model, prompt, decoder=decoder, gen_length=gen_length, block_length=block_length,
                              use_cache=use_cache, early_stop=early_stop, attention_mask=attention_mask,
                              mask_id=mask_id, eos_id=eos_id, maximum_unroll=maximum_unroll,
                              expected_tpf=expected_tpf, stats=stats), model)


def dinfer_steps(
    model: torch.nn.Module,
    prompt: torch.Tensor,
    *,
    decoder: CommitRule = ThresholdDecoding(),
    gen_length: int = 128,
    block_length: int = 128,
    use_cache: str | VicinityCache | None = None,
    early_stop: bool = True,
    attention_mask: torch.Tensor | None = None,
    mask_id: int | None = None,
    eos_id: int | None = None,
    maximum_unroll: int = 4,
    expected_tpf: int = 8,
    stats: GenerationStats | None = None,
    structure: Any = None,
    end_ids: Any = (),
) -> StepGenerator:
    """`dinfer_generate` as a step generator (`remask.diffusion.stepper`): the arguments are checked
    here, at the call; the generator yields a `ForwardRequest` for every model forward (it calls no
    model: `drive` or the engine's runner answers with the logits), a `Progress` after each (with
    `final` the decoded blocks), and returns the `[B, P + gen_length]` tokens of `dinfer_generate`.
    `structure` (a `remask.structured.CompiledStructure`) and `end_ids`: structured output, held at
    every decode (`diffusion/parts/constrain.py`: the rule's commits filtered, a block iterated until
    it holds no mask)."""
    check_instance("decoder", decoder, CommitRule, "a remask commit rule (ThresholdDecoding, CreditDecoding, "
                   "HierarchicalDecoding or another CommitRule)", allow_none=False)
    check_int("gen_length", gen_length, minimum=1)
    check_int("block_length", block_length, minimum=1)
    check_int("maximum_unroll", maximum_unroll, minimum=1)
    check_int("expected_tpf", expected_tpf, minimum=1)
    check_bool("early_stop", early_stop)
    check_stats("stats", stats)
    vicinity = use_cache if isinstance(use_cache, VicinityCache) else None
    if vicinity is None and use_cache not in (None, "prefix", "dual"):
        raise ValueError(f"use_cache must be None, 'prefix', 'dual' or a remask VicinityCache, got {use_cache!r}")
    for name, value in (("mask_id", mask_id), ("eos_id", eos_id)):
        check_int(name, value, minimum=0, allow_none=True)
    spec = get_spec(model, mask_id=mask_id, eos_id=eos_id)
    check_model_kind(spec, diffusion=True, entry="remask.dinfer_generate")
    check_mask_id(spec)
    check_prompt(model, prompt, attention_mask, spec=spec, mask_in_prompt="refuse")
    if spec.eos_id is None and early_stop:
        raise ValueError("early_stop needs an EOS id: the model has none, pass eos_id=")
    if vicinity is not None:
        vicinity.check_request(gen_length=gen_length, block_length=block_length, prompt_length=prompt.shape[1],
                               maximum_unroll=maximum_unroll)

    from ..parts.constrain import CommitFilter, end_ids_of

    constraint = CommitFilter.start(structure, end_ids_of(spec, end_ids), prompt.shape[0], spec.mask_id,
                                    prompt.shape[1], gen_length)
    return _dinfer_loop(model, spec, prompt, attention_mask, decoder, gen_length, block_length, use_cache,
                        vicinity, early_stop, maximum_unroll, expected_tpf, stats, constraint)


@torch.no_grad()
def _dinfer_loop(model, spec, prompt, attention_mask, decoder, gen_length, block_length, use_cache, vicinity,
                 early_stop, maximum_unroll, expected_tpf, stats, constraint=None) -> StepGenerator:
    # decoded row by row where upstream couples a batch's rows (the vicinity warmup and unrolling,
    # iteration smoothing's iteration count): each row as alone, in its row of the canvas
    alone = vicinity is not None or decoder.smoothing is not None
    rows = [slice(b, b + 1) for b in range(prompt.shape[0])] if alone else [slice(None)]
    if stats is not None:
        stats.start()
    B, P = prompt.shape
    x = torch.full((B, P + gen_length), spec.mask_id, dtype=torch.long, device=prompt.device)
    x[:, :P] = prompt
    for i, rs in enumerate(rows):
        mask = None if attention_mask is None else attention_mask[rs]
        # rows decoded earlier are final; rows after this one are not started (0 final)
        yield from _generate(x[rs], model, spec, mask, decoder, gen_length, block_length, use_cache, vicinity,
                             early_stop, maximum_unroll, expected_tpf, stats, canvas=x,
                             report_final=i == len(rows) - 1,
                             constraint=None if constraint is None else constraint.rows(range(B)[rs]))
    if stats is not None:
        stats.stop(int(gen_length * prompt.shape[0]))
    return x


def _generate(x, model, spec, attention_mask, rule, gen_length, block_length, use_cache, vicinity, early_stop,
              maximum_unroll, expected_tpf, stats, *, canvas, report_final, constraint=None) -> StepGenerator:
    """Decode `x` `[B, P + gen_length]` (the prompt, then masks) in place: a generator yielding a
    `Progress` of `canvas` (x's rows or all of them) after every forward."""
    B, T = x.shape
    P = T - gen_length
    mask_id, eos_id = spec.mask_id, spec.eos_id
    forward_inputs = spec.forward_inputs(attention_mask, T)
    valid = None
    if attention_mask is not None:
        valid = torch.cat([attention_mask.bool(), attention_mask.new_ones((B, gen_length), dtype=torch.bool)], 1)
    run = _Run(model, spec, _Decoder(rule, mask_id, constraint), forward_inputs, valid, stats, maximum_unroll, expected_tpf,
               canvas=canvas, prompt_len=P, report_final=report_final)
    run.block_forward = BlockForward(model, spec, None if vicinity is not None else use_cache, forward_inputs, valid)
    if rule.smoothing is not None:
        run.smoothing = rule.smoothing
        run.embeds = run._embed(x)
    first = (P // block_length) * block_length
    for block_id, start in enumerate(range(first, T, block_length)):
        end = min(start + block_length, T)
        yield from run.run_block(x, start, end, block_id, vicinity)
        if early_stop:
            has_eos = (x[:, start:end] == eos_id).any(dim=1)
            x[has_eos, end:] = eos_id
            if bool(has_eos.all()):
                break
    return x
