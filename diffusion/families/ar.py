"""Plain autoregressive decoding for any `AutoModelForCausalLM`, with its KV cache: the baseline the
diffusion strategies are compared against, sampling through `score_tokens` like every remask sampler.
`ARDecoder` is a `Decoder` (`parts/protocol.py`) like every diffusion decoder: its forwards (the
prefill, then each one-token decode) are causal continuations (`ForwardRequest.extends`) that the
drop-in `ar_generate` answers with the model's own KV cache and the engine's runner with one flat
forward over its paged store for every running sequence.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from remask.models.hf_compat import output_cache
from remask.models.spec import ModelSpec, get_spec

from ..parts.checks import (ParameterTypeError, check_generator, check_int, check_model_kind, check_prompt,
                            check_real, check_stats, check_token_id, warn_if_padded_without_mask)
from ..parts.constrain_loops import structure_for_call
from ..parts.processors import logprob_entries
from ..parts.scoring import score_tokens
from ..parts.stats import GenerationStats
from ..parts.protocol import Decoder
from ..parts.stepper import ForwardRequest, ForwardThenCommit, decode_alone


@dataclass
class ARState:
    """Rows decoded together: the prompt and the tokens so far in one buffer (`sequence`, `pad_token_id`
    after a row's EOS), its attention mask and positions over the whole length (each forward feeds a
    slice: the prompt, then the token just sampled), the model's own cache (the drop-in driver's; the
    engine keeps K/V in its page store), and which rows are past their EOS, kept on the host."""

    prompt_len: int
    sequence: torch.Tensor         # [B, P + max_new_tokens]: the prompt, then `tokens` (a view of it)
    mask: torch.Tensor             # [B, P + max_new_tokens]: the prompt's attention mask, then ones
    positions: torch.Tensor        # [B, P + max_new_tokens]: each position's id (left pads at 0)
    finished: list[bool]
    cache: Any = None
    step: int = 0
    generated: int = 0
    done: bool = False
    matchers: Any = None           # structured output: one `remask.structured.Matcher` per row
    # `logprobs`: per step, the sampled tokens `[B]`, their log-probabilities and ranks under the raw
    # distribution, and the `logprobs` most likely ids with theirs `[B, logprobs]` (empty when not asked for)
    logprobs: list = field(default_factory=list)

    @property
    def tokens(self) -> torch.Tensor:
        return self.sequence[:, self.prompt_len:]

    @property
    def fed(self) -> slice:
        """The positions the next forward feeds: the prompt, then the last token sampled."""
        end = self.prompt_len + self.step
        return slice(0, end) if self.step == 0 else slice(end - 1, end)


class ARDecoder(Decoder):
    """Autoregressive decoding under the one decoder protocol (`parts/protocol.py`); the constructor
    validates the settings. Each forward feeds the ids not yet seen (the prompt, then the token just
    sampled) as a causal continuation (`ForwardRequest.extends`); `receive` samples from the last
    position's logits. The drop-in driver answers with the model's own cache, the engine's runner
    from its page store, so both decode the same tokens by construction."""

    processors: tuple = ()   # logits processors (`add_processor`), applied in order before `sample`
    add_processor = ForwardThenCommit.add_processor

    def __init__(self, spec: ModelSpec, *, max_new_tokens: int = 128, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, eos_token_id: int | list[int] | None = None,
                 pad_token_id: int | None = None, structure: Any = None, logprobs: int | None = None) -> None:
        check_model_kind(spec, diffusion=False, entry="remask.ar_generate")
        check_int("max_new_tokens", max_new_tokens, minimum=1)
        check_real("temperature", temperature, low=0)
        check_int("top_k", top_k, minimum=1, allow_none=True)
        check_real("top_p", top_p, low=0, high=1, low_open=True, allow_none=True)
        check_int("logprobs", logprobs, minimum=0, maximum=spec.vocab_size, allow_none=True)
        eos_token_id = getattr(spec.config, "eos_token_id", None) if eos_token_id is None else eos_token_id
        if not (eos_token_id is None or isinstance(eos_token_id, (numbers.Integral, list, tuple))):
            raise ParameterTypeError(f"eos_token_id must be an int, a list of ints or None, got {eos_token_id!r}")
        listed = [eos_token_id] if isinstance(eos_token_id, numbers.Integral) else eos_token_id or []
        eos_ids = [check_token_id(spec, value, "eos_token_id") for value in listed]
        if pad_token_id is None:   # the config's, else the first EOS id, else 0
            pad_token_id = getattr(spec.config, "pad_token_id", None)
            pad_token_id = (eos_ids[0] if eos_ids else 0) if pad_token_id is None else pad_token_id
        check_token_id(spec, pad_token_id, "pad_token_id")
        # structured output (remask/structured.py): a CompiledStructure; the EOS ids end the answer
        if structure is not None and not eos_ids:
            raise ValueError("structured_outputs needs an end token: pass eos_token_id (the model config has none)")
        self.spec, self.structure = spec, structure
        self.max_new_tokens, self.temperature, self.top_k, self.top_p = max_new_tokens, temperature, top_k, top_p
        self.eos_ids, self.pad_token_id, self.logprobs = eos_ids, pad_token_id, logprobs
        self.max_positions = getattr(spec.config, "max_position_embeddings", None)

    def check_input(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        check_prompt(self.spec.device, input_ids, attention_mask, name="input_ids", spec=self.spec)
        if self.max_positions is not None and input_ids.shape[1] + self.max_new_tokens > self.max_positions:
            raise ValueError(f"prompt length + max_new_tokens = {input_ids.shape[1] + self.max_new_tokens} exceeds "
                             f"the model's max_position_embeddings {self.max_positions}")

    def start(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> ARState:
        B, device, grow = input_ids.shape[0], input_ids.device, (0, self.max_new_tokens)
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(input_ids.dtype)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        positions = torch.cat([positions, positions[:, -1:] + torch.arange(1, grow[1] + 1, device=device)], dim=1)
        matchers = None if self.structure is None else [self.structure.matcher(self.eos_ids) for _ in range(B)]
        return ARState(prompt_len=input_ids.shape[1], finished=[False] * B, positions=positions,
                       sequence=torch.nn.functional.pad(input_ids.long(), grow, value=self.pad_token_id),
                       mask=torch.nn.functional.pad(mask, grow, value=1), matchers=matchers)

    def next_forward(self, state: ARState, generator: torch.Generator | None = None,
                     stats: GenerationStats | None = None) -> ForwardRequest | None:
        if state.done:
            return None
        fed = state.fed
        per_row = dict(attention_mask=state.mask[:, :fed.stop], position_ids=state.positions[:, fed])
        return ForwardRequest(state.sequence[:, fed], per_row=per_row, shared=dict(use_cache=True), cache=state.cache,
                              output="model", extends=True)

    def receive(self, state: ARState, output: Any, generator: torch.Generator | None = None,
                stats: GenerationStats | None = None) -> None:
        """The forward's output (the model's, or the runner's with the last position's logits):
        sample one token per row, the next forward's feed unless that ends the state. Which rows are
        past their EOS is kept on the host: one sync a step (the engine steps token by token)."""
        raw = logits = output.logits[:, -1:]
        for processor in self.processors:
            logits = processor(state, logits, state.prompt_len + state.step)
        self._take(state, output, raw, self.sample(logits[:, 0], generator, state), stats)

    def commit_key(self) -> Any:
        """Greedy decoders without processors or a structure sample together: one argmax over their rows."""
        greedy = self.temperature == 0 and not self.processors and self.structure is None
        return ("greedy", self.top_k, self.top_p, self.spec.mask_id) if greedy else None

    @staticmethod
    def receive_together(decoders: Sequence["ARDecoder"], states: Sequence[ARState], answers: Sequence[Any],
                         generators: Sequence[torch.Generator | None], stats: Sequence[GenerationStats | None]) -> None:
        """Greedy decoders of one key: their last positions' logits stacked, one `sample` (row by row as alone)."""
        if len(decoders) == 1:   # alone (without a key too): its own generator and processors
            return decoders[0].receive(states[0], answers[0], generators[0], stats[0])
        raws = [output.logits[:, -1:] for output in answers]
        tokens = decoders[0].sample(torch.cat(raws)[:, 0]).split([raw.shape[0] for raw in raws])
        for decoder, state, output, raw, token, counts in zip(decoders, states, answers, raws, tokens, stats):
            decoder._take(state, output, raw, token, counts)

    def _take(self, state: ARState, output: Any, raw: torch.Tensor, next_token: torch.Tensor,
              stats: GenerationStats | None) -> None:
        """The sampled tokens into the state: the next forward's feed unless they end it."""
        B, at, fed = len(state.finished), state.prompt_len + state.step, state.fed
        state.cache = output_cache(output)
        done_before = sum(state.finished)
        if done_before:   # rows past their EOS go on with the pad token
            next_token.masked_fill_(torch.tensor(state.finished, device=next_token.device), self.pad_token_id)
        state.sequence[:, at] = next_token
        if self.logprobs is not None:   # the raw distribution: the model's logits `[B, V]` before any processor
            state.logprobs.append((next_token, *logprob_entries(raw[:, 0], next_token, self.logprobs)))
        state.generated += B - done_before
        if stats is not None:
            stats.forward(B, fed.stop - fed.start)
            stats.step(B - done_before)
        state.finished = [done or token in self.eos_ids for done, token in zip(state.finished, next_token.tolist())]
        state.step += 1
        state.done = all(state.finished) or state.step == self.max_new_tokens

    def token_logprobs(self, state: ARState, count: int, row: int = 0) -> list[tuple] | None:
        """Row `row`'s first `count` tokens: `(token id, log-probability, rank, [(id, log-probability)
        of the most likely], ...)`, recorded by `receive` beside the sample under the raw distribution
        (before any processor (min_tokens), structure mask, temperature or top-k / top-p: vLLM's default
        `logprobs_mode="raw_logprobs"`), so asking for them never changes a token; None without `logprobs`."""
        if self.logprobs is None:
            return None
        columns = [torch.stack(steps, dim=1)[row].tolist() for steps in zip(*state.logprobs[:count])]
        return [(t, lp, r, list(zip(ti, tl))) for t, lp, r, ti, tl in zip(*columns)]

    def num_final(self, state: ARState) -> int:
        """Tokens that no later step changes: every token sampled so far."""
        return state.step

    def canvas(self, state: ARState) -> torch.Tensor:
        return state.sequence[:, :state.prompt_len + state.step]

    def sample(self, logits: torch.Tensor, generator: torch.Generator | None = None, state: Any = None) -> torch.Tensor:
        """The next token of each row from its logits `[B, V]`; with a structure, masked to what it
        allows by the matchers `state` carries (one per row, from `start`), which then advance."""
        if self.structure is not None:
            logits = torch.stack([m.mask_logits(row) for m, row in zip(state.matchers, logits)])
        # never a mask token the config declares (a model sharing a diffusion model's tokenizer)
        tokens = score_tokens(logits.float(), temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                              sampler="categorical", exclude_id=self.spec.mask_id, generator=generator)[0]
        if self.structure is not None:
            for m, token in zip(state.matchers, tokens.tolist()):
                m.advance([token])
        return tokens


