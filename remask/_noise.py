"""Two third-party messages every import would print once torchao is installed (transformers imports
its quantizers, and with them torchao, at import time), dropped by narrow log filters:

* torchao: "Failed to load .../_C_*.so" for its CUDA/CUTLASS extensions on a machine without them
  (a CPU machine: nothing fails, torchao falls back to its CPU kernels);
* torch's pytree: "<enum ...> is an Enum subclass and is now natively supported ... register_constant()
  ... deprecated", raised by torchao's own registrations.

Nothing else from either logger is touched. Importing this module installs the filters.
"""
from __future__ import annotations

import logging


class _Drop(logging.Filter):
    def __init__(self, *needles: str) -> None:
        super().__init__()
        self.needles = needles

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not all(needle in message for needle in self.needles)


def quiet() -> None:
    logging.getLogger("torchao").addFilter(_Drop("Failed to load", "_C_"))
    logging.getLogger("torch.utils._pytree").addFilter(_Drop("is an Enum subclass", "register_constant()"))


quiet()
