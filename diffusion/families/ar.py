"""Plain autoregressive decoding for any `AutoModelForCausalLM`, with its KV cache: the baseline the
diffusion strategies are compared against, sampling through `score_tokens` like every remask sampler.
The prefill and each one-token decode are `ForwardRequest`s (`output="model"`: the whole output, its
cache included) that `ARDecoder.starting` / `stepping` yield; `ar_generate` drives `ar_steps`. The
engine runs its own paged forward (`model_runner.py::_ar_step`) and takes only `ARDecoder.sample`.
"""
from __future__ import annotations

import inspect
import numbers
from dataclasses import dataclass
from typing import Any, Generator

import torch

from remask.models.hf_compat import cache_arg, output_cache
from remask.models.spec import get_spec

from ..parts.checks import (ParameterTypeError, check_generator, check_int, check_model_kind, check_prompt,
                            check_real, check_stats, check_token_id, warn_if_padded_without_mask)
from ..parts.constrain_loops import structure_for_call
from ..parts.scoring import score_tokens
from ..parts.stats import GenerationStats
from ..parts.stepper import ForwardRequest, drive


@dataclass
class ARState:
    """Rows decoded together: the prompt, the tokens so far `[B, max_new_tokens]` (`pad_token_id`
    after a row's EOS), the model's cache and the next position's logits."""

    input_ids: torch.Tensor
    eos: torch.Tensor              # the EOS ids, on the prompt's device
    tokens: torch.Tensor
    finished: torch.Tensor
    mask: torch.Tensor
    position_ids: torch.Tensor
    cache: Any
    logits: torch.Tensor
    step: int = 0
    generated: int = 0
    done: bool = False
    matchers: Any = None           # structured output: one `remask.structured.Matcher` per row


