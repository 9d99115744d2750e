"""Benchmark cases for fusetune.linear_cross_entropy: bf16 hidden states and lm_head weight,
forward + backward, gradients for both (and a frozen-weight variant, as under LoRA).

Providers: fusetune, fusetune-frozen-weight (no weight gradient), fusetune-2048-rows (wider
chunks: more memory, fewer re-reads of the weight gradient), torch eager as a HF causal-LM
head computes it (matmul, fp32 upcast, F.cross_entropy), torch.compile of that, Liger-Kernel's
LigerFusedLinearCrossEntropyLoss and Cut Cross-Entropy's linear_cross_entropy when importable.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

import fusetune
from fusetune.bench.harness import Case, register, three_products_floor

SHAPES = [(8192, 4096, 128256), (8192, 2304, 256000), (8192, 896, 151936), (32768, 4096, 128256)]
CPU_SHAPE = (48, 32, 500)
WIDE_CHUNK = 2048


def _torch_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """What a HF causal-LM head does: lm_head matmul, upcast to fp32, F.cross_entropy."""
    logits = (hidden @ weight.t()).float()
    return F.cross_entropy(logits, labels, ignore_index=-100)


def _wide_chunks(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor):
    return fusetune.linear_cross_entropy(hidden, weight, labels, chunk_size=WIDE_CHUNK)


def _peer_losses() -> dict[str, Callable]:
    peers: dict[str, Callable] = {}
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss()
        peers["liger"] = lambda hidden, weight, labels: liger(weight, hidden, labels)
    except ImportError:
        pass
    try:
        from cut_cross_entropy import linear_cross_entropy as cce_loss

        peers["cce"] = cce_loss
    except ImportError:
        pass
    return peers


def _step(loss_fn: Callable, hidden, weight, labels) -> Callable[[], None]:
    def step() -> None:
        loss_fn(hidden, weight, labels).backward()
        hidden.grad = None
        weight.grad = None

    return step


def _make(rows: int, hidden_size: int, vocab: int):
    def make(device: torch.device, quick: bool) -> dict[str, Callable[[], object]]:
        n, h, v = (rows, hidden_size, vocab) if device.type == "cuda" else CPU_SHAPE
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        # Logits spread over a few units, as a trained lm_head's; never time on zeros.
        hidden = torch.randn(n, h, device=device).to(dtype).requires_grad_()
        weight = (torch.randn(v, h, device=device) * 2 / h**0.5).to(dtype).requires_grad_()
        frozen = weight.detach()
        labels = torch.randint(0, v, (n,), device=device)
        labels[::7] = -100
        providers = {
            "fusetune": _step(fusetune.linear_cross_entropy, hidden, weight, labels),
            "fusetune-frozen-weight": _step(fusetune.linear_cross_entropy, hidden, frozen, labels),
            # the other side of the memory / speed trade: chunks of 2048 rows, not the default's
            f"fusetune-{WIDE_CHUNK}-rows": _step(_wide_chunks, hidden, weight, labels),
            "torch": _step(_torch_loss, hidden, weight, labels),
        }
        if device.type == "cuda":
            providers["torch.compile"] = _step(torch.compile(_torch_loss), hidden, weight, labels)
            for name, loss in _peer_losses().items():
                providers[name] = _step(loss, hidden, weight, labels)
        return providers

    return make


for _rows, _hidden, _vocab in SHAPES:
    register(
        Case(
            op="linear_cross_entropy",
            name=f"{_rows}x{_hidden}x{_vocab} bf16",
            make=_make(_rows, _hidden, _vocab),
            floor_flops=three_products_floor((_rows, _hidden, _vocab), CPU_SHAPE),
        )
    )
