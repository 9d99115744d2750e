"""``python -m fusetune finetune``: supervised fine-tuning (LoRA or full) of a causal LM with
fusetune applied; see ``python -m fusetune finetune --help``.

Modules: :mod:`~fusetune.finetune.args` (options), :mod:`~fusetune.finetune.data` (JSONL,
tokenisation, batches), :mod:`~fusetune.finetune.tokenizers`, :mod:`~fusetune.finetune.models`
(tiny configs, family check), :mod:`~fusetune.finetune.precision`,
:mod:`~fusetune.finetune.train` (the loop), :mod:`~fusetune.finetune.progress`,
:mod:`~fusetune.finetune.summary`, :mod:`~fusetune.finetune.output` (all-or-nothing writes),
:mod:`~fusetune.finetune.schedule` (learning-rate schedule),
:mod:`~fusetune.finetune.checkpoint` (atomic checkpoints, resume checks),
:mod:`~fusetune.finetune.interrupt` (SIGINT / SIGTERM), :mod:`~fusetune.finetune.results` (loss
curve, --merge), :mod:`~fusetune.finetune.command` (the command itself);
:mod:`~fusetune.finetune.generate` is ``python -m fusetune generate``.
"""

from fusetune.finetune.command import main
from fusetune.finetune.errors import FinetuneError

__all__ = ["FinetuneError", "main"]
