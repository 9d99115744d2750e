"""TRL's trainers (GRPOTrainer, SFTTrainer, ...) through fusetune.

    trainer = trl.GRPOTrainer(model=..., reward_funcs=..., args=..., train_dataset=...)
    fusetune.apply(trainer)          # the policy (and reference) models, and TRL's LM head
    trainer.train()
    fusetune.revert(trainer)         # TRL's own head and transformers' forwards back

TRL 1.x scores tokens with its own fused LM head: ``add_fused_lm_head`` wraps the model's
forward so that ``model(..., fused_lm_head=True)`` runs the backbone and then
``_ChunkedLogProbFunction.apply(hidden, weight, bias, targets, temperature, chunk_size,
softcap, logit_scale, outputs)`` for the per-token log-probs, entropy and top-1 match that every
trainer's loss and metrics are built from. :func:`apply` serves that one call from fusetune's
kernels (:func:`fusetune.selective_log_softmax` with ``return_entropy`` / ``return_top1``) and
leaves TRL's loss code as it is, so every ``loss_type``, importance-sampling level, clipping,
KL, entropy mask, entropy bonus and vLLM correction is TRL's own formula, exactly: the seam is
the narrowest TRL has, and the one most likely to survive its releases (replacing
``_compute_loss`` would mean re-implementing each option). The backbone goes through
:func:`fusetune.apply` as for any transformers model.

What is served: ``log_probs`` and ``entropy`` (both differentiable) and ``is_top1``. A call that
asks for a field fusetune does not compute (``log_sum_sq_probs``, ``mean_logits``: DPO and KTO
ask for them) runs TRL's own kernel for that call, with one warning naming the field. GRPO asks
for log-probs and entropy only, so every GRPOConfig option (each loss type and level,
``off_policy_mask_threshold``, ``top_entropy_quantile``, ``mask_truncated_completions``, the
entropy bonus, adaptive or not, the vLLM importance-sampling correction) is TRL's own loss code
on fusetune's numbers: none falls back and none warns (tests/test_trl_grpo.py checks each
against unpatched TRL). Under autocast over fp32 weights (``bf16=True``) the head's weight and
hidden gradients are summed in fp32, as TRL's are. TRL's ``chunk_size`` (a vocabulary
tile) is ignored: fusetune sizes its row chunks itself. With ``cast_lm_head_to_fp32`` (fp32
hidden states outside autocast) the head is computed in fp32, as TRL does.

TRL's head is a module-level function, so while any trainer is patched every fused-head call in
the process goes through fusetune (as the RoPE patch is per family); :func:`revert` of the last
patched trainer restores TRL's.
"""

from __future__ import annotations

import importlib.metadata
import warnings

import torch

from fusetune.ops.grpo import selective_log_softmax

TESTED_TRL = ("1.16.0",)
SERVED_OUTPUTS = ("log_probs", "entropy", "is_top1")
_MARK = "_fusetune_trl"
_state = {"original": None, "trainers": 0, "warned": set()}


class FusedHead:
    """Stands in for ``trl.trainer.utils._ChunkedLogProbFunction``: the same ``apply`` and the
    same five outputs (log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1)."""

    calls = 0  # fusetune-served calls, for tests and for users who check the route

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
              logit_scale=1.0, outputs=("log_probs",)):  # fmt: skip
        unserved = [name for name in outputs if name not in SERVED_OUTPUTS]
        if unserved:
            _warn_once(f"TRL asked its fused head for {', '.join(unserved)}, which fusetune does "
                       "not compute: TRL's own kernel serves those calls")  # fmt: skip
            return _state["original"].apply(
                hidden,
                weight,
                bias,
                targets,
                temperature,
                chunk_size,
                final_logit_softcapping,
                logit_scale,
                outputs,
            )
        device_type = hidden.device.type
        if hidden.dtype == torch.float32 and not torch.is_autocast_enabled(device_type):
            # TRL computes in hidden's dtype outside autocast (cast_lm_head_to_fp32): so do we
            weight = weight.float()
            bias = None if bias is None else bias.float()
        FusedHead.calls += 1
        out = selective_log_softmax(
            hidden,
            weight,
            targets,
            bias=bias,
            temperature=temperature,
            logit_softcap=final_logit_softcapping,
            logit_scale=None if logit_scale == 1.0 else logit_scale,
            return_entropy="entropy" in outputs,
            return_top1="is_top1" in outputs,
        )
        if isinstance(out, torch.Tensor):  # log-probs alone
            return out, None, None, None, None
        return out.log_probs, out.entropy, None, None, out.is_top1


def _warn_once(message: str) -> None:
    if message not in _state["warned"]:
        _state["warned"].add(message)
        warnings.warn(f"fusetune.integrations.trl: {message}", stacklevel=3)


def is_trainer(obj: object) -> bool:
    """A TRL trainer (anything from ``trl`` with a ``model``), without importing TRL."""
    module = type(obj).__module__ or ""
    return module.split(".")[0] == "trl" and hasattr(obj, "model")


def _check_version() -> None:
    version = importlib.metadata.version("trl")
    if version not in TESTED_TRL:
        _warn_once(f"tested with TRL {', '.join(TESTED_TRL)}, found {version}")


def _models(trainer) -> list[torch.nn.Module]:
    models = [trainer.model]
    ref_model = getattr(trainer, "ref_model", None)
    if ref_model is not None and ref_model is not trainer.model:
        models.append(ref_model)
    return models


def apply(trainer, **options):
    """Route ``trainer``'s models through :func:`fusetune.apply` (``options`` as there, but for
    ``linear_cross_entropy``: TRL's head, now fusetune's, computes every loss) and TRL's fused
    LM head through fusetune's kernels. Idempotent; returns ``trainer``.

    Raises:
        TypeError: ``trainer`` is not a TRL trainer. ValueError: a model family fusetune does
            not patch (from :func:`fusetune.apply`). Warns once when TRL is outside
            ``TESTED_TRL``.
    """
    from fusetune.integrations import transformers as hf_integration

    if not is_trainer(trainer):
        raise TypeError(f"trainer must be a TRL trainer, got {type(trainer).__name__}")
    if getattr(trainer, _MARK, False):
        return trainer
    _check_version()
    # TRL wrapped each model's forward with its fused head (the loss comes from it): keep that
    # wrapper, so no fused linear cross-entropy forward goes over it.
    options = {**options, "linear_cross_entropy": False}
    for model in _models(trainer):
        hf_integration.apply(model, **options)
    import trl.trainer.utils as trl_utils

    if _state["trainers"] == 0:
        _state["original"] = trl_utils._ChunkedLogProbFunction
        trl_utils._ChunkedLogProbFunction = FusedHead
    _state["trainers"] += 1
    setattr(trainer, _MARK, True)
    return trainer


def revert(trainer):
    """Undo :func:`apply` for ``trainer``; TRL's head comes back with the last one. Returns
    ``trainer``."""
    from fusetune.integrations import transformers as hf_integration

    if not getattr(trainer, _MARK, False):
        return trainer
    for model in _models(trainer):
        hf_integration.revert(model)
    delattr(trainer, _MARK)
    _state["trainers"] -= 1
    if _state["trainers"] == 0:
        import trl.trainer.utils as trl_utils

        trl_utils._ChunkedLogProbFunction = _state["original"]
        _state["original"] = None
    return trainer
