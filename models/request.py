"""`ForwardRequest`: one model forward a decoder asks for, as data — the seam between decoding and the
models (docs/architecture.md, "The protocol"). It lives with the models so that a model family can
describe its own forwards as requests (DiffusionGemma's encoder and decoder passes); every decoder
builds them, and the drivers (`remask.diffusion.parts.stepper`) answer them, alone or packed.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch


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
      retention / the methods' own caches. Any cache with an `attend` joins a packed forward: it
      attends its own request's rows as in that request's own forward (`varlen.PackedAttention`).
    * `spec`: answer with `spec.logits` (the family's logit shift); None: the raw `.logits`.
    * `rows`: the slice of positions whose logits it wants (None: all).
    * `rows_alone`: each batch row's linears are computed as that row alone (drafts that must get
      the bits of the single-sequence forward; the engine's batch invariance gives it for free).
    * `layers`: work of its own between the model's layers (Elastic-Cache: `before(layer, h)` →
      the rows the layer runs on and their RoPE tables, `after(layer)`; the driver finds the layers
      through `ModelSpec.layers`); one row, a segmented model; it packs with the others (`varlen.PackedLayers`).
    * `output`: "logits", or "model" for the whole model output (its `past_key_values`; a stacked call's
      output is the call's, each request's cache written in place).
    * `module`: a model other than the driver's to call (APD's verifier, DiffusionGemma's encoder); such a
      request runs alone, unless it `extends` or its cache stacks.
    * `extends`: a causal continuation (autoregressive): `input_ids` follow every id fed before, whose
      K/V are the model's own cache in `cache` (the drop-in driver; the engine's for a `module`'s) or
      the engine's page store. The answer holds the last position's logits (`rows` None) or those of
      `rows`; the engine's runner answers all such requests of one model in one flat forward, as
      `output="model"` (with its cache for a `module`'s).
    """

    input_ids: torch.Tensor | None
    per_row: dict[str, torch.Tensor] = field(default_factory=dict)
    shared: dict[str, Any] = field(default_factory=dict)
    cache: Any = None
    spec: Any = None
    rows: slice | None = None
    rows_alone: bool = False
    layers: Any = None
    output: str = "logits"
    module: Any = None
    extends: bool = False

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
        if self.input_ids is not None:
            return self.input_ids.shape[0]
        return max(t.shape[0] for t in self.per_row.values())   # inputs_embeds, or an encoder-decoder's canvas

    @property
    def stacks(self) -> bool:
        """Its cache's class packs several requests' caches into one (`pack_key()` and the
        classmethod `pack(members, sizes)`: a `BlockBatch`): such requests go the stacked route."""
        return self.cache is not None and hasattr(type(self.cache), "pack") and hasattr(self.cache, "pack_key")

    def pack_key(self) -> tuple | None:
        """Equal for requests that one packed forward can serve, each as alone (`run_forwards`);
        None: this one runs alone (another model, the whole output wanted, inputs the packed
        forward does not take). A request whose cache packs (`stacks`) gets a stacked key
        (`stacked_key`), which models without the flat route (not `spec.segmented`) take too."""
        if self.stacks:
            return stacked_key(self)
        if self.output != "logits" or self.module is not None:
            return None
        if not set(self.per_row) <= PACKED_PER_ROW or not set(self.shared) <= PACKED_SHARED:
            return None
        if isinstance(self.shared.get("attention_mask"), torch.Tensor):
            return None
        if self.cache is not None and not hasattr(self.cache, "attend"):
            return None
        if self.input_ids is None:
            embeds = self.per_row["inputs_embeds"]
            return ("embeds", embeds.dtype, embeds.shape[-1])
        return ("ids",)


class ScopedCache:
    """A cache argument the model call must run inside `forward_scope(model)` of (transformers' attention and
    experts set to implementations that answer each request of a stacked call through its own cache:
    DiffusionGemma's `CanvasRows`). The drivers enter it around every call they pass the cache to."""

    def forward_scope(self, model: Any) -> contextlib.AbstractContextManager:
        raise NotImplementedError


def cache_scope(cache: Any, model: Any) -> contextlib.AbstractContextManager:
    """The context the model call with `cache` runs in: its `forward_scope`, or none."""
    return cache.forward_scope(model) if isinstance(cache, ScopedCache) else contextlib.nullcontext()


# What a packed forward takes: per-row positions and masks (each request's own, through its
# segment), a shared cache position, the string masks ("full").
PACKED_PER_ROW = frozenset({"position_ids", "attention_mask", "attention_bias", "inputs_embeds"})
PACKED_SHARED = frozenset({"cache_position", "attention_mask"})


def stacked_key(request: ForwardRequest) -> tuple | None:
    """The stacked route's key: requests whose caches pack (`ForwardRequest.stacks`; equal
    `cache.pack_key()`), whose inputs stack (the same shapes and dtypes past the batch dim, the
    same shared inputs) and whose rows are each computed as alone (one row, or `rows_alone`) run
    as ONE call on their rows stacked (`_stacked`). None: it runs alone."""
    if request.batch > 1 and not request.rows_alone:
        return None
    if any(torch.is_tensor(v) for v in request.shared.values()):
        return None
    shared = tuple(sorted(request.shared.items()))
    try:
        hash(shared)
    except TypeError:
        return None
    inputs = {"input_ids": request.input_ids, **request.per_row}
    shapes = tuple((name, tuple(t.shape[1:]), t.dtype, t.device) for name, t in sorted(inputs.items()) if t is not None)
    return ("stacked", type(request.cache), request.cache.pack_key(), id(request.module), request.output, shapes,
            shared)
