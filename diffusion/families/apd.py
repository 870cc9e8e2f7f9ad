"""APD: adaptive parallel decoding with an autoregressive verifier (Israel, Van den Broeck, Grover
2025; danielmisrael/apd `dream/generation_utils.py::apd_sample`), for any remask dLLM.

Left to right from the first mask. Each round:

1. the dLLM (its own KV cache cropped at `curr − kv_window`, the window and the newly accepted
   tokens recomputed) scores the masked window `[curr, curr + max_lookahead)`; a draft is sampled
   at every window position from its (aligned) logits;
2. the verifier scores the draft in one forward with its own croppable KV cache (the whole prefix
   the first time), logits aligned so that position j conditions on the draft before j;
3. draft token j is accepted iff it equals `argmax(R·l_dLLM + (1 − R)·l_AR)` over the shared
   vocabulary; the first is always accepted; the longest accepted prefix is committed;
4. stop when nothing is masked or an EOS is in the sequence.

`R = mixture_weight`: R → 1 trusts the dLLM, R → 0 demands the verifier's greedy agreement.

`coupled_gumbel=True` is the paper's rule instead of the reference's: at T > 0 one set of uniforms u
per position gives both the draft ``argmax(l_dLLM/T + g)`` (temperature T, not the reference's T²)
and the target ``argmax((R·l_dLLM + (1 − R)·l_AR)/T + g)``, g = −log(−log u), so the draft is kept
exactly when the mixture's own sample agrees with it. At T = 0 both rules are the same argmax test.
The acceptance test runs in the fused `remask.kernels.apd_accept` kernel.

No forward is computed here: a round (`APDDecoder.round`) is a step generator that yields the dLLM's
window forward and then the verifier's (`ForwardRequest(module=verifier)`, the whole output for its
cache). `apd_generate` drives `apd_steps` with `drive`; the engine steps it one forward per engine
step (a `StepwiseDecoder`), packing the dLLM's forward with the other requests' forwards.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generator

import torch

from remask.kernels import apd_accept
from remask.kernels.confidence_ref import gumbel
from remask.caches import KVCache
from remask.models.hf_compat import output_cache
from remask.models.parallel import full_logits
from remask.models.spec import ModelSpec, get_spec

from ..parts.checks import NoWorkBound, check_bool, check_int, check_real, checked, model_device
from ..parts.constrain_loops import Constrainable, draft_under
from ..parts.scoring import filter_logits, gumbel_max_scores
from ..parts.stats import GenerationStats
from ..parts.step import masked_canvas
from ..parts.stepper import ForwardRequest, Progress, drive


@dataclass
class APDConfig(NoWorkBound):
    """APD's parameters. `verifier`: any `AutoModelForCausalLM` whose vocabulary covers the
    dLLM's tokens up to its own size (the dLLM's logits are cut to the verifier's vocabulary).
    `mixture_weight` R in [0, 1]; `kv_window` W (None: no dLLM cache, a full forward each round);
    `max_lookahead` M (None: the whole rest of the sequence). `dllm_cache`: whether the dLLM keeps a
    KV cache between rounds; None follows the dLLM's `config.use_cache`, as the reference does (a
    model whose config says `use_cache=False`, like the released Dream, returns no cache there, so
    every round recomputes from position 0 and `kv_window` has no effect). `coupled_gumbel`: the
    paper's coupled draft/target sampling at T > 0 (default False: the reference's T² draft and
    deterministic argmax target).

    No work bound: as in the official APD code, a window `[curr, curr + max_lookahead)` past the answer is the rest
    of it, and a `kv_window` past the sequence keeps the whole cache."""

    verifier: Any
    mixture_weight: float = checked(0.7, check_real, low=0, high=1)
    kv_window: int | None = checked(16, check_int, minimum=0, allow_none=True)
    max_lookahead: int | None = checked(100, check_int, minimum=1, allow_none=True)
    dllm_cache: bool | None = checked(None, check_bool, allow_none=True)
    coupled_gumbel: bool = checked(False, check_bool)

    def __post_init__(self) -> None:
        """The fields' checks (`Checked`, again when a decoder is built: the config is mutable), then the verifier."""
        super().__post_init__()
        if not callable(self.verifier) or getattr(self.verifier, "config", None) is None:
            raise ValueError(f"verifier must be a transformers causal LM (AutoModelForCausalLM), got "
                             f"{type(self.verifier).__name__}")
        kind = get_spec(self.verifier).kind
        if kind != "ar":
            raise ValueError(f"verifier must be an autoregressive (causal) model; got a {kind} diffusion model, "
                             "whose logits do not score a left-to-right continuation")

    validate = __post_init__


