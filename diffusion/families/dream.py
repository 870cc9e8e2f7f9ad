"""Dream's `diffusion_generate`, reproduced: a drop-in with the same keyword arguments and returns.

Algorithms: ``origin`` (each mask revealed with probability 1 − s/t), ``maskgit_plus`` (top-1
probability), ``topk_margin`` (p1 − p2), ``entropy`` (Σ p log p), over `t = linspace(1, eps, steps + 1)`;
Fast-dLLM's ``confidence_threshold`` (a fixed number of commits per step, each beyond the first
deferred while below `threshold`); Fast-dLLM's block decoder (`DreamBlockDecoder`). Any remask
diffusion model works: the spec supplies mask id, forward inputs and the logit shift.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, fields
from typing import Any, Callable, Generator, Sequence

import torch
import torch.nn.functional as F
from transformers.utils import ModelOutput

from remask.kernels import unmask
from remask.models.parallel import full_logits

from .llada import BlockwiseDecoder, block_forwards
from ..parts.sparse import BlockMaskForward, SparseConfig
from ..parts.checks import check_bools, check_choice, check_int, check_optional_token_id, check_real
from ..parts.constrain import CommitFilter, before_rule, end_ids_of
from ..parts.scoring import score_rows, score_tokens
from ..parts.selection import frechet_profile_counts
from ..parts.stats import GenerationStats
from ..parts.stepper import ForwardRequest, ForwardThenCommit

ALGORITHMS = ("origin", "maskgit_plus", "topk_margin", "entropy", "confidence_threshold")
CONFIDENCE_OF = {"maskgit_plus": "prob", "topk_margin": "margin", "entropy": "neg_entropy",
                 "confidence_threshold": "prob"}
DEFAULT_MAX_LENGTH = 20  # transformers' model-agnostic default, as in Dream's config
DEFAULT_BLOCK_LENGTH = 32  # Fast-dLLM's Dream block decoder default


@dataclass
class DreamModelOutput(ModelOutput):
    """With `return_dict_in_generate`: `sequences`, and the one after every step in `history`."""

    sequences: torch.LongTensor | None = None
    history: list[torch.LongTensor] | None = None


@dataclass
class DreamGenerationConfig:
    """The fields of Dream's `DreamGenerationConfig` (same names and defaults)."""

    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    max_length: int | None = DEFAULT_MAX_LENGTH
    max_new_tokens: int | None = None
    eps: float = 1e-3
    steps: int = 512
    alg: str = "origin"
    alg_temp: float | None = None
    num_return_sequences: int = 1
    return_dict_in_generate: bool = False
    output_history: bool = False
    mask_token_id: int | None = None
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    @classmethod
    def from_any(cls, config: Any) -> "DreamGenerationConfig":
        """The known fields of a DreamGenerationConfig, a transformers or remote-code config, or a dict."""
        if isinstance(config, cls):
            return copy.deepcopy(config)
        get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
        return cls(**{f.name: get(f.name, None) for f in fields(cls) if get(f.name, None) is not None})

    def update(self, **kwargs: Any) -> dict[str, Any]:
        """Set known fields; return the unknown kwargs (as GenerationConfig.update does)."""
        for k in [k for k in kwargs if k in {f.name for f in fields(self)}]:
            setattr(self, k, kwargs.pop(k))
        return kwargs


def _validate_config(config: DreamGenerationConfig, spec) -> None:
    """Every `DreamGenerationConfig` field, whichever way it was given (keyword or config object)."""
    check_real("temperature", config.temperature, low=0)
    check_real("top_p", config.top_p, low=0, high=1, low_open=True, allow_none=True)
    for name in ("top_k", "max_length", "max_new_tokens"):
        check_int(name, getattr(config, name), minimum=1, allow_none=True)
    check_real("eps", config.eps, low=0, high=1, high_open=True)
    check_int("steps", config.steps, minimum=1)
    check_choice("alg", config.alg, ALGORITHMS)
    check_real("alg_temp", config.alg_temp, low=0, allow_none=True)
    check_int("num_return_sequences", config.num_return_sequences, minimum=1)
    check_bools(return_dict_in_generate=config.return_dict_in_generate, output_history=config.output_history)
    for name in ("pad_token_id", "bos_token_id"):
        check_optional_token_id(spec, getattr(config, name), name)
    eos = config.eos_token_id
    for value in (eos if isinstance(eos, (list, tuple)) else [eos]):
        check_optional_token_id(spec, value, "eos_token_id")


