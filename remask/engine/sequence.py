"""A request's state in the engine: one `Sequence` per sample (a request with `n=4` has four),
and the `RequestOutput` the engine returns for it."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from remask.diffusion.parts.stats import GenerationStats

from .sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(eq=False)
class Sequence:
    """One sample of a request: its prompt, settings, decoder (`BlockDecoder`, `ARDecoder`, ...),
    its state (None until scheduled) and its own generator."""

    request_id: str
    index: int
    prompt_ids: torch.Tensor           # [1, P]
    params: SamplingParams
    decoder: Any
    generator: torch.Generator
    arrival_time: float
    seed: int = 0                      # the generator's seed (a preempted sequence restarts from it)
    paged: bool = False                # its K/V live in the engine's page store (autoregressive)
    owner: str | None = None           # who asked (an API key's identity): the scheduler's fairness unit
    preemptions: int = 0
    drafts: bool = False               # report the provisional canvas after every step
    block_table: list[int] | None = None   # paged: its pages of the engine's store (prompt, then tokens)
    kv_len: int = 0                    # paged: positions whose K/V its pages hold
    status: SequenceStatus = SequenceStatus.WAITING
    state: Any = None
    stats: GenerationStats = field(default_factory=GenerationStats)
    final_len: int = 0                 # generated positions that are final (whole decoded blocks / AR tokens)
    first_final_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None
    error: str | None = None
    output_ids: list[int] | None = None   # the generated ids, kept when the state is freed
    output_logprobs: list[tuple] | None = None   # their logprobs (`SamplingParams.logprobs`), kept likewise
    deadline: float | None = None      # `now()` past which the engine aborts it (finish reason "timeout")
    recorder: Any = None               # a mask model's `RecordLogprobs` (`SamplingParams.logprobs`), else None

    def restart(self, pages: Any) -> None:
        """Back to its first step (preempted: its pages go back to `pages`). Decoding again from the
        same seed gives the same tokens, so what was already reported stays true."""
        if self.state is not None and self.final_len > len(self.output_ids or []):
            self.output_ids = self.final_ids()   # reported until the new run catches up
            self.output_logprobs = self.token_logprobs(self.final_len)
        pages.free(self.block_table)
        self.block_table, self.kv_len, self.state = None, 0, None
        self.generator.manual_seed(self.seed)
        self.stats = GenerationStats()
        self.preemptions += 1
        self.status = SequenceStatus.WAITING

    def token_logprobs(self, count: int) -> list[tuple] | None:
        """Its first `count` generated tokens' logprobs, as its decoder (AR) or its `recorder` recorded them."""
        if self.recorder is not None:
            return self.recorder.token_logprobs(self.state, self.prompt_len, count)
        return self.decoder.token_logprobs(self.state, count)

    def final_ids(self) -> list[int]:
        """The generated ids no later step changes (its decoder's canvas, `final_len` of it)."""
        return self.decoder.canvas(self.state)[0, self.prompt_len:self.prompt_len + self.final_len].tolist()

    @property
    def prompt_len(self) -> int:
        return self.prompt_ids.shape[1]

    @property
    def is_finished(self) -> bool:
        return self.status in (SequenceStatus.FINISHED, SequenceStatus.ABORTED)

    @property
    def num_tokens(self) -> int:
        """Positions the sequence occupies in a forward (its admission cost)."""
        return self.prompt_len + self.params.max_tokens


@dataclass(frozen=True)
class Logprob:
    """A token's log-probability (`SamplingParams.logprobs`), vLLM's shape: `rank` 1 is the most
    likely token; `decoded_token` its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One sample's answer (docs/engine.md, One step): `token_ids` up to and including the first stop
    token, `text` without it; `all_token_ids`: every generated position. `draft` (`drafts=True`,
    diffusion models): the provisional canvas, None where still masked; not final."""

    index: int
    text: str
    token_ids: list[int]
    all_token_ids: list[int]
    finish_reason: str | None
    nfe: int
    tokens_per_step: list[int]
    error: str | None = None
    draft: list[int | None] | None = None
    # with `SamplingParams.logprobs`: per token of `token_ids`, {id: Logprob} for the sampled token
    # and its `logprobs` most likely alternatives (vLLM's `SampleLogprobs`)
    logprobs: list[dict[int, Logprob]] | None = None


@dataclass
class RequestOutput:
    """What `LLM.generate` returns per prompt and `LLMEngine.step` per request. `metrics`: arrival, first
    final block (`first_token_time`), finish, `latency` (s), `preemptions` (restarts: KV pages ran out)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict[str, float | None] = field(default_factory=dict)


now = time.perf_counter   # the engine's clock: arrival, finish and deadline times
