"""d3LLM's multi-block decoding (hao-ai-lab/d3LLM `generate_multi_block`: `d3llm_llada_generate_util.py` for
LLaDA, `d3llm_dream_generate_util.py`'s `_sample_multi_block` for Dream): several blocks of the answer are
decoded at once. One loop; the model's spec shifts Dream's logits, and `variant` picks the commit rule.

The answer is cut into `gen_length / block_length` blocks, opened left to right. Each step, in this
order (per row; a row is one call of the reference, which is batch 1):

- early stop (`early_stop`): from the first EOS of the answer on, every position becomes EOS; the
  blocks wholly after it count as decoded, the block holding it counts its masks up to it;
- a block is *fully activated* once its predecessor's progress (the share of its positions decoded;
  the prompt's is 1) reaches `decoded_token_threshold`;
- one new block opens when the last open block's progress reaches `block_add_threshold` or it holds
  no mask (not after an EOS); it is fully activated if its predecessor's progress allows;
- one forward of the whole sequence; every masked position of the open blocks whose entropy (float64
  softmax, nats) is at most `threshold` (None: every one) is committed to its argmax, and the
  lowest-entropy one always; when the first fully activated block with masks got nothing, its
  lowest-entropy position is committed too.

`variant="dream"` (Dream's file): the commit takes entropies strictly below `threshold` and no lowest-entropy
one; the early stop recounts every block's masks (a changed count of 0 fully activates it). A step that
commits nothing and opens no block would repeat itself to the forward guard: there remask commits the
lowest-entropy position (docs/quirks.md).

`variant="sglang"` (SGLang's port, sgl-project/sglang `FullAttnMultiBlock`): Dream's commit rule on either model, and
its own blocks: the last one ends at the answer's end (any `gen_length`, `block_length` past it too), the first is
fully activated whatever `decoded_token_threshold`, every block whose predecessor qualifies opens in the same step
(`block_add_threshold` <= 0: all at the first), a committed mask token is not counted as decoded, and its guard is
`gen_length` + 1 forwards (SGLang's extra forward after it counted, not run). Greedy only, no early stop, no cache.

`temperature` > 0 samples as each file does, from the call's `generator` (a row's draws as upstream's after
`torch.manual_seed`): LLaDA's float64 Gumbel-max noise over the whole canvas (the entropy stays the clean
logits', the forced position takes the clean argmax), Dream's one multinomial of the tempered softmax over the
canvas (the forced position takes the draw); LLaDA's `remasking="random"` ranks by float32 uniforms drawn after
the noise. Rows of a batch draw in turn at each step.

`cache_delay_iter` < 10000 (LLaDA's `generate_multi_block_kv_cache`, Dream's `_sample_multi_block_kv_cache`): a
delayed prefix KV cache (`parts.cache.BlockForward`'s forwards). Each step, after the block opening, blocks are looked
at from the first uncached one on while they hold no mask: one gets the step it is first seen so as "completed", and
`cache_delay_iter` steps later it is cached (LLaDA's look stops at a block still waiting, Dream's goes on past it).
The step's forward is then one of: the cache's growth (forward from the cached length to the end against the cache,
which keeps the new blocks' K/V, appended after what it holds), a cached forward (the same, nothing kept), a refresh
(a full forward whose K/V, cut at the latest waiting block's start or else the cached length, replace the cache:
while a block waits, and at every step that is a multiple of `refresh_interval`), or a plain full forward (nothing
cached yet). No mask lies before the cached length, so the commit reads the fed positions' logits only (Dream's
draws too); mask counts stop at 0. Dream's early stop also passes the blocks after the EOS by.

A row ends when its answer holds no mask and every block has opened. Its count of forwards is the
reference's returned NFE (after an early stop that count includes one step with no forward, as the
reference counts it). Rows of a batch are decided alone; a finished row is not forwarded again.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Generator

import torch

from remask.caches import KVCache
from remask.models.spec import ModelSpec

from ..parts.cache import BlockForward
from ..parts.checks import (Checked, check_bool, check_choice, check_config, check_generator, check_int,
                            check_method_call, check_real, check_token_id, checked)
from ..parts.constrain import CommitFilter, before_rule, end_ids_of
from ..parts.protocol import Together
from ..parts.scoring import sample_categorical, score_rows, score_tokens
from ..parts.stats import GenerationStats
from ..parts.step import masked_canvas
from ..parts.stepper import ForwardRequest, Progress, StepGenerator, drop_in

MAX_FORWARDS = 10000   # d3LLM's loop guard (reached only when the mask token is committed)
NO_CACHE = 10000   # a `cache_delay_iter` this large: no cache (Dream's entry point's switch)
VARIANTS = ("llada", "dream", "sglang")


@dataclass(frozen=True)
class MultiBlock(Checked):
    """`generate_multi_block`'s parameters, its names and defaults (`max_new_tokens` / `block_size` are the
    entry point's `gen_length` / `block_length`). `eos_token_id` None: the model's EOS. `commit_mask_token`:
    commit an argmax equal to the mask token as upstream does (it stays masked; remask's default commits the
    most probable other token, so no mask is ever returned). `variant`: d3LLM's "llada" or "dream" file, or
    "sglang", SGLang's port (module docstring); None: the model's own (Dream's on a model that shifts its logits).
    The defaults are d3LLM's; SGLang's (0.4, 0.1, 0.95) are `MultiBlock.sglang()`'s. `cache_delay_iter` /
    `refresh_interval`: the files' delayed KV cache (module docstring), off at `cache_delay_iter` >= 10000."""

    threshold: float | None = checked(0.5, check_real, allow_none=True)
    block_add_threshold: float = checked(0.5, check_real)
    decoded_token_threshold: float = checked(0.5, check_real)
    early_stop: bool = checked(False, check_bool)
    eos_token_id: int | None = checked(None, check_int, minimum=0, allow_none=True)
    commit_mask_token: bool = checked(False, check_bool)
    variant: str | None = checked(None, check_choice, choices=VARIANTS + (None,))
    cache_delay_iter: int = checked(NO_CACHE, check_int, minimum=0)
    refresh_interval: int = checked(10000, check_int, minimum=1)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.variant == "sglang" and (self.early_stop or self.cached):
            raise ValueError(f"{'early_stop' if self.early_stop else 'cache_delay_iter'}: SGLang's port "
                             f"(variant='sglang') has no early stop and no KV cache")

    @classmethod
    def sglang(cls, **settings: Any) -> MultiBlock:
        """`variant="sglang"` with SGLang's defaults (`FullAttnMultiBlock`'s), `settings` over them."""
        return cls(**{"threshold": 0.4, "block_add_threshold": 0.1, "decoded_token_threshold": 0.95,
                      "variant": "sglang", **settings})

    @property
    def cached(self) -> bool:
        return self.cache_delay_iter < NO_CACHE

    def check_request(self, *, gen_length: int | None = None, block_length: int | None = None,
                      steps: int | None = None, prompt_length: int | None = None) -> None:
        """Upstream never opens the positions past the last whole block and loops to its forward
        guard: a `gen_length` that is no multiple of `block_length` is refused (SGLang's cuts its last block)."""
        if self.variant != "sglang" and None not in (gen_length, block_length) and gen_length % block_length:
            raise ValueError(f"gen_length ({gen_length}) must be a multiple of block_length ({block_length}) "
                             f"for MultiBlock")


class _Block:
    def __init__(self, start: int, end: int, masks: int, full: bool, completed: int | None = None) -> None:
        self.start, self.end, self.masks, self.full = start, end, masks, full
        self.completed, self.cached = completed, False   # the cache's: the step it was seen decoded; in the cache

    @property
    def progress(self) -> float:
        return 1 - self.masks / (self.end - self.start)


class _Row:
    """One row's blocks (block 0: the prompt, decoded) and counters, as upstream keeps them."""

    def __init__(self, config: MultiBlock, P: int, gen_length: int, block_length: int, dream: bool,
                 sampling: tuple = (0.0, "low_confidence", None), kv: BlockForward | None = None) -> None:
        self.config, self.P, self.block_length, self.dream = config, P, block_length, dream
        self.T, self.num_blocks = P + gen_length, -(-gen_length // block_length)   # SGLang's last block: partial
        self.sglang = config.variant == "sglang"
        # `kv`: the row's forwards with the cache (or None); `lo`: the first position its step forwarded
        self.sampling, self.kv, self.cached, self.lo = sampling, kv, 0, 0
        self.blocks = [_Block(0, P, 0, True, completed=0)]
        self.next, self.nfe, self.done, self.has_eos = 1, 0, False, False
        self._open(masks=min(block_length, gen_length), full=self.sglang or 1.0 >= config.decoded_token_threshold)

    def _open(self, masks: int, full: bool) -> _Block:
        start = self.P + (self.next - 1) * self.block_length
        self.blocks.append(_Block(start, min(start + self.block_length, self.T), masks, full))
        self.next += 1
        return self.blocks[-1]

    def begin_step(self, x: torch.Tensor, mask_id: int, eos_id: int, ended: bool = False) -> int | None:
        """Upstream's step up to its forward on row `x` (written in place): the end of the open
        blocks, or None when the row is done (or `ended`: its structure ended it)."""
        # upstream takes the step's masks here, before the early stop's fill: the positions it fills
        # with EOS stay candidates of this step's commit (a commit there overwrites the EOS)
        self.masked = x[self.P:] == mask_id
        if self.done or ended or (not bool(self.masked.any()) and self.next > self.num_blocks):
            return self._finish()
        self.nfe += 1
        if self.config.early_stop and self._early_stop(x, mask_id, eos_id):
            return self._finish()
        for prev, block in zip(self.blocks, self.blocks[1:]):
            block.full = block.full or prev.progress >= self.config.decoded_token_threshold
        while self._opens():   # d3LLM opens one block a step, SGLang each whose predecessor qualifies
            block = self._open(0, self.blocks[-1].progress >= self.config.decoded_token_threshold)
            block.masks = int((x[block.start:block.end] == mask_id).sum())
            if not self.sglang:
                break
        open_ = [b for b in self.blocks[1:] if b.full or b.masks > 0]
        if not open_ or (self.kv is not None and self._plan() >= open_[-1].end):   # upstream's stops
            return self._finish()
        return open_[-1].end

    def _plan(self) -> int:
        """The cache's bookkeeping before the forward (module docstring): the blocks cached now (`grow`: the
        positions the cache gains), whether the forward refreshes the cache; returns the first position to forward."""
        delay_iter, grow_to = self.config.cache_delay_iter, self.cached
        for block in [b for b in self.blocks if b.end > self.cached]:
            if block.masks != 0:
                break
            block.completed = self.nfe if block.completed is None else block.completed
            delay = self.nfe - block.completed
            if delay >= delay_iter and not block.cached:
                block.cached, grow_to = True, block.end
            elif delay < delay_iter and not self.dream:   # Dream's look goes on past a waiting block
                break
        waiting = [b for b in self.blocks if b.masks == 0 and b.completed is not None and not b.cached]
        self.grow = grow_to - self.cached
        self.refresh = not self.grow and self.kv.cache is not None and (
            bool(waiting) or self.nfe % self.config.refresh_interval == 0)
        self.cut = waiting[-1].start if waiting else self.cached   # what a refresh keeps
        return min([self.cached] + [b.start for b in self.blocks if b.masks > 0 or b in waiting])

    def forward(self, x: torch.Tensor) -> Generator[ForwardRequest, Any, torch.Tensor]:
        """The step's forward of the row `x` `[1, T]` as `_plan` set it: its logits `[1, T, V]`, 0 before the first
        position fed (`self.lo`; those before it are decoded)."""
        kv, T = self.kv, x.shape[1]
        self.lo = 0 if kv.cache is None or self.refresh else self.cached
        if kv.cache is None and not self.grow:   # nothing cached yet: a full forward
            return (yield from kv.span(x, 0, T, None))
        if self.lo == 0:
            kv.cache = KVCache()
        held = kv.cache.get_seq_length()   # upstream appends the new K/V after what the cache holds
        logits = yield from kv.span(x, self.lo, T, kv.cache, write_at=held)
        kv.cache.crop(self.cut if self.refresh else held + self.grow)
        self.cached += self.grow
        return torch.nn.functional.pad(logits, (0, 0, self.lo, 0))

    def _opens(self) -> bool:
        """Upstream opens the next block: the last open one reached `block_add_threshold` or has no mask."""
        last = self.blocks[-1]
        return self.next <= self.num_blocks and not self.has_eos and (
            last.progress >= self.config.block_add_threshold or last.masks == 0)

    def _finish(self) -> None:
        self.done = True
        self.masked = torch.zeros_like(self.masked)

    def _early_stop(self, x: torch.Tensor, mask_id: int, eos_id: int) -> bool:
        """Upstream's `handle_early_stop` and the blocks it opens after an EOS; True: no mask is left."""
        eos = (x[self.P:] == eos_id).nonzero()
        self.has_eos = len(eos) > 0
        if not self.has_eos:
            return False
        first = self.P + int(eos[0])
        x[first + 1:] = eos_id
        for block in self.blocks[1:]:
            if block.start > first and block.masks != 0:
                block.masks, block.full = 0, True
            elif block.start <= first < block.end or self.dream:   # Dream recounts every block
                masks = int((x[block.start:min(block.end, first + 1)] == mask_id).sum())
                block.full = block.full or (masks == 0 and block.masks != 0)   # a changed count of 0
                block.masks = masks
            if self.dream and block.start > first:   # Dream's cache passes the blocks after the EOS by
                block.cached, block.completed = True, self.nfe if block.completed is None else block.completed
        while self.next <= self.num_blocks and self.P + (self.next - 1) * self.block_length > first:
            block = self._open(masks=0, full=True)
            block.completed, block.cached = self.nfe, True   # the cache's look passes them by
        return not bool((x[self.P:] == mask_id).any())

    def commit(self, x: torch.Tensor, logits: torch.Tensor, end: int, mask_id: int,
               scored: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Upstream's commit on row `x` (written in place) from its logits `[T, V]` and `scored`, the greedy token
        and negative entropy of `logits[P:end]` (`_score_spans`), the open blocks ending at `end`, then the blocks'
        counts and the forward guard; returns the candidates of `x[P:end]` (the mask token excluded by default),
        drawn as upstream (over the whole canvas) from `self.sampling`: (temperature, remasking, generator)."""
        temperature, remasking, generator = self.sampling
        exclude = None if self.config.commit_mask_token else mask_id
        x0, neg_entropy = scored
        masked = self.masked[:end - self.P]
        entropy = torch.where(masked, -neg_entropy, torch.inf)
        drawn = x0   # the threshold's tokens; LLaDA's forced position takes the clean argmax x0, Dream's the draw
        if temperature > 0 and self.dream:   # one multinomial of the tempered softmax over the forwarded rows
            draw = sample_categorical(logits[self.lo:], temperature, generator=generator, exclude_id=exclude)[0]
            x0[max(self.lo - self.P, 0):] = draw[max(self.P - self.lo, 0):end - self.lo]   # (drawn is x0)
        elif temperature > 0:   # float64 Gumbel-max noise over the canvas; the entropy stays the clean logits'
            drawn = score_tokens(logits[self.P:end], temperature=temperature, exclude_id=exclude, noise=torch.rand(
                logits.shape, dtype=torch.float64, device=logits.device, generator=generator)[self.P:end])[0]
        ranked = entropy if remasking != "random" else torch.where(   # float32 uniforms, drawn after the noise
            masked, torch.rand(len(logits), device=logits.device, generator=generator)[self.P:end], torch.inf)
        threshold = 999.0 if self.config.threshold is None else self.config.threshold
        commit = masked & ((ranked < threshold) if self.dream else (ranked <= threshold))   # Dream: strictly below
        if bool(masked.any()) and not self.dream:
            commit[ranked.argmin()] = True   # the lowest entropy, whatever the threshold (not Dream's)
        first = next((b for b in self.blocks[1:] if b.full and b.masks > 0), None)
        if first is not None:
            lo, hi = first.start - self.P, first.end - self.P
            if not bool(commit[lo:hi].any()):
                forced = lo + entropy[lo:hi].argmin()
                commit[forced], drawn[forced] = True, x0[forced]   # (drawn is x0 when greedy)
        if bool(masked.any()) and not bool(commit.any()) and not self._opens():   # else a stall to the guard
            commit[entropy.argmin()] = True
        if self.sglang:   # SGLang recounts the masks: a committed mask token (commit_mask_token) is no commit
            commit &= drawn != mask_id
        x[self.P:end][commit] = drawn[commit]
        for block in [b for b in self.blocks[1:] if b.masks > 0]:   # their counts less the commits, as upstream's
            left = block.masks - int(commit[block.start - self.P:block.end - self.P].sum())
            block.masks = left if self.kv is None else max(left, 0)   # the cache's counts stop at 0
        if self.nfe > (self.T - self.P if self.sglang else MAX_FORWARDS):   # upstream's forward guard
            self.done = True   # SGLang forwards once more after its guard when masks are left: counted, not run
            if self.sglang and (self.next <= self.num_blocks or any(b.masks > 0 for b in self.blocks)):
                self.nfe += 1
        return drawn


def multiblock_steps(spec: ModelSpec, prompt: torch.Tensor, *, config: MultiBlock | None = None,
                     gen_length: int = 512, block_length: int = 32, attention_mask: torch.Tensor | None = None,
                     mask_id: int | None = None, stats: GenerationStats | None = None, structure=None, end_ids=(),
                     temperature: float = 0.0, remasking: str = "low_confidence",
                     generator: torch.Generator | None = None) -> StepGenerator:
    """`multiblock_generate` as a step generator (`diffusion/parts/stepper.py`), its arguments checked at
    the call; it yields a `Progress` after every forward and returns `(x, nfe)`. `structure` / `end_ids`:
    structured output (`diffusion/parts/constrain.py`) over the open blocks; a row ends when it ends.
    `temperature` / `remasking` ("random": LLaDA's file only): upstream's draws from `generator`, row after row."""
    config = check_config("config", config, MultiBlock, "a remask MultiBlock")
    check_int("gen_length", gen_length, minimum=1)
    check_int("block_length", block_length, minimum=1, maximum=None if config.variant == "sglang" else gen_length)
    config.check_request(gen_length=gen_length, block_length=block_length)
    spec, stats = check_method_call(spec, prompt, attention_mask, stats, mask_id=mask_id)
    eos_id = spec.eos_id if config.eos_token_id is None else check_token_id(spec, config.eos_token_id, "eos_token_id")
    if config.early_stop:
        check_token_id(spec, eos_id, "eos_token_id")
    B, P = prompt.shape
    x = masked_canvas(prompt, gen_length, spec.mask_id, spec.device)
    inputs = spec.forward_inputs(attention_mask, x.shape[1])
    dream = (config.variant or ("dream" if spec.logit_shift else "llada")) != "llada"   # SGLang's: Dream's rule
    check_real("temperature", temperature, low=0)
    if config.variant == "sglang" and temperature > 0:
        raise ValueError(f"temperature ({temperature}): SGLang's port (variant='sglang') decodes greedily")
    check_choice("remasking", remasking, ("low_confidence",) if dream else ("low_confidence", "random"))
    sampling = (temperature, remasking, check_generator(generator, spec.device))
    rows = [_Row(config, P, gen_length, block_length, dream, sampling, BlockForward(
        spec, "prefix", {k: v[b:b + 1] if torch.is_tensor(v) else v for k, v in inputs.items()}, None)
        if config.cached else None) for b in range(B)]
    constraint = CommitFilter.start(structure, end_ids_of(spec, end_ids), B, spec.mask_id, P, gen_length)
    return _loop(x, rows, inputs, spec, eos_id, stats, constraint)


@drop_in(multiblock_steps, hidden=())
def multiblock_generate() -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-block decoding. Returns `(x [B, P + gen_length], nfe [B])`, each row's NFE as upstream returns
    it. `attention_mask` `[B, P]` (left padding, 0 = pad) hides pad keys; `sampling`: `multiblock_steps`'."""


def _score_spans(exclude_id: int | None, items: list[tuple[torch.Tensor, ...]]) -> list[list[tuple[torch.Tensor, ...]]]:
    """`items`' logits spans `[n, V]` (per request, per row) scored in one call: each span's greedy token and
    negative entropy, a row's scores its own whatever else is scored with it."""
    spans = [span for item in items for span in item]
    x0, neg_entropy = score_rows(torch.cat(spans), mode="neg_entropy", exclude_id=exclude_id)
    sizes = [len(span) for span in spans]
    parts = iter(zip(x0.split(sizes), neg_entropy.split(sizes)))
    return [[next(parts) for _ in item] for item in items]


@torch.no_grad()
def _loop(x: torch.Tensor, rows: list[_Row], inputs: dict, spec, eos_id: int | None,
          stats: GenerationStats, constraint: CommitFilter | None) -> StepGenerator:
    mask_id, P, T = spec.mask_id, rows[0].P, x.shape[1]

    def begin() -> dict[int, int]:   # each row's step up to its forward (early stop's fill included)
        ended = [False] * len(rows) if constraint is None else constraint.finished
        return {b: end for b, row in enumerate(rows)
                if (end := row.begin_step(x[b], mask_id, eos_id, ended[b])) is not None}

    stats.start()
    ends = begin()
    while ends:
        active = list(ends)
        index = torch.tensor(active, device=x.device)
        if rows[active[0]].kv is None:
            logits = yield ForwardRequest.call(x[index], {k: v[index] if torch.is_tensor(v) else v
                                                          for k, v in inputs.items()}, spec=spec)
            stats.forward(len(active), T)
        else:   # a forward a row, each with its own cache; the (decoded) positions before the fed ones score 0
            parts = []
            for b in active:
                parts.append((yield from rows[b].forward(x[b:b + 1])))
            stats.forward(1, sum(T - rows[b].lo for b in active), sum(rows[b].kv.cache_nbytes for b in active))
            logits = torch.cat(parts)
        before = (x[index, P:] == mask_id).sum()
        sub = None if constraint is None else constraint.rows(active)
        logits, prior = before_rule(sub, logits, x[index, P:], P, T, P)
        candidates = torch.full((len(active), T - P), mask_id, device=x.device)   # the structure's
        # every row's span scored in one call, with the other requests' in the engine (each row as alone)
        exclude = None if rows[0].config.commit_mask_token else mask_id
        scored = yield Together((_score_spans, exclude, logits.dtype, logits.shape[-1], logits.device),
                                partial(_score_spans, exclude), tuple(logits[i, P:ends[b]] for i, b in enumerate(active)))
        for i, b in enumerate(active):
            candidates[i, :ends[b] - P] = rows[b].commit(x[b], logits[i], ends[b], mask_id, scored[i])
        if constraint is not None:   # keep what the structure accepts; the blocks count what is left
            canvas = x[index]
            sub.filter(canvas, prior, candidates, logits, P, T, P)
            x[index] = canvas
            for b in active:
                for block in rows[b].blocks[1:]:
                    block.masks = int((x[b, block.start:block.end] == mask_id).sum())
        stats.step(before - (x[index, P:] == mask_id).sum())
        ends = begin()
        # the decoded run from the answer's start (the next commit's candidates undecided): no later step changes it
        undecided = (x[:, P:] == mask_id) | torch.stack([row.masked for row in rows])
        yield Progress(x, int((~undecided).long().cumprod(dim=1).sum(dim=1).min()))
    stats.stop(x.shape[0] * (T - P))
    return x, torch.tensor([row.nfe for row in rows])
