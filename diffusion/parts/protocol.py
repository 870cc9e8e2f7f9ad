"""The one decoder protocol: everything both drivers — the drop-in loops and the engine's runner —
call on a diffusion decoder, and nothing else (no attribute probing, no writes to its state).

    state = decoder.start(prompt)                         # the request's state: the decoder's alone
    while (request := decoder.next_forward(state, generator, stats)) is not None:
        decoder.receive(state, logits_of(request), generator, stats)   # commits, up to its next forward
    decoder.num_final(state)                              # generated positions no later step changes

No decoder is handed the model: what it needs of it comes as values — the model's `ModelSpec`
(`get_spec`, resolved by the driver: ids, layout, device, config values, embedding table) — or in the
answers to its `ForwardRequest`s. Only the drivers (the drop-in functions, the engine's runner) hold it.

* Batched commit: decoders with an equal `commit_key()` (not None) receive together — one
  `receive_together` over all of them (one scoring and one selection for the lot, row by row as
  each alone); None receives alone.
* Work between forwards: a step generator asks for what the engine may batch across requests (a commit) as
  `Together` work, answered one key at a time (`StepwiseDecoder.receive_together`).
* Pages: a decoder whose requests take whole pages of the engine's store when they start says how
  many (`pages_needed`, None: none) and gives them back (`release`).
* `canvas(state)`: the canvas so far `[1, P + L]` (masks where undecided), for drafts.
* `add_processor`: a logits processor (`parts/processors.py`, e.g. `min_tokens`) as a part.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from .stats import GenerationStats

if TYPE_CHECKING:
    from .stepper import ForwardRequest


class Decoder(abc.ABC):
    """A diffusion decoder as the drivers see it (module docstring). States have a `done` flag."""

    @abc.abstractmethod
    def start(self, input_ids: torch.Tensor) -> Any:
        """A new request's state for its prompt `[1, P]`."""

    @abc.abstractmethod
    def next_forward(self, state: Any, generator: torch.Generator | None = None,
                     stats: GenerationStats | None = None) -> ForwardRequest | None:
        """The forward the request waits for; None once it is done (or for one step, paused)."""

    @abc.abstractmethod
    def receive(self, state: Any, logits: Any, generator: torch.Generator | None = None,
                stats: GenerationStats | None = None) -> None:
        """The forward's answer: commit, and run to the next forward."""

    @abc.abstractmethod
    def num_final(self, state: Any) -> int:
        """Generated positions (from the prompt's end) that no later step changes."""

    def canvas(self, state: Any) -> torch.Tensor:
        return state.x

    def token_logprobs(self, state: Any, count: int, row: int = 0) -> list[tuple] | None:
        """The first `count` generated tokens' `(id, log-probability, rank, top alternatives)`, as the
        decoder recorded them (`SamplingParams.logprobs`); None: it records none."""
        return None

    def commit_key(self) -> Any:
        """Equal for decoders whose commits run together in one `receive_together`; None: alone."""
        return None

    @staticmethod
    def receive_together(decoders: Sequence["Decoder"], states: Sequence[Any], answers: Sequence[Any],
                         generators: Sequence[torch.Generator | None], stats: Sequence[GenerationStats | None]) -> None:
        """`decoders[i].receive(states[i], answers[i], ...)` for every i (decoders of one `commit_key`: it may
        commit them all in one batched call, each row as alone)."""
        for decoder, state, answer, generator, counts in zip(decoders, states, answers, generators, stats):
            decoder.receive(state, answer, generator, counts)

    def add_processor(self, processor: Any) -> "Decoder":
        """Edit every forward's logits with `processor(state, logits, fed)` before the commit scores
        them (`parts/processors.py`); a decoder that scores inside its own loop refuses."""
        raise ValueError(f"{type(self).__name__} scores the logits inside its own loop: no logits processor "
                         "reaches them")

    def pages_needed(self, pages: Any, prompt_ids: torch.Tensor) -> int | None:
        """Pages of the engine's store a request with this prompt takes at its start; None: none."""
        return None

    def release(self, state: Any) -> None:
        """Give back what `pages_needed` counted."""


@dataclass(eq=False)
class Together:
    """Work a step generator asks for between its forwards that the engine may do together with other requests'
    (`answer = yield Together(key, run, args)`): `run(several args)` answers every one of one `key` in one batched
    call, each as alone; key None: alone. The drivers answer it alone (`drive`), or gather the requests' of one key
    (`StepwiseDecoder.receive_together`). A decoder's commit: `ForwardThenCommit.commit_later`."""

    key: Any
    run: Callable[[list[tuple]], list[Any]]
    args: tuple

    def alone(self) -> Any:
        return self.run([self.args])[0]


def answer_alone(advance: Callable[[Any], Together | None], answer: Any) -> None:
    """Run one request to its next forward: `advance(answer)` (send it; returns the `Together` work the request
    asks for, or None once it waits for a forward or has ended), each asked work done alone and sent back."""
    work = advance(answer)
    while work is not None:
        work = advance(work.alone())


def answer_together(advance: Callable[[int, Any], Together | None], answers: Sequence[Any],
                    fail: Callable[[int, Exception], None]) -> None:
    """`answer_alone` for several requests at once (`advance(i, answer)`): what they ask between their forwards is
    done together by key, one batched call a key, until every one waits for its forward or has ended. A request
    whose `advance` raises fails alone (`fail(i, error)`); a batched call that raises is sent, as the error, to
    each request that asked (its generator gets it thrown)."""
    sends: dict[int, Any] = dict(enumerate(answers))
    while sends:
        asked: dict[Any, list[tuple[int, Together]]] = {}
        for i, answer in sends.items():
            try:
                work = advance(i, answer)
            except Exception as err:  # noqa: BLE001 - one request's failure must not stop the others
                fail(i, err)
                continue
            if work is not None:
                asked.setdefault(("alone", i) if work.key is None else work.key, []).append((i, work))
        sends = {}
        for members in asked.values():
            try:
                results = members[0][1].run([work.args for _, work in members])
            except Exception as err:  # noqa: BLE001 - thrown into each generator that asked
                results = [err] * len(members)
            sends.update((i, result) for (i, _), result in zip(members, results))