def _scorer(config: DreamGenerationConfig, mask_id: int):
    """`score(logits, positions, mode, generator)`: x0 and confidence at the flat `positions` of
    `logits` with Dream's sampling (greedy and unfiltered: the plain softmax, on the fused kernel)."""
    sample = dict(temperature=config.temperature, top_p=config.top_p, top_k=config.top_k, sampler="categorical",
                  exclude_id=mask_id)
    fused = config.temperature == 0 and (config.top_p is None or config.top_p >= 1) and config.top_k is None

    def score(logits, positions, mode="prob", generator=None):
        if fused:
            x0, conf = score_rows(logits, positions, mode=mode, exclude_id=mask_id)
            return x0, conf.to(logits.dtype)
        logits = full_logits(logits)   # Dream's sampling filters whole rows
        return score_tokens(logits.reshape(-1, logits.shape[-1])[positions], mode=mode, generator=generator, **sample)

    return score


def _count(masks: torch.Tensor, timesteps: torch.Tensor, i: int, last: bool) -> int:
    """Dream's one count for the whole batch at step `i`: the mean number of masks per row (as upstream) times
    1 − s/t, all of them at the `last` step."""
    mean = masks.sum() / masks.shape[0]
    return int(mean) if last else int(mean * (1 - timesteps[i + 1] / timesteps[i]))


@dataclass(eq=False)
class DreamState:
    """Rows under Dream's loop or Fast-dLLM's Dream block decoder: the canvas `x`, the `step` of `steps` on
    `timesteps = linspace(1, eps, steps + 1)` (the block decoder's: per `block` of `num_blocks`; Fast-dLLM's
    `confidence_threshold` may add one), its per-row budgets, and the history if asked for."""

    x: torch.Tensor
    prompt_len: int
    first: int   # the first block's start (the prompt's end)
    timesteps: torch.Tensor
    steps: int
    forward_inputs: dict[str, Any] | None = None
    # the block decoder's forwards; the sampler's under sparse=SparseConfig(method="block_mask"), else None
    forwards: Any = None
    step: int = 0
    block: int = 0
    num_blocks: int = 1
    rows: torch.Tensor | None = None   # [B, 1]: each row's index
    number_transfer: torch.Tensor | None = None
    deferred: torch.Tensor | None = None
    histories: list[torch.Tensor] | None = None
    done: bool = False
    pending: Any = None    # the forward asked for and not yet answered
    constraint: Any = None  # structured output: a `CommitFilter` over the answer, or None


