"""What a finished run leaves besides the adapter: a loss curve (``loss.png``, when matplotlib
is installed) and, with ``--merge``, the base model with the LoRA adapter merged in
(``merged/``, loadable by ``transformers.AutoModelForCausalLM.from_pretrained``)."""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

LOSS_CURVE = "loss.png"
MERGED = "merged"


def write_loss_curve(path: Path, runs: Sequence[Any]) -> bool:
    """Plot each run's per-step loss (non-finite steps left out) into a PNG; False, and no
    file, without matplotlib. A plotting failure only warns: the trained weights matter more."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return False
    try:
        figure = Figure(figsize=(6.4, 3.6))
        axes = figure.subplots()
        for run in runs:
            points = [(i + 1, v) for i, v in enumerate(run.losses) if math.isfinite(v)]
            axes.plot([s for s, _ in points], [v for _, v in points], label=run.label)
        axes.set_xlabel("optimizer step")
        axes.set_ylabel("training loss")
        axes.grid(alpha=0.3)
        axes.legend()
        figure.tight_layout()
        figure.savefig(path, dpi=100)
    except Exception as exc:  # noqa: BLE001 - a plot is never worth the run
        print(f"warning: no loss curve: {exc}", file=sys.stderr)
        path.unlink(missing_ok=True)
        return False
    return True


def merge_adapter(plan: Any, adapter: Path, target: Path) -> None:
    """Load the saved adapter onto a fresh copy of the base (16-bit, on the CPU: under
    --load-in-4bit, the unquantised base, as PEFT merges QLoRA adapters), merge it into the
    weights and save that model and the tokenizer into ``target``."""
    import peft

    from fusetune.finetune import models

    dtype = plan.precision.weight_dtype(full=False)
    base = models.build(plan.spec, dtype, torch.device("cpu"), plan.args.seed)
    merged = peft.PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
    merged.config.use_cache = True  # for generation; training had turned it off
    target.mkdir()
    merged.save_pretrained(str(target))
    plan.encoder.save(target)
