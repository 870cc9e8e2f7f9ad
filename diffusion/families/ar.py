"""Plain autoregressive decoding for any `AutoModelForCausalLM`, with its KV cache.

It is the baseline the diffusion strategies are compared against, and later the APD verifier's
decoder. Token choice goes through `score_tokens` (greedy at T=0; temperature, top-k, top-p
otherwise), like every other sampler in remask.

No forward is computed here: the prompt's forward and each one-token forward are `ForwardRequest`s
(`output="model"`: the answer is the whole output, its KV cache included) that `ARDecoder.prefill`
/ `decode` yield as sub-generators; `ar_generate` drives its loop (`ar_steps`) with `drive`. The
engine runs its own paged flat forward instead (`remask/engine/model_runner.py::_ar_step`) and
takes only `ARDecoder.sample` from here.
"""
from __future__ import annotations

import inspect
import numbers
from dataclasses import dataclass
from typing import Any, Generator

import torch

from remask.models.hf_compat import cache_arg, output_cache
from remask.models.spec import get_spec

from ..parts.checks import (ParameterTypeError, check_generator, check_int, check_model_kind, check_prompt, check_real, check_stats,
                     check_token_id, warn_if_padded_without_mask)
from ..parts.scoring import score_tokens
from ..parts.stats import GenerationStats
from ..parts.stepper import ForwardRequest, drive