class _DreamParts:
    """What Dream's sampler and its block decoder share: their settings and scorer, the state over the prompt
    padded with masks to `max_length`, and the count commit."""

    def _setup(self, spec, config: DreamGenerationConfig, threshold: float, sparse: SparseConfig | None,
               reference_ties: bool, structure: Any, end_ids: Any) -> None:
        self.spec, self.config, self.threshold, self.sparse = spec, config, threshold, sparse
        self.reference_ties = reference_ties   # `torch.topk`'s order among exact ties, as Dream (diffusion_generate)
        # structured output (remask/structured.py): a CompiledStructure and the ids that end an answer
        self.structure, self.end_ids = structure, end_ids_of(spec, end_ids)
        self.score = _scorer(config, spec.mask_id)

    def _state(self, input_ids: torch.Tensor, steps: int, **fields: Any) -> DreamState:
        (B, P), mask_id = input_ids.shape, self.spec.mask_id
        x = F.pad(input_ids, (0, self.config.max_length - P), value=mask_id)
        history = self.config.return_dict_in_generate and self.config.output_history
        return DreamState(x=x, prompt_len=P, first=P, steps=steps,
                          timesteps=torch.linspace(1, self.config.eps, steps + 1, device=x.device),
                          constraint=CommitFilter.start(self.structure, self.end_ids, B, mask_id, P, x.shape[1] - P),
                          histories=[] if history else None, **fields)

    def _commit_count(self, x: torch.Tensor, mask_index: torch.Tensor, proposal: torch.Tensor,
                      full_conf: torch.Tensor, n: int, generator: torch.Generator | None, last: bool = False,
                      ties: bool = False) -> None:
        """Commit `n` positions of each row of `x` (`last`: all its masks): the most confident (`ties`: through
        Dream's own `torch.topk`), or with `alg_temp` drawn without replacement, weights `softmax(confidence /
        alg_temp)`: one draw for the batch, as upstream, when every row has `n` masks (at the last step all); else
        row by row, each asked for no more than it has (upstream's single draw fails there)."""
        per_row = mask_index.sum(dim=1)
        if self.config.alg_temp:
            want = [c if last else min(n, c) for c in per_row.tolist()]
            weights = F.softmax(full_conf / self.config.alg_temp, dim=-1)
            whole = len(set(want)) == 1 and (last or want[0] == n)   # every row has n masks (at the last step all)
            for rows, k in [(slice(None), want[0])] if whole else enumerate(want):
                if k > 0:
                    index = torch.multinomial(weights[rows], num_samples=k, generator=generator)
                    x[rows].scatter_(-1, index, proposal[rows].gather(-1, index))
        elif ties and not last:
            # a row with fewer masks than n keeps its other positions (upstream would write the mask id over them)
            picked = torch.zeros_like(mask_index).scatter_(1, torch.topk(full_conf, n).indices, True) & mask_index
            x[picked] = proposal[picked]
        else:
            unmask(x, mask_index, proposal, full_conf, k=per_row if last else n)

    def _finish(self, state: DreamState, counted: torch.Tensor, before: torch.Tensor, prior: Any, candidates: Any,
                logits: torch.Tensor, start: int, end: int, local: int, stats: GenerationStats | None) -> None:
        """After a commit: the structure's filter keeps what it accepts (a hook's rewrite of a consumed position
        rolls its matcher back) and advances the matchers; the stats count the masks of `counted` decided since
        `before`; the history takes the canvas."""
        if state.constraint is not None:
            state.constraint.filter(state.x, prior, candidates, logits, start, end, local)
        if stats is not None:
            stats.step(int(before - (counted == self.spec.mask_id).sum()))
        if state.histories is not None:
            state.histories.append(state.x.clone())


