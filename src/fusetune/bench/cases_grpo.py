"""Benchmark cases for the RL head: ``grpo``, one GRPO policy step from hidden states (forward +
backward, gradients for the hidden states and the lm_head weight), bf16, DAPO aggregation with old
and reference log-probs and a KL penalty (beta = 0.04), token-level ratios; and ``log_probs``,
per-token log-probs and entropy from hidden states with a backward through the log-probs (what
GRPOTrainer's head does each step).

Providers: fusetune, fusetune-frozen-weight (LoRA: no lm_head gradient), trl (TRL 1.16's fused
head, ``trl.kernels.chunked_logprob``, then TRL's loss formulas: what GRPOTrainer runs), torch
eager as TRL computed it before its fused head (logits, fp32 upcast, log_softmax, gather, then
the same formulas), torch.compile of that, and Liger-Kernel's LigerFusedLinearGRPOLoss.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import torch

import fusetune
from fusetune.bench.harness import Case, register, three_products_floor
from fusetune.reference.grpo import grpo_loss_from_logps

# (B, T, H, V): Llama-3-8B, Qwen2.5-0.5B, Llama-3.2-1B, Qwen2.5-7B heads at 8192 tokens
SHAPES = [(8, 1024, 4096, 128256), (8, 1024, 896, 151936), (8, 1024, 2048, 128256),
          (8, 1024, 3584, 152064)]  # fmt: skip
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


def trl_head() -> Callable | None:
    """TRL's fused head (``ChunkedLogProbFunction.apply``), or None without TRL. The kernel file
    needs only torch and transformers; where TRL's package import fails (a machine missing one of
    TRL's other dependencies) the file is loaded on its own."""
    try:
        from trl.kernels.chunked_logprob import ChunkedLogProbFunction
    except ImportError:
        spec = importlib.util.find_spec("trl")
        if spec is None or not spec.submodule_search_locations:
            return None
        path = Path(spec.submodule_search_locations[0]) / "kernels" / "chunked_logprob.py"
        file_spec = importlib.util.spec_from_file_location("_trl_chunked_logprob", path)
        module = importlib.util.module_from_spec(file_spec)
        file_spec.loader.exec_module(module)
        ChunkedLogProbFunction = module.ChunkedLogProbFunction  # noqa: N806 (TRL's name)
    return ChunkedLogProbFunction.apply


def _trl_logps(head: Callable, hidden, weight, token_ids, entropy: bool = True):
    """GRPOTrainer's call: flat rows, temperature 1, TRL's vocabulary tile, no softcap."""
    outputs = ("log_probs", "entropy") if entropy else ("log_probs",)
    flat = hidden.reshape(-1, hidden.shape[-1])
    result = head(flat, weight, None, token_ids.reshape(-1), 1.0, 32768, None, 1.0, outputs)
    return result[0].view(token_ids.shape), result[1]


def _trl_loss(head: Callable) -> Callable:
    def loss(hidden, weight, token_ids, mask, advantages, old_logps, ref_logps):
        logps, _ = _trl_logps(head, hidden, weight, token_ids)
        value, _ = grpo_loss_from_logps(
            logps, mask, advantages, old_logps=old_logps, ref_logps=ref_logps, **OPTIONS
        )
        return value

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
            head = trl_head()
            if head is not None:
                providers["trl"] = _step(_trl_loss(head), hidden, weight, *rest)
            providers["torch.compile"] = _step(torch.compile(_torch_loss), hidden, weight, *rest)
            liger = _liger_loss()
            if liger is not None:
                providers["liger"] = _step(liger, hidden, weight, *rest)
        return providers

    return make


def _log_probs_make(batch: int, time: int, hidden_size: int, vocab: int):
    """Log-probs and entropy (no gradient into the entropy, as GRPO without an entropy bonus),
    backward through the log-probs with a random upstream gradient."""

    def make(device: torch.device, quick: bool) -> dict[str, Callable[[], object]]:
        b, t, h, v = (batch, time, hidden_size, vocab) if device.type == "cuda" else CPU_SHAPE
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        hidden = torch.randn(b, t, h, device=device).to(dtype).requires_grad_()
        weight = (torch.randn(v, h, device=device) * 2 / h**0.5).to(dtype).requires_grad_()
        token_ids = torch.randint(0, v, (b, t), device=device)
        upstream = torch.randn(b, t, device=device)

        def step(logps_of: Callable) -> Callable[[], None]:
            def run() -> None:
                logps_of().backward(upstream)
                hidden.grad = weight.grad = None

            return run

        def fused():
            out = fusetune.selective_log_softmax(hidden, weight, token_ids, return_entropy=True)
            return out.log_probs

        def torch_eager():
            logits = (hidden @ weight.t()).float()
            logp = logits.log_softmax(-1)
            _ = -(logp.exp() * logp).sum(-1).detach()  # the entropy TRL logged
            return logp.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)

        providers = {"fusetune": step(fused), "torch": step(torch_eager)}
        head = trl_head() if device.type == "cuda" else None
        if head is not None:
            providers["trl"] = step(lambda: _trl_logps(head, hidden, weight, token_ids)[0])
        return providers

    return make


for _index, _shape in enumerate(SHAPES):
    _gpu_only = _index > 0  # the CPU smoke run times one tiny shape per op
    register(
        Case(
            op="grpo",
            name="B{}xT{} H{} V{} bf16".format(*_shape),
            make=_make(*_shape),
            floor_flops=three_products_floor(_shape, CPU_SHAPE),
            gpu_only=_gpu_only,
        )
    )
    register(
        Case(
            op="log_probs",
            name="B{}xT{} H{} V{} bf16, entropy".format(*_shape),
            make=_log_probs_make(*_shape),
            floor_flops=three_products_floor(_shape, CPU_SHAPE),
            gpu_only=_gpu_only,
        )
    )
