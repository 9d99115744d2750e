"""Benchmark cases for fusetune.grpo_loss: one GRPO policy step (forward + backward, gradients
for the hidden states and the lm_head weight), bf16, DAPO aggregation with old and reference
log-probs and a KL penalty (beta = 0.04), token-level ratios.

Providers: fusetune, fusetune-frozen-weight (LoRA: no lm_head gradient), torch eager as TRL
computes it (logits, fp32 upcast, log_softmax, gather, then the same formulas), torch.compile of
that, and Liger-Kernel's LigerFusedLinearGRPOLoss when importable.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import fusetune
from fusetune.bench.harness import Case, register
from fusetune.reference.grpo import grpo_loss_from_logps

SHAPES = [(8, 1024, 4096, 128256)]
CPU_SHAPE = (2, 24, 32, 500)
OPTIONS = dict(beta=0.04, epsilon_low=0.2, epsilon_high=0.2, loss_type="dapo")


def _torch_loss(hidden, weight, token_ids, mask, advantages, old_logps, ref_logps):
    """TRL's GRPOTrainer: bf16 logits, upcast, log_softmax, gather; then the loss formulas."""
    logits = (hidden @ weight.t()).float()
    logps = logits.log_softmax(-1).gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
    loss, _ = grpo_loss_from_logps(
        logps, mask, advantages, old_logps=old_logps, ref_logps=ref_logps, **OPTIONS
    )
    return loss


def _fusetune_loss(hidden, weight, token_ids, mask, advantages, old_logps, ref_logps):
    loss, _ = fusetune.grpo_loss(
        hidden,
        weight,
        token_ids,
        mask,
        advantages,
        old_logps=old_logps,
        ref_logps=ref_logps,
        **OPTIONS,
    )
    return loss


def _liger_loss() -> Callable | None:
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    except ImportError:
        return None
    liger = LigerFusedLinearGRPOLoss(**OPTIONS)

    def loss(hidden, weight, token_ids, mask, advantages, old_logps, ref_logps):
        result = liger(
            hidden,
            weight,
            token_ids,
            mask,
            advantages,
            ref_per_token_logps=ref_logps,
            old_per_token_logps=old_logps,
        )
        return result[0] if isinstance(result, tuple) else result

    return loss


def _step(loss_fn: Callable, hidden, weight, *rest) -> Callable[[], None]:
    def step() -> None:
        loss_fn(hidden, weight, *rest).backward()
        hidden.grad = None
        weight.grad = None

    return step


def _make(batch: int, time: int, hidden_size: int, vocab: int):
    def make(device: torch.device, quick: bool) -> dict[str, Callable[[], object]]:
        b, t, h, v = (batch, time, hidden_size, vocab) if device.type == "cuda" else CPU_SHAPE
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        # Logits spread over a few units, as a trained lm_head's; never time on zeros.
        hidden = torch.randn(b, t, h, device=device).to(dtype).requires_grad_()
        weight = (torch.randn(v, h, device=device) * 2 / h**0.5).to(dtype).requires_grad_()
        token_ids = torch.randint(0, v, (b, t), device=device)
        lengths = torch.randint(t // 2, t + 1, (b, 1), device=device)
        mask = torch.arange(t, device=device)[None, :] < lengths
        advantages = torch.randn(b, device=device)
        with torch.no_grad():
            logps = fusetune.selective_log_softmax(hidden, weight, token_ids)
        old_logps = logps + 0.1 * torch.randn_like(logps)
        ref_logps = logps + 0.1 * torch.randn_like(logps)
        rest = (token_ids, mask, advantages, old_logps, ref_logps)
        providers = {
            "fusetune": _step(_fusetune_loss, hidden, weight, *rest),
            "fusetune-frozen-weight": _step(_fusetune_loss, hidden, weight.detach(), *rest),
            "torch": _step(_torch_loss, hidden, weight, *rest),
        }
        if device.type == "cuda":
            providers["torch.compile"] = _step(torch.compile(_torch_loss), hidden, weight, *rest)
            liger = _liger_loss()
            if liger is not None:
                providers["liger"] = _step(liger, hidden, weight, *rest)
        return providers

    return make


def _flops(batch: int, time: int, hidden_size: int, vocab: int):
    """Three matmuls (logits, grad hidden, grad weight) of 2 N H V FLOPs each."""

    def floor(quick: bool) -> float:
        b, t, h, v = CPU_SHAPE if quick else (batch, time, hidden_size, vocab)
        return 3 * 2.0 * b * t * h * v

    return floor


for _shape in SHAPES:
    register(
        Case(
            op="grpo",
            name="B{}xT{} H{} V{} bf16".format(*_shape),
            make=_make(*_shape),
            floor_flops=_flops(*_shape),
        )
    )
