"""The step protocol: a decoder describes each forward it needs, a driver computes it.

A method's loop (`freedave_steps`, `dinfer_steps`, `wino_steps`, `dkv_steps`, …) is a Python
generator. For every model forward it yields a `ForwardRequest` and receives the logits:
``logits = yield ForwardRequest(x, ...)``; between forwards it may yield a `Progress` (the canvas
so far) and at the end it returns its output. No decoder calls the model. Two drivers answer the
requests, so their tokens are the same by construction:

* `drive(steps, model)` — the drop-in functions: each request computed alone (`run_forwards`);
* `StepwiseDecoder` + the engine's `ModelRunner` — one request per engine step and request; the
  runner packs the requests of every running sequence whose layouts agree (`ForwardRequest.pack_key`)
  into one model call (`run_forwards` over the group) and hands each its own rows.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Concatenate, ContextManager, Generator, Iterator, ParamSpec, Sequence

import torch

from remask.models.hf_compat import cache_arg, takes_logits_to_keep
from remask.models.request import ForwardRequest, cache_scope  # the requests' module (also here for the drivers)
from remask.models.spec import ModelSpec, get_spec, shift_logits

from .constrain_loops import structure_for_call
from .protocol import Decoder, Together, answer_alone, answer_together
from .stats import GenerationStats


@dataclass
class Progress:
    """What a step generator reports after a forward: `x` the canvas `[B, P + L]` as it stands
    (prompt included; masks where undecided), `final` how many generated positions (from the
    prompt's end) no later step changes — whole decoded blocks."""

    x: torch.Tensor
    final: int = 0


StepGenerator = Generator["ForwardRequest | Progress | Together", Any, Any]
Settings = ParamSpec("Settings")   # a step generator's parameters after the spec (`drop_in`)


def call_model(model: torch.nn.Module, request: ForwardRequest, input_ids: torch.Tensor | None,
               per_row: dict[str, torch.Tensor] | None = None, cache: Any = None) -> Any:
    """The model call of `request` on `input_ids` (a CUDA graph's body replays it on its static input)."""
    kwargs = {**(per_row or {}), **request.shared}
    if cache is not None:   # under the keyword the forward declares (`cache` or `past_key_values`)
        kwargs.update(cache_arg(model.forward, cache))
    if request.extends and request.rows is None and takes_logits_to_keep(model.forward):
        # only the last position's logits, as transformers' `generate` and the engine's runner
        kwargs["logits_to_keep"] = 1
    with cache_scope(cache, model):
        out = model(input_ids, **kwargs)
    return out if request.output == "model" else _own(request, out.logits)   # shifted as `ModelSpec.logits` shifts


@torch.no_grad()
def run_forwards(model: torch.nn.Module, requests: list[ForwardRequest],
                 invariant: Callable[..., ContextManager] | None = None, spec: ModelSpec | None = None,
                 varlen: bool = False) -> list[Any]:
    """Answer `requests` (one `pack_key`, or a single one) with ONE model call, each with what its
    own forward gives it. Several go into one flat forward `[1, N]` (`_packed`), or, where their
    caches pack (`ForwardRequest.stacks`), into one call on their rows stacked (`_stacked`); `invariant(rows,
    token_groups)`: the runner's batch-invariance context. Without it (the drop-in driver) a
    `rows_alone` request of several rows runs its linears row by row. `spec`: `model`'s, where the caller holds it.
    `varlen`: a segmented model's attention through `varlen_attention` (`varlen.PackedAttention`), a packable
    request alone as a pack of one, so that its bits do not depend on having batch-mates."""
    request = requests[0]
    alone_packed = varlen and len(requests) == 1 and request.pack_key() is not None
    if len(requests) > 1 or request.layers is not None or alone_packed:
        spec = spec or get_spec(model)
        if request.stacks:
            return _stacked(model, requests, invariant, varlen)
        if spec.segmented or not alone_packed:
            return _packed(model, requests, invariant, spec, varlen)
    if invariant is not None:
        context = invariant(request.batch if request.rows_alone else 1)
    elif request.rows_alone and request.batch > 1:
        from remask.kernels.batch_invariant import batch_invariant_linear
        context = batch_invariant_linear(True, single_thread=False)
    else:
        context = contextlib.nullcontext()
    with context:
        return [call_model(request.module if request.module is not None else model, request, request.input_ids,
                           request.per_row, request.cache)]


def _packed(model: torch.nn.Module, requests: list[ForwardRequest],
            invariant: Callable[..., ContextManager] | None, spec: ModelSpec, varlen: bool = False
            ) -> list[torch.Tensor]:
    """Requests of different lengths, caches and masks in one flat forward: each request's rows
    one after another, RoPE at the positions its own forward uses, its attention through its own
    cache and mask (`varlen.PackedAttention`), its linears the GEMM problems its own forward poses
    (`token_groups`: one of rows × length, or one per row with `rows_alone`)."""
    from remask.models.layers import cache_span

    from .varlen import PackedAttention, PackedLayers, Segment, token_groups

    if not spec.segmented:
        raise ValueError(f"the {spec.kind!r} model does not run packed forwards (spec.segmented is False)")
    param = next(model.parameters())
    segments, inputs, positions, start = [], [], [], 0
    for r in requests:
        x = r.input_ids if r.input_ids is not None else r.per_row["inputs_embeds"]
        B, T = x.shape[:2]
        cache_position, cache_start, end, past_len = cache_span(r.cache, T, x.device, r.shared.get("cache_position"))
        pos = r.per_row.get("position_ids")
        positions.append((cache_position[None] if pos is None else pos).expand(B, T).reshape(1, -1))
        masks = {k: v for k, v in (*r.per_row.items(), *r.shared.items()) if k in ("attention_mask", "attention_bias")}
        k_len = max(past_len, end) if r.cache is not None else T
        mask = spec.attend_mask(masks, T, k_len, param.dtype) if masks else None
        segments.append(Segment(start, B, T, r.cache, cache_start, mask))
        inputs.append(x.reshape(1, B * T, *x.shape[2:]))
        start += B * T
    flat = torch.cat(inputs, dim=1)
    ids, embeds = (flat, {}) if requests[0].input_ids is not None else (None, {"inputs_embeds": flat})
    # on CUDA, under batch invariance, no request's attention is batched with another's (SDPA's split)
    attend = PackedAttention(segments, batch_calls=invariant is None or flat.device.type != "cuda", varlen=varlen)
    kwargs = dict(position_ids=torch.cat(positions, dim=1), past_key_values=attend)
    groups = token_groups(segments, [r.rows_alone for r in requests], flat.device)
    context = invariant(sum(s.rows for s in segments), groups) if invariant is not None else contextlib.nullcontext()
    with context as linear:
        # requests with work of their own between the model's layers (`layers`): the layout may change per layer
        hooks = PackedLayers(requests, attend, getattr(linear, "regroup", None)).installed(spec.layers(model)) \
            if any(r.layers is not None for r in requests) else contextlib.nullcontext()
        with hooks:
            logits = model(ids, **embeds, **kwargs).logits[0]
    return [_own(r, logits[s.start:s.end].view(s.rows, s.length, -1)) for r, s in zip(requests, attend.segments)]


def _stacked(model: torch.nn.Module, requests: list[ForwardRequest],
             invariant: Callable[..., ContextManager] | None, varlen: bool = False) -> list[torch.Tensor]:
    """Requests of one `stacked_key` in one call on their rows stacked `[ΣB, T]` (non-segmented
    models: SDAR, LLaDA2, Fast-dLLM v2): the call's cache is `type(cache).pack(caches, batches)`,
    through which each row attends over its own request's cache as in that request's own forward;
    each row's linears are the problem it poses alone (`invariant(rows)`: the runner's batch
    invariance). Each request gets its rows, shifted by its `spec`, cut to its `rows`. `varlen`: the packed
    cache's (`PackedRows.varlen`)."""
    head = requests[0]
    sizes = [r.batch for r in requests]
    ids = None if head.input_ids is None else torch.cat([r.input_ids for r in requests])
    per_row = {name: torch.cat([r.per_row[name].expand(r.batch, *r.per_row[name].shape[1:]) for r in requests])
               for name in head.per_row}
    cache = type(head.cache).pack([r.cache for r in requests], sizes, varlen)
    model = head.module if head.module is not None else model
    with invariant(sum(sizes)) if invariant is not None else contextlib.nullcontext(), cache_scope(cache, model):
        out = model(ids, **per_row, **head.shared, **cache_arg(model.forward, cache))
    if head.output == "model":   # the call's output (each request's own cache was written in place)
        return [out] * len(requests)
    return [_own(r, own) for r, own in zip(requests, out.logits.split(sizes))]


def _own(request: ForwardRequest, logits: torch.Tensor) -> torch.Tensor:
    """A request's answer from its own rows' logits (its own call's, or a shared call's): shifted by its `spec`
    within each row (as `ModelSpec.logits` shifts), cut to its `rows`."""
    if request.spec is not None and request.spec.logit_shift:
        logits = shift_logits(logits)
    return logits if request.rows is None else logits[:, request.rows]


def guided_forward(spec: Any, x: torch.Tensor, un_x: torch.Tensor, forward_inputs: dict[str, Any],
                   cfg_scale: float) -> Generator[ForwardRequest, Any, torch.Tensor]:
    """LLaDA's unsupervised CFG, `un + (cfg+1)(cond − un)`: one forward of the rows `x` and their
    unconditional rows `un_x` (the prompt masked) stacked, `forward_inputs` repeated for both."""
    doubled = {k: torch.cat([v, v], dim=0) if torch.is_tensor(v) else v for k, v in forward_inputs.items()}
    logits, un_logits = torch.chunk((yield ForwardRequest.call(torch.cat([x, un_x], dim=0), doubled, spec=spec)),
                                    2, dim=0)
    return un_logits + (cfg_scale + 1) * (logits - un_logits)


def run_steps(model: torch.nn.Module, steps_of: Callable[..., StepGenerator], *args: Any, **kwargs: Any) -> Any:
    """`drive` the step generator `steps_of(spec, *args, **kwargs)` on `model` (the drop-in functions): the
    decoder gets the model's spec (`get_spec`), never the model; the driver answers its forwards."""
    return drive(steps_of(get_spec(model), *args, **kwargs), model)


def drop_in(steps_of: Callable[Concatenate[ModelSpec, Settings], StepGenerator],
            hidden: tuple[str, ...] = ("structure", "end_ids"), structured: str | None = None
            ) -> Callable[[Callable[..., Any]], Callable[Concatenate[torch.nn.Module, Settings], Any]]:
    """A decorator making a method's drop-in function from its step generator: `fn(model, ...)` is
    `run_steps(model, steps_of, ...)`. Its arguments are `steps_of`'s, the model in place of the spec, less
    `hidden` (structured output's, which the drop-in functions leave to their callers), bound (and refused) by
    that signature at the call; its name, docstring and return annotation are the decorated function's. Type
    checkers see the same parameters (`Settings`, the step generator's after the spec). `structured` (the name of
    the answer's length among them): the function also takes `structured_outputs` and `tokenizer` (keyword-only,
    last), compiled at the call before anything else (`structure_for_call` against the model's mask id, its
    `mask_id` argument overriding, and that length) into `steps_of`'s `structure`."""
    def wrap(fn: Callable) -> Callable:
        first, *rest = inspect.signature(steps_of).parameters.values()
        added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation="Any")
                 for name in ("structured_outputs", "tokenizer") if structured is not None]
        signature = inspect.Signature([first.replace(name="model", annotation="torch.nn.Module")]
                                      + [p for p in rest if p.name not in hidden] + added,
                                      return_annotation=inspect.signature(fn).return_annotation)

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            model, given = bound.args[0], bound.arguments
            compiled = {} if structured is None else {"structure": structure_for_call(   # before steps_of's checks
                given.pop("structured_outputs"), model, given.pop("tokenizer"),
                get_spec(model, mask_id=given.get("mask_id")).mask_id, given[structured])}
            return run_steps(model, steps_of, *bound.args[1:], **bound.kwargs, **compiled)

        call.__signature__ = signature
        return call
    return wrap