@torch.no_grad()
def ar_generate(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                max_new_tokens: int = 128, temperature: float = 0.0, top_k: int | None = None,
                top_p: float | None = None, eos_token_id: int | list[int] | None = None,
                pad_token_id: int | None = None, *, generator: torch.Generator | None = None,
                stats: GenerationStats | None = None, structured_outputs: Any = None,
                tokenizer: Any = None) -> torch.LongTensor:
    """Decode `max_new_tokens` after a (left-padded) prompt `[B, P]`; returns `[B, P + max_new_tokens]`.
    Rows that emitted an EOS id continue with `pad_token_id` (default: the first EOS id); decoding
    stops once every row has finished. `structured_outputs` (a `remask.StructuredOutputsParams`,
    compiled against `tokenizer`, default the one beside the checkpoint): each token is drawn from
    what the structure allows (EOS only where it is complete); a row without EOS holds a valid prefix.
    """
    if structured_outputs is not None:   # (before its budget is checked against max_new_tokens)
        check_int("max_new_tokens", max_new_tokens, minimum=1)
    spec = get_spec(model)
    structure = structure_for_call(structured_outputs, model, tokenizer, spec.mask_id, max_new_tokens)
    decoder = ARDecoder(spec, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                        eos_token_id=eos_token_id, pad_token_id=pad_token_id, structure=structure)
    decoder.check_input(input_ids, attention_mask)
    check_generator(generator, input_ids.device)
    stats = check_stats("stats", stats) or GenerationStats()   # None: counted, then dropped
    warn_if_padded_without_mask(input_ids, attention_mask, getattr(model.config, "pad_token_id", None))
    stats.start()
    state = decode_alone(decoder, model, decoder.start(input_ids, attention_mask), generator, stats)
    stats.stop(state.generated)   # tokens up to and including each row's EOS
    return state.sequence
