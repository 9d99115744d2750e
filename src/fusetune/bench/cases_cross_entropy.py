"""Benchmark cases for fusetune.cross_entropy: bf16 logits, forward + backward.

Providers: fusetune (gradient in its own buffer), fusetune-inplace (gradient written over the
logits; its step first re-fills them from a pristine copy, so its time includes that copy),
torch eager as HF computes it (fp32 upcast, then F.cross_entropy), torch.compile of that, and
Liger-Kernel's LigerCrossEntropyLoss when importable.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

import fusetune
from fusetune.bench.harness import Case, register

SHAPES = [(8192, 32000), (8192, 128256), (8192, 262144)]
SOFTCAPS = [None, 30.0]
CPU_SHAPE = (64, 1000)
BF16_BYTES = 2


def _torch_loss(logits: torch.Tensor, labels: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """What a HF causal-LM head does: upcast to fp32, optional softcap, F.cross_entropy."""
    logits = logits.float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return F.cross_entropy(logits, labels, ignore_index=-100)


def _step(loss_fn: Callable[[], torch.Tensor], leaf: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        loss_fn().backward()
        leaf.grad = None

    return step


def _liger_loss(softcap: float | None) -> Callable | None:
    try:
        from liger_kernel.transformers import LigerCrossEntropyLoss
    except ImportError:
        return None
    return LigerCrossEntropyLoss(softcap=softcap) if softcap else LigerCrossEntropyLoss()


def _make(rows: int, vocab: int, softcap: float | None):
    def make(device: torch.device, quick: bool) -> dict[str, Callable[[], object]]:
        n, v = (rows, vocab) if device.type == "cuda" else CPU_SHAPE
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        # A trained lm_head's logits spread over a few units; never time on zeros.
        logits = (torch.randn(n, v, device=device) * 3).to(dtype).requires_grad_()
        labels = torch.randint(0, v, (n,), device=device)
        labels[::7] = -100
        providers = {
            "fusetune": _step(
                lambda: fusetune.cross_entropy(logits, labels, logit_softcap=softcap), logits
            ),
            "torch": _step(lambda: _torch_loss(logits, labels, softcap), logits),
        }
        if device.type == "cuda":
            pristine, work = logits.detach().clone(), logits.detach().clone()

            def inplace_step() -> None:
                with torch.no_grad():
                    work.copy_(pristine)  # the last step overwrote the logits with a gradient
                leaf = work.requires_grad_()
                loss = fusetune.cross_entropy(
                    leaf, labels, logit_softcap=softcap, inplace_backward=True
                )
                torch.autograd.grad(loss, leaf)  # returns the overwritten buffer: no copy
                work.requires_grad_(False)

            providers["fusetune-inplace"] = inplace_step
            compiled = torch.compile(_torch_loss)
            providers["torch.compile"] = _step(lambda: compiled(logits, labels, softcap), logits)
            liger = _liger_loss(softcap)
            if liger is not None:
                providers["liger"] = _step(lambda: liger(logits, labels), logits)
        return providers

    return make


def _floor_bytes(rows: int, vocab: int) -> Callable[[bool], float]:
    # Read the logits once, write their gradient once.
    return lambda quick: 2.0 * rows * vocab * BF16_BYTES


for _rows, _vocab in SHAPES:
    for _softcap in SOFTCAPS:
        register(
            Case(
                op="cross_entropy",
                name=f"{_rows}x{_vocab} bf16" + (f" softcap={_softcap:g}" if _softcap else ""),
                make=_make(_rows, _vocab, _softcap),
                floor_bytes=_floor_bytes(_rows, _vocab),
            )
        )
