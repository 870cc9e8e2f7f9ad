"""`remask.patch(model)`: attach remask's samplers as methods so existing scripts run unchanged."""
from __future__ import annotations

import types

import torch

from remask.diffusion import diffusion_generate, generate
from remask.models.registry import family_of
from remask.models.spec import get_spec


def patch(model: torch.nn.Module) -> torch.nn.Module:
    """Give a diffusion model `model.diffusion_generate(inputs, generation_config=None, **kw)` (Dream's
    method) and `model.generate(prompt, ...)` (LLaDA's `generate` without the model argument).

    Works on remask's own classes and on models loaded with the official remote code. For
    DiffusionGemma, `model.generate(input_ids, **kw)` runs `canvas_generate` (the same arguments). For
    a block-diffusion family, `model.generate(...)` is its drop-in entry point (`Family.generate`, e.g.
    SDAR's `remask.compat.sdar.block_diffusion_generate` without the model argument). Returns the model.
    """
    spec = get_spec(model)
    family = family_of(getattr(getattr(model, "config", None), "model_type", ""))
    entry = family.entry_point() if family is not None else None
    if entry is not None:   # a block-diffusion family: its drop-in entry point (same arguments as upstream's)
        model.generate = types.MethodType(lambda self, *args, **kw: entry(self, *args, **kw), model)
        return model
    if spec.noise == "uniform":   # DiffusionGemma: its `generate` (same arguments) runs remask's canvas loop
        from remask.diffusion.families.canvas import canvas_generate

        model.generate = types.MethodType(lambda self, input_ids=None, **kw: canvas_generate(self, input_ids, **kw),
                                          model)
        model.diffusion_generate = model.generate
        return model
    if spec.kind == "ar":
        raise ValueError("remask.patch expects a diffusion model (LLaDA, Dream); an autoregressive model "
                         "already has generate(), and remask.ar_generate is its remask counterpart")
    model.diffusion_generate = types.MethodType(
        lambda self, inputs=None, generation_config=None, **kw: diffusion_generate(self, inputs, generation_config, **kw),
        model)
    model.generate = types.MethodType(lambda self, prompt, *args, **kw: generate(self, prompt, *args, **kw), model)
    return model
