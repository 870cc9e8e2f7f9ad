"""The registry: every method that `decoder=` / `use_cache=` takes, by name, one line each.

A method is a name, a config dataclass (in the method's own file, checking its own values) and the
keyword it goes under. Everything that turns a name into a method looks here: the JSON form
`{"name": "freedave", ...}` of `SamplingParams`, the HTTP API and the CLI, the type checks and
their messages, docs/compatibility.md. Adding a method is its file plus one `register` line below
(docs/architecture.md, "Adding a method").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..parts.step import CommitRule
from .d2cache import D2Cache
from ..parts.rules import CreditDecoding, HierarchicalDecoding, ThresholdDecoding
from .dinfer import VicinityCache
from .dkv import DKVCache
from .elastic import ElasticCache
from .freedave import FreeDave
from .margin import MarginDecoding
from .wino import WINO

FIELDS = ("decoder", "use_cache")


@dataclass(frozen=True)
class Method:
    """One registered method: its JSON `name`, its `config` class and the keyword (`field`) it goes under."""

    name: str
    config: type
    field: str = "decoder"

    @property
    def is_rule(self) -> bool:
        """A commit rule: every loop that takes `decoder=` runs it (`CommitRule`)."""
        return issubclass(self.config, CommitRule)


METHODS: dict[str, Method] = {}


def register(name: str, config: type, field: str = "decoder") -> None:
    if field not in FIELDS:
        raise ValueError(f"field must be one of {FIELDS}, got {field!r}")
    if name in METHODS:
        raise ValueError(f"a method named {name!r} is registered already ({METHODS[name].config.__name__})")
    METHODS[name] = Method(name, config, field)


register("freedave", FreeDave)
register("threshold", ThresholdDecoding)
register("credit", CreditDecoding)
register("hierarchical", HierarchicalDecoding)
register("margin", MarginDecoding)
register("wino", WINO)
register("vicinity", VicinityCache, "use_cache")
register("dkv", DKVCache, "use_cache")
register("d2cache", D2Cache, "use_cache")
register("elastic", ElasticCache, "use_cache")


def names(field: str) -> dict[str, type]:
    """name → config class of the methods that go under `field` ("decoder" or "use_cache"), in registry order."""
    return {m.name: m.config for m in METHODS.values() if m.field == field}


def configs(field: str) -> tuple[type, ...]:
    return tuple(names(field).values())


def rules() -> tuple[type, ...]:
    """The registered commit rules."""
    return tuple(m.config for m in METHODS.values() if m.is_rule)


def is_config(field: str, value: Any) -> bool:
    return isinstance(value, configs(field))


def from_json(field: str, value: dict) -> Any:
    """A config from its JSON form `{"name": "freedave", "draft_steps": 4}`; errors name the field
    (`decoder.name`, `decoder (freedave): ... unexpected keyword ...`)."""
    known = names(field)
    settings = dict(value)
    name = settings.pop("name", None)
    if name not in known:
        raise ValueError(f"{field}.name must be one of {sorted(known)}, got {name!r}")
    try:
        return known[name](**settings)
    except TypeError as err:   # an unknown field
        raise ValueError(f"{field} ({name}): {err}") from None
