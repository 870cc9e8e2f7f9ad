"""DiffusionGemma: transformers' own `DiffusionGemmaForBlockDiffusion` (transformers >= 5.11), not a
reimplementation. This module holds what remask needs to know about it: its spec (uniform noise,
no mask token, an encoder–decoder layout with canvases of `config.canvas_length`) and the adapter
the canvas loop (`remask.diffusion.families.canvas`) drives — encoder into the KV cache, decoder over a
canvas against it — so the loop itself never touches the model's classes; and `CanvasRows`, through which
the engine stacks several requests' forwards into one call, each over its own cache.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import weakref
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from remask.kernels.batch_invariant import Seam, linear_seam

from .hf_compat import cache_arg, own_setting, swapped_setting
from .registry import Family, register_family
from .request import ForwardRequest, ScopedCache
from .spec import ModelSpec, config_id

MODEL_TYPE = "diffusion_gemma"
MIN_TRANSFORMERS = "5.11"


def require_diffusion_gemma():
    """transformers' DiffusionGemma module, or an ImportError naming the version needed."""
    try:
        from transformers.models.diffusion_gemma import generation_diffusion_gemma
    except ImportError as error:   # pragma: no cover - the pinned transformers has it
        import transformers

        raise ImportError(f"DiffusionGemma needs transformers >= {MIN_TRANSFORMERS} "
                          f"(installed: {transformers.__version__})") from error
    return generation_diffusion_gemma


def _generation_id(model_config: Any, name: str) -> int | None:
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    return config_id(model_config, name, None) if getattr(model_config, name, None) is not None else \
        config_id(text, name, None)


def diffusion_gemma_spec(config: Any) -> ModelSpec:
    text = config.get_text_config()
    return ModelSpec(
        kind=MODEL_TYPE,
        mask_id=None,
        eos_id=_generation_id(config, "eos_token_id"),
        pad_id=_generation_id(config, "pad_token_id"),
        vocab_size=text.vocab_size,
        max_length=getattr(text, "max_position_embeddings", None),
        attention="bidirectional",   # the decoder over its canvas; the encoder is causal
        noise="uniform",
        layout="encoder-decoder",
        block_length=config.canvas_length,
        # transformers' eager MoE experts give other logits at 2 threads than at 1 (measured on the tiny one)
        thread_sensitive=True,
    )


# transformers ships the classes; AutoModel would give the backbone without the LM head
register_family(Family(MODEL_TYPE, diffusion_gemma_spec, load_class="AutoModelForImageTextToText"))


class CanvasModel:
    """The calls of DiffusionGemma's generation loop, one method each, with the arguments
    transformers' `generate` passes (so the same forwards run on the same tensors). The two forwards
    are described, not run: `encoder_forward` and `decoder_forward` return the
    `ForwardRequest` (`remask.models.request`) a driver computes. Built from the model's spec (its
    config, `encoder` and `embeddings`, the table the decoder shares with the encoder), never the model:
    the decoder's mask builder is transformers' class function."""

    def __init__(self, spec: ModelSpec):
        from transformers.models.diffusion_gemma import modeling_diffusion_gemma as modeling

        self.config, self.encoder, self.embeddings = spec.config, spec.encoder, spec.embeddings
        self.canvas_length = int(self.config.canvas_length)
        self.vocab_size = int(self.config.get_text_config().vocab_size)
        self.create_decoder_masks = modeling.DiffusionGemmaDecoderModel.create_diffusion_decoder_attention_mask

    @property
    def embedding_dtype(self) -> torch.dtype:
        return self.embeddings.weight.dtype

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.config.get_text_config(decoder=True))

    def encoder_forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                        cache):
        """The encoder over `input_ids` (uncached tokens), writing their keys and values into `cache` (in
        place: the answer is the encoder's output). Its cache is a `CanvasRows`: the engine stacks the encoder
        forwards of its requests of one length into one call, each into its own cache."""

        encoder = self.encoder
        input_ids = input_ids.clone(memory_format=torch.contiguous_format)
        shape_only = torch.empty((input_ids.shape[0], input_ids.shape[1], 0), dtype=encoder.dtype,
                                 device=input_ids.device)
        masks = encoder.create_masks_for_generate(config=self.config, inputs_embeds=shape_only,
                                                  attention_mask=attention_mask, position_ids=position_ids,
                                                  mm_token_type_ids=None,
                                                  **cache_arg(encoder.create_masks_for_generate, cache))
        return ForwardRequest(input_ids, per_row=dict(position_ids=position_ids), shared=dict(attention_mask=OWN_MASKS),
                              cache=CanvasRows([cache], [masks], [input_ids.shape[0]], input_ids.shape[1]),
                              output="model", module=encoder)

    def decoder_masks(self, canvas: torch.Tensor, cache, decoder_attention_mask: torch.Tensor) -> dict:
        """The decoder's attention masks for a canvas over the cache (computed once per canvas)."""
        create = self.create_decoder_masks
        return create(config=self.config, inputs_embeds=canvas.unsqueeze(-1),
                      decoder_attention_mask=decoder_attention_mask, **cache_arg(create, cache))

    def decoder_forward(self, canvas: torch.Tensor, self_conditioning_logits: torch.Tensor | None, masks: dict,
                        cache, position_ids: torch.Tensor):
        """One decoder forward of the model (no encoder input): a request answered with the logits
        `[B, canvas_length, V]` (float32, soft-capped). Its cache is a `CanvasRows`: the engine stacks the
        decoder forwards of its requests into one call, each over its own encoder cache."""

        per_row = dict(decoder_input_ids=canvas, decoder_position_ids=position_ids)
        shared = {}
        if self_conditioning_logits is None:
            shared["self_conditioning_logits"] = None
        else:
            per_row["self_conditioning_logits"] = self_conditioning_logits
        return ForwardRequest(None, per_row=per_row, shared=shared,
                              cache=CanvasRows([cache], [masks], [canvas.shape[0]], canvas.shape[1]))


