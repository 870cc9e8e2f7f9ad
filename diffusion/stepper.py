"""The step protocol for the methods written as one loop over a request: a *step generator*.

A method's loop (`freedave_steps`, `dinfer_steps`, `wino_steps`, `dkv_steps`, …) is a Python
generator that yields a `Progress` after every model forward and returns its output tensor.
The two drivers run the same generator, so their tokens are the same by construction:

* `drive(steps)` — the drop-in function (`freedave_generate`, `run_decoder`, …): to the end;
* `StepwiseDecoder` — the engine: one `next()` per engine step, i.e. one forward of the request
  between the forwards of every other request (no request holds the engine for its whole
  generation). `num_final` reports the answer's positions that no later step changes, so the
  engine streams each block when it is final.

A generator must yield at least once per forward and never run a forward between its last yield
and its return, so one engine step is at most one forward of one request.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Generator, Iterator

import torch

from .stats import GenerationStats


@dataclass
class Progress:
    """What a step generator reports after a forward: `x` the canvas `[B, P + L]` as it stands
    (prompt included; masks where undecided), `final` how many generated positions (from the
    prompt's end) no later step changes — whole decoded blocks."""

    x: torch.Tensor
    final: int = 0


StepGenerator = Generator[Progress, None, torch.Tensor]


def drive(steps: StepGenerator) -> torch.Tensor:
    """Run a step generator to its end and return its output (the drop-in functions)."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            if stop.value is None:
                raise RuntimeError("a step generator must return its output tensor") from None
            return stop.value


@dataclass(eq=False)
class StepwiseState:
    """One engine request under a `StepwiseDecoder`: the generator (made at its first step, with
    the request's generator and stats), the canvas so far and what of it is final."""

    prompt: torch.Tensor
    x: torch.Tensor
    prompt_len: int
    gen_length: int
    steps: Iterator[Progress] | None = None
    final: int = 0
    done: bool = False
    # The generator's own counts (it starts and stops them as the drop-in call does); each step
    # adds what it counted to the engine's stats, which time the request themselves.
    counted: GenerationStats = field(default_factory=GenerationStats)


class StepwiseDecoder:
    """The engine's decoder for a method written as a step generator. `make_steps(model, prompt,
    generator, stats)` starts the method's loop on one request (its prompt `[1, P]` alone, so its
    tokens are the drop-in function's on that prompt); `step` advances it by one forward."""

    def __init__(self, make_steps: Callable[[torch.nn.Module, torch.Tensor, torch.Generator | None,
                                             GenerationStats], StepGenerator], *, gen_length: int,
                 name: str = "") -> None:
        self.make_steps, self.gen_length, self.name = make_steps, gen_length, name

    def start(self, model: torch.nn.Module, input_ids: torch.Tensor) -> StepwiseState:
        return StepwiseState(prompt=input_ids, x=input_ids, prompt_len=input_ids.shape[1], gen_length=self.gen_length)

    def shared_forward_key(self, state: StepwiseState) -> None:
        return None   # its forwards are its own (the method's own cache and attention layout)

    def num_final(self, state: StepwiseState) -> int:
        return self.gen_length if state.done else state.final

    def step(self, model: torch.nn.Module, state: StepwiseState, generator: torch.Generator | None = None,
             stats: GenerationStats | None = None) -> None:
        if state.steps is None:
            state.steps = self.make_steps(model, state.prompt, generator, state.counted)
        counted = state.counted
        nfe, positions, commits = counted.nfe, counted.forward_positions, counted.num_steps
        try:
            progress = next(state.steps)
        except StopIteration as stop:
            if stop.value is None:
                raise RuntimeError(f"{self.name or 'a step generator'} returned no output") from None
            state.x, state.final, state.done = stop.value, self.gen_length, True
        else:
            state.x, state.final = progress.x, max(state.final, progress.final)
        if stats is not None:
            stats.nfe += counted.nfe - nfe
            stats.forward_positions += counted.forward_positions - positions
            stats.add_steps(counted, commits)
            stats.kv_cache_bytes = max(stats.kv_cache_bytes, counted.kv_cache_bytes)

    def __repr__(self) -> str:
        return f"StepwiseDecoder({self.name})"


