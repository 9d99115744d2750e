"""The model families :mod:`fusetune.integrations.transformers` patches, and the forwards it
puts in place of transformers' own. Every forward here keeps the signature and the outputs of
the one it replaces, and hands the call back to it where fusetune's op does not apply."""

from __future__ import annotations

import functools
import importlib
import inspect
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


def plain_head(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The model's lm_head when the fused loss can stand in for it: an nn.Linear with no hooks
    and no forward of its own (a PEFT LoRA or modules_to_save wrapper, or an accelerate
    offload hook, keeps transformers' path)."""
    head = getattr(model, "lm_head", None)
    if (
        type(head) is not torch.nn.Linear
        or head._forward_hooks
        or head._forward_pre_hooks
        or "forward" in head.__dict__
    ):
        return None
    return head


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
        head = plain_head(self)
        if kwargs.get("labels") is None or not wanted or head is None:
            return original(self, **kwargs)
        return _fused_loss_forward(
            family, self, head, keep_positions, CausalLMOutputWithPast, **kwargs
        )

    return forward


def _fused_loss_forward(
    family: Family,
    model,
    head: torch.nn.Linear,
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
    loss = linear_cross_entropy(
        hidden,
        head.weight,
        targets.to(hidden.device),
        head.bias,
        shift=shift_labels is None,
        ignore_index=kwargs.get("ignore_index", -100),
        logit_softcap=getattr(model.config, family.logit_softcap) if family.logit_softcap else None,
        logit_scale=getattr(model, family.logit_scale) if family.logit_scale else None,
        num_items=kwargs.get("num_items_in_batch"),
    )
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