def draft_scores(logits: torch.Tensor, temperature: float, top_p: float | None, top_k: int | None,
                 generator: torch.Generator | None = None, uniforms: torch.Tensor | None = None,
                 vocab: int | None = None) -> torch.Tensor:
    """The scores a draft is the argmax of. The reference's: logits / T, top-p then top-k (Dream's
    filter order, `scoring.filter_logits(order="top_p_first", removed="dtype_min")`), then the float64
    Gumbel-max score `exp(l) / (−log u)^T` — so the effective temperature is T² (documented quirk);
    T=0: the logits. With `uniforms` `[N, >= vocab]` (the coupled rule, T > 0): ``filtered(l/T) + g``
    over the first `vocab` ids, g = −log(−log u), which the target reuses."""
    filtered = filter_logits(logits if uniforms is None else logits[:, :vocab], temperature, top_k, top_p,
                             order="top_p_first", removed="dtype_min")
    if uniforms is not None:
        return filtered.float() + gumbel(uniforms[:, :vocab].float())
    return gumbel_max_scores(filtered, temperature, generator)


def shared_argmax(scores: torch.Tensor, vocab: int | None) -> torch.Tensor:
    """The draft: the best-scoring id, or below `vocab` (the ids the verifier has) the best one there."""
    draft = torch.argmax(scores, dim=-1)
    if vocab is not None and vocab < scores.shape[-1]:
        draft = torch.where(draft < vocab, draft, torch.argmax(scores[:, :vocab], dim=-1))
    return draft


@dataclass(eq=False)
class APDState:
    """One sequence under APD: the canvas `[1, T]`, the first masked position `curr`, the
    tokens accepted in the last round, both models' caches (`use_dllm_cache`: whether the dLLM
    keeps one)."""

    x: torch.Tensor
    prompt_len: int
    curr: int
    num_accept: int = 0
    use_dllm_cache: bool = False
    dllm_cache: KVCache | None = None
    verifier_cache: Any = None
    done: bool = False
    matcher: Any = None                   # structured output: the answer's matcher (`APDDecoder.constrain`)


