"""WINO: wide-in, narrow-out revocable decoding for LLaDA (Feng-Hong/WINO-DLLM `decoding_wino`).

Each forward sees `[prompt | generation | shadow]`, the shadow one extra block of mask tokens at
the current block's RoPE positions. Every query attends every real position; shadow keys are seen
only by shadow queries, and shadow position i does not see its twin, block position i: the shadow's
prediction at i is the model's opinion of position i with its own token hidden.

Per forward (greedy, float64 softmax confidences):
- wide in: commit every masked block position whose confidence exceeds `threshold`; when more than
  `max_accept = min(max(int(masks * accept_ratio), accept_floor), accept_cap)` pass (masks counted
  before the forward), the `max_accept` most confident; when none passes, the most confident one;
- narrow out: only when this forward committed more than one position, every position committed
  by an earlier forward of the block whose shadow confidence is below `threshold_back` is masked
  again; when that is at least as many as the previous forward committed (`initial_last_accept`
  at a block's first), only that count minus one of the least confident are.
The block ends when it holds no mask; the returned step count is the number of forwards. With
`commit_mask_token` (upstream's behaviour) a committed mask token is decoded again by every later
block: upstream's mask index covers the whole sequence up to the block's end, so those positions are
scored and counted with the block's masks (wide in only; they have no shadow twin).

Rows of a batch are decided alone (own counts, own forward count); a row that finished its block
waits, not forwarded, until every row has.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from remask.models.spec import ModelSpec

from ..families.llada import validate_block_args
from ..parts.cache import valid_positions
from ..parts.checks import (NoWorkBound, check_bool, check_config, check_int, check_method_call, check_real,
                            checked)
from ..parts.constrain import CommitFilter, before_rule, end_ids_of
from ..parts.scoring import avoid_id
from ..parts.stats import GenerationStats
from ..parts.step import masked_canvas
from ..parts.stepper import ForwardRequest, Progress, StepGenerator, drop_in


@dataclass(frozen=True)
class WINO(NoWorkBound):
    """WINO's parameters (upstream: `threshold`, `threshold_back`; the accept cap
    `min(max(int(#mask * 0.7), 5), 20)` and the initial `last_accept = 30` are constants there).

    No work bound (docs/parameters.md, "Work bounds", "Not bounded"): `accept_floor` / `accept_cap` read "at most";
    a forward accepts at most the block's masked positions, so any value past the block length decodes as the block
    length, at no more work (upstream takes any)."""

    threshold: float = checked(0.6, check_real, low=0, high=1)
    threshold_back: float = checked(0.9, check_real, low=0, high=1)
    # int(masks * ratio) >= masks for any ratio >= 1 (and overflows at 1e308): (0, 1] is every rule
    accept_ratio: float = checked(0.7, check_real, low=0, high=1, low_open=True)
    accept_floor: int = checked(5, check_int, minimum=1)
    accept_cap: int = checked(20, check_int, minimum=1)
    initial_last_accept: int = checked(30, check_int, minimum=1)
    commit_mask_token: bool = checked(False, check_bool)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.accept_floor > self.accept_cap:
            raise ValueError(f"accept_floor ({self.accept_floor}) must not exceed accept_cap ({self.accept_cap})")

    def max_accept(self, masks: int) -> int:
        return min(max(int(masks * self.accept_ratio), self.accept_floor), self.accept_cap)


def shadow_attention(prompt_length: int, gen_length: int, start: int, block_length: int,
                     device: torch.device) -> torch.Tensor:
    """Bool `[1, 1, T, T]` (T = prompt + gen + block): True where a query may attend a key."""
    real = prompt_length + gen_length
    total = real + block_length
    allowed = torch.ones((total, total), dtype=torch.bool, device=device)
    allowed[:, real:] = False
    allowed[real:, real:] = True
    allowed[real:, start:start + block_length] = ~torch.eye(block_length, dtype=torch.bool, device=device)
    return allowed[None, None]


def predict(logits: torch.Tensor, mask_id: int, commit_mask_token: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens `[L]` and the float64 softmax `[L, V]` of one row's logits. Unless
    `commit_mask_token`, an argmax equal to the mask token becomes the most probable other token."""
    x0 = torch.argmax(logits, dim=-1)
    p = F.softmax(logits.to(torch.float64), dim=-1)
    return (x0 if commit_mask_token else avoid_id(x0, p, mask_id)), p


