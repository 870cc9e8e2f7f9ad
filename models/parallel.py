"""Tensor parallel pieces shared by the model families: the vocabulary-parallel LM head style and
the helpers that read a vocabulary-sharded logits tensor.

A model's `_tp_plan` maps its LM head to ``"vocab_parallel"``: transformers' column-parallel linear
whose output stays a `DTensor` sharded on the vocabulary axis (``Shard(-1)``) instead of being
gathered. Scoring (`remask.diffusion.parts.scoring.score_rows`) then works on each rank's columns and
combines a few numbers per row across ranks; code that needs whole rows (the reference
formulations, log-likelihoods) calls `full_logits`, the one place that gathers.
"""
from __future__ import annotations

import functools

import torch

VOCAB_PARALLEL = "vocab_parallel"


def register_tp_styles() -> None:
    """Add ``"vocab_parallel"`` to transformers' parallel styles (a no-op without torch.distributed)."""
    try:
        from torch.distributed.tensor import Replicate, Shard
        from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES
        from transformers.distributed.tensor_parallel import ColwiseParallel
    except ImportError:   # no distributed build of torch, or a transformers without DTensor TP
        return
    if VOCAB_PARALLEL not in ALL_PARALLEL_STYLES.valid_keys():
        ALL_PARALLEL_STYLES.register(VOCAB_PARALLEL, ColwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False))


@functools.cache
def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    return DTensor


def vocab_shard(logits: torch.Tensor):
    """(local columns, vocab_start, vocab_size, process group) when `logits` is a DTensor sharded
    on its last axis over a 1-D mesh, else None. Shards follow `torch.chunk` (rank r holds
    ``[r·c, (r+1)·c)``, c = ⌈V / world⌉, the last one shorter)."""
    DTensor = _dtensor_type()
    if DTensor is None or not isinstance(logits, DTensor):
        return None
    from torch.distributed.tensor import Shard

    placements, mesh = logits.placements, logits.device_mesh
    if mesh.ndim != 1 or len(placements) != 1 or not isinstance(placements[0], Shard) or \
            placements[0].dim not in (-1, logits.dim() - 1):
        return None
    local = logits.to_local()
    vocab_size = logits.shape[-1]
    chunk = -(-vocab_size // mesh.size())
    start = min(mesh.get_local_rank() * chunk, vocab_size)
    if local.shape[-1] != max(0, min(chunk, vocab_size - start)):
        raise RuntimeError(f"vocabulary shard of width {local.shape[-1]} at column {start} does not follow "
                           f"torch.chunk over {mesh.size()} ranks of a vocabulary of {vocab_size}")
    return local, start, vocab_size, mesh.get_group()


def full_logits(logits: torch.Tensor) -> torch.Tensor:
    """`logits` as a plain tensor with whole rows (all-gathers a DTensor; anything else as is)."""
    DTensor = _dtensor_type()
    if DTensor is not None and isinstance(logits, DTensor):
        return logits.full_tensor()
    return logits