def drive(steps: StepGenerator, model: torch.nn.Module | None = None) -> Any:
    """Run a step generator to its end, answering each of its forwards alone, and return its output
    (the drop-in functions)."""
    answer = None
    while True:
        try:
            item = steps.send(answer)
        except StopIteration as stop:
            if stop.value is None:
                raise RuntimeError("a step generator must return its output tensor") from None
            return stop.value
        if isinstance(item, ForwardRequest) and model is None:
            raise RuntimeError("drive(steps, model): the generator asked for a forward and no model was given")
        answer = run_forwards(model, [item])[0] if isinstance(item, ForwardRequest) else \
            item.alone() if isinstance(item, Together) else None


def row_by_row(canvas: torch.Tensor, decode: Callable[..., StepGenerator], mask: torch.Tensor | None,
               stats: GenerationStats, generated: int, rows: list[slice] | None = None) -> StepGenerator:
    """Decode the `rows` of `canvas` (each row alone by default) one after another, where the reference
    decodes one prompt or couples a batch's rows: `decode(rows, mask)` is the step generator of
    `canvas[rows]` (`mask[rows]`, or None), which yields `Progress(its rows, final)` and returns them;
    each is written into the canvas, reported as the canvas's Progress (`final` on the last rows, 0
    before: later rows are not started). `stats` counts the `generated` positions; returns the canvas."""
    rows = [slice(b, b + 1) for b in range(canvas.shape[0])] if rows is None else rows
    stats.start()
    for rs in rows:
        steps, answer = decode(rs, None if mask is None else mask[rs]), None
        while True:
            try:
                item = steps.send(answer)
            except StopIteration as stop:
                canvas[rs] = stop.value
                break
            if isinstance(item, Progress):
                canvas[rs] = item.x
                item = Progress(canvas, item.final if rs is rows[-1] else 0)
            answer = yield item
    stats.stop(generated)
    return canvas


