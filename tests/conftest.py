"""Shared fixtures: tiny random checkpoints in the official LLaDA / Dream formats, built once per session."""
from __future__ import annotations

import os

import pytest
import torch

import remask  # noqa: F401  (registers the model classes with transformers)
from helpers import CHECKPOINTS

# Tiny shapes make every op small; on 2-core machines OpenMP hand-offs then cost more than the work.
torch.set_num_threads(1)

@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory):
    """`checkpoint_dir(name)` → (path, digest) of a tiny official-format checkpoint, written once."""
    root = tmp_path_factory.mktemp("checkpoints")
    made: dict[str, tuple[str, str]] = {}

    def get(name: str) -> tuple[str, str]:
        if name not in made:
            writer, kwargs = CHECKPOINTS[name]
            path = os.path.join(root, name)
            made[name] = (path, writer(path, **kwargs))
        return made[name]

    return get


@pytest.fixture(scope="session")
def load_model(checkpoint_dir):
    """`load_model(name)` → the checkpoint loaded through `AutoModel` (no trust_remote_code), cached."""
    from transformers import AutoModel

    cache: dict[str, torch.nn.Module] = {}

    def get(name: str) -> torch.nn.Module:
        if name not in cache:
            cache[name] = AutoModel.from_pretrained(checkpoint_dir(name)[0]).eval()
        return cache[name]

    return get


