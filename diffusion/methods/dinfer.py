"""dInfer's parallel decoders and caches for LLaDA-style models (inclusionAI/dInfer, arXiv 2510.08666).

`dinfer_generate` reproduces dInfer's `BlockWiseDiffusionLLM` / `VicinityCacheDiffusionLLM` loop at
temperature 0, token for token (reference fixtures: tests/fixtures/dinfer_reference.json):

* blocks start at ``floor(P / block_length) * block_length`` (``start_block_align=True``): the first
  may overlap the prompt tail (whose tokens are never touched), the last may be shorter;
* a block is iterated while any row has a mask in it, in groups of
  ``max(min(masks // expected_tpf, maximum_unroll), 1)`` iterations (dInfer's loop unrolling: the
  extra iterations of a finished block cost forwards and change nothing);
* ``use_cache="prefix"`` / ``"dual"``: a block's first iteration is a full forward that decodes and
  builds the cache, then a cached forward (prefix: the block and all after it; dual: the block)
  that decodes again; later iterations are cached forwards only;
* ``VicinityCache``: the first ``warmup_steps`` iterations (over the whole sequence) are full
  forwards without a cache; the cache is built by a full forward (which also decodes) when there is
  none and on entering every block but the first; every iteration then recomputes the window
  ``[start - prefix_look, end + after_look)`` against it;
* ``early_stop``: after a block, rows holding EOS in it get EOS at every later position; decoding
  ends when every row has.

The rules are described on their classes, the departures from upstream in `dinfer_generate`.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Generator

import torch

from remask.caches import KVCache
from remask.models.spec import get_spec

from ..parts.cache import BlockForward, valid_positions
from ..parts.constrain import CommitFilter, end_ids_of
from ..parts.checks import (check_bool, check_config_bounds, check_instance, check_int, check_model_kind, check_prompt,
                     check_real, check_stats, check_mask_id)
from ..parts.stats import GenerationStats
from ..parts.rules import CreditDecoding, HierarchicalDecoding, IterationSmoothing, ThresholdDecoding
from ..parts.step import CommitRule, masked_canvas
from ..parts.stepper import ForwardRequest, Progress, StepGenerator, drive

__all__ = ["ThresholdDecoding", "CreditDecoding", "HierarchicalDecoding", "VicinityCache", "IterationSmoothing",
           "dinfer_generate", "dinfer_steps"]


@dataclass(frozen=True)
class VicinityCache:
    """dInfer's vicinity cache refresh (`VicinityCacheDiffusionLLM`, dual cache): every iteration
    recomputes the window ``[start − prefix_look, end + after_look)`` (module docstring)."""

    prefix_look: int = 16
    after_look: int = 16
    warmup_steps: int = 4

    def __post_init__(self) -> None:
        for name in ("prefix_look", "after_look", "warmup_steps"):
            check_int(name, getattr(self, name), minimum=0)

    def check_request(self, *, gen_length: int | None = None, block_length: int | None = None,
                      steps: int | None = None, prompt_length: int | None = None, maximum_unroll: int = 4) -> None:
        """The work bounds of a request (docs/parameters.md, "Work bounds"; dInfer's blocks depend on
        the prompt): the window's start is 0 from `prefix_look` ≥ the last block's start, its end
        T from `after_look` ≥ T − the first block's end; a sequence runs at most `gen_length +
        blocks × maximum_unroll` iterations. `prompt_length` None: checked where the loop is built."""
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


class _Decoder:
    """A `CommitRule` in dInfer's block loop: its state made again at each block."""

    def __init__(self, rule: Any, mask_id: int, constraint: Any = None) -> None:
        self.rule, self.mask_id = rule, mask_id
        self.state = rule.new_state()
        self.constraint = constraint   # structured output: a `CommitFilter` over x's rows, or None

    def block_start(self) -> None:
        self.state = self.rule.new_state()

    def decode(self, x: torch.Tensor, logits: torch.Tensor, start: int, end: int,
               threshold: float | None = None) -> int:
        """Commit in x[:, start:end] from its logits; the committed count. `threshold`: iteration
        smoothing's, else the rule's."""
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


@dataclass
class _Run:
    model: torch.nn.Module
    spec: Any
    decoder: _Decoder
    forward_inputs: dict[str, Any]
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
    # step reporting: the canvas `[B, T]` (x may be one row of it), the prompt length, the masks left
    # in the block and its end, the positions final so far, and whether to report them (row by row
    # only the last row's are the minimum)
    canvas: torch.Tensor | None = None
    prompt_len: int = 0
    left: int = 0
    block_end: int = 0
    final: int = 0
    report_final: bool = True

    def progress(self) -> Progress:
        return Progress(self.canvas, self.final if self.report_final else 0)

    def logits(self, inputs: torch.Tensor, lo: int, hi: int,
               cache: KVCache | None) -> Generator[ForwardRequest, Any, torch.Tensor]:
        """Sub-generator: the logits of positions `[lo, hi)` (all without a cache) of `inputs`, ids
        `[B, T]` or smoothed inputs `[B, T, d]`, reading and writing `cache`. In the engine every
        such request joins the step's packed forward (`varlen.PackedAttention`)."""
        B, T = inputs.shape[:2]
        part = inputs if cache is None else inputs[:, lo:hi]
        ids, per_row = (part, {}) if inputs.dim() == 2 else (None, {"inputs_embeds": part})
        if cache is None:
            request = ForwardRequest.call(ids, {**self.forward_inputs, **per_row}, spec=self.spec)
        else:
            fwd = self.forward_inputs if lo == 0 and hi == T else \
                self.spec.inputs_for_positions(self.forward_inputs, lo, hi)
            cache.write_start = lo   # the model reads it instead of cache_position[0] (no host sync)
            request = ForwardRequest.call(ids, {**fwd, **per_row}, spec=self.spec, cache=cache,
                                          cache_position=torch.arange(lo, hi, device=inputs.device))
        out = yield request
        if self.stats is not None:
            self.stats.forward(B, hi - lo, 0 if cache is None else cache.nbytes)
        return out

    def decode(self, x: torch.Tensor, logits: torch.Tensor, start: int, end: int,
               threshold: float | None = None) -> None:
        committed = self.decoder.decode(x, logits, start, end, threshold)
        if self.stats is not None:
            self.stats.step(committed)
        self.left -= committed
        if self.left <= 0:   # the block is decoded: no later step changes it
            self.final = max(self.final, self.block_end - self.prompt_len)

    def step(self, x: torch.Tensor, lo: int, hi: int, cache: KVCache | None, start: int,
             end: int) -> StepGenerator:
        """One iteration over `[lo, hi)`: forward, decode the block, then a `Progress`; under
        iteration smoothing from the smoothed inputs, with this iteration's threshold and weight."""
        if self.smoothing is None:
            logits = yield from self.logits(x, lo, hi, cache)
            self.decode(x, logits[:, start - lo:end - lo], start, end)
            self.iter_no += 1
        else:
            sm = self.smoothing   # upstream's expressions
            weight = min(sm.cont_weight_init + sm.cont_weight_growth * self.iter_no, sm.cont_weight)
            threshold = max(1 - self.iter_no * sm.threshold_decay, self.decoder.rule.threshold)
            logits = yield from self.logits(self.embeds, lo, hi, cache)
            self.iter_no += 1
            self.decode(x, logits[:, start - lo:end - lo], start, end, threshold)
            self.embeds[:, lo:hi] = self._embed(x[:, lo:hi], logits, weight)
        del logits
        yield self.progress()

    def _embed(self, ids: torch.Tensor, logits: torch.Tensor | None = None, weight: float = 0.0) -> torch.Tensor:
        """Plain embeddings of `ids`; with `logits`, masked positions add `weight` times the expected
        embedding of their prediction (dInfer's H2Embed, tau 1)."""
        table = self.model.get_input_embeddings()
        out = table(ids)
        if logits is None:
            return out
        expected = torch.softmax(logits / 1.0, dim=-1) @ table.weight
        return torch.where((ids == self.decoder.mask_id).unsqueeze(-1), weight * expected + 1 * out, out)

    # BaseDiffusionIteration (IterationSmooth with smoothing): no cache, prefix or dual
    def iterate(self, x: torch.Tensor, start: int, end: int, block_id: int) -> StepGenerator:
        T, bf = x.shape[1], self.block_forward
        if bf.mode is None:
            yield from self.step(x, 0, T, None, start, end)
            return
        if self.smoothing is not None:
            if block_id not in self.refreshed:   # the cache-building forward
                self.refreshed.add(block_id)
                self.cache = KVCache()
                yield from self.step(x, 0, T, self.cache, start, end)
            yield from self.step(x, start, T if bf.mode == "prefix" else end, self.cache, start, end)
            if bf.mode == "prefix":
                self.cache.crop(start)   # the suffix's K/V are recomputed at every step
            return
        if block_id not in self.refreshed:
            self.refreshed.add(block_id)
            full = yield from bf.refresh(x, start, end)
            if self.stats is not None:
                self.stats.forward(x.shape[0], T, bf.cache_nbytes)
            self.decode(x, full[:, start:end], start, end)
            del full
            yield self.progress()
        logits, fed = yield from bf.step(x, start, end)
        if self.stats is not None:
            self.stats.forward(x.shape[0], logits.shape[1], bf.cache_nbytes)
        self.decode(x, logits[:, start - fed:end - fed], start, end)
        del logits
        yield self.progress()

    # VicinityCacheIteration (IterSmoothWithVicinityCache with smoothing)
    def iterate_vicinity(self, x: torch.Tensor, start: int, end: int, block_id: int,
                         vc: VicinityCache) -> StepGenerator:
        T = x.shape[1]
        if self.iter_no < vc.warmup_steps:
            yield from self.step(x, 0, T, None, start, end)
            return
        if self._vicinity_rebuild(start, end, block_id):
            self.cache = KVCache()
            yield from self.step(x, 0, T, self.cache, start, end)
        yield from self.step(x, max(0, start - vc.prefix_look), min(T, end + vc.after_look), self.cache, start, end)

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
                    yield from self.iterate(x, start, end, block_id)
                else:
                    yield from self.iterate_vicinity(x, start, end, block_id, vicinity)


def dinfer_generate(model: torch.nn.Module, prompt: torch.Tensor, *, decoder: CommitRule = ThresholdDecoding(),
                    gen_length: int = 128, block_length: int = 128, use_cache: str | VicinityCache | None = None,
                    early_stop: bool = True, attention_mask: torch.Tensor | None = None, mask_id: int | None = None,
                    eos_id: int | None = None, maximum_unroll: int = 4, expected_tpf: int = 8,
                    stats: GenerationStats | None = None) -> torch.LongTensor:
    """dInfer's block-wise decoding (greedy) with one of its decoders and caches (module docstring).

    `decoder`: `ThresholdDecoding`, `CreditDecoding`, `HierarchicalDecoding` or any other `CommitRule`
    (`remask.diffusion.parts.rules`); `use_cache`: None, "prefix", "dual" or a `VicinityCache`;
    `maximum_unroll`, `expected_tpf`: dInfer's loop unrolling (NFE, and with a `VicinityCache` the
    iteration that ends the warmup); `stats`: NFE, tokens per decode, cache bytes. Returns
    `[B, P + gen_length]`, no mask left (upstream: the batch-1 sequence with every EOS removed).

    Departures from dInfer (fce4e32), each only where upstream breaks its own output:
        * a decode where every masked position predicts the mask token commits nothing upstream,
          repeated forever; here the most confident one takes its best non-mask token;
        * upstream stops after a block where every row has EOS even with early_stop=False, leaving
          later blocks masked; here early_stop=False decodes every block;
        * batches: rows are decoded exactly as alone (hierarchical decoding is batch-1 upstream; a
          `VicinityCache` or smoothing run, whose counts span the batch upstream, decodes row by
          row); `attention_mask` keeps left pads out of attention (upstream has no padding);
        * the credit state lives for one call (upstream's can leak into the next call when a
          generation ends with masks left in later blocks).
    """
    return drive(dinfer_steps(model, prompt, decoder=decoder, gen_length=gen_length, block_length=block_length,
                              use_cache=use_cache, early_stop=early_stop, attention_mask=attention_mask,
                              mask_id=mask_id, eos_id=eos_id, maximum_unroll=maximum_unroll,
                              expected_tpf=expected_tpf, stats=stats), model)


def dinfer_steps(model: torch.nn.Module, prompt: torch.Tensor, *, decoder: CommitRule = ThresholdDecoding(),
                 gen_length: int = 128, block_length: int = 128, use_cache: str | VicinityCache | None = None,
                 early_stop: bool = True, attention_mask: torch.Tensor | None = None, mask_id: int | None = None,
                 eos_id: int | None = None, maximum_unroll: int = 4, expected_tpf: int = 8,
                 stats: GenerationStats | None = None, structure: Any = None, end_ids: Any = ()) -> StepGenerator:
    """`dinfer_generate` as a step generator (`remask.diffusion.parts.stepper`), its arguments checked at
    the call: it yields a `ForwardRequest` per forward and a `Progress` after each (`final`: the
    decoded blocks), and returns the tokens. `structure` / `end_ids`: structured output, held at
    every decode (`diffusion/parts/constrain.py`: commits filtered, a block iterated until full)."""
    check_instance("decoder", decoder, CommitRule, "a remask commit rule (ThresholdDecoding, CreditDecoding, "
                   "HierarchicalDecoding or another CommitRule)", allow_none=False)
    for name, value in (("gen_length", gen_length), ("block_length", block_length),
                        ("maximum_unroll", maximum_unroll), ("expected_tpf", expected_tpf)):
        check_int(name, value, minimum=1)
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
    constraint = CommitFilter.start(structure, end_ids_of(spec, end_ids), prompt.shape[0], spec.mask_id,
                                    prompt.shape[1], gen_length)
    return _dinfer_loop(model, spec, prompt, attention_mask, decoder, gen_length, block_length, use_cache,
                        vicinity, early_stop, maximum_unroll, expected_tpf, stats, constraint)


@torch.no_grad()
def _dinfer_loop(model, spec, prompt, attention_mask, rule, gen_length, block_length, use_cache, vicinity,
                 early_stop, maximum_unroll, expected_tpf, stats, constraint=None) -> StepGenerator:
    if stats is not None:
        stats.start()
    B, P = prompt.shape
    T = P + gen_length
    canvas = masked_canvas(prompt, gen_length, spec.mask_id)
    # decoded row by row where upstream couples a batch's rows (the vicinity warmup and unrolling,
    # iteration smoothing's iteration count): each row as alone, in its row of the canvas
    alone = vicinity is not None or rule.smoothing is not None
    rows = [slice(b, b + 1) for b in range(B)] if alone else [slice(None)]
    for i, rs in enumerate(rows):
        x, mask = canvas[rs], None if attention_mask is None else attention_mask[rs]
        forward_inputs = spec.forward_inputs(mask, T)
        block_forward = BlockForward(model, spec, None if vicinity is not None else use_cache, forward_inputs,
                                     valid_positions(mask, T))
        decoder = _Decoder(rule, spec.mask_id, None if constraint is None else constraint.rows(range(B)[rs]))
        # rows decoded earlier are final; rows after this one are not started (0 final)
        run = _Run(model, spec, decoder, forward_inputs, stats, maximum_unroll, expected_tpf, canvas=canvas,
                   prompt_len=P, report_final=i == len(rows) - 1, block_forward=block_forward,
                   smoothing=rule.smoothing)
        if rule.smoothing is not None:
            run.embeds = run._embed(x)
        for block_id, start in enumerate(range((P // block_length) * block_length, T, block_length)):
            end = min(start + block_length, T)
            yield from run.run_block(x, start, end, block_id, vicinity)
            if early_stop:
                has_eos = (x[:, start:end] == spec.eos_id).any(dim=1)
                x[has_eos, end:] = spec.eos_id
                if bool(has_eos.all()):
                    break
    if stats is not None:
        stats.stop(int(gen_length * B))
    return canvas