class DreamDecoder(_DreamParts, ForwardThenCommit):
    """Dream's `diffusion_generate` loop (and Fast-dLLM's `confidence_threshold`) as a state and a
    step, like `BlockDecoder`. `config`: a resolved, validated `DreamGenerationConfig` (`max_length` set)."""

    def __init__(self, spec, config: DreamGenerationConfig, threshold: float = 0.9, tokens_hook: Callable | None = None,
                 logits_hook: Callable | None = None, reference_ties: bool = False,
                 sparse: SparseConfig | None = None, structure: Any = None, end_ids: Any = ()) -> None:
        self._setup(spec, config, threshold, sparse, reference_ties, structure, end_ids)
        self.hooked = tokens_hook is not None or logits_hook is not None
        self.tokens_hook = tokens_hook or (lambda step, x, logits: x)
        self.logits_hook = logits_hook or (lambda step, x, logits: logits)

    def start(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> DreamState:
        config, mask_id = self.config, self.spec.mask_id
        inputs = self.spec.forward_inputs(attention_mask, config.max_length)
        state = self._state(input_ids, config.steps, forward_inputs=inputs)
        if self.sparse is not None:
            # SparseD's Dream sampler: selection scaled by 1/√head_dim (its LLaDA one by 1/√n_heads)
            state.forwards = BlockMaskForward(self.spec, self.sparse, state.forward_inputs, config.steps,
                                              config.max_length - state.prompt_len, head_dim_scale=True)
        state.x = self.tokens_hook(None, state.x, None)
        if config.alg == "confidence_threshold":
            per_row = (state.x == mask_id).sum(dim=1)
            if bool((per_row % state.steps != 0).any()):
                raise ValueError(f"alg='confidence_threshold' needs the masked length ({per_row.tolist()}) to be "
                                 f"divisible by steps ({state.steps})")
            state.number_transfer = per_row // state.steps  # per row: remask runs a batch's rows in one tensor
            state.deferred = torch.zeros_like(state.number_transfer)
        return state

    def num_final(self, state: DreamState) -> int:
        """Generated positions that no later step changes: any may until the last step."""
        return state.x.shape[1] - state.prompt_len if state.done else 0

    def _forward(self, state: DreamState) -> Generator[ForwardRequest, Any, tuple[torch.Tensor, int]]:
        if state.forwards is not None:
            return (yield from state.forwards.step(state.x, 0, state.x.shape[1]))
        return (yield ForwardRequest.call(state.x, state.forward_inputs, spec=self.spec)), 0

    def commit(self, state: DreamState, logits: torch.Tensor, fed: int = 0, generator: torch.Generator | None = None,
               stats: GenerationStats | None = None) -> None:
        mask_id, alg, i, x = self.spec.mask_id, self.config.alg, state.step, state.x
        if stats is not None:
            stats.forward(*x.shape)
        mask_index = x == mask_id
        logits = self.logits_hook(i, x, logits)
        positions = mask_index.reshape(-1).nonzero().squeeze(1)
        before = mask_index.sum()
        constraint, P, T = state.constraint, state.prompt_len, x.shape[1]
        # the answer is the window: its first undecided position holds only what the structure allows
        logits, prior = before_rule(constraint, logits, x[:, P:], P, T, P - fed)
        # past the schedule (the filter left holes): every mask committed, the filter keeps what it accepts
        past = constraint is not None and i >= state.steps
        last = i == state.steps - 1
        if alg == "origin" and not past:
            t, s = state.timesteps[i], state.timesteps[i + 1]
            x0 = torch.full_like(x[mask_index], mask_id)
            reveal = torch.rand(*x0.shape, device=x.device, generator=generator) < (1 if last else 1 - s / t)
            x0[reveal] = self.score(logits, positions[reveal], generator=generator)[0]
            x[mask_index] = x0
            candidates = x[:, P:]
        else:
            x0, confidence = self.score(logits, positions, "prob" if past else CONFIDENCE_OF[alg], generator)
            full_conf, proposal = _scatter(x, mask_index, confidence, x0, logits.dtype, mask_id)
            if past:
                x[mask_index] = x0
            elif alg == "confidence_threshold":
                # The reference keeps the top-1 of each row's budget and defers every other pick below
                # the threshold; at the last step it adds a step and stops scheduling new picks.
                current = state.number_transfer + state.deferred
                has_masks = mask_index.any(dim=1)
                committed = unmask(x, mask_index, proposal, full_conf, k=current, threshold=self.threshold)
                # A row with nothing left defers nothing (upstream would write the mask token back).
                state.deferred = torch.where(has_masks, current - committed, 0)
                if last and bool((state.deferred > 0).any()):
                    state.number_transfer = torch.zeros_like(state.number_transfer)
                    state.steps += 1
            else:
                # Rows differ only when their prompts hold masks (infilled): no row is asked for more than it
                # has, and the last step commits every row's rest (the batch's mean would leave masks).
                n = _count(mask_index, state.timesteps, i, last)
                if n > 0 or last:
                    self._commit_count(x, mask_index, proposal, full_conf, n, generator, last, self.reference_ties)
            candidates = proposal[:, P:]
        state.x = self.tokens_hook(i, x, logits)
        self._finish(state, state.x, before, prior, candidates, logits, P, T, P - fed, stats)
        state.step += 1
        # under a structure: until every mask is decided (the schedule, then steps for the filter's holes)
        state.done = not bool((state.x == mask_id).any()) if constraint is not None else state.step >= state.steps

    def commit_key(self) -> tuple | None:
        """Equal for decoders whose commits one batched call can make (`commit_together`): greedy, unfiltered scoring
        by an algorithm's confidence (not origin's draws, confidence_threshold's deferrals or `alg_temp`'s), with no
        hooks, ties, sparse forwards, structure, history or processors; None when it commits alone."""
        config = self.config
        greedy = config.temperature == 0 and (config.top_p is None or config.top_p >= 1) and config.top_k is None
        if not greedy or config.alg_temp or config.alg not in ("maskgit_plus", "topk_margin", "entropy") \
                or self.hooked or self.reference_ties or self.sparse is not None or self.structure is not None \
                or self.processors or (config.return_dict_in_generate and config.output_history):
            return None
        return DreamDecoder, self.spec.mask_id, config.alg

    @staticmethod
    def commit_together(decoders: Sequence["DreamDecoder"], states: Sequence[DreamState],
                        logits: Sequence[torch.Tensor], fed: Sequence[int],
                        stats: Sequence[GenerationStats | None]) -> None:
        """`commit` of several states of one `commit_key`, each row's tokens its own commit's: their canvases
        right-padded into one `[ΣB, T]` (the padding never masked), one scoring call over every masked position, each
        state's count from its own masks and schedule (Dream's float32 arithmetic, elementwise), one unmask."""
        head, mask_id = decoders[0], decoders[0].spec.mask_id
        width, sizes = max(s.x.shape[1] for s in states), [len(s.x) for s in states]
        x = torch.cat([F.pad(s.x, (0, width - s.x.shape[1])) for s in states])
        mask_index = torch.cat([F.pad(s.x == mask_id, (0, width - s.x.shape[1])) for s in states])
        # each stacked row's first position in the states' logits flattened one after another
        starts, offset = [], 0
        for s in states:
            starts += [offset + b * s.x.shape[1] for b in range(len(s.x))]
            offset += s.x.numel()
        rows, cols = mask_index.nonzero(as_tuple=True)
        flat = torch.cat([part.reshape(-1, part.shape[-1]) for part in logits])
        positions = torch.tensor(starts, device=x.device)[rows] + cols
        x0, confidence = head.score(flat, positions, CONFIDENCE_OF[head.config.alg])
        full_conf, proposal = _scatter(x, mask_index, confidence, x0, flat.dtype, mask_id)
        # each state's count (`_count`): its mean masks per row times 1 − s/t, every mask at its last step
        owner = torch.repeat_interleave(torch.arange(len(states), device=x.device),
                                        torch.tensor(sizes, device=x.device))
        per_row = mask_index.sum(dim=1)
        before = torch.zeros(len(states), dtype=per_row.dtype, device=x.device).index_add_(0, owner, per_row)
        timesteps = torch.nn.utils.rnn.pad_sequence([s.timesteps for s in states], batch_first=True)
        at = torch.tensor([[s.step, s.step + 1] for s in states], device=x.device)
        t, s_next = timesteps.gather(1, at).unbind(1)
        count = (before / torch.tensor(sizes, device=x.device) * (1 - s_next / t)).to(per_row.dtype)
        last = torch.tensor([s.step == s.steps - 1 for s in states], device=x.device)
        unmask(x, mask_index, proposal, full_conf, k=torch.where(last[owner], per_row, count[owner]))
        committed = before - torch.zeros_like(before).index_add_(0, owner, (x == mask_id).sum(dim=1))
        for i, (state, own) in enumerate(zip(states, x.split(sizes))):
            state.x.copy_(own[:, :state.x.shape[1]])
            if stats[i] is not None:
                stats[i].forward(*state.x.shape)
                stats[i].step(committed[i])
            state.step += 1
            state.done = state.step >= state.steps


class DreamBlockDecoder(_DreamParts, BlockwiseDecoder):
    """Fast-dLLM's Dream block decoder (`generation_utils_block.py`) as a state and a step. Per block: a
    full forward (building the cache) commits the block's first position; then each cached step commits,
    for ``alg="confidence_threshold"``, the most confident mask plus every one ≥ `threshold`; for any
    other alg (upstream scores by negative entropy) a count on `linspace(1, eps, steps_per_block + 1)`; with
    `frechet_margin` (Fast-dLLM++, in place of alg's rule) the Fréchet profile count of the probabilities
    (`parts.selection.frechet_profile_counts`), until the block is decoded."""

    def __init__(self, spec, config: DreamGenerationConfig, threshold: float, block_length: int, use_cache: Any,
                 finish_blocks: bool = True, sparse: SparseConfig | None = None, reference_ties: bool = False,
                 structure: Any = None, end_ids: Any = (), frechet_margin: float | None = None) -> None:
        self._setup(spec, config, threshold, sparse, reference_ties, structure, end_ids)
        if structure is not None and not finish_blocks:
            # structured output: each block is the filter's window (diffusion/parts/constrain.py)
            raise ValueError("finish_blocks=False leaves masks in the output; structured_outputs needs every block "
                             "decoded")
        self.block_length, self.use_cache, self.finish_blocks = block_length, use_cache, finish_blocks
        self.frechet_margin = frechet_margin   # Fast-dLLM++: a count of the probabilities in place of alg's rule
        self.parallel = config.alg == "confidence_threshold" or frechet_margin is not None
        # Sparse-dLLM's Dream sampler scores by its alg; Fast-dLLM's by negative entropy
        self.confidence_mode = "prob" if self.parallel else CONFIDENCE_OF[config.alg] if sparse is not None else (
            "neg_entropy")

    def start(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> DreamState:
        (B, P), T = input_ids.shape, self.config.max_length
        num_blocks = (T - P) // self.block_length
        forwards = block_forwards(self.spec, self.use_cache, self.sparse,
                                  self.spec.forward_inputs(attention_mask, T), attention_mask, T, self.reference_ties)
        return self._state(input_ids, self.config.steps // num_blocks, forwards=forwards, num_blocks=num_blocks,
                           rows=torch.arange(B, device=input_ids.device)[:, None])

    def _next_block(self, state: DreamState) -> None:
        state.block += 1
        state.step = 0
        state.done = state.block == state.num_blocks

    def commit(self, state: DreamState, logits: torch.Tensor, fed: int, generator: torch.Generator | None = None,
               stats=None) -> None:
        mask_id, x, constraint = self.spec.mask_id, state.x, state.constraint
        B, T = x.shape
        start, end = self.block_span(state)
        local = start - fed   # the block's first row within the logits
        block_x = x[:, start:end]   # a view: commits write into x
        block_mask = block_x == mask_id
        before = block_mask.sum()
        if stats is not None:
            stats.forward(B, logits.shape[1], state.forwards.cache_nbytes)
        logits, prior = before_rule(constraint, logits, block_x, start, end, local)
        refresh = state.step == 0
        if refresh:   # the block's full forward commits its first position unconditionally
            proposal = torch.full_like(block_x, mask_id)
            proposal[:, 0] = self.score(logits, state.rows[:, 0] * T + start, generator=generator)[0]
            # under a structure, a row that ended its answer holds its end fill here: nothing is committed there
            x[:, start] = torch.where(x[:, start] == mask_id, proposal[:, 0], x[:, start])
            state.step = 1
        else:
            L, i, n = logits.shape[1], state.step, None
            positions = (state.rows * L + local + torch.arange(self.block_length, device=x.device))[block_mask]
            if not self.parallel:
                if i == state.steps and not self.finish_blocks:
                    self._next_block(state)   # upstream: one forward too many, and the block's masks stay
                    return
                # i == steps per block (one step per block) commits the rest: remask finishes the block.
                n = _count(block_mask, state.timesteps, i, i >= state.steps - 1)
                state.step = i + 1
            proposal = None
            if n != 0 or constraint is not None:   # a structure's filter reads the candidates every step
                x0, conf = self.score(logits, positions, self.confidence_mode, generator)
                full_conf, proposal = _scatter(block_x, block_mask, conf, x0, logits.dtype, mask_id)
            if n is None:   # Fast-dLLM's threshold, or Fast-dLLM++'s Fréchet count (parts/selection.py)
                k = None if self.frechet_margin is None else frechet_profile_counts(
                    full_conf, block_mask, self.frechet_margin)
                unmask(block_x, block_mask, proposal, full_conf, k=k, threshold=self.threshold if k is None else None)
            elif n > 0:
                self._commit_count(block_x, block_mask, proposal, full_conf, n, generator)
        self._finish(state, block_x, before, prior, proposal, logits, start, end, local, stats)
        if constraint is not None and all(constraint.finished):
            state.done = True   # under a structure: the answer ends when every row's has
        elif (constraint is not None or not refresh) and not bool((block_x == mask_id).any()):
            self._next_block(state)


def _scatter(x, mask_index, confidence, x0, dtype, mask_id):
    """Per-position confidence (−inf off the masks) and proposals (mask id off the masks)."""
    full_conf = torch.full_like(x, -torch.inf, dtype=dtype).masked_scatter(mask_index, confidence.to(dtype))
    return full_conf, torch.full_like(x, mask_id).masked_scatter(mask_index, x0.to(x.dtype))
