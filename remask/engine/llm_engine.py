"""`LLMEngine`: requests in, one engine step at a time, outputs out — what `LLM` and a server drive.

    engine = LLMEngine(model, tokenizer)
    engine.add_request("a", "sort 52814", SamplingParams(max_tokens=16))
    while engine.has_unfinished_requests():
        for out in engine.step():          # requests with new final tokens (or finished)
            print(out.request_id, out.outputs[0].text, out.finished)

Every sample draws from its own generator, seeded by `SamplingParams.seed` + its index, or by the
engine's seed and the prompt's ids (never the arrival order). With `batch_invariant=True` a
request's tokens are bitwise those of `remask.generate` / `remask.ar_generate` on its prompt alone.
"""
from __future__ import annotations

import enum
import functools
import zlib
from typing import Any, Sequence as Seq

import torch

from remask.caches import PromptCache
from remask.diffusion.parts.checks import (ParameterTypeError, check_bools, check_choice, check_context, check_instance,
                                           check_int, check_ints, check_prompt, check_real, check_token_id)
from remask.diffusion.parts.processors import HoldEndIds, RecordLogprobs
from remask.diffusion.parts.stats import read_counts
from remask.engine.presets import decoder_for
from remask.models.registry import family_of
from remask.models.spec import get_spec
from remask.text import answer_text, stop_token_ids

from .model_runner import ModelRunner
from remask.caches.page_manager import PageManager
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .sequence import CompletionOutput, Logprob, RequestOutput, Sequence, SequenceStatus, now

# vLLM's prompt dicts: TextPrompt {"prompt": str}; TokensPrompt {"prompt_token_ids": [...]} (with an
# optional "prompt": reported, not tokenized). Its other keys are refused by name, never dropped.
PROMPT_KEYS = ("prompt", "prompt_token_ids")
VLLM_PROMPT_KEYS = {"multi_modal_data": "multimodal inputs", "mm_processor_kwargs": "multimodal processor settings",
                    "multi_modal_uuids": "multimodal item ids", "cache_salt": "a prefix-cache salt",
                    "prompt_embeds": "prompt embeddings (EmbedsPrompt)", "token_type_ids": "cross-encoder token types",
                    "encoder_prompt": "encoder-decoder prompts", "decoder_prompt": "encoder-decoder prompts"}


class EngineState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"     # finishes what it has, admits nothing new
    SHUT_DOWN = "shut_down"
    ERROR = "error"


