"""Model specs: everything a sampler needs to know about a model, found from its config.

A sampler never branches on the model type. It asks the spec for the special ids, for the
model's forward inputs given a padding mask (`forward_inputs`), and for logits aligned so that
row i predicts token i (`logits`; Dream's one-position shift lives here and nowhere else).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class ModelSpec:
    """Special ids and conventions of one model.

    kind: "llada", "dream" or "ar". logit_shift: position i is predicted from hidden state i−1
    (Dream). attention: ``"bidirectional"``, ``"causal"`` or ``"block-causal"`` (causal across
    blocks, bidirectional inside one). vocab_size: width of the logits.
    max_length: the longest sequence the model accepts (None: unknown). trained_gen_length: the
    longest answer the model was trained to produce, where its config declares one
    (`config.trained_gen_length`, remask's tiny models); the samplers warn beyond it.
    noise: how positions are corrupted — ``"mask"`` (a mask token: LLaDA, Dream) or ``"uniform"``
    (random tokens re-drawn from the vocabulary: DiffusionGemma; `mask_id` is None). layout:
    ``"decoder-only"`` or ``"encoder-decoder"`` (an encoder writes the cache, a decoder denoises a
    canvas against it). block_length: the model's fixed canvas, where it has one.
    segmented: the model attends through the KV-cache seam (`cache.attend`) and takes
    `position_ids`, so one flat forward `[1, ΣT]` can hold several sequences, each attending only
    to itself (`remask.diffusion.parts.varlen`). attend_mask: `(inputs, q_len, k_len, dtype)` → the
    mask its layers attend with, from a forward's mask inputs (`attention_mask`, `attention_bias`),
    so a packed forward gives each sequence the mask its own forward would. layers: `model` → its
    decoder blocks, for a driver that runs a request's work between them (`ForwardRequest.layers`).
    thread_sensitive: its forward's bits on CPU depend on the intra-op thread count (measured), so the
    engine runs even a lone request's forward on one thread, as it runs a batched one.

    What a decoder needs of the model itself comes here, set by `get_spec` (decoders are never handed
    the model): `device` (its parameters'), `config` (its config's values), `embeddings` (its input
    embedding table, None where it has none) and `encoder` (an encoder-decoder model's encoder,
    transformers' `get_encoder()`, whose forward DiffusionGemma's canvas loop requests; None otherwise).
    """

    kind: str
    mask_id: int | None
    eos_id: int | None
    pad_id: int | None
    eot_id: int | None = None
    vocab_size: int | None = None
    max_length: int | None = None
    logit_shift: bool = False
    attention: str = "bidirectional"
    trained_gen_length: int | None = None
    noise: str = "mask"
    layout: str = "decoder-only"
    block_length: int | None = None
    segmented: bool = False
    thread_sensitive: bool = False
    attend_mask: Callable[[dict, int, int, torch.dtype], torch.Tensor | None] | None = field(
        default=None, repr=False, compare=False)
    _inputs: Callable[["ModelSpec", torch.Tensor | None, int], dict[str, Any]] = field(
        default=None, repr=False, compare=False)
    layers: Callable[[torch.nn.Module], Any] | None = field(default=None, repr=False, compare=False)
    device: torch.device = field(default=torch.device("cpu"), compare=False)
    config: Any = field(default=None, repr=False, compare=False)
    embeddings: Any = field(default=None, repr=False, compare=False)
    encoder: Any = field(default=None, repr=False, compare=False)

    def forward_inputs(self, attention_mask: torch.Tensor | None, total_len: int) -> dict[str, Any]:
        """Keyword arguments for `model(x, **kw)` over a sequence of `total_len` positions whose
        first columns are covered by the left-padded prompt mask `attention_mask` `[B, P]`."""
        return self._inputs(self, attention_mask, total_len)

    @staticmethod
    def inputs_for_positions(forward_inputs: dict[str, Any], start: int, end: int) -> dict[str, Any]:
        """`forward_inputs` (built for all `total_len` positions) cut for a cached forward of the
        positions `[start, end)` against keys of every position: per-query inputs (position ids,
        the rows of a 4-D mask) are sliced, per-key ones (a 2-D padding mask) are kept."""
        out = dict(forward_inputs)
        if torch.is_tensor(out.get("position_ids")):
            out["position_ids"] = out["position_ids"][:, start:end]
        mask = out.get("attention_mask")
        if torch.is_tensor(mask) and mask.dim() == 4:
            out["attention_mask"] = mask[:, :, start:end]
        return out

    def logits(self, model: torch.nn.Module, x: torch.Tensor, **forward_inputs: Any) -> torch.Tensor:
        """One model forward; returns logits `[B, L, V]` where row i scores position i."""
        logits = model(x, **forward_inputs).logits
        return shift_logits(logits) if self.logit_shift else logits

    @property
    def bidirectional(self) -> bool:
        """Positions may attend to later ones (every attention kind but causal)."""
        return self.attention != "causal"

    def with_overrides(self, **ids: int | None) -> "ModelSpec":
        """A copy with some ids replaced (None keeps the model's own)."""
        return replace(self, **{k: v for k, v in ids.items() if v is not None})


def shift_logits(logits: torch.Tensor) -> torch.Tensor:
    """The logit shift (`ModelSpec.logit_shift`: Dream, Fast-dLLM v2): row i takes the logits of row i−1 (the
    model's prediction of token i), the first row keeps its own. The one copy: `ModelSpec.logits` and the
    drivers' and loops' forwards shift with it."""
    return torch.cat([logits[:, :1], logits[:, :-1]], dim=1)


def extend_mask(attention_mask: torch.Tensor | None, total_len: int) -> torch.Tensor | None:
    if attention_mask is None:
        return None
    gen = total_len - attention_mask.shape[1]
    ones = torch.ones((attention_mask.shape[0], gen), dtype=attention_mask.dtype, device=attention_mask.device)
    return torch.cat([attention_mask, ones], dim=-1)


def padding_mask_inputs(spec: ModelSpec, attention_mask: torch.Tensor | None, total_len: int) -> dict[str, Any]:
    # LLaDA (and AR models) take the 2-D padding mask; LLaDA's RoPE positions stay absolute (0..L-1).
    mask = extend_mask(attention_mask, total_len)
    return {} if mask is None else {"attention_mask": mask}


def config_id(config: Any, name: str, default: int | None) -> int | None:
    """An id from a config (the first of a list), or `default` when it has none."""
    value = getattr(config, name, None)
    if isinstance(value, (list, tuple)):
        value = value[0] if value else None
    return default if value is None else int(value)


def _ar_spec(config: Any) -> ModelSpec:
    return ModelSpec(
        kind="ar",
        mask_id=config_id(config, "mask_token_id", None),
        eos_id=config_id(config, "eos_token_id", None),
        pad_id=config_id(config, "pad_token_id", None),
        vocab_size=getattr(config, "vocab_size", None),
        max_length=getattr(config, "max_position_embeddings", None),
        logit_shift=False,
        attention="causal",
        trained_gen_length=getattr(config, "trained_gen_length", None),
        _inputs=padding_mask_inputs,
    )


def register_spec(model_type: str, builder: Callable[[Any], ModelSpec]) -> None:
    """Teach remask a new diffusion model type (matched case-insensitively on `config.model_type`):
    a family with only a spec (`registry.register_family` is the full form)."""
    from .registry import Family, register_family

    register_family(Family(model_type, builder))


def get_spec(model: torch.nn.Module, **overrides: int | None) -> ModelSpec:
    """The spec of `model`, from its config; `overrides` (mask_id=…, eos_id=…, pad_id=…, eot_id=…)
    replace the model's own ids when not None. Unknown model types are treated as autoregressive."""
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError("model has no `.config`; remask needs a transformers model (or an object with a config)")
    from .registry import family_of

    family = family_of(getattr(config, "model_type", ""))
    builder = _ar_spec if family is None else family.spec
    parameters = next(model.parameters(), None) if hasattr(model, "parameters") else None
    device = torch.device("cpu") if parameters is None else parameters.device
    spec = builder(config).with_overrides(**overrides)
    return replace(spec, device=device, config=config, embeddings=_part(model, "get_input_embeddings"),
                   encoder=_part(model, "get_encoder") if spec.layout == "encoder-decoder" else None)


def _part(model: torch.nn.Module, getter: str) -> Any:
    """A part of the model by transformers' getter (`get_input_embeddings`: its input embedding table,
    `get_encoder`), None where it has none."""
    try:
        return getattr(model, getter)()
    except (AttributeError, NotImplementedError):
        return None
