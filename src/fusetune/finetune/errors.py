"""The exceptions the fine-tuning command turns into a clear message and a non-zero exit."""

from __future__ import annotations


class FinetuneError(Exception):
    """Bad input to ``python -m fusetune finetune``: a missing or malformed data file, a model
    fusetune cannot patch, an option out of range, an output path that is not ours to replace,
    a checkpoint that does not match the run.

    The message is printed as ``error: <message>`` and the command exits with status
    ``exit_code`` (2), having written nothing.
    """

    exit_code = 2


class RunStopped(FinetuneError):
    """The run stopped after it started: a non-finite loss or gradient (exit status 1). The
    checkpoints written so far stay; the final output is not written."""

    exit_code = 1


class Interrupted(FinetuneError):
    """SIGINT or SIGTERM: the run wrote a checkpoint after the step in flight and stopped; exit
    status 128 + the signal's number, as a shell reports a process killed by it."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum
