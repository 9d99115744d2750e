"""Loss modules: thin wrappers that hold an op's options."""

from __future__ import annotations

import torch

from fusetune.ops.cross_entropy import cross_entropy
from fusetune.ops.grpo import grpo_loss
from fusetune.ops.linear_cross_entropy import linear_cross_entropy


class _LossWithOptions(torch.nn.Module):
    """Holds an op's keyword options, fixed at construction, and shows them in repr."""

    def __init__(self, **options: object) -> None:
        super().__init__()
        self.options = options

    def extra_repr(self) -> str:
        return ", ".join(f"{key}={value!r}" for key, value in self.options.items())


class CrossEntropyLoss(_LossWithOptions):
    """Module form of :func:`fusetune.cross_entropy`; the options are fixed at construction.

    ``forward(logits, labels, num_items=None)`` takes logits [N, V] or [B, T, V] and labels
    [N] or [B, T] and returns what :func:`fusetune.cross_entropy` returns. ``weight`` (class
    weights [V]) is a buffer, as in ``torch.nn.CrossEntropyLoss``: it follows the module's
    ``.to()`` and is saved in its state dict.
    """

    def __init__(
        self,
        *,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        logit_softcap: float | None = None,
        logit_scale: float | None = None,
        z_loss: float = 0.0,
        return_z_loss: bool = False,
        inplace_backward: bool = False,
        weight: torch.Tensor | None = None,
    ) -> None:
        super().__init__(
            ignore_index=ignore_index,
            reduction=reduction,
            label_smoothing=label_smoothing,
            logit_softcap=logit_softcap,
            logit_scale=logit_scale,
            z_loss=z_loss,
            return_z_loss=return_z_loss,
            inplace_backward=inplace_backward,
        )
        self.weight: torch.Tensor | None
        self.register_buffer("weight", weight)

    def forward(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        num_items: float | torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return cross_entropy(
            logits, labels, num_items=num_items, weight=self.weight, **self.options
        )


class LinearCrossEntropyLoss(_LossWithOptions):
    """Module form of :func:`fusetune.linear_cross_entropy`; the options are fixed at
    construction.

    ``forward(hidden, weight, labels, bias=None, num_items=None, token_weight=None)`` takes
    hidden [N, H] or [B, T, H], the lm_head weight [V, H], labels [N] or [B, T], an optional
    bias [V] and optional per-token loss weights (labels' shape), and returns what
    :func:`fusetune.linear_cross_entropy` returns. The module holds no lm_head weight: pass the
    model's, so that tied embeddings and adapters keep working. ``class_weight`` (class weights
    [V], torch's ``weight=`` under the op's name) is a buffer, as torch's CrossEntropyLoss
    keeps its ``weight``.
    """

    def __init__(
        self,
        *,
        shift: bool = False,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        logit_softcap: float | None = None,
        logit_scale: float | None = None,
        z_loss: float = 0.0,
        return_z_loss: bool = False,
        chunk_size: int | None = None,
        class_weight: torch.Tensor | None = None,
    ) -> None:
        super().__init__(
            shift=shift,
            ignore_index=ignore_index,
            reduction=reduction,
            label_smoothing=label_smoothing,
            logit_softcap=logit_softcap,
            logit_scale=logit_scale,
            z_loss=z_loss,
            return_z_loss=return_z_loss,
            chunk_size=chunk_size,
        )
        self.class_weight: torch.Tensor | None
        self.register_buffer("class_weight", class_weight)

    def forward(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        bias: torch.Tensor | None = None,
        num_items: float | torch.Tensor | None = None,
        token_weight: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return linear_cross_entropy(
            hidden,
            weight,
            labels,
            bias,
            num_items=num_items,
            class_weight=self.class_weight,
            token_weight=token_weight,
            **self.options,
        )


class GRPOLoss(_LossWithOptions):
    """Module form of :func:`fusetune.grpo_loss`; the options are fixed at construction.

    ``forward(hidden, weight, token_ids, completion_mask, advantages, old_logps=None,
    ref_logps=None, bias=None, num_items_in_batch=None)`` takes hidden [B, T, H], the lm_head
    weight [V, H], token_ids and completion_mask [B, T], advantages [B] and optional log-probs
    [B, T], and returns (loss, metrics) as :func:`fusetune.grpo_loss` does. The module holds no
    weight: pass the policy's lm_head weight. Every loss type of :func:`fusetune.grpo_loss`
    (grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo) with its options; the defaults are
    the op's (``use_bias_correction_kl`` False, where TRL's GRPOConfig has True).
    """

    def __init__(
        self,
        *,
        beta: float = 0.0,
        epsilon_low: float = 0.2,
        epsilon_high: float = 0.2,
        delta: float | None = None,
        temperature: float = 1.0,
        loss_type: str = "grpo",
        importance_sampling_level: str = "token",
        max_completion_length: int | None = None,
        logit_softcap: float | None = None,
        logit_scale: float | None = None,
        chunk_size: int | None = None,
        sapo_temperature_pos: float = 1.0,
        sapo_temperature_neg: float = 1.05,
        vespo_k_pos: float = 2.0,
        vespo_lambda_pos: float = 3.0,
        vespo_k_neg: float = 3.0,
        vespo_lambda_neg: float = 2.0,
        use_bias_correction_kl: bool = False,
    ) -> None:
        super().__init__(
            beta=beta,
            epsilon_low=epsilon_low,
            epsilon_high=epsilon_high,
            delta=delta,
            temperature=temperature,
            loss_type=loss_type,
            importance_sampling_level=importance_sampling_level,
            max_completion_length=max_completion_length,
            logit_softcap=logit_softcap,
            logit_scale=logit_scale,
            chunk_size=chunk_size,
            sapo_temperature_pos=sapo_temperature_pos,
            sapo_temperature_neg=sapo_temperature_neg,
            vespo_k_pos=vespo_k_pos,
            vespo_lambda_pos=vespo_lambda_pos,
            vespo_k_neg=vespo_k_neg,
            vespo_lambda_neg=vespo_lambda_neg,
            use_bias_correction_kl=use_bias_correction_kl,
        )

    def forward(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        token_ids: torch.Tensor,
        completion_mask: torch.Tensor,
        advantages: torch.Tensor,
        old_logps: torch.Tensor | None = None,
        ref_logps: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        num_items_in_batch: float | torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return grpo_loss(
            hidden,
            weight,
            token_ids,
            completion_mask,
            advantages,
            old_logps=old_logps,
            ref_logps=ref_logps,
            bias=bias,
            num_items_in_batch=num_items_in_batch,
            **self.options,
        )