@dataclass
class ARState:
    """Rows decoded together: the prompt `[B, P]`, the tokens so far `[B, max_new_tokens]`
    (`pad_token_id` after a row's EOS), the model's cache and the logits of the next position."""

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
    """Autoregressive decoding as a state and a step (`ar_generate` drives one batch, the engine
    many): `start` runs the prompt's forward, each `step` samples one token per row and, unless
    that ends the state, runs the next one-token forward. The constructor validates the settings."""

    def __init__(self, model: torch.nn.Module, *, max_new_tokens: int = 128, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, eos_token_id: int | list[int] | None = None,
                 pad_token_id: int | None = None, structure: Any = None) -> None:
        spec = get_spec(model)
        check_model_kind(spec, diffusion=False, entry="remask.ar_generate")
        check_int("max_new_tokens", max_new_tokens, minimum=1)
        check_real("temperature", temperature, low=0)
        check_int("top_k", top_k, minimum=1, allow_none=True)
        check_real("top_p", top_p, low=0, high=1, low_open=True, allow_none=True)
        config = model.config
        if eos_token_id is None:
            eos_token_id = getattr(config, "eos_token_id", None)
        if eos_token_id is None or isinstance(eos_token_id, numbers.Integral):
            eos_ids = [] if eos_token_id is None else [eos_token_id]
        elif isinstance(eos_token_id, (list, tuple)):
            eos_ids = list(eos_token_id)
        else:
            raise ParameterTypeError(f"eos_token_id must be an int, a list of ints or None, got {eos_token_id!r}")
        for value in eos_ids:
            check_token_id(spec, value, "eos_token_id")
        if pad_token_id is None:
            pad_token_id = getattr(config, "pad_token_id", None)
            if pad_token_id is None:
                pad_token_id = eos_ids[0] if eos_ids else 0
        check_token_id(spec, pad_token_id, "pad_token_id")
        self.model, self.spec = model, spec
        self.max_new_tokens, self.temperature, self.top_k, self.top_p = max_new_tokens, temperature, top_k, top_p
        self.eos_ids, self.pad_token_id = eos_ids, pad_token_id
        # structured output (remask/structured.py): a CompiledStructure; the EOS ids end the answer
        if structure is not None and not eos_ids:
            raise ValueError("structured_outputs needs an end token: pass eos_token_id (the model config has none)")
        self.structure = structure
        # Only the last position's logits are needed, as in transformers' `generate`: the LM head
        # then runs on one row per sequence, the shape the engine's flat forward gives it too.
        forward_params = inspect.signature(model.forward).parameters
        self.keep_last = {"logits_to_keep": 1} if "logits_to_keep" in forward_params else {}

    def num_final(self, state: Any) -> int:
        """Tokens that no later step changes: every token sampled so far (the engine's protocol)."""
        return state.step

    def check_input(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        check_prompt(self.model, input_ids, attention_mask, name="input_ids", spec=self.spec)
        max_positions = getattr(self.model.config, "max_position_embeddings", None)
        if max_positions is not None and input_ids.shape[1] + self.max_new_tokens > max_positions:
            raise ValueError(f"prompt length + max_new_tokens = {input_ids.shape[1] + self.max_new_tokens} exceeds "
                             f"the model's max_position_embeddings {max_positions}")

    def prefill(self, input_ids: torch.Tensor, mask: torch.Tensor
                ) -> Generator[ForwardRequest, Any, tuple[Any, torch.Tensor, torch.Tensor]]:
        """The prompt's forward (a sub-generator of one request): (cache, next-position logits
        `[B, V]`, position ids of the last column)."""
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        out = yield ForwardRequest(input_ids, per_row=dict(attention_mask=mask, position_ids=position_ids),
                                   shared=dict(use_cache=True, **self.keep_last), output="model")
        return output_cache(out), out.logits[:, -1], position_ids[:, -1:]

    def decode(self, cache: Any, tokens: torch.Tensor, mask: torch.Tensor,
               position_ids: torch.Tensor) -> Generator[ForwardRequest, Any, tuple[Any, torch.Tensor]]:
        """One token per row `[B]` at `position_ids` `[B, 1]` against `cache` (a sub-generator of
        one request); `mask` covers every position so far, this one included. Returns (cache,
        next-position logits `[B, V]`)."""
        # the cache under the keyword the model's forward declares (`cache` or `past_key_values`)
        out = yield ForwardRequest(tokens[:, None], per_row=dict(attention_mask=mask, position_ids=position_ids),
                                   shared=dict(cache_arg(self.model.forward, cache), use_cache=True,
                                               **self.keep_last), output="model")
        return output_cache(out), out.logits[:, -1]

    def sample(self, logits: torch.Tensor, generator: torch.Generator | None = None, state: Any = None) -> torch.Tensor:
        """The next token of each row from its next-position logits `[B, V]` (greedy at T=0;
        temperature, top-k, top-p otherwise). With a structure, `state` (an `ARState`, or the
        engine's row) carries each row's matcher (made on first use): the logits are masked to the
        ids the structure allows next (EOS only where it is complete), and the matchers advance
        over the sampled tokens."""
        matchers = None
        if self.structure is not None:
            if state is None:
                raise ValueError("ARDecoder.sample: a structured decoder needs the sequence's state (its matchers)")
            matchers = getattr(state, "matchers", None)
            if matchers is None:
                matchers = [self.structure.matcher(self.eos_ids) for _ in range(logits.shape[0])]
                state.matchers = matchers
            logits = torch.stack([m.mask_logits(row) for m, row in zip(matchers, logits)])
        # A mask token the config declares (a model sharing a diffusion model's tokenizer) is never
        # emitted: no remask output holds one.
        tokens = score_tokens(logits.float(), temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                              sampler="categorical", exclude_id=self.spec.mask_id, generator=generator)[0]
        if matchers is not None:
            for m, token in zip(matchers, tokens.tolist()):
                m.advance([token])
        return tokens

    def start(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
              stats: GenerationStats | None = None) -> ARState:
        """The prompt's forward, computed alone (`starting` is its sub-generator)."""
        return drive(self.starting(input_ids, attention_mask, stats), self.model)

    def step(self, state: ARState, generator: torch.Generator | None = None,
             stats: GenerationStats | None = None) -> None:
        """One token per row and the next forward, computed alone (`stepping` is its sub-generator)."""
        drive(self.stepping(state, generator, stats), self.model)

    def starting(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 stats: GenerationStats | None = None) -> Generator[ForwardRequest, Any, ARState]:
        B, P = input_ids.shape
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(input_ids.dtype)
        cache, logits, position_ids = yield from self.prefill(input_ids, mask)
        if stats is not None:
            stats.forward(B, P)
        device = input_ids.device
        return ARState(input_ids=input_ids, eos=torch.tensor(self.eos_ids, dtype=torch.long, device=device),
                       mask=mask, position_ids=position_ids, cache=cache, logits=logits,
                       tokens=torch.full((B, self.max_new_tokens), self.pad_token_id, dtype=torch.long, device=device),
                       finished=torch.zeros(B, dtype=torch.bool, device=device))

    def stepping(self, state: ARState, generator: torch.Generator | None = None,
                 stats: GenerationStats | None = None) -> Generator[ForwardRequest, Any, ARState]:
        """Sample one token per row; unless that ends the state, the next one-token forward. Returns
        the state."""
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
        mask = state.mask
        state.mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype, device=mask.device)], dim=-1)
        state.position_ids = state.position_ids + 1
        state.cache, state.logits = yield from self.decode(state.cache, next_token, state.mask, state.position_ids)
        if stats is not None:
            stats.forward(B, 1)
        return state


