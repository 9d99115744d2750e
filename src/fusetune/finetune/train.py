"""The supervised fine-tuning loop: AdamW, gradient accumulation with HF's
``num_items_in_batch`` (the accumulated loss equals one big batch's), optional loss scaling,
gradient clipping, one host sync per optimizer step (for the loss the progress bar shows)."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from fusetune.finetune.data import Batch
from fusetune.finetune.distributed import Ranks, all_sum
from fusetune.finetune.precision import Precision
from fusetune.finetune.progress import ProgressBar, format_memory, peak_memory

# Steps left out of the throughput: the first one compiles and autotunes kernels.
WARMUP_STEPS = 1


@dataclass
class RunResult:
    """What one run measured. ``tokens_per_s`` leaves out the first step when there are 3 or
    more (kernel compilation); ``peak_memory`` is the CUDA allocator's peak over the whole run,
    model and optimizer state included (on the CPU: the process's peak RSS)."""

    label: str
    losses: list[float] = field(default_factory=list)
    tokens: int = 0
    timed_tokens: int = 0
    timed_seconds: float = 0.0
    seconds: float = 0.0
    peak_memory: int | None = None
    memory_kind: str = ""

    @property
    def tokens_per_s(self) -> float:
        return self.timed_tokens / self.timed_seconds if self.timed_seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "losses": self.losses,
            "tokens": self.tokens,
            "tokens_per_s": self.tokens_per_s,
            "seconds": self.seconds,
            "peak_memory_bytes": self.peak_memory,
            "memory_kind": self.memory_kind,
        }


@dataclass(frozen=True)
class TrainSettings:
    lr: float
    max_grad_norm: float
    precision: Precision
    device: torch.device
    ranks: Ranks = Ranks()


def train(
    model: torch.nn.Module,
    steps: list[list[Batch]],
    settings: TrainSettings,
    label: str,
    progress: ProgressBar | None = None,
) -> RunResult:
    """Run one optimizer step per entry of ``steps`` (each a list of micro-batches)."""
    params = [p for p in model.parameters() if p.requires_grad]
    device = settings.device
    optimizer = torch.optim.AdamW(
        params, lr=settings.lr, weight_decay=0.0, fused=device.type == "cuda"
    )
    scaler = torch.amp.GradScaler(device.type) if settings.precision.grad_scaler else None
    result = RunResult(label)
    model.train()
    skip = WARMUP_STEPS if len(steps) >= 3 else 0
    start = time.perf_counter()
    try:
        for index, micro_batches in enumerate(steps):
            step_start = time.perf_counter()
            loss = _step(model, micro_batches, optimizer, scaler, params, settings)
            seconds = time.perf_counter() - step_start
            tokens = sum(batch.tokens for batch in micro_batches)
            result.losses.append(loss)
            result.tokens += tokens
            if index >= skip:
                result.timed_tokens += tokens
                result.timed_seconds += seconds
            result.peak_memory, result.memory_kind = peak_memory(device)
            if progress is not None:
                rate = result.tokens_per_s or tokens / seconds
                memory = format_memory(result.peak_memory, result.memory_kind)
                elapsed = time.perf_counter() - start
                progress.update(index + 1, loss, rate, memory, elapsed)
    finally:
        if progress is not None:
            progress.close()
    result.seconds = time.perf_counter() - start
    return result


def _autocast(precision: Precision, device: torch.device):
    if not precision.autocast:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=precision.compute_dtype)


def _step(model, micro_batches, optimizer, scaler, params, settings: TrainSettings) -> float:
    device, precision = settings.device, settings.precision
    # The loss of every micro-batch is its sum over tokens / the step's token count, so the
    # accumulated gradient is that of the mean over the whole step, however tokens fall.
    ranks = settings.ranks
    items = torch.tensor(sum(b.label_count for b in micro_batches), device=device)
    items = all_sum(items, ranks)  # the step's labelled tokens over every rank
    total = torch.zeros((), device=device)
    for batch in micro_batches:
        with _autocast(precision, device):
            output = model(
                input_ids=batch.input_ids.to(device, non_blocking=True),
                attention_mask=batch.attention_mask.to(device, non_blocking=True),
                labels=batch.labels.to(device, non_blocking=True),
                num_items_in_batch=items,
            )
        loss = output.loss
        scaled = loss * ranks.world  # FSDP2 averages gradients over ranks: sum them instead
        (scaler.scale(scaled) if scaler is not None else scaled).backward()
        total += loss.detach().float()
    total = all_sum(total, ranks)
    if scaler is not None:
        scaler.unscale_(optimizer)
    if settings.max_grad_norm > 0:
        torch.nn.utils.clip_grad_norm_(params, settings.max_grad_norm)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(total)  # the step's one host-device sync
