"""The one exception the fine-tuning command turns into a clear message and a non-zero exit."""

from __future__ import annotations


class FinetuneError(Exception):
    """Bad input to ``python -m fusetune finetune``: a missing or malformed data file, a model
    fusetune cannot patch, an option out of range, an output path that is not ours to replace.

    The message is printed as ``error: <message>`` and the command exits with status 2, having
    written nothing.
    """
