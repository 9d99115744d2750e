"""Interpreter switch, applied before Triton is imported.

Triton decides at import time whether its own helpers (``tl.sigmoid``, ...) are compiled or
interpreted, so ``FUSETUNE_INTERPRET=1`` has to become ``TRITON_INTERPRET=1`` before the first
``import triton`` anywhere in the process (``import torch._dynamo`` imports it, for one).
"""

from __future__ import annotations

import os
import sys


def _truthy(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


def interpreting() -> bool:
    """True when Triton kernels run through Triton's CPU interpreter."""
    return _truthy("TRITON_INTERPRET")


if _truthy("FUSETUNE_INTERPRET") and not interpreting():
    if "triton" in sys.modules:
        raise RuntimeError(
            "FUSETUNE_INTERPRET=1 was set after triton had been imported; set it (or "
            "TRITON_INTERPRET=1) in the environment before the process imports torch or triton"
        )
    os.environ["TRITON_INTERPRET"] = "1"
