"""The model families :mod:`fusetune.integrations.transformers` patches, and the forwards it
puts in place of transformers' own. Every forward here keeps the signature and the outputs of
the one it replaces, and hands the call back to it where fusetune's op does not apply."""

from __future__ import annotations

import functools
import importlib
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from fusetune.ops.activation import geglu, swiglu
from fusetune.ops.linear_cross_entropy import linear_cross_entropy
from fusetune.ops.rms_norm import rms_norm
from fusetune.ops.rope import rope


@dataclass(frozen=True)
class Family:
    """What differs between the supported families (transformers 5.x class and attribute
    names). ``norm_casting`` None: the family normalises with LayerNorm, left to transformers."""

    model_type: str
    prefix: str  # class-name prefix: LlamaRMSNorm, LlamaMLP, LlamaForCausalLM
    norm_casting: str | None = "llama"  # fusetune.rms_norm's casting of the family's RMSNorm
    norm_eps: str = "variance_epsilon"  # the RMSNorm's eps attribute
    activation: str = "hidden_act"  # the config attribute the MLP builds act_fn from
    interleaved_rope: bool = False  # rotate pairs (2p, 2p + 1) (Cohere) instead of halves
    logit_softcap: str | None = None  # config attribute: c * tanh(logits / c) (Gemma 2)
    logit_scale: str | None = None  # model attribute: s * logits (Cohere)

    @property
    def modeling(self) -> ModuleType:
        return importlib.import_module(
            f"transformers.models.{self.model_type}.modeling_{self.model_type}"
        )

    def attribute(self, suffix: str):
        """The modeling module's ``{prefix}{suffix}`` (e.g. LlamaMLP), or None."""
        return getattr(self.modeling, f"{self.prefix}{suffix}", None)


FAMILIES = {
    family.model_type: family
    for family in (
        Family("llama", "Llama"),
        Family("mistral", "Mistral"),
        Family("qwen2", "Qwen2"),
        Family("qwen3", "Qwen3"),  # its q_norm / k_norm are Qwen3RMSNorm too
        Family(
            "gemma2",
            "Gemma2",
            norm_casting="gemma",
            norm_eps="eps",
            activation="hidden_activation",
            logit_softcap="final_logit_softcapping",
        ),
        # Cohere normalises with LayerNorm (mean subtracted): not an RMSNorm, left as it is.
        Family(
            "cohere", "Cohere", norm_casting=None, interleaved_rope=True, logit_scale="logit_scale"
        ),
    )
}

# ----------------------------------------------------------------------------- RMSNorm


def rms_norm_forward(family: Family) -> Callable:
    """An RMSNorm module's forward through fusetune.rms_norm with the family's casting:
    "llama" rounds the normalised value to the input dtype before the weight (LlamaRMSNorm),
    "gemma" stays in fp32 with (1 + weight) and rounds once (Gemma2RMSNorm)."""
    casting, eps_name = family.norm_casting, family.norm_eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, getattr(self, eps_name), casting=casting)

    return forward


# ----------------------------------------------------------------------------- MLP

# transformers' activation names (ACT2FN keys) whose gated MLP is a fused op.
GLU_BY_ACTIVATION = {
    "silu": "swiglu",
    "swish": "swiglu",
    "gelu": "geglu",
    "gelu_python": "geglu",
    "gelu_pytorch_tanh": "geglu_tanh",
    "gelu_python_tanh": "geglu_tanh",
    "gelu_new": "geglu_tanh",
    "gelu_fast": "geglu_tanh",
}
GLU_OPS = {
    "swiglu": swiglu,
    "geglu": geglu,
    "geglu_tanh": functools.partial(geglu, approximate="tanh"),
}


def glu_of(family: Family, mlp: torch.nn.Module) -> str | None:
    """The fused GLU for ``mlp`` from its config's activation name ("swiglu", "geglu",
    "geglu_tanh"), or None. A string lookup, so torch.compile traces it as a constant."""
    config = getattr(mlp, "config", None)
    return GLU_BY_ACTIVATION.get(getattr(config, family.activation, None))


