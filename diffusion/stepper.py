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
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Generator, Iterator

import torch

from .stats import GenerationStats


@dataclass
class Progress:
    """What a step generator reports after a forward: `x` the canvas `[B, P + L]` as it stands
    (prompt included; masks where undecided), `final` how many generated positions (from the
    prompt's end) no later step changes — whole decoded blocks."""

    x: torch.Tensor
    final: int = 0


@dataclass(eq=False)
class ForwardRequest:
    """One model forward a decoder asks for, as data.

    * `input_ids` `[B, T]`: the tokens to run (None with `inputs_embeds` in `per_row`).
    * `per_row`: model inputs with one entry per batch row on dim 0 (a dim 0 of 1 broadcasts):
      `position_ids`, `attention_mask` (2-D padding or 4-D per-query), `attention_bias`,
      `inputs_embeds`. The attention layout — bidirectional, block-causal or causal — is the
      model's, narrowed by these masks.
    * `shared`: inputs the same for every row (`cache_position`, `block_size`, ...).
    * `cache`: the K/V it reads and writes back (`past_key_values`): prefix / dual / paged /
      retention / the methods' own caches; a cache class that can serve several requests in one
      call says so with `pack_key()` and `pack(members)` (`remask.caches`).
    * `spec`: answer with `spec.logits` (the family's logit shift); None: the raw `.logits`.
    * `rows`: the slice of positions whose logits it wants (None: all).
    * `rows_alone`: each batch row's linears are computed as that row alone (drafts that must get
      the bits of the single-sequence forward; the engine's batch invariance gives it for free).
    * `context`: a mode of the method's own around the call (FreeDave's tree attention); such a
      request runs alone.
    * `output`: "logits", or "model" for the whole model output (its `past_key_values`).
    """

    input_ids: torch.Tensor | None
    per_row: dict[str, torch.Tensor] = field(default_factory=dict)
    shared: dict[str, Any] = field(default_factory=dict)
    cache: Any = None
    spec: Any = None
    rows: slice | None = None
    rows_alone: bool = False
    context: Callable[[], ContextManager] | None = None
    output: str = "logits"

    @classmethod
    def call(cls, input_ids: torch.Tensor | None, inputs: dict[str, Any], **fields: Any) -> "ForwardRequest":
        """The request for ``model(input_ids, **inputs, **shared)``: `inputs`' tensors with a batch
        dim are per row, the rest shared; `fields` are the request's fields (`cache`, `spec`,
        `rows`, ...) and further shared inputs (`cache_position=...`)."""
        own = {name: fields.pop(name) for name in list(fields) if name in cls.__dataclass_fields__}
        per_row = {k: v for k, v in inputs.items() if torch.is_tensor(v) and v.dim() > 1}
        shared = {k: v for k, v in inputs.items() if k not in per_row}
        return cls(input_ids, per_row=per_row, shared={**shared, **fields}, **own)

    @property
    def batch(self) -> int:
        x = self.input_ids if self.input_ids is not None else self.per_row["inputs_embeds"]
        return x.shape[0]

    def pack_key(self) -> tuple | None:
        """Equal for requests one model call can serve row by row as each alone; None: alone."""
        if self.context is not None or self.output != "logits":
            return None
        cache_key = None
        if self.cache is not None:
            key = getattr(self.cache, "pack_key", None)
            cache_key = key() if key is not None else None
            if cache_key is None:
                return None
        x = self.input_ids if self.input_ids is not None else self.per_row["inputs_embeds"]
        shared = []
        for name, value in sorted(self.shared.items()):
            if torch.is_tensor(value):
                if value.is_cuda or value.numel() > 4096:
                    return None      # compared by value only where that costs no device sync
                value = (tuple(value.shape), tuple(value.flatten().tolist()))
            shared.append((name, value))
        per_row = tuple((name, tuple(v.shape[1:]), v.dtype) for name, v in sorted(self.per_row.items()))
        return (tuple(x.shape[1:]), x.dtype, self.input_ids is None, self.spec is not None, self.rows,
                per_row, tuple(shared), cache_key)


StepGenerator = Generator["ForwardRequest | Progress", Any, Any]


def _call(model: torch.nn.Module, request: ForwardRequest, input_ids: torch.Tensor | None,
          per_row: dict[str, torch.Tensor], cache: Any) -> Any:
    kwargs = {**per_row, **request.shared}
    if cache is not None:
        kwargs["past_key_values"] = cache
    if request.output == "model":
        return model(input_ids, **kwargs)
    if request.spec is not None:
        logits = request.spec.logits(model, input_ids, **kwargs)
    else:
        logits = model(input_ids, **kwargs).logits
    return logits if request.rows is None else logits[:, request.rows]


