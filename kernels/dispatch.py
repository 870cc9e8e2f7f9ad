"""Which implementation runs: the Triton kernel or its torch reference.

``REMASK_TRITON=1`` forces Triton (on CPU tensors this needs ``TRITON_INTERPRET=1``, set before
Triton is imported), ``REMASK_TRITON=0`` forces torch; unset, Triton runs when the tensors are on
CUDA and Triton is importable.
"""
from __future__ import annotations

import os

import torch

try:  # Triton is a Linux-only dependency; everything has a torch path without it.
    import triton  # noqa: F401
    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    HAS_TRITON = False

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(tensor: torch.Tensor) -> bool:
    """True when the Triton kernel should handle `tensor` (see the module docstring)."""
    flag = os.environ.get("REMASK_TRITON")
    if flag not in (None, "", "0", "1"):
        raise ValueError(f"REMASK_TRITON must be '0', '1' or unset, got {flag!r}")
    if flag == "0":
        return False
    if flag == "1":
        if not HAS_TRITON:
            raise RuntimeError("REMASK_TRITON=1 but triton is not installed")
        if not tensor.is_cuda and not INTERPRETING:
            raise RuntimeError("REMASK_TRITON=1 with CPU tensors needs TRITON_INTERPRET=1 set before triton is imported")
        return True
    return HAS_TRITON and tensor.is_cuda


def check_like(name: str, operand: torch.Tensor, x: torch.Tensor) -> None:
    """A kernel operand on x's device in x's dtype, or a ValueError naming it."""
    if operand.dtype != x.dtype:
        raise ValueError(f"{name} dtype {operand.dtype} differs from x's {x.dtype}")
    if operand.device != x.device:
        raise ValueError(f"{name} is on {operand.device}, x on {x.device}")


def next_power_of_2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()