def mlp_forward(family: Family, original: Callable) -> Callable:
    """A gated MLP's forward, ``down(act(gate(x)) * up(x))``, with the activation and the
    product fused (swiglu / geglu); an activation without a fused op goes to ``original``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        glu = glu_of(family, self)
        if glu is None:
            return original(self, x)
        return self.down_proj(GLU_OPS[glu](self.gate_proj(x), self.up_proj(x)))

    return forward


# ----------------------------------------------------------------------------- RoPE


def rope_function(family: Family, original: Callable) -> Callable:
    """``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` through fusetune.rope.
    unsqueeze_dim 1 means q, k are [B, H, T, D] (what the attention passes), 2 [B, T, H, D];
    cos, sin [B, T, R] with R <= D (partial rotary leaves the rest of each head as it is).
    Anything else (another signature's extra arguments, cos requiring grad) goes to
    ``original``."""
    extra_names = list(inspect.signature(original).parameters)[4:]
    interleaved = family.interleaved_rope

    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        options = dict(zip(extra_names, args, strict=False))
        options.update(kwargs)
        unsqueeze_dim = options.pop("unsqueeze_dim", 1)
        unusual = (
            len(args) > len(extra_names)
            or any(value is not None for value in options.values())
            or unsqueeze_dim not in (1, 2)
            or q.dim() != 4
            or k.dim() != 4
            or cos.dim() != 3
            or (torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad))
        )
        if unusual:
            return original(q, k, cos, sin, *args, **kwargs)
        layout = "BHTD" if unsqueeze_dim == 1 else "BTHD"
        return rope(q, k, cos, sin, layout=layout, interleaved=interleaved)

    return apply_rotary_pos_emb


# ----------------------------------------------------------------------------- causal LM


def _keep_last(hidden: torch.Tensor, logits_to_keep) -> torch.Tensor:
    """transformers 5.17's inline slicing (5.2x has slice_logits_to_keep)."""
    keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    return hidden[:, keep, :]


def _keep_positions_function() -> Callable:
    """Looked up when patching: an import that fails inside a traced forward is a graph
    break (Dynamo raises on the ImportError)."""
    try:
        from transformers.modeling_utils import slice_logits_to_keep
    except ImportError:
        return _keep_last
    return slice_logits_to_keep


def head_route(model: torch.nn.Module) -> tuple[torch.nn.Linear | None, bool, str | None]:
    """(lm_head, inside, reason) for the fused loss. ``inside``: the loss must run inside the
    head module's own call, so that the hooks a sharding engine put on it fire (FSDP2's
    ``fully_shard`` of the head, which swaps its class; DeepSpeed ZeRO-3's parameter hooks):
    they gather the weight before, free it after, and route its gradient to the engine's
    reduction. ``reason`` says why the fused loss cannot apply (head None): a head with a
    forward of its own (PEFT LoRA or modules_to_save), an accelerate offload hook, no Linear."""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, torch.nn.Linear):
        return None, False, f"lm_head is {type(head).__name__}, not an nn.Linear"
    if "forward" in head.__dict__ or hasattr(head, "_hf_hook"):
        return None, False, "lm_head has a forward of its own (an accelerate hook or a wrapper)"
    if type(head) is not torch.nn.Linear and type(head).forward is not torch.nn.Linear.forward:
        return None, False, f"lm_head is a {type(head).__name__} with its own forward"
    if _sharded(head):
        return head, True, None
    if head._forward_hooks or head._forward_pre_hooks:
        return None, False, "lm_head has forward hooks that are not FSDP2's or ZeRO-3's"
    if type(head) is not torch.nn.Linear:
        return None, False, f"lm_head is a {type(head).__name__}, not a plain nn.Linear"
    return head, False, None


def _sharded(module: torch.nn.Module) -> bool:
    """FSDP2's ``fully_shard`` applied to the module itself, or a DeepSpeed ZeRO-3 parameter."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        FSDPModule = ()  # noqa: N806
    return isinstance(module, FSDPModule) or hasattr(module.weight, "ds_id")


def _warn_fallback(model: torch.nn.Module, reason: str) -> None:
    """One warning per model and reason: the fused loss is not used."""
    warned = model.__dict__.setdefault("_fusetune_fallback_warned", set())
    if reason not in warned:
        warned.add(reason)
        warnings.warn(
            f"fusetune: {type(model).__name__} computes its loss through transformers' logits "
            f"path, not fusetune's fused linear cross-entropy: {reason}",
            stacklevel=3,
        )


def run_inside(module: torch.nn.Module, function: Callable, *args):
    """``function(*args)`` as ``module``'s forward for one call: the module's hooks (an
    engine's weight gathering, its gradient hooks) run around it as around its own forward.
    ``function`` reads the module's parameters while they are gathered."""
    module.forward = function
    try:
        return module(*args)
    finally:
        del module.forward


def causal_lm_forward(family: Family, original: Callable) -> Callable:
    """XForCausalLM.forward: with labels in training (or ``skip_logits=True``) the loss comes
    from fusetune.linear_cross_entropy on the final hidden states (the [B, T, V] logits never
    exist; ``logits`` is None); otherwise ``original`` runs unchanged (generation, evaluation
    with logits). The signature seen by inspect (Trainer, generate) is ``original``'s."""
    names = [
        name
        for name, parameter in list(inspect.signature(original).parameters.items())[1:]
        if parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD)
    ]

    from transformers.modeling_outputs import CausalLMOutputWithPast

    keep_positions = _keep_positions_function()

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        if len(args) > len(names):
            return original(self, *args, **kwargs)
        kwargs.update(zip(names, args, strict=False))
        skip_logits = kwargs.pop("skip_logits", None)
        wanted = self.training if skip_logits is None else skip_logits
        if kwargs.get("labels") is None or not wanted:
            return original(self, **kwargs)
        head, inside, reason = head_route(self)
        if head is None:
            _warn_fallback(self, reason)
            return original(self, **kwargs)
        return _fused_loss_forward(
            family, self, head, inside, keep_positions, CausalLMOutputWithPast, **kwargs
        )

    return forward


def _fused_loss_forward(
    family: Family,
    model,
    head: torch.nn.Linear,
    inside: bool,
    keep_positions: Callable,
    output_class: type,
    labels: torch.Tensor,
    logits_to_keep=0,
    return_dict: bool | None = None,
    **kwargs,
):
    """The causal-LM forward of transformers 5.x with ForCausalLMLoss replaced by the fused
    loss. Like transformers, every other keyword goes to the base model and to the loss
    (num_items_in_batch: sum / num_items for gradient accumulation; shift_labels: labels
    already shifted; ignore_index)."""
    outputs = getattr(model, model.base_model_prefix)(**kwargs)
    hidden = keep_positions(outputs.last_hidden_state, logits_to_keep)
    shift_labels = kwargs.get("shift_labels")
    targets = labels if shift_labels is None else shift_labels

    def loss_of(hidden: torch.Tensor) -> torch.Tensor:
        return linear_cross_entropy(
            hidden,
            head.weight,
            targets.to(hidden.device),
            head.bias,
            shift=shift_labels is None,
            ignore_index=kwargs.get("ignore_index", -100),
            logit_softcap=getattr(model.config, family.logit_softcap)
            if family.logit_softcap
            else None,
            logit_scale=getattr(model, family.logit_scale) if family.logit_scale else None,
            num_items=kwargs.get("num_items_in_batch"),
        )

    loss = run_inside(head, loss_of, hidden) if inside else loss_of(hidden)
    output = output_class(
        loss=loss,
        logits=None,
        past_key_values=outputs.past_key_values,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
    )
    if return_dict is None:
        return_dict = getattr(model.config, "return_dict", True)
    return output if return_dict else output.to_tuple()