# ---- the forwards of several requests in one call ------------------------------------------------------------

ROWS_IMPLEMENTATION = "remask_canvas_rows"
_ROWS: contextvars.ContextVar["CanvasRows | None"] = contextvars.ContextVar("remask_canvas_rows", default=None)


class LayerMasks(dict):
    """A mask per layer type, given to the model so that it builds none (hashable: requests stack by their shared
    inputs)."""

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.items())))


OWN_MASKS = LayerMasks(full_attention=None, sliding_attention=None)   # each request's own: `CanvasRows.masks`


@dataclass(eq=False)
class CanvasRows(ScopedCache):
    """The cache argument of an encoder or decoder forward over the rows of one or more requests stacked in
    order, `length` positions each: request i has `sizes[i]` rows, its cache `caches[i]` and masks `masks[i]`
    (those its own forward has). Inside `forward_scope` each request's rows attend with its own mask through its
    own cache, exactly as transformers' attention does (the encoder's `update`, the decoder's read-only
    `append_to_cache`, then the model's attention implementation); its experts and the products that mix rows
    (`F.linear` over flattened tokens, `matmul`) run on its rows alone: with the engine's batch-invariant linears
    (its `nn.Linear` layers) a request's answer is bitwise that of its own forward. To the model it is a cache of
    no positions that stores nothing."""

    caches: list[Any]
    masks: list[dict]
    sizes: list[int]
    length: int
    is_compileable = False

    def pack_key(self) -> tuple:
        return ("canvas", self.length)

    @classmethod
    def pack(cls, members: list["CanvasRows"], sizes: list[int], varlen: bool = False) -> "CanvasRows":
        if varlen:   # (the engine refuses varlen_attention for this model before any forward)
            raise ValueError("varlen_attention: DiffusionGemma's canvases attend through transformers, not varlen")
        return cls([c for m in members for c in m.caches], [k for m in members for k in m.masks],
                   [s for m in members for s in m.sizes], members[0].length)

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, ...]:
        """The encoder's write: nothing here (each request's own cache is written in the attention)."""
        return key, value

    @functools.cached_property
    def layers(self) -> list[Any]:
        """What the decoder's `append_to_cache` reads: no positions for the stacked rows (each request's own
        are joined in the attention)."""
        def empty(t: torch.Tensor) -> torch.Tensor:
            return t.new_empty((sum(self.sizes), t.shape[1], 0, t.shape[3]))
        return [_NoPositions(empty(layer.keys), empty(layer.values)) for layer in self.caches[0].layers]

    @functools.cached_property
    def bounds(self) -> list[slice]:
        """Each request's rows."""
        ends = torch.tensor(self.sizes).cumsum(0).tolist()
        return [slice(end - size, end) for size, end in zip(self.sizes, ends)]

    def token_bounds(self) -> list[slice]:
        """Each request's part of the flattened tokens."""
        return [slice(b.start * self.length, b.stop * self.length) for b in self.bounds]

    @contextlib.contextmanager
    def forward_scope(self, model: Any) -> Iterator[None]:
        register_rows()
        attention, experts = _implementation_configs(model)
        token = _ROWS.set(self)
        try:
            with swapped_setting(attention, "_attn_implementation", ROWS_IMPLEMENTATION), \
                    swapped_setting(experts, "_experts_implementation", ROWS_IMPLEMENTATION), \
                    self._per_request(linear_seam, split_rows=False), self._per_request(_MATMUL, split_rows=True):
                yield
        finally:
            _ROWS.reset(token)

    def _per_request(self, seam: Seam, split_rows: bool) -> contextlib.AbstractContextManager:
        """Several requests: the seam's products that mix rows computed per request (`_PerRequest`)."""
        return seam.active(_PerRequest(self, seam, split_rows)) if len(self.sizes) > 1 else contextlib.nullcontext()


