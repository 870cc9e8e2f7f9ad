"""remask's tiny trained models: `tiny-llada` (masked diffusion, official LLaDA format) and
`tiny-ar` (transformers Llama), with their character tokenizer, data and training script; and
their chat successors `tiny-llada-chat` / `tiny-ar-chat` (the same tasks answered in plain text,
as JSON to a schema, and with tool calls; `remask.zoo.formats`), whose weights are made by
`python -m remask.zoo.train --model chat` (they load once trained).

    >>> import remask
    >>> model, tokenizer = remask.load("tiny-llada")
    >>> model.config.model_type, tokenizer.mask_token_id == model.config.mask_token_id
    ('llada', True)
"""
from __future__ import annotations

import os
from typing import Any

import torch

CHECKPOINTS = os.path.join(os.path.dirname(__file__), "checkpoints")
SHIPPED = ("tiny-llada", "tiny-ar")
CHAT_MODELS = ("tiny-llada-chat", "tiny-ar-chat")   # trained by `python -m remask.zoo.train --model chat`


def checkpoint_path(name: str | os.PathLike[str]) -> str:
    """Folder of a shipped checkpoint (`"tiny-llada"`, `"tiny-ar"`), or `name` itself if it is a folder."""
    # Checked first: os.path.isdir would take an int as a file descriptor and bytes as a path.
    name = os.fspath(name) if isinstance(name, os.PathLike) else name
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, one of {list(SHIPPED)} or a checkpoint folder, "
                        f"got {name!r} ({type(name).__name__})")
    if name in SHIPPED or name in CHAT_MODELS:
        return os.path.join(CHECKPOINTS, name)
    if os.path.isdir(name):
        return name
    raise ValueError(f"name must be one of {list(SHIPPED + CHAT_MODELS)} or a checkpoint folder, got {name!r}")


def available_devices() -> list[str]:
    """The devices this machine can put a model on: "cpu", then every CUDA / XPU device, then "mps"."""
    out = ["cpu"]
    for kind in ("cuda", "xpu"):
        backend = getattr(torch, kind, None)   # not every torch build has torch.xpu
        if backend is not None and backend.is_available():
            out += [f"{kind}:{i}" for i in range(backend.device_count())]
    if torch.backends.mps.is_available():
        out.append("mps")
    return out


def _unavailable(dev: torch.device) -> str | None:
    """Why `dev` does not exist on this machine (the check that says so), or None if it does."""
    if dev.type in ("cpu", "meta"):
        return None
    if dev.type == "mps":   # torch.backends.mps, not torch.mps, answers on every torch >= 2.4
        if not torch.backends.mps.is_available():
            return "torch.backends.mps.is_available() is False"
        return None if dev.index in (None, 0) else "there is one MPS device, mps:0"
    backend = getattr(torch, dev.type, None)
    if backend is None or not hasattr(backend, "is_available"):
        return f"this torch has no torch.{dev.type} backend"
    if not backend.is_available():
        return f"torch.{dev.type}.is_available() is False"
    if dev.index is not None and hasattr(backend, "device_count") and dev.index >= backend.device_count():
        return f"torch.{dev.type}.device_count() is {backend.device_count()}"
    return None


def check_device(device: str | torch.device) -> torch.device:
    """`device` as a torch.device if this machine has it; otherwise an error naming what it has
    (clearer than the CUDA / MPS error `.to(device)` would raise after the weights are read)."""
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str such as 'cpu' or 'cuda:0', or a torch.device, "
                        f"got {device!r} ({type(device).__name__})")
    shown = device if isinstance(device, str) else str(device)
    try:
        dev = torch.device(device)
    except RuntimeError as e:   # torch's message lists every device type it knows, most absent here
        reason = f"is not a torch device ({e})"
    else:
        missing = _unavailable(dev)
        if missing is None:
            return dev
        reason = f"is not available here: {missing}"
    use = " or ".join(f"device={d!r}" for d in available_devices())
    raise ValueError(f"device={shown!r} {reason}; use {use}")


def check_dtype(dtype: torch.dtype) -> torch.dtype:
    """`dtype` if the weights can be cast to it: a floating torch.dtype."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a floating torch.dtype such as torch.float32 or torch.bfloat16, "
                        f"got {dtype!r} ({type(dtype).__name__})")
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype such as torch.float32 or torch.bfloat16, got {dtype}")
    return dtype


QUANTIZATIONS = ("int8",)


def quantization_config(quantization: Any) -> Any:
    """A transformers quantization config for `quantization`: "int8" (torchao int8 weight-only,
    which runs on CPU), a transformers config object (bitsandbytes, FP8, torchao, ...) as it is,
    or None."""
    if quantization is None or not isinstance(quantization, str):
        return quantization
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)}, a transformers quantization config "
                         f"or None, got {quantization!r}")
    try:
        from torchao.quantization import Int8WeightOnlyConfig
    except ImportError as err:
        raise ValueError(f"quantization='int8' needs torchao: pip install torchao ({err})") from None
    from transformers import TorchAoConfig

    return TorchAoConfig(Int8WeightOnlyConfig())


def load(name: str | os.PathLike[str], *, dtype: torch.dtype = torch.float32,
         device: str | torch.device = "cpu", quantization: Any = None):
    """(model, tokenizer) of a shipped tiny model or a checkpoint folder, in eval mode.

    Diffusion checkpoints load with `AutoModel`, autoregressive ones with `AutoModelForCausalLM`
    (decided by `config.model_type`); nothing is downloaded. A `name`, `dtype` or `device` this
    machine cannot load is an error before anything is read. A folder without tokenizer files gives
    tokenizer None (prompts are then token ids). `quantization`: "int8" (torchao
    weight-only, CPU or GPU) or any transformers quantization config (bitsandbytes, FP8 on GPU)."""
    path = checkpoint_path(name)
    dtype = check_dtype(dtype)
    device = check_device(device)
    qconfig = quantization_config(quantization)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    import remask.models  # noqa: F401  (registers LLaDA / Dream with the Auto classes)
    from remask.models.registry import family_of

    if not os.path.exists(os.path.join(path, "config.json")):
        which = " --model chat" if name in CHAT_MODELS else ""
        raise FileNotFoundError(f"no checkpoint in {path} (config.json missing); train one with "
                                f"`python -m remask.zoo.train{which}`")
    config = AutoConfig.from_pretrained(path)
    family = family_of(config.model_type)
    if family is None:
        auto = AutoModelForCausalLM
    else:   # a diffusion family: AutoModel, or its own Auto class (DiffusionGemma)
        import transformers

        auto = getattr(transformers, family.load_class)
    if qconfig is None:
        model = auto.from_pretrained(path, dtype=dtype).to(device).eval()
    else:   # quantized weights are placed by from_pretrained (they may not support .to())
        model = auto.from_pretrained(path, dtype=dtype, quantization_config=qconfig, device_map=str(device)).eval()
    has_tokenizer = any(os.path.exists(os.path.join(path, f)) for f in
                        ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json"))
    tokenizer = AutoTokenizer.from_pretrained(path) if has_tokenizer else None   # None: token ids only
    return model, tokenizer