def ar_steps(decoder: ARDecoder, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
             generator: torch.Generator | None = None,
             stats: GenerationStats | None = None) -> Generator[ForwardRequest, Any, torch.Tensor]:
    """`ar_generate`'s loop as a step generator (its arguments checked by the caller): yields each
    forward as a `ForwardRequest`, returns `[B, P + max_new_tokens]`."""
    if stats is not None:
        stats.start()
    state = yield from decoder.starting(input_ids, attention_mask, stats)
    while not state.done:
        yield from decoder.stepping(state, generator, stats)
    if stats is not None:
        stats.stop(state.generated)   # tokens up to and including each row's EOS
    return torch.cat([input_ids, state.tokens], dim=1)


@torch.no_grad()
def ar_generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    *,
    generator: torch.Generator | None = None,
    stats: GenerationStats | None = None,
    structured_outputs: Any = None,
    tokenizer: Any = None,
) -> torch.LongTensor:
    """Decode `max_new_tokens` after a (left-padded) prompt `[B, P]`.

    Rows that emitted an EOS id continue with `pad_token_id` (default: the first EOS id); decoding
    stops early once every row has finished. Returns `[B, P + max_new_tokens]`.

    `structured_outputs` (a `remask.StructuredOutputsParams`): each row's next token is drawn from
    the ids the structure allows (an EOS id only where it is complete), compiled against
    `tokenizer` (default: the one saved in the model's checkpoint folder). A row without EOS ran
    out of `max_new_tokens` and holds a valid prefix.
    """
    structure = None
    if structured_outputs is not None:
        from remask.structured import StructuredOutputsParams, compile_structure, model_vocab_size, tokenizer_for

        structured_outputs = StructuredOutputsParams.from_json(structured_outputs)
        mask_id = get_spec(model).mask_id
        structure = compile_structure(structured_outputs, tokenizer_for(model, tokenizer), model_vocab_size(model),
                                      () if mask_id is None else (mask_id,))
        check_int("max_new_tokens", max_new_tokens, minimum=1)
        structure.check_budget(max_new_tokens)
    decoder = ARDecoder(model, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                        eos_token_id=eos_token_id, pad_token_id=pad_token_id, structure=structure)
    decoder.check_input(input_ids, attention_mask)
    check_generator(generator, input_ids.device)
    check_stats("stats", stats)
    warn_if_padded_without_mask(input_ids, attention_mask, getattr(model.config, "pad_token_id", None))
    return drive(ar_steps(decoder, input_ids, attention_mask, generator, stats), model)