def step_alone(decoder: Decoder, model: torch.nn.Module, state: Any, generator: torch.Generator | None = None,
               stats: GenerationStats | None = None) -> None:
    """One step of a decoder (the drop-in loops): its next forward computed alone, then its `receive` of it."""
    request = decoder.next_forward(state, generator, stats)
    if request is not None:
        decoder.receive(state, run_forwards(model, [request])[0], generator, stats)


def decode_alone(decoder: Decoder, model: torch.nn.Module, state: Any, generator: torch.Generator | None = None,
                 stats: GenerationStats | None = None) -> Any:
    """`step_alone` until `state` is done (the drop-in functions); returns it."""
    while not state.done:
        step_alone(decoder, model, state, generator, stats)
    return state


class ForwardThenCommit(Decoder):
    """A decoder whose step is one forward then a commit: `_forward(state)` (a sub-generator of
    one `ForwardRequest`, returning `(logits, first fed position)`) and `commit(state, logits, fed,
    generator, stats)`. The runner asks `next_forward`, packs, and hands the logits to `receive`;
    the drop-in loops do the same alone (`step_alone`). Its state has `done` and `pending`."""

    def next_forward(self, state: Any, generator: torch.Generator | None = None,
                     stats: GenerationStats | None = None) -> ForwardRequest | None:
        if state.done:
            return None
        state.pending = self._forward(state)
        return next(state.pending)

    def finish_forward(self, state: Any, logits: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Hand the pending forward its logits: (the logits of the positions it computed, the first)."""
        try:
            state.pending.send(logits)
        except StopIteration as stop:
            state.pending = None
            return stop.value
        raise RuntimeError(f"{type(self).__name__}: one step asked for a second forward")

    processors: tuple = ()   # logits processors (`add_processor`), applied before `commit` scores

    def add_processor(self, processor: Any) -> "ForwardThenCommit":
        self.processors = (*self.processors, processor)
        return self

    def receive(self, state: Any, logits: torch.Tensor, generator: torch.Generator | None = None,
                stats: GenerationStats | None = None) -> None:
        logits, fed = self.finish_forward(state, logits)
        for processor in self.processors:
            logits = processor(state, logits, fed)
        self.commit(state, logits, fed, generator, stats)

    @staticmethod
    def receive_together(decoders: Sequence["ForwardThenCommit"], states: Sequence[Any], answers: Sequence[Any],
                         generators: Sequence[torch.Generator | None], stats: Sequence[GenerationStats | None]) -> None:
        if len(decoders) == 1:
            return decoders[0].receive(states[0], answers[0], generators[0], stats[0])
        # decoders of one `commit_key` (so without processors): one `commit_together`
        _commit_all([(d, s, *d.finish_forward(s, a), None, counts)
                     for d, s, a, counts in zip(decoders, states, answers, stats)])

    def commit_later(self, state: Any, logits: torch.Tensor, fed: int, generator: torch.Generator | None = None,
                     stats: GenerationStats | None = None) -> Together:
        """`commit(...)` as a step generator asks for it (`yield decoder.commit_later(...)`): batched with other
        requests' commits of its `commit_key` in the engine."""
        key = self.commit_key()
        return Together(None if key is None else (type(self), key), _commit_all, (self, state, logits, fed, generator,
                                                                                  stats))


def _commit_all(items: list[tuple]) -> list[None]:
    """`(decoder, state, logits, fed, generator, stats)` commits: one alone, several of one `commit_key` in one
    `commit_together(decoders, states, logits, fed, stats)` (which a decoder with a key has)."""
    decoders, states, logits, fed, generators, stats = zip(*items)
    if len(items) == 1:
        decoders[0].commit(states[0], logits[0], fed[0], generators[0], stats[0])
    else:
        type(decoders[0]).commit_together(decoders, states, logits, fed, stats)
    return [None] * len(items)


@dataclass(eq=False)
class StepwiseState:
    """One engine request under a `StepwiseDecoder`: the generator (made at its first step, with
    the request's generator and stats), its pending forward, the canvas so far and what of it is
    final."""

    prompt: torch.Tensor
    x: torch.Tensor
    prompt_len: int
    steps: Iterator[Any] | None = None
    pending: ForwardRequest | None = None
    final: int = 0
    done: bool = False
    # The generator's own counts (it starts and stops them as the drop-in call does); each step
    # adds what it counted to the engine's stats, which time the request themselves.
    counted: GenerationStats = field(default_factory=GenerationStats)
    error: Exception | None = None   # raised by its generator while receiving with others: failed at its next step


class StepwiseDecoder(Decoder):
    """The engine's decoder for a method written as a step generator. `make_steps(prompt, generator,
    stats)` starts the method's loop on one request (its prompt `[1, P]` alone, so its
    tokens are the drop-in function's on that prompt).

    The runner asks `next_forward` for the request's pending `ForwardRequest` (None once it is
    done), computes it with the other requests' (`run_forwards`), and hands the logits back with
    `receive`, which runs the method's commit up to its next forward: one forward per engine step."""

    def __init__(self, make_steps: Callable[[torch.Tensor, torch.Generator | None, GenerationStats], StepGenerator],
                 *, gen_length: int, name: str = "") -> None:
        self.make_steps, self.gen_length, self.name = make_steps, gen_length, name

    def start(self, input_ids: torch.Tensor) -> StepwiseState:
        return StepwiseState(prompt=input_ids, x=input_ids, prompt_len=input_ids.shape[1])

    def num_final(self, state: StepwiseState) -> int:
        return state.final

    def next_forward(self, state: StepwiseState, generator: torch.Generator | None = None,
                     stats: GenerationStats | None = None) -> ForwardRequest | None:
        if state.error is not None:
            raise state.error
        if state.steps is None:
            state.steps = self.make_steps(state.prompt, generator, state.counted)
            self.receive(state, None, generator, stats)
        return state.pending

    def receive(self, state: StepwiseState, logits: Any, generator: torch.Generator | None = None,
                stats: GenerationStats | None = None) -> None:
        """Send `logits` (None to start) and run the generator to its next forward (or its end), answering
        what it asks between them (`Together`) alone."""
        answer_alone(lambda answer: self._advance(state, answer, stats), logits)

    def commit_key(self) -> Any:
        return "steps"   # every step generator receives with the others: their `Together` work is gathered by key

    @staticmethod
    def receive_together(decoders: Sequence["StepwiseDecoder"], states: Sequence[StepwiseState],
                         answers: Sequence[Any], generators: Sequence[torch.Generator | None],
                         stats: Sequence[GenerationStats | None]) -> None:
        """Each generator run to its next forward, what they ask between (`Together`) done together by key
        (`answer_together`). A generator that raises fails alone (at its next step: `next_forward` raises it)."""
        def fail(i: int, err: Exception) -> None:
            states[i].error, states[i].pending = err, None

        answer_together(lambda i, answer: decoders[i]._advance(states[i], answer, stats[i]), answers, fail)

    def _advance(self, state: StepwiseState, answer: Any, stats: GenerationStats | None) -> Together | None:
        """Send `answer` and run the generator to its next forward, its end, or work it asks for (returned)."""
        counted = state.counted
        nfe, positions, commits = counted.nfe, counted.forward_positions, counted.num_steps
        state.pending, work = None, None
        try:
            item = state.steps.throw(answer) if isinstance(answer, Exception) else state.steps.send(answer)
            while isinstance(item, Progress):
                state.x, state.final = item.x, max(state.final, item.final)
                item = state.steps.send(None)
            if isinstance(item, Together):
                work = item
            else:
                state.pending = item
        except StopIteration as stop:
            if stop.value is None:
                raise RuntimeError(f"{self.name or 'a step generator'} returned no output") from None
            # what the method returned is final: `gen_length` positions, or fewer where the method's own
            # length is "at most" gen_length (DAEDAL's canvas)
            state.x, state.final, state.done = stop.value, stop.value.shape[1] - state.prompt_len, True
        if stats is not None:
            stats.nfe += counted.nfe - nfe
            stats.forward_positions += counted.forward_positions - positions
            stats.add_steps(counted, commits)
            stats.kv_cache_bytes = max(stats.kv_cache_bytes, counted.kv_cache_bytes)
        return work

    def __repr__(self) -> str:
        return f"StepwiseDecoder({self.name})"

