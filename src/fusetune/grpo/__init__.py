"""``python -m fusetune grpo``: RL fine-tuning with TRL's GRPOTrainer and fusetune applied; see
``python -m fusetune grpo --help``. Modules: :mod:`~fusetune.grpo.data` (prompts),
:mod:`~fusetune.grpo.rewards` (built-in and user rewards), :mod:`~fusetune.grpo.command`."""

from fusetune.grpo.command import main

__all__ = ["main"]