class LLMEngine:
    def __init__(self, model: torch.nn.Module, tokenizer: Any = None, *, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 16384, kv_cache_pages: int | None = None,
                 kv_cache_memory_fraction: float | None = None, page_size: int = 16,
                 enable_prefix_caching: bool = True, batch_invariant: bool = True, seed: int = 0,
                 max_request_bytes: int | None = None, cost_stride: bool = True, cuda_graphs: bool = False,
                 varlen_attention: bool = False) -> None:
        self.state = EngineState.LOADING
        check_ints(1, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, page_size=page_size)
        check_int("kv_cache_pages", kv_cache_pages, minimum=1, allow_none=True)
        check_real("kv_cache_memory_fraction", kv_cache_memory_fraction, low=0, high=1, low_open=True,
                   allow_none=True)
        check_int("seed", seed, minimum=0)
        check_int("max_request_bytes", max_request_bytes, minimum=1, allow_none=True)
        check_bools(enable_prefix_caching=enable_prefix_caching, batch_invariant=batch_invariant,
                    cost_stride=cost_stride, cuda_graphs=cuda_graphs, varlen_attention=varlen_attention)
        self.model, self.tokenizer, self.seed = model.eval(), tokenizer, seed
        self.spec = get_spec(model)
        self.family = family_of(getattr(model.config, "model_type", ""))
        self.is_ar = self.spec.kind == "ar"
        self.device = next(model.parameters()).device
        self.pages = self._page_manager(max_num_seqs, max_num_batched_tokens, kv_cache_pages,
                                        kv_cache_memory_fraction, page_size, enable_prefix_caching)
        self.scheduler = Scheduler(max_num_seqs, max_num_batched_tokens, self.pages, cost_stride)
        # cuda_graphs (engine/cuda_graphs.py): refused (ValueError) for a model off CUDA
        self.runner = ModelRunner(model, self.spec, batch_invariant, self.pages, cuda_graphs=cuda_graphs,
                                  max_num_seqs=max_num_seqs, varlen_attention=varlen_attention)
        self._generator_bytes = torch.Generator(device=self.device).get_state().numel()
        # Admission's memory budget per request (`request_bytes`; docs/engine.md, Admission): one full
        # step at this engine's limits plus 1024 samples' bookkeeping at the model's context length.
        self.max_request_bytes = max_request_bytes if max_request_bytes is not None else (
            2 * max_num_batched_tokens * self._position_bytes(cached=True)
            + 1024 * self._sample_bytes(self.spec.max_length or max_num_batched_tokens))
        # Encoder–decoder models: requests with the same prompt share its encoder cache (copied).
        self.prompt_cache = PromptCache(max(64, max_num_seqs)) if (
            self.spec.layout == "encoder-decoder" and enable_prefix_caching) else None
        self.requests: dict[str, tuple[str | None, list[int], list[Sequence]]] = {}
        self.stop_ids = stop_token_ids(tokenizer, model)   # without a tokenizer: the spec's EOS / EOT
        self.state = EngineState.READY

    def _page_manager(self, max_num_seqs: int, max_num_batched_tokens: int, kv_cache_pages: int | None,
                      memory_fraction: float | None, page_size: int, prefix_caching: bool) -> PageManager | None:
        """The page store of autoregressive models. A diffusion request keeps its cache to itself
        (its K/V depend on its whole canvas), so the knobs are refused there rather than ignored."""
        if not self.is_ar and self.spec.attention != "block-causal":
            sharing = self.spec.layout == "encoder-decoder"   # whole prompts' encoder caches (PromptCache)
            set_here = [name for name, value, default in (
                ("kv_cache_pages", kv_cache_pages, None), ("kv_cache_memory_fraction", memory_fraction, None),
                ("page_size", page_size, 16), ("enable_prefix_caching", prefix_caching, True))
                if value != default and not (sharing and name == "enable_prefix_caching")]
            if set_here:
                raise ValueError(f"{', '.join(set_here)}: the KV page store serves autoregressive models; a diffusion "
                                 f"request keeps its own cache (use_cache='paged' pages it per request)")
            return None
        # Block-causal models keep their finished blocks here too (`remask.caches.BlockKVCache`).
        if kv_cache_pages is not None and memory_fraction is not None:
            raise ValueError("pass kv_cache_pages or kv_cache_memory_fraction, not both")
        if memory_fraction is not None:
            if self.device.type != "cuda":
                raise ValueError(f"kv_cache_memory_fraction sizes the store from free GPU memory; the model is on "
                                 f"{self.device.type}: pass kv_cache_pages")
            free, _ = torch.cuda.mem_get_info(self.device)
            kv_bytes = self._position_bytes(cached=True) - self._position_bytes(cached=False)   # a position's K/V
            kv_cache_pages = max(1, int(free * memory_fraction) // (page_size * kv_bytes))
        elif kv_cache_pages is None:
            # Enough for every admitted sequence at full length: no preemption unless asked for.
            # A block-causal request rounds its length up to whole blocks: a block's worth more each.
            rounding = 1 + -(-(self.spec.block_length or 0) // page_size)
            kv_cache_pages = -(-max_num_batched_tokens // page_size) + max_num_seqs * rounding
        return PageManager(kv_cache_pages, page_size, enable_prefix_caching=prefix_caching)

    def kv_stats(self) -> dict[str, int]:
        """The page store's figures (zero without one): pages in total / in use / at peak, page size, prefix
        lookups and hits (encoder–decoder models: whole prompts' encoder caches), shared pages made private."""
        pages, shared = self.pages, self.prompt_cache
        if pages is None:
            return {"pages": 0, "pages_in_use": 0, "peak_pages_in_use": 0, "page_size": 0,
                    "prefix_lookups": 0 if shared is None else shared.hits + shared.misses,
                    "prefix_hits": 0 if shared is None else shared.hits, "pages_unshared": 0}
        return {"pages": pages.num_pages, "pages_in_use": pages.pages_in_use, "peak_pages_in_use": pages.peak_in_use,
                "page_size": pages.page_size, "prefix_lookups": pages.lookups, "prefix_hits": pages.shared_hits,
                "pages_unshared": self.runner.store.unshared_pages}

    # ---- requests ------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | Seq[int] | torch.Tensor | dict[str, Any],
                    params: SamplingParams | None = None, *, drafts: bool = False, owner: str | None = None) -> None:
        """Queue a request (text, token ids, or vLLM's TextPrompt / TokensPrompt dict), checked whole: a bad
        one raises `ValueError` naming the problem before anything is allocated. `drafts=True`: `step`
        reports the provisional canvas (diffusion models); `owner`: who asked, the fairness unit."""
        if self.state is not EngineState.READY:
            raise RuntimeError(f"the engine is {self.state.value}: it admits no new request")
        check_bools(drafts=drafts)
        if drafts and params is not None and params.output_kind == "final_only":
            raise ValueError("drafts=True reports the canvas every step; output_kind='final_only' reports nothing "
                             "before the end: ask for output_kind='cumulative'")
        check_instance("owner", owner, str, "a str")
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params = check_instance("params", params, SamplingParams, "a remask.SamplingParams") or SamplingParams()
        text, ids = self._prompt_ids(prompt)
        check_context(self.spec, len(ids), params.max_tokens)   # before any decoder sizes its buffers by it
        self._check_request_bytes(len(ids), params)            # before any sample, decoder or buffer exists
        prompt_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
        decoder = decoder_for(self, params, prompt_ids)   # the parts this request asks for
        recorder = None
        if params.logprobs is not None and not self.is_ar:   # the first processor: it sees the raw logits
            recorder = RecordLogprobs(decoder.canvas, self.spec.mask_id, params.logprobs)
            decoder.add_processor(recorder)
        for token in params.stop_token_ids:
            check_token_id(self.spec, token, "stop_token_ids")
        if params.min_tokens:
            # The ids that could end the answer: the model's EOS/EOT, the tokenizer's end tokens and
            # stop_token_ids — EOS too under ignore_eos, as vLLM (its min_tokens masks every stop id).
            end_ids = torch.tensor(sorted(set(self.stop_ids) | set(self.eos_ids()) | set(params.stop_token_ids)),
                                    dtype=torch.long, device=self.device)
            decoder.add_processor(HoldEndIds(params.min_tokens, end_ids))
        # From the engine seed and the prompt, not the arrival order: the same tokens whenever it arrives.
        base_seed = params.seed if params.seed is not None else (
            (self.seed * 1_000_003 + zlib.crc32(str(ids).encode())) % (2**31))
        arrival = now()
        seqs = [Sequence(request_id=request_id, index=i, prompt_ids=prompt_ids, params=params, decoder=decoder,
                         generator=torch.Generator(device=self.device).manual_seed(base_seed + i), arrival_time=arrival,
                         seed=base_seed + i, paged=self.is_ar, owner=owner, drafts=drafts and not self.is_ar,
                         recorder=recorder)
                for i in range(params.n)]
        for seq in seqs:
            self.scheduler.add(seq)
        self.requests[request_id] = (text, ids, seqs)

    def _position_bytes(self, cached: bool) -> int:
        """Estimated bytes one position holds during a step: its id, logits and the rule's probabilities
        (2 × vocabulary float32), activations in the model's dtype and with `cached` every layer's K/V."""
        plain, kv = self._position_sizes
        return plain + (kv if cached else 0)

    @functools.cached_property
    def _position_sizes(self) -> tuple[int, int]:
        """`_position_bytes` without and of the K/V, read from the model's config once."""
        config = self.model.config
        config = config.get_text_config() if hasattr(config, "get_text_config") else config

        def read(*names: str, default: int = 0) -> int:
            return next((v for name in names if isinstance(v := getattr(config, name, None), int) and v > 0), default)

        hidden = read("hidden_size", "d_model", "n_embd", "dim", default=1024)
        intermediate = read("intermediate_size", "mlp_hidden_size", "ffn_dim", "n_inner", default=4 * hidden)
        layers = read("num_hidden_layers", "n_layers", "num_layers", "n_layer", default=1)
        heads = read("num_attention_heads", "n_heads", "n_head", default=1)
        kv_width = read("num_key_value_heads", "n_kv_heads", default=heads) * read("head_dim", default=hidden // heads)
        width = torch.empty((), dtype=next(self.model.parameters()).dtype).element_size()
        vocab = self.spec.vocab_size or read("vocab_size", "embedding_size", default=hidden)
        return 8 + 2 * vocab * 4 + (5 * hidden + intermediate) * width, 2 * layers * kv_width * width

    def _sample_bytes(self, max_tokens: int) -> int:
        """A sample's bookkeeping: its generator's state, the `Sequence` and its token ids."""
        return self._generator_bytes + 1024 + 8 * max_tokens

    def request_bytes(self, prompt_len: int, params: SamplingParams) -> tuple[int, int]:
        """(estimated bytes of the whole request, of one sample alone; docs/engine.md, Admission).
        AR K/V and block-causal blocks live in the page store, checked there."""
        positions = prompt_len + params.max_tokens
        cached = not self.is_ar and (params.use_cache is not None or params.sparse is not None)
        one = positions * self._position_bytes(cached) * (2 if params.cfg_scale else 1)
        live = min(params.n, self.scheduler.max_num_seqs, max(1, self.scheduler.max_num_batched_tokens // positions))
        book = self._sample_bytes(params.max_tokens)
        return live * one + params.n * book, one + book

    def _check_request_bytes(self, prompt_len: int, params: SamplingParams) -> None:
        total, one = self.request_bytes(prompt_len, params)
        # past max_num_batched_tokens the scheduler refuses it by its positions, also before allocation
        if prompt_len + params.max_tokens > self.scheduler.max_num_batched_tokens or total <= self.max_request_bytes:
            return
        mib = 1 << 20
        if one > self.max_request_bytes:
            name = "prompt" if prompt_len > params.max_tokens else "max_tokens"
            raise ValueError(f"{name}: one sample of this request needs about {one / mib:.1f} MiB (prompt {prompt_len} "
                             f"+ max_tokens {params.max_tokens} positions), more than this engine's "
                             f"max_request_bytes={self.max_request_bytes} ({self.max_request_bytes / mib:.1f} MiB)")
        raise ValueError(f"n: the request's {params.n} samples need about {total / mib:.1f} MiB (one alone "
                         f"{one / mib:.2f} MiB), more than this engine's max_request_bytes={self.max_request_bytes} "
                         f"({self.max_request_bytes / mib:.1f} MiB): lower n")

    def _prompt_ids(self, prompt: Any) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            return self._prompt_dict(prompt)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer: pass tokenizer= or token ids")
            ids, text = list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"]), prompt
        elif torch.is_tensor(prompt):
            if prompt.dim() != 1:
                raise ValueError(f"prompt token ids must be 1-D, got shape {tuple(prompt.shape)}")
            ids, text = prompt.tolist(), None
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids, text = list(prompt), None
        else:
            raise ValueError(f"prompt must be a str, a list of token ids, {{'prompt': str}} or "
                             f"{{'prompt_token_ids': [ids]}}, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt is empty: at least one token is needed")
        check_prompt(self.spec.device, torch.tensor([ids], dtype=torch.long, device=self.device), None, spec=self.spec,
                     mask_in_prompt="allow" if self.is_ar else "refuse")
        return text, ids

    def _prompt_dict(self, prompt: dict[str, Any]) -> tuple[str | None, list[int]]:
        """vLLM's TextPrompt / TokensPrompt: (text, ids) as the plain forms give them."""
        for key in prompt:
            if key in VLLM_PROMPT_KEYS:
                raise ValueError(f"prompt: the key {key!r} ({VLLM_PROMPT_KEYS[key]}) is not supported by remask; a "
                                 f"prompt dict takes {list(PROMPT_KEYS)}")
            if key not in PROMPT_KEYS:
                raise ValueError(f"prompt: unknown key {key!r}; a prompt dict takes {list(PROMPT_KEYS)} (vLLM's "
                                 "TextPrompt / TokensPrompt)")
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise ParameterTypeError(f"prompt['prompt'] must be a str, got {type(text).__name__}")
        if "prompt_token_ids" not in prompt:
            if text is None:
                raise ValueError(f"prompt: a prompt dict needs 'prompt' (text) or 'prompt_token_ids', got {prompt!r}")
            return self._prompt_ids(text)
        ids = prompt["prompt_token_ids"]
        if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ParameterTypeError(f"prompt['prompt_token_ids'] must be a list of token ids, got {ids!r}")
        # A TokensPrompt's text is the text its ids came from (vLLM's meaning): reported, not tokenized.
        return text, self._prompt_ids(list(ids))[1]

    def eos_ids(self) -> list[int]:
        eos = getattr(self.model.config, "eos_token_id", None)
        return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))

    def abort_request(self, request_id: str, reason: str = "abort") -> RequestOutput | None:
        """Stop a request now and free its cache; returns its last output (finish reason `reason`:
        "abort", or "timeout" for a passed deadline), or None for an unknown or finished id."""
        check_choice("reason", reason, ("abort", "timeout"))
        if request_id not in self.requests:
            return None
        for seq in self.requests[request_id][2]:
            if not seq.is_finished:   # waiting or running: what it has, and why it stopped
                seq.output_ids = self._generated(seq)
                seq.finish_time, seq.finish_reason = now(), reason
        self.scheduler.abort(request_id)
        return self.output(request_id)

    def set_deadline(self, request_id: str, deadline: float | None) -> None:
        """Abort the request at the next `step` (reason "timeout") once `deadline` (`time.perf_counter()`;
        None: none) has passed: the engine's own, so a caller that stopped watching cannot hold it."""
        if request_id not in self.requests:
            raise ValueError(f"request_id {request_id!r} is not in flight")
        check_real("deadline", deadline, allow_none=True)
        for seq in self.requests[request_id][2]:
            seq.deadline = deadline

    def _expire(self) -> list[RequestOutput]:
        """Abort the requests whose deadline has passed (checked between steps)."""
        t = now()
        late = [request_id for request_id, (_, _, seqs) in self.requests.items()
                if seqs[0].deadline is not None and seqs[0].deadline <= t]
        return [out for request_id in late if (out := self.abort_request(request_id, "timeout")) is not None]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    def drain(self) -> None:
        """Admit nothing new; `step` finishes the requests already queued."""
        self.state = EngineState.DRAINING

    def shutdown(self) -> None:
        for request_id in list(self.requests):
            self.abort_request(request_id)
        self.state = EngineState.SHUT_DOWN

    # ---- one step ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Admit, run one step of the scheduled sequences, retire the finished. Returns an output
        for every request whose final tokens grew or that finished (or timed out, checked first)."""
        expired = self._expire()
        _, running, _ = self.scheduler.schedule()
        failed = self.runner.step(running)
        touched: dict[str, None] = {}
        for seq in running:
            if seq in failed:
                seq.error, seq.finish_reason, seq.finish_time = failed[seq], "error", now()
                seq.output_ids = self._generated(seq)
                self.scheduler.finish(seq, SequenceStatus.ABORTED)
            if seq in failed or self._advance(seq) or seq.drafts:
                touched[seq.request_id] = None
        reported = [request_id for request_id in touched if self._reports(request_id)]
        # their step counts (held on the device, unread) in one host read rather than one per output
        read_counts(seq.stats for request_id in reported for seq in self.requests[request_id][2])
        return expired + [self.output(request_id) for request_id in reported]

    def _reports(self, request_id: str) -> bool:
        """Whether `step` gives the request's output now: always, but at its end only with output_kind='final_only'."""
        seqs = self.requests[request_id][2]
        return seqs[0].params.output_kind == "cumulative" or all(seq.is_finished for seq in seqs)

    def _advance(self, seq: Sequence) -> bool:
        """Update what is final; finish the sequence when its decoder is done. True if it changed."""
        final = seq.decoder.num_final(seq.state)
        grew = final > seq.final_len
        if grew and seq.first_final_time is None:
            seq.first_final_time = now()
        seq.final_len = final
        done = seq.state.done
        if not done and seq.params.stop and seq.paged and grew:   # token by token: stop strings end it early
            generated = self._generated(seq)
            text = answer_text(self.tokenizer, generated, stop_ids=self._stop_ids(seq))
            done = self._stop_string_at(seq, text, generated) is not None
        if done:
            seq.stats.stop(seq.final_len if seq.paged else seq.params.max_tokens)
            seq.finish_time = now()
            seq.output_ids = self._generated(seq)
            seq.output_logprobs = seq.token_logprobs(seq.final_len)
            self.scheduler.finish(seq)
            return True
        return grew

    @staticmethod
    def _stale(seq: Sequence) -> bool:
        """Freed, or preempted and decoding again: what it had stands until its decoder catches up."""
        return seq.state is None or seq.final_len < len(seq.output_ids or [])

    def _generated(self, seq: Sequence) -> list[int]:
        return list(seq.output_ids or []) if self._stale(seq) else seq.final_ids()

    def _logprobs(self, seq: Sequence, count: int) -> list[dict[int, Logprob]] | None:
        """The first `count` tokens' logprobs (`SamplingParams.logprobs`), as vLLM gives them: per
        token, the sampled id and its alternatives, each a `Logprob` with its rank and text."""
        if seq.params.logprobs is None:
            return None
        recorded = (seq.output_logprobs or [])[:count] if self._stale(seq) else (seq.token_logprobs(count) or [])
        text = (lambda t: self.tokenizer.decode([t])) if self.tokenizer is not None else (lambda t: None)
        # the sampled token first, then its alternatives ranked from 1 (the sampled one not again)
        return [{token: Logprob(logprob, rank, text(token))}
                | {alt: Logprob(alt_lp, i + 1, text(alt)) for i, (alt, alt_lp) in enumerate(top) if alt != token}
                for token, logprob, rank, top in recorded]

    def _draft(self, seq: Sequence) -> list[int | None] | None:
        if seq.state is None or seq.paged:
            return None if not seq.is_finished else list(seq.output_ids or [])
        canvas = seq.decoder.canvas(seq.state)[0, seq.prompt_len:seq.prompt_len + seq.params.max_tokens].tolist()
        return [None if t == self.spec.mask_id else t for t in canvas]

    def _stop_ids(self, seq: Sequence) -> list[int]:
        """The ids that end the answer: the model's end tokens (unless `ignore_eos`), `stop_token_ids` always."""
        ends = () if seq.params.ignore_eos else self.stop_ids
        return sorted(set(ends) | set(seq.params.stop_token_ids))

    def _stop_string_at(self, seq: Sequence, text: str, answer: list[int]) -> int | None:
        """Where the answer's `text` is cut: at the first `stop` string that ends past the text of
        its first `min_tokens` tokens (vLLM looks only from there on), or None."""
        if not seq.params.stop:
            return None
        least = seq.params.min_tokens
        floor = len(answer_text(self.tokenizer, answer[:least], stop_ids=self._stop_ids(seq))) if least else 0
        found = [i for s in seq.params.stop if (i := text.find(s, max(0, floor - len(s) + 1))) >= 0]
        return min(found) if found else None

    def output(self, request_id: str) -> RequestOutput:
        """The request's output now; a finished request leaves `requests` with it."""
        text, ids, seqs = self.requests[request_id]
        outputs = []
        for seq in seqs:
            generated = self._generated(seq)
            stops = set(self._stop_ids(seq))
            cut = next((i + 1 for i, t in enumerate(generated) if t in stops), None)
            answer = generated if cut is None else generated[:cut]
            body = answer_text(self.tokenizer, answer, stop_ids=stops) if self.tokenizer is not None else ""
            reason = seq.finish_reason or ("stop" if cut is not None else "length")
            at = self._stop_string_at(seq, body, answer) if self.tokenizer is not None else None
            if at is not None:
                body, reason = body[:at], "stop"
            outputs.append(CompletionOutput(index=seq.index, text=body, token_ids=answer, all_token_ids=generated,
                                            finish_reason=reason if seq.is_finished else None, nfe=seq.stats.nfe,
                                            tokens_per_step=list(seq.stats.tokens_per_step), error=seq.error,
                                            draft=self._draft(seq) if seq.drafts else None,
                                            logprobs=self._logprobs(seq, len(answer))))
        arrival, finished = seqs[0].arrival_time, all(s.is_finished for s in seqs)
        first = min((s.first_final_time for s in seqs if s.first_final_time is not None), default=None)
        done = max((s.finish_time for s in seqs if s.finish_time is not None), default=None) if finished else None
        metrics = {"arrival_time": arrival, "first_token_time": first,
                   "time_to_first_token": None if first is None else first - arrival, "finish_time": done,
                   "latency": None if done is None else done - arrival, "preemptions": sum(s.preemptions for s in seqs)}
        if finished:
            del self.requests[request_id]
        return RequestOutput(request_id=request_id, prompt=text, prompt_token_ids=ids, outputs=outputs,
                             finished=finished, metrics=metrics)