def _decide_row(config: WINO, confidence: torch.Tensor, confidence_back: torch.Tensor, last_accept: int,
                max_accept: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One row's commit and re-mask index sets (positions of the block, 0-based) from the block's
    confidences (−inf off the masks) and shadow confidences (+inf off the earlier commits)."""
    accept = (confidence > config.threshold).nonzero().flatten()
    if accept.numel() > max_accept:
        accept = torch.topk(confidence, k=max_accept, largest=True).indices
    elif accept.numel() == 0:
        accept = torch.argmax(confidence).reshape(1)
    remask = (confidence_back < config.threshold_back).nonzero().flatten()
    if accept.numel() <= 1:
        remask = remask[:0]
    elif remask.numel() >= last_accept:
        remask = torch.topk(confidence_back, k=last_accept - 1, largest=False).indices
    return accept, remask


def wino_steps(spec: ModelSpec, prompt: torch.Tensor, *, config: WINO | None = None,
               gen_length: int = 128, block_length: int = 128, attention_mask: torch.Tensor | None = None,
               mask_id: int | None = None, stats: GenerationStats | None = None, structure: Any = None,
               end_ids: Any = ()) -> StepGenerator:
    """`wino_generate` as a step generator (`diffusion/parts/stepper.py`), its arguments checked at
    the call: it yields a `Progress` after every forward (the canvas without the shadow; `final`: the
    blocks every row has decoded, a block staying revocable until it holds no mask) and returns
    `(x, forwards)`. `structure` / `end_ids`: structured output (`diffusion/parts/constrain.py`):
    the frontier masked before the rows decide, the commits filtered after; a narrow-out of a
    consumed position rolls its matcher back. Departure: after `2 * block_length` forwards in one
    block a row stops narrowing out (the filter then ends the block), so the two cannot cycle."""
    config = check_config("config", config, WINO, "a remask WINO")
    validate_block_args(gen_length, block_length, gen_length)   # (no schedule: any steps a multiple of the blocks)
    spec, stats = check_method_call(spec, prompt, attention_mask, stats, mask_id=mask_id)
    B, P = prompt.shape
    x = masked_canvas(prompt, gen_length + block_length, spec.mask_id, spec.device)   # + the shadow block
    padded = attention_mask is not None and bool((attention_mask == 0).any())
    keys = valid_positions(attention_mask, x.shape[1]) if padded else None   # False on the left pads
    constraint = CommitFilter.start(structure, end_ids_of(spec, end_ids), B, spec.mask_id, P, gen_length)
    return _wino_loop(config, x, keys, P, gen_length, block_length, spec.mask_id, stats, constraint)


@drop_in(wino_steps)
def wino_generate() -> tuple[torch.Tensor, torch.Tensor]:
    """WINO decoding (greedy). Returns `(x [B, P + gen_length], forwards [B])`: each row's forward
    count is upstream's returned `step`. `attention_mask` `[B, P]` (left padding, 0 = pad) hides pad
    keys; RoPE positions stay absolute."""


@torch.no_grad()
def _wino_loop(config: WINO, x: torch.Tensor, keys: torch.Tensor | None, P: int,
               gen_length: int, block_length: int, mask_id: int, stats: GenerationStats,
               constraint: CommitFilter | None = None) -> StepGenerator:
    B, device = x.shape[0], x.device
    real = P + gen_length
    forwards = torch.zeros(B, dtype=torch.long)
    stats.start()
    for start in range(P, real, block_length):
        end = start + block_length
        position_ids = torch.cat([torch.arange(real, device=device), torch.arange(start, end, device=device)])
        allowed = shadow_attention(P, gen_length, start, block_length, device)
        if keys is not None:
            allowed = allowed & keys[:, None, None, :]
        # Per row: which block positions are decoded-and-revocable (their shadow twin is scored).
        decoded = torch.zeros((B, block_length), dtype=torch.bool, device=device)
        # The undecided positions, kept apart from the tokens as upstream keeps them (with
        # commit_mask_token a committed mask token counts as decoded, as upstream). Upstream's mask
        # index covers everything before the block's end, so with commit_mask_token an earlier
        # block's committed mask token is decoded again here (committed, never narrowed out); `lo`
        # is where the region starts. Without it no earlier position holds the mask token.
        reopen = config.commit_mask_token and constraint is None
        lo = P if reopen else start
        masked = x[:, lo:end] == mask_id
        inside = start - lo   # the block's first column in `masked`
        last_accept = [config.initial_last_accept] * B
        block_forwards = [0] * B
        while active := masked.any(dim=1).nonzero().flatten().tolist():   # the rows with a mask left in the block
            rows = torch.tensor(active, device=device)
            bias = allowed if allowed.shape[0] == 1 else allowed[rows]
            positions = position_ids[None].expand(len(active), -1)
            logits = yield ForwardRequest(x[rows], per_row=dict(attention_bias=bias, position_ids=positions))
            stats.forward(len(active), x.shape[1])
            committed = 0
            sub = None if constraint is None else constraint.rows(active)
            logits, prior = before_rule(sub, logits, x[rows, start:end], start, end, start)   # the real block's rows
            candidates = None if sub is None else torch.full_like(prior, mask_id)
            for i, b in enumerate(active):
                max_accept = config.max_accept(int(masked[b].sum()))
                x0, p = predict(logits[i], mask_id, config.commit_mask_token)
                x0[real:] = torch.where(decoded[b], x[b, start:end], x0[real:])
                x0_p = torch.gather(p, -1, x0[:, None]).squeeze(-1)
                confidence = torch.where(masked[b], x0_p[lo:end], -torch.inf)
                confidence_back = torch.where(decoded[b], x0_p[real:], torch.inf)
                accept, remask = _decide_row(config, confidence, confidence_back, last_accept[b], max_accept)
                if constraint is not None:
                    candidates[i] = x0[start:end]
                    block_forwards[b] += 1
                    if block_forwards[b] > 2 * block_length:   # no cycle with the filter (docstring)
                        remask = remask[:0]
                x[b, lo + accept] = x0[lo + accept]
                x[b, start + remask] = mask_id
                masked[b, accept], masked[b, inside + remask] = False, True
                in_block = accept[accept >= inside] - inside   # earlier positions have no shadow twin
                decoded[b, in_block], decoded[b, remask] = True, False
                last_accept[b] = int(accept.numel())
                forwards[b] += 1
                committed += int(accept.numel()) - int(remask.numel())
            if constraint is not None:
                # keep what the structure accepts; a remasked consumed position rolls its matcher back
                canvas = x[rows]
                sub.filter(canvas, prior, candidates, logits, start, end, start)
                x[rows] = canvas
                now = canvas[:, start:end] == mask_id
                committed = int((prior == mask_id).sum() - now.sum())
                masked[rows], decoded[rows] = now, ~now
            stats.step(committed)
            # a block is final once no row holds a mask in it, and with commit_mask_token once none
            # holds the mask token before it either (the next block decodes those again)
            pending = masked.any(dim=0)
            if reopen:
                pending |= (x[:, lo:end] == mask_id).any(dim=0)
            final = min(start, lo + int(pending.nonzero()[0])) if bool(pending.any()) else end
            yield Progress(x[:, :real], final - P)
    stats.stop(B * gen_length)
    return x[:, :real], forwards