class APDDecoder(Constrainable):
    """APD as a state and a round (one sequence at a time, as the reference): each `round` is a
    step generator of two forwards (dLLM draft, verifier score) that accepts the longest agreeing
    prefix; `apd_steps` runs the rounds. Tokens accepted are final."""

    def __init__(self, spec: ModelSpec, apd: APDConfig, *, gen_length: int, temperature: float = 0.0,
                 top_p: float | None = None, top_k: int | None = None) -> None:
        apd.validate()
        check_int("gen_length", gen_length, minimum=1)
        check_real("temperature", temperature, low=0)
        self.spec, self.apd, self.gen_length = spec, apd, gen_length
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        verifier_vocab = apd.verifier.config.vocab_size
        self.vocab = min(spec.vocab_size or verifier_vocab, verifier_vocab)
        if spec.eos_id is not None and spec.eos_id >= self.vocab:
            raise ValueError(f"the dLLM's eos_id {spec.eos_id} is outside the shared vocabulary [0, {self.vocab}) of "
                             f"the dLLM and the verifier; APD needs a verifier that shares the dLLM's tokenizer")

    def _default_end_ids(self) -> tuple[Any, str]:
        """Structured output (`constrain`): every draft is drawn from scores masked by a clone that walked the
        drafts before it, the accepted run is cut at the first token the matcher refuses and consumed; the answer
        ends at the dLLM's EOS (APD's stop)."""
        return [self.spec.eos_id], "the dLLM's spec has no eos_id"

    def check_input(self, prompt: torch.Tensor) -> None:
        if prompt.shape[0] != 1:
            raise ValueError(f"APD decodes one sequence at a time (as the reference); got a batch of "
                             f"{prompt.shape[0]} (prompt rows × num_return_sequences)")
        verifier = self.apd.verifier
        if model_device(verifier) != prompt.device:
            raise ValueError(f"the APD verifier is on {model_device(verifier)} but the prompt is on {prompt.device}")
        # The verifier reads the prompt and scores drafts cut to the shared vocabulary [0, vocab).
        if int(prompt.max()) >= verifier.config.vocab_size:
            raise ValueError(f"the prompt holds token id {int(prompt.max())}, outside the verifier's vocabulary "
                             f"(vocab_size={verifier.config.vocab_size}); APD needs a verifier that shares the "
                             f"dLLM's tokenizer")

    def start(self, prompt: torch.Tensor) -> APDState:
        apd, P = self.apd, prompt.shape[1]
        cached = apd.dllm_cache if apd.dllm_cache is not None else bool(getattr(self.spec.config, "use_cache", False))
        return APDState(x=masked_canvas(prompt, self.gen_length, self.spec.mask_id), prompt_len=P, curr=P,
                        use_dllm_cache=apd.kv_window is not None and cached,
                        matcher=None if self.structure is None else self.structure.matcher(self.end_ids))

    def round(self, state: APDState, generator: torch.Generator | None, stats: GenerationStats,
              verifier_stats: GenerationStats | None = None) -> Generator[ForwardRequest, Any, APDState]:
        """One round as a step generator: the dLLM's forward over the window, the draft, the
        verifier's forward over it, the accepted prefix committed. Returns the state."""
        apd, spec, x, verifier, vocab = self.apd, self.spec, state.x, self.apd.verifier, self.vocab
        T, temperature, curr = x.shape[1], self.temperature, state.curr
        right = T if apd.max_lookahead is None else min(curr + apd.max_lookahead, T)
        cache, left = state.dllm_cache, 0
        if cache is not None:
            left = max(curr - apd.kv_window - state.num_accept + 1, 0)
            cache.crop(left)
            logits = yield ForwardRequest(x[:, left:right], cache=cache, spec=spec,
                                          shared=dict(cache_position=torch.arange(left, right, device=x.device)))
        else:   # the first round (or every round without a dLLM cache): from position 0
            state.dllm_cache = KVCache() if state.use_dllm_cache else None
            logits = yield ForwardRequest(x[:, :right], cache=state.dllm_cache, spec=spec)
        stats.forward(1, right - left)
        # Every position of [curr, right) is masked. Drafts are drawn over the dLLM's whole
        # vocabulary, as upstream (same noise shape, so seeded runs replay), but never the mask token
        # (upstream can commit it and return masks) and never an id the verifier lacks (upstream's
        # verifier crashes on one): such a draft becomes the best id of the shared vocabulary.
        window = full_logits(logits)[0, curr - left:right - left]   # APD's verifier mixes whole rows
        proposal = window.clone()
        proposal[:, spec.mask_id] = torch.finfo(proposal.dtype).min
        uniforms = torch.rand((right - curr, vocab), dtype=torch.float32, device=x.device, generator=generator) \
            if apd.coupled_gumbel and temperature > 0 else None
        scores = draft_scores(proposal, temperature, self.top_p, self.top_k, generator, uniforms, vocab)
        # under a structure, the same scores, each draft masked by the lookahead over the drafts before it
        draft = shared_argmax(scores, vocab) if state.matcher is None else draft_under(state.matcher, scores, vocab)
        # The verifier scores the draft: the whole prefix the first time, then only the draft. A causal
        # continuation of a model of its own (`module`; its whole output wanted: its cache), every position's
        # logits: the engine answers all APD requests' in one forward.
        if state.verifier_cache is None:
            ids = torch.cat([x[:, :curr], draft[None]], dim=1)   # the prefix, then the draft
            out = yield ForwardRequest(ids, shared=dict(use_cache=True), output="model", module=verifier,
                                       extends=True, rows=slice(None))
            verifier_logits = out.logits[0, curr - 1:right - 1]
        else:
            positions = torch.arange(curr, right, device=x.device)
            out = yield ForwardRequest(draft[None], per_row=dict(position_ids=positions[None]),
                                       shared=dict(use_cache=True, cache_position=positions), cache=state.verifier_cache,
                                       output="model", module=verifier, extends=True, rows=slice(None))
            # Row j predicts draft j + 1; row 0's own prediction is never needed (j = 0 is accepted).
            verifier_logits = torch.cat([out.logits[0, :1], out.logits[0, :-1]])
        state.verifier_cache = output_cache(out)
        if verifier_stats is not None:
            verifier_stats.forward(1, out.logits.shape[1])   # the prefix too on the first round
        num_accept = int(apd_accept(draft, window, verifier_logits, apd.mixture_weight, vocab=vocab,
                                    temperature=temperature if uniforms is not None else 0.0, noise=uniforms)[1])
        if state.matcher is not None:   # the accepted run, cut at the first token the structure refuses
            num_accept = max(1, state.matcher.accepts(draft[:num_accept].tolist()))
            state.matcher.advance(draft[:num_accept].tolist())
        # the verifier's cache cut after the accepted run, by a negative count of positions: what both
        # transformers 4.x and 5.x accept (5.x refuses an absolute length)
        extra = state.verifier_cache.get_seq_length() - (curr + num_accept)
        if extra > 0:
            state.verifier_cache.crop(-extra)
        x[0, curr:curr + num_accept] = draft[:num_accept]
        state.curr = curr = curr + num_accept
        state.num_accept = num_accept
        stats.step(num_accept)
        # Upstream stops at an EOS anywhere, the prompt included; remask looks at the generated part.
        eos_seen = spec.eos_id is not None and bool((x[:, state.prompt_len:curr] == spec.eos_id).any())
        if eos_seen:
            x[0, curr:] = spec.eos_id   # stopped at an EOS: the rest is EOS, never mask tokens
        state.done = curr >= T or eos_seen
        return state


