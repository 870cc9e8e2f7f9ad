"""Prophet: early-commit decoding for LLaDA (pixeli99/Prophet `generate_earlyexit.py`, arXiv 2508.19982).

LLaDA's block loop (`families.llada.BlockDecoder`: the integer schedule, low-confidence or random
remasking, unsupervised CFG) with one check between each forward and its commit: the mean
top-1 − top-2 gap of the logits at the answer positions ``[answer_start_pos, answer_start_pos +
answer_length)`` (positions of the whole sequence, prompt included; those inside the generation
count) against the threshold of the phase the step falls in (step / steps < 0.33: "early",
< 0.67: "mid", else "late"; steps counted from 1 over all blocks). Once the gap reaches it, every
position still masked, in every block, takes its argmax at once and decoding ends: that forward
is the last. `constraints` ({offset in the generation: token}) are written into the canvas before
decoding, so the schedule and CFG's unconditional input treat them as given, as upstream.

A method with its own loop, not a commit rule: a rule sees one block's logits and commits inside
that block (in dInfer's loop, not LLaDA's schedule), while the exit reads positions past the block
and commits the whole answer. Each row is decoded alone (upstream decodes one prompt), so a row
stops at its own exit.

Structured output (`structure`): LLaDA's block loop holds it (`parts/constrain.py`); the exit's fill is
then held to it from the frontier on (`_hold_to_structure`), so the answer ends complete or as a valid prefix.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from remask.models.spec import ModelSpec

from ..families.llada import BlockDecoder
from ..parts.checks import (Checked, CombinationError, check_config, check_generator, check_instance, check_int,
                            check_method_call, check_real, check_settings, check_token_id, checked)
from ..parts.constrain import CommitFilter, advance_best
from ..parts.scoring import score_rows
from ..parts.selection import schedule_counts
from ..parts.stats import GenerationStats
from ..parts.step import masked_canvas
from ..parts.stepper import Progress, StepGenerator, drop_in, row_by_row

PHASES = {"early": 7.5, "mid": 5.0, "late": 2.5}   # upstream's thresholds when none are given


@dataclass(frozen=True)
class Prophet(Checked):
    """Prophet's parameters (upstream: `answer_start_pos`, `early_exit_thresholds`, `constraints`; the
    answer length 5 is a constant there). Without `answer_start_pos` no step exits (plain LLaDA)."""

    answer_start_pos: int | None = checked(None, check_int, minimum=0, allow_none=True)
    early_exit_thresholds: dict[str, float] | None = None
    constraints: dict[int, int] | None = None
    answer_length: int = checked(5, check_int, minimum=1)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.early_exit_thresholds is not None:   # a phase left out keeps upstream's threshold
            given = check_settings("early_exit_thresholds", self.early_exit_thresholds, tuple(PHASES))
            object.__setattr__(self, "early_exit_thresholds", {
                phase: check_real(f"early_exit_thresholds[{phase!r}]", value) for phase, value in given.items()})
        if self.constraints is not None:
            check_instance("constraints", self.constraints, dict, "a dict {position: token id}")
            pinned = {}
            for position, token in self.constraints.items():   # JSON's keys are strings: "3" is position 3
                position = int(position) if isinstance(position, str) and position.isdigit() else position
                pinned[check_int("constraints (a position)", position, minimum=0)] = check_int(
                    f"constraints[{position}]", token, minimum=0)
            object.__setattr__(self, "constraints", pinned)

    def check_request(self, *, gen_length: int | None = None, block_length: int | None = None,
                      steps: int | None = None, prompt_length: int | None = None) -> None:
        """A constraint past the generation would be dropped (upstream skips it): refused."""
        outside = sorted(p for p in self.constraints or {} if gen_length is not None and p >= gen_length)
        if outside:
            raise ValueError(f"constraints: positions {outside} lie outside the generation [0, {gen_length})")

    def threshold_at(self, step: int, steps: int) -> float:
        progress = step / steps
        phase = "early" if progress < 0.33 else "mid" if progress < 0.67 else "late"
        return {**PHASES, **(self.early_exit_thresholds or {})}[phase]


def prophet_steps(spec: ModelSpec, prompt: torch.Tensor, *, config: Prophet | None = None, steps: int = 128,
                  gen_length: int = 128, block_length: int = 128, cfg_scale: float = 0.0,
                  remasking: str = "low_confidence", attention_mask: torch.Tensor | None = None,
                  mask_id: int | None = None, generator: torch.Generator | None = None,
                  stats: GenerationStats | None = None, structure: Any = None, end_ids: Any = ()) -> StepGenerator:
    """`prophet_generate` as a step generator (`diffusion/parts/stepper.py`), its arguments checked at the call."""
    config = check_config("config", config, Prophet, "a remask.Prophet")
    if structure is not None and config.constraints:
        raise CombinationError("structured_outputs with Prophet(constraints=...): a pinned token the structure "
                               "refuses could not be kept; pin tokens or give a structure, not both")
    spec, stats = check_method_call(spec, prompt, attention_mask, stats, "Prophet", mask_id=mask_id)
    check_generator(generator, prompt.device)
    decoder = BlockDecoder(spec, steps=steps, gen_length=gen_length, block_length=block_length, cfg_scale=cfg_scale,
                           remasking=remasking, structure=structure, end_ids=end_ids)
    decoder.check_input(prompt, attention_mask)
    config.check_request(gen_length=gen_length)
    start, P = config.answer_start_pos, prompt.shape[1]
    if start is not None and not (start < P + gen_length and start + config.answer_length > P):
        raise ValueError(f"answer_start_pos: the answer positions [{start}, {start + config.answer_length}) hold no "
                         f"generated position [{P}, {P + gen_length}) (positions count from the prompt's start)")
    for position, token in (config.constraints or {}).items():
        if check_token_id(spec, token, f"constraints[{position}]") == spec.mask_id:
            raise ValueError(f"constraints[{position}] is the mask token {token}: it would stay in the output")
    canvas, mask_id = masked_canvas(prompt, gen_length, spec.mask_id), spec.mask_id
    T = canvas.shape[1]
    answer = [] if start is None else list(range(max(start, P), min(T, start + config.answer_length)))

    @torch.no_grad()
    def decode_row(rows: slice, mask: torch.Tensor | None) -> StepGenerator:
        """Prophet's loop on the row `canvas[rows]` alone: it stops at its own exit."""
        state = decoder.start(canvas[rows, :P], mask)
        for position, token in (config.constraints or {}).items():
            state.x[:, P + position] = token
        state.prompt_index = state.x != mask_id          # the pinned positions are given, as the prompt
        state.schedule = schedule_counts(state.x[:, slice(*decoder.block_span(state))] == mask_id,
                                         decoder.steps_per_block)
        step = 0
        while not state.done:
            step += 1
            logits, fed = decoder.finish_forward(state, (yield decoder.next_forward(state)))
            if answer:
                top = logits[0, answer].topk(2, dim=-1).values
                gaps = (top[:, 0] - top[:, 1]).double()   # upstream: each gap a Python float, summed in order
                if bool(sum(gaps) / len(answer) >= config.threshold_at(step, steps)):
                    masked = (state.x[0] == mask_id).nonzero().flatten()
                    state.x[0, masked] = score_rows(logits[0], masked, exclude_id=mask_id)[0]
                    if state.constraint is not None:
                        _hold_to_structure(state.constraint, state.x, logits[0])
                    stats.forward(2 if decoder.cfg_scale > 0 else 1, T)
                    stats.step(masked.numel())
                    break
            yield decoder.commit_later(state, logits, fed, generator, stats)   # (the engine batches it)
            yield Progress(state.x, decoder.num_final(state))
        return state.x

    return row_by_row(canvas, decode_row, attention_mask, stats, prompt.shape[0] * gen_length)


@drop_in(prophet_steps)
def prophet_generate() -> torch.LongTensor:
    """Prophet decoding (greedy; module docstring): `[B, P + gen_length]`, no mask left. `stats.nfe`
    counts the forwards (upstream's `exit_decision_step` when a row exits, else `steps`)."""


def _hold_to_structure(constraint: CommitFilter, x: torch.Tensor, logits: torch.Tensor) -> None:
    """The exit's fill `x` `[1, T]` under a structure: from the frontier on, each position keeps its token (the
    argmax where it was masked) while the structure accepts it, else takes the best token it allows (the masked
    argmax of `logits` `[T, V]`); the matcher then consumes the answer (an end token fills the rest)."""
    matcher, start = constraint.matchers[0].clone(), constraint.frontier(0)
    for position in range(start, constraint.answer_start + constraint.answer_len):
        if matcher.ended:
            break
        if not matcher.try_advance(int(x[0, position])):
            x[0, position] = advance_best(matcher, logits[position].float(), fallback=True)
    constraint.sync(x)
