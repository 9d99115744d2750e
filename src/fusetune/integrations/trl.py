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

TRL's head is a module-level function, swapped while any trainer is patched (:func:`revert` of
the last one restores TRL's); fusetune serves only the calls made inside the fused forwards of
patched trainers' models, so another trainer in the same process keeps TRL's own kernel.

Sharded heads (FSDP2). With the head in the root's FSDP group (accelerate's FSDP2 plugin: the
decoder layers, then the root), the root's forward has gathered it and TRL hands fusetune the
unsharded parameter: its gradient goes to FSDP's reduce-scatter as any parameter's. With
``fully_shard`` applied to ``lm_head`` itself (torchtitan's layout), TRL's forward reads a
sharded DTensor and gathers it with ``full_tensor()``, whose backward keeps each rank's own
gradient: the head's gradient is then not reduced over ranks (TRL 1.16 with its own kernel
too: at 2 gloo ranks the head's gradient was off by its own size, the rest exact).
:func:`apply` wraps TRL's fused forward so that such a head runs fusetune's kernel inside the
head module's own call (:func:`run_inside`): FSDP's hooks gather the weight once for the call
(the kernel tiles rows over the whole weight, no gather per chunk), free it as configured, and
reduce-scatter its gradient. A head DeepSpeed ZeRO-3 partitions runs the same way: ZeRO's hooks
gather it for the call and again for the backward, and reduce its gradient (TRL's own gather
context holds the weight for the forward only, and fusetune's backward reads it again). A
DTensor head outside an FSDP2 module warns once (naming the module and the reason) and is
served on TRL's gathered weight.
"""

from __future__ import annotations

import functools
import importlib.metadata
import warnings

import torch

from fusetune.integrations._transformers_forwards import run_inside
from fusetune.ops.grpo import selective_log_softmax

TESTED_TRL = ("1.16.0",)
SERVED_OUTPUTS = ("log_probs", "entropy", "is_top1")
_MARK = "_fusetune_trl"
# serving: how many patched models' fused forwards are running now (calls outside them are
# another trainer's: TRL's own kernel serves those)
_state = {"original": None, "trainers": 0, "warned": set(), "serving": 0}
_WRAPPED = "_fusetune_trl_forward"  # the model attribute holding TRL's fused forward


class FusedHead:
    """Stands in for ``trl.trainer.utils._ChunkedLogProbFunction``: the same ``apply`` and the
    same five outputs (log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1)."""

    calls = 0  # fusetune-served eager calls, for tests and for users who check the route

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
              logit_scale=1.0, outputs=("log_probs",)):  # fmt: skip
        if not _served(outputs, weight):
            return _state["original"].apply(
                hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping,
                logit_scale, outputs,
            )  # fmt: skip
        ticket = _HeadTicket.current
        if ticket is not None and weight is ticket.weight:  # a sharded head: in its own call
            ticket.used = True
            head = ticket.head

            def inside(rows: torch.Tensor):
                out = _serve(rows, head.weight, head.bias, targets, temperature,
                             final_logit_softcapping, logit_scale, outputs)  # fmt: skip
                # FSDP hooks the outputs for its pre-backward gather: views of one buffer
                # would lose that hook to an in-place op (it warns), so each is its own tensor
                return tuple(t if t is None or t._base is None else t.clone() for t in out)

            return run_inside(head, inside, hidden)
        return _serve(hidden, weight, bias, targets, temperature, final_logit_softcapping,
                      logit_scale, outputs)  # fmt: skip


def _served(outputs, weight) -> bool:
    """Whether fusetune serves this head call. Not outside a patched trainer's models (another
    trainer's call: TRL's kernel, silently), nor for an output it does not compute or a head
    ZeRO-3 partitions (TRL's kernel, with one warning saying why)."""
    if _state["serving"] == 0:
        return False
    unserved = [name for name in outputs if name not in SERVED_OUTPUTS]
    if unserved:
        _warn_once(f"TRL asked its fused head for {', '.join(unserved)}, which fusetune does "
                   "not compute: TRL's own kernel serves those calls")  # fmt: skip
        return False
    if hasattr(weight, "ds_id"):
        _warn_once("lm_head is partitioned by DeepSpeed ZeRO-3: TRL's own kernel serves its "
                   "calls (its gather holds the weight for the forward only)")  # fmt: skip
        return False
    return True


def _serve(hidden, weight, bias, targets, temperature, softcap, logit_scale, outputs) -> tuple:
    """fusetune's kernel for one TRL head call: the five outputs of TRL's function."""
    device_type = hidden.device.type
    if hidden.dtype == torch.float32 and not torch.is_autocast_enabled(device_type):
        # TRL computes in hidden's dtype outside autocast (cast_lm_head_to_fp32): so do we
        weight = weight.float()
        bias = None if bias is None else bias.float()
    # eager calls alone are counted: Dynamo would guard a traced count's value and compile
    # again on every call
    if not torch.compiler.is_compiling():
        FusedHead.calls += 1
    out = selective_log_softmax(
        hidden,
        weight,
        targets,
        bias=bias,
        temperature=temperature,
        logit_softcap=softcap,
        logit_scale=None if logit_scale == 1.0 else logit_scale,
        return_entropy="entropy" in outputs,
        return_top1="is_top1" in outputs,
    )
    if isinstance(out, torch.Tensor):  # log-probs alone
        return out, None, None, None, None
    return out.log_probs, out.entropy, None, None, out.is_top1


class _HeadTicket:
    """What TRL's fused forward sees as the LM head while a head sharded on its own (FSDP2's
    ``fully_shard(lm_head)``) waits for its own call: ``weight`` (and ``bias``) are empty
    markers on the head's device, so TRL neither reads nor gathers the sharded DTensor;
    :class:`FusedHead` recognises the marker and runs inside ``head``'s call."""

    current: _HeadTicket | None = None  # the ticket of the fused forward running now

    def __init__(self, head: torch.nn.Module):
        device = head.weight.device  # a DTensor's device is its local shard's
        self.head, self.used = head, False
        self.weight = torch.empty(0, device=device)
        self.bias = None if head.bias is None else torch.empty(0, device=device)
        status = getattr(head.weight, "ds_status", None)
        if status is not None:  # ZeRO-3: TRL's gather skips what says it is available
            for marker in (self.weight, self.bias):
                if marker is not None:
                    marker.ds_status = type(status).AVAILABLE


def _fsdp_module() -> type | tuple:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return ()
    return FSDPModule


def _is_dtensor(tensor: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(tensor, DTensor)


def _wrap_trl_forward(model: torch.nn.Module) -> None:
    """Wrap the fused forward TRL put on ``model`` (``add_fused_lm_head``) so that a head FSDP2
    shards on its own runs inside its own call, and a DTensor head that fusetune cannot route
    warns once. Nothing changes for a plain head or for calls without ``fused_lm_head``."""
    trl_forward = model.__dict__["forward"]

    @functools.wraps(trl_forward)
    def forward(*args, **kwargs):
        _state["serving"] += 1
        try:
            return route(*args, **kwargs)
        finally:
            _state["serving"] -= 1

    def route(*args, fused_lm_head: bool = False, **kwargs):
        head = model.get_output_embeddings() if fused_lm_head else None
        weight = getattr(head, "weight", None)
        partitioned = hasattr(weight, "ds_id")  # ZeRO-3: gathered inside the head's own call
        if head is None or weight is None or not (partitioned or _is_dtensor(weight)):
            return trl_forward(*args, fused_lm_head=fused_lm_head, **kwargs)
        if not partitioned and not isinstance(head, _fsdp_module()):
            _warn_once(f"{type(model).__name__}.lm_head's weight is a DTensor outside an FSDP2 "
                       "module of its own: TRL gathers it with full_tensor(), whose gradient is "
                       "not reduced over ranks; fusetune serves the gathered weight")  # fmt: skip
            return trl_forward(*args, fused_lm_head=True, **kwargs)
        ticket = _HeadTicket(head)
        outer = _HeadTicket.current
        _HeadTicket.current = ticket
        model.get_output_embeddings = lambda: ticket
        try:
            output = trl_forward(*args, fused_lm_head=True, **kwargs)
        finally:
            del model.get_output_embeddings
            _HeadTicket.current = outer
        if not ticket.used:
            raise RuntimeError(
                "fusetune: TRL's fused forward did not call its head function on the sharded "
                "lm_head (a TRL release fusetune does not know)"
            )
        return output

    setattr(model, _WRAPPED, trl_forward)
    model.forward = forward


def _trl_forward_models(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` carrying TRL's fused forward (the model, or PEFT's base model)."""
    found = []
    for candidate in (model, getattr(model, "get_base_model", lambda: None)()):
        forward = getattr(candidate, "__dict__", {}).get("forward")
        code = getattr(getattr(forward, "__func__", None), "__code__", None)
        if code is not None and code.co_name == "_fused_forward":  # functools.wraps keeps it
            found.append(candidate)
    return found


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
        for carrier in _trl_forward_models(model):
            _wrap_trl_forward(carrier)
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
        for carrier in (model, getattr(model, "get_base_model", lambda: None)()):
            if carrier is not None and _WRAPPED in carrier.__dict__:
                carrier.forward = carrier.__dict__.pop(_WRAPPED)
    delattr(trainer, _MARK)
    _state["trainers"] -= 1
    if _state["trainers"] == 0:
        import trl.trainer.utils as trl_utils

        trl_utils._ChunkedLogProbFunction = _state["original"]
        _state["original"] = None
    return trainer