@torch.no_grad()
def apd_generate(model: torch.nn.Module, spec: ModelSpec, prompt: torch.Tensor, gen_length: int, apd: APDConfig,
                 *, temperature: float = 0.0, top_p: float | None = None, top_k: int | None = None,
                 generator: torch.Generator | None = None, stats: GenerationStats | None = None,
                 verifier_stats: GenerationStats | None = None, structure: Any = None) -> torch.LongTensor:
    """Decode `gen_length` positions after `prompt` `[1, P]` with APD; returns `[1, P + gen_length]`.
    `structure`: a compiled structured output the answer is held to (`APDDecoder.constrain`).
    After an EOS the reference stops and leaves the remaining positions masked; remask fills them
    with EOS so no mask token is returned."""
    return drive(apd_call_steps(spec, prompt, gen_length, apd, temperature=temperature, top_p=top_p, top_k=top_k,
                                generator=generator, stats=stats, verifier_stats=verifier_stats, structure=structure),
                 model)


def apd_call_steps(spec: ModelSpec, prompt: torch.Tensor, gen_length: int, apd: APDConfig, *,
                   temperature: float = 0.0, top_p: float | None = None, top_k: int | None = None,
                   generator: torch.Generator | None = None, stats: GenerationStats | None = None,
                   verifier_stats: GenerationStats | None = None,
                   structure: Any = None) -> Generator[ForwardRequest, Any, torch.Tensor]:
    """APD's decoder for one call, built and its input checked now (not at the first step), and its loop
    (`apd_steps`): what `apd_generate` drives and the registry's `apd` method runs."""
    decoder = APDDecoder(spec, apd, gen_length=gen_length, temperature=temperature, top_p=top_p, top_k=top_k)
    decoder.constrain(structure).check_input(prompt)
    return apd_steps(decoder, prompt, generator, stats, verifier_stats)


def apd_steps(decoder: APDDecoder, prompt: torch.Tensor,
              generator: torch.Generator | None = None, stats: GenerationStats | None = None,
              verifier_stats: GenerationStats | None = None) -> Generator[ForwardRequest, Any, torch.Tensor]:
    """`apd_generate`'s loop as a step generator (the input checked by the caller): its rounds'
    forwards as `ForwardRequest`s, a `Progress` after each round (the accepted tokens are final);
    returns `[1, P + gen_length]`."""
    stats = stats or GenerationStats()   # None: counted, then dropped
    stats.start()
    state = decoder.start(prompt)
    while not state.done:
        yield from decoder.round(state, generator, stats, verifier_stats)
        yield Progress(state.x, state.curr - state.prompt_len)
    stats.stop(decoder.gen_length)
    return state.x
