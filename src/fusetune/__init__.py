"""fusetune: exact, fast Triton kernels for fine-tuning and RL-training LLMs.

Set ``FUSETUNE_INTERPRET=1`` before importing (before torch, which may import triton) to run
the Triton kernels on CPU tensors through Triton's interpreter.
"""

from fusetune import (
    _env,  # noqa: F401  (must run before anything imports triton)
    nn,
    reference,
)
from fusetune._utils import backend
from fusetune.ops.cross_entropy import cross_entropy

__version__ = "0.1.0"

__all__ = ["__version__", "backend", "cross_entropy", "nn", "reference"]
