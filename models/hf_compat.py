"""The one place that knows how transformers names the KV cache, on every version in the tested range.

transformers 5.24 renamed the cache keyword of model forwards, layers and mask helpers, and the
cache field of model outputs, from `past_key_values` to `cache` (the old name warns, and is removed
in 5.40); 5.23 and older know only `past_key_values`. remask binds by what the installed code
declares — the parameter names of the function it calls, the fields of the output class — never by
comparing version strings, so a backport or a later rename of one function is followed too.

It also holds `swapped_setting`: a config's implementation setting (`_attn_implementation`,
`_experts_implementation`) set to one remask registered with transformers for the forwards inside, shared by
threads and restored when the last leaves (the engine's paged attention, DiffusionGemma's `CanvasRows`).

remask's own model families (LLaDA, Dream, SDAR, LLaDA2, Fast-dLLM v2) keep the official remote
code's `past_key_values` keyword in their `forward`; `cache_arg(model.forward, cache)` gives each
callee the name it declares, whichever family it is.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import threading
from typing import Any, Callable, Iterator

CACHE_NAMES = ("cache", "past_key_values")   # the current name first


@functools.lru_cache(maxsize=None)
def output_cache_field() -> str:
    """The name of the cache field of transformers' model outputs (`cache` or `past_key_values`)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    names = {field.name for field in dataclasses.fields(CausalLMOutputWithPast)}
    return next(name for name in CACHE_NAMES if name in names)


@functools.lru_cache(maxsize=256)
def _cache_parameter(fn: Callable) -> str:
    # inspect.signature follows `__wrapped__`, so transformers' `deprecate_kwarg` wrappers report
    # the wrapped function's own parameters (the current name), not the deprecated alias.
    parameters = inspect.signature(fn).parameters
    for name in CACHE_NAMES:
        if name in parameters:
            return name
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        # a forward that takes `**kwargs` only (a wrapper): the name of the installed transformers,
        # which renamed its outputs' field in the same release as its keywords
        return output_cache_field()
    raise TypeError(f"{getattr(fn, '__qualname__', fn)} takes no KV cache argument "
                    f"(none of {', '.join(CACHE_NAMES)} in its signature)")


def cache_parameter(fn: Callable) -> str:
    """The name under which `fn` takes the KV cache, read from its signature."""
    # bound methods are new objects at each attribute access: key the cache on the function
    return _cache_parameter(getattr(fn, "__func__", fn))


@functools.lru_cache(maxsize=256)
def _takes_logits_to_keep(fn: Callable) -> bool:
    return "logits_to_keep" in inspect.signature(fn).parameters


def takes_logits_to_keep(fn: Callable) -> bool:
    """Whether the forward `fn` takes transformers' `logits_to_keep` (only the last positions' logits)."""
    return _takes_logits_to_keep(getattr(fn, "__func__", fn))


def cache_arg(fn: Callable, cache: Any) -> dict[str, Any]:
    """`{name: cache}` with the cache keyword `fn` declares: `fn(x, **cache_arg(fn, cache))`."""
    return {cache_parameter(fn): cache}


def dynamic_cache(model: Any) -> Any:
    """A new, empty KV cache of the kind `model`'s forward makes itself when given none (transformers'
    `DynamicCache` for its config)."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def output_cache(output: Any) -> Any:
    """The KV cache a model output carries (None when it has none), under either name."""
    return getattr(output, output_cache_field(), None)


def lm_output(**fields: Any):
    """transformers' `CausalLMOutputWithPast` with `cache=` stored under the installed field name."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return CausalLMOutputWithPast(**with_cache_field(fields))


def with_cache_field(fields: dict[str, Any]) -> dict[str, Any]:
    """`fields` with its `cache` entry renamed to the installed output field name (for output
    classes derived from transformers' `ModelOutput`)."""
    fields = dict(fields)
    if "cache" in fields:
        fields[output_cache_field()] = fields.pop("cache")
    return fields


_SWAP_LOCK = threading.Lock()
_SWAPPED: dict[tuple[int, str], list[Any]] = {}   # (id(config), attribute) → [threads inside, the value it had]


@contextlib.contextmanager
def swapped_setting(configs: list[Any], attribute: str, value: str) -> Iterator[None]:
    """Set `attribute` (`_attn_implementation`, `_experts_implementation`) of each config to `value` (an
    implementation registered with transformers) inside, restoring it when the last thread inside leaves: the
    server's engines, each on its thread, may share a model."""
    with _SWAP_LOCK:
        for config in configs:
            held = _SWAPPED.setdefault((id(config), attribute), [0, getattr(config, attribute)])
            held[0] += 1
            setattr(config, attribute, value)
    try:
        yield
    finally:
        with _SWAP_LOCK:
            for config in configs:
                held = _SWAPPED[(id(config), attribute)]
                held[0] -= 1
                if held[0] == 0:
                    setattr(config, attribute, _SWAPPED.pop((id(config), attribute))[1])


def own_setting(config: Any, attribute: str) -> Any:
    """`config`'s `attribute` as it was before `swapped_setting` (what an implementation registered in its place
    runs where its thread has no work of its own)."""
    with _SWAP_LOCK:
        held = _SWAPPED.get((id(config), attribute))
        return getattr(config, attribute) if held is None else held[1]
