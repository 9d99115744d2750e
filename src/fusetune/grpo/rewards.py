"""Reward functions for ``python -m fusetune grpo``: verifiable built-ins and ``module:function``.

Every reward has TRL's signature, ``reward(prompts, completions, **columns) -> list[float]``
(the dataset's other columns, such as ``answer``, arrive as keyword lists).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable

from fusetune.finetune.errors import FinetuneError

_NUMBER = re.compile(r"-?\d+")


def exact_answer(prompts, completions, answer, **_) -> list[float]:
    """1.0 when the completion's first integer equals the answer, else 0.0: the exact-answer
    reward real models are trained on for arithmetic."""
    rewards = []
    for completion, want in zip(completions, answer, strict=True):
        found = _NUMBER.search(completion)
        rewards.append(1.0 if found and found.group() == str(want).strip() else 0.0)
    return rewards


def digits(prompts, completions, **_) -> list[float]:
    """The share of the completion's characters that are digits or a minus sign: a format reward
    a tiny random-weight model learns within a short run."""
    return [sum(c.isdigit() or c == "-" for c in text) / max(len(text), 1) for text in completions]


BUILTIN = {"exact": exact_answer, "digits": digits}
DEFAULT = ("exact", "digits")


def resolve(name: str) -> Callable:
    """A built-in reward by name or ``package.module:function``.

    Raises:
        FinetuneError: an unknown name, a module that does not import, a missing or
            non-callable attribute.
    """
    if name in BUILTIN:
        return BUILTIN[name]
    if ":" not in name:
        raise FinetuneError(
            f"--reward {name!r}: not a built-in reward ({', '.join(BUILTIN)}) nor 'module:function'"
        )
    module_name, _, attribute = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 (any import failure is the user's to fix)
        raise FinetuneError(f"--reward {name!r}: cannot import {module_name!r}: {exc}") from None
    function = getattr(module, attribute, None)
    if not callable(function):
        raise FinetuneError(f"--reward {name!r}: {module_name} has no function {attribute!r}")
    return function