@torch.no_grad()
def run_forwards(model: torch.nn.Module, requests: list[ForwardRequest],
                 invariant: Callable[[int], ContextManager] | None = None) -> list[Any]:
    """Answer `requests` (one `pack_key`, or a single one) with ONE model call: their rows are
    stacked along the batch, each cache joins the call through its class's `pack`, and each gets
    back its own rows. `invariant(rows)`: the runner's batch-invariance context; without it (the
    drop-in driver) a `rows_alone` request of several rows runs its linears row by row."""
    head = requests[0]
    sizes = [r.batch for r in requests]
    if len(requests) == 1:
        input_ids, per_row, cache = head.input_ids, head.per_row, head.cache
    else:
        input_ids = None if head.input_ids is None else torch.cat([r.input_ids for r in requests])
        per_row = {name: torch.cat([r.per_row[name].expand(n, *r.per_row[name].shape[1:])
                                    for r, n in zip(requests, sizes)]) for name in head.per_row}
        cache = None if head.cache is None else type(head.cache).pack([r.cache for r in requests], sizes)
    rows = sum(sizes)
    if invariant is not None:
        context = invariant(rows)
    elif any(r.rows_alone for r in requests) and rows > 1:
        from remask.engine.batch_invariant import batch_invariant_linear
        context = batch_invariant_linear(True, single_thread=False)
    else:
        context = contextlib.nullcontext()
    with context, (head.context() if head.context is not None else contextlib.nullcontext()):
        out = _call(model, head, input_ids, per_row, cache)
    if len(requests) == 1:
        return [out]
    return list(torch.split(out, sizes))


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
        if isinstance(item, ForwardRequest):
            if model is None:
                raise RuntimeError("drive(steps, model): the generator asked for a forward and no model was given")
            answer = run_forwards(model, [item])[0]
        else:
            answer = None


def drive_packed(model: torch.nn.Module, forwards: list[Generator[ForwardRequest, Any, Any]]) -> list[Any]:
    """Run one forward of each of several sub-generators (one `pack_key`) as one model call and
    return what each returns (the block decoders' shared forwards in the engine)."""
    requests = [next(f) for f in forwards]
    results = []
    for f, answer in zip(forwards, run_forwards(model, requests)):
        try:
            f.send(answer)
        except StopIteration as stop:
            results.append(stop.value)
        else:
            raise RuntimeError("a packed forward asked for a second forward")
    return results


@dataclass(eq=False)
class StepwiseState:
    """One engine request under a `StepwiseDecoder`: the generator (made at its first step, with
    the request's generator and stats), its pending forward, the canvas so far and what of it is
    final."""

    prompt: torch.Tensor
    x: torch.Tensor
    prompt_len: int
    gen_length: int
    steps: Iterator[Any] | None = None
    pending: ForwardRequest | None = None
    final: int = 0
    done: bool = False
    # The generator's own counts (it starts and stops them as the drop-in call does); each step
    # adds what it counted to the engine's stats, which time the request themselves.
    counted: GenerationStats = field(default_factory=GenerationStats)


class StepwiseDecoder:
    """The engine's decoder for a method written as a step generator. `make_steps(model, prompt,
    generator, stats)` starts the method's loop on one request (its prompt `[1, P]` alone, so its
    tokens are the drop-in function's on that prompt).

    The runner asks `next_forward` for the request's pending `ForwardRequest` (None once it is
    done), computes it with the other requests' (`run_forwards`), and hands the logits back with
    `receive`, which runs the method's commit up to its next forward: one forward per engine step."""

    def __init__(self, make_steps: Callable[[torch.nn.Module, torch.Tensor, torch.Generator | None,
                                             GenerationStats], StepGenerator], *, gen_length: int,
                 name: str = "") -> None:
        self.make_steps, self.gen_length, self.name = make_steps, gen_length, name

    def start(self, model: torch.nn.Module, input_ids: torch.Tensor) -> StepwiseState:
        return StepwiseState(prompt=input_ids, x=input_ids, prompt_len=input_ids.shape[1], gen_length=self.gen_length)

    def num_final(self, state: StepwiseState) -> int:
        return self.gen_length if state.done else state.final

    def next_forward(self, model: torch.nn.Module, state: StepwiseState, generator: torch.Generator | None = None,
                     stats: GenerationStats | None = None) -> ForwardRequest | None:
        if state.steps is None:
            state.steps = self.make_steps(model, state.prompt, generator, state.counted)
            self._advance(state, None, stats)
        return state.pending

    def receive(self, state: StepwiseState, logits: Any, stats: GenerationStats | None = None) -> None:
        self._advance(state, logits, stats)

    def _advance(self, state: StepwiseState, answer: Any, stats: GenerationStats | None) -> None:
        """Send `answer` and run the generator to its next forward (or its end)."""
        counted = state.counted
        nfe, positions, commits = counted.nfe, counted.forward_positions, counted.num_steps
        state.pending = None
        try:
            while True:
                item = state.steps.send(answer)
                answer = None
                if isinstance(item, ForwardRequest):
                    state.pending = item
                    break
                state.x, state.final = item.x, max(state.final, item.final)
        except StopIteration as stop:
            if stop.value is None:
                raise RuntimeError(f"{self.name or 'a step generator'} returned no output") from None
            state.x, state.final, state.done = stop.value, self.gen_length, True
        if stats is not None:
            stats.nfe += counted.nfe - nfe
            stats.forward_positions += counted.forward_positions - positions
            stats.add_steps(counted, commits)
            stats.kv_cache_bytes = max(stats.kv_cache_bytes, counted.kv_cache_bytes)

    def step(self, model: torch.nn.Module, state: StepwiseState, generator: torch.Generator | None = None,
             stats: GenerationStats | None = None) -> None:
        """One forward of this request alone and what follows it (the runner packs instead)."""
        request = self.next_forward(model, state, generator, stats)
        if request is not None:
            self.receive(state, run_forwards(model, [request])[0], stats)

    def __repr__(self) -> str:
        return f"StepwiseDecoder({self.name})"