class ARDecoder:
    """Autoregressive decoding as a state and a step; the constructor validates the settings."""

    def __init__(self, model: torch.nn.Module, *, max_new_tokens: int = 128, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, eos_token_id: int | list[int] | None = None,
                 pad_token_id: int | None = None, structure: Any = None) -> None:
        spec = get_spec(model)
        check_model_kind(spec, diffusion=False, entry="remask.ar_generate")
        check_int("max_new_tokens", max_new_tokens, minimum=1)
        check_real("temperature", temperature, low=0)
        check_int("top_k", top_k, minimum=1, allow_none=True)
        check_real("top_p", top_p, low=0, high=1, low_open=True, allow_none=True)
        if eos_token_id is None:
            eos_token_id = getattr(model.config, "eos_token_id", None)
        if not (eos_token_id is None or isinstance(eos_token_id, (numbers.Integral, list, tuple))):
            raise ParameterTypeError(f"eos_token_id must be an int, a list of ints or None, got {eos_token_id!r}")
        eos_ids = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, numbers.Integral) \
            else list(eos_token_id)
        for value in eos_ids:
            check_token_id(spec, value, "eos_token_id")
        if pad_token_id is None:
            pad_token_id = getattr(model.config, "pad_token_id", None)
        if pad_token_id is None:
            pad_token_id = eos_ids[0] if eos_ids else 0
        check_token_id(spec, pad_token_id, "pad_token_id")
        # structured output (remask/structured.py): a CompiledStructure; the EOS ids end the answer
        if structure is not None and not eos_ids:
            raise ValueError("structured_outputs needs an end token: pass eos_token_id (the model config has none)")
        self.model, self.spec, self.structure = model, spec, structure
        self.max_new_tokens, self.temperature, self.top_k, self.top_p = max_new_tokens, temperature, top_k, top_p
        self.eos_ids, self.pad_token_id = eos_ids, pad_token_id
        # Only the last position's logits are needed, as in transformers' `generate`: the LM head
        # then runs on one row per sequence, the shape the engine's flat forward gives it too.
        self.keep_last = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters \
            else {}

    def num_final(self, state: Any) -> int:
        """Tokens that no later step changes: every token sampled so far (the engine's protocol)."""
        return state.step

    def check_input(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        check_prompt(self.model, input_ids, attention_mask, name="input_ids", spec=self.spec)
        max_positions = getattr(self.model.config, "max_position_embeddings", None)
        if max_positions is not None and input_ids.shape[1] + self.max_new_tokens > max_positions:
            raise ValueError(f"prompt length + max_new_tokens = {input_ids.shape[1] + self.max_new_tokens} exceeds "
                             f"the model's max_position_embeddings {max_positions}")

    def _forward(self, input_ids: torch.Tensor, mask: torch.Tensor, position_ids: torch.Tensor,
                 **shared: Any) -> Generator[ForwardRequest, Any, tuple[Any, torch.Tensor]]:
        """One forward of `input_ids` `[B, n]` (a sub-generator of one request; `mask` covers every
        position so far): (the model's cache, the next position's logits `[B, V]`)."""
        out = yield ForwardRequest(input_ids, per_row=dict(attention_mask=mask, position_ids=position_ids),
                                   shared=dict(shared, use_cache=True, **self.keep_last), output="model")
        return output_cache(out), out.logits[:, -1]

    def sample(self, logits: torch.Tensor, generator: torch.Generator | None = None, state: Any = None) -> torch.Tensor:
        """The next token of each row from its logits `[B, V]`; with a structure, masked to what it
        allows by the matchers `state` (an `ARState` or the engine's row) carries, which then advance."""
        matchers = None
        if self.structure is not None:
            if state is None:
                raise ValueError("ARDecoder.sample: a structured decoder needs the sequence's state (its matchers)")
            if getattr(state, "matchers", None) is None:
                state.matchers = [self.structure.matcher(self.eos_ids) for _ in range(logits.shape[0])]
            matchers = state.matchers
            logits = torch.stack([m.mask_logits(row) for m, row in zip(matchers, logits)])
        # never a mask token the config declares (a model sharing a diffusion model's tokenizer)
        tokens = score_tokens(logits.float(), temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                              sampler="categorical", exclude_id=self.spec.mask_id, generator=generator)[0]
        if matchers is not None:
            for m, token in zip(matchers, tokens.tolist()):
                m.advance([token])
        return tokens

    def start(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
              stats: GenerationStats | None = None) -> ARState:
        """`starting`, its forward computed alone."""
        return drive(self.starting(input_ids, attention_mask, stats), self.model)

    def step(self, state: ARState, generator: torch.Generator | None = None,
             stats: GenerationStats | None = None) -> None:
        """`stepping`, its forward computed alone."""
        drive(self.stepping(state, generator, stats), self.model)

    def starting(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 stats: GenerationStats | None = None) -> Generator[ForwardRequest, Any, ARState]:
        """The prompt's forward (a sub-generator of one request); returns the state."""
        B, P = input_ids.shape
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(input_ids.dtype)
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        cache, logits = yield from self._forward(input_ids, mask, position_ids)
        if stats is not None:
            stats.forward(B, P)
        device = input_ids.device
        return ARState(input_ids=input_ids, eos=torch.tensor(self.eos_ids, dtype=torch.long, device=device),
                       mask=mask, position_ids=position_ids[:, -1:], cache=cache, logits=logits,
                       tokens=torch.full((B, self.max_new_tokens), self.pad_token_id, dtype=torch.long, device=device),
                       finished=torch.zeros(B, dtype=torch.bool, device=device))

    def stepping(self, state: ARState, generator: torch.Generator | None = None,
                 stats: GenerationStats | None = None) -> Generator[ForwardRequest, Any, ARState]:
        """Sample one token per row; unless that ends the state, the next one-token forward (a
        sub-generator of one request). Returns the state."""
        B = state.tokens.shape[0]
        next_token = self.sample(state.logits, generator, state)
        next_token = torch.where(state.finished, torch.full_like(next_token, self.pad_token_id), next_token)
        state.tokens[:, state.step] = next_token
        active = int((~state.finished).sum())
        state.generated += active
        if stats is not None:
            stats.step(active)
        state.finished |= torch.isin(next_token, state.eos)
        state.step += 1
        if bool(state.finished.all()) or state.step == self.max_new_tokens:
            state.done = True
            return state
        state.mask = torch.nn.functional.pad(state.mask, (0, 1), value=1)
        state.position_ids = state.position_ids + 1
        # the cache under the keyword the model's forward declares (`cache` or `past_key_values`)
        state.cache, state.logits = yield from self._forward(next_token[:, None], state.mask, state.position_ids,
                                                             **cache_arg(self.model.forward, state.cache))
        if stats is not None:
            stats.forward(B, 1)
        return state


def ar_steps(decoder: ARDecoder, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
             generator: torch.Generator | None = None,
             stats: GenerationStats | None = None) -> Generator[ForwardRequest, Any, torch.Tensor]:
    """`ar_generate`'s loop as a step generator (arguments checked by the caller): `[B, P + max_new_tokens]`."""
    if stats is not None:
        stats.start()
    state = yield from decoder.starting(input_ids, attention_mask, stats)
    while not state.done:
        yield from decoder.stepping(state, generator, stats)
    if stats is not None:
        stats.stop(state.generated)   # tokens up to and including each row's EOS
    return torch.cat([input_ids, state.tokens], dim=1)


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
    structure = None
    if structured_outputs is not None:
        check_int("max_new_tokens", max_new_tokens, minimum=1)
        structure = structure_for_call(structured_outputs, model, tokenizer, get_spec(model).mask_id, max_new_tokens)
    decoder = ARDecoder(model, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                        eos_token_id=eos_token_id, pad_token_id=pad_token_id, structure=structure)
    decoder.check_input(input_ids, attention_mask)
    check_generator(generator, input_ids.device)
    check_stats("stats", stats)
    warn_if_padded_without_mask(input_ids, attention_mask, getattr(model.config, "pad_token_id", None))
    return drive(ar_steps(decoder, input_ids, attention_mask, generator, stats), model)
