"""Elastic-Cache for LLaDA (Nguyen-Tri, Ranjan, Shen, arXiv 2510.14973; loop
`llada/generate.py::generate_with_elastic_cache` with the trigger in `llada/model/modeling_llada.py`'s
attention, github.com/yxu-dev/Elastic-Cache): attention-aware, layer-aware K/V refresh.

No blocks and no step budget: each step decodes inside a sliding window over the first
`window_length` positions still masked, until no masked position is left. Per step:
- step 0: a full forward; every layer keeps its input hidden states, queries, keys and values for
  every position.
- later steps: only the queried positions are forwarded: the tracked tokens, the positions decoded
  at the previous step and the window (with `block_caching=False` every masked position; the
  window is then the first `window_length` of them). In each layer their fresh q/k/v overwrite the
  layer's caches and they attend over all cached keys. The tracked tokens' attention is recomputed
  from their cached (old) queries and keys; if the cosine of old and new attention (over heads,
  averaged) falls below `gamma`, every later layer is recomputed for ALL positions: the layer's
  cached input hidden states, with the fresh rows written in, run through the layer and refresh
  its caches (the layers before keep theirs).
- tracked tokens for the next step: per layer, the `track_num` positions receiving the most
  attention from the window's queries (summed over heads and queries; masked positions excluded),
  united over layers.
- commit: p = softmax(float64) of the window's logits; keep the argmax where its probability is
  >= min(`threshold`, the window's best); `threshold=None` commits the `tokens_per_iter` most
  confident instead. Once an EOS is committed, masked positions after the first EOS are dropped
  (they are returned as EOS here; upstream returns them masked).

The attention runs through remask's LLaDA `attend` seam (`ElasticKVCache`). Every forward is a
`ForwardRequest` over the queried positions whose `layers` (`ElasticLayers`) do the per-layer work:
keep each layer's input hidden states, swap in the cached ones of all positions from the first
recomputed layer on (so the row count changes between layers), set the layer's RoPE tables and the
cache's plan. The driver runs them around the model's blocks, for one request alone or for several
in one packed forward (`varlen.PackedLayers`), so no model code changes and nothing here calls the
model. Upstream decodes one row; rows of a batch are decoded one by one, each with its cache.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from remask.caches.elastic import ElasticKVCache
from remask.models.layers import rope_cos_sin
from remask.models.spec import ModelSpec

from ..parts.cache import valid_positions
from ..parts.checks import (Checked, changed, check_bool, check_config, check_instance, check_int, check_method_call,
                            check_optional_token_id, check_real, checked)
from ..parts.constrain import CommitFilter, end_ids_of
from ..parts.rules import check_rule_on_loop
from ..parts.scoring import score_tokens
from ..parts.stats import GenerationStats
from ..parts.step import CommitRule, masked_canvas
from ..parts.stepper import ForwardRequest, Progress, StepGenerator, drop_in, row_by_row


@dataclass(frozen=True)
class ElasticCache(Checked):
    """Elastic-Cache's parameters (upstream defaults; the README runs gen_length 512).

    `threshold=None` switches to upstream's top-k mode (`tokens_per_iter` per step).
    `commit_mask_token=True` reproduces upstream when the argmax is the mask token (it is
    committed: the position leaves the masked set but holds the mask token); by default the most
    probable other token is committed instead, with its probability as the confidence."""

    window_length: int = checked(16, check_int, minimum=1)
    threshold: float | None = checked(0.9, check_real, low=0.0, high=1.0, low_open=True, allow_none=True)
    gamma: float = checked(0.9, check_real, low=-1.0, high=1.0)
    track_num: int = checked(1, check_int, minimum=1)
    block_caching: bool = checked(True, check_bool)
    tokens_per_iter: int = checked(1, check_int, minimum=1)
    commit_mask_token: bool = checked(False, check_bool)

    def check_request(self, *, gen_length: int | None = None, block_length: int | None = None,
                      steps: int | None = None, prompt_length: int | None = None) -> None:
        """`window_length` and `tokens_per_iter` read "at most" (the window is the first
        `window_length` masked positions, a top-k step commits `min(tokens_per_iter, window)`): any
        value decodes, past `gen_length` as `gen_length`, at no more work (docs/parameters.md, "Work
        bounds"). `track_num` is refused past the sequence's `prompt + gen_length` positions: a layer
        tracks its `track_num` most attended positions, and the official code's `torch.topk` raises
        past them. `prompt_length` None: not known yet (checked again where the loop is built)."""
        if prompt_length is not None and self.track_num > prompt_length + gen_length:
            raise ValueError(f"use_cache.track_num must be <= {prompt_length + gen_length} (the sequence: prompt + "
                             f"gen_length), got {self.track_num}: a layer tracks at most every position (the official "
                             "code's torch.topk raises past them)")


class ElasticLayers:
    """The per-layer work of one Elastic-Cache forward (the request's `layers`; the driver calls
    `before` and `after` around each of the model's blocks, `ModelSpec.layers`). Before each block: its input hidden
    states are kept (all positions) or written into the kept ones at the queried rows, and from the
    first recomputed layer on the block runs on the kept states of all positions; the block gets
    its RoPE tables (the queried positions when the rows are as many, else 0..T-1, upstream's) and
    the cache its plan. After each block: a drift trigger (`ElasticKVCache.triggered`) makes the
    following layers recompute. `start_reset`: the first recomputed layer (-1: every layer runs on
    all positions; the layer count: none)."""

    def __init__(self, model_config: Any, cache: "ElasticKVCache", x_cache: list, query: torch.Tensor,
                 track: torch.Tensor, window: torch.Tensor, masked: torch.Tensor, start_reset: int,
                 config: ElasticCache, T: int) -> None:
        self.model_config, self.cache, self.x_cache, self.query = model_config, cache, x_cache, query
        self.start_reset, self.plan = start_reset, dict(query=query, track=track, window=window, masked=masked,
                                                        gamma=config.gamma, track_num=config.track_num)
        self.everything = torch.arange(T, device=query.device)

    def before(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if layer > self.start_reset:
            self.x_cache[layer] = h
        else:
            self.x_cache[layer][:, self.query, :] = h
            if layer == self.start_reset:
                h = self.x_cache[layer]
        # upstream's RoPE: the query positions when the rows are as many, else 0..T-1
        rope = self.query if h.shape[1] == self.query.shape[0] else self.everything
        cos, sin = rope_cos_sin(rope[None], self.model_config.head_dim, self.model_config.rope_theta)
        self.cache.plan(full=layer >= self.start_reset, **self.plan)
        return h, cos, sin

    def after(self, layer: int) -> None:
        if self.cache.triggered and self.start_reset == self.model_config.n_layers:
            self.start_reset = layer + 1


def _final_prefix(x: torch.Tensor, P: int, masked: torch.Tensor, mask_id: int, eos_id: int | None) -> int:
    """How many leading generated positions of the row `x` `[1, T]` no later step changes: those
    before the first still-masked position (a decoded position is never revisited; the window only
    holds masked ones), up to a committed mask token after an EOS (the end turns it into EOS)."""
    n = x.shape[1] - P if masked.shape[0] == 0 else int(masked[0]) - P
    if eos_id is not None:
        row = x[0, P:P + n]
        after_eos = (row == eos_id).cumsum(dim=0) > 0
        cut = ((row == mask_id) & after_eos).nonzero()
        if cut.shape[0] > 0:
            n = int(cut[0, 0])
    return n


@torch.no_grad()
def _elastic_row(spec: ModelSpec, canvas: torch.Tensor, P: int, config: ElasticCache, mask_id: int,
                 eos_id: int | None, stats: GenerationStats, trace: list | None, rule: Any, filters: Any,
                 rows: slice, key_ok: torch.Tensor | None) -> StepGenerator:
    """Elastic-Cache decoding of the row `canvas[rows]` (prompt then masks) alone, in place, as a step
    generator: a `Progress` after every forward (`final`: the row's final prefix); returns the row.
    `filters`: the batch's `CommitFilter` or None (`elastic_steps`)."""
    T, L, device = canvas.shape[1], spec.config.n_layers, canvas.device
    W, everything = config.window_length, torch.arange(T, device=device)
    x = canvas[rows]   # a view: decoded in the canvas
    constraint = None if filters is None else filters.rows([rows.start])   # the row's (one matcher)
    cache = ElasticKVCache(key_ok)
    x_cache: list[torch.Tensor | None] = [None] * L
    track_position = everything[:0].clone()
    masked = everything[P:].clone()
    decoded_eos = False
    rule_state = rule.new_state() if rule is not None else None
    if constraint is not None:
        ends_of = torch.tensor(constraint.matchers[0].end_ids, dtype=torch.long, device=device)
    new_decoded = None   # the first forward: every position through every layer
    while True:
        window = masked[:W] if config.block_caching else masked
        query_position, start_reset = (everything, -1) if new_decoded is None else (
            torch.cat([track_position, new_decoded, window]), L)
        cache.triggered = False
        layers = ElasticLayers(spec.config, cache, x_cache, query_position, track_position, window, masked, start_reset,
                               config, T)
        logits = yield ForwardRequest(x[:, query_position], cache=cache, layers=layers)
        start_reset = layers.start_reset
        # positions computed, averaged over the layers (a recomputed layer: all T)
        computed = max(start_reset, 0) * query_position.shape[0] + (L - max(start_reset, 0)) * T
        stats.forward(1, -(-computed // L), cache.nbytes)
        if trace is not None:
            trace.append((int(query_position.shape[0]), int(start_reset)))
        logits = logits[:, window, :] if logits.shape[1] == T else logits[:, -window.shape[0]:, :]
        if not config.block_caching:
            window, logits = window[:W], logits[:, :W]
        track_position = torch.cat([cache.track[layer] for layer in range(L)], dim=0).unique(sorted=False)

        if constraint is not None:
            # the filter's window: from the frontier (the first masked position) through the last
            # window position and the committed run after it; logits −inf off the window
            lo = min(constraint.frontier(0), int(window[0]))
            hi = int(window[-1]) + 1
            while hi < T and int(x[0, hi]) != mask_id:
                hi += 1
            span = torch.full((1, hi - lo, logits.shape[-1]), -torch.inf, dtype=logits.dtype, device=device)
            span[0, window - lo] = logits[0]
            span = constraint.mask_frontier(span, lo, hi, 0)   # before the rule scores (parts/constrain.py)
            logits = span[:, window - lo]
            before = x.clone()
        if rule is not None:   # a commit rule over the window (all masked): its commits and tokens
            commit, candidates = yield rule.commit_later(x[:, window], logits, mask_id, rule_state)   # (batched)
            keep = commit[0]
        else:   # the float64 softmax's most probable token (the mask token only with commit_mask_token)
            candidates, conf = score_tokens(logits.to(torch.float64), sampler="categorical",
                                            exclude_id=None if config.commit_mask_token else mask_id)
            if config.threshold is not None:
                keep = (conf >= min(config.threshold, conf.max()))[0]
            else:
                keep = torch.topk(conf[0], k=min(config.tokens_per_iter, candidates.shape[1]), largest=True)[1]
        decoded = new_decoded = window[keep]
        tokens = candidates[:, keep]
        x[:, decoded] = tokens
        masked = masked[~torch.isin(masked, decoded)]
        if constraint is not None:   # keep what the structure accepts, advance the matcher
            proposal = torch.full((1, hi - lo), mask_id, dtype=torch.long, device=device)
            proposal[0, window - lo] = candidates[0]
            constraint.filter(x, before[:, lo:hi], proposal, span, lo, hi, 0)
            new_decoded = ((x[0] != before[0]) & (x[0] != mask_id)).nonzero().flatten()
            # the masked positions, revoked ones included, up to a committed end token (the filter
            # fills the rest once the matcher consumes it)
            left = (x[0, P:] == mask_id).nonzero().flatten() + P
            ends = torch.isin(x[0, P:], ends_of).nonzero().flatten()
            masked = left if ends.shape[0] == 0 or not bool((left < int(ends[0]) + P).any()) else \
                left[left < int(ends[0]) + P]
            stats.step((before[0] == mask_id).sum() - (x[0] == mask_id).sum())
        else:
            stats.step(decoded.shape[0])
        if eos_id is not None and not decoded_eos and constraint is None:
            eos_pos = decoded[tokens.eq(eos_id)[0]]
            if eos_pos.shape[0] > 0:
                decoded_eos = True
                masked = masked[masked <= eos_pos.min().item()]
        yield Progress(x, _final_prefix(x, P, masked, mask_id, eos_id))
        if masked.shape[0] == 0:
            break
    if decoded_eos:   # positions dropped after the first EOS: EOS (upstream leaves them masked)
        first = int(((x[0, P:] == eos_id).nonzero()[0, 0]) + P)
        tail = x[:, first:]
        tail[tail == mask_id] = eos_id
    return x


def elastic_steps(spec: ModelSpec, prompt: torch.Tensor, *, config: ElasticCache | None = None,
                  gen_length: int = 512, attention_mask: torch.Tensor | None = None, mask_id: int | None = None,
                  eos_id: int | None = None, stats: GenerationStats | None = None,
                  trace: list | None = None, rule: Any = None, structure: Any = None, end_ids: Any = ()
                  ) -> StepGenerator:
    """`elastic_generate`'s loop as a step generator (`diffusion/parts/stepper.py`), its arguments
    checked at the call: a `ForwardRequest` per forward (its `layers`, `ElasticLayers`, do the
    per-layer work) and a `Progress` after it (rows are decoded one by one; `final`: for one row,
    the generated positions before the window, which never change; for several rows 0 until the
    last row); returns `[B, P + gen_length]`. `structure` / `end_ids`: structured output around
    Elastic's own rule or `rule` (`diffusion/parts/constrain.py`; what it changes in Elastic's
    loop: docs/quirks.md, "Structured output in ... the step-generator methods")."""
    config = check_config("config", config, ElasticCache, "a remask ElasticCache")
    check_int("gen_length", gen_length, minimum=1)
    spec, stats = check_method_call(spec, prompt, attention_mask, stats, "remask.elastic_generate", mask_id=mask_id,
                                    eos_id=eos_id)
    if spec.kind != "llada":
        raise ValueError(f"elastic_generate drives LLaDA's layers; got a {spec.kind} model")
    check_optional_token_id(spec, spec.eos_id, "eos_id")
    check_instance("trace", trace, list, "a list")
    if rule is not None:   # a commit rule without iteration smoothing, and none of Elastic's own commit settings
        if not isinstance(rule, CommitRule):   # (the rule replaces them), each refused naming both parts
            raise ValueError(f"decoder: Elastic-Cache takes a commit rule (a remask CommitRule: ThresholdDecoding, "
                             f"CreditDecoding, HierarchicalDecoding, MarginDecoding, ...), got {type(rule).__name__}")
        replaced = ("threshold", "tokens_per_iter", "commit_mask_token")
        unread = {name: getattr(config, name) for name in changed(config, replaced)}
        check_rule_on_loop(rule, "Elastic-Cache", temperature=0, unread=unread, replaces="commit rule")
    B, P = prompt.shape
    config.check_request(gen_length=gen_length, prompt_length=P)
    x = masked_canvas(prompt, gen_length, spec.mask_id, spec.device)
    key_ok = valid_positions(attention_mask, P + gen_length)   # False on the left pads
    filters = CommitFilter.start(structure, end_ids_of(spec, end_ids), B, spec.mask_id, P, gen_length)
    decode_row = partial(_elastic_row, spec, x, P, config, spec.mask_id, spec.eos_id, stats, trace, rule, filters)
    return row_by_row(x, decode_row, key_ok, stats, B * gen_length)


@drop_in(elastic_steps)
def elastic_generate() -> torch.Tensor:
    """Elastic-Cache decoding (greedy). Returns `[B, P + gen_length]`.

    `eos_id` (default: the model's): once committed, the masked positions after the first EOS are
    dropped and returned as EOS. `attention_mask` `[B, P]` (left padding) hides pad keys (upstream
    has none). `trace`: a list that receives `(queried positions, first recomputed layer)` per row
    and step (the layer count when nothing was recomputed; -1 for the first, full forward).
    `rule`: a commit rule (`remask.diffusion.parts.step.CommitRule`: dInfer's, `MarginDecoding`, …) that
    decides each step's commits in the window instead of Elastic-Cache's own threshold / top-k rule
    (a combination no paper shipped; Elastic's `threshold`, `tokens_per_iter` and
    `commit_mask_token` are then not read and refused when set)."""