_CONFIGS: "weakref.WeakKeyDictionary[Any, tuple[list[Any], list[Any]]]" = weakref.WeakKeyDictionary()


def _implementation_configs(model: Any) -> tuple[list[Any], list[Any]]:
    """The configs the model's (or its encoder's) attention layers and experts read their implementations from."""
    if model not in _CONFIGS:
        from transformers.models.diffusion_gemma import modeling_diffusion_gemma as modeling

        attention = (modeling.DiffusionGemmaEncoderTextAttention, modeling.DiffusionGemmaDecoderTextAttention)
        _CONFIGS[model] = tuple(list({id(m.config): m.config for m in model.modules() if isinstance(m, kind)}.values())
                                for kind in (attention, modeling.DiffusionGemmaTextExperts))
    return _CONFIGS[model]


@dataclass
class _NoPositions:
    keys: torch.Tensor
    values: torch.Tensor


def _rows_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Each request's rows over its own encoder cache with its own mask (`CanvasRows`), through the config's own
    implementation (which alone runs where this thread has no rows)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.diffusion_gemma import modeling_diffusion_gemma as modeling

    own = ALL_ATTENTION_FUNCTIONS.get_interface(own_setting(module.config, "_attn_implementation"),
                                                modeling.eager_attention_forward)
    rows = _ROWS.get()
    if rows is None:
        return own(module, query, key, value, attention_mask, **kwargs)
    outputs = []
    for part, cache, masks in zip(rows.bounds, rows.caches, rows.masks):
        if isinstance(module, modeling.DiffusionGemmaDecoderTextAttention):   # reads the encoder's cache
            k, v = module.append_to_cache(cache, key[part], value[part])
        else:                                                               # the encoder writes it
            k, v = cache.update(key[part], value[part], module.layer_idx)
        outputs.append(own(module, query[part], k, v, masks[module.config.layer_types[module.layer_idx]],
                           **kwargs)[0])
    return torch.cat(outputs), None


def _rows_experts(module: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts over each request's tokens alone (the tokens that meet in an expert's GEMM set its bits)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    own = ALL_EXPERTS_FUNCTIONS.get_interface(own_setting(module.config, "_experts_implementation"),
                                              type(module).forward.__wrapped__)   # the eager forward
    rows = _ROWS.get()
    if rows is None:
        return own(module, hidden_states, top_k_index, top_k_weights)
    return torch.cat([own(module, hidden_states[part], top_k_index[part], top_k_weights[part])
                      for part in rows.token_bounds()])


class _PerRequest:
    """A seam's handler inside a stacked call of several requests: `F.linear` over the flattened tokens
    `[rows × length, K]` (the router's) and `matmul` over the stacked rows `[rows, ...]` (the self-conditioning
    embedding's) computed per request, with the shapes its own forward has (a GEMM's bits may depend on its row
    count), by the next handler (the batch-invariant linears, as a request alone has them on CUDA), else torch's own
    function (`split_rows`: stacked rows too). Any other call goes on to the next handler whole: `F.linear` over
    stacked rows is an `nn.Linear`'s, whose rows the batch-invariant linears pose each as alone (in one GEMM where the
    bits allow; without them, under `batch_invariant=False`, rows share a GEMM as in any packed forward)."""

    def __init__(self, rows: CanvasRows, seam: Seam, split_rows: bool):
        self.rows, self.seam, self.total, self.split_rows = rows, seam, sum(rows.sizes), split_rows

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        x = args[0] if args else None
        if self.split_rows and torch.is_tensor(x) and x.dim() == 3 and x.shape[0] == self.total:
            parts = self.rows.bounds
        elif torch.is_tensor(x) and x.dim() == 2 and x.shape[0] == self.total * self.rows.length:
            parts = self.rows.token_bounds()
        else:
            return self.seam.seamed(*args, **kwargs)
        return torch.cat([self.seam.seamed(x[part], *args[1:], **kwargs) for part in parts])   # each as alone


_MATMUL = Seam(torch, "matmul")


@functools.cache
def register_rows() -> None:
    from transformers import AttentionInterface
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ROWS_IMPLEMENTATION, _rows_attention)
    AttentionMaskInterface.register(ROWS_IMPLEMENTATION, sdpa_mask)   # another thread's masks meanwhile
    ALL_EXPERTS_FUNCTIONS.register(ROWS_IMPLEMENTATION, _rows_experts)
