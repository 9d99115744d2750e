"""Which precision a fine-tuning run uses, and why.

``auto``: bf16 on a GPU that has it (compute capability 8.0 and up), fp16 with loss scaling
(``torch.amp.GradScaler``) on an older GPU, fp32 on the CPU. How the weights are kept:

- LoRA: the frozen base weights in the 16-bit dtype, the adapters in fp32 (PEFT's default), the
  forward under ``torch.autocast`` in that dtype;
- full fine-tuning: fp32 master weights and optimizer state, the forward under autocast (as HF
  Trainer's ``bf16=True`` / ``fp16=True`` do with an fp32 model).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusetune.finetune.errors import FinetuneError

CHOICES = ("auto", "bf16", "fp16", "fp32")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Precision:
    """A resolved precision: ``name`` is bf16, fp16 or fp32; ``reason`` says why it was picked."""

    name: str
    reason: str

    @property
    def compute_dtype(self) -> torch.dtype:
        return _DTYPES[self.name]

    @property
    def autocast(self) -> bool:
        return self.name != "fp32"

    @property
    def grad_scaler(self) -> bool:
        """fp16 gradients underflow without loss scaling; bf16 has fp32's exponent range."""
        return self.name == "fp16"

    def weight_dtype(self, full: bool) -> torch.dtype:
        """Base weights: fp32 masters for full fine-tuning, the compute dtype under LoRA."""
        return torch.float32 if full else self.compute_dtype

    def describe(self) -> str:
        scaling = " with loss scaling (GradScaler)" if self.grad_scaler else ""
        return f"{self.name}{scaling}: {self.reason}"


def bf16_supported(device: torch.device) -> bool:
    """Native bfloat16 on this CUDA device (not the slow emulation older GPUs offer)."""
    if device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 8


def choose_precision(requested: str, device_type: str, has_bf16: bool) -> Precision:
    """The precision for ``--precision requested`` on a ``device_type`` ("cuda" or "cpu")
    device; ``has_bf16``: whether that GPU runs bfloat16 natively.

    Raises :class:`FinetuneError` for fp16 on the CPU (loss scaling is a GPU feature here) and
    for bf16 on a GPU without it.
    """
    if requested not in CHOICES:
        raise FinetuneError(f"--precision must be one of {', '.join(CHOICES)}, got {requested!r}")
    cuda = device_type == "cuda"
    if requested == "auto":
        if not cuda:
            return Precision("fp32", "running on the CPU")
        if has_bf16:
            return Precision("bf16", "the GPU supports bfloat16")
        return Precision("fp16", "the GPU has no native bfloat16 (compute capability < 8.0)")
    if requested == "fp16" and not cuda:
        raise FinetuneError("--precision fp16 needs a CUDA GPU; on the CPU use fp32 or bf16")
    if requested == "bf16" and cuda and not has_bf16:
        raise FinetuneError(
            "--precision bf16: this GPU has no native bfloat16 (compute capability < 8.0); "
            "use fp16 (with loss scaling) or auto"
        )
    return Precision(requested, f"--precision {requested}")
