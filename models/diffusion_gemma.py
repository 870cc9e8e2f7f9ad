"""DiffusionGemma: transformers' own `DiffusionGemmaForBlockDiffusion` (transformers >= 5.11), not a
reimplementation. This module holds what remask needs to know about it: its spec (uniform noise,
no mask token, an encoder–decoder layout with canvases of `config.canvas_length`) and the adapter
the canvas loop (`remask.diffusion.families.canvas`) drives — encoder into the KV cache, decoder over a
canvas against it — so the loop itself never touches the model's classes.
"""
from __future__ import annotations

from typing import Any

import torch

from .hf_compat import cache_arg
from .registry import Family, register_family
from .request import ForwardRequest
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
    )


# transformers ships the classes; AutoModel would give the backbone without the LM head
register_family(Family(MODEL_TYPE, diffusion_gemma_spec, load_class="AutoModelForImageTextToText"))


class CanvasModel:
    """The calls of DiffusionGemma's generation loop, one method each, with the arguments
    transformers' `generate` passes (so the same forwards run on the same tensors). The two forwards
    are described, not run: `encoder_forward` and `decoder_forward` return the
    `ForwardRequest` (`remask.models.request`) a driver computes. Built from the model's spec (its
    config, `encoder` and `embeddings`, the table the decoder shares with the encoder), never the model:
    the decoder's mask builder and the model's forward signature are transformers' class functions."""

    def __init__(self, spec: ModelSpec):
        from transformers.models.diffusion_gemma import modeling_diffusion_gemma as modeling

        self.config, self.encoder, self.embeddings = spec.config, spec.encoder, spec.embeddings
        self.canvas_length = int(self.config.canvas_length)
        self.vocab_size = int(self.config.get_text_config().vocab_size)
        self.create_decoder_masks = modeling.DiffusionGemmaDecoderModel.create_diffusion_decoder_attention_mask
        self.model_forward = modeling.DiffusionGemmaForBlockDiffusion.forward

    @property
    def embedding_dtype(self) -> torch.dtype:
        return self.embeddings.weight.dtype

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.config.get_text_config(decoder=True))

    def encoder_forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                        cache):
        """The encoder over `input_ids` (uncached tokens), writing their keys and values into
        `cache`: a request for the encoder's whole output (`output_cache(answer)` is the cache).
        The encoder is a module of its own (`module=`), so the request runs alone."""

        encoder = self.encoder
        input_ids = input_ids.clone(memory_format=torch.contiguous_format)
        shape_only = torch.empty((input_ids.shape[0], input_ids.shape[1], 0), dtype=encoder.dtype,
                                 device=input_ids.device)
        masks = encoder.create_masks_for_generate(config=self.config, inputs_embeds=shape_only,
                                                  attention_mask=attention_mask, position_ids=position_ids,
                                                  mm_token_type_ids=None,
                                                  **cache_arg(encoder.create_masks_for_generate, cache))
        return ForwardRequest(input_ids, per_row=dict(position_ids=position_ids),
                              shared=dict(attention_mask=masks, **cache_arg(encoder.forward, cache)),
                              output="model", module=encoder)

    def decoder_masks(self, canvas: torch.Tensor, cache, decoder_attention_mask: torch.Tensor) -> dict:
        """The decoder's attention masks for a canvas over the cache (computed once per canvas)."""
        create = self.create_decoder_masks
        return create(config=self.config, inputs_embeds=canvas.unsqueeze(-1),
                      decoder_attention_mask=decoder_attention_mask, **cache_arg(create, cache))

    def decoder_forward(self, canvas: torch.Tensor, self_conditioning_logits: torch.Tensor | None, masks: dict,
                        cache, position_ids: torch.Tensor):
        """One decoder forward of the model (no encoder input): a request answered with the logits
        `[B, canvas_length, V]` (float32, soft-capped)."""

        per_row = dict(decoder_input_ids=canvas, decoder_position_ids=position_ids)
        shared = dict(decoder_attention_mask=masks, **cache_arg(self.model_forward, cache))
        if self_conditioning_logits is None:
            shared["self_conditioning_logits"] = None
        else:
            per_row["self_conditioning_logits"] = self_conditioning_logits
        return ForwardRequest(None, per_row=per_row, shared=shared)
