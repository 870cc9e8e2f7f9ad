"""remask's tiny trained models: `tiny-llada` (masked diffusion, official LLaDA format) and
`tiny-ar` (transformers Llama), with their character tokenizer, data and training script.

    >>> import remask
    >>> model, tokenizer = remask.load("tiny-llada")
    >>> model.config.model_type, tokenizer.mask_token_id == model.config.mask_token_id
    ('llada', True)
"""
from __future__ import annotations

import os

import torch

CHECKPOINTS = os.path.join(os.path.dirname(__file__), "checkpoints")
SHIPPED = ("tiny-llada", "tiny-ar")


def checkpoint_path(name: str) -> str:
    """Folder of a shipped checkpoint (`"tiny-llada"`, `"tiny-ar"`), or `name` itself if it is a folder."""
    if name in SHIPPED:
        return os.path.join(CHECKPOINTS, name)
    if os.path.isdir(name):
        return name
    raise ValueError(f"name must be one of {list(SHIPPED)} or a checkpoint folder, got {name!r}")


def load(name: str, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """(model, tokenizer) of a shipped tiny model or a checkpoint folder, in eval mode.

    Diffusion checkpoints load with `AutoModel`, autoregressive ones with `AutoModelForCausalLM`
    (decided by `config.model_type`); nothing is downloaded."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

    import remask.models  # noqa: F401  (registers LLaDA / Dream with the Auto classes)
    from remask.models.spec import SPEC_BUILDERS

    path = checkpoint_path(name)
    if not os.path.exists(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"no checkpoint in {path} (config.json missing); train one with "
                                f"`python -m remask.zoo.train`")
    config = AutoConfig.from_pretrained(path)
    auto = AutoModel if str(config.model_type).lower() in SPEC_BUILDERS else AutoModelForCausalLM
    model = auto.from_pretrained(path, dtype=dtype).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer
