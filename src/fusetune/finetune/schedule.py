"""The learning-rate schedule of ``python -m fusetune finetune``: ``--lr-schedule`` and
``--warmup-steps``.

The factor on ``--lr`` at optimizer step ``i`` (0-based) of ``total``:

- warmup (``i < warmup``): ``(i + 1) / warmup``, so the first step already learns and step
  ``warmup`` reaches the full rate;
- then, with ``p = (i - warmup) / (total - warmup)`` in [0, 1): ``constant`` 1, ``linear``
  ``1 - p``, ``cosine`` ``(1 + cos(pi p)) / 2``. The last step's rate is small but not 0.

The schedule's whole state is the step index, so a resumed run continues it exactly.
"""

from __future__ import annotations

import math

import torch

CHOICES = ("constant", "linear", "cosine")


def lr_factor(step: int, total: int, schedule: str = "constant", warmup: int = 0) -> float:
    """The multiplier on the base learning rate at 0-based ``step`` of ``total`` steps.

    Raises ValueError for an unknown ``schedule``."""
    if schedule not in CHOICES:
        raise ValueError(f"unknown lr schedule {schedule!r}; one of {', '.join(CHOICES)}")
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    if schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, base_lr: float, factor: float) -> float:
    """Set every parameter group's rate to ``base_lr * factor`` (exactly ``base_lr`` for a
    factor of 1, so a constant schedule changes nothing); returns it."""
    lr = base_lr * factor
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):  # (--cuda-graph: the graph reads it in place)
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
    return lr


def describe(schedule: str, warmup: int) -> str:
    warm = f", {warmup} warmup steps" if warmup else ""
    return f"{schedule}{warm}"
