"""Input validation shared by the samplers: every error names the parameter and what is allowed."""
from __future__ import annotations

import torch

from remask.models.spec import ModelSpec


def model_device(model: torch.nn.Module) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:  # pragma: no cover - parameterless stand-ins
        return torch.device("cpu")


def check_prompt(model: torch.nn.Module, prompt: torch.Tensor, attention_mask: torch.Tensor | None,
                 name: str = "prompt") -> None:
    if not torch.is_tensor(prompt) or prompt.dim() != 2:
        raise ValueError(f"{name} must be a 2-D LongTensor [batch, length], got "
                         f"{type(prompt).__name__}{tuple(prompt.shape) if torch.is_tensor(prompt) else ''}")
    if prompt.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name} must hold integer token ids (torch.long), got dtype {prompt.dtype}")
    if prompt.shape[0] == 0 or prompt.shape[1] == 0:
        raise ValueError(f"{name} must have at least one row and one token, got shape {tuple(prompt.shape)}")
    device = model_device(model)
    if prompt.device != device:
        raise ValueError(f"{name} is on {prompt.device} but the model is on {device}; move them to one device")
    if attention_mask is not None:
        if not torch.is_tensor(attention_mask) or attention_mask.shape != prompt.shape:
            raise ValueError(f"attention_mask must have the shape of {name} {tuple(prompt.shape)}, got "
                             f"{tuple(attention_mask.shape) if torch.is_tensor(attention_mask) else attention_mask!r}")
        if attention_mask.device != prompt.device:
            raise ValueError(f"attention_mask is on {attention_mask.device} but {name} is on {prompt.device}")


def check_mask_id(spec: ModelSpec, prompt: torch.Tensor | None = None) -> None:
    if spec.mask_id is None:
        raise ValueError(f"the model ({spec.kind}) has no mask token: pass mask_id=<id of the mask token>")
    if spec.vocab_size is not None and not 0 <= spec.mask_id < spec.vocab_size:
        raise ValueError(f"mask_id={spec.mask_id} is outside the vocabulary [0, {spec.vocab_size})")
    if spec.pad_id is not None and spec.mask_id == spec.pad_id:
        raise ValueError(f"mask_id={spec.mask_id} equals the pad token id; the mask id must differ from pad_id")


def check_length(spec: ModelSpec, total: int, what: str) -> None:
    if spec.max_length is not None and total > spec.max_length:
        raise ValueError(f"{what} = {total} exceeds the model's maximum sequence length {spec.max_length}")


def check_token_id(spec: ModelSpec, value: int | None, name: str) -> int:
    if value is None:
        raise ValueError(f"{name} is needed here but the model declares none; pass it explicitly")
    if spec.vocab_size is not None and not 0 <= value < spec.vocab_size:
        raise ValueError(f"{name}={value} is outside the vocabulary [0, {spec.vocab_size})")
    return value
